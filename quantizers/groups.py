"""Asymmetric min/max integer quantization over groups, shared by the naive
int baselines and KIVI. A group is a slice of the input along one axis;
each stores fp16 `scale` and `zero` (the group minimum) beside its codes."""
from __future__ import annotations

import torch

from .base import check_fp16_storable
from .packing import pack_bits, unpack_bits


def quantize_groups(x: torch.Tensor, bits: int, group: int, dim: int) -> dict[str, torch.Tensor]:
    """Code float32 x in groups of `group` consecutive elements along `dim`
    (which must divide evenly). Returns stored tensors: packed `codes`
    (along the last axis, per row), fp16 `scale` and `zero` per group."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group:
        raise ValueError(f"group {group} does not divide axis of length {n}")
    g = x.unflatten(dim, (n // group, group))  # group members on axis dim+1
    lo = g.amin(dim + 1, keepdim=True)
    hi = g.amax(dim + 1, keepdim=True)
    check_fp16_storable("group min/max", torch.cat([lo, hi]))
    levels = (1 << bits) - 1
    zero = lo.half()
    scale = ((hi - lo) / levels).half()
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


def group_error_bound(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """Per-token L2 error bound: each element is off by at most half a step of
    its group, plus fp16 rounding of the stored zero (and of the scale, times the
    largest code)."""
    dim = dim % x.dim()
    g = x.unflatten(dim, (x.shape[dim] // group, group))
    lo, hi = g.amin(dim + 1, keepdim=True), g.amax(dim + 1, keepdim=True)
    step = (hi - lo) / ((1 << bits) - 1)
    fp16_slack = 2.0 ** -10 * (lo.abs() + hi - lo)
    per_elem = (step / 2 + fp16_slack).expand_as(g).flatten(dim, dim + 1)
    return per_elem.pow(2).sum(-1).sqrt()
