#!/usr/bin/env bash
# One GPU call for the decode engine (the `run` tool's machine; suites/bench/gpu_env.sh
# sets up the environment): the CUDA-graph decode-step tests, then the decode benchmark
# (eager and graph runs) into $OUT/decode/{decode.json,decode.md,decode.png} plus logs.
# usage: bash suites/bench/decode/gpu_decode.sh [test seconds] [bench seconds] [bench args...]
# Default bench: the issue-9 target shapes (ctx 4096 batch 1, ctx 32768 batch 8), every
# default cache. Each phase runs under `timeout`; the JSON is saved after every row.
T_TEST=${1:-100}; T_BENCH=${2:-330}; shift 2 || true
source "$(dirname "$0")/../gpu_env.sh"
export PYTHONUNBUFFERED=1
timeout -s INT "$T_TEST" $PY -m pytest -q -rf -x -n 4 -p no:cacheprovider suites/tests/test_graph_step.py \
  2>&1 | tee "$OUT/tests.log" | grep -vE "^(SKIPPED|PASSED|USDT)" | tail -25
echo "tests done at $(( $(date +%s) - t0 )) s"
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -eq 0 ] && BENCH_ARGS=(--pairs 4096:1 32768:8)
timeout "$T_BENCH" $PY -m kvqbench.suites.bench.decode --out "$OUT/decode" "${BENCH_ARGS[@]}" 2>&1 \
  | tee "$OUT/bench.log" | grep -v USDT | cut -c1-400 | tail -40
echo "all done at $(( $(date +%s) - t0 )) s"
