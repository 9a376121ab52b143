"""Reading a fused cache's device-written segments probes no shape on the host.

A segment is checked against the fields its quantizer stores for its shape
(`Quantizer.segment_layout`), learnt from this process's writes, else by encoding zeros of
that shape on the host. Device-encoded writes (a fused cache's prefill, its one-token
steps) bypass `encode_tokens`, so before `learn_layout` every new prompt length made the
first read encode zeros (and a heavy-tailed probe) of the whole write on the host: on an
H100 a 32768 x 8-token prefill of the decode benchmark took 8.7 s for int4 and 48 s for
HQMQ (2026-12-06). Now the layer learns each run's layout (suites/harness/kv_cache.py
`_run_segments`) and the data-dependence probe is at most `PROBE_TOKENS` tokens of one row.

CPU: the kernels run under the Triton interpreter, tiny shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.quantizers import base  # noqa: E402
from kvqbench.quantizers.base import Quantizer  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("spec", ["int4", "hqmq:S=8,r=4", "hqmq:S=8,r=4,outliers=med3", "kivi:bits=2,group=8,residual=8"])
def test_reading_device_writes_encodes_nothing_of_their_shape(spec, monkeypatch):
    monkeypatch.setattr(Quantizer, "_layouts", {})  # nothing learnt before (other tests' writes)
    monkeypatch.setattr(base, "PROBE_TOKENS", 8)  # (a short probe: the interpreter's writes stay small)
    T = base.PROBE_TOKENS + 16
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, T + 3, 64, generator=g).to(DEV, torch.float16) for _ in range(2))
    layer = QuantizedLayer(spec, 0, seed=0)
    layer.fused_wanted, layer.prefill = True, "quantized"  # the prefill's attention reads the cache
    probes = []
    cls = type(layer.quantizers["K"])
    encode = cls.encode_tokens

    def spy(self, x, shared):
        probes.append(tuple(x.shape))
        return encode(self, x, shared)

    monkeypatch.setattr(cls, "encode_tokens", spy)
    with torch.inference_mode():
        layer.update(k[:, :, :T], v[:, :, :T])  # the device prefill and its transient read
        assert layer.mode == "fused"
        for t in range(T, T + 3):  # one-token device steps, then a read of their run
            layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        dense = layer.read("K")
    assert dense.shape[2] == T + 3
    # what may run on the host: the one-row data-dependence probe, and one-token layouts
    assert all(s[0] == 1 and s[2] <= base.PROBE_TOKENS or s[2] == 1 for s in probes), probes
