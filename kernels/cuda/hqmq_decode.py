"""CUDA C++ fused decode attention for HQMQ caches (hqmq_decode.cu, this folder): built at
first use by library.py's loader (`KernelLibrary`), called through ctypes.

Takes: `HQMQFlat` K and V with 12-bit codes (24 S <= 4096, S <= 170), r = 4 uniform
radius levels, head_dim 64, 128 or 256 (HEAD_DIMS), with or without Med3x outliers (both
sides alike; backend="auto" sends Med3x here only when AUTO_MED3; at head_dim 64 and 256
through the prefetching variants only), mixed-radix code rows (pack=mixed) at S = 96,
head_dim 64 / 128 / 256 (MIXED_HEAD_DIMS; auto at AUTO_MIXED_HEAD_DIMS), GQA groups of 1..8
(and 10, 12, 14, 16 as two CTAs of half the heads: launch.head_split), q fp16/bf16/fp32, a
device valid length and a left-padded batch's `row_start` (auto while AUTO_ROW_START). The kernel gathers codewords from the fp16 codebook `[H, 24 S, 4]` held
in shared memory; when a flat carries another table (the default is the fp32
secondaries) the fp16 codebook is built once per secondaries tensor and cached here.

Numerics: codeword (fp16) * rq rounded to fp16 (one rounding), r_max / 15 applied in
fp32 to the scores (K) and to P before its fp16 rounding (V); Med3x outliers exact in
fp16, added by their own mma (K: to the scores unscaled; V: weighted by P without
r_max / 15); q exact in fp16, base-2 softmax scale on the fp32 scores, P in fp16, fp32
accumulation. reports/kernels/NOTES.md ("CUDA HQMQ decode") has the
design, SASS counts and GPU figures.

(About 765 lines, on purpose: the host side of one .cu source, its checks, split choice
and the planned call's ctypes struct mirroring the .cu's `HqmqPlan`; the per-call path
stays beside it while PLANNED is new, as the reference its GPU tests compare with.)
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from ...quantizers.derived import derived, identity
from ...quantizers.derived import tensor_version as _version
from ...quantizers.hqmq import int8_components
from ..common import PlanCache, Workspace, bh_stride, check_q, sm_count, split_tiles
from ..layout import HQMQFlat, codebook_from_secondaries
from .launch import (HeadSplitField, RoutedPlan, follow_tokens, fresh_partials, gqa_refusal, head_split,
                     head_split_shift, on_current_stream, residency_refusal, row_start_ptr, workspace_counters)
from .library import FUSED_COMBINE, FUSED_DEFINE, PDL, QTYPE, KernelLibrary, fused_declare

SOURCE = Path(__file__).parent / "hqmq_decode.cu"
# VARIANTS in the .cu: (warps per CTA, cp.async stages per warp, min CTAs per SM):
# 0 (4, 4, 3), 1 (8, 4, 1), 2 (4, 3, 3), 3 (8, 2, 2), 4 (4, 6, 1), 5 (8, 4, 2), 6 (4, 2, 4),
# 7 (16, 4, 1), 8 (16, 5, 1; not with S > 96: its shared memory). With the table copied by
# cp.async every instance takes 120-126 registers, so shared memory sets the CTAs per SM
# (v0 3, v3 2, v6 4, v7 1). 9 (4, 3, 3) and 10 (8, 2, 2) are Med3x's (PREFETCH_VARIANTS): the
# outliers one tile ahead; without outliers they run v2's / v3's kernel itself. 11 (8, 2, 2)
# is v10 with running outlier slots (the .cu's RUN: fewer instructions per outlier k-step;
# 2026-12-07, H100, B=8 T=32k: as fast as v10 at d 128, 2.6% faster at 64, 1.2% slower at
# 256, so no default). (An earlier 11 and 12,
# head dim 64's 16-byte bypass copies and padded V code rows, lost to v3 on the H100 on
# 2026-12-06 and went: reports/kernels/NOTES.md.)
NUM_VARIANTS = 12
PREFETCH_VARIANTS = (9, 10, 11)
# Variant 12: v3's shape with both q-head halves of a GQA group of 10..16 in one CTA per kv row
# (the .cu's JOINT_VARIANT, hqmq_split_kernel HH = 2: each codeword gathered once for 16
# heads); HQMQ and Med3x at head dim 128, either codebook. Offline, sm_90a: 599 instructions a tile
# for 16 heads against v3's 2 x 499 as two CTAs, 186-193 registers, no spills (one CTA of 8
# warps per SM). The default of the calls it takes (`default_variant`): H100, gqa 16 (Hq 64 /
# Hkv 4) d 128 T=32k graphed, 155.2 -> 92.9 us at B=8 and 35.5 -> 28.5 at B=1 against the
# two-CTA launch (reports/latency/h100_2026-12-08/). Its Med3x instance runs v10's outlier
# path once per half (203-204 registers, no spills offline; 187.9 -> 164.1 us at B=8), its
# pack=mixed ones rewrite the tile first as v3's / v10's do (205.9 -> 126.4 us). Out of
# `variants()` (the tests' loops).
JOINT_VARIANT = 12
# The numbers behind these defaults and switches, call by call: reports/kernels/NOTES.md,
# "Defaults of kernels/cuda and the runs that chose them".
# v3: best, or within 0.5 us of it, at B=8 and B=1, T=32k on the H200.
DEFAULT_VARIANT = 3
# Default split count: the whole-wave rule of `splits` (FILL of occupancy x SMs CTAs in the
# fewest waves; on the H200 at B=8 T=32k a split count leaving a partial wave was up to 16% slower).
FILL = 0.9
MIN_CTAS_PER_SM = 2  # the fallback rule's floor when the occupancy is unknown
TILES_PER_SPLIT = 64
# backend="auto" routes HQMQ (no Med3x) here: it passed the GPU tests and is ~10x the Triton
# kernel's speed at B=8 T=32k.
AUTO = True
# Med3x (outliers extracted and stored aside): the variants with an outlier path (the .cu's
# OUT_OK: v0, v2; the 128-register variants spilled) and the prefetching ones, 9 and 10, that
# load a tile's outliers one tile ahead (v10 the fastest: ~1.2x HQMQ's time). Auto routes
# Med3x caches here since the GPU tests passed with v10 (~5.5x Triton's speed).
MED3_VARIANTS = (0, 2, 9, 10, 11)
DEFAULT_VARIANT_MED3 = 10
AUTO_MED3 = True
# Head dims with an instance in the .cu (Dims<D>), all routed by auto since their GPU tests:
# 64 the d = 128 arithmetic over a lane's 4 K / 2 V chunks; 256 by warp pairs, each warp
# d = 128's code on its half of the dims, the pair's partial scores added through shared
# memory (doubling the per-thread arrays cost ~200 registers). Med3x off d = 128 only through
# the prefetching variants.
HEAD_DIMS = (64, 128, 256)
AUTO_HEAD_DIMS = (64, 128, 256)
# Left-padded batches (row_start, read on the device; keys below masked): auto routes them
# here since their GPU tests passed, 3.2-3.7x faster than Triton's (H100, B=8 T=32k d 128, graphed,
# rows from 0..7k; NOTES.md, "Defaults").
AUTO_ROW_START = True


def row_start_refusal() -> str | None:
    """Why backend="auto" keeps a call with row_start off this kernel (None: it does not)."""
    if AUTO_ROW_START:
        return None
    return "row_start: cuda.hqmq_decode.AUTO_ROW_START is False (backend='cuda' takes it)"


# The planned host path (issue 28, "thin host path"): the checks, strides, codebooks and
# split plan of a call are made once per (cache layout, q shape / dtype / device, options,
# valid_len given or not) into a ctypes struct the .cu reads (`_PlanArgs`, kvq_hqmq_run), so
# a call is one lookup and one ctypes call with 8 arguments instead of ~45 (host time per
# eager call on the H200: 31-45 us, against 59-93 per call without the plan).
PLANNED = True
# codebook=int8 caches (quantizers/hqmq.py): 4-byte codewords (`codebook8`), instances of the
# default variants (3; Med3x 10) at every head dim. auto routes them here since their GPU tests
# passed; half the table's bytes cut the gathers that bound HQMQ (H100, B=8 T=32k d 128, eager: -15%
# kernel time; NOTES.md, "Defaults").
AUTO_INT8 = True
# pack=mixed caches (mixed-radix code rows, quantizers/packing.py `mixed_layout`): the .cu's
# MIX instances of the default variants copy a tile's rows as they lie and rewrite them in
# shared memory as 12-bit rows before v3's (Med3x: v10's) decode (mixed_codes.cuh). Radix 2304
# (S = 96) at head dim 64, 128, 256 (at 256 each half row is a d 128 row); Triton serves the rest.
MIXED_HEAD_DIMS = (64, 128, 256)
# auto takes them at every MIXED_HEAD_DIMS since their GPU tests passed (bit for bit against the
# 12-bit rows; Med3x at 256, whose instance has 16 warps a CTA, within the tolerance) and they
# beat Triton 2.1-4.5x (H100, B=8 T=32k, graphed, 2026-12-07; figures: reports/kernels/NOTES.md, "Defaults").
AUTO_MIXED = True
AUTO_MIXED_HEAD_DIMS = (64, 128, 256)
AUTO_MIXED_MED3 = True


def variants(head_dim: int = 128, med3: bool = False, cw: int = 8, mix: bool = False) -> tuple[int, ...]:
    """The variants with an instance at this head dim (med3: with a Med3x instance; cw 4:
    for codebook=int8 caches, the defaults' alone; mix: for pack=mixed caches, the default's
    alone)."""
    if mix:
        return () if head_dim not in MIXED_HEAD_DIMS else (DEFAULT_VARIANT_MED3,) if med3 else (DEFAULT_VARIANT,)
    if cw == 4:
        return (DEFAULT_VARIANT_MED3,) if med3 else (DEFAULT_VARIANT,)
    if med3:
        return MED3_VARIANTS if head_dim == 128 else PREFETCH_VARIANTS
    return tuple(range(NUM_VARIANTS))


def mixed_rows(f) -> bool:
    """Whether this flat's code rows are mixed-radix (pack=mixed): the .cu's MIX instances."""
    return f.code_pack == "mixed"


def codeword_bytes(f) -> int:
    """Bytes per codeword of the table the kernel gathers from for this flat: 8 (fp16
    components), 4 for codebook=int8 (`codebook8`)."""
    return 4 if f.codebook == "int8" else 8


def qk_scale(head_dim: int) -> float:
    """log2(e) / sqrt(d): the base-2 softmax scale the kernel applies to the fp32 scores."""
    return 1.4426950408889634 / math.sqrt(head_dim)



# fp16 codebooks are derived from the secondaries TENSOR (quantizers/derived.py: weakly
# keyed, with its in-place write counter), never by data_ptr: a freed tensor's address reused
# by another quantizer's secondaries once served a stale codebook.


def _declare(lib) -> str | None:
    P, I, LL, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    lib.kvq_hqmq_plan_size.restype = I
    if lib.kvq_hqmq_plan_size() != ctypes.sizeof(_PlanArgs):  # a struct out of step with the .cu: refuse, never misread
        return f"HqmqPlan is {lib.kvq_hqmq_plan_size()} bytes in the library, _PlanArgs {ctypes.sizeof(_PlanArgs)}"
    lib.kvq_hqmq_run.argtypes = [P, P, P, P, P, P, P, P, P]
    lib.kvq_hqmq_run.restype = I
    lib.kvq_hqmq_decode.argtypes = [P, I, P, P, P, P, P, P, P, P, LL, LL, LL, LL, LL, LL, P, P, P, P, P, P, LL,
                                    LL, LL, LL, LL, LL, I, I, I, I, I, I, I, F, P, P, P, P, I, I, P, P, I, I, I, P, I]
    lib.kvq_hqmq_decode.restype = I
    lib.kvq_hqmq_num_regs.argtypes = [I, I, I, I, I, I]
    lib.kvq_hqmq_num_regs.restype = I
    lib.kvq_hqmq_occupancy.argtypes = [I, I, I, I, I, I]
    lib.kvq_hqmq_occupancy.restype = I
    lib.kvq_hqmq_set_pdl.argtypes = [I]
    lib.kvq_hqmq_set_pdl.restype = None
    PDL.attach(lib.kvq_hqmq_set_pdl)  # (the combine as the split kernel's programmatic dependent: library.py)
    return None


_LIB = KernelLibrary(SOURCE, "kvq_hqmq", _declare)  # built / loaded once, as decode_attention.py's
_FUSED = KernelLibrary(SOURCE, "kvq_hqmq_fused",  # built at the first fused call
                       fused_declare("kvq_hqmq_fused_build", "kvq_hqmq_run_fused", _declare), FUSED_DEFINE)
_load = _LIB.load
why_unavailable = _LIB.why_unavailable


def available() -> bool:  # through the module's why_unavailable, as before KernelLibrary (tests stub it)
    return why_unavailable() is None


def num_regs(variant: int = 0, S: int = 96, med3: bool = False, head_dim: int = 128, fused: bool = False,
             cw: int = 8, mix: bool = False) -> int:
    """Registers per thread of a variant's instance (med3: its Med3x one; fused: the fused
    build's; cw 4: codebook=int8's; mix: pack=mixed's); < 0: none / error."""
    lib = _FUSED.load() if fused else _load()
    return -1 if lib is None else lib.kvq_hqmq_num_regs(variant, S, int(med3), head_dim, cw, int(mix))


