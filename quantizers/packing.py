"""Bit-packing of integer codes into bytes: a 12-bit code occupies 12 bits.

Layout (shared with the Triton kernels): along the last axis, element i of
width w occupies bits [i*w, (i+1)*w) of a little-endian bit stream, least
significant bit first; the stream is padded with zero bits to whole bytes.
So element i starts in byte (i*w)//8 at bit (i*w)%8 and spans at most 3 bytes
for w <= 16.
"""
from __future__ import annotations

import math

import torch

from .checks import require

MAX_WIDTH = 32


def packed_nbytes(n: int, width: int) -> int:
    return math.ceil(n * width / 8)


def _check_width(width: int) -> None:
    if not (isinstance(width, int) and 1 <= width <= MAX_WIDTH):
        raise ValueError(f"bit width must be an int in 1..{MAX_WIDTH}, got {width!r}")


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative ints `[..., n]` of `width` bits into uint8 `[..., ceil(n*width/8)]`."""
    _check_width(width)
    if values.is_floating_point():
        raise TypeError(f"pack_bits needs an integer tensor, got {values.dtype}")
    v = values.to(torch.int64)
    if v.numel():
        lo, hi = torch.aminmax(v)
        require((lo < 0) | (hi >= (1 << width)),
                lambda: ValueError(f"codes out of range for {width} bits: [{int(lo)}, {int(hi)}]"))
    n = v.shape[-1]
    shifts = torch.arange(width, device=v.device)
    bits = ((v.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).flatten(-2)  # [..., n*width]
    pad = (-bits.shape[-1]) % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    bits = bits.unflatten(-1, (-1, 8))
    # made on the device: a host tensor copied there would wait for the stream (a hidden sync)
    weights = torch.ones(8, dtype=torch.uint8, device=v.device) << torch.arange(8, dtype=torch.uint8, device=v.device)
    out = (bits * weights).sum(-1, dtype=torch.uint8)
    assert out.shape[-1] == packed_nbytes(n, width)
    return out


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 `[..., nbytes]` -> int64 `[..., n]`."""
    _check_width(width)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits needs uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_nbytes(n, width):
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {n} codes of {width} bits")
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = ((packed.unsqueeze(-1) >> shifts8) & 1).flatten(-2)[..., : n * width]
    bits = bits.unflatten(-1, (n, width)).to(torch.int64)
    return (bits << torch.arange(width, device=packed.device)).sum(-1)


def bits_for(levels: int) -> int:
    """Whole bits needed to store a code taking `levels` distinct values."""
    return max(1, math.ceil(math.log2(levels)))
