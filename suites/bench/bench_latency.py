"""pytest-benchmark entry points of the latency suite (GPU only; `pytest -m bench`).

The fused kernels and fp16 SDPA at the focus shape (B=8, T=32k, Hq 32, Hkv 8,
d 128): each format as shipped (decode_attention, backend="auto": CUDA where the
dispatcher routes it) and as the Triton kernel at its defaults; and the whole report as `python -m kvqbench.suites.bench.latency` writes
it (into $KVQBENCH_LATENCY_OUT or a temp folder). The measurement itself lives
in the package `kvqbench.suites.bench.latency`; its kernel-importing modules are
imported inside the fixtures, so that collecting this file on a CPU machine
imports no kernels (test_kernels.py sets TRITON_INTERPRET before they are).
"""
from __future__ import annotations

import os

import pytest
import torch

from kvqbench.suites.bench.latency.config import DEFAULT_LAUNCH, FUSED_SPECS, LatencyConfig

FULL = LatencyConfig.full()
pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="latency benchmarks need a CUDA GPU")]


def _query(B: int) -> torch.Tensor:
    return torch.randn(B, FULL.hq, 1, FULL.d, device="cuda").half()


@pytest.fixture(scope="module")
def caches():
    from kvqbench.suites.bench.latency.caches import encode_caches

    return encode_caches("cuda", FULL.hkv, FULL.t0, FULL.d)


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("method", list(FUSED_SPECS))
def test_fused_decode_latency(benchmark, caches, method, backend):
    from kvqbench.suites.bench.latency.caches import tiled
    from kvqbench.suites.bench.latency.methods import fused_callable, shipped_callable

    kf, vf = tiled(caches[method], *FULL.focus)
    q = _query(FULL.focus[0])
    fn = shipped_callable(q, kf, vf) if backend == "auto" else fused_callable(q, kf, vf, DEFAULT_LAUNCH)
    fn()
    torch.cuda.synchronize()
    benchmark(lambda: (fn(), torch.cuda.synchronize()))


def test_fp16_sdpa_latency(benchmark):
    from kvqbench.suites.bench.latency.methods import sdpa_callable

    B, T = FULL.focus
    k = torch.randn(B, FULL.hkv, T, FULL.d, device="cuda").half()
    fn, _, _ = sdpa_callable(_query(B), k, torch.randn_like(k))
    benchmark(lambda: (fn(), torch.cuda.synchronize()))


def test_latency_report(tmp_path):
    """The whole report, as the command line writes it."""
    from kvqbench.suites.bench.latency.__main__ import main

    res = main(["--out", os.environ.get("KVQBENCH_LATENCY_OUT", str(tmp_path))])
    assert any("latency_us" in r for r in res["latency"])
