"""HQMQ encode with the O(S) search in a Triton kernel; torch reference beside it.

What runs where (the stored fields are exactly those of `quantizers/hqmq.py`):

- torch, before the kernel: chunk radii, the Med3x median and outlier mask,
  r_max, the unit directions u (all through `HQMQ.encode_tokens` itself);
- the kernel (`hqmq_search`): for every chunk u and every secondary s of its
  kv head, v = u * conj(s), score = max(max_i |v_i|, sum_i |v_i| / 2); best s =
  first argmax over s (ties to the lower index, like torch.argmax); then p =
  nearest_hurwitz(v) for the best s (ties to the axis element, lowest axis);
  code = p * S + s;
- torch, after it: radius codes, the zeroing of codes of chunks that decode to
  zero, the bit packing (`pack_bits`), flags and outliers.

`encode_with_kernel(q, x)` is `q.encode(x)` with `HQMQ.search` replaced by the
kernel, so everything but the search is the reference code path. The torch
reference of the kernel is `HQMQ.search`.

`hqmq_tokens` is the whole encode of a decode step on the device (the store's step
encoder, kernels/formats/hqmq.py; kernels/step_encode.py has the other formats' and
the shared pieces): radii, the per-write median and outliers, r_max, the direction
search (`best_codes`), radius codes, packing (whole bits, or mixed radix: `pack_groups`),
the per-(b, h) outlier lists and the 64-token outlier index. A Med3x write of several
tokens (its median is over the whole write) is `hqmq_med3_write`: the write's chunk
radii (`_chunk_radii_kernel`), their median per (b, h) (torch.median), `_med3_write_kernel`
(per (b, h): each token's list position, the index blocks, the lengths), then
`_hqmq_kernel` with that per-(b, h) threshold, one program per token as without Med3x.

Bit identity and ties: the kernel computes v_j = sum_i u_i M[i, j] in the
order i = 0..3 (M the right-multiplication matrix of conj(s), as torch's
matmul sees it) and sums |v_i| left to right; torch's matmul/sum may order or
fuse (FMA) these differently. The two agree bit for bit except where two
secondaries (or the axis and half candidates) score within a few ulps of each
other: such near-ties can resolve differently. suites/tests/test_kernels.py checks
that every differing code is such a tie (scores equal to 1e-6).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantizers.hqmq import OUTLIER_BLOCK
from . import step_encode
from .common import interpreting
from .step_encode import device_pos, flag, nonfinite, p2, pack_row, rne, token_program
from .triton.common import hamilton, launch


@triton.jit
def best_codes(u0, u1, u2, u3, sec_ptr, h, S, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    """Code p*S + s of unit chunks (u0..u3: [BLOCK_N] fp32 each) against kv head h's
    normalised secondaries (`sec_ptr`: [H, S, 4] fp32): the search of `HQMQ.search`
    (shared by the search kernel and the decode-step encoder, kernels/step_encode.py)."""
    w0 = u0[:, None]
    w1 = u1[:, None]
    w2 = u2[:, None]
    w3 = u3[:, None]
    best = tl.full([BLOCK_N], -1.0, tl.float32)
    best_i = tl.zeros([BLOCK_N], tl.int32)
    sl = tl.arange(0, SB)
    for s0 in range(0, S, SB):
        sidx = s0 + sl
        sm = sidx < S
        sp = sec_ptr + (h * S + sidx) * 4
        c0 = tl.load(sp + 0, mask=sm, other=0.0)[None, :]  # conj(s) = (s0, -s1, -s2, -s3)
        c1 = -tl.load(sp + 1, mask=sm, other=0.0)[None, :]
        c2 = -tl.load(sp + 2, mask=sm, other=0.0)[None, :]
        c3 = -tl.load(sp + 3, mask=sm, other=0.0)[None, :]
        # v = u * c (Hamilton; the same products and order as u @ right_mul_matrix(c))
        v0, v1, v2, v3 = hamilton(w0, w1, w2, w3, c0, c1, c2, c3)
        a0 = tl.abs(v0)
        a1 = tl.abs(v1)
        a2 = tl.abs(v2)
        a3 = tl.abs(v3)
        score = tl.maximum(tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)), (a0 + a1 + a2 + a3) * 0.5)
        score = tl.where(sm[None, :], score, -1.0)
        bs, bi = tl.max(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
        upd = bs > best
        best = tl.where(upd, bs, best)
        best_i = tl.where(upd, bi + s0, best_i)
    # the best secondary's v, then its nearest element of 2T
    sp = sec_ptr + (h * S + best_i) * 4
    c0 = tl.load(sp + 0)
    c1 = -tl.load(sp + 1)
    c2 = -tl.load(sp + 2)
    c3 = -tl.load(sp + 3)
    v0, v1, v2, v3 = hamilton(u0, u1, u2, u3, c0, c1, c2, c3)
    a0 = tl.abs(v0)
    a1 = tl.abs(v1)
    a2 = tl.abs(v2)
    a3 = tl.abs(v3)
    # nearest_hurwitz: axis candidate (first max), half candidate, half wins only if strictly better
    ax_s = a0
    ax = tl.zeros([BLOCK_N], tl.int32)
    ax_v = v0
    ax = tl.where(a1 > ax_s, 1, ax)
    ax_v = tl.where(a1 > ax_s, v1, ax_v)
    ax_s = tl.maximum(ax_s, a1)
    ax = tl.where(a2 > ax_s, 2, ax)
    ax_v = tl.where(a2 > ax_s, v2, ax_v)
    ax_s = tl.maximum(ax_s, a2)
    ax = tl.where(a3 > ax_s, 3, ax)
    ax_v = tl.where(a3 > ax_s, v3, ax_v)
    ax_s = tl.maximum(ax_s, a3)
    axis_idx = 2 * ax + (ax_v < 0).to(tl.int32)
    half_s = (a0 + a1 + a2 + a3) * 0.5
    half_idx = 8 + (v0 < 0).to(tl.int32) + 2 * (v1 < 0).to(tl.int32) + 4 * (v2 < 0).to(tl.int32) \
        + 8 * (v3 < 0).to(tl.int32)
    p = tl.where(half_s > ax_s, half_idx, axis_idx)
    return p * S + best_i


@triton.jit
def _hqmq_search_kernel(u_ptr, sec_ptr, code_ptr, N, H, S,
                        BLOCK_N: tl.constexpr, SB: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    h = pid_bh % H
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    base = (pid_bh.to(tl.int64) * N + n) * 4
    u0 = tl.load(u_ptr + base + 0, mask=nm, other=1.0)
    u1 = tl.load(u_ptr + base + 1, mask=nm, other=0.0)
    u2 = tl.load(u_ptr + base + 2, mask=nm, other=0.0)
    u3 = tl.load(u_ptr + base + 3, mask=nm, other=0.0)
    code = best_codes(u0, u1, u2, u3, sec_ptr, h, S, BLOCK_N, SB)
    tl.store(code_ptr + pid_bh.to(tl.int64) * N + n, code, mask=nm)


def hqmq_search(u: torch.Tensor, secondaries: torch.Tensor, *, block_n: int | None = None,
                s_block: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Best code p*S + s for unit chunks u `[B, H, N, 4]` (float32) against the
    normalised secondaries `[H, S, 4]` (float32): the kernel twin of `HQMQ.search`."""
    if u.dim() != 4 or u.shape[-1] != 4:
        raise ValueError(f"u must be [B, H, N, 4], got {tuple(u.shape)}")
    B, H, N, _ = u.shape
    S = secondaries.shape[1]
    if secondaries.shape != (H, S, 4):
        raise ValueError(f"secondaries {tuple(secondaries.shape)} do not fit {H} heads")
    u = u.float().contiguous()
    sec = secondaries.float().contiguous().to(u.device)
    code = torch.empty(B, H, N, dtype=torch.int32, device=u.device)
    if N == 0:
        return code.long()
    if block_n is None:  # the interpreter pays per program, the GPU wants many programs
        block_n = 1024 if interpreting() else 64
    extra = {} if interpreting() else {"num_warps": num_warps}
    grid = (B * H, triton.cdiv(N, block_n))
    launch(_hqmq_search_kernel, grid, u, sec, code, N, H, S, BLOCK_N=block_n, SB=s_block, **extra)
    return code.long()


