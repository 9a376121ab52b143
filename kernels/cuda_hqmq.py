"""Temporary alias (issue 26): this module moved to kvqbench.kernels.cuda.hqmq_decode.
The benchmarks under suites/bench/ and kernels/cuda/hqmq_bench.py import the old path until
the benchmark toolkit moves them; the name is then removed. The alias is the module itself
(monkeypatching either path patches both)."""
import sys

from .cuda import hqmq_decode

sys.modules[__name__] = hqmq_decode
