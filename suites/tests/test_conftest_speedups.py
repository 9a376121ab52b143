"""conftest.py's two speed-ups change nothing a test checks, and are in place:

- `_run_each_test_in_a_roomy_frame`: every test runs inside one large frame, so Python
  3.11's frame stack never maps and unmaps a chunk per call in a hot loop;
- `_patch_the_interpreter_once_per_launch`: under the Triton interpreter a @triton.jit
  helper called inside a kernel skips re-patching the language modules its launch
  already patched; the kernels compute the same outputs and store the same bytes with it
  on and off (the decode attention, the device step encoders: int groups, HQMQ's search,
  Med3x's outliers).

`KVQBENCH_PLAIN_PYTEST=1` turns both off (to measure what they save): these tests skip then.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if os.environ.get("KVQBENCH_PLAIN_PYTEST") == "1":
    pytest.skip("KVQBENCH_PLAIN_PYTEST=1: conftest.py's speed-ups are off", allow_module_level=True)

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the interpreter patch applies under the Triton interpreter only")


def test_this_test_runs_inside_the_roomy_frame():
    import _pytest.runner as runner

    assert hasattr(runner.runtestprotocol, "roomy"), "conftest.py no longer wraps _pytest.runner.runtestprotocol"
    f = sys._getframe()
    while f is not None and f.f_code is not runner.runtestprotocol.roomy.__code__:
        f = f.f_back
    assert f is not None, "the test does not run below conftest.py's roomy frame"
    assert f.f_code.co_nlocals >= 16000


def _memo():
    it = pytest.importorskip("triton.runtime.interpreter", reason="triton is not installed")
    memo = getattr(it._patch_lang, "memo", None)
    assert memo is not None, "conftest.py's interpreter patch is not installed (did Triton's interpreter change?)"
    return memo


def _run_kernels(spec):
    """Outputs of the fused kernels on a small cache of `spec`: a fused layer's prefill and
    two decode steps (encoded on the device), its stored bytes, and a decode attention."""
    from kvqbench.kernels import layout as L
    from kvqbench.kernels.decode_attention import decode_attention
    from kvqbench.suites.harness.kv_cache import QuantizedLayer

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 2, 12, 32, generator=g)
    x[..., 3] *= 8  # a hot channel (Med3x outliers)
    layer = QuantizedLayer(spec, 1, seed=0)
    layer.fused_wanted = True
    with torch.inference_mode():
        layer.update(x[0, :, :, :10], x[1, :, :, :10])
        for t in (10, 11):
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
        flats = [L.flatten(layer.packed[r], r) for r in ("K", "V")]
        q = torch.randn(2, 4, 1, 32, generator=g)
        out = decode_attention(q, *flats, out_dtype=torch.float32, num_splits=2)
    assert layer.mode == "fused" and all(s.in_run for s in layer.stores.values())
    return out, [layer.packed[r].digest() for r in ("K", "V")], [layer.read(r) for r in ("K", "V")]


@interpreter_only
@pytest.mark.parametrize("spec", ["int4", "hqmq:S=8,r=4,outliers=med3"])
def test_kernels_compute_the_same_with_and_without_the_interpreter_patch(spec):
    memo = _memo()
    results, skipped = {}, {}
    try:
        for enabled in (False, True):
            memo.enabled = enabled
            n0 = getattr(memo, "skipped", 0)
            results[enabled] = _run_kernels(spec)
            skipped[enabled] = getattr(memo, "skipped", 0) - n0
    finally:
        memo.enabled = True
    assert skipped[False] == 0 and skipped[True] > 0, skipped  # off: every re-patch ran; on: re-patches skipped
    (out0, dig0, read0), (out1, dig1, read1) = results[False], results[True]
    assert torch.equal(out0, out1)
    assert dig0 == dig1
    assert all(torch.equal(a, b) for a, b in zip(read0, read1))


@interpreter_only
def test_the_language_is_restored_after_a_launch():
    """After a launch, triton.language's builtins are the originals again, as without the
    patch (the launch's own patch scope undoes them)."""
    import triton.language as tl

    _memo()
    before = {name: getattr(tl, name) for name in ("where", "load", "store", "sum", "arange")}
    _run_kernels("int4")
    assert {name: getattr(tl, name) for name in before} == before
