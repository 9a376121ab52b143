"""CUDA C++ fused decode attention (decode_attention.cu, this folder) for int4, fp8 and
KIVI-2 / KIVI-4 caches: built at first use (library.py), called through ctypes.

Why CUDA and not Triton (reports/kernels/NOTES.md, "CUDA decode kernels"): the mma operand of
p @ V wants pairs of TOKENS in a register; Triton decodes pairs of dims and transposes
the tile through 16-bit shared-memory stores (~2 SASS instructions per element). Here
the packed bytes of two tokens are interleaved by one PRMT before decoding, the
int4 decode is the Triton FAST path's arithmetic (LOP3, HSUB2, HFMA2), and the kernel
loop issues ~2.8 (int4) / ~1.6 (fp8) SASS instructions per element (Triton: 5.3).

Built by library.py (nvcc at first use, once per machine). `why_unavailable()` says why
the CUDA path cannot run here (no CUDA torch, a ROCm torch, no nvcc, a GPU older than
sm_80, a failed build); `decode_attention` then uses the Triton kernels and the reason
stays readable from here. backend="auto" sends the formats in CUDA_VERIFIED here (each
faster than its Triton kernel on the H200: reports/latency/).

Formats: `IntFlat` with 4 bits and groups of 32 (the `int4` spec), head_dim 64, 128 or
256; `FP8Flat` e4m3 / e5m2 (sm_89+), head_dim 64, 128 or 256 (256: the shared-memory
variants only). GQA groups of 1..8 query heads per kv head, and 10, 12, 14, 16 as two CTAs
of half the heads each (launch.head_split). Anything else: `unsupported(q, k, v)` names the
reason (the dispatcher then uses Triton). Numerics as the Triton FAST path: K/V decoded to fp16 with one rounding
of s*x + z (int4), q rounded to fp16 unscaled, the base-2 softmax scale applied to the
fp32 scores, P rounded to fp16, fp32 accumulation.

`KIVIFlat` (2 or 4 bits, groups of 32, head_dim 64, 128 or 256): keys
per channel over 32-token groups (codes along tokens), values per token; the quantized
tokens both sides have go through the same kernel template (a KIVI decode functor), the
fp16 windows' tail through a branch of the same launch (its first splits; direct loads),
one combine (reports/kernels/NOTES.md, "KIVI as a format of the CUDA template").

Variants (`variant=`): 0, 1 hold prefetched tiles in registers; 2..5 stream each
warp's tiles through a cp.async shared-memory pipeline (SMEM_VARIANTS). KIVI has its
own KIVI_VARIANTS (2..9 and 12).

valid_len: the number of valid tokens read on the device, so one captured CUDA graph
serves every decode step (`decode`, `make_workspace`). KIVI takes it with `KIVIGraphFlat`
views (`KernelStore.graph_view`): each side's window policy turns the count into its
quantized tokens and window rows in the kernel, as the Triton kernel does; the grid is cut
for the capacity. backend="auto" takes such calls while KIVI_VALID_LEN_AUTO.

row_start: a left-padded batch's first key per batch row, read on the device (the keys
below it masked, the tiles wholly below it skipped; a row with none left gets 0).
backend="auto" takes such calls while AUTO_ROW_START.

(About 760 lines, on purpose: the host side of one .cu source, three formats of one
template; its launch-argument struct mirrors the .cu's, and its constants keep the GPU
runs that chose them beside them; the fused combine's build and call beside the default's.)
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from ...quantizers.derived import identity
from ..common import PlanCache, Workspace, bh_stride, check_q, sm_count, split_tiles
from ..layout import FP8Flat, IntFlat, KIVIFlat, KIVIGraphFlat
from .launch import (HeadSplitField, RoutedPlan, check_token_counts, follow_tokens, fresh_partials, gqa_refusal,
                     head_split, on_current_stream, residency_refusal, row_start_ptr, workspace_counters)
from .library import FUSED_COMBINE, FUSED_DEFINE, PDL, QTYPE, KernelLibrary, fused_declare

SOURCE = Path(__file__).parent / "decode_attention.cu"
# The numbers behind every default below (variants, splits, switches), run by run, are in
# reports/kernels/NOTES.md, "Defaults of kernels/cuda and the runs that chose them".
# VARIANTS in the .cu: (register stages, min CTAs per SM, shared-memory stages): 0 (2, 1, 0)
# and 1 (3, 3, 0) hold prefetched tiles in registers; 2..5 stream each warp's tiles through a
# cp.async shared-memory pipeline of 4, 3, 6, 8 stages (115-118 registers, no spills).
NUM_VARIANTS = 6
# Variant 6: variant 2's launch with both halves of a GQA group of 10..16 in one CTA (the .cu's
# JOINT_VARIANT, split_kernel HH = 2: K and V decoded once for 16 heads; int4 / fp8 at head dim
# 64 / 128). Offline, sm_90a: an int4 d 128 tile 530 instructions for 16 heads against 2 x 419
# as two CTAs, fp8 369 against 2 x 259, 177-190 registers (no spills): 2 CTAs per SM, not 4.
# By request only (variant=6): on an H100 (gqa 16, d 128, T=32k, graphed; 2026-12-08) int4 was
# 1.03x the two-CTA launch's speed at B=8 and 0.84x at B=1, fp8 0.97x / 0.86x (HQMQ's joint
# variant, 1.67x / 1.24x, became its default; reports/latency/h100_2026-12-08/).
JOINT_VARIANT = 6
SMEM_VARIANTS = (2, 3, 4, 5)
# KIVI's own variants (KVARIANTS in the .cu): 2, 3, 4 stream whole 32-token groups per stage;
# 5, 6 one-tile stages; 7, 8, 9 a group's two tiles in one step (one softmax pass per group);
# 12 KIVI-2 in the lane-byte map (a lane's 4 tokens of a group in one byte) with 8's decode.
# 10 and 11 (a folded zero point) are gone: their error at T = 131072 passed the 3e-3 every
# variant is tested to; the launcher refuses variants not listed here.
KIVI_VARIANTS = (2, 3, 4, 5, 6, 7, 8, 9, 12)
# by format: int4, fp8 e4m3, fp8 e5m2, KIVI: the fastest of each at B=8 and B=1, T=32k, on the H200
DEFAULT_VARIANT = {0: 2, 1: 2, 2: 2, "kivi": 12}
# Default split count (ctas_per_sm=None): about TILES_PER_SPLIT 16-token tiles per split, but at
# least MIN_CTAS_PER_SM CTAs per SM (the measured optima: ~62 tiles per split at B=8 and B=1);
# KIVI's quantized part streams groups, ~128 tiles per split.
TILES_PER_SPLIT = 64
MIN_CTAS_PER_SM = 2
KIVI_TILES_PER_SPLIT = 128
DEFAULT_CTAS_PER_SM = None
# THE SWITCH the lead flips after a GPU run: the formats whose CUDA kernels passed the GPU tests
# and beat Triton. backend="auto" routes only these here; backend="cuda" takes every format
# `unsupported` accepts.
CUDA_VERIFIED = {"int4", "fp8", "kivi"}
# Head dims the kernels take (HEAD_DIMS), and those backend="auto" routes here per format
# (VERIFIED_HEAD_DIMS: passed the GPU tests). Head dim 256 runs 8 warps as 4 pairs, each warp
# d = 128's code on its half of the dims, the pair's partial scores added through shared memory
# (doubling the per-thread arrays instead cost 165-217 registers).
HEAD_DIMS = (64, 128, 256)
VERIFIED_HEAD_DIMS = {"int4": (64, 128, 256), "fp8": (64, 128, 256), "kivi": (64, 128, 256)}
# The register-path variants (0, 1) read whole token rows (no warp-pair split), so the .cu
# has no head_dim 256 instance of them; nor of KIVI's tile stream (5, 6) off d = 128, whose
# stage layout is d = 128's.
HEAD_256_VARIANTS = SMEM_VARIANTS
KIVI_TILE_STREAM = (5, 6)
# KIVI graph views with a device count (the kernel derives each side's counts from it by the
# window policies): auto takes them since their GPU tests passed (test_cuda_decode.py
# "kivi_valid_len"); off, auto leaves them to Triton and backend="cuda" takes them.
KIVI_VALID_LEN_AUTO = True
# Left-padded batches (row_start: each batch row's first key, read on the device; keys below
# it masked, tiles wholly below it skipped as Triton skips them): backend="cuda" takes them for
# every format; auto too while this is on (every format passed its GPU tests and beat Triton
# with row_start once the pad tiles were skipped; figures: NOTES.md, "Defaults").
AUTO_ROW_START = True


def row_start_refusal(name: str) -> str | None:
    """Why backend="auto" keeps a call of format `name` with row_start off these kernels
    (None: it does not)."""
    if AUTO_ROW_START:
        return None
    return f"row_start: cuda.decode_attention.AUTO_ROW_START is False ({name}: backend='cuda' takes it)"


_FORMAT = {IntFlat: "int4", FP8Flat: "fp8", KIVIFlat: "kivi", KIVIGraphFlat: "kivi"}  # cache type -> CUDA_VERIFIED name


def _declare(lib) -> str | None:
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.kvq_args_size.restype = I
    if lib.kvq_args_size() != ctypes.sizeof(_Args):  # a struct out of step with the .cu: refuse, never misread
        return f"HostArgs is {lib.kvq_args_size()} bytes in the library, _Args {ctypes.sizeof(_Args)}"
    lib.kvq_run.argtypes = [P, P, P, P, P, P, P, P, P]
    lib.kvq_run.restype = I
    lib.kvq_num_regs.argtypes = [I, I, I]
    lib.kvq_num_regs.restype = I
    lib.kvq_num_regs_kivi.argtypes = [I, I, I, I]
    lib.kvq_num_regs_kivi.restype = I
    for name in ("kvq_occupancy", "kvq_occupancy_kivi"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [I, I, I], I
    lib.kvq_set_pdl.argtypes = [I]
    lib.kvq_set_pdl.restype = None
    PDL.attach(lib.kvq_set_pdl)  # (the combine as the split kernel's programmatic dependent: library.py)
    return None


_LIB = KernelLibrary(SOURCE, "kvq_decode", _declare)
_FUSED = KernelLibrary(SOURCE, "kvq_decode_fused",  # built at the first fused call
                       fused_declare("kvq_fused_build", "kvq_run_fused", _declare), FUSED_DEFINE)
_load = _LIB.load
why_unavailable = _LIB.why_unavailable


def available() -> bool:  # through the module's why_unavailable, as before KernelLibrary (tests stub it)
    return why_unavailable() is None


def num_regs(fmt: int, head_dim: int, variant: int = 0, fused: bool = False) -> int:
    lib = _FUSED.load() if fused else _load()  # (fused: the instances of the fused build)
    return -1 if lib is None else lib.kvq_num_regs(fmt, head_dim, variant)


def num_regs_kivi(bits: int, tail: bool = False, variant: int = 2, head_dim: int = 128, fused: bool = False) -> int:
    """Registers per thread of the KIVI instances (tail=True: the window-tail path, a
    branch of the variant-2 kernel)."""
    lib = _FUSED.load() if fused else _load()
    return -1 if lib is None else lib.kvq_num_regs_kivi(bits, int(tail), variant, head_dim)


def occupancy(k, variant: int | None = None) -> int:
    """CTAs of the instance a call on cache `k` launches (its format and head dim; variant:
    the default one if None) resident per SM: the CUDA occupancy query after the shared-memory
    opt-in; < 0 when unavailable (no library, no such instance, an opt-in this GPU refuses)."""
    lib = _load()
    if lib is None or format_name(k) is None:
        return -1
    if isinstance(k, KIVIFlat):
        variant = DEFAULT_VARIANT["kivi"] if variant is None else variant
        key = ("kivi", k.bits, variant, k.D)
    else:
        fmt = 0 if isinstance(k, IntFlat) else 1 if k.fmt == "e4m3" else 2
        variant = DEFAULT_VARIANT[fmt] if variant is None else variant
        key = (fmt, variant, k.D)
    if key not in _OCC:
        _OCC[key] = (lib.kvq_occupancy_kivi(k.bits, variant, k.D) if key[0] == "kivi"
                     else lib.kvq_occupancy(fmt, k.D, variant))
    return _OCC[key]


_OCC: dict = {}


def fits(q: torch.Tensor, k, v) -> str | None:
    """Why this GPU cannot hold the default instance a call on these caches launches (None:
    it can): e.g. the head-dim-256 stages (up to SMEM256, 192 KB a CTA) past an Ada GPU's
    99 KB opt-in; auto then takes Triton. Asked after the library loaded (kernels/registry.py
    `Kernel.fits`), as cuda.hqmq_decode.fits."""
    if format_name(k) is None or _LIB.lib is None or not torch.cuda.is_available():
        return None  # (no library: why_unavailable said so; a CPU process launches nothing)
    return residency_refusal(occupancy(k), f"the default {format_name(k)} instance at head_dim {k.D}", q.device)


def variants(k) -> tuple[int, ...]:
    """The launch variants with an instance for this cache type and head dim."""
    if isinstance(k, KIVIFlat):
        return tuple(v for v in KIVI_VARIANTS if k.D == 128 or v not in KIVI_TILE_STREAM)
    return tuple(range(NUM_VARIANTS)) if k.D <= 128 else HEAD_256_VARIANTS


def head_dim_reason(D: int) -> str | None:
    """Why the kernels have no instance for this head dim (None: they have one)."""
    if D not in HEAD_DIMS:
        return f"head_dim {D} (the CUDA kernels take {', '.join(map(str, HEAD_DIMS))})"
    return None


def _aligned(t: torch.Tensor, stride_bytes: int, n: int) -> bool:
    return t.data_ptr() % n == 0 and stride_bytes % n == 0


def unsupported(q: torch.Tensor, k, v) -> str | None:
    """Why the CUDA kernels cannot take this call (None: they can). Does not build.
    (A layout a default-options call has planned already is taken without re-checking:
    decode_attention's auto route asks this on every call.)"""
    if type(k) in _FORMAT and type(v) is type(k) and q.is_cuda and _PLANS.plans:
        # (a KIVI graph view is planned for a device count: the only call it takes)
        graph = _is_graph(k, v)
        plan = _find(q, k, v, None, DEFAULT_CTAS_PER_SM, None, None, graph)
        if plan is not None and (graph or k.T == v.T):  # (counts are out of the key: see _flat_key)
            ROUTED.offer(q, k, v, (None, DEFAULT_CTAS_PER_SM, None, None, graph), plan)
            return None
    if not q.is_cuda:
        return "q is not on a CUDA device"
    if q.dtype not in QTYPE:
        return f"q dtype {q.dtype}"
    if type(k) is not type(v) or not isinstance(k, (IntFlat, FP8Flat, KIVIFlat)):
        return f"no CUDA kernel for {type(k).__name__}"
    if isinstance(k, KIVIFlat):
        return _kivi_unsupported(q, k, v)
    D, H = k.D, k.H
    why = head_dim_reason(D)
    if why:
        return why
    why = gqa_refusal(q, H)
    if why:
        return why
    row_align = 16  # cp.async copies 16-byte chunks of codes (rows are 32..128 bytes)
    if isinstance(k, IntFlat):
        for f in (k, v):
            if f.bits != 4 or f.group != 32:
                return f"int{f.bits} g{f.group} (the CUDA kernel takes int4 with groups of 32)"
            if f.scale.dtype != torch.float16 or f.zero.dtype != torch.float16 or f.codes.dtype != torch.uint8:
                return "int scale/zero must be fp16, codes uint8"
            if f.zero.stride() != f.scale.stride():
                return "int scale and zero buffers must share a layout"
            if any(t.data_ptr() % (D // 16) for t in (f.scale, f.zero)):  # cp.async: one token's NG fp16
                return f"int scale/zero not {D // 16}-byte aligned"
            try:
                cs = bh_stride(f.codes, "codes")
                bh_stride(f.scale, "scale")
            except ValueError as e:
                return str(e)
            if not _aligned(f.codes, cs, row_align):
                return f"codes not {row_align}-byte aligned"
    else:
        if torch.cuda.get_device_capability(q.device) < (8, 9):
            return "fp8 conversions need sm_89+"
        for f in (k, v):
            try:
                cs = bh_stride(f.codes, "codes")
            except ValueError as e:
                return str(e)
            if not _aligned(f.codes, cs, row_align):
                return f"codes not {row_align}-byte aligned"
    return None


def _is_graph(k, v) -> bool:
    """Both sides KIVI graph views with their window policies (a device count's call)."""
    return type(k) is KIVIGraphFlat and type(v) is KIVIGraphFlat and bool(k.policy) and bool(v.policy)


def _kivi_unsupported(q: torch.Tensor, k, v) -> str | None:
    if k.role != "K" or v.role != "V":
        return "pass the keys' KIVIFlat (role K) then the values' (role V)"
    why = head_dim_reason(k.D)
    if why:
        return why
    if (k.bits, k.group) != (v.bits, v.group) or k.bits not in (2, 4) or k.group != 32:
        return f"kivi {k.bits}/{v.bits} bits, groups {k.group}/{v.group} (the CUDA kernel takes 2 or 4 bits, groups of 32)"
    graph = _is_graph(k, v)  # every buffer may be read up to the capacity: all are checked
    if graph:
        if k.capacity != v.capacity or k.codes is None or v.codes is None:
            return "K and V KIVI graph views differ in capacity or have no group buffers"
        if k.policy[1] % 32 or v.policy[1] % 32:  # a flush quantizes P tokens: whole groups
            return f"KIVI window policies {k.policy} / {v.policy} (the CUDA kernel takes flushes of whole 32-token groups)"
    elif (v.T, type(v)) != (k.T, type(k)):
        return "K and V KIVI caches differ in length or type"
    if (v.B, v.H, v.D) != (k.B, k.H, k.D):
        return "K and V KIVI caches differ in shape"
    why = gqa_refusal(q, k.H)
    if why:
        return why
    for f, role in ((k, "K"), (v, "V")):
        if f.residual.dtype != torch.float16 or ((graph or f.T_res) and f.residual.data_ptr() % 16):
            return f"{role} window must be fp16, 16-byte aligned"
        if graph or f.T_res:
            try:
                rs = bh_stride(f.residual, f"{role} window")
            except ValueError as e:
                return str(e)
            if rs % 8:
                return f"{role} window head stride not 16-byte aligned"
        if graph or f.n_groups:
            if f.codes.dtype != torch.uint8 or f.scale.dtype != torch.float16 or f.zero.dtype != torch.float16:
                return "kivi codes must be uint8, scale/zero fp16"
            if f.zero.stride() != f.scale.stride():
                return "kivi scale and zero buffers must share a layout"
            try:
                cs, ss = bh_stride(f.codes, f"{role} codes"), bh_stride(f.scale, f"{role} scale")
            except ValueError as e:
                return str(e)
            if not _aligned(f.codes, cs, 16):
                return f"{role} codes not 16-byte aligned"
            if any(t.data_ptr() % 16 for t in (f.scale, f.zero)) or (2 * ss) % 16:
                return f"{role} scale/zero not 16-byte aligned"
    return None


def splits(rows: int, T: int, device, num_splits: int | None = None,
           ctas_per_sm: int | None = DEFAULT_CTAS_PER_SM, tiles_per_split: int = TILES_PER_SPLIT) -> tuple[int, int]:
    """(number of splits, 16-token tiles per split), every split non-empty: num_splits
    if given, else about ctas_per_sm CTAs per SM if given, else about tiles_per_split
    tiles per split with at least MIN_CTAS_PER_SM CTAs per SM."""
    sms = sm_count(device)
    return split_tiles(rows, T, sms, num_splits, ctas_per_sm, lambda tiles: max(
        -(-tiles // tiles_per_split), math.ceil(MIN_CTAS_PER_SM * sms / max(1, rows))))


def format_name(k) -> str | None:
    """The CUDA_VERIFIED name of a cache type ("int4", "fp8", "kivi"), None if none."""
    return _FORMAT.get(type(k))


def auto_refusal(k) -> str | None:
    """Why backend="auto" does not route this cache here (None: it does): its format is
    not in CUDA_VERIFIED, or its head dim not in VERIFIED_HEAD_DIMS."""
    name = format_name(k)
    if name is None:
        return f"no CUDA kernel for {type(k).__name__}"
    if name not in CUDA_VERIFIED:
        return f"{name} is not in cuda.decode_attention.CUDA_VERIFIED"
    if k.D not in HEAD_DIMS:  # (no instance: Triton serves it, padded when not a power of two)
        return f"no CUDA kernel at head_dim {k.D} (the CUDA kernels take {', '.join(map(str, HEAD_DIMS))})"
    if k.D not in VERIFIED_HEAD_DIMS.get(name, ()):
        return (f"{name} at head_dim {k.D} is not in cuda.decode_attention.VERIFIED_HEAD_DIMS "
                f"(not yet run on a GPU; backend='cuda' takes it)")
    if type(k) is KIVIGraphFlat and not KIVI_VALID_LEN_AUTO:
        return ("KIVI graph views (device counts) wait for their GPU tests "
                "(cuda.decode_attention.KIVI_VALID_LEN_AUTO; backend='cuda' takes them)")
    return None


def takes_by_default(k) -> bool:
    """Whether backend="auto" routes this cache type here (CUDA_VERIFIED)."""
    return auto_refusal(k) is None


# decode_attention's options `decode` takes (valid_len apart), and the ones it names otherwise
OPTIONS = frozenset({"num_splits", "programs_per_sm", "ctas_per_sm", "variant", "workspace", "out_dtype"})
RENAMED = {"programs_per_sm": "ctas_per_sm"}


# ---------------------------------------------------------------------------------------
# the call path. At B=1 a decode call's time is host time (KIVI: 67.5 us eager vs 37.8 us as
# a CUDA graph on the H200), so what does not change between calls -- the checks, strides,
# split plan and the ~35 launch arguments -- is computed once per cache layout and kept in
# a plan (a ctypes struct the C side reads: kvq_run takes one pointer plus the per-call q,
# valid count, workspace and stream).
# ---------------------------------------------------------------------------------------
class _Args(HeadSplitField, ctypes.Structure):  # mirrors HostArgs in decode_attention.cu (checked by kvq_args_size)
    _fields_ = ([(n, ctypes.c_void_p) for n in ("kc", "ks", "kz", "kr", "vc", "vs", "vz", "vr", "khs", "vhs")]
                + [(n, ctypes.c_longlong) for n in ("k_cs", "k_ss", "k_rs", "v_cs", "v_ss", "v_rs")]
                + [(n, ctypes.c_int) for n in ("kind", "fmt", "D", "qtype", "otype", "variant", "B", "Hkv", "gqa", "T",
                                               "per", "nsplit", "TQK", "TQV", "n_main", "per_main", "nsplit_main",
                                               "per_tail", "nsplit_tail", "KA", "KP", "VA", "VP", "qsh")]
                + [("qk_scale", ctypes.c_float)])


class _Plan:
    """What a call on one cache layout launches: the argument struct, the split count and
    the workspace size (`_PLANS` keeps it while the cache tensors it points into live);
    `counts`: a host-count KIVI plan's counts it was last set to (`_kivi_counts`)."""
    __slots__ = ("keep", "args", "ptr", "nsplit", "rows_q", "D", "shape", "out_dtype", "kind", "splits_asked",
                 "counts")


_PLANS = PlanCache(64)  # layouts kept (kernels/common.py: while their tensors live, cleared when full)
# The plan the auto route's check found, handed to the same call's launch (launch.py
# RoutedPlan; test_cuda_plans.py checks the route's offer is what the launch takes). On an
# H100 (host_time --breakdown, B=1, T=32768, d=128, off then on in one run, 2026-12-06) an
# eager call's host time went int4 24.3 -> 22.8 us, fp8 23.7 -> 22.1, KIVI-4 28.7 -> 25.0,
# HQMQ 27.4 -> 25.1; the CUDA tests passed with it on.
ROUTED = RoutedPlan(enabled=True)


def _flat_key(f, device_count: bool):
    """(tensors a plan reads, the ints that place the valid tokens in them) of a flat
    (device_count: a KIVI graph view's call with valid_len, placed by its policy and capacity).
    int4 / fp8: not the token count (a kept plan follows it: `_retarget`, launch.py
    `follow_tokens`). KIVI: whether each side has quantized groups and window rows (which
    buffers the plan points into), not their counts."""
    if type(f) is IntFlat:
        return (f.codes, f.scale, f.zero), (f.B, f.H, f.D, f.bits, f.group)
    if type(f) is FP8Flat:
        return (f.codes, f.scale), (f.B, f.H, f.D, f.fmt)
    counts = (f.policy, f.capacity) if device_count else (f.n_groups > 0, f.T_res > 0)
    return (f.codes, f.scale, f.zero, f.residual), (f.B, f.H, f.D, f.bits, f.group, f.role, *counts)


def _lookup(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count: bool = False):
    """(the cached plan of this call or None, its key, the tensors it reads)."""
    tk, ik = _flat_key(k, device_count)
    tv, iv = _flat_key(v, device_count)
    ts = tk + tv
    key = (type(k), ik, iv, tuple(map(identity, ts)), q.dtype, q.shape, q.device, num_splits, ctas_per_sm, variant,
           out_dtype, device_count)
    return _PLANS.get(key), key, ts


def _find(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count: bool = False):
    """The cached plan of this call or None: the memo on k (PlanCache.memo_get: its facts are
    what the key holds besides the flats' stamped fields; a host-count KIVI key's which
    counts are nonzero), else the full key."""
    facts = (q.dtype, q.shape, q.device, num_splits, ctas_per_sm, variant, out_dtype, device_count)
    if not device_count and type(k) is not IntFlat and type(k) is not FP8Flat:  # (as _flat_key: KIVI)
        facts += (k.n_groups > 0, k.T_res > 0, v.n_groups > 0, v.T_res > 0)
    return _PLANS.find(k, v, facts, _lookup, q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count)


def _plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count: bool = False) -> _Plan:
    if type(k) not in _FORMAT or type(v) is not type(k):
        raise ValueError(f"CUDA decode kernel: no CUDA kernel for {type(k).__name__}/{type(v).__name__}")
    if device_count and isinstance(k, KIVIFlat) and not _is_graph(k, v):
        raise ValueError("valid_len: KIVI takes a device count only with KIVIGraphFlat views (the window policies "
                         "that split it into groups and window rows: KernelStore.graph_view)")
    if not device_count and _is_graph(k, v):
        raise ValueError("a KIVI graph view needs valid_len: its group and window counts follow the device length")
    device_count = device_count and isinstance(k, KIVIFlat)  # (int4 / fp8: the same plan either way)
    plan = ROUTED.take(q, k, v, (num_splits, ctas_per_sm, variant, out_dtype, device_count))
    if plan is None:
        plan = _find(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count)
        if plan is None:
            _, key, ts = _lookup(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count)
            return _PLANS.put(key, ts, _build_plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count))
    return _fit(plan, q, k, v, device_count)


def _fit(plan, q, k, v, device_count: bool) -> _Plan:
    """A kept plan set to this call's counts (they are out of the key)."""
    if _moved(plan, k, v, device_count):
        _retarget(plan, q, k, v)
    return plan


def _moved(plan, k, v, device_count: bool) -> bool:
    """Whether this call's counts differ from those its kept plan was last set to: int4 / fp8
    more (or fewer) tokens of the same buffers, host-count KIVI other group / window counts."""
    if plan.kind == 0:
        return plan.args.T != k.T
    return not device_count and _kivi_moved(plan, k, v)


def fast(q: torch.Tensor, k, v, valid_len=None) -> torch.Tensor | None:
    """decode_attention's fast route (kernels/decode_attention.py `_fast`: backend="auto",
    no options or row_start, the auto switch routing this format here): the
    call launched by the plan kept for exactly its layouts, None when none is kept (the
    route then decides, as before). Every check the route makes held when the plan was
    built (a build runs `unsupported`, and raises where it refuses) and holds while the
    key's tensors live: the key is their identities, the flats' shapes and formats, and q's shape,
    dtype and device. What the key leaves out is checked here as `unsupported`'s planned
    branch checks it (K and V of one T; a KIVI graph view needs a valid_len and a host-count
    KIVI flat takes none: the route). valid_len: checked by the launch, as a routed call's."""
    if type(v) is not type(k) or not _PLANS.plans:
        return None
    graph = _is_graph(k, v)
    if graph != (valid_len is not None) and (graph or type(k) not in (IntFlat, FP8Flat)):
        return None
    plan = _find(q, k, v, None, DEFAULT_CTAS_PER_SM, None, None, graph)
    if plan is None:
        return None
    if plan.kind == 0:
        T = k.T
        if T != v.T:
            return None
        if plan.args.T != T:  # (an eager decode step)
            _retarget(plan, q, k, v)
    elif not graph:  # (KIVI counts a plan holds are of one T: unmoved, read no further)
        counts = _kivi_counts(k, v)
        if counts != plan.counts and not _kivi_follow(plan, q, k, v, counts):
            return None
    return _launch(plan, q, valid_len, None)


def _kivi_counts(k, v) -> tuple:
    """What fixes a host-count KIVI call's lengths on its plan's buffers: each side's groups
    and window rows (n_res None: all rows of the window buffer, whose tensor is in the key)."""
    return k.n_groups, k.n_res, v.n_groups, v.n_res


def _kivi_moved(plan, k, v) -> bool:
    """Whether a host-count KIVI call's counts differ from those its plan was last set to
    (`counts`; plain fields: the length properties cost an eager call ~1 us in the CUDA path
    walked on a 2-core CPU, 2026-12-06). The plan's counts passed `check_token_counts` (K
    and V of one T), so K and V of different T always read as moved, and the retarget
    refuses them."""
    return plan.counts != _kivi_counts(k, v)


def _host_lengths(k, v) -> tuple[int, int]:
    """(n_main, tail tokens) of a host-count KIVI call: the tokens both sides hold quantized,
    and the rest (`kivi_plan` cuts these)."""
    n_main = min(k.T_quant, v.T_quant)
    return n_main, k.T - n_main


def _kivi_cut(n_main: int, T: int) -> tuple:
    """All of a host-count call's counts that `kivi_plan`'s cut reads: n_main and the tail's
    16-token tiles (0: no tail; T >= n_main). Calls alike in it are cut alike (a retarget
    then sets the lengths only: most decode steps)."""
    return n_main, (T - n_main + 15) >> 4  # (token_tiles(T - n_main) where T > n_main, else 0)


def _kivi_token_fields(a, k, v, device, num_splits, ctas_per_sm, device_count: bool) -> int:
    """The launch fields that follow a KIVI call's counts (host counts; a graph view's
    device count: its capacity cut): T, the quantized lengths, the main / tail cut and
    their splits (the only ones: `_retarget` relies on it). Returns nsplit."""
    n_main, (ns_m, per_m), (ns_t, per_t) = kivi_plan(k, v, device, num_splits, ctas_per_sm, device_count, a.qs)
    if not device_count:
        a.T, a.TQK, a.TQV, a.n_main = k.T, k.T_quant, v.T_quant, n_main
    a.per_main, a.nsplit_main, a.per_tail, a.nsplit_tail = per_m, ns_m, per_t, ns_t
    a.nsplit = ns_m + ns_t
    return a.nsplit


def _row_variant(variant: int | None, fmt: int, k, group: int) -> int:
    """The int4 / fp8 variant a call launches (the format's default if None), or ValueError
    naming why not: out of range, no instance at the head dim, or JOINT_VARIANT for a GQA
    group it does not take (10..16 at head dim 64 / 128 only)."""
    variant = DEFAULT_VARIANT[fmt] if variant is None else variant
    if variant == JOINT_VARIANT:
        if head_split(group) != 2 or k.D > 128:
            raise ValueError(f"variant {JOINT_VARIANT} (both q-head halves in one CTA) takes GQA groups of 10, 12, 14, "
                             f"16 at head_dim 64 / 128; this call: a group of {group} at head_dim {k.D}")
    elif not 0 <= variant < NUM_VARIANTS:
        raise ValueError(f"variant must be in 0..{NUM_VARIANTS - 1} (or {JOINT_VARIANT} for GQA groups over 8)")
    elif variant not in variants(k):
        raise ValueError(f"variant {variant} has no instance at head_dim {k.D} (variants: {variants(k)})")
    return variant


def _token_fields(a, k, device, num_splits, ctas_per_sm):
    """The launch fields that follow the token count T of an int4 / fp8 call: T, the split
    count and tiles per split (the only ones: `_retarget` relies on it). Returns nsplit."""
    rows = k.B * k.H * (1 if a.variant == JOINT_VARIANT else a.qs)  # (the grid's rows: CTAs per split)
    nsplit, per = splits(rows, k.T, device, num_splits, ctas_per_sm)
    a.T, a.per, a.nsplit = k.T, per, nsplit
    return nsplit


def _retarget(plan, q, k, v) -> None:
    """A kept plan set to this call's token count: int4 / fp8 by launch.py `follow_tokens`;
    KIVI its group and window counts (the split fields re-cut only when `_kivi_cut` moves
    from the cut the struct holds). The rest of a plan is alike for every count of the same
    buffers."""
    if plan.kind == 0:
        follow_tokens(plan, k.T, v.T, _token_fields, plan.args, k, q.device, *plan.splits_asked)
    elif not _kivi_follow(plan, q, k, v, _kivi_counts(k, v)):
        check_token_counts(k.T, v.T)  # (raises: K and V of different T, or none)


def _kivi_follow(plan, q, k, v, counts) -> bool:
    """A host-count KIVI plan set to the call's `counts` (`_kivi_counts(k, v)`), each length
    read once: T is T_quant + T_res, T_quant n_groups * group. False, the plan untouched,
    where K and V hold different T or none (the caller refuses them)."""
    tqk, tqv = counts[0] * k.group, counts[2] * v.group
    T = tqk + k.T_res
    if T != tqv + v.T_res or T == 0:
        return False
    a = plan.args
    if _kivi_cut(min(tqk, tqv), T) == _kivi_cut(a.n_main, a.T):  # (min: _host_lengths' n_main)
        a.T, a.TQK, a.TQV = T, tqk, tqv
    else:
        plan.nsplit = _kivi_token_fields(a, k, v, q.device, *plan.splits_asked, False)
    plan.counts = counts
    return True


def _build_plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, device_count: bool = False) -> _Plan:
    B, H, T, D = k.B, k.H, k.T, k.D
    if device_count:
        T = k.capacity  # (K and V of one capacity: unsupported checks it)
    check_q(q, H, D, B)
    if (v.B, v.H, v.D) != (B, H, D) or (not device_count and v.T != T):
        raise ValueError("K and V caches differ in shape")
    why = unsupported(q, k, v)
    if why:
        raise ValueError(f"CUDA decode kernel: {why}")
    if T == 0:
        raise ValueError("empty cache (T = 0)")
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CUDA decode kernels unavailable: {_LIB.why}")
    out_dtype = out_dtype or q.dtype
    if out_dtype not in QTYPE:
        raise ValueError(f"out dtype {out_dtype}")
    Hq = q.shape[1]
    a = _Args()
    a.qs = head_split(Hq // H)  # (>= 1: unsupported took the group)
    a.D, a.qtype, a.otype, a.B, a.Hkv, a.gqa, a.T = D, QTYPE[q.dtype], QTYPE[out_dtype], B, H, Hq // H // a.qs, T
    a.qk_scale = 1.4426950408889634 / math.sqrt(D)
    keep = []
    if isinstance(k, KIVIFlat):
        variant = DEFAULT_VARIANT["kivi"] if variant is None else variant
        if variant not in variants(k):
            raise ValueError(f"KIVI takes the shared-memory variants {variants(k)} at head_dim {D}, got {variant}")
        a.kind, a.fmt = 1, k.bits
        for f, role, pre in ((k, "K", "k"), (v, "V", "v")):
            if f.n_groups or device_count:  # else never read: no quantized token on this side
                setattr(a, pre + "c", f.codes.data_ptr())
                setattr(a, pre + "s", f.scale.data_ptr())
                setattr(a, pre + "z", f.zero.data_ptr())
                setattr(a, pre + "_cs", bh_stride(f.codes, f"{role} codes"))
                setattr(a, pre + "_ss", bh_stride(f.scale, f"{role} scale"))
            if f.T_res or device_count:
                setattr(a, pre + "r", f.residual.data_ptr())
                setattr(a, pre + "_rs", bh_stride(f.residual, f"{role} window"))
        if device_count:  # the kernel derives TQK, TQV, n_main from the count
            (a.KA, a.KP), (a.VA, a.VP) = k.policy, v.policy
        nsplit = _kivi_token_fields(a, k, v, q.device, num_splits, ctas_per_sm, device_count)
    else:
        if isinstance(k, IntFlat):
            a.kind, a.fmt = 0, 0
            a.kc, a.ks, a.kz = k.codes.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr()
            a.vc, a.vs, a.vz = v.codes.data_ptr(), v.scale.data_ptr(), v.zero.data_ptr()
            a.k_cs, a.k_ss, a.v_cs, a.v_ss = bh_stride(k.codes), bh_stride(k.scale), bh_stride(v.codes), bh_stride(v.scale)
        else:
            if k.fmt != v.fmt:
                raise ValueError("K and V fp8 caches differ in format")
            a.kind, a.fmt = 0, 1 if k.fmt == "e4m3" else 2
            ks, vs = k.scale.float().contiguous(), v.scale.float().contiguous()
            keep += [ks, vs]  # (the same tensors when already fp32 and contiguous, as FP8Flat keeps them)
            a.kc, a.vc, a.khs, a.vhs = k.codes.data_ptr(), v.codes.data_ptr(), ks.data_ptr(), vs.data_ptr()
            a.k_cs, a.v_cs = bh_stride(k.codes), bh_stride(v.codes)
        a.variant = variant = _row_variant(variant, a.fmt, k, Hq // H)
        nsplit = _token_fields(a, k, q.device, num_splits, ctas_per_sm)
    a.variant = variant
    plan = _Plan()
    plan.keep, plan.args, plan.ptr = keep, a, ctypes.addressof(a)
    plan.nsplit, plan.rows_q, plan.D, plan.out_dtype, plan.kind = nsplit, B * Hq, D, out_dtype, a.kind
    plan.splits_asked = (num_splits, ctas_per_sm)
    plan.shape = (B, Hq, 1, D)
    plan.counts = _kivi_counts(k, v) if a.kind == 1 and not device_count else None
    return plan


def make_workspace(q: torch.Tensor, k, v, *, num_splits: int | None = None,
                   ctas_per_sm: int | None = DEFAULT_CTAS_PER_SM, out_dtype=None, valid_len: bool = False) -> Workspace:
    """A workspace that fits `decode(q, k, v, ...)` with the same options (the one a
    valid_len / CUDA-graph caller must pass: such a call allocates nothing). valid_len:
    whether the calls pass one (KIVI graph views: the splits are cut for the capacity)."""
    plan = _plan(q, k, v, num_splits, ctas_per_sm, None, out_dtype, bool(valid_len))
    ws = Workspace(plan.rows_q, plan.nsplit, plan.D, q.device, plan.out_dtype)
    if FUSED_COMBINE.on:  # (its counters now, not in a capture's first call)
        workspace_counters(ws, plan.rows_q, q.device)
    return ws


def decode(q: torch.Tensor, k, v, *, num_splits: int | None = None, ctas_per_sm: int | None = DEFAULT_CTAS_PER_SM,
           variant: int | None = None, workspace=None, out_dtype=None,
           valid_len: torch.Tensor | None = None, row_start: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the valid tokens of int4 (`IntFlat`), fp8 (`FP8Flat`)
    or KIVI (`KIVIFlat`) caches; `[B, Hq, 1, d]` in out_dtype (default q's). Raises
    ValueError when `unsupported` gives a reason, RuntimeError when the kernels are
    unavailable or a launch fails.

    valid_len: an int32 CUDA tensor of one element on q's device holding the number of
    valid tokens. The flat's T (KIVI graph views: their capacity) is then the CAPACITY
    bound: the grid and the splits are sized from it, and the kernel reads min(valid_len, T) at run time (CTAs
    whose tokens all lie past it write empty partials); a count < 1 gives NaN (no token to
    attend to). It is read on the device only, so with a `workspace` that fits
    (`make_workspace`) the call neither synchronises nor allocates: it can be captured in
    a CUDA graph and replayed after the count changes (`valid_len.fill_(n)` on the
    device). A workspace that does not fit is then an error, not a silent allocation.
    KIVI takes valid_len with `KIVIGraphFlat` views only: its valid state is two lengths per
    side (quantized groups and window rows), which the kernel derives from the count by each
    side's window policy (A, P): max(0, T - A) // P * P tokens quantized, the rest in the
    window.

    row_start: None, or an int32 tensor `[B]` on q's device, read on the device: batch row b
    attends to the keys from row_start[b] on only (a left-padded batch); a row with none
    left gets zeros.

    With a workspace, the result is its `out` buffer (overwritten by the next call with
    it); without one, a fresh tensor."""
    rs = row_start_ptr(row_start, q)
    return _launch(_plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len is not None),
                   q, valid_len, workspace, rs)


def _launch(plan, q, valid_len, workspace, rs=None) -> torch.Tensor:
    """A call's launch through its plan: the partials from the workspace when it fits (else
    from the scratch buffer, with a fresh result), q's, valid_len's and the row starts'
    pointers (rs: row_start's, or None)."""
    if not q.is_contiguous():
        q = q.contiguous()
    vptr = None
    if valid_len is not None:
        if (type(valid_len) is not torch.Tensor or valid_len.dtype != torch.int32 or valid_len.numel() != 1
                or valid_len.get_device() != q.get_device()):
            raise ValueError("valid_len must be an int32 tensor of one element on q's CUDA device")
        vptr = valid_len.data_ptr()
    ws = workspace
    if ws is not None and (ws.nsplit != plan.nsplit or ws.out.dtype != plan.out_dtype
                           or ws.out.numel() != plan.rows_q * plan.D):
        if valid_len is not None:
            raise ValueError(f"workspace does not fit this call ({plan.nsplit} splits, {plan.rows_q} x {plan.D} "
                             f"{plan.out_dtype}): use make_workspace")
        ws = None
    fused = FUSED_COMBINE.on  # (one launch, the counters after `out`: library.py FusedCombine)
    if ws is None:  # the partials from the scratch buffer, a fresh result
        part, out, po, pm, pl, optr, cptr = fresh_partials(plan.rows_q, plan.nsplit, plan.D, plan.shape,
                                                           plan.out_dtype, q.device, counters=fused)
    else:
        po, pm, pl, optr = ws.po.data_ptr(), ws.pm.data_ptr(), ws.pl.data_ptr(), ws.out.data_ptr()
        out = ws.__dict__.get("_kvq_out")
        if out is None or out.shape != plan.shape or out.data_ptr() != optr:
            out = ws.out.view(plan.shape)
            ws._kvq_out = out  # (the view, made once per workspace)
        cptr = workspace_counters(ws, plan.rows_q, q.device) if fused else None
    entry = _FUSED.entry("kvq_run_fused") if fused else _LIB.lib.kvq_run
    err = on_current_stream(q.get_device(), entry, plan.ptr, q.data_ptr(), vptr, rs, po, pm, pl, optr,
                            *((cptr,) if fused else ()))
    if err:
        raise RuntimeError(f"CUDA decode kernel launch failed: error {err}")
    return out


def kivi_plan(k, v, device, num_splits: int | None = None, ctas_per_sm: int | None = DEFAULT_CTAS_PER_SM,
              device_count: bool = False, qs: int = 1):
    """How a KIVI call is cut: (n_main, (splits, tiles per split) of tokens [0, n_main),
    (splits, tiles per split) of the tail [n_main, T)). n_main = min(TQK, TQV): both sides
    quantized (whole groups, whole tiles); its splits hold whole groups (an even number of
    tiles: the group stream's stage is a group); num_splits / ctas_per_sm apply to that
    part, the tail (the windows, usually < R + G tokens) takes the default rule.
    device_count (graph views): cut for the most either part can hold at any count up to
    the capacity C: n_main(C) (it grows with the count), and a tail of at most
    max(A + P) - 1 tokens over the sides (T - q(T) < A + P for q(T) = max(0, T - A) // P * P).
    qs: CTAs per kv row (launch.head_split), which the grid's rows count."""
    rows = k.B * k.H * qs
    if device_count:
        C = k.capacity
        n_main = min(max(0, C - a) // p * p for a, p in (k.policy, v.policy))
        tail_tokens = min(C, max(a + p for a, p in (k.policy, v.policy)) - 1)
    else:
        n_main, tail_tokens = _host_lengths(k, v)
    main = (0, 0)
    if n_main:
        _, per = splits(rows, n_main, device, num_splits, ctas_per_sm, KIVI_TILES_PER_SPLIT)
        per += per % 2
        main = (-(-(n_main // 16) // per), per)
    tail = splits(rows, tail_tokens, device) if tail_tokens else (0, 0)
    return n_main, main, tail


__all__ = ["decode", "make_workspace", "unsupported", "takes_by_default", "auto_refusal", "OPTIONS", "RENAMED",
           "CUDA_VERIFIED", "format_name", "kivi_plan", "num_regs_kivi", "why_unavailable", "available", "splits",
           "num_regs", "occupancy", "fits", "SOURCE", "NUM_VARIANTS", "JOINT_VARIANT", "SMEM_VARIANTS", "KIVI_VARIANTS", "HEAD_DIMS",
           "VERIFIED_HEAD_DIMS", "AUTO_ROW_START", "row_start_refusal", "variants", "head_dim_reason"]