def head_dim_reason(D: int) -> str | None:
    """Why the kernel has no instance for this head dim (None: it has one)."""
    if D not in HEAD_DIMS:
        return f"head_dim {D} (the CUDA HQMQ kernel takes {', '.join(map(str, HEAD_DIMS))})"
    return None


def _align(D: int) -> int:
    """Bytes the code / radius rows are copied in (cp.async): 8 at head_dim 64 (24-byte code
    rows, 8-byte radius rows), else 16."""
    return 8 if D == 64 else 16


def _flat_reason(f) -> str | None:
    """Why the kernel cannot read this flat (None: it can)."""
    if not isinstance(f, HQMQFlat):
        return f"no CUDA HQMQ kernel for {type(f).__name__}"
    why = head_dim_reason(f.D)
    if why:
        return why
    if f.code_bits != 12 or not 1 <= f.S <= 170:
        return f"code bits {f.code_bits} / S={f.S} (the CUDA kernel takes 12-bit codes, S <= 170)"
    if f.r_bits != 4 or f.log_radius:
        return "radius levels other than r=4 uniform"
    if f.sec is None:
        return "no secondaries to build the fp16 codebook from"
    if f.codes.dtype != torch.uint8 or f.radius.dtype != torch.uint8 or f.r_max.dtype != torch.float16:
        return "codes/radius must be uint8, r_max fp16"
    cb, rb, al = f.D * 3 // 8, f.D // 8, _align(f.D)
    if mixed_rows(f):
        G, W, _, cb = f.code_layout
        if f.S != 96 or f.D not in MIXED_HEAD_DIMS:
            return (f"mixed-radix codes (pack=mixed: {G} codes of radix {24 * f.S} per {W}-bit group, {cb}-byte "
                    f"rows) at S={f.S}, head_dim {f.D}: the CUDA kernel reads them at S=96, head_dim "
                    f"{' / '.join(map(str, MIXED_HEAD_DIMS))}; Triton reads them")
    if f.codes.shape[-1] != cb or f.radius.shape[-1] != rb:
        return f"code/radius rows of {cb}/{rb} bytes expected"
    if not (f.codes.is_cuda and f.radius.is_cuda and f.r_max.is_cuda):
        return "cache buffers not on a CUDA device"
    try:
        cs = bh_stride(f.codes, "codes")
        rs = bh_stride(f.radius, "radius")
        bh_stride(f.r_max, "r_max")
    except ValueError as e:
        return str(e)
    # (mixed rows: a tile's are copied in 16-byte pieces from the boundary below them, so any
    # row stride serves and only the buffer's start must be aligned)
    al_c = 16 if mixed_rows(f) else al
    if f.codes.data_ptr() % al_c or f.radius.data_ptr() % al or rs % al or (cs % al and not mixed_rows(f)):
        return f"codes/radius not {al_c}/{al}-byte aligned (cp.async)"
    if f.r_max.data_ptr() % 2:
        return "r_max not 2-byte aligned"
    if f.has_outliers:  # Med3x: flag words, the outlier list (8-byte items), the block starts
        fl, ol, ix = f.flags, f.outliers, f.outlier_index
        fb = f.D // 32  # flag bytes per token (one bit per 4-dim chunk)
        if fl.dtype != torch.uint8 or fl.shape[-1] != fb or ol.dtype != torch.float16 or ol.shape[-1] != 4 \
                or ix.dtype != torch.int32:
            return f"Med3x flags [.., {fb}] uint8, outliers [.., 4] fp16, outlier_index int32 expected"
        if not (fl.is_cuda and ol.is_cuda and ix.is_cuda):
            return "Med3x buffers not on a CUDA device"
        try:
            fs, os_, _ = bh_stride(fl, "flags"), bh_stride(ol, "outliers"), bh_stride(ix, "outlier_index")
        except ValueError as e:
            return str(e)
        # flag rows are copied 4 bytes at a time (at head_dim 64 two tokens' 2-byte rows from a
        # 4-byte boundary, whatever the capacity: the .cu's copy_tile), 8 at 256
        fa = max(4, fb)
        if fl.data_ptr() % fa or (fb > 2 and fs % fa) or ol.data_ptr() % 8 or os_ % 4 or ix.data_ptr() % 4:
            return f"Med3x flags / outliers / outlier_index not {fa} / 8 / 4-byte aligned"
    return None


