"""Temporary alias (issue 26): this module moved to kvqbench.kernels.cuda.decode_attention.
The benchmarks under suites/bench/ and kernels/cuda/bench.py import the old path until the
benchmark toolkit moves them; the name is then removed. The alias is the module itself
(monkeypatching either path patches both)."""
import sys

from .cuda import decode_attention

sys.modules[__name__] = decode_attention
