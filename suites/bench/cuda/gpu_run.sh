#!/usr/bin/env bash
# One GPU call (reports/kernels/NOTES.md, "CUDA decode kernels"): the package on PYTHONPATH
# through a symlinked kvqbench/ (gpu_env.sh: no install step on a bare machine),
# tests first, then the bench (bench.py beside this file); logs and JSON under $OUT.
# usage: bash suites/bench/cuda/gpu_run.sh [test seconds] [bench seconds] [bench args...]
# Defaults: the CUDA decode tests (int4, fp8, KIVI-2/4 with backend="cuda", the device valid
# length and its graph replay) plus the int4 / fp8 / KIVI tests of test_kernels.py (TEST_K),
# then the bench of int4, fp8, KIVI-2, KIVI-4 (CUDA and Triton) beside fp16 SDPA at B=8 and
# B=1, T=32k: ~30 s build + <= 150 + <= 60 s (run 17: the whole test file took 63 s at -n 8
# without the T = 131072 tests and did not finish in 90 s at -n 14; the bench ~15-20 s).
# `bash suites/bench/cuda/gpu_run.sh 75 55 --methods kivi2,kivi4` times KIVI only; bench seconds 0
# skips the bench; TEST_FILES replaces the test files, PYTEST_N the number of xdist workers.
# KIVI variants (NOTES.md, "GPU calls 20a-20d"; 10, 11 are refused): the variant tests, then the
# listed variants at the default split rule and at 8 CTAs/SM beside same-run SDPA (~3-4 min):
#   TEST_FILES=suites/tests/test_cuda_decode.py TEST_K="kivi_splits_and_variants or 131072" \
#   bash suites/bench/cuda/gpu_run.sh 100 90 --methods kivi2,kivi4 --kivi-variants 4,8,12 --kivi-ctas default,8
# NCU="kivi2,kivi4" (optional): then Nsight Compute on one call of each at B=8, T=32k (kernels
# whose MANGLED name matches NCU_K (the plain name is split_kernel for all), default the KIVI
# and int4 split kernels; sections NCU_SECTIONS)
# into $OUT/ncu.txt, within NCU_S seconds (default 60).
T_TEST=${1:-150}; T_BENCH=${2:-60}; shift 2 || true
source "$(dirname "$0")/../gpu_env.sh"
[ -n "${PYTEST_N:-}" ] && [ -n "$XD" ] && XD="-n $PYTEST_N"  # more xdist workers than gpu_env.sh's 8
$PY -c "from kvqbench.kernels.cuda import decode_attention as c; print('why_unavailable:', c.why_unavailable()); print('regs', {v: c.num_regs(0, 128, v) for v in range(c.NUM_VARIANTS)}, {v: c.num_regs(1, 128, v) for v in range(c.NUM_VARIANTS)}); print('kivi regs', {b: [c.num_regs_kivi(b, False, v) for v in c.KIVI_VARIANTS] for b in (2, 4)}, 'CUDA_VERIFIED', sorted(c.CUDA_VERIFIED))" 2>&1 | tail -5 | tee "$OUT/build.txt"
echo "build+load $(( $(date +%s) - t0 )) s"
timeout -s INT "$T_TEST" $PY -m pytest -q -rf $XD ${TEST_FILES:-suites/tests/test_cuda_decode.py suites/tests/test_kernels.py} -k "${TEST_K:-int4 or fp8 or kivi or cuda or auto or splits or unsupported or backend or valid_len or plan}" -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests.log" | grep -vE "^(SKIPPED|PASSED)" | tail -30
echo "tests done at $(( $(date +%s) - t0 )) s"
if [ "${NCU:-}" ]; then
  NCUB=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "${NCU_S:-60}" $NCUB --clock-control none --kernel-name-base mangled -k "regex:${NCU_K:-KiviQ|Int4}" \
    ${NCU_SECTIONS:---section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy} \
    $PY -m kvqbench.suites.bench.cuda.bench --once --methods "$NCU" --shapes 8x32768 > "$OUT/ncu.txt" 2>&1
  echo "ncu rc $? at $(( $(date +%s) - t0 )) s"; grep -E "split_kernel|Throughput|Duration|Hit Rate|Stall|Achieved Occ|Mem Busy|Max Bandwidth|L1/TEX|Warp Cycles" "$OUT/ncu.txt" | head -80
fi
[ "$T_BENCH" != 0 ] && timeout "$T_BENCH" $PY -m kvqbench.suites.bench.cuda.bench --out "$OUT" "$@" 2>&1 | tail -70
echo "all done at $(( $(date +%s) - t0 )) s"
