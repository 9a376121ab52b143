#!/usr/bin/env bash
# One GPU call (kernels/NOTES.md, "CUDA decode kernels"): the package on PYTHONPATH
# through a symlinked kvqbench/ (pip install -e . gave no importable package there),
# tests first, then the bench; logs and JSON under $OUT.
# usage: bash kernels/cuda/gpu_run.sh [test seconds] [bench seconds] [bench args...]
set -u
T_TEST=${1:-70}; T_BENCH=${2:-60}; shift 2 || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PP=/tmp/pp; mkdir -p $PP/kvqbench
for d in kernels quantizers suites; do ln -sfn "$PWD/$d" $PP/kvqbench/$d; done
export PYTHONPATH=$PP TORCH_EXTENSIONS_DIR=/tmp/kvq_ext PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python}
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2; date -u; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
$PY -c "from kvqbench.kernels import cuda_decode as c; print('why_unavailable:', c.why_unavailable()); print('regs', {v: c.num_regs(0, 128, v) for v in range(c.NUM_VARIANTS)}, {v: c.num_regs(1, 128, v) for v in range(c.NUM_VARIANTS)})" 2>&1 | tail -5 | tee "$OUT/build.txt"
echo "build+load $(( $(date +%s) - t0 )) s"
XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n 8"
timeout "$T_TEST" $PY -m pytest -q $XD suites/tests/test_cuda_decode.py suites/tests/test_kernels.py -k "${TEST_K:-not nothing}" -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests.log" | grep -vE "^(SKIPPED|PASSED)" | tail -30
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout "$T_BENCH" $PY kernels/cuda/bench.py --out "$OUT" "$@" 2>&1 | tail -70
echo "all done at $(( $(date +%s) - t0 )) s"
