"""The kernel sweep: one GPU call checks every fused decode kernel against the
reference and times launch-config variants of each at the issue-10 shapes beside
fp16 SDPA and the copy bandwidth measured in the same run (`measure.py`); the JSON
it writes is rendered into reports/latency/kernels.{md,json,png} with the issue-10
targets and a roofline-style plot (`render.py`). reports/kernels/NOTES.md records its runs.

    python -m kvqbench.suites.bench.kernel_sweep run --out $OUT [--shapes 8x32768,1x32768]
    python -m kvqbench.suites.bench.kernel_sweep render $OUT/bench_kernels.json --out reports/latency

The latency suite (`suites/bench/latency/`) is the broader, tuned measurement
(more shapes, the fake-quant pipeline, encode throughput); this sweep is the
kernel engineer's quick loop.
"""