# Per-call host work (the bh_stride checks, the codebook lookup) is cached per set of
# buffers (kernels/common.py PlanCache: kept while those tensors live): key = the ids of the
# flat's tensors, its format fields and sec's version (the codebook follows the
# secondaries); entry = a reason string, or ((codes, radius, r_max strides), fp16 codebook,
# Med3x strides or None); data pointers are read per call. The store makes a new flat
# object per decode step over the same buffers, so the key is not the flat itself.
_INFO = PlanCache(256)


def _flat_info(f):
    if not isinstance(f, HQMQFlat):
        return f"no CUDA HQMQ kernel for {type(f).__name__}"
    ts = (f.codes, f.radius, f.r_max, f.sec, f.table, f.flags, f.outliers, f.outlier_index)
    key = (tuple(map(identity, ts)), f.D, f.S, f.code_bits, f.r_bits, f.log_radius, f.table_mode, f.codebook,
           f.code_pack, None if f.sec is None else _version(f.sec))
    hit = _INFO.get(key)
    if hit is not None:
        return hit
    why = _flat_reason(f)
    if why is None:
        med3 = None
        if f.has_outliers:  # strides in flag words / 8-byte items / ints (pointers: read per call)
            med3 = (bh_stride(f.flags) // (f.D // 32), bh_stride(f.outliers) // 4, bh_stride(f.outlier_index))
        table = codebook8(f) if codeword_bytes(f) == 4 else codebook16(f)
        info = ((bh_stride(f.codes), bh_stride(f.radius), bh_stride(f.r_max)), table, med3)
    else:
        info = why
    return _INFO.put(key, ts, info)


def unsupported(q: torch.Tensor, k, v) -> str | None:
    """Why the CUDA HQMQ kernel cannot take this call (None: it can). Does not build.
    (PLANNED: a layout a default-options call has planned already is taken without
    re-checking, its plan having passed every check this makes: the auto route asks this
    on every call.)"""
    if PLANNED and _PLANS.plans and isinstance(k, HQMQFlat) and isinstance(v, HQMQFlat):
        for given in (False, True):
            plan = _find(q, k, v, None, None, None, None, given)
            if plan is not None and k.T == v.T:  # (T is out of the key: see _retarget)
                ROUTED.offer(q, k, v, (None, None, None, None, given), plan)
                return None
    if not q.is_cuda:
        return "q is not on a CUDA device"
    if q.dtype not in QTYPE:
        return f"q dtype {q.dtype}"
    for f in (k, v):
        if not isinstance(f, HQMQFlat):
            return f"no CUDA HQMQ kernel for {type(f).__name__}"
    why = head_dim_reason(k.D)
    if why:
        return why
    if v.D != k.D:
        return f"K head_dim {k.D}, V {v.D}"
    why = gqa_refusal(q, k.H)
    if why:
        return why
    for f in (k, v):
        i = _flat_info(f)
        if isinstance(i, str):
            return i
    if k.has_outliers != v.has_outliers:
        return "Med3x outliers on one side only"
    if k.codebook != v.codebook:
        return f"K codebook={k.codebook}, V codebook={v.codebook} (one kernel instance reads both tables)"
    if k.code_pack != v.code_pack:
        return f"K pack={k.code_pack}, V pack={v.code_pack} (one kernel instance reads both)"
    return None


def codebook16(f) -> torch.Tensor:
    """The fp16 codebook [H, 24 S, 4] of a flat (its own table if it is that, else built
    from its secondaries once and cached)."""
    if f.table_mode == "codebook" and f.table.dtype == torch.float16 and f.table.is_contiguous() \
            and f.table.data_ptr() % 16 == 0:
        return f.table
    return derived(f.sec, "cuda_hqmq.codebook16", lambda: codebook_from_secondaries(f.sec.float()).half().contiguous())


def codebook8(f) -> torch.Tensor:
    """codebook=int8's table for the kernel: [H, 24 S, 4] uint8, component k + 128 for the
    format's k / 127 (quantizers/hqmq.py `int8_components`), built once per secondaries."""
    def make():
        k = int8_components(codebook_from_secondaries(f.sec.float()))
        return (k + 128).to(torch.uint8).contiguous()
    return derived(f.sec, "cuda_hqmq.codebook8", make)


def occupancy(variant: int = DEFAULT_VARIANT, S: int = 96, med3: bool = False, head_dim: int = 128,
              cw: int = 8, mix: bool = False) -> int:
    """CTAs of a variant resident per SM (the CUDA occupancy query; < 0 when unavailable:
    no library, no such instance (NO_INSTANCE: no Med3x / cw 4 / mixed instance), a refused
    opt-in)."""
    lib = _load()
    if lib is None:
        return -1
    key = (variant, S if mix else S <= 96, med3, head_dim, cw, mix)
    if key not in _OCC:
        _OCC[key] = lib.kvq_hqmq_occupancy(variant, S, int(med3), head_dim, cw, int(mix))
    return _OCC[key]


_OCC: dict = {}


def fits(q: torch.Tensor, k, v) -> str | None:
    """Why this GPU cannot hold the default instance a call on these caches launches (None:
    it can), from the loaded library's occupancy query: e.g. Med3x with pack=mixed at head
    dim 256 takes 200 KB of shared memory a CTA, past an A100's 163 KB opt-in (auto then
    takes Triton). Asked after the library loaded (kernels/registry.py `Kernel.fits`)."""
    if not isinstance(k, HQMQFlat) or _LIB.lib is None or not torch.cuda.is_available():
        return None  # (no library: why_unavailable said so; a CPU process launches nothing)
    med3 = k.has_outliers
    variant = default_variant(head_split(q.shape[1] // k.H), k.D, med3)
    return residency_refusal(occupancy(variant, k.S, med3, k.D, codeword_bytes(k), mixed_rows(k)),
                             f"variant {variant}'s instance for these caches (head_dim {k.D}, S={k.S}"
                             f"{', Med3x' if med3 else ''}{', pack=mixed' if mixed_rows(k) else ''})", q.device)


def splits(rows: int, T: int, device, num_splits: int | None = None, ctas_per_sm: int | None = None,
           variant: int = DEFAULT_VARIANT, S: int = 96, med3: bool = False, head_dim: int = 128, cw: int = 8,
           mix: bool = False):
    """(number of splits, 16-token tiles per split), every split non-empty: num_splits if
    given, else about ctas_per_sm CTAs per SM if given, else the whole-wave rule: for
    w = 1, 2, ... waves of `slots = occupancy x SMs` CTAs, the most splits that fit w
    waves, first taken when they fill at least FILL of them (B=8 T=32k at 3 CTAs/SM: 6
    splits = 384 of 396 slots; B=1: 49 splits). med3: tiles per split a multiple of 4 (a
    split starts on a 64-token outlier block)."""
    sms = sm_count(device)

    def whole_waves(tiles: int) -> int:
        occ = occupancy(variant, S, med3, head_dim, cw, mix) if device.type == "cuda" else -1
        if occ <= 0:
            return max(-(-tiles // TILES_PER_SPLIT), math.ceil(MIN_CTAS_PER_SM * sms / max(1, rows)))
        slots = occ * sms
        for w in range(1, 9):
            n = w * slots // rows
            if n >= 1 and rows * n >= FILL * w * slots:
                return n
        return max(1, -(-slots // rows))

    return split_tiles(rows, T, sms, num_splits, ctas_per_sm, whole_waves, 4 if med3 else 1)


def auto_refusal(k) -> str | None:
    """Why backend="auto" does not route this cache here (None: it does): AUTO, its head
    dim in AUTO_HEAD_DIMS, and AUTO_MED3 for Med3x."""
    if not isinstance(k, HQMQFlat):
        return f"no CUDA HQMQ kernel for {type(k).__name__}"
    if not AUTO:
        return "cuda.hqmq_decode.AUTO is False"
    if k.D not in HEAD_DIMS:  # (no instance: Triton serves it, padded when not a power of two)
        return f"no CUDA HQMQ kernel at head_dim {k.D} (it takes {', '.join(map(str, HEAD_DIMS))})"
    if k.D not in AUTO_HEAD_DIMS:
        return (f"head_dim {k.D} is not in cuda.hqmq_decode.AUTO_HEAD_DIMS (not yet run on a GPU; "
                f"backend='cuda' takes it)")
    if k.has_outliers and not AUTO_MED3:
        return "cuda.hqmq_decode.AUTO_MED3 is False: auto keeps Med3x caches on Triton"
    if codeword_bytes(k) == 4 and not AUTO_INT8:
        return "codebook=int8: cuda.hqmq_decode.AUTO_INT8 is False (not yet run on a GPU; backend='cuda' takes it)"
    if not mixed_rows(k):  # (the fast route asks this on every call: the refusals' text only when refusing)
        return None
    takes = f"backend='cuda' takes S=96 at head_dim {' / '.join(map(str, MIXED_HEAD_DIMS))}"
    if not AUTO_MIXED:
        return f"pack=mixed: cuda.hqmq_decode.AUTO_MIXED is False: auto keeps such caches on Triton ({takes})"
    if k.D not in AUTO_MIXED_HEAD_DIMS:
        return (f"pack=mixed at head_dim {k.D}: not in cuda.hqmq_decode.AUTO_MIXED_HEAD_DIMS (not yet run on "
                f"a GPU; {takes})")
    if k.has_outliers and not AUTO_MIXED_MED3:
        return ("Med3x with pack=mixed: cuda.hqmq_decode.AUTO_MIXED_MED3 is False: auto keeps such caches on "
                f"Triton ({takes})")
    return None


def takes_by_default(k) -> bool:
    """Whether backend="auto" routes this cache here: AUTO, AUTO_HEAD_DIMS, and AUTO_MED3 for Med3x."""
    return auto_refusal(k) is None


# decode_attention's options `decode` takes (valid_len apart), and the ones it names otherwise
OPTIONS = frozenset({"num_splits", "programs_per_sm", "ctas_per_sm", "variant", "workspace", "out_dtype"})
RENAMED = {"programs_per_sm": "ctas_per_sm"}


def workspace(q: torch.Tensor, k, *, num_splits: int | None = None, ctas_per_sm: int | None = None,
              variant: int | None = None, out_dtype=None) -> Workspace:
    """A Workspace sized for `decode(q, k, ...)` with these split arguments (the splits
    follow k.T, the capacity bound when a valid_len tensor is passed): give it to every
    call of a captured CUDA graph so the call allocates nothing."""
    qs = head_split(q.shape[1] // k.H)
    if variant is None:
        variant = default_variant(qs, k.D, k.has_outliers)
    nsplit, _ = _token_splits(k, q.device, num_splits, ctas_per_sm, variant, qs)
    ws = Workspace(k.B * q.shape[1], nsplit, k.D, q.device, out_dtype or q.dtype)
    if FUSED_COMBINE.on:  # (its counters now, not in a capture's first call)
        workspace_counters(ws, k.B * q.shape[1], q.device)
    return ws


_NO_MED3_ARGS = (None,) * 6 + (0,) * 6  # no Med3x: null flag pointer, the kernel's OUT=false instance


def _checked(q: torch.Tensor, k, v):
    """(strides of the 6 buffers, K table, V table, Med3x pointers and strides or None) or
    ValueError; the per-flat part is cached (see _flat_info)."""
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    if (v.B, v.H, v.T, v.D) != (B, H, T, D):
        raise ValueError("K and V caches differ in shape")
    if not q.is_cuda:
        raise ValueError("CUDA HQMQ kernel: q is not on a CUDA device")
    if q.dtype not in QTYPE:
        raise ValueError(f"CUDA HQMQ kernel: q dtype {q.dtype}")
    why = gqa_refusal(q, H)
    if why:
        raise ValueError(f"CUDA HQMQ kernel: {why}")
    ik, iv = _flat_info(k), _flat_info(v)
    for i in (ik, iv):
        if isinstance(i, str):
            raise ValueError(f"CUDA HQMQ kernel: {i}")
    if k.S != v.S:
        raise ValueError("K and V differ in S")
    if (ik[2] is None) != (iv[2] is None):
        raise ValueError("CUDA HQMQ kernel: Med3x outliers on one side only")
    if ik[2] is None:
        return ik[0] + iv[0], ik[1], iv[1], None
    # the kernel's order: kf, vf, ko, vo, ki, vi, then k_fs, k_os, k_is, v_fs, v_os, v_is
    ptrs = (k.flags.data_ptr(), v.flags.data_ptr(), k.outliers.data_ptr(), v.outliers.data_ptr(),
            k.outlier_index.data_ptr(), v.outlier_index.data_ptr())
    return ik[0] + iv[0], ik[1], iv[1], ptrs + ik[2] + iv[2]


def _valid_len_ptr(valid_len, q: torch.Tensor) -> int:
    """The device pointer of a valid_len tensor, or ValueError (checked without reading it)."""
    if not (isinstance(valid_len, torch.Tensor) and valid_len.dtype == torch.int32
            and valid_len.numel() == 1 and valid_len.device == q.device):
        raise ValueError("valid_len must be an int32 tensor of one element on q's device")
    return valid_len.data_ptr()


def _loaded():
    lib = _LIB.lib if _LIB.lib is not None else _load()
    if lib is None:
        raise RuntimeError(f"CUDA HQMQ kernel unavailable: {_LIB.why}")
    return lib


def _joint_needs(qs: int, D: int) -> list[str]:
    """What JOINT_VARIANT needs and a call lacks (empty: it takes the call): a GQA group of two
    halves of 5..8 heads (qs: launch.head_split's CTAs per kv row) and head dim 128. (Any
    codebook, Med3x or not, 12-bit or mixed rows: its Med3x instance runs v10's outlier path
    per half, pack=mixed rows are rewritten first.)"""
    return [w for w, bad in (("a GQA group of 10, 12, 14 or 16", qs != 2), ("head_dim 128", D != 128)) if bad]


def default_variant(qs: int, D: int, med3: bool) -> int:
    """The variant a call without variant= launches: JOINT_VARIANT where it takes the call
    (one CTA decodes for both halves), else Med3x's or plain HQMQ's default."""
    if not _joint_needs(qs, D):
        return JOINT_VARIANT
    return DEFAULT_VARIANT_MED3 if med3 else DEFAULT_VARIANT


def joint_refusal(qs: int, D: int) -> None:
    """ValueError naming why JOINT_VARIANT does not take a call (`_joint_needs`)."""
    why = _joint_needs(qs, D)
    if why:
        raise ValueError(f"variant {JOINT_VARIANT} (both q-head halves in one CTA) needs " + ", ".join(why))


def _token_splits(k, device, num_splits, ctas_per_sm, variant, qs: int) -> tuple[int, int]:
    """(splits, tiles per split) of a call on k's T tokens: with T itself, all a plan holds
    that follows the token count (`_retarget` relies on it). qs: CTAs per kv row
    (launch.head_split), which the grid's rows count."""
    rows = k.B * k.H * (1 if variant == JOINT_VARIANT else qs)  # (the grid's rows)
    return splits(rows, k.T, device, num_splits, ctas_per_sm, variant, k.S, k.has_outliers, k.D,
                  codeword_bytes(k), mixed_rows(k))


def _launch_values(q: torch.Tensor, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len):
    """Every check of a call after the library's, in the order `decode` has always made them
    (so a call with several faults names the same one on both paths), and what the launch
    derives from them: (strides, K table, V table, Med3x pointers and strides or None,
    variant, splits, tiles per split, out dtype, valid_len pointer or 0)."""
    B, H, T, D = k.B, k.H, k.T, k.D
    strides, kt, vt, med3 = _checked(q, k, v)
    if T == 0:
        raise ValueError("empty cache (T = 0)")
    vl = 0 if valid_len is None else _valid_len_ptr(valid_len, q)
    out = med3 is not None
    cw = codeword_bytes(k)
    mix = mixed_rows(k)
    qs = head_split(q.shape[1] // H)
    if variant is None:
        variant = default_variant(qs, D, out)
    if variant == JOINT_VARIANT:
        joint_refusal(qs, D)
    elif not 0 <= variant < NUM_VARIANTS:
        raise ValueError(f"variant must be in 0..{NUM_VARIANTS - 1} (or {JOINT_VARIANT} for GQA groups over 8)")
    elif out and variant not in variants(D, True):
        raise ValueError(f"variant {variant} has no Med3x instance at head_dim {D} (variants: {variants(D, True)})")
    elif variant not in variants(D):
        raise ValueError(f"variant {variant} has no instance at head_dim {D} (variants: {variants(D)})")
    elif cw == 4 and variant not in variants(D, out, cw):
        raise ValueError(f"variant {variant} has no codebook=int8 instance (variants: {variants(D, out, cw)})")
    elif mix and variant not in variants(D, out, cw, mix):
        raise ValueError(f"variant {variant} has no pack=mixed instance (variants: {variants(D, out, cw, mix)})")
    if occupancy(variant, k.S, out, D, cw, mix) <= 0:  # v8 with S > 96 (the shared-memory opt-in is refused)
        raise ValueError(f"variant {variant} does not fit the shared memory with S={k.S} at head_dim {D}")
    nsplit, per = _token_splits(k, q.device, num_splits, ctas_per_sm, variant, qs)
    out_dtype = out_dtype or q.dtype
    if out_dtype not in QTYPE:
        raise ValueError(f"out dtype {out_dtype}")
    return strides, kt, vt, med3, variant, nsplit, per, out_dtype, vl


def decode(q: torch.Tensor, k, v, *, num_splits: int | None = None, ctas_per_sm: int | None = None,
           variant: int | None = None, workspace=None, out_dtype=None,
           valid_len: torch.Tensor | None = None, row_start: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the valid tokens of HQMQ caches; `[B, Hq, 1, d]` in
    out_dtype (default q's), the workspace's buffer. ValueError when `unsupported` gives a
    reason, RuntimeError when the kernel is unavailable.

    valid_len: None (the flats' T tokens are valid), or an int32 CUDA tensor of shape [1]
    on q's device holding the number of valid tokens, read by the kernel at run time:
    k.T is then the CAPACITY bound (the splits are sized from it; values above it are
    clamped to it, below 0 to 0; 0 gives zeros). With valid_len and a fitting `workspace`
    (`cuda_hqmq.workspace(...)`) a call makes no host sync and no allocation, so a CUDA
    graph captured once serves every decode step: change the tensor's value on the device
    between replays.

    row_start: None, or an int32 tensor `[B]` on q's device, read on the device: batch row b
    attends to the keys from row_start[b] on only (a left-padded batch); a row with none
    left gets zeros.

    With a workspace that fits, the result is a view of its `out` buffer (overwritten by
    the next call with it); without one, a fresh tensor. PLANNED picks the host path (the
    same launches either way)."""
    rs = row_start_ptr(row_start, q)
    if PLANNED:
        return _decode_planned(q, k, v, num_splits, ctas_per_sm, variant, workspace, out_dtype, valid_len, rs)
    return _decode_per_call(q, k, v, num_splits, ctas_per_sm, variant, workspace, out_dtype, valid_len, rs)


def _decode_per_call(q, k, v, num_splits, ctas_per_sm, variant, workspace, out_dtype, valid_len, rs=None):
    """Every check and argument made again on every call, ~45 ctypes arguments (the path
    until PLANNED; the planned path's tests compare against it)."""
    lib = _loaded()
    B, H, T, D = k.B, k.H, k.T, k.D
    strides, kt, vt, med3, variant, nsplit, per, out_dtype, vl = _launch_values(
        q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len)
    if not q.is_contiguous():
        q = q.contiguous()
    Hq = q.shape[1]
    rows_q, qs = B * Hq, head_split(Hq // H)
    ws = workspace
    if ws is None or ws.nsplit != nsplit or ws.out.dtype != out_dtype or ws.out.numel() != rows_q * D:
        ws = Workspace(rows_q, nsplit, D, q.device, out_dtype)
    dev = q.device.index
    args = (q.data_ptr(), QTYPE[q.dtype], k.codes.data_ptr(), k.radius.data_ptr(), k.r_max.data_ptr(),
            v.codes.data_ptr(), v.radius.data_ptr(), v.r_max.data_ptr(), kt.data_ptr(), vt.data_ptr(), *strides,
            *(med3 or _NO_MED3_ARGS), B, H, Hq // H // qs, T, k.S, per, nsplit, qk_scale(D), ws.po.data_ptr(),
            ws.pm.data_ptr(), ws.pl.data_ptr(), ws.out.data_ptr(), QTYPE[out_dtype], variant, vl)
    if torch.cuda.current_device() == dev:  # the usual case: no device switch around the launch
        err = lib.kvq_hqmq_decode(*args, torch._C._cuda_getCurrentRawStream(dev), D, codeword_bytes(k),
                                  int(mixed_rows(k)), rs, head_split_shift(qs))
    else:
        with torch.cuda.device(dev):
            err = lib.kvq_hqmq_decode(*args, torch._C._cuda_getCurrentRawStream(dev), D, codeword_bytes(k),
                                      int(mixed_rows(k)), rs, head_split_shift(qs))
    if err:
        raise RuntimeError(f"CUDA HQMQ kernel launch failed: error {err}")
    return ws.out.view(B, Hq, 1, D)


# ---------------------------------------------------------------------------------------
# the planned path (PLANNED): what a call on one cache layout launches, made once. The key
# follows the per-call path's inputs: the flats' tensors (by identity: PlanCache), their
# format ints, the secondaries' in-place write counters (the fp16 codebooks follow them, as
# _flat_info's do), q's shape / dtype / device, the options, and whether valid_len is given
# (the struct records it and kvq_hqmq_run refuses a call that disagrees: a plan made for
# eager calls is never launched with a device count, nor one made for graphs without).
# Data pointers and strides are read once: the store never moves a tensor's storage in place.
# ---------------------------------------------------------------------------------------
class _PlanArgs(HeadSplitField, ctypes.Structure):  # mirrors HqmqPlan in hqmq_decode.cu (checked by kvq_hqmq_plan_size)
    _fields_ = ([(n, ctypes.c_void_p) for n in ("kc", "kr", "km", "vc", "vr", "vm", "ktab", "vtab",
                                                "kf", "vf", "ko", "vo", "ki", "vi")]
                + [(n, ctypes.c_longlong) for n in ("k_cs", "k_rs", "k_ms", "v_cs", "v_rs", "v_ms",
                                                    "k_fs", "k_os", "k_is", "v_fs", "v_os", "v_is")]
                + [(n, ctypes.c_int) for n in ("qtype", "otype", "variant", "D", "S", "B", "Hkv", "gqa", "T",
                                               "steps_per_split", "nsplit", "vlen")]
                + [("qk_scale", ctypes.c_float), ("cw", ctypes.c_int), ("mix", ctypes.c_int), ("qsh", ctypes.c_int)])


class _Plan:
    """A call's launch: the argument struct (and its address), the tensors it points into
    that nothing else keeps alive (the fp16 codebooks), and the workspace shape."""
    __slots__ = ("args", "ptr", "keep", "nsplit", "rows_q", "D", "shape", "out_dtype", "splits_asked")


_PLANS = PlanCache()
# The plan the auto route's check found, handed to the same call's launch (launch.py
# RoutedPlan; decode_attention.py's ROUTED gives the H100 figures it rests on).
ROUTED = RoutedPlan(enabled=True)


def _plan_tensors(k, v) -> tuple:
    return (k.codes, k.radius, k.r_max, k.sec, k.table, k.flags, k.outliers, k.outlier_index,
            v.codes, v.radius, v.r_max, v.sec, v.table, v.flags, v.outliers, v.outlier_index)


def _facts(q, k, v, *options) -> tuple:
    """What a plan derives from besides the flats' fields: the codebooks' versions (the
    secondaries written in place make other tables), q's shape, dtype and device, and the
    options (num_splits, ctas_per_sm, variant, out_dtype, whether valid_len is given)."""
    return (None if k.sec is None else _version(k.sec), None if v.sec is None else _version(v.sec),
            q.shape, q.dtype, q.device, *options)


def _lookup(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len_given: bool):
    """(the kept plan of this call or None, its full key, the tensors it reads)."""
    ts = _plan_tensors(k, v)
    key = (type(k), type(v), tuple(map(identity, ts)),  # (not T: see _retarget)
           k.B, k.H, k.D, k.S, k.code_bits, k.r_bits, k.log_radius, k.table_mode, k.codebook, k.code_pack,
           v.B, v.H, v.D, v.S, v.code_bits, v.r_bits, v.log_radius, v.table_mode, v.codebook, v.code_pack,
           _facts(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len_given))
    return _PLANS.get(key), key, ts


def _find(q, k, v, *options):
    """The kept plan of this call or None: the memo on k (an eager decode step's flats are
    the store's, their fields unchanged but T), else the full key."""
    return _PLANS.find(k, v, _facts(q, k, v, *options), _lookup, q, k, v, *options)


def _plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len):
    """The plan of a call on HQMQ flats: the kept one, else one made (every check of the
    call: ValueError / RuntimeError as the per-call path) and kept."""
    plan = ROUTED.take(q, k, v, (num_splits, ctas_per_sm, variant, out_dtype, valid_len is not None))
    if plan is None:
        plan = _find(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len is not None)
        if plan is None:
            _, key, ts = _lookup(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len is not None)
            return _PLANS.put(key, ts, _build_plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len))
    if plan.args.T != k.T:
        _retarget(plan, q, k, v)
    return plan


def _build_plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len) -> _Plan:
    _loaded()
    strides, kt, vt, med3, variant, nsplit, per, out_dtype, _ = _launch_values(
        q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len)
    B, H, D, Hq = k.B, k.H, k.D, q.shape[1]
    a = _PlanArgs()
    a.kc, a.kr, a.km = k.codes.data_ptr(), k.radius.data_ptr(), k.r_max.data_ptr()
    a.vc, a.vr, a.vm = v.codes.data_ptr(), v.radius.data_ptr(), v.r_max.data_ptr()
    a.ktab, a.vtab = kt.data_ptr(), vt.data_ptr()
    a.k_cs, a.k_rs, a.k_ms, a.v_cs, a.v_rs, a.v_ms = strides
    if med3 is not None:  # else the pointers stay null: kvq_hqmq_run takes the instance without outliers
        (a.kf, a.vf, a.ko, a.vo, a.ki, a.vi, a.k_fs, a.k_os, a.k_is, a.v_fs, a.v_os, a.v_is) = med3
    a.qtype, a.otype, a.variant, a.D, a.S = QTYPE[q.dtype], QTYPE[out_dtype], variant, D, k.S
    a.qs = head_split(Hq // H)  # (>= 1: _launch_values took the group)
    a.B, a.Hkv, a.gqa, a.T, a.steps_per_split, a.nsplit = B, H, Hq // H // a.qs, k.T, per, nsplit
    a.vlen = int(valid_len is not None)
    a.qk_scale = qk_scale(D)
    a.cw = codeword_bytes(k)
    a.mix = int(mixed_rows(k))
    plan = _Plan()
    plan.args, plan.ptr, plan.keep = a, ctypes.addressof(a), (kt, vt)
    plan.nsplit, plan.rows_q, plan.D, plan.shape, plan.out_dtype = nsplit, B * Hq, D, (B, Hq, 1, D), out_dtype
    plan.splits_asked = (num_splits, ctas_per_sm)
    return plan


def _retarget(plan, q, k, v) -> None:
    """A kept plan set to this call's T (launch.py `follow_tokens`; the splits by
    `_token_splits`, as a build makes them)."""
    follow_tokens(plan, k.T, v.T, _resplit, plan.args, k, q.device, *plan.splits_asked)


def _resplit(a, k, device, num_splits, ctas_per_sm) -> int:
    a.nsplit, a.steps_per_split = _token_splits(k, device, num_splits, ctas_per_sm, a.variant, a.qs)
    return a.nsplit


def _decode_planned(q, k, v, num_splits, ctas_per_sm, variant, workspace, out_dtype, valid_len, rs=None):
    if not (isinstance(k, HQMQFlat) and isinstance(v, HQMQFlat)):  # no plan: the per-call path's error
        return _decode_per_call(q, k, v, num_splits, ctas_per_sm, variant, workspace, out_dtype, valid_len, rs)
    plan = _plan(q, k, v, num_splits, ctas_per_sm, variant, out_dtype, valid_len)
    vl = None if valid_len is None else _valid_len_ptr(valid_len, q)  # (a plan holds no valid_len tensor)
    return _launch_planned(plan, q, vl, workspace, rs)


def fast(q: torch.Tensor, k, v, valid_len=None) -> torch.Tensor | None:
    """decode_attention's fast route (kernels/decode_attention.py `_fast`; the auto switch
    routes this cache here): the call launched by the plan kept for exactly its layouts, None
    when none is kept (the route decides). The plan passed every check of the route when it
    was built, and the key holds what those checks read (the buffers' identities, the flats' fields,
    the codebooks' versions, q's shape, dtype and device); T is out of it (`_retarget`).
    valid_len: the plan made for one (its tensor checked here, as the per-call path does)."""
    T = k.T
    if not (PLANNED and _PLANS.plans) or type(k) is not HQMQFlat or type(v) is not HQMQFlat or T != v.T:
        return None
    plan = _find(q, k, v, None, None, None, None, valid_len is not None)
    if plan is None:
        return None
    if plan.args.T != T:  # (an eager decode step)
        _retarget(plan, q, k, v)
    return _launch_planned(plan, q, None if valid_len is None else _valid_len_ptr(valid_len, q), None)


def _launch_planned(plan, q, vl, workspace, rs=None) -> torch.Tensor:
    """A planned call's launch: the partials from the workspace when it fits, else from the
    scratch buffer with a fresh result. vl, rs: the valid count's and the row starts' device
    pointers, or None."""
    if not q.is_contiguous():
        q = q.contiguous()
    ws, part = workspace, None
    fused = FUSED_COMBINE.on  # (one launch, the counters after `out`: library.py FusedCombine)
    if ws is not None and ws.nsplit == plan.nsplit and ws.out.dtype == plan.out_dtype \
            and ws.out.numel() == plan.rows_q * plan.D:
        po, pm, pl, optr = ws.po.data_ptr(), ws.pm.data_ptr(), ws.pl.data_ptr(), ws.out.data_ptr()
        out = ws.out.view(plan.shape)
        cptr = workspace_counters(ws, plan.rows_q, q.device) if fused else None
    else:  # (part held to the launch: see fresh_partials)
        part, out, po, pm, pl, optr, cptr = fresh_partials(plan.rows_q, plan.nsplit, plan.D, plan.shape,
                                                           plan.out_dtype, q.device, counters=fused)
    entry = _FUSED.entry("kvq_hqmq_run_fused") if fused else _LIB.lib.kvq_hqmq_run
    err = on_current_stream(q.get_device(), entry, plan.ptr, q.data_ptr(), vl, rs, po, pm, pl, optr,
                            *((cptr,) if fused else ()))
    if err:
        raise RuntimeError(f"CUDA HQMQ kernel launch failed: error {err}")
    return out


__all__ = ["decode", "workspace", "unsupported", "why_unavailable", "available", "num_regs", "occupancy", "splits",
           "codebook16", "codebook8", "codeword_bytes", "AUTO_INT8", "AUTO_MIXED", "AUTO_MIXED_MED3",
           "AUTO_MIXED_HEAD_DIMS", "MIXED_HEAD_DIMS", "mixed_rows", "takes_by_default", "auto_refusal", "OPTIONS",
           "RENAMED", "AUTO", "AUTO_MED3", "NUM_VARIANTS", "JOINT_VARIANT", "joint_refusal", "default_variant", "fits",
           "MED3_VARIANTS", "PREFETCH_VARIANTS", "SOURCE", "HEAD_DIMS", "AUTO_HEAD_DIMS", "variants", "qk_scale",
           "AUTO_ROW_START", "row_start_refusal",
           "head_dim_reason", "PLANNED"]
