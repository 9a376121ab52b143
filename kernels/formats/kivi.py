"""The KIVI format (keys per channel over G-token groups, values per-token groups, an fp16
window): `KIVIFlat` and its graph view `KIVIGraphFlat` (kernels/layout.py), its flatten,
its kernels (Triton, kernels/triton/kivi.py; CUDA KIVI-2/4 g32 d128,
kernels/cuda/decode_attention.py, host counts only: no valid_len).
"""
from __future__ import annotations

import torch

from ...quantizers import Packed, parse_spec
from ...quantizers.kivi import KIVI
from ..cuda import decode_attention as cuda_decode
from ..layout import KIVIFlat, KIVIGraphFlat
from ..registry import Format, Kernel
from ..triton.kivi import kivi_decode_attention


def flatten_kivi(packed: Packed, role: str | None = "K") -> KIVIFlat:
    cls, cfg = parse_spec(packed.spec)
    if not issubclass(cls, KIVI):
        raise ValueError(f"flatten_kivi needs a kivi cache, got {packed.spec!r}")
    role = role or "K"
    if role not in ("K", "V"):
        raise ValueError(f"role must be K or V, got {role!r}")
    B, H, D = packed.batch, packed.heads, packed.head_dim
    quant = [s for s in packed.segments if "residual" not in s.fields]
    res = [s for s in packed.segments if "residual" in s.fields]
    if len(res) > 1 or (res and packed.segments[-1] is not res[0]):
        raise ValueError("KIVI cache must hold its fp16 window last, once")
    residual = (res[0].fields["residual"] if res else
                torch.zeros(B, H, 0, D, dtype=torch.float16, device=packed.device)).contiguous()
    ng = len(quant)
    codes = scale = zero = None
    if ng:
        join = torch.stack if role == "K" else torch.cat

        def field(name):
            ts = [s.fields[name] for s in quant]
            if role == "K" and name != "codes":
                ts = [t.squeeze(-1) for t in ts]
            return join(ts, dim=2).contiguous()

        codes, scale, zero = field("codes"), field("scale"), field("zero")
    return KIVIFlat(B=B, H=H, D=D, bits=cfg.bits, group=cfg.group, role=role, n_groups=ng,
                    codes=codes, scale=scale, zero=zero, residual=residual, dtype=packed.dtype)


CUDA = Kernel("cuda", lambda q, k, v, **kw: cuda_decode.decode(q, k, v, **kw), title="CUDA KIVI kernel",
              auto=lambda k: cuda_decode.auto_refusal(k), options=cuda_decode.OPTIONS,
              valid_len=False,  # its valid state is two counts per side (kernels/cuda/decode_attention.py)
              unsupported=lambda q, k, v: cuda_decode.unsupported(q, k, v),
              why_unavailable=lambda: cuda_decode.why_unavailable(), renamed=cuda_decode.RENAMED)

FORMAT = Format(
    name="kivi", quantizer=KIVI, flat=(KIVIFlat, KIVIGraphFlat), flatten=flatten_kivi,
    kernels=(Kernel("triton", kivi_decode_attention, title="Triton KIVI kernel"), CUDA),
    bench={"kivi4": "kivi:bits=4", "kivi2": "kivi:bits=2"},
)
