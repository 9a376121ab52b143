"""Fuzzing the stored bytes of every registered quantizer's caches (issue 13,
item 5): Hypothesis flips bits, truncates, extends, retypes and drops stored
fields, and miscounts segment tokens. `decode` must then either raise
QuantizerInputError (CorruptPackedError names what is wrong) or return finite
values of the cache's shape; never garbage of another shape, NaN/Inf, or a bare
IndexError. Runs on every example config of every registered quantizer (the
`quantizer_spec` fixture), out-of-tree plugins included; a few seconds each."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvqbench.quantizers import QuantizerInputError, get_quantizer
from kvqbench.suites.conformance import head_dim_for, reference_tensor

pytestmark = pytest.mark.conformance

EXAMPLES = 40  # per config: bounded for CI, and each example decodes a small cache
RETYPES = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.int32, torch.float32, torch.int64)
_caches = {}


def written_cache(spec: str):
    """(quantizer, packed): 160 tokens written as a 150-token prefill then ten
    one-token decode steps (past KIVI's 128-token window, so quantized groups and an
    fp16 window are both stored)."""
    if spec not in _caches:
        q = get_quantizer(spec, role="K", layer=1, seed=2)
        x = reference_tensor(head_dim_for(spec), tokens=160, heads=2, batch=1, seed=4, outlier_channels=(1,))
        packed = q.encode(x[:, :, :150])
        for t in range(150, 160):
            packed = q.append(packed, x[:, :, t : t + 1])
        _caches[spec] = (q, packed)
    return _caches[spec]


def _flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    raw = t.contiguous().clone().view(torch.uint8).view(-1)
    raw[byte % raw.numel()] ^= 1 << bit
    return raw.view(t.dtype).view(t.shape)


def _resize(t: torch.Tensor, axis: int, new_len: int) -> torch.Tensor:
    axis %= t.dim()
    if new_len <= t.shape[axis]:
        return t.narrow(axis, 0, new_len).clone()
    pad = list(t.shape)
    pad[axis] = new_len - t.shape[axis]
    return torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim=axis)


def _retype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype.itemsize == dtype.itemsize:  # reinterpret the same bytes
        return t.contiguous().view(dtype)
    return t.to(dtype)  # or convert the values


@st.composite
def mutations(draw, packed):
    """A copy of `packed` with one thing wrong, and a description of it."""
    places = [(i, name) for i, seg in enumerate(packed.segments) for name in seg.fields]
    places += [(None, name) for name in packed.shared]
    i, name = draw(st.sampled_from(places))
    t = packed.shared[name] if i is None else packed.segments[i].fields[name]
    ops = ["truncate", "extend", "retype", "drop"] + (["flip", "flip", "flip"] if t.numel() else [])
    ops += ["tokens"] if i is not None else []
    op = draw(st.sampled_from(ops))
    fields = dict(packed.shared if i is None else packed.segments[i].fields)
    tokens = None
    if op == "flip":
        fields[name] = _flip(t, draw(st.integers(0, 1 << 30)), draw(st.integers(0, 7)))
    elif op in ("truncate", "extend") and t.dim():
        axis = draw(st.integers(0, t.dim() - 1))
        n = t.shape[axis]
        new_len = draw(st.integers(0, max(0, n - 1))) if op == "truncate" else draw(st.integers(n + 1, n + 9))
        fields[name] = _resize(t, axis, new_len)
    elif op == "retype":
        fields[name] = _retype(t, draw(st.sampled_from([d for d in RETYPES if d != t.dtype])))
    elif op == "drop":
        del fields[name]
    elif op == "tokens":
        tokens = max(0, packed.segments[i].tokens + draw(st.sampled_from([-33, -1, 1, 31])))
    what = f"{op} {name!r} of {'shared' if i is None else f'segment {i}'}"
    if i is None:
        return dataclasses.replace(packed, shared=fields), what
    seg = packed.segments[i]
    new = dataclasses.replace(seg, fields=fields, tokens=seg.tokens if tokens is None else tokens, _decoded=None)
    segs = list(packed.segments)
    segs[i] = new
    return dataclasses.replace(packed, segments=segs), what


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_corrupt_stored_bytes_raise_or_decode_finite(quantizer_spec, data):
    q, packed = written_cache(quantizer_spec)
    bad, what = data.draw(mutations(packed))
    try:
        y = q.decode(bad)
    except QuantizerInputError as e:
        assert str(e), what
        return
    assert tuple(y.shape) == bad.shape, f"{what}: decoded shape {tuple(y.shape)}, cache shape {bad.shape}"
    assert torch.isfinite(y).all(), f"{what}: decoded NaN/Inf without an error"


def test_the_written_cache_decodes(quantizer_spec):
    """The fuzz targets start valid: decode of the untouched cache is finite."""
    q, packed = written_cache(quantizer_spec)
    y = q.decode(dataclasses.replace(packed, segments=[dataclasses.replace(s, _decoded=None)
                                                       for s in packed.segments]))
    assert y.shape == packed.shape and torch.isfinite(y).all()
