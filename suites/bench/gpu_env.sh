# Sourced by the GPU scripts (suites/bench/cuda/gpu_run.sh, cuda/hqmq_gpu_run.sh,
# decode/gpu_decode.sh, gpu_compare.sh), from the repository root: the environment of one
# GPU call. The package goes on PYTHONPATH through a symlinked kvqbench/ (no install step
# on a bare machine), the build cache under /tmp; prints the GPU, versions and date into
# $OUT/env.txt. Run pytest under `timeout -s INT`: cut short by SIGINT it still prints its
# summary (the failures' names); the default SIGTERM lost them (2026-12-07).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PP=/tmp/pp; mkdir -p $PP/kvqbench
for d in kernels quantizers suites; do ln -sfn "$PWD/$d" $PP/kvqbench/$d; done
export PYTHONPATH=$PP TORCH_EXTENSIONS_DIR=/tmp/kvq_ext PYTHONDONTWRITEBYTECODE=1
# libraries built on the CPU machine (`python -m kvqbench.suites.bench.gpu_prebuild`, carry
# .gpubuild): a fresh machine then spends no device time in nvcc; a library whose hash
# (source, flags, nvcc version) differs from the prebuilt ones is built here as before
[ -d .gpubuild/kvqbench_cuda_decode ] && export TORCH_EXTENSIONS_DIR=$PWD/.gpubuild
# the commit measured: that machine's copy of the tree keeps a stale .git, so the caller writes
# `git rev-parse HEAD > .gpu_commit` (ignored; name it in the call's carry) and results record it
[ -f .gpu_commit ] && export KVQBENCH_COMMIT=$(cat .gpu_commit)
PY=${PYTHON:-python}
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2; date -u; } 2>&1 | tee "$OUT/env.txt"
XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n 8"
t0=$(date +%s)
