"""The contract every registered quantizer meets, as plain check functions.

`suites/tests/test_conformance.py` runs them on every example config of every
registered quantizer (built-in and entry-point plugins alike); a plugin author
can call `check_quantizer("myq:...")` directly while developing.
"""
from __future__ import annotations

import torch

from ..quantizers import get_quantizer, registry

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Decoding into a narrow dtype rounds once more: relative half-ulp of the output.
OUTPUT_ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


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


def check_shapes_dtypes_and_bound(spec: str, role: str) -> None:
    d = head_dim_for(spec)
    x32 = reference_tensor(d, tokens=200, outlier_channels=(3,), outlier_scale=8.0)
    for dtype in DTYPES:
        x = x32.to(dtype)
        q = get_quantizer(spec, role=role, layer=1, seed=5)
        packed = q.encode(x)
        y = q.decode(packed)
        assert y.shape == x.shape, f"{spec}: decode shape {tuple(y.shape)} != {tuple(x.shape)}"
        assert y.dtype == dtype and y.device == x.device, f"{spec}: decode gave {y.dtype} on {y.device}"
        assert torch.isfinite(y).all(), f"{spec}: decode produced NaN/Inf"
        xf = x.float()
        err = (y.float() - xf).norm(dim=-1)
        bound = q.error_bound(xf) + OUTPUT_ROUNDING[dtype] * y.float().norm(dim=-1) + 1e-6
        worst = (err - bound).max().item()
        assert worst <= 0, f"{spec} {role} {dtype}: round-trip error exceeds its stated bound by {worst:.3g}"


def check_append(spec: str, role: str) -> None:
    """Token-by-token writes: same decode and same bytes as one write, where the
    method says so; otherwise still the right shape and within its bound per write."""
    d = head_dim_for(spec)
    x = reference_tensor(d, tokens=200)  # past KIVI's default 128-token fp16 window
    q = get_quantizer(spec, role=role, seed=3)
    whole = q.encode(x)
    cuts = [0, 133, 134, 135, 170, 200]  # a prefill, single-token decode steps, a block
    packed = None
    for a, b in zip(cuts, cuts[1:]):
        packed = q.append(packed, x[:, :, a:b])
    assert packed.shape == whole.shape
    y = q.decode(packed)
    assert y.shape == x.shape
    if q.append_matches_single_write:
        torch.testing.assert_close(y, q.decode(whole), rtol=0, atol=0,
                                   msg=f"{spec}: appended writes decode differently from one write")
        assert packed.nbytes == whole.nbytes, f"{spec}: appended writes store other byte counts"


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
    # Whole-bit code fields and amortised codebooks only ever add to the formula.
    assert measured >= q.formula_bits(d) - 1e-9, f"{spec}: measured {measured} < formula {q.formula_bits(d)}"
    assert measured < 33


def check_quantizer(spec: str) -> None:
    """Every check, for use by plugin authors."""
    for role in ("K", "V"):
        check_shapes_dtypes_and_bound(spec, role)
        check_append(spec, role)
    check_determinism(spec)
    check_measured_bits(spec)
