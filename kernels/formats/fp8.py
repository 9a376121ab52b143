"""The fp8 format (e4m3 / e5m2 codes, a per-kv-head scale): `FP8Flat` (kernels/layout.py),
its flatten (a per-layer scale, fp8's default `[1]`, is broadcast to the `[H]` every kernel reads),
its flatten, its store field (the codes along the tokens; the scale, fitted on the first
write, from its flatten), its device step encoder (kernels/step_encode.py's `fp8_tokens`),
its kernels (Triton, kernels/triton/fp8.py; CUDA, kernels/cuda/decode_attention.py).
"""
from __future__ import annotations

import torch

from ...quantizers import Packed, parse_spec
from ...quantizers.fp8 import FP8
from .. import step_encode
from ..cuda import decode_attention as cuda_decode
from ..layout import FP8Flat, concat_field
from ..registry import Format, Kernel
from ..triton.fp8 import fp8_decode_attention


def flatten_fp8(packed: Packed, role: str | None = None) -> FP8Flat:
    cls, cfg = parse_spec(packed.spec)
    if not issubclass(cls, FP8):
        raise ValueError(f"flatten_fp8 needs an fp8 cache, got {packed.spec!r}")
    return FP8Flat(B=packed.batch, H=packed.heads, T=packed.tokens, D=packed.head_dim, fmt=cfg.format,
                   codes=concat_field(packed, "codes"), scale=packed.shared["scale"].float().expand(packed.heads).contiguous(),
                   dtype=packed.dtype)


def encode_step(store, x: torch.Tensor, errors: torch.Tensor, t0: int, pos=None) -> None:
    """fp8 codes of a one-token write on the device (torch's saturating cast of x / scale),
    into the store's buffer at token t0 (or the device position pos)."""
    f = store.flat
    step_encode.fp8_tokens(x, f.codes, f.scale, f.fmt, t0, errors, pos=pos)


CUDA = Kernel("cuda", lambda q, k, v, **kw: cuda_decode.decode(q, k, v, **kw), title="CUDA fp8 kernel",
              auto=lambda k: cuda_decode.auto_refusal(k), options=cuda_decode.OPTIONS,
              row_start=True, row_start_auto=lambda: cuda_decode.row_start_refusal("fp8"),
              unsupported=lambda q, k, v: cuda_decode.unsupported(q, k, v),
              why_unavailable=lambda: cuda_decode.why_unavailable(), renamed=cuda_decode.RENAMED,
              fast=lambda q, k, v, valid_len=None: cuda_decode.fast(q, k, v, valid_len),
              fits=lambda q, k, v: cuda_decode.fits(q, k, v))

FORMAT = Format(
    name="fp8", quantizer=FP8, flat=FP8Flat, flatten=flatten_fp8, token_fields=("codes",), step=encode_step,
    # a prefill on the device: its scale is fitted before the write (`Quantizer.empty_for`), as
    # `append` fits it, then every token is coded with it, as one-token steps would
    multi_step=True,
    kernels=(Kernel("triton", fp8_decode_attention, title="Triton fp8 kernel", row_start=True), CUDA),
    bench={"fp8": "fp8-e4m3"},
)
