"""Rotated ints (QuaRot / SpinQuant style for the KV cache): a randomised
Hadamard rotation of each head vector, then per-token asymmetric min/max ints.

The rotation (rotation.py) is W diag(s)/sqrt(D) with seeded signs s, one set
per (layer, role, kv-head), stored as 1 bit per sign. It spreads a few outlier
channels over every coordinate, so a per-token int grid no longer spends its
range on them. Codes are asymmetric min/max ints over groups of
rotated coordinates (`group_size`; 0, the default, means the whole head vector: one group
per token, as QuaRot quantizes its KV cache), fp16 scale and zero per group
(groups.py). Decode dequantizes and rotates back.

What of QuaRot / SpinQuant is not here: they fold the rotation into the
weights (no runtime cost) and SpinQuant learns it; here it is applied to K/V
as written, which is the same numerically for the cache but not for speed,
and the signs are seeded, never learned. Calibration-free.

Stored per token vector: packed codes (`bits` each) and fp16 scale and zero
per group. Per (layer, role): the sign bits, uint8 `[H, D/8]`, a model constant
(`constant_shared`: reported once per model, not in the cache's bits).
"""
from __future__ import annotations

import dataclasses

from .base import Quantizer, QuantizerInputError, Segment
from .groups import dequantize_groups, group_error_bound, quantize_groups
from .rotation import random_signs, rotate, signs_of, unrotate

ROTATION_SLACK = 1e-5  # relative: float32 rounding of the two butterfly passes (log2 D stages each)


class HadamardInt(Quantizer):
    name = "hadamard-int"
    description = "randomised Hadamard rotation (QuaRot-style) then per-token asymmetric min/max ints"
    aliases = {f"hadamard-int{b}": {"bits": b} for b in (2, 3, 4)}
    example_specs = ("hadamard-int3", "hadamard-int4")

    @dataclasses.dataclass
    class Config:
        bits: int = 4
        # Rotated coordinates per scale/zero; 0 = the whole head vector (not named
        # `group`: there a 0 would read as a group length).
        group_size: int = 0

    def validate_config(self):
        c = self.config
        if not 1 <= c.bits <= 8:
            raise QuantizerInputError(f"hadamard-int: bits must be in 1..8, got {c.bits}")
        if c.group_size < 0:
            raise QuantizerInputError(f"hadamard-int: group_size must be >= 0 (0 = whole head), got {c.group_size}")

    def _group(self, d: int) -> int:
        g = self.config.group_size or d
        if d % g:
            raise QuantizerInputError(f"hadamard-int: group_size {g} does not divide head_dim {d}")
        return g

    def make_shared(self, heads, head_dim):
        return {"signs": random_signs([self.head_seed(h) for h in range(heads)], head_dim)}

    def constant_shared(self):
        # Seeded, never fitted: a model constant (base.py), not cache bytes.
        return frozenset({"signs"})

    def _signs(self, shared, d):
        return signs_of(shared["signs"], d)

    def encode_tokens(self, x, shared):
        D = x.shape[-1]
        y = rotate(x, self._signs(shared, D).to(x.device))
        return Segment(quantize_groups(y, self.config.bits, self._group(D), -1), x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        D = shape[-1]
        y = dequantize_groups(seg.fields, self.config.bits, self._group(D), -1, shape)
        return unrotate(y, self._signs(shared, D).to(y.device))

    def formula_bits(self, head_dim):
        return self.config.bits + 32 / self._group(head_dim)

    def error_bound(self, x):
        """The rotation is orthogonal, so the error is the int error of the rotated
        coordinates (groups.py's per-group half step plus fp16 rounding of scale
        and zero), plus float32 rounding of the rotations, relative to ||x||."""
        D = x.shape[-1]
        y = rotate(x.float(), self._signs(self.empty(x).shared, D).to(x.device))
        return group_error_bound(y, self.config.bits, self._group(D), -1) + ROTATION_SLACK * x.float().norm(dim=-1)
