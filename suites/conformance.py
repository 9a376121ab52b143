"""The contract every registered quantizer meets, as plain check functions.

`suites/tests/test_conformance.py` runs them on every example config of every
registered quantizer (built-in and entry-point plugins alike); a plugin author
can call `check_quantizer("myq:...")` directly while developing.
"""
from __future__ import annotations

import torch

from ..quantizers import get_quantizer, registry

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Decoding into a narrow dtype rounds once more: half an ulp of the output, relative
# for normal values, absolute (half the smallest subnormal) below them.
OUTPUT_ROUNDING = {torch.float16: (2.0**-11, 2.0**-25), torch.bfloat16: (2.0**-8, 2.0**-134),
                   torch.float32: (0.0, 0.0)}
# The only slack a bound gets: relative, for float32 rounding inside encode, decode and
# the bound's own arithmetic (a few ulps, 2^-24 each, over a few hundred operations).
# No absolute slack: at input scale 1e-7 an absolute 1e-6 would hide every error.
RELATIVE_SLACK = 1e-5
# Input scales the bound is checked at: ordinary, large, and where fp16 scales and
# values are subnormal.
SCALES = (1.0, 1e3, 1e-7)


def all_example_specs() -> list[str]:
    return [spec for cls in registry().values() for spec in cls.examples()]


def reference_tensor(head_dim: int, tokens: int = 40, heads: int = 2, batch: int = 2, seed: int = 0,
                     outlier_channels: tuple[int, ...] = (), outlier_scale: float = 50.0) -> torch.Tensor:
    """Seeded Gaussian K/V `[batch, heads, tokens, head_dim]`, optionally with a few
    channels scaled up (the structure of real key caches after RoPE)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, tokens, head_dim, generator=g)
    for c in outlier_channels:
        x[..., c] *= outlier_scale
    return x


def head_dim_for(spec: str) -> int:
    """A head_dim the config accepts: 64 unless its groups need more."""
    q = get_quantizer(spec)
    for d in (64, 128, 256):
        try:
            q.check_input(torch.zeros(1, 1, 1, d))
            group = getattr(q.config, "group", 1)
            if d % group == 0:
                return d
        except ValueError:
            continue
    raise AssertionError(f"{spec}: accepts none of head_dim 64/128/256")


def bound_excess(q, x: torch.Tensor, y: torch.Tensor) -> float:
    """How far (relative to the bound) decode `y` of input `x` exceeds q's stated
    per-token bound plus the output dtype's rounding; <= 0 means it holds."""
    xf = x.double()
    err = (y.double() - xf).norm(dim=-1)
    rel, tiny = OUTPUT_ROUNDING[y.dtype]
    out_round = torch.clamp_min(y.double().abs() * rel, tiny).norm(dim=-1)
    bound = (q.error_bound(x.float()).double() + out_round) * (1 + RELATIVE_SLACK)
    return float(((err - bound) / bound.clamp_min(torch.finfo(torch.float64).tiny)).max())


def check_shapes_dtypes_and_bound(spec: str, role: str) -> None:
    d = head_dim_for(spec)
    base = reference_tensor(d, tokens=200, outlier_channels=(3,), outlier_scale=8.0)
    for scale in SCALES:
        for dtype in DTYPES:
            x = (base * scale).to(dtype)
            q = get_quantizer(spec, role=role, layer=1, seed=5)
            packed = q.encode(x)
            y = q.decode(packed)
            assert y.shape == x.shape, f"{spec}: decode shape {tuple(y.shape)} != {tuple(x.shape)}"
            assert y.dtype == dtype and y.device == x.device, f"{spec}: decode gave {y.dtype} on {y.device}"
            # (the base class makes it so; an attention that reads the decoded history
            # needs unit stride on the last axis for SDPA's fused kernels)
            assert y.is_contiguous(), f"{spec}: decode gave a non-contiguous tensor (strides {y.stride()})"
            assert torch.isfinite(y).all(), f"{spec}: decode produced NaN/Inf"
            worst = bound_excess(q, x, y)
            assert worst <= 0, (f"{spec} {role} {dtype} at input scale {scale:g}: round-trip error exceeds "
                                f"its stated bound by {worst:.3g} of the bound")


WRITE_CUTS = (0, 133, 134, 135, 170, 200)  # a prefill, single-token decode steps, a block


