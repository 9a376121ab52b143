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


# ---- mixed-radix packing ---------------------------------------------------------------
# Codes of radix R that is not a power of two waste bits when each takes ceil(log2 R)
# bits (HQMQ S=96: 12 bits for 2304 values, log2 2304 = 11.17). Mixed-radix packing
# combines G codes c_0..c_{G-1} of a row into one integer sum_k c_k R^k (c_0 least
# significant) < R^G, stored in W = bits_for(R^G) bits; a row of n codes is n // G such
# groups, then one group of the n % G codes left (W_last bits), bit-packed like
# `pack_bits` (group j at bits [j*W, j*W + width_j) of the little-endian LSB-first
# stream; the row padded with zero bits to whole bytes). R^G < 2^63, so a kernel
# unpacks a group with 64-bit integer arithmetic: G - 1 divisions by the constant R.

MIXED_MAX_BITS = 63  # a group fits a signed 64-bit integer


def _group_width(radix: int, k: int) -> int:
    return (radix ** k - 1).bit_length() if k else 0


def mixed_layout(radix: int, n: int) -> tuple[int, int, int, int]:
    """(G, W, W_last, nbytes) of a row of n codes of radix `radix`: G codes per group of
    W bits (W_last bits for the n % G codes of the last group, 0 if none), nbytes the
    row's bytes. G is the size with the fewest row bytes among those whose groups fit
    63 bits, the smallest such on ties (cheapest to unpack); G = 1 is `pack_bits` at
    bits_for(radix) bits exactly."""
    if not (isinstance(radix, int) and radix >= 2 and (radix - 1).bit_length() <= MIXED_MAX_BITS):
        raise ValueError(f"radix must be an int in 2..2^{MIXED_MAX_BITS}, got {radix!r}")
    if n < 1:
        raise ValueError(f"a row needs at least one code, got n={n}")
    best = None
    g = 1
    while g <= n and _group_width(radix, g) <= MIXED_MAX_BITS:
        w, wl = _group_width(radix, g), _group_width(radix, n % g)
        nbytes = math.ceil(((n // g) * w + wl) / 8)
        if best is None or nbytes < best[3]:
            best = (g, w, wl, nbytes)
        g += 1
    return best


def _bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bits `[..., m]` (LSB first) -> uint8 bytes `[..., ceil(m/8)]`."""
    pad = (-bits.shape[-1]) % 8
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    bits = bits.unflatten(-1, (-1, 8))
    weights = torch.ones(8, dtype=torch.uint8, device=bits.device) << torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def pack_mixed(values: torch.Tensor, radix: int) -> torch.Tensor:
    """Pack ints `[..., n]` in [0, radix) into uint8 `[..., nbytes]`, mixed radix
    (`mixed_layout`)."""
    if values.is_floating_point():
        raise TypeError(f"pack_mixed needs an integer tensor, got {values.dtype}")
    n = values.shape[-1]
    G, W, WL, nbytes = mixed_layout(radix, n)
    v = values.to(torch.int64)
    if v.numel():
        lo, hi = torch.aminmax(v)
        require((lo < 0) | (hi >= radix),
                lambda: ValueError(f"codes out of range for radix {radix}: [{int(lo)}, {int(hi)}]"))
    v = torch.nn.functional.pad(v, (0, (-n) % G)).unflatten(-1, (-1, G))  # [..., ng, G]
    weights = torch.tensor([radix ** k for k in range(G)], dtype=torch.int64, device=v.device)
    groups = (v * weights).sum(-1)  # [..., ng]; exact: < radix^G < 2^63
    shifts = torch.arange(W, device=v.device)
    bits = ((groups.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).flatten(-2)  # [..., ng*W]
    bits = bits[..., : (n // G) * W + WL]  # the last group's W_last bits (its higher bits are 0)
    out = _bits_to_bytes(bits)
    assert out.shape[-1] == nbytes
    return out


def unpack_mixed(packed: torch.Tensor, radix: int, n: int) -> torch.Tensor:
    """Inverse of `pack_mixed`: uint8 `[..., nbytes]` -> int64 `[..., n]`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_mixed needs uint8, got {packed.dtype}")
    G, W, WL, nbytes = mixed_layout(radix, n)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"{packed.shape[-1]} bytes are not a mixed-radix row of {n} codes of radix {radix} "
                         f"({nbytes} bytes)")
    ng = -(-n // G)
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = ((packed.unsqueeze(-1) >> shifts8) & 1).flatten(-2)[..., : (n // G) * W + WL]
    bits = torch.nn.functional.pad(bits, (0, ng * W - bits.shape[-1])).unflatten(-1, (ng, W)).to(torch.int64)
    groups = (bits << torch.arange(W, device=packed.device)).sum(-1)  # [..., ng]
    digits = []
    for _ in range(G):
        digits.append(groups % radix)
        groups = groups // radix
    return torch.stack(digits, -1).flatten(-2)[..., :n]
