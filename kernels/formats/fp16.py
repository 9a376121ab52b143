"""The fp16 format: the unquantized cache in the engine (`FP16Flat`, kernels/layout.py),
so a quantized format's speed is read against fp16 in the same store, step encoder,
graphed step and split-K kernel over the valid tokens, not against a framework's cache
(transformers' DynamicCache grows by torch.cat; its StaticCache attends over its whole
masked capacity). Its store field is the values along the tokens; its device step
encoder writes a token as fp16 (kernels/step_encode.py's `fp16_tokens`); its kernel is
Triton (kernels/triton/fp16.py).
"""
from __future__ import annotations

import torch

from ...quantizers import Packed, parse_spec
from ...quantizers.fp16 import FP16
from .. import step_encode
from ..layout import FP16Flat, concat_field
from ..registry import Format, Kernel
from ..triton.fp16 import fp16_decode_attention


def flatten_fp16(packed: Packed, role: str | None = None) -> FP16Flat:
    cls, _ = parse_spec(packed.spec)
    if not issubclass(cls, FP16):
        raise ValueError(f"flatten_fp16 needs an fp16 cache, got {packed.spec!r}")
    return FP16Flat(B=packed.batch, H=packed.heads, T=packed.tokens, D=packed.head_dim,
                    values=concat_field(packed, "values"), dtype=packed.dtype)


def encode_step(store, x: torch.Tensor, errors: torch.Tensor, t0: int, pos=None) -> None:
    """A write of t tokens `[B, H, t, D]` (a decode step: one) as fp16 on the device, into
    the store's buffer at token t0 (or the device position pos)."""
    step_encode.fp16_tokens(x, store.flat.values, t0, errors, pos=pos)


FORMAT = Format(
    name="fp16", quantizer=FP16, flat=FP16Flat, flatten=flatten_fp16, token_fields=("values",), step=encode_step,
    multi_step=True,
    kernels=(Kernel("triton", fp16_decode_attention, title="Triton fp16 kernel", row_start=True),),
    bench={"fp16": "fp16"},
)
