"""Naive integer baseline: asymmetric min/max, groups of G along the head
dimension, per token (the common naive choice); or, for keys, per channel
over groups of G tokens (`keys=per-channel`), since per-token keys are the
known weak choice under channel outliers.

Per-channel key groups are cut at fixed token positions 0, G, 2G, ... and the
newest tokens wait in an fp16 window (`Quantizer.append_windowed`, KIVI's
scheme) until their group is complete and at least `residual` tokens old. So
a one-token decode write stores one fp16 token, not a one-token group (which
would cost 40 bits per element at 4 bits), and token-by-token writes store
exactly what one write stores. `residual=0` (the default) keeps only the
unfilled group fp16: the smallest window per-channel groups allow.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Quantizer, QuantizerInputError, Segment, fp16_rounding_bound
from .groups import dequantize_groups, group_error_bound, group_step_bound, quantize_groups


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
        residual: int = 0  # per-channel keys: tokens kept fp16 beyond the unfilled group

    def validate_config(self):
        c = self.config
        if not 1 <= c.bits <= 8:
            raise QuantizerInputError(f"int: bits must be in 1..8, got {c.bits}")
        if c.group < 1:
            raise QuantizerInputError(f"int: group must be >= 1, got {c.group}")
        if c.keys not in ("per-token", "per-channel"):
            raise QuantizerInputError(f"int: keys must be per-token or per-channel, got {c.keys!r}")
        if c.residual < 0:
            raise QuantizerInputError(f"int: residual must be >= 0, got {c.residual}")

    @property
    def per_channel(self) -> bool:
        return self.config.keys == "per-channel" and self.role == "K"

    def _token_group(self, d: int) -> int:
        if d % self.config.group:
            # A group that does not divide head_dim would silently change the bits.
            raise QuantizerInputError(f"int: group {self.config.group} does not divide head_dim {d}")
        return self.config.group

    def append(self, packed, x):
        if not self.per_channel:
            return super().append(packed, x)
        return self.append_windowed(packed, x, self.config.group)

    def appends_one_segment(self) -> bool:
        return not self.per_channel and type(self).append is NaiveInt.append  # per-channel: windowed

    def encode_tokens(self, x, shared):
        c = self.config
        if not self.per_channel:
            return Segment(quantize_groups(x, c.bits, self._token_group(x.shape[-1]), -1), x.shape[2])
        # One group of G tokens (append_windowed cuts them): channels as rows.
        return Segment(quantize_groups(x.transpose(2, 3), c.bits, c.group, -1), x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        c = self.config
        if not self.per_channel:
            return dequantize_groups(seg.fields, c.bits, self._token_group(shape[-1]), -1, shape)
        B, H, T, D = shape
        return dequantize_groups(seg.fields, c.bits, c.group, -1, (B, H, D, T)).transpose(2, 3)

    def formula_bits(self, head_dim):
        return self.config.bits + 32 / self.config.group  # per-channel: quantized tokens; the window adds

    def quantized_tokens(self, total: int) -> int:
        """Per-channel keys: how many of `total` tokens written are quantized."""
        c = self.config
        return max(0, total - c.residual) // c.group * c.group

    def error_bound(self, x):
        c = self.config
        if not self.per_channel:
            return group_error_bound(x, c.bits, self._token_group(x.shape[-1]), -1)
        # Quantized tokens are coded from their fp16 values: fp16 rounding, then half a step.
        x16 = x.half().float()
        elem = fp16_rounding_bound(x)  # [B, H, T, D]; the window's whole error
        n = self.quantized_tokens(x.shape[2])
        if n:
            blocks = x16[:, :, :n].transpose(2, 3)  # [B, H, D, n]: channels as rows, groups of G tokens
            step = group_step_bound(blocks, c.bits, c.group, -1).transpose(2, 3)
            elem = torch.cat([elem[:, :, :n] + step, elem[:, :, n:]], dim=2)
        return elem.norm(dim=-1)