def check_append(spec: str, role: str) -> None:
    """Token-by-token writes: same decode and same bytes as one write, where the
    method says so (then one write's bound covers them); otherwise the right shape
    and every write within the bound of that write alone."""
    d = head_dim_for(spec)
    x = reference_tensor(d, tokens=200)  # past KIVI's default 128-token fp16 window
    q = get_quantizer(spec, role=role, seed=3)
    whole = q.encode(x)
    packed = None
    for a, b in zip(WRITE_CUTS, WRITE_CUTS[1:]):
        packed = q.append(packed, x[:, :, a:b])
    assert packed.shape == whole.shape
    y = q.decode(packed)
    assert y.shape == x.shape
    if q.append_matches_single_write:
        torch.testing.assert_close(y, q.decode(whole), rtol=0, atol=0,
                                   msg=f"{spec}: appended writes decode differently from one write")
        assert packed.nbytes == whole.nbytes, f"{spec}: appended writes store other byte counts"
        worst = bound_excess(q, x, y)
        assert worst <= 0, f"{spec} {role}: appended writes exceed the one-write bound by {worst:.3g}"
    else:
        for a, b in zip(WRITE_CUTS, WRITE_CUTS[1:]):
            worst = bound_excess(q, x[:, :, a:b], y[:, :, a:b])
            assert worst <= 0, f"{spec} {role}: the write of tokens {a}..{b} exceeds its bound by {worst:.3g}"


def check_determinism(spec: str) -> None:
    d = head_dim_for(spec)
    x = reference_tensor(d)
    a = get_quantizer(spec, role="V", layer=2, seed=11).encode(x)
    b = get_quantizer(spec, role="V", layer=2, seed=11).encode(x)
    assert a.digest() == b.digest(), f"{spec}: same seed and config stored different bytes"


def check_measured_bits(spec: str) -> None:
    d = head_dim_for(spec)
    x = reference_tensor(d, tokens=256)
    q = get_quantizer(spec)
    packed = q.encode(x)
    fields = [t for s in packed.segments for t in s.fields.values()] + list(packed.shared.values())
    assert all(t.dtype in (torch.uint8, torch.float16, torch.int32) for t in fields), (
        f"{spec}: stores {sorted({str(t.dtype) for t in fields})}; codes must be bit-packed uint8, "
        "scales fp16 (int32 only for kernel indices)"
    )
    measured = packed.bits_per_element
    assert measured == packed.nbytes * 8 / x.numel()
    assert packed.cache_nbytes + packed.constant_nbytes == packed.nbytes, (
        f"{spec}: cache bytes {packed.cache_nbytes} + model-constant bytes {packed.constant_nbytes} != "
        f"total {packed.nbytes}")
    cache_bits = packed.cache_bits_per_element
    assert cache_bits == packed.cache_nbytes * 8 / x.numel()
    # Whole-bit code fields and amortised fitted codebooks only ever add to the formula, which
    # counts what a cache stores per token (never the model constants).
    assert cache_bits >= q.formula_bits(d) - 1e-9, (
        f"{spec}: measured cache bits {cache_bits} < formula {q.formula_bits(d)} (model constants, "
        f"{packed.constant_nbytes} bytes, are not cache bits; does the formula count them?)")
    assert measured < 33


def check_constant_shared(spec: str) -> None:
    """The shared tensors a quantizer declares model constants (`constant_shared()`) are a
    deterministic function of (config, layer, role, seed, heads, head_dim): two fresh
    instances writing different data (other values, scale, batch rows and token count)
    store them byte for byte alike, and a later append leaves them unchanged. A codebook
    fitted on the write, a per-row tensor or a scale fails here."""
    d = head_dim_for(spec)
    for role in ("K", "V"):
        q = get_quantizer(spec, role=role, layer=1, seed=5)
        declared = q.constant_shared()
        x1 = reference_tensor(d, tokens=40, batch=2, seed=0)
        x2 = reference_tensor(d, tokens=24, batch=1, seed=7, outlier_channels=(1, 5), outlier_scale=30.0) * 100
        a = q.encode(x1)
        b = get_quantizer(spec, role=role, layer=1, seed=5).encode(x2)
        assert a.constant == declared == b.constant, (
            f"{spec} {role}: Packed.constant {sorted(a.constant)} is not constant_shared() {sorted(declared)}")
        assert declared <= set(a.shared), (
            f"{spec} {role}: constant_shared() names {sorted(declared - set(a.shared))}, not shared tensors")
        later = q.append(a, reference_tensor(d, tokens=3, batch=2, seed=9) * 3)
        for name in sorted(declared):
            for what, other in (("a write of other data", b.shared[name]), ("a later append", later.shared[name])):
                t = a.shared[name]
                raw = lambda u: u.contiguous().cpu().view(torch.uint8)  # noqa: E731
                same = t.shape == other.shape and t.dtype == other.dtype and torch.equal(raw(t), raw(other))
                assert same, (
                    f"{spec} {role}: shared tensor {name!r} is declared a model constant (constant_shared) but "
                    f"{what} stored other bytes ({tuple(t.shape)} {t.dtype} vs {tuple(other.shape)} {other.dtype}): "
                    "it depends on the data or the batch, so it is a cache byte; leave it out of constant_shared()")
        assert a.constant_nbytes == sum(a.shared[n].numel() * a.shared[n].element_size() for n in declared)


def check_quantizer(spec: str) -> None:
    """Every check, for use by plugin authors."""
    for role in ("K", "V"):
        check_shapes_dtypes_and_bound(spec, role)
        check_append(spec, role)
    check_determinism(spec)
    check_measured_bits(spec)
    check_constant_shared(spec)
