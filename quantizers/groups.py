"""Asymmetric min/max integer quantization over groups, shared by the naive
int baselines and KIVI. A group is a slice of the input along one axis;
each stores fp16 `scale` and `zero` beside its codes.

The stored fp16 parameters are rounded outward: `zero` down to at most the group
minimum, `scale` up so that zero + levels * scale reaches the maximum. Every
member then lies on the code grid's span and no code ever clamps, even when the
scale is an fp16 subnormal (inputs around 1e-7), so each element is within half
a stored step of its code: the bound `group_error_bound` states.
"""
from __future__ import annotations

import torch

from .base import FP16_MAX, QuantizerInputError, check_fp16_storable
from .checks import require
from .packing import pack_bits, unpack_bits


def _fp16_toward(t: torch.Tensor, direction: float) -> torch.Tensor:
    """fp16 of float32 t, rounded toward -inf (direction < 0) or +inf (> 0)."""
    h = t.half()
    off = h.float() > t if direction < 0 else h.float() < t
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction * float("inf"))), h)


def group_params(g: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero, scale) in fp16 for groups whose members lie on axis `dim` of g."""
    lo, hi = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    check_fp16_storable("group min/max", torch.cat([lo, hi]))
    levels = (1 << bits) - 1
    zero = _fp16_toward(lo, -1.0)
    # A true division on every device: torch on CUDA turns a division by a Python scalar into
    # a product with its rounded reciprocal (1/15 is inexact), one ulp off the CPU's and the
    # step kernels' (div.rn) quotient in some groups.
    span = (hi - zero.float()) / torch.full_like(hi, levels)
    if span.numel():
        mx = span.amax()
        require(mx > FP16_MAX, lambda: QuantizerInputError(
            f"a group's range {float(mx) * levels:.4g} needs a step beyond "
            f"the fp16 the cache stores ({bits} bits); rescale the input"))
    return zero, _fp16_toward(span, 1.0)


def quantize_groups(x: torch.Tensor, bits: int, group: int, dim: int) -> dict[str, torch.Tensor]:
    """Code float32 x in groups of `group` consecutive elements along `dim`
    (which must divide evenly). Returns stored tensors: packed `codes`
    (along the last axis, per row), fp16 `scale` and `zero` per group."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group:
        raise ValueError(f"group {group} does not divide axis of length {n}")
    g = x.unflatten(dim, (n // group, group))  # group members on axis dim+1
    zero, scale = group_params(g, bits, dim + 1)
    levels = (1 << bits) - 1
    # Computed with the fp16 values actually stored, so decode sees what encode saw.
    z, s = zero.float(), scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round((g - z) / safe), torch.zeros_like(g)).clamp(0, levels)
    codes = codes.flatten(dim, dim + 1).long()
    return {
        "codes": pack_bits(codes, bits),
        "scale": scale.squeeze(dim + 1),
        "zero": zero.squeeze(dim + 1),
    }


def dequantize_groups(fields: dict[str, torch.Tensor], bits: int, group: int, dim: int, shape) -> torch.Tensor:
    dim = dim % len(shape)
    codes = unpack_bits(fields["codes"], bits, shape[-1]).float()
    codes = codes.unflatten(dim, (shape[dim] // group, group))
    out = codes * fields["scale"].float().unsqueeze(dim + 1) + fields["zero"].float().unsqueeze(dim + 1)
    return out.flatten(dim, dim + 1)


def group_step_bound(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """Elementwise error bound, shaped like x, for quantizing x in groups of `group`
    along `dim`: half the stored step (no code clamps, see the module docstring),
    plus the float32 rounding of encode's (x - zero) / scale and decode's
    code * scale + zero, a few ulps of |zero| + levels * scale."""
    dim = dim % x.dim()
    g = x.unflatten(dim, (x.shape[dim] // group, group))
    zero, scale = group_params(g, bits, dim + 1)
    z, s = zero.float(), scale.float()
    levels = (1 << bits) - 1
    return (s / 2 + 2.0**-22 * (z.abs() + levels * s)).expand_as(g).flatten(dim, dim + 1)


def group_error_bound(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """`group_step_bound` as an L2 norm over the last axis."""
    return group_step_bound(x, bits, group, dim).norm(dim=-1)
