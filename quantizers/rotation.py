"""Randomised Hadamard rotations, shared by the quantizers that rotate a head
vector before coding it (hadamard-int, spherical, additive VQ).

The rotation of a head vector x of length D is R x = W_b diag(s) x / sqrt(b):
s are seeded random signs (one per element, stored as 1 bit each), and W_b is
Sylvester's Hadamard matrix of order b, the largest power of two dividing D,
applied to each block of b consecutive elements (b = D for the usual power-of-
two head dims; a 96-dim head gets blocks of 32). R is orthogonal, so it
preserves norms and the inverse is diag(s) W_b / sqrt(b).

`fwht` applies W_b by the fast Walsh-Hadamard butterflies: log2(b) stages of
elementwise sums and differences, O(D log D), and, unlike a matmul, the same
operations in the same order whatever the batch shape, so a token rotated alone
gets bit-identical coordinates to the same token inside a long write.

`structured_rotation(seed, d)` is an orthogonal d x d matrix for ANY d, drawn from
its seed alone (so a model constant: nothing but the seed need be kept), for the
parts of a head vector whose size is no power of two (spherical's outlier split,
e.g. 64 - 16 = 48 channels, or 64 - 13 = 51): `rounds` (default 3) rounds of
seeded random signs, a seeded random permutation, and Sylvester's Hadamard of
order p, the largest power of two <= d, applied to the first p coordinates and
then to the last p (the two overlap when p < d, so every coordinate is mixed;
when p = d it is one Hadamard). One round leaves the coordinates of an outlier
channel flat (p = d) or partly zero (p < d); three re-mix them to code like a
dense Haar rotation (figures in spherical.py). Built by elementwise butterflies
and sign flips from the identity, in float64: the same bits on every machine
(no LAPACK, no matmul summation order).
"""
from __future__ import annotations

import math

import torch

from .derived import derived
from .packing import pack_bits, unpack_bits


def hadamard_block(d: int) -> int:
    """The largest power of two dividing d: the order of the Hadamard blocks."""
    if d < 1:
        raise ValueError(f"head_dim must be >= 1, got {d}")
    return d & -d


def sylvester_hadamard(d: int) -> torch.Tensor:
    """Sylvester's +-1 Hadamard matrix of order d (a power of two), float32."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Sylvester's construction needs a power-of-two order, got {d}")
    w = torch.ones(1, 1)
    while w.shape[0] < d:
        w = torch.cat([torch.cat([w, w], 1), torch.cat([w, -w], 1)], 0)
    return w


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """x @ W_block on each block of `block` elements of the last axis (unnormalised;
    W is symmetric, so this is also W x). Butterflies only: deterministic."""
    shape = x.shape
    y = x.reshape(*shape[:-1], shape[-1] // block, block)
    h = 1
    while h < block:
        y = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = y.select(-2, 0), y.select(-2, 1)
        # sums and differences written straight into their halves: two kernels a stage
        # where a stack of two temporaries took three (a graphed dense decode step replays
        # every one of them, per layer and role)
        out = torch.empty_like(y)
        torch.add(a, b, out=out.select(-2, 0))
        torch.sub(a, b, out=out.select(-2, 1))
        y = out.flatten(-3)
        h *= 2
    return y.reshape(shape)


def seed_bytes(seeds: list[int]) -> torch.Tensor:
    """63-bit seeds as uint8 `[len(seeds), 8]` (little-endian): what a rotation that is a
    function of its seed stores."""
    return torch.tensor([list(int(s).to_bytes(8, "little")) for s in seeds], dtype=torch.uint8)


def seeds_of(packed: torch.Tensor) -> list[int]:
    """The seeds `seed_bytes` stored."""
    return [int.from_bytes(bytes(row.tolist()), "little") for row in packed.cpu()]


STRUCTURED_ROUNDS = 3


def structured_rotation(seed: int, d: int, rounds: int | None = None) -> torch.Tensor:
    """float64 `[d, d]` orthogonal R with rows T(e_i): x @ R = T(x) for a row vector x, T
    the `rounds` rounds of (signs, permutation, overlapped Hadamard) of the module
    docstring, all drawn from `seed`."""
    if d < 1 or (rounds is not None and rounds < 1):
        raise ValueError(f"structured rotation needs d >= 1 and rounds >= 1, got d={d}, rounds={rounds}")
    p = 1 << (d.bit_length() - 1)  # largest power of two <= d
    rounds = STRUCTURED_ROUNDS if rounds is None else rounds
    g = torch.Generator().manual_seed(int(seed))
    scale = 1 / math.sqrt(p)
    x = torch.eye(d, dtype=torch.float64)
    for _ in range(rounds):
        signs = 1 - 2 * torch.randint(0, 2, (d,), generator=g).double()
        perm = torch.randperm(d, generator=g)
        x = (x * signs)[:, perm]
        x = torch.cat([fwht(x[:, :p], p) * scale, x[:, p:]], dim=1)
        if p < d:
            x = torch.cat([x[:, : d - p], fwht(x[:, d - p :], p) * scale], dim=1)
    return x


def random_signs(seeds: list[int], d: int) -> torch.Tensor:
    """Packed sign bits uint8 `[len(seeds), ceil(d/8)]`, one seeded set per seed;
    bit 1 means a negative sign."""
    rows = [torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(s)) for s in seeds]
    return pack_bits(torch.stack(rows), 1)


def signs_of(packed_signs: torch.Tensor, d: int, dtype=torch.float32) -> torch.Tensor:
    """+-1 `[H, d]` from packed sign bits (unpacked once per stored tensor: derived.py)."""
    return derived(packed_signs, ("signs_of", d, dtype), lambda: 1 - 2 * unpack_bits(packed_signs, 1, d).to(dtype))


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R x for x `[B, H, T, D]` and +-1 signs `[H, D]` (one rotation per kv-head)."""
    b = hadamard_block(x.shape[-1])
    return fwht(x * signs.unsqueeze(-2), b) * (1 / math.sqrt(b))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T y, the inverse of `rotate`."""
    b = hadamard_block(y.shape[-1])
    return fwht(y, b) * (1 / math.sqrt(b)) * signs.unsqueeze(-2)


__all__ = ["fwht", "hadamard_block", "random_signs", "rotate", "seed_bytes", "seeds_of", "signs_of",
           "structured_rotation", "sylvester_hadamard", "unrotate"]