def kernel_quantizer(q):
    """A copy of HQMQ quantizer `q` (same config, layer, role, seed) whose search is the kernel."""
    base = type(q)
    if not hasattr(base, "search"):
        raise TypeError(f"{base.__name__} is not an HQMQ quantizer")

    class KernelHQMQ(base):
        def search(self, u, shared):
            return hqmq_search(u, self.secondaries(shared).to(u.device))

    KernelHQMQ.__name__ = f"Kernel{base.__name__}"
    return KernelHQMQ(q.config, layer=q.layer, role=q.role, seed=q.seed)


def encode_with_kernel(q, x: torch.Tensor):
    """`q.encode(x)` with the search in the Triton kernel: same Packed fields."""
    return kernel_quantizer(q).encode(x)


# ---------------------------------------------------------------------------------------
# HQMQ (+ Med3x)
# ---------------------------------------------------------------------------------------
@triton.jit
def pack_groups(code, NCP: tl.constexpr, G: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
                NGP: tl.constexpr, NBP: tl.constexpr):
    """Bytes `[NBP]` (int64, 0..255) of a mixed-radix code row (quantizers/packing.py
    `pack_mixed`): codes `[NCP]` (int32, zero past the row) combined G at a time into
    radix-R integers sum_k c_k R^k (< 2^63), group j at bits [j*W, ...) of the
    little-endian LSB-first stream (the last group's higher bits are zero)."""
    c = tl.arange(0, NCP)
    k = c % G
    wgt = tl.full([NCP], 1, tl.int64)
    for j in tl.static_range(1, G):
        wgt = tl.where(k >= j, wgt * R, wgt)
    gi = tl.arange(0, NGP)
    digit = code.to(tl.int64) * wgt
    v = tl.sum(tl.where((c // G)[None, :] == gi[:, None], digit[None, :], 0), axis=1)  # [NGP], disjoint digits
    jb = tl.arange(0, NBP)[:, None]
    sh = gi[None, :] * W - 8 * jb  # where group i's bit 0 falls relative to byte j's bit 0
    ov = (sh > -W) & (sh < 8)
    left = tl.where(ov & (sh > 0), sh, 0)
    right = tl.where(ov & (sh < 0), -sh, 0)
    part = tl.where(ov, (((v[None, :] >> right) & 0xFF) << left) & 0xFF, 0)  # never past bit 63
    return tl.sum(part, axis=1)


@triton.jit
def norm4(x0, x1, x2, x3):
    """Chunk radius, as torch's norm: the squares summed in order, then sqrt (both HQMQ step
    kernels call this one helper: a write's median and its outlier counts see the radii
    the encode sees; launches take no FMA contraction, `step_encode.launch`)."""
    return tl.sqrt_rn(((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3)


@triton.jit
def _chunk_radius(xo, m):
    """norm4 of the chunks whose first element is at xo (4 consecutive elements), 0 where ~m."""
    x0 = tl.load(xo + 0, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(xo + 1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xo + 2, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(xo + 3, mask=m, other=0.0).to(tl.float32)
    return norm4(x0, x1, x2, x3)


@triton.jit(do_not_specialize=["n"])
def _chunk_radii_kernel(x_ptr, sxb, sxh, sxt, H, n, r_ptr, NC: tl.constexpr, BLK: tl.constexpr):
    """The chunk radii of a write (norm4, as the encode sees them) into r `[B*H, n]` fp32,
    n = T * NC, chunk i of row bh = token i // NC, chunk i % NC: grid (B*H, cdiv(n, BLK))."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    i = tl.program_id(1) * BLK + tl.arange(0, BLK)
    m = i < n
    r = _chunk_radius(x_ptr + b.to(tl.int64) * sxb + h * sxh + (i // NC) * sxt + (i % NC) * 4, m)
    tl.store(r_ptr + bh.to(tl.int64) * n + i, r, mask=m)


@triton.jit(do_not_specialize=["T", "t0"])
def _med3_write_kernel(r_ptr, T, t0, C, med_ptr, st_ptr, olen_ptr, oi_ptr, oi_h,
                       NC: tl.constexpr, NCP: tl.constexpr, TB: tl.constexpr, OB: tl.constexpr):
    """Med3x's per-token part of a write of T tokens at token t0, one program per (b, h),
    from the write's chunk radii (`r_ptr` [B*H, T*NC]) and their median (`med_ptr` [B*H]):
    the outlier count of every token (r > C * r_med, r > 0), their running sum: each
    token's start in the (b, h) list (`st_ptr` [B*H, T], int64: the list length before
    the write plus the write's outliers before the token), the start of every OB-token
    index block the write opens (`oi_ptr`), and the list length after the write (`olen_ptr`)."""
    bh = tl.program_id(0)
    bh64 = bh.to(tl.int64)
    thr = C * tl.load(med_ptr + bh)
    olen = tl.load(olen_ptr + bh)
    c = tl.arange(0, NCP)
    cm = c < NC
    for s in range(0, T, TB):
        tt = s + tl.arange(0, TB)
        tm = tt < T
        m = tm[:, None] & cm[None, :]
        r = tl.load(r_ptr + bh64 * T * NC + tt[:, None] * NC + c[None, :], mask=m, other=0.0)
        per_tok = tl.sum(((r > thr) & (r > 0) & m).to(tl.int32), axis=1)  # [TB]
        start = olen + (tl.cumsum(per_tok, axis=0) - per_tok).to(tl.int64)
        tl.store(st_ptr + bh64 * T + tt, start, mask=tm)
        tok = t0 + tt
        tl.store(oi_ptr + bh64 * oi_h + tok // OB, start.to(tl.int32), mask=tm & (tok % OB == 0))
        olen += tl.sum(per_tok, axis=0).to(tl.int64)
    tl.store(olen_ptr + bh, olen)


@triton.jit(do_not_specialize=["t0", "blk", "T"])
def _hqmq_kernel(x_ptr, sxb, sxh, sxt, sec_ptr, rel_ptr, S, H, t0,
                 c_ptr, c_h, c_t, rad_ptr, r_h, r_t, m_ptr, m_h, m_t, f_ptr, f_h, f_t,
                 o_ptr, o_h, olen_ptr, oi_ptr, oi_h, blk, err_ptr, C, pos_ptr, med_ptr, st_ptr, T,
                 DEVPOS: tl.constexpr,
                 NC: tl.constexpr, NCP: tl.constexpr, CBITS: tl.constexpr, CB: tl.constexpr, CBP: tl.constexpr,
                 CG: tl.constexpr, CGW: tl.constexpr, NGP: tl.constexpr,
                 RBITS: tl.constexpr, RB: tl.constexpr, RBP: tl.constexpr, FB: tl.constexpr, FBP: tl.constexpr,
                 LOG: tl.constexpr, MED3: tl.constexpr, INDEX: tl.constexpr, SB: tl.constexpr,
                 OB: tl.constexpr = 64, WRITE: tl.constexpr = False):
    """`HQMQ.encode_tokens` of one token row (program (b*H+h, t)). With Med3x (MED3, one
    token per write) the median is over this token's chunks and the outliers go to the
    end of the (b, h) list (`olen_ptr`), the block start to the index when the token
    opens a 64-token block (INDEX, at block `blk`). `sb`/`sh`: the shared b/h strides of
    the token buffers (one [B, H, Tcap] layout), `ct`..`ft` their token strides.
    DEVPOS: the device position at pos_ptr is added to t0; with MED3 the kernel then
    decides itself whether the token opens an OB-token block (no host value in the launch).
    WRITE (MED3, a write of T tokens, grid (B*H, T)): `_med3_write_kernel` ran first; the
    threshold is C times its (b, h) median over the write (`med_ptr`), the token's outliers
    go to its list position (`st_ptr`, [B*H, T]); lengths and index blocks are left alone
    (that kernel wrote them)."""
    t0, bh, b, h, t = token_program(t0, pos_ptr, H, DEVPOS)
    c = tl.arange(0, NCP)
    cm = c < NC
    xo = x_ptr + b.to(tl.int64) * sxb + h * sxh + t * sxt + c * 4
    x0 = tl.load(xo + 0, mask=cm, other=0.0).to(tl.float32)
    x1 = tl.load(xo + 1, mask=cm, other=0.0).to(tl.float32)
    x2 = tl.load(xo + 2, mask=cm, other=0.0).to(tl.float32)
    x3 = tl.load(xo + 3, mask=cm, other=0.0).to(tl.float32)
    n_bad = tl.sum((nonfinite(x0).to(tl.int32) + nonfinite(x1).to(tl.int32) + nonfinite(x2).to(tl.int32)
                    + nonfinite(x3).to(tl.int32)) * cm.to(tl.int32), axis=0)
    r = norm4(x0, x1, x2, x3)
    if MED3 and WRITE:  # the (b, h) median of the whole write, from `_med3_write_kernel`
        r_med = tl.load(med_ptr + bh)
        outl = (r > C * r_med) & (r > 0) & cm
    elif MED3:
        # torch.median (the lower middle value): the radius with at most k smaller and more than k
        # smaller-or-equal, k = (NC - 1) // 2, by an [NC, NC] comparison
        ri = r[:, None]
        rj = tl.where(cm, r, float("inf"))[None, :]
        less = tl.sum((rj < ri).to(tl.int32), axis=1)
        leq = tl.sum((rj <= ri).to(tl.int32), axis=1)
        med = cm & (less <= (NC - 1) // 2) & (leq > (NC - 1) // 2)
        r_med = tl.max(tl.where(med, r, -1.0), axis=0)
        outl = (r > C * r_med) & (r > 0) & cm
    else:
        outl = c < 0
    rr = tl.where(outl | ~cm, 0.0, r)
    r_max = tl.max(rr, axis=0)
    over = r_max > 65504.0
    rm16 = r_max.to(tl.float16)
    rm = rm16.to(tl.float32)
    pos = r > 0
    safe_r = tl.where(pos, r, 1.0)
    u0 = tl.where(pos, tl.math.div_rn(x0, safe_r), 1.0)
    u1 = tl.where(pos, tl.math.div_rn(x1, safe_r), 0.0)
    u2 = tl.where(pos, tl.math.div_rn(x2, safe_r), 0.0)
    u3 = tl.where(pos, tl.math.div_rn(x3, safe_r), 0.0)
    code = best_codes(u0, u1, u2, u3, sec_ptr, h, S, NCP, SB)
    L: tl.constexpr = (1 << RBITS) - 1
    if LOG:  # argmin |r - r_max * rel[q]|, the first on ties
        rq = tl.zeros([NCP], tl.int32)
        bestd = tl.abs(rr - rm * tl.load(rel_ptr))
        for q in tl.static_range(1, L + 1):
            dq = tl.abs(rr - rm * tl.load(rel_ptr + q))
            rq = tl.where(dq < bestd, q, rq)
            bestd = tl.minimum(dq, bestd)
    else:
        rq = rne(tl.math.div_rn(rr, tl.where(rm > 0, rm, 1.0)) * (L * 1.0))
        rq = tl.minimum(tl.maximum(rq, 0.0), L * 1.0).to(tl.int32)
    rq = tl.where(cm, rq, 0)
    code = tl.where((rq == 0) | outl | ~cm, 0, code)
    bh64 = bh.to(tl.int64)
    tok = t0 + t
    j = tl.arange(0, CBP)
    if CG > 1:  # mixed radix: CG codes per CGW-bit group
        row = pack_groups(code, NCP, CG, CGW, 24 * S, NGP, CBP)
    else:
        row = pack_row(code, CBITS, NCP, CBP)
    tl.store(c_ptr + bh64 * c_h + tok * c_t + j, row.to(tl.uint8), mask=j < CB)
    j = tl.arange(0, RBP)
    tl.store(rad_ptr + bh64 * r_h + tok * r_t + j, pack_row(rq, RBITS, NCP, RBP).to(tl.uint8), mask=j < RB)
    tl.store(m_ptr + bh64 * m_h + tok * m_t, rm16)
    if MED3:
        oi = outl.to(tl.int32)
        j = tl.arange(0, FBP)
        tl.store(f_ptr + bh64 * f_h + tok * f_t + j, pack_row(oi, 1, NCP, FBP).to(tl.uint8), mask=j < FB)
        if WRITE:  # this token's place in its (b, h) list, from `_med3_write_kernel`
            start = tl.load(st_ptr + bh64 * T + t)
        else:
            start = tl.load(olen_ptr + bh)
        dest = start + tl.cumsum(oi, axis=0) - oi  # list end + rank among this token's outliers
        ob = o_ptr + bh64 * o_h + dest * 4
        tl.store(ob + 0, x0.to(tl.float16), mask=outl)
        tl.store(ob + 1, x1.to(tl.float16), mask=outl)
        tl.store(ob + 2, x2.to(tl.float16), mask=outl)
        tl.store(ob + 3, x3.to(tl.float16), mask=outl)
        big = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
        over = over | (tl.max(tl.where(outl, big, 0.0), axis=0) > 65504.0)
        if not WRITE:  # (a write's lengths and index blocks: `_med3_write_kernel`)
            tl.store(olen_ptr + bh, start + tl.sum(oi, axis=0))
        if INDEX:
            tl.store(oi_ptr + bh64 * oi_h + blk, start.to(tl.int32))
        if DEVPOS:
            tl.store(oi_ptr + bh64 * oi_h + tok // OB, start.to(tl.int32), mask=tok % OB == 0)
    flag(err_ptr, tl.where(n_bad > 0, 1, 0) | tl.where(over, 2, 0), n_bad, tok)


def hqmq_tokens(x, flat, S: int, rel, t0: int, err, *, C: float = 3.0, med3: bool = False,
                outlier_len=None, index_block: int | None = None, pos=None, med3_plan=None):
    """HQMQ codes of x `[B, H, t, D]` into the buffers of `flat` (an `HQMQFlat`) at token
    t0 (plus the device position `pos`, see `int_rows`). Med3x (one token): outliers
    appended to `flat.outliers`' (b, h) lists at `outlier_len` (`[B*H]` int64, advanced),
    the block start written to `flat.outlier_index` at `index_block` (None: the token
    opens no block; with `pos` the kernel writes it when the token at pos opens one).
    A Med3x write of t tokens is `hqmq_med3_write` (its median is over the write)."""
    if pos is not None and index_block is not None:
        raise ValueError("a write at a device position finds its outlier index block on the device")
    B, H, t, D = x.shape
    if med3 and t != 1 and med3_plan is None:
        raise ValueError("a Med3x write of several tokens takes its median over the write: hqmq_med3_write")
    r_med, starts = med3_plan if med3_plan is not None else (x, x)  # (never read without one)
    pos_arg, devpos = device_pos(pos, x)
    nc = D // 4
    G, W, _, cb = flat.code_layout
    rb, fb = (nc * flat.r_bits + 7) // 8, (nc + 7) // 8
    c, r, m = flat.codes, flat.radius, flat.r_max
    if med3:
        f, o, oi = flat.flags, flat.outliers, flat.outlier_index
        med = (f, f.stride(1), f.stride(2), o, o.stride(1), outlier_len, oi, oi.stride(1), index_block or 0)
    else:
        med = (c, 0, 0, c, 0, c, c, 0, 0)  # never read
    step_encode.launch(_hqmq_kernel, (B * H, t), x, x.stride(0), x.stride(1), x.stride(2), flat.sec, rel, S, H, t0,
            c, c.stride(1), c.stride(2), r, r.stride(1), r.stride(2), m, m.stride(1), m.stride(2), *med,
            err, float(C), pos_arg, r_med, starts, t, DEVPOS=devpos, NC=nc, NCP=p2(nc), CBITS=flat.code_bits, CB=cb, CBP=p2(cb),
            CG=G, CGW=W, NGP=p2(-(-nc // G)),
            RBITS=flat.r_bits, RB=rb, RBP=p2(rb), FB=fb, FBP=p2(fb), LOG=flat.log_radius, MED3=med3,
            INDEX=index_block is not None, SB=32, OB=OUTLIER_BLOCK, WRITE=med3_plan is not None)


def hqmq_med3_write(x, flat, S: int, rel, t0: int, err, *, C: float, outlier_len) -> None:
    """`HQMQ.encode_tokens` of a Med3x write of t tokens x `[B, H, t, D]` on the device,
    into the buffers of `flat` at tokens t0..t0+t-1, with no host read: the write's chunk
    radii (`_chunk_radii_kernel`), r_med = their lower median per (b, h) (torch.median: the
    k-th smallest, k = (t*D/4 - 1) // 2, the value the encode's own median gives), then
    `_med3_write_kernel` (a program per (b, h): each token's start in its (b, h) outlier
    list, the starts of the 64-token index blocks the write opens, the lists' lengths
    `outlier_len` advanced), then `_hqmq_kernel` over (B*H, t) with that per-(b, h)
    threshold, each token's outliers stored at its start. The caller has made room in
    `flat.outliers` (t*D/8 more per list: at most half the chunks exceed C times a lower
    median) and in `flat.outlier_index`. The radii take a float32 temporary of half x's
    bytes (x fp16).
    (Until 2026-12-05 the median was a radix select inside `_med3_write_kernel`, 16 passes
    over the write in one program per (b, h). Replacing it did not close Med3x's prefill gap
    to HQMQ's: ~0.045 s more at a 512-token batch-8 prefill of the embedded shape on an H100
    afterwards, against ~0.06 s on the H200 before; reports/generate/README.md.)"""
    B, H, t, D = x.shape
    nc, n = D // 4, t * (D // 4)
    r = torch.empty(B * H, n, dtype=torch.float32, device=x.device)
    blk = 1024
    step_encode.launch(_chunk_radii_kernel, (B * H, triton.cdiv(n, blk)), x, x.stride(0), x.stride(1), x.stride(2),
                       H, n, r, NC=nc, BLK=blk)
    med = torch.median(r, dim=1).values  # the lower median: as the encode's torch.median
    st = torch.empty(B * H, t, dtype=torch.int64, device=x.device)
    oi = flat.outlier_index
    tb = 64 if interpreting() else 32  # tokens a loop step: the interpreter pays per iteration
    step_encode.launch(_med3_write_kernel, (B * H,), r, t, t0, float(C), med, st, outlier_len, oi, oi.stride(1),
                       NC=nc, NCP=p2(nc), TB=tb, OB=OUTLIER_BLOCK)
    hqmq_tokens(x, flat, S, rel, t0, err, C=C, med3=True, outlier_len=outlier_len, med3_plan=(med, st))


__all__ = ["best_codes", "hqmq_search", "hqmq_tokens", "hqmq_med3_write", "kernel_quantizer", "encode_with_kernel"]
