"""The naive int format (per-token groups along the head dim): `IntFlat` (kernels/layout.py),
its flatten, its store fields (codes, scale, zero along the tokens), its device step
encoder (kernels/step_encode.py's `int_rows`), its kernels (Triton,
kernels/triton/naive_int.py; CUDA int4 g32, kernels/cuda/decode_attention.py).
Per-channel key groups are refused (the fused kernels read per-token groups only):
such caches take the dense path.
"""
from __future__ import annotations

import torch

from ...quantizers import Packed, parse_spec
from ...quantizers.naive_int import NaiveInt
from .. import step_encode
from ..cuda import decode_attention as cuda_decode
from ..layout import IntFlat, concat_field
from ..registry import Format, Kernel
from ..triton.naive_int import int_decode_attention


def flatten_int(packed: Packed, role: str | None = None) -> IntFlat:
    cls, cfg = parse_spec(packed.spec)
    if not issubclass(cls, NaiveInt):
        raise ValueError(f"flatten_int needs a naive int cache, got {packed.spec!r}")
    # Decided by the config, not by the fields: per-channel key groups store fields of the
    # same names (codes, scale, zero over channels x G tokens), which read as per-token
    # groups are garbage (an H200 prefill-then-decode row of int4:keys=per-channel went
    # NaN that way). Role None reads as K, as in flatten_kivi.
    if cfg.keys == "per-channel" and role != "V":
        raise ValueError("the fused int kernel reads per-token groups only; keys of "
                         f"{packed.spec!r} are per-channel groups")
    return IntFlat(B=packed.batch, H=packed.heads, T=packed.tokens, D=packed.head_dim, bits=cfg.bits,
                   group=cfg.group, codes=concat_field(packed, "codes"), scale=concat_field(packed, "scale"),
                   zero=concat_field(packed, "zero"), dtype=packed.dtype)


def encode_step(store, x: torch.Tensor, errors: torch.Tensor, t0: int, pos=None) -> None:
    """`quantize_groups` of a write of t tokens `[B, H, t, D]` (a decode step: one) on the
    device, per-token groups of the head dim, into the store's buffers at tokens t0..
    (or the device position pos): one launch, a program per (b*H+h, token)."""
    f = store.flat
    c, sc = f.codes, f.scale
    step_encode.int_rows(x, x.stride()[:4] + (0,), x.shape[2], 1, c, c.stride()[:3] + (0,), sc, f.zero,
                         sc.stride()[:3] + (0,), t0, 0, n=store.D, group=f.group, bits=f.bits,
                         err=errors, tok0=t0, token_rows=True, pos=pos)


CUDA = Kernel("cuda", lambda q, k, v, **kw: cuda_decode.decode(q, k, v, **kw), title="CUDA int4 kernel",
              auto=lambda k: cuda_decode.auto_refusal(k), options=cuda_decode.OPTIONS,
              row_start=True, row_start_auto=lambda: cuda_decode.row_start_refusal("int4"),
              unsupported=lambda q, k, v: cuda_decode.unsupported(q, k, v),
              why_unavailable=lambda: cuda_decode.why_unavailable(), renamed=cuda_decode.RENAMED,
              fast=lambda q, k, v, valid_len=None: cuda_decode.fast(q, k, v, valid_len),
              fits=lambda q, k, v: cuda_decode.fits(q, k, v))

FORMAT = Format(
    name="naive_int", quantizer=NaiveInt, flat=IntFlat, flatten=flatten_int,
    token_fields=("codes", "scale", "zero"), step=encode_step,
    multi_step=lambda q: not q.per_channel,  # (per-channel keys: windowed groups, no fused kernel)
    kernels=(Kernel("triton", int_decode_attention, title="Triton int kernel", row_start=True), CUDA),
    bench={"int4": "int4"},
)
