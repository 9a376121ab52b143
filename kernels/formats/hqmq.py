"""The HQMQ format, with or without Med3x outliers: `HQMQFlat` (kernels/layout.py), its
flatten (the outliers regrouped per (b, h), the outlier index derived), its kernels
(Triton, kernels/triton/hqmq.py; CUDA 12-bit codes r=4 d128, kernels/cuda/hqmq_decode.py).
"""
from __future__ import annotations

import torch

from ...quantizers import Packed, parse_spec
from ...quantizers.hqmq import HQMQ, outlier_block_starts
from ...quantizers.packing import unpack_bits
from ...quantizers.quaternion import hurwitz_units
from ..cuda import hqmq_decode as cuda_hqmq
from ..layout import HQMQFlat, concat_field, normalised_secondaries, whole_blocks
from ..registry import Format, Kernel
from ..triton.hqmq import hqmq_decode_attention


def per_head_outliers(packed: Packed, nc: int):
    """Med3x outliers of every segment as per-(b, h) lists `[B, H, Ocap, 4]` in (t, chunk)
    order, and the per-token outlier counts `[B, H, T]`. Each segment stores its outliers
    in (b, h, t, chunk) order; a stable sort by (b, h) over the segments in time order
    keeps (t, chunk) order within each (b, h)."""
    B, H = packed.batch, packed.heads
    rows, vals, per_tok = [], [], []
    for seg in packed.segments:
        m = unpack_bits(seg.fields["flags"], 1, nc).bool()  # [B, H, Ts, nc]
        per_tok.append(m.sum(-1))
        rows.append(m.nonzero()[:, 0] * H + m.nonzero()[:, 1])
        vals.append(seg.fields["outliers"])
    per_tok = torch.cat(per_tok, dim=2)
    row = torch.cat(rows)
    val = torch.cat(vals)
    order = torch.sort(row, stable=True).indices
    row, val = row[order], val[order]
    n_bh = torch.bincount(row, minlength=B * H)
    first = torch.cumsum(n_bh, 0) - n_bh
    rank = torch.arange(row.numel(), device=row.device) - first[row]
    ocap = whole_blocks(max(1, int(n_bh.max()) if row.numel() else 1))
    out = torch.zeros(B * H, ocap, 4, dtype=torch.float16, device=per_tok.device)
    out[row, rank] = val.to(torch.float16)
    return out.view(B, H, ocap, 4), per_tok


def flatten_hqmq(packed: Packed, role: str | None = None, table_dtype=torch.float32,
                 table_mode: str = "secondaries") -> HQMQFlat:
    cls, cfg = parse_spec(packed.spec)
    if not issubclass(cls, HQMQ):
        raise ValueError(f"flatten_hqmq needs an hqmq cache, got {packed.spec!r}")
    if not packed.segments:
        raise ValueError("empty packed cache")
    q = cls(cfg)
    D = packed.head_dim
    rel = q.radius_levels(torch.ones((), device=packed.device)).float().contiguous()
    flat = HQMQFlat(
        B=packed.batch, H=packed.heads, T=packed.tokens, D=D, S=cfg.S,
        code_bits=q.code_bits, r_bits=cfg.r,
        codes=concat_field(packed, "codes"), radius=concat_field(packed, "radius"), r_max=concat_field(packed, "r_max"),
        table=torch.empty(0), rel=rel, dtype=packed.dtype,
        log_radius=cfg.radius == "log" and cfg.r > 1,
        sec=normalised_secondaries(packed.shared), ptab=hurwitz_units(device=packed.device).contiguous(),
    )
    flat = flat.with_table(table_mode, table_dtype)
    if q.med3:
        flat.flags = concat_field(packed, "flags")
        flat.outliers, per_tok = per_head_outliers(packed, D // 4)
        flat.outlier_index = outlier_block_starts(per_tok)
    return flat


CUDA = Kernel("cuda", lambda q, k, v, **kw: cuda_hqmq.decode(q, k, v, **kw), title="CUDA HQMQ kernel",
              auto=lambda k: cuda_hqmq.auto_refusal(k), options=cuda_hqmq.OPTIONS,
              unsupported=lambda q, k, v: cuda_hqmq.unsupported(q, k, v),
              why_unavailable=lambda: cuda_hqmq.why_unavailable(), renamed=cuda_hqmq.RENAMED)

FORMAT = Format(
    name="hqmq", quantizer=HQMQ, flat=HQMQFlat, flatten=flatten_hqmq,
    kernels=(Kernel("triton", hqmq_decode_attention, title="Triton HQMQ kernel"), CUDA),
    bench={"hqmq": "hqmq:S=96,r=4", "hqmq-med3": "hqmq:S=96,r=4,outliers=med3"},
)
