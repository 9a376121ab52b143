#!/usr/bin/env bash
# One GPU call for the CUDA HQMQ kernel (reports/kernels/NOTES.md, "CUDA HQMQ decode"): package on
# PYTHONPATH through a symlinked kvqbench/ (gpu_env.sh), build, the whole test file (no -x:
# every failure shows; the slowest tests listed for the next trim), bench.
# usage: bash suites/bench/cuda/hqmq_gpu_run.sh [test seconds] [bench seconds] [bench args...]
# Call 17b (cold machine) cut the 64-test file at 100 s after 33 passed: give it 180 s. The
# first test of each xdist worker paid ~25-48 s in call 17a (Triton compiles of the encoder
# in 8 workers at once): one encode per spec first puts them in the shared Triton cache.
T_TEST=${1:-180}; T_BENCH=${2:-100}; shift 2 || true
source "$(dirname "$0")/../gpu_env.sh"
$PY -c "from kvqbench.kernels.cuda import hqmq_decode as c; print('why_unavailable:', c.why_unavailable()); n = range(c.NUM_VARIANTS); print('regs', {v: c.num_regs(v, 96) for v in n}, {v: c.num_regs(v, 170) for v in n}); print('CTAs/SM', {v: c.occupancy(v, 96) for v in n}, {v: c.occupancy(v, 170) for v in n})" 2>&1 | tail -5 | tee "$OUT/build.txt"
echo "build+load $(( $(date +%s) - t0 )) s"
$PY -c "
import torch
from kvqbench.quantizers import get_quantizer
x = torch.randn(1, 2, 100, 128, device='cuda').half()
for spec in ('hqmq:S=96,r=4', 'hqmq:S=96,r=4,outliers=med3'):
    for role in ('K', 'V'):
        q = get_quantizer(spec, role=role, seed=3); q.decode(q.encode(x))
" 2>&1 | tail -3 || true
echo "encoder warm-up done at $(( $(date +%s) - t0 )) s"
# -v: one line per test in tests.log, so a run cut by the limit still says which passed
# (call 17b's -q dots did not); the summary shows failures and the slowest tests
timeout -s INT "$T_TEST" $PY -m pytest -v -rfE --durations=12 $XD suites/tests/test_cuda_hqmq.py -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests.log" | grep -vE "(PASSED|SKIPPED|PytestBenchmarkWarning|warner\()" | tail -40
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout "$T_BENCH" $PY -m kvqbench.suites.bench.cuda.hqmq_bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -100
echo "all done at $(( $(date +%s) - t0 )) s"
