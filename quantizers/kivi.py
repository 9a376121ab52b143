"""KIVI (Liu et al., ICML 2024), tuning-free: keys per channel, grouped over G
tokens; values per token, grouped over G channels; asymmetric min/max; recent
tokens stay fp16.

The fp16 windows (`window`):
- "paper" (default), as the paper and its official code do for keys: the key
  residual holds T mod R tokens (0..R-1); when it reaches R tokens all R are
  quantized at once (R/G key groups; an R that is not a multiple of G, 0
  included, is rounded up to one, since keys are coded in whole G-token
  groups; the official code asserts R % G == 0). Values keep the latest R
  tokens fp16 and are flushed in whole G-token groups, so R..R+G-1 values
  are fp16 once T >= R + G.
  The official code flushes one value token per step (exactly R fp16); values
  are coded per token, so this changes no code, only keeps up to G-1 more
  fp16 value tokens, and keeps every stored segment a whole G-token group,
  which the fused kernel's layout reads.
- "fixed" (the earlier behaviour here): keys and values both keep the latest
  R tokens plus the G-1 of an unfilled group, R..R+G-1 tokens fp16, more
  bits for more accuracy than the method named after.

Groups are cut at fixed token positions 0, G, 2G, ... and a token leaves the
fp16 window at a fixed step count, so writing token by token stores exactly
what one big write stores. Under the quantize-on-write protocol a window of
N < R tokens is therefore never quantized: that is KIVI, not a bug.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Quantizer, QuantizerInputError, Segment, fp16_rounding_bound
from .groups import dequantize_groups, group_step_bound, quantize_groups


class KIVI(Quantizer):
    name = "kivi"
    description = "KIVI: per-channel keys / per-token values over groups of G; fp16 key residual T mod R (paper), values last R"
    example_specs = ("kivi:bits=2", "kivi:bits=4")
    aliases = {"kivi2": {"bits": 2}, "kivi4": {"bits": 4}}

    @dataclasses.dataclass
    class Config:
        bits: int = 2
        group: int = 32
        residual: int = 128
        window: str = "paper"  # or "fixed" (see the module docstring)

    def validate_config(self):
        c = self.config
        if not 1 <= c.bits <= 8:
            raise QuantizerInputError(f"kivi: bits must be in 1..8, got {c.bits}")
        if c.group < 1 or c.residual < 0:
            raise QuantizerInputError(f"kivi: need group >= 1 and residual >= 0, got {c}")
        if c.window not in ("paper", "fixed"):
            raise QuantizerInputError(f"kivi: window must be paper or fixed, got {c.window!r}")

    def quantized_tokens(self, total: int) -> int:
        """How many of the first `total` tokens written are quantized (the rest are
        the fp16 window); always a whole number of G-token groups."""
        c = self.config
        if c.window == "paper" and self.role == "K":
            flush = -(-max(c.residual, 1) // c.group) * c.group  # R, rounded up to whole groups
            return total // flush * flush
        return max(0, total - c.residual) // c.group * c.group

    def append(self, packed, x):
        if packed is None:
            return self.encode(x)
        return self.append_windowed(packed, x, self.config.group)  # window: quantized_tokens above

    def encode_tokens(self, x, shared):
        """One full group of G tokens."""
        c = self.config
        if self.role == "K":  # per channel over the G tokens
            return Segment(quantize_groups(x.transpose(2, 3), c.bits, c.group, -1), x.shape[2])
        return Segment(quantize_groups(x, c.bits, self._channel_group(x.shape[-1]), -1), x.shape[2])

    # A K group's codes are packed along its G tokens: groups concatenate byte-wise when
    # G * bits is whole bytes (other widths are encoded and decoded group by group).
    def _key_group_bytes(self) -> int | None:
        c = self.config
        return c.group * c.bits // 8 if c.group * c.bits % 8 == 0 else None

    def encode_groups(self, x, shared, group):
        gb = self._key_group_bytes()
        if self.role == "K" and gb is None:
            return None
        n = x.shape[2] // group
        f = self._encode_segment(x, shared).fields
        if self.role == "V":  # per token: the token axis
            return [Segment({k: v[:, :, i * group : (i + 1) * group] for k, v in f.items()}, group) for i in range(n)]
        return [Segment({"codes": f["codes"][..., i * gb : (i + 1) * gb], "scale": f["scale"][..., i : i + 1],
                         "zero": f["zero"][..., i : i + 1]}, group) for i in range(n)]

    def merge_groups(self, segs):
        c = self.config
        if self.role == "K" and self._key_group_bytes() is None:
            return None
        if any(s.tokens != c.group or set(s.fields) != {"codes", "scale", "zero"} for s in segs):
            return None  # not one-group segments: each is decoded (and rejected) alone
        axis = 2 if self.role == "V" else -1  # values: the token axis; keys: packed along it
        return Segment({k: torch.cat([s.fields[k] for s in segs], dim=axis) for k in ("codes", "scale", "zero")},
                       sum(s.tokens for s in segs))

    def decode_tokens(self, seg, shared, shape):  # window segments are decoded by the base class
        c = self.config
        B, H, T, D = shape
        if self.role == "K":
            return dequantize_groups(seg.fields, c.bits, c.group, -1, (B, H, D, T)).transpose(2, 3)
        return dequantize_groups(seg.fields, c.bits, self._channel_group(D), -1, shape)

    def _channel_group(self, d: int) -> int:
        if d % self.config.group:
            raise QuantizerInputError(f"kivi: group {self.config.group} does not divide head_dim {d}")
        return self.config.group

    def formula_bits(self, head_dim):
        return self.config.bits + 32 / self.config.group  # quantized tokens; the fp16 window adds more

    def error_bound(self, x):
        # Tokens are quantized from their fp16 values: per element, fp16 rounding (the
        # window's whole error; subnormals included) plus half a stored step.
        c = self.config
        n_quant = self.quantized_tokens(x.shape[2])
        elem = fp16_rounding_bound(x)
        if n_quant:
            q = x.half().float()[:, :, :n_quant]
            if self.role == "K":  # per channel over groups of G tokens
                step = group_step_bound(q.transpose(2, 3), c.bits, c.group, -1).transpose(2, 3)
            else:
                step = group_step_bound(q, c.bits, self._channel_group(x.shape[-1]), -1)
            elem = torch.cat([elem[:, :, :n_quant] + step, elem[:, :, n_quant:]], dim=2)
        return elem.norm(dim=-1)
