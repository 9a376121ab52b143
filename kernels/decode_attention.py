"""Fused decode attention over packed KV caches: the one entry point, `decode_attention`,
routing a call to a backend (Triton, kernels/triton/; CUDA C++, kernels/cuda/), and the
torch reference `reference_decode_attention(q, k, v)`.
"""
from __future__ import annotations

import math

import torch

from .layout import FP8Flat, HQMQFlat, IntFlat, KIVIFlat, KIVIGraphFlat
from .triton.fp8 import fp8_decode_attention
from .triton.hqmq import hqmq_decode_attention
from .triton.kivi import kivi_decode_attention
from .triton.naive_int import int_decode_attention


def reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 softmax(q K^T / sqrt(d)) V over every key; q `[B,Hq,1,d]`, k/v `[B,Hkv,T,d]`.
    Returns float32."""
    B, Hq, _, D = q.shape
    g = Hq // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(D)
    return torch.softmax(s, dim=-1) @ vf


_KERNELS = {HQMQFlat: hqmq_decode_attention, IntFlat: int_decode_attention, KIVIFlat: kivi_decode_attention,
            KIVIGraphFlat: kivi_decode_attention, FP8Flat: fp8_decode_attention}


_TRITON_ONLY = ("block_t", "num_warps", "num_stages")  # launch options only the Triton kernels have


_TAKES_VALID_LEN: dict = {}


def _takes_valid_len(fn) -> bool:
    """Whether a CUDA entry point takes `valid_len` (kernels/cuda_decode.py and cuda_hqmq.py
    grow it separately; until then a call with a device length stays on Triton). Cached:
    inspect.signature costs ~10 us, a decode step's budget."""
    hit = _TAKES_VALID_LEN.get(fn)
    if hit is None:
        import inspect

        try:
            hit = "valid_len" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            hit = False
        _TAKES_VALID_LEN[fn] = hit
    return hit


def decode_attention(q: torch.Tensor, k, v, backend: str = "auto", valid_len: torch.Tensor | None = None,
                     **kw) -> torch.Tensor:
    """Dispatch on the flattened cache type. Returns `[B, Hq, 1, d]` in out_dtype
    (default q's dtype); the tensor is the workspace's buffer when one is passed.

    backend: "triton", "cuda" (kernels/cuda_decode.py: int4 with groups of 32, fp8, and
    KIVI-2 / KIVI-4 with groups of 32 at d 128; kernels/cuda_hqmq.py: HQMQ 12-bit codes,
    r=4, d=128, no Med3x; raises where it cannot run) or "auto": the CUDA kernel for the
    formats verified on a GPU and faster there (`cuda_decode.CUDA_VERIFIED`: int4, fp8,
    KIVI; HQMQ when `cuda_hqmq.AUTO`) when it takes the call (`cuda_decode.unsupported`
    is None) and builds here (`cuda_decode.why_unavailable()` says why not), else Triton; Triton's launch options (block_t, num_warps,
    num_stages) select Triton. `programs_per_sm` means CTAs per SM for the CUDA kernel.

    valid_len: None, or an int32 CUDA/CPU tensor of one element on q's device holding the
    number of valid tokens, read by the kernel at run time (so a CUDA graph can replay
    the call while the cache grows); the flats' T is then the capacity bound the launch
    grid is cut for (valid_len <= T; a larger value is clamped to T). Int, fp8 and HQMQ
    (Triton; CUDA where its entry point takes valid_len); KIVI on Triton only, with
    `KIVIGraphFlat` views (`KernelStore.graph_view`: the window policy turns the length
    into each side's group and window counts on the device): the CUDA KIVI kernel
    (kernels/cuda/, `cuda_decode.decode`) takes host counts only, so "auto" sends a KIVI
    call with valid_len to Triton even once cuda_decode.decode takes valid_len for the
    other formats, and "cuda" refuses it. Device lengths for the CUDA KIVI kernel are the
    next step (it would compute the counts from the length by the same policy)."""
    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"backend must be auto, cuda or triton, got {backend!r}")
    if valid_len is not None:
        kw["valid_len"] = valid_len
        if isinstance(k, KIVIFlat):
            if backend == "cuda":
                raise ValueError("the CUDA KIVI kernel takes no valid_len (device lengths): use backend='triton'")
            backend = "triton"
    if backend != "triton" and isinstance(k, (IntFlat, FP8Flat, KIVIFlat)) and q.is_cuda:
        from .cuda import decode_attention as cuda_decode

        if backend == "cuda" or (cuda_decode.takes_by_default(k) and not set(kw) & set(_TRITON_ONLY)
                                 and (valid_len is None or _takes_valid_len(cuda_decode.decode))
                                 and cuda_decode.unsupported(q, k, v) is None and cuda_decode.available()):
            return cuda_decode.decode(q, k, v, **_cuda_kw(kw, cuda_decode.decode))
    elif backend != "triton" and isinstance(k, HQMQFlat) and q.is_cuda:
        from .cuda import hqmq_decode as cuda_hqmq  # HQMQ: kernels/cuda/hqmq_decode.cu (no Med3x: Triton under auto)

        if backend == "cuda" or (cuda_hqmq.takes_by_default(k) and not set(kw) & set(_TRITON_ONLY)
                                 and (valid_len is None or _takes_valid_len(cuda_hqmq.decode))
                                 and cuda_hqmq.unsupported(q, k, v) is None and cuda_hqmq.available()):
            return cuda_hqmq.decode(q, k, v, **_cuda_kw(kw, cuda_hqmq.decode))
    elif backend == "cuda":
        raise ValueError(f"no CUDA kernel for {type(k).__name__} (or q not on a CUDA device)")
    fn = _KERNELS.get(type(k))
    if fn is None:
        raise TypeError(f"no fused kernel for {type(k).__name__}")
    return fn(q, k, v, **kw)


def _cuda_kw(kw: dict, fn) -> dict:
    ckw = dict(kw)
    if "programs_per_sm" in ckw:
        ckw["ctas_per_sm"] = ckw.pop("programs_per_sm")
    if "valid_len" in ckw and not _takes_valid_len(fn):
        raise ValueError(f"{fn.__module__}.decode takes no valid_len yet: use backend='triton'")
    return ckw


__all__ = ["decode_attention", "reference_decode_attention"]
