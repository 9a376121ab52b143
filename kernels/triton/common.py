"""Triton pieces shared by the per-format kernels of this backend (and kernels/'s
encoders): the jit Hamilton product, bit tricks that decode packed integers straight
to fp16, the flash-decoding split prologue, online-softmax step, partial store and
combine kernel, and the host side of a launch (`launch_split`, `launch`).

Decoding without conversion instructions (GPU path, `FAST`): on Hopper an
int->float or float->half conversion issues at 1/8 of the FP32 rate, so a decoder
that converts every element is issue-bound long before memory (NOTES.md: the
first int4 kernel spent ~13 SASS instructions per element). Instead a packed byte
field f at bit offset o is ORed into the mantissa of the fp16 number M = 2^(10-o)
(its mantissa's bit o then weighs 1), after `prmt` has spread two bytes into the
low bytes of two fp16 halves: (M + f) - M = f exactly, then one `fma.rn.f16x2`
applies scale and zero. Per 32-bit word of 4 bytes and field: 2 PRMT (shared by
the fields of a byte), 2 LOP3, 2 HSUB2, 2 HFMA2, all full-rate. The CPU
interpreter cannot run inline PTX: there (and for fp32 queries) the same values
come from plain integer arithmetic in fp32, rounded to the cache dtype as
`Quantizer.decode` rounds them.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common import PlanCache as SharedPlanCache, Workspace, interpreting, sm_count

try:  # Triton >= 3.0
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice


LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------
# quaternions
# ---------------------------------------------------------------------------------------
@triton.jit
def hamilton(a0, a1, a2, a3, b0, b1, b2, b3):
    """a * b, with quaternion.hamilton's term order (bit identical in fp32)."""
    c0 = a0 * b0 - a1 * b1 - a2 * b2 - a3 * b3
    c1 = a0 * b1 + a1 * b0 + a2 * b3 - a3 * b2
    c2 = a0 * b2 - a1 * b3 + a2 * b0 + a3 * b1
    c3 = a0 * b3 + a1 * b2 - a2 * b1 + a3 * b0
    return c0, c1, c2, c3


# ---------------------------------------------------------------------------------------
# bits
# ---------------------------------------------------------------------------------------
@triton.jit
def popc(x, INTERP: tl.constexpr):
    """Set bits of int32 x."""
    if INTERP:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24) & 0xFF
    else:
        return libdevice.popc(x)


