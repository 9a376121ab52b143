"""CPU encode/decode time of every registered quantizer's example configs
(pytest-benchmark; marked `bench`, so skipped unless `-m bench`).

    pytest -m bench --benchmark-enable suites/bench/bench_quantizers.py --benchmark-autosave
    pytest -m bench --benchmark-enable suites/bench/bench_quantizers.py \\
        --benchmark-compare --benchmark-compare-fail=mean:10%

One write of a seeded `[1, 2, 256, d]` key tensor (two outlier channels) into an
empty packed store whose shared tensors (codebooks) exist already, as for every
write after a layer's first; decode is `decode_tokens` of what it stored (the
work `Quantizer.decode` does before it memoises a segment). One thread, so
figures are comparable run to run. No Hypothesis here: its repeated examples
and the benchmark fixture's repeated rounds do not mix (property tests live in
test_properties.py).
"""
from __future__ import annotations

import pytest
import torch

from kvqbench.quantizers import get_quantizer
from kvqbench.suites.conformance import all_example_specs, head_dim_for

pytestmark = [pytest.mark.bench, pytest.mark.usefixtures("one_thread")]  # one_thread: see conftest.py
SPECS = ["fp16"] + [s for s in all_example_specs() if s != "fp16"]


def _setup(spec: str):
    d = head_dim_for(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 256, d, generator=g)
    x[..., 1] *= 20.0
    x[..., 35] *= 20.0
    q = get_quantizer(spec, role="K", layer=0, seed=0)
    empty = q.empty(x)
    return q, x, empty, q.append(empty, x)


@pytest.mark.parametrize("spec", SPECS)
def test_encode(benchmark, spec):
    q, x, empty, packed = _setup(spec)
    benchmark.group = "encode [1, 2, 256, d]"
    benchmark.extra_info["bits_per_element"] = packed.bits_per_element
    benchmark.extra_info["cache_bits_per_element"] = packed.cache_bits_per_element
    out = benchmark(q.append, empty, x)
    assert out.nbytes == packed.nbytes


@pytest.mark.parametrize("spec", SPECS)
def test_decode(benchmark, spec):
    q, x, _, packed = _setup(spec)
    benchmark.group = "decode [1, 2, 256, d]"

    def decode():
        return [q.decode_tokens(s, packed.shared, (packed.batch, packed.heads, s.tokens, packed.head_dim))
                for s in packed.segments]

    parts = benchmark(decode)
    assert sum(p.shape[2] for p in parts) == x.shape[2]
