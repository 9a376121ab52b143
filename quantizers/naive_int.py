"""Naive integer baseline: asymmetric min/max, groups of G along the head
dimension, per token (the common naive choice); or, for keys, per channel
over groups of G tokens (`keys=per-channel`), since per-token keys are the
known weak choice under channel outliers.

Per-token groups make appended writes identical to one write. Per-channel
key groups are cut from each write separately (a trailing partial group is
quantized as it is), so there they differ; KIVI is the variant that keeps a
window instead.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Quantizer, QuantizerInputError, Segment
from .groups import dequantize_groups, group_error_bound, quantize_groups


class NaiveInt(Quantizer):
    name = "int"
    description = "naive asymmetric min/max ints, per-token groups of G along head_dim"
    example_specs = ("int2", "int3", "int4", "int8", "int4:keys=per-channel")
    aliases = {f"int{b}": {"bits": b} for b in (2, 3, 4, 8)}

    @dataclasses.dataclass
    class Config:
        bits: int = 4
        group: int = 32
        keys: str = "per-token"  # or "per-channel" (keys only; values stay per-token)

    def validate_config(self):
        c = self.config
        if not 1 <= c.bits <= 8:
            raise QuantizerInputError(f"int: bits must be in 1..8, got {c.bits}")
        if c.group < 1:
            raise QuantizerInputError(f"int: group must be >= 1, got {c.group}")
        if c.keys not in ("per-token", "per-channel"):
            raise QuantizerInputError(f"int: keys must be per-token or per-channel, got {c.keys!r}")
        # Per-channel key groups are cut per write (see module docstring).
        self.append_matches_single_write = not self.per_channel

    @property
    def per_channel(self) -> bool:
        return self.config.keys == "per-channel" and self.role == "K"

    def _token_group(self, d: int) -> int:
        if d % self.config.group:
            # A group that does not divide head_dim would silently change the bits.
            raise QuantizerInputError(f"int: group {self.config.group} does not divide head_dim {d}")
        return self.config.group

    def encode_tokens(self, x, shared):
        c = self.config
        if not self.per_channel:
            return Segment(quantize_groups(x, c.bits, self._token_group(x.shape[-1]), -1), x.shape[2])
        # Per channel: one stored block per run of G tokens (the last may be shorter).
        fields = {}
        for i, start in enumerate(range(0, x.shape[2], c.group)):
            blk = x[:, :, start : start + c.group].transpose(2, 3)  # [B, H, D, g]: channels as rows
            for k, v in quantize_groups(blk, c.bits, blk.shape[-1], -1).items():
                fields[f"{k}{i}"] = v
        return Segment(fields, x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        c = self.config
        if not self.per_channel:
            return dequantize_groups(seg.fields, c.bits, self._token_group(shape[-1]), -1, shape)
        B, H, T, D = shape
        parts = []
        for i, start in enumerate(range(0, T, c.group)):
            g = min(c.group, T - start)
            f = {k: seg.fields[f"{k}{i}"] for k in ("codes", "scale", "zero")}
            parts.append(dequantize_groups(f, c.bits, g, -1, (B, H, D, g)).transpose(2, 3))
        return torch.cat(parts, dim=2)

    def formula_bits(self, head_dim):
        return self.config.bits + 32 / self.config.group

    def error_bound(self, x):
        c = self.config
        if not self.per_channel:
            return group_error_bound(x, c.bits, self._token_group(x.shape[-1]), -1)
        parts = []
        for start in range(0, x.shape[2], c.group):
            blk = x[:, :, start : start + c.group].transpose(2, 3)
            g = blk.shape[-1]
            b = group_error_bound(blk, c.bits, g, -1) / g**0.5  # [B, H, D]: per element of a channel
            parts.append(b.unsqueeze(2).expand(-1, -1, blk.shape[-1], -1))  # same bound for each token
        return torch.cat(parts, dim=2).norm(dim=-1)
