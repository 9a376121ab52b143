"""HQMQ Med3x's median at a decode step (`median=`, quantizers/hqmq.py module docstring):

- the option parses and validates (unknown values name the allowed ones; median=prefill
  without outliers=med3 is refused);
- "write" (the default) takes each write's own median: unchanged bytes, nothing kept;
- "prefill" keeps the prefill's median per (b, h) (fp16, rounded toward zero) and codes
  later writes with C * max(kept, the write's own median): the flags of a decode token are
  checked against radii computed by hand (a small token with two moderate chunks: "write"
  flags them, "prefill" does not; a token scaled x10: both flag per their rule; a token
  with one hot chunk: flagged under both); the prefill's bytes equal "write"'s;
- the kept median is counted in the measured bits: exactly 16 bits per (b, h) per (layer,
  role) more than "write" over the same tokens (same segments);
- the fused store declines device writes for "prefill" (`device_refusal`): no launch, no
  stepper, `graph_unsupported` says why, and the fused cache holds the reference path's
  bytes (a prefill, steps and a chunk).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.quantizers.packing import unpack_bits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

WRITE = "hqmq:S=24,r=4,outliers=med3"
PREFILL = WRITE + ",median=prefill"
B, H, D = 2, 2, 32
NC = D // 4


def _prompt(T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g).half()


def _flags(seg):
    return unpack_bits(seg.fields["flags"], 1, NC).bool()  # [B, H, T, nc]


def _radii(x):
    return x.float().reshape(*x.shape[:3], NC, 4).norm(dim=-1)


def test_option_parses_and_validates():
    assert get_quantizer(WRITE).config.median == "write"
    q = get_quantizer(PREFILL)
    assert q.config.median == "prefill" and q.keeps_median and "median=prefill" in q.spec
    with pytest.raises(QuantizerInputError, match="write, prefill"):
        get_quantizer(WRITE + ",median=token")
    with pytest.raises(QuantizerInputError, match="needs outliers=med3"):
        get_quantizer("hqmq:S=24,r=4,median=prefill")
    assert "r_med" not in get_quantizer(WRITE).make_shared(H, D)


def _decode_step(spec, prompt, token):
    q = get_quantizer(spec, layer=0, role="K", seed=0)
    p = q.encode(prompt)
    return q, p, q.append(p, token)


def _expected(prompt, token, spec):
    """Flags of `token` by hand: C * median of its own radii, or of max(kept, its own)."""
    r_tok = _radii(token)  # [B, H, 1, nc]
    own = r_tok.reshape(B, H, -1).median(-1).values
    if "prefill" in spec:
        m = _radii(prompt).reshape(B, H, -1).median(-1).values
        h = m.half()
        kept = torch.where(h.float() > m, (h.view(torch.int16) - 1).view(torch.float16), h).float()
        assert (kept <= m).all() and ((m - kept) <= m * 2 ** -10).all()
        own = torch.maximum(own, kept)
    return (r_tok > 3.0 * own.view(B, H, 1, 1)) & (r_tok > 0)


def test_decode_step_flags_follow_the_max_rule():
    prompt = _prompt()
    g = torch.Generator().manual_seed(1)
    base = torch.randn(B, H, 1, D, generator=g)
    small = base * 0.05  # a small token with two chunks of a typical radius: large only against itself
    small[..., 0:4] = base[..., 0:4] * 0.6
    small[..., 8:12] = base[..., 8:12] * 0.6
    big = base * 10  # every chunk large against the prompt, none against itself
    hot = base.clone()  # one hot chunk: large against both
    hot[..., 4:8] *= 30
    cases = {"small": small.half(), "big": big.half(), "hot": hot.half()}
    got = {}
    for name, tok in cases.items():
        for spec in (WRITE, PREFILL):
            q, p, p2 = _decode_step(spec, prompt, tok)
            flags = _flags(p2.segments[-1])
            assert torch.equal(flags, _expected(prompt, tok, spec)), (name, spec)
            # the outliers stored are the flagged chunks, exactly (fp16)
            assert torch.equal(p2.segments[-1].fields["outliers"].float(),
                               tok.float().reshape(B, H, 1, NC, 4)[flags])
            got[name, spec] = int(flags.sum())
    assert got["small", WRITE] >= 3 and got["small", PREFILL] == 0  # the reviewer's tilt, both ways
    assert got["big", WRITE] == got["big", PREFILL]  # the max: the token's own median is the larger
    assert got["hot", WRITE] == got["hot", PREFILL] == B * H  # one hot chunk per (b, h): both


def test_prefill_bytes_equal_and_kept_median_counted():
    prompt = _prompt(T=24, seed=2)
    steps = [_prompt(T=1, seed=10 + i) for i in range(3)] + [_prompt(T=5, seed=20)]
    out = {}
    for spec in (WRITE, PREFILL):
        q = get_quantizer(spec, layer=1, role="V", seed=3)
        p = q.encode(prompt)
        first = [s.fields for s in p.segments]
        for x in steps:
            p = q.append(p, x)
        out[spec] = (q, p, first)
    (qw, pw, fw), (qp, pp, fp) = out[WRITE], out[PREFILL]
    # the prefill: the same segment bytes (its own median, exactly: the kept one is rounded down)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(fw, fp) for k in a)
    # the kept median: fp16 [B, H], the prefill's, not the placeholder
    r_med = pp.shared["r_med"]
    assert r_med.dtype == torch.float16 and r_med.shape == (B, H) and (r_med > 0).all()
    assert torch.equal(r_med, qp.kept_median(prompt.float()))
    # bits: exactly 16 bits per (b, h) per (layer, role) more, over these tokens, where the
    # steps' segments are the same size (here: no step flags an outlier the other does not)
    assert [s.nbytes for s in pw.segments] == [s.nbytes for s in pp.segments]
    assert pp.cache_nbytes * 8 - pw.cache_nbytes * 8 == 16 * B * H
    T = pp.tokens
    assert pp.cache_bits_per_element - pw.cache_bits_per_element == pytest.approx(16 * B * H / (B * H * T * D))
    assert pp.nbytes_by_field()["shared:r_med"] == 2 * B * H
    assert "shared:r_med" not in pw.nbytes_by_field()
    # the packed cache checks and decodes; a kept median of the wrong rows is refused
    assert qp.decode(pp).shape == (B, H, pp.tokens, D)
    import dataclasses
    bad = dataclasses.replace(pp, shared={**pp.shared, "r_med": r_med[:1]})
    with pytest.raises(QuantizerInputError, match="r_med"):
        qp.decode(bad)


def test_fused_store_declines_and_holds_the_reference_bytes():
    from kvqbench.kernels.formats.hqmq import device_refusal
    from kvqbench.suites.harness.kv_cache import QuantizedLayer

    assert device_refusal(get_quantizer(WRITE)) is None
    assert "median=prefill" in device_refusal(get_quantizer(PREFILL))
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, B, H, 40, D, generator=g) * torch.rand(2, B, H, 40, 1, generator=g).mul(4).add(0.05)).half()
    layer = QuantizedLayer(PREFILL, 1, seed=0)
    layer.fused_wanted = True
    with torch.inference_mode():
        n0 = se.LAUNCHES[0]
        layer.update(x[0, :, :, :30], x[1, :, :, :30])
        for t in range(30, 33):
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
        layer.update(x[0, :, :, 33:38], x[1, :, :, 33:38])
        layer.update(x[0, :, :, 38:39], x[1, :, :, 38:39])
        launches = se.LAUNCHES[0] - n0
    assert layer.mode == "fused" and launches == 0  # no device encoder ran
    for i, role in enumerate(("K", "V")):
        store = layer.stores[role]
        assert store.stepper is None and "median=prefill" in store.graph_unsupported()
        assert not store.multi_steps and not store.can_rewind
        q = get_quantizer(PREFILL, layer=1, role=role, seed=0)
        ref = q.encode(x[i, :, :, :30])
        for a, b in ((30, 31), (31, 32), (32, 33), (33, 38), (38, 39)):
            ref = q.append(ref, x[i, :, :, a:b])
        got = layer.packed[role]
        assert [s.tokens for s in got.segments] == [s.tokens for s in ref.segments]
        assert got.digest() == ref.digest(), role
        assert store.stored_nbytes == sum(s.nbytes for s in got.segments)
        assert torch.equal(layer.read(role).float(), q.decode(ref).float())


def test_kept_median_class_and_batch_rows():
    # median=prefill builds the kept-median class (fitted.py's per-row fit and byte count);
    # every other config stays HQMQ itself (the fused store's step encoder serves it)
    from kvqbench.quantizers.fitted import FitsOnFirstWrite, nbytes_as_row_caches
    from kvqbench.quantizers.hqmq import HQMQ, HQMQKeptMedian

    assert type(get_quantizer(WRITE)) is HQMQ and not isinstance(get_quantizer(WRITE), FitsOnFirstWrite)
    q = get_quantizer(PREFILL, layer=2, role="K", seed=1)
    assert type(q) is HQMQKeptMedian and q.appends_one_segment()
    x = _prompt(T=20, seed=4)
    x[1] *= 5  # rows of different ranges
    p = q.append(q.encode(x[:, :, :17]), x[:, :, 17:])
    rows = [q.append(q.encode(x[b:b + 1, :, :17].clone()), x[b:b + 1, :, 17:].clone()) for b in range(B)]
    # the batch stores each row's kept median, and counts its bytes once per row
    assert torch.equal(p.shared["r_med"], torch.cat([r.shared["r_med"] for r in rows]))
    assert nbytes_as_row_caches(p, q) == sum(r.nbytes for r in rows)
    assert all(torch.equal(q.decode(p)[b:b + 1], q.decode(r)) for b, r in enumerate(rows))