@triton.jit
def f16_lane(w, K: tl.constexpr):
    """fp16 number K (0..3) packed in int64 w, as float32 (arithmetic path)."""
    return ((w >> (16 * K)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f16x4(w, FAST: tl.constexpr):
    """The four fp16 numbers packed in int64 w: fp16 (FAST, a register move) or fp32."""
    if FAST:
        return tl.inline_asm_elementwise("mov.b64 {$0, $1, $2, $3}, $4;", "=h,=h,=h,=h,l", [w],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    else:
        return f16_lane(w, 0), f16_lane(w, 1), f16_lane(w, 2), f16_lane(w, 3)


@triton.jit
def table_quad(ptr, idx, F16: tl.constexpr):
    """Row idx of a [N, 4] table of fp16 (F16) or fp32 numbers viewed as int64 (one or
    two 8-byte gathers): four fp32 numbers, exactly the stored ones."""
    if F16:
        return f16x4(tl.load(ptr + idx), False)
    else:
        w0 = tl.load(ptr + idx * 2)
        w1 = tl.load(ptr + idx * 2 + 1)
        return (w0.to(tl.int32).to(tl.float32, bitcast=True), (w0 >> 32).to(tl.int32).to(tl.float32, bitcast=True),
                w1.to(tl.int32).to(tl.float32, bitcast=True), (w1 >> 32).to(tl.int32).to(tl.float32, bitcast=True))


def _dq_asm(width: int, offset: int) -> str:
    """PTX: 4 bytes ($2) -> field (width bits at `offset` of each byte) * scale + zero,
    4 fp16 in $0, $1; scale in $3, $4, zero in $5, $6 (fp16x2 each)."""
    mask = ((1 << width) - 1) << offset
    magic = (25 - offset) << 10  # fp16 2^(10 - offset): its mantissa bit `offset` weighs 1
    m32, g32 = mask | (mask << 16), magic | (magic << 16)
    return ("{ .reg .b32 t0, t1, zr, mg; mov.b32 zr, 0; mov.b32 mg, %d; "
            "prmt.b32 t0, $2, zr, 0x4140; prmt.b32 t1, $2, zr, 0x4342; "
            "lop3.b32 t0, t0, %d, mg, 0xea; lop3.b32 t1, t1, %d, mg, 0xea; "
            "sub.f16x2 t0, t0, mg; sub.f16x2 t1, t1, mg; "
            "fma.rn.f16x2 $0, t0, $3, $5; fma.rn.f16x2 $1, t1, $4, $6; }") % (g32, m32, m32)


DQ8_0 = tl.constexpr(_dq_asm(8, 0))
DQ4_0 = tl.constexpr(_dq_asm(4, 0))
DQ4_4 = tl.constexpr(_dq_asm(4, 4))
DQ2_0 = tl.constexpr(_dq_asm(2, 0))
DQ2_2 = tl.constexpr(_dq_asm(2, 2))
DQ2_4 = tl.constexpr(_dq_asm(2, 4))
DQ2_6 = tl.constexpr(_dq_asm(2, 6))


@triton.jit
def _dq_field(b, s, z, ASM: tl.constexpr, W: tl.constexpr, O: tl.constexpr, FAST: tl.constexpr,
              RND: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r", [b, s, z], dtype=tl.float16,
                                         is_pure=True, pack=4)
    else:
        c = ((b.to(tl.int32) >> O) & ((1 << W) - 1)).to(tl.float32)
        return (c * s + z).to(RND).to(tl.float32)


@triton.jit
def dq_bytes(b, s, z, W: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    """Dequantise the 8/W fields of bytes b (uint8, any shape [..., n]) as field*s + z
    (s, z of b's shape: fp16 when FAST, else fp32). Returns the fields joined on new
    trailing dims whose row-major flattening with n is the element order
    (element i*E + e = field e of byte i, LSB first), fp16 (FAST) or fp32."""
    if W == 8:
        out = _dq_field(b, s, z, DQ8_0, 8, 0, FAST, RND)
    elif W == 4:
        out = tl.join(_dq_field(b, s, z, DQ4_0, 4, 0, FAST, RND), _dq_field(b, s, z, DQ4_4, 4, 4, FAST, RND))
    else:
        tl.static_assert(W == 2, "dq_bytes: widths 2, 4 or 8")
        out = tl.join(tl.join(_dq_field(b, s, z, DQ2_0, 2, 0, FAST, RND), _dq_field(b, s, z, DQ2_4, 2, 4, FAST, RND)),
                      tl.join(_dq_field(b, s, z, DQ2_2, 2, 2, FAST, RND), _dq_field(b, s, z, DQ2_6, 2, 6, FAST, RND)))
    return out


# ---------------------------------------------------------------------------------------
# head dims that are not powers of two (issue 28: "any multiple of 16 up to 256")
# ---------------------------------------------------------------------------------------
# tl.arange takes power-of-two extents, so a head dim such as 96 (Phi-3) or 80 (Phi-2) runs
# as the next power of two of columns (`pad_cols`: 128), the padded ones masked on every
# load and store (`pad_mask`): they read no byte and write none, the query's are zero, so
# they add nothing to a score, and the V columns they accumulate are never stored. The same
# holds for what a format counts along the head dim (groups, chunks, code words). A power
# of two is its own pad and `pad_mask` leaves its masks as they were: those kernels compile
# exactly as before. (The pad is an expression here, not a launch argument, so the kernels'
# signatures and the shipped precompile manifests stay as they are.)
@triton.jit
def pad_cols(N: tl.constexpr):
    """`[NP]`: 0 .. NP-1, NP the power of two from N (N itself when it is one, or past 256)."""
    NP: tl.constexpr = 1 if N <= 1 else 2 if N <= 2 else 4 if N <= 4 else 8 if N <= 8 else 16 if N <= 16 else \
        32 if N <= 32 else 64 if N <= 64 else 128 if N <= 128 else 256 if N <= 256 else N
    return tl.arange(0, NP)


@triton.jit
def pad_mask(mask, cols, N: tl.constexpr):
    """`mask` (broadcast against `cols`, from `pad_cols(N)`) with the padding off; `mask`
    itself when N is a power of two."""
    if (N & (N - 1)) == 0:
        return mask
    else:
        return mask & (cols < N)


def default_stages(D: int) -> int:
    """The int and KIVI kernels' pipeline stages at head dim D: 2 (their H200-swept default),
    1 past 128 columns or when padded (an H100 sweep, B=8 T=32k, reports/kernels/NOTES.md,
    fifteenth session: the second stage cost up to 2x at 256 columns and 15-35% padded).
    HQMQ's wide default is its own (`hqmq_decode_attention`)."""
    return 1 if D > 128 or D & (D - 1) else 2


# ---------------------------------------------------------------------------------------
# flash-decoding: prologue, online softmax, partials, combine
# ---------------------------------------------------------------------------------------
@triton.jit
def split_prologue(q_ptr, n_tiles, tiles_per_split, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                   FAST: tl.constexpr):
    """Program (kv row, split): its GROUP queries (padded to BH rows for tl.dot; fp16
    when FAST, else fp32; head dim padded by `pad_cols`), empty softmax state and its run
    of token tiles."""
    pid_bh = tl.program_id(0)
    sp = tl.program_id(1)
    nsplit = tl.num_programs(1)
    hr = tl.arange(0, BH)
    hmask = hr < GROUP
    qrow = pid_bh * GROUP + hr  # (b*Hkv + h)*GROUP + i == b*Hq + h*GROUP + i
    d = pad_cols(D)
    q = tl.load(q_ptr + qrow.to(tl.int64)[:, None] * D + d[None, :], mask=pad_mask(hmask[:, None], d[None, :], D),
                other=0)
    if FAST:
        q = q.to(tl.float16)
    else:
        q = q.to(tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    first = sp * tiles_per_split
    last = tl.minimum(first + tiles_per_split, n_tiles)
    return pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last


@triton.jit
def scores(q, kt, tmask, qk_scale, FAST: tl.constexpr):
    """Base-2 scores [BH, BT] of q against keys kt [D, BT] (already transposed)."""
    if FAST:
        s = tl.dot(q, kt)
    else:
        s = tl.dot(q, kt, input_precision="ieee")
    s = s * qk_scale
    return tl.where(tmask[None, :], s, float("-inf"))


@triton.jit
def softmax_update(s, v, m_i, l_i, acc, FAST: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FAST:
        pv = tl.dot(p.to(tl.float16), v)
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D: tl.constexpr):
    d = pad_cols(D)
    prow = qrow.to(tl.int64) * nsplit + sp
    tl.store(po_ptr + prow[:, None] * D + d[None, :], acc, mask=pad_mask(hmask[:, None], d[None, :], D))
    tl.store(pm_ptr + prow, m_i, mask=hmask)
    tl.store(pl_ptr + prow, l_i, mask=hmask)


@triton.jit
def combine_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, NSPLIT, D: tl.constexpr, SB: tl.constexpr):
    """Merge the NSPLIT partial (output, max, sum) of each query row."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SB)
    d = pad_cols(D)
    mx = tl.full([SB], float("-inf"), tl.float32)
    for s0 in range(0, NSPLIT, SB):
        sm = (s0 + s) < NSPLIT
        mx = tl.maximum(mx, tl.load(pm_ptr + row * NSPLIT + s0 + s, mask=sm, other=float("-inf")))
    M = tl.max(mx, axis=0)
    M = tl.where(M == float("-inf"), 0.0, M)  # every split empty (a fully masked row): no -inf - -inf below
    num = tl.zeros(d.shape, tl.float32)
    den = tl.zeros([SB], tl.float32)
    for s0 in range(0, NSPLIT, SB):
        sm = (s0 + s) < NSPLIT
        m = tl.load(pm_ptr + row * NSPLIT + s0 + s, mask=sm, other=float("-inf"))
        w = tl.where(m > float("-inf"), tl.exp2(m - M), 0.0)
        den += w * tl.load(pl_ptr + row * NSPLIT + s0 + s, mask=sm, other=0)
        o = tl.load(po_ptr + (row * NSPLIT + s0 + s)[:, None] * D + d[None, :],
                    mask=pad_mask(sm[:, None], d[None, :], D), other=0)
        num += tl.sum(o * w[:, None], axis=0)
    # A row whose every key is masked (row_start past the valid length: every split's max
    # -inf, its sum 0) gets 0/1 = 0, as SDPA gives a fully masked row, not 0/0. Otherwise the
    # sum is >= 1 (the split holding the max weighs 1, and its sum counts exp2(0) = 1), so
    # the max changes nothing.
    tot = tl.maximum(tl.sum(den, axis=0), 1.0)
    if (D & (D - 1)) == 0:
        tl.store(out_ptr + row * D + d, (num / tot).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + row * D + d, (num / tot).to(out_ptr.dtype.element_ty), mask=d < D)


# ---------------------------------------------------------------------------------------
# helpers of the per-format kernels: bit unpacking, the decoded tile, the valid length
# ---------------------------------------------------------------------------------------
@triton.jit
def unpack_rows(ptr, row_off, rmask, BT: tl.constexpr, NCOLS: tl.constexpr, W: tl.constexpr,
                ROWB: tl.constexpr, NBYTES: tl.constexpr):
    """`[BT, NCOLS]` int32 fields of width W from BT packed rows (byte offsets row_off [BT]);
    NCOLS padded by `pad_cols` (the padding reads nothing: 0)."""
    c = pad_cols(NCOLS)
    bit = c * W
    byte = bit // 8
    p = ptr + row_off[:, None] + byte[None, :]
    m = pad_mask(rmask[:, None], c[None, :], NCOLS)
    acc = tl.load(p, mask=m, other=0).to(tl.int32)
    for i in tl.static_range(1, NBYTES):
        nb = tl.load(p + i, mask=m & (byte[None, :] + i < ROWB), other=0).to(tl.int32)
        acc = acc | (nb << (8 * i))
    return (acc >> (bit % 8)[None, :]) & ((1 << W) - 1)


def nbytes_span(n: int, width: int) -> int:
    """Most bytes one field of `width` bits spans, over the n fields of a row."""
    return max(((i * width) % 8 + width + 7) // 8 for i in range(min(n, 8)))


@triton.jit
def finish(v, FAST: tl.constexpr, RND: tl.constexpr):
    """A decoded tile as the dot operand: fp16 (FAST) or fp32 rounded to the cache dtype."""
    if FAST:
        return v.to(tl.float16)
    else:
        return v.to(RND).to(tl.float32)


@triton.jit
def valid_tokens(T, vlen_ptr, VLEN: tl.constexpr):
    """The tokens a program attends to: T (a host argument), or with VLEN the device
    valid length at vlen_ptr, read at run time (a CUDA graph replays the same launch
    while the cache grows), clamped to T, which is then the capacity bound the grid was
    cut for: splits past the valid tokens run no tile and leave an empty partial."""
    if VLEN:
        T = tl.minimum(tl.load(vlen_ptr), T)
    return T


@triton.jit
def row_floor(rs_ptr, pid_bh, HKV: tl.constexpr, RSTART: tl.constexpr):
    """The first key position kv row pid_bh attends to: row_start[b] of its batch row b
    (RSTART: a left-padded batch, the pad count read at run time), else 0."""
    if RSTART:
        return tl.load(rs_ptr + pid_bh // HKV)
    else:
        return 0


@triton.jit
def first_tile(first, lo, BT: tl.constexpr, RSTART: tl.constexpr):
    """A split's first tile, past the tiles wholly before `lo` (pads: never read). A split
    left with no tile stores max -inf, sum 0, which the combine weighs 0."""
    if RSTART:
        return tl.maximum(first, lo // BT)
    else:
        return first


@triton.jit
def from_floor(tmask, tok, lo, RSTART: tl.constexpr):
    """The keys of a tile a score may use: the valid ones (tmask) from position lo on."""
    if RSTART:
        return tmask & (tok >= lo)
    else:
        return tmask


# ---------------------------------------------------------------------------------------
# host side: every launch goes through `launch`
# ---------------------------------------------------------------------------------------
# `launch_hook`, when set, receives (kernel, grid, args, kwargs) of each launch instead of
# the launch: kernels/aot_check.py records them to compile for a GPU it does not have.
launch_hook = None


def launch(kernel, grid, *args, **kw):
    if launch_hook is not None:
        return launch_hook(kernel, grid, args, kw)
    return kernel[grid](*args, **kw)


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def fast_path(q: torch.Tensor) -> bool:
    return not interpreting() and q.dtype in (torch.float16, torch.bfloat16)


def launch_split(kernel, args, runtime, const, q, B, H, nsplit, D, num_warps, num_stages, ws, cache_dtype, out_dtype):
    """The flash-decoding launch of a format's split kernel, grid (B*Hkv, nsplit), then the
    combine: q, the format's buffers (`args`), the partials, its runtime and constexpr
    arguments; the output `[B, Hq, 1, D]` is the workspace's buffer (a fresh one unless
    `ws` fits). (The unplanned form of `SplitPlan` + `run_split`, kept for callers
    outside the planned wrappers.)"""
    plan = SplitPlan(kernel, const, q, B, H, D, num_warps, num_stages, cache_dtype, out_dtype)
    return run_split(plan, q, args, runtime, nsplit, ws)


# ---------------------------------------------------------------------------------------
# host side, planned (issue 28): what a call derives from the shapes, once per layout
# ---------------------------------------------------------------------------------------
class SplitPlan:
    """What a split launch of one layout keeps between calls: the kernel, the grid rows,
    every constexpr / launch keyword, the output dtype and shape, and whatever the format's
    wrapper adds (its per-layout launch arguments, checked once). `want`: the split count
    before the cut by the token tiles (`choose_splits`' rule without T, see `splits`)."""
    __slots__ = ("kernel", "rows", "rows_q", "D", "kw", "out_dtype", "out_shape", "want", "block", "extra")

    def __init__(self, kernel, const, q, B, H, D, num_warps, num_stages, cache_dtype, out_dtype):
        Hq = q.shape[1]
        group = Hq // H
        self.kernel, self.rows, self.rows_q, self.D = kernel, B * H, B * Hq, D
        extra = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
        self.kw = dict(GROUP=group, BH=max(16, triton.next_power_of_2(group)), D=D, FAST=fast_path(q),
                       RND=TL_DTYPES[cache_dtype], **const, **extra)
        self.out_dtype = out_dtype or q.dtype
        self.out_shape = (B, Hq, 1, D)
        self.want, self.block, self.extra = 0, 1, None

    def splits(self, ntiles: int) -> tuple[int, int]:
        """`choose_splits(rows, ntiles, ...)` with the plan's `want` (set by the wrapper:
        num_splits, else programs_per_sm programs per SM over the rows)."""
        if ntiles <= 0:
            return 1, 0
        want = self.want if self.want < ntiles else ntiles
        per = -(-ntiles // want)
        return -(-ntiles // per), per


def split_want(rows: int, device, num_splits, programs_per_sm) -> int:
    """The split count `choose_splits` aims for before it is cut to the token tiles."""
    return max(1, num_splits or max(1, math.ceil(programs_per_sm * sm_count(device) / max(1, rows))))


def run_split(plan: SplitPlan, q, args, runtime, nsplit: int, ws):
    """One planned launch: the split kernel over (rows, nsplit), then the combine (see
    `launch_split`); a fresh workspace unless `ws` fits."""
    rows_q, D, out_dtype = plan.rows_q, plan.D, plan.out_dtype
    if ws is None or ws.nsplit != nsplit or ws.out.dtype != out_dtype or ws.out.numel() != rows_q * D:
        ws = Workspace(rows_q, nsplit, D, q.device, out_dtype)
    launch(plan.kernel, (plan.rows, nsplit), q, *args, ws.po, ws.pm, ws.pl, *runtime, **plan.kw)
    launch(combine_kernel, (rows_q,), ws.po, ws.pm, ws.pl, ws.out, nsplit, D=D, SB=16)
    return ws.out.view(plan.out_shape)


class PlanCache(SharedPlanCache):
    """Plans by layout key (kernels/common.py `PlanCache`: each valid while the tensors whose
    ids its key holds are alive), the key holding every int, dtype, option and q property the
    plan derives from, but not the valid length T (the split cut is redone per call,
    `SplitPlan.splits`); `lookup` makes a call's plan when none is kept. Every cache is
    listed for `clear_plans` / `plan_count`."""

    def __init__(self, max_plans: int = 256):
        super().__init__(max_plans)
        _CACHES.append(self)

    def lookup(self, layout, tensors, make, q, k, v, valid_len, *options, row_start=None):
        """The plan of a call: the cached one for (`layout`, q's shape / dtype / device,
        whether valid_len is given, whether row_start is given, `options`), else
        `make(q, k, v, valid_len, *options, row_start=row_start)` (every check of the call)
        kept for the next one. `layout`: the format's own key (the ids of `tensors` and
        its ints and dtypes). (Both tensors are read by the kernel at run time: only
        whether they are given changes the plan, a constexpr.)"""
        key = (*layout, *q_key(q), valid_len is None, row_start is None, *options)
        plan = self.get(key)
        return plan if plan is not None else self.put(key, tensors,
                                                      make(q, k, v, valid_len, *options, row_start=row_start))


_CACHES: list = []


def clear_plans() -> None:
    """Forget every Triton wrapper's plans (tests; a plan is made again at the next call)."""
    for c in _CACHES:
        c.clear()


def plan_count() -> int:
    """Plans held by every Triton wrapper (tests)."""
    return sum(len(c.plans) for c in _CACHES)


def q_key(q):
    """What a plan derives from q: shape, dtype, device (contiguity is handled per call)."""
    return q.shape, q.dtype, q.device


__all__ = ["LOG2E", "PlanCache", "clear_plans", "plan_count", "SplitPlan", "TL_DTYPES", "combine_kernel", "dq_bytes",
           "f16x4", "fast_path", "finish", "pad_cols", "pad_mask", "default_stages",
           "first_tile", "from_floor", "hamilton", "launch", "launch_split", "nbytes_span", "popc", "q_key", "row_floor",
           "run_split", "scores", "softmax_update",
           "split_prologue", "split_want", "store_partial", "table_quad", "unpack_rows", "valid_tokens"]
