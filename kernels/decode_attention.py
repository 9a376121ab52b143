"""Fused decode attention over packed KV caches: the front. One entry point,
`decode_attention(q, k, v)`, routes each call by table (kernels/registry.py: the format
of the flattened cache's type, and its kernels per backend) to a backend: Triton
(kernels/triton/) or CUDA C++ (kernels/cuda/). `explain_backend(q, k, v)` says which
backend takes a call and why, by the same rules. `reference_decode_attention` is the
torch reference.

Imports run one way: this front -> the registry -> the formats (found at first use) ->
the backends -> kernels/common.py. No backend imports the front or another backend.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import registry


def reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               row_start: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 softmax(q K^T / sqrt(d)) V over every key; q `[B,Hq,1,d]`, k/v `[B,Hkv,T,d]`.
    `row_start` (`[B]`): row b attends to keys from row_start[b] on only (none: zeros).
    Returns float32."""
    B, Hq, _, D = q.shape
    g = Hq // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(D)
    if row_start is not None:
        pos = torch.arange(k.shape[2], device=k.device)
        s = s.masked_fill((pos[None, :] < row_start.to(k.device).long()[:, None])[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key left: 0, as the kernels' combine
    return p @ vf


@dataclasses.dataclass(frozen=True)
class Route:
    """Which backend takes a `decode_attention` call and why (`explain_backend`):
    `declined` holds, for backend="auto", each backend tried before it and why it did not
    take the call (empty when the first one did)."""
    backend: str
    format: str
    reason: str
    declined: dict


def _route(q, k, v, backend: str, options: dict, valid_len, declined: dict | None = None, row_start=None):
    """(the Kernel that takes this call, its Format); raises as decode_attention does."""
    if backend != "auto" and not registry.is_backend(backend):
        raise ValueError(f"backend must be auto or one of {', '.join(sorted(registry.backends()))}, got {backend!r}")
    fmt = registry.format_of_flat(type(k))
    if fmt is None:
        raise TypeError(f"no fused kernel for {type(k).__name__}")
    if backend != "auto":
        kern = fmt.by_backend.get(backend)
        if kern is not None and valid_len is not None and not kern.valid_len:
            takes = [n for n, x in fmt.by_backend.items() if x.valid_len]
            raise ValueError(f"the {kern.name} takes no valid_len (device lengths): use backend="
                             + " or ".join(repr(n) for n in takes))
        if kern is not None and row_start is not None and not kern.row_start:
            takes = [n for n, x in fmt.by_backend.items() if x.row_start]
            raise ValueError(f"the {kern.name} takes no row_start (per-row key starts of a left-padded batch): "
                             "use backend=" + " or ".join(repr(n) for n in takes))
        b = registry.backends()[backend]
        if kern is None or not registry.on_device(q, b.device):
            raise ValueError(f"no {b.title} kernel for {type(k).__name__}"
                             + (f" (or q not on a {b.title} device)" if b.device else ""))
        return kern, fmt
    for kern in fmt.ordered:
        why = kern.declines(q, k, v, options, valid_len, row_start)
        if why is None:
            return kern, fmt
        if declined is not None:
            declined[kern.backend] = why
    raise ValueError(f"no kernel takes this {fmt.name} call: "
                     + "; ".join(f"{b}: {w}" for b, w in (declined or {}).items()))


# The fast route on (host_time.py --breakdown times it off and on in one run). H100,
# 2026-12-06, B=1 T=32k d 128, whole eager call off -> on in one process (the quietest of
# three runs): int4 18.8 -> 17.1 us, fp8 17.4 -> 16.1, KIVI-4 19.6 -> 16.3, HQMQ 19.4 ->
# 16.4, Med3x 19.4 -> 17.6 (reports/latency/host_breakdown_h100_2026-12-06{b,c}.txt); its
# GPU tests (test_cuda_plans.py and the CUDA files) passed.
FAST_ROUTE = True


def _fast(q, k, v, valid_len=None):
    """An eager call's fast route (issue 28: host time per call): the first kernel auto
    tries, when the auto switch routes this cache to it, launches the call through a plan it
    keeps for exactly these layouts (`Kernel.fast`), skipping the route's checks, which that
    plan passed when it was made. None: no such plan (the first call on a layout, another
    switch state, a kernel without a fast route): the route decides. On an eager decode
    step every call after a layout's first takes it. A call with a valid_len takes the plan
    made for a valid_len (its first call routed), which a kernel that reads none never makes."""
    fmt = registry.format_of_flat(type(k))
    if fmt is None:
        return None
    kerns = fmt.ordered
    if not kerns:
        return None
    kern = kerns[0]
    if kern.fast is None or (kern.auto is not None and kern.auto(k)) or (valid_len is not None and not kern.valid_len):
        return None
    return kern.fast(q, k, v) if valid_len is None else kern.fast(q, k, v, valid_len)


def explain_backend(q, k, v, backend: str = "auto", valid_len=None, row_start=None, **options) -> Route:
    """The backend `decode_attention(q, k, v, backend, valid_len=..., row_start=...,
    **options)` runs, and why: the same routing, without the call (it may build a CUDA
    library, as the call would). Raises where the call would refuse the arguments."""
    declined: dict = {}
    kern, fmt = _route(q, k, v, backend, options, valid_len, declined, row_start)
    if backend != "auto":
        reason = f"asked for (backend={backend!r})"
    elif not declined:
        reason = f"auto: the {kern.name} takes the call (tried first of {', '.join(x.backend for x in fmt.ordered)})"
    else:
        reason = "auto: " + "; ".join(f"{b} declines: {w}" for b, w in declined.items())
    return Route(kern.backend, fmt.name, reason, declined)


def decode_attention(q: torch.Tensor, k, v, backend: str = "auto", valid_len: torch.Tensor | None = None,
                     row_start: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the valid tokens of flattened caches k and v (the
    `*Flat`s of kernels/layout.py). Returns `[B, Hq, 1, d]` in out_dtype (default q's
    dtype); the tensor is the workspace's buffer when one is passed.

    Routed by the format of type(k) (kernels/registry.py), whose kernels each say when
    they take a call. backend: a backend by name ("triton"; "cuda": raises where its
    kernel cannot run) or "auto": the formats' kernels in backend order (CUDA first, q on
    a CUDA device), each taking the call unless: its GPU-run switch keeps auto off it
    (CUDA: `cuda.decode_attention.CUDA_VERIFIED`: int4, fp8, KIVI; `cuda.hqmq_decode.AUTO`
    / `AUTO_MED3`), the call carries launch options it does not take (Triton's block_t,
    num_warps, num_stages select Triton), a valid_len it cannot read, a layout it refuses
    (`unsupported`), its library does not build here (`why_unavailable`), or this GPU cannot
    hold the instance it would launch (`fits`: shared memory); Triton takes
    the rest. `explain_backend` says which and why. `programs_per_sm` means CTAs per SM
    for the CUDA kernels.

    row_start: None, or an int32 tensor `[B]` on q's device: batch row b attends to the
    keys at positions >= row_start[b] only (a left-padded batch: its pad counts), read by
    the kernel at run time (a graph replays it for the next batch's pads). A row with no
    key left gets 0. Every built-in kernel takes it (`Kernel.row_start`); "auto" gives
    it to a CUDA kernel once that module's AUTO_ROW_START is set (`Kernel.row_start_auto`;
    before, Triton takes such calls) and "cuda" runs it either way.

    valid_len: None, or an int32 CUDA/CPU tensor of one element on q's device holding the
    number of valid tokens, read by the kernel at run time (so a CUDA graph can replay
    the call while the cache grows); the flats' T is then the capacity bound the launch
    grid is cut for (valid_len <= T; a larger value is clamped to T). Int, fp8 and HQMQ on
    both backends; KIVI with `KIVIGraphFlat` views (`KernelStore.graph_view`: the window
    policy turns the length into each side's group and window counts on the device), on
    both backends ("auto" takes CUDA for them once `cuda.decode_attention.KIVI_VALID_LEN_AUTO`)."""
    if FAST_ROUTE and backend == "auto" and row_start is None and not kw:
        out = _fast(q, k, v, valid_len)
        if out is not None:
            return out
    kern, _ = _route(q, k, v, backend, kw, valid_len, row_start=row_start)
    if valid_len is not None:
        kw["valid_len"] = valid_len
    if row_start is not None:
        kw["row_start"] = row_start
    if kern.renamed:
        kw = {kern.renamed.get(n, n): x for n, x in kw.items()}
    return kern.fn(q, k, v, **kw)


__all__ = ["Route", "decode_attention", "explain_backend", "reference_decode_attention"]
