"""Triton decode attention over HQMQ caches (`HQMQFlat`), with or without Med3x outliers:
the tile decoder (codes, radius levels, the codeword table, the outlier lookup), the
split kernel and its host wrapper. Launch defaults (H200 sweep, reports/kernels/NOTES.md run 8):
128-token tiles, 4 warps, no pipelining; past 128 columns with an fp32 codeword table
64-token tiles of 8 warps (`wide_launch`).

Mixed-radix code rows (HQMQ pack=mixed, `HQMQFlat.code_layout` (G, W, W_last)): chunk c
is digit c % G of group c // G, a W-bit field at bit (c // G) * W of the row (W_last bits
for the last group when G does not divide D/4). G = 2 or 4 dividing D/4 (S=24 and S=96
at d=64 and d=128): `_mixed_codes_2_4` loads each group once and splits it with G - 1
divisions by the constant 24 S (int32 for G = 2 at S <= 96, uint64 otherwise); any other
G: `_mixed_codes`, per chunk. Compiled for sm_90 without a GPU (kernels/aot_check.py's
capture): S=96 d=128 176-180 registers at BT 64/128 (whole bits: 173-174), d=64 128-132
(whole bits: 101-128). Timed on an H100 (the `hqmq-mixed` bench row, graphed B=8 T=32k):
508 us at d 128 against 406 on 12-bit rows; the CUDA kernel reads these rows in 204 us
(reports/latency/h100_2026-12-07c/), so auto sends S=96 mixed caches there.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quantizers.derived import identity
from ..common import Workspace, bh_stride, check_q, check_row_start, check_valid_len, interpreting
from ..layout import OUTLIER_BLOCK, HQMQFlat
from .common import (LOG2E, PlanCache, SplitPlan, f16x4, fast_path, finish, first_tile, from_floor, hamilton,
                     nbytes_span, pad_cols, pad_mask, popc, row_floor, run_split, scores, softmax_update,
                     split_prologue, split_want, store_partial, table_quad, unpack_rows, valid_tokens)


@triton.jit
def _mixed_codes(ptr, row_off, rmask, BT: tl.constexpr, NC: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
                 WL: tl.constexpr, R: tl.constexpr, ROWB: tl.constexpr, NBYTES: tl.constexpr):
    """`[BT, NC]` int32 codes from BT mixed-radix rows (byte offsets row_off [BT]): chunk c
    is digit c % G (least significant first) of the radix-R group c // G (module docstring);
    NC padded by `pad_cols`."""
    c = pad_cols(NC)
    g = c // G
    bit = g * W
    byte = bit // 8
    sh = (bit % 8)[None, :]
    p = ptr + row_off[:, None] + byte[None, :]
    m = pad_mask(rmask[:, None], c[None, :], NC)
    acc = tl.load(p, mask=m, other=0).to(tl.int64) >> sh
    for i in tl.static_range(1, NBYTES):
        nb = tl.load(p + i, mask=m & (byte[None, :] + i < ROWB), other=0).to(tl.int64)
        up = 8 * i - sh  # where byte i lands; past bit 63 it holds no bit of a group (W <= 63)
        acc = acc | tl.where(up < 64, nb << tl.minimum(up, 63), 0)
    width = tl.where(g == NC // G, WL, W).to(tl.int64)  # the last group holds NC % G codes
    acc = acc & ((tl.full(c.shape, 1, tl.int64) << width) - 1)[None, :]
    k = (c % G)[None, :]
    for j in tl.static_range(1, G):
        acc = tl.where(k >= j, acc // R, acc)
    return (acc % R).to(tl.int32)


@triton.jit
def _mixed_codes_2_4(ptr, row_off, rmask, BT: tl.constexpr, NC: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
                     R: tl.constexpr, ROWB: tl.constexpr, NBYTES: tl.constexpr):
    """`_mixed_codes` for G = 2 or 4 dividing NC: each group loaded once (`[BT, NC/G]`),
    its digits by G - 1 divisions by the constant R (uint64; int32 when a group and its
    bit offset fit 31 bits), interleaved back to chunk order."""
    NG: tl.constexpr = NC // G
    g = tl.arange(0, NG)
    bit = g * W
    byte = bit // 8
    p = ptr + row_off[:, None] + byte[None, :]
    if W + 7 <= 31:  # the group's bytes fit an int32 (at most 4 of them)
        sh = (bit % 8)[None, :]
        acc = tl.load(p, mask=rmask[:, None], other=0).to(tl.int32)
        for i in tl.static_range(1, NBYTES):
            nb = tl.load(p + i, mask=rmask[:, None] & (byte[None, :] + i < ROWB), other=0).to(tl.int32)
            acc = acc | (nb << (8 * i))
        v = (acc >> sh) & ((1 << W) - 1)
    else:
        sh = (bit % 8).to(tl.uint64)[None, :]
        v = tl.load(p, mask=rmask[:, None], other=0).to(tl.uint64) >> sh
        for i in tl.static_range(1, NBYTES):
            nb = tl.load(p + i, mask=rmask[:, None] & (byte[None, :] + i < ROWB), other=0).to(tl.uint64)
            up = 8 * i - sh  # where byte i lands; past bit 63 it holds no bit of a group (W <= 63)
            v = v | tl.where(up < 64, nb << tl.minimum(up, 63), 0)
        v = v & ((1 << W) - 1)
    q1 = v // R
    d0 = (v - q1 * R).to(tl.int32)
    if G == 2:
        return tl.reshape(tl.join(d0, q1.to(tl.int32)), (BT, NC))
    else:
        q2 = q1 // R
        d1 = (q1 - q2 * R).to(tl.int32)
        d3 = q2 // R
        d2 = (q2 - d3 * R).to(tl.int32)
        # join(join(d0, d2), join(d1, d3))[t, g, a, b] = d_{2a+b}: chunk 4g + 2a + b
        return tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3.to(tl.int32))), (BT, NC))


@triton.jit
def popc_wide(x, WIDE: tl.constexpr, INTERP: tl.constexpr):
    """Set bits of x: int32, or int64 (WIDE) as its two halves."""
    if WIDE:
        return popc(x.to(tl.int32), INTERP) + popc((x >> 32).to(tl.int32), INTERP)
    else:
        return popc(x, INTERP)


@triton.jit
def _hqmq_tile(codes_ptr, rad_ptr, rmax_ptr, flags_ptr, outl_ptr, oidx_ptr, table_ptr, ptab_ptr, rel_ptr,
               bh, h, t0, T, cs, rs, ms, fs, osb, isb,
               BT: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
               CG: tl.constexpr, CGW: tl.constexpr, CGL: tl.constexpr, RW: tl.constexpr, RB: tl.constexpr, RNB: tl.constexpr, FB: tl.constexpr,
               S: tl.constexpr, HAS_OUT: tl.constexpr, TAB: tl.constexpr, LOGR: tl.constexpr,
               FAST: tl.constexpr, INTERP: tl.constexpr, RND: tl.constexpr):
    """Tokens t0..t0+BT-1 of kv row bh: [BT, D]. Codeword of chunk code = p*S + s (TAB):
    0/1 the codebook [H, 24S, 4] fp32/fp16, 2/3 the secondaries [H, S, 4] fp32/fp16
    and the 24 units, P[p]*S[s] formed here (bit identical to HQMQ.decode_tokens in
    fp32). Tables are viewed as int64 so a gather moves 8 bytes. FAST with the fp16
    codebook: everything in fp16 (radius level table `rel_ptr` fp16 then). A head dim that
    is not a power of two runs padded (`pad_cols`): the padded chunks read no byte (code 0,
    radius level 0, no outlier) and their columns meet zero queries or are never stored."""
    NC: tl.constexpr = D // 4
    NCP: tl.constexpr = pad_cols(NC).shape[0]
    tok = t0 + tl.arange(0, BT)
    tmask = tok < T
    bh64 = bh.to(tl.int64)
    # mixed radix, each group loaded once (a power-of-two group count: not at a padded head dim)
    if (CG == 2 or CG == 4) and NC % CG == 0 and ((NC // CG) & (NC // CG - 1)) == 0:
        code = _mixed_codes_2_4(codes_ptr + bh64 * cs, tok * CB, tmask, BT, NC, CG, CGW, 24 * S, CB, CNB)
    elif CG > 1:  # mixed-radix groups of CG codes (module docstring)
        code = _mixed_codes(codes_ptr + bh64 * cs, tok * CB, tmask, BT, NC, CG, CGW, CGL, 24 * S, CB, CNB)
    elif CW == 12 and NC % 8 == 0:  # eight 12-bit codes in three 32-bit words: 3 loads, not 12
        g = pad_cols(NC // 8)
        pw = (codes_ptr + bh64 * cs + (tok * CB)[:, None] + (g * 12)[None, :]).to(tl.pointer_type(tl.int32))
        gm = pad_mask(tmask[:, None], g[None, :], NC // 8)
        w0 = tl.load(pw, mask=gm, other=0)
        w1 = tl.load(pw + 1, mask=gm, other=0)
        w2 = tl.load(pw + 2, mask=gm, other=0)
        # code k of the group = bits 12k .. 12k+11 of the 96-bit little-endian word stream
        x0 = w0 & 0xFFF
        x1 = (w0 >> 12) & 0xFFF
        x2 = ((w0 >> 24) & 0xFF) | ((w1 & 0xF) << 8)
        x3 = (w1 >> 4) & 0xFFF
        x4 = (w1 >> 16) & 0xFFF
        x5 = ((w1 >> 28) & 0xF) | ((w2 & 0xFF) << 4)
        x6 = (w2 >> 8) & 0xFFF
        x7 = (w2 >> 20) & 0xFFF
        code = tl.reshape(tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)),
                                  tl.join(tl.join(x1, x5), tl.join(x3, x7))), (BT, NCP))  # x_{4p+2q+r}
    elif CW == 12:  # two 12-bit codes in three bytes
        i2 = pad_cols(NC // 2)
        pc = codes_ptr + bh64 * cs + (tok * CB)[:, None] + 3 * i2[None, :]
        pm = pad_mask(tmask[:, None], i2[None, :], NC // 2)
        b0 = tl.load(pc, mask=pm, other=0).to(tl.int32)
        b1 = tl.load(pc + 1, mask=pm, other=0).to(tl.int32)
        b2 = tl.load(pc + 2, mask=pm, other=0).to(tl.int32)
        code = tl.reshape(tl.join(b0 | ((b1 & 15) << 8), (b1 >> 4) | (b2 << 4)), (BT, NCP))
    else:
        code = unpack_rows(codes_ptr + bh64 * cs, tok * CB, tmask, BT, NC, CW, CB, CNB)
    if RW == 4:  # two radius codes per byte: one vector load of the row
        i2 = pad_cols(NC // 2)
        rb = tl.load(rad_ptr + bh64 * rs + (tok * RB)[:, None] + i2[None, :],
                     mask=pad_mask(tmask[:, None], i2[None, :], NC // 2), other=0).to(tl.int32)
        rq = tl.reshape(tl.join(rb & 15, rb >> 4), (BT, NCP))
    else:
        rq = unpack_rows(rad_ptr + bh64 * rs, tok * RB, tmask, BT, NC, RW, RB, RNB)
    rmax = tl.load(rmax_ptr + bh64 * ms + tok, mask=tmask, other=0)
    if FAST and TAB == 1:
        c0, c1, c2, c3 = f16x4(tl.load(table_ptr + (h * (24 * S) + code)), True)
        if LOGR:
            rhat = rmax.to(tl.float16)[:, None] * tl.load(rel_ptr + rq)
        else:  # q * (r_max / L): q to fp16 exactly by the magic-number trick, no table gather
            qh = (rq | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
            rhat = qh * (rmax.to(tl.float32) / ((1 << RW) - 1)).to(tl.float16)[:, None]
    else:
        rmax = rmax.to(tl.float32)
        if LOGR:
            rel = tl.load(rel_ptr + rq).to(tl.float32)
        else:  # uniform levels: q / L, the IEEE quotient torch computes
            rel = tl.div_rn(rq.to(tl.float32), tl.full([BT, NCP], (1 << RW) - 1, tl.float32))
        rhat = rmax[:, None] * rel  # as HQMQ.radius_levels: r_max * rel[q]
        if TAB < 2:  # codebook [H, 24S, 4], fp16 (TAB 1) or fp32 (TAB 0)
            c0, c1, c2, c3 = table_quad(table_ptr, (h * (24 * S) + code).to(tl.int64), TAB == 1)
        else:  # P [24, 4] fp32 times the secondaries [H, S, 4], fp16 (TAB 3) or fp32 (TAB 2)
            p = code // S
            a0 = tl.load(ptab_ptr + p * 4)
            a1 = tl.load(ptab_ptr + p * 4 + 1)
            a2 = tl.load(ptab_ptr + p * 4 + 2)
            a3 = tl.load(ptab_ptr + p * 4 + 3)
            s0, s1, s2, s3 = table_quad(table_ptr, (h * S + (code - p * S)).to(tl.int64), TAB == 3)
            c0, c1, c2, c3 = hamilton(a0, a1, a2, a3, s0, s1, s2, s3)
    v0 = c0 * rhat
    v1 = c1 * rhat
    v2 = c2 * rhat
    v3 = c3 * rhat
    if HAS_OUT:
        # the token's flag bits, chunk c at bit c: 64-bit words past 32 chunks (head dim 256;
        # int32 words there once shifted bytes 4-7 out and read wrong outliers)
        FT: tl.constexpr = tl.int64 if FB > 4 else tl.int32
        fw = tl.zeros([BT], FT)
        for i in tl.static_range(FB):
            fw = fw | (tl.load(flags_ptr + bh64 * fs + tok * FB + i, mask=tmask, other=0).to(FT) << (8 * i))
        if tl.sum((fw != 0).to(tl.int32), axis=0) > 0:  # skip tiles without outliers
            cnt = tl.reshape(popc_wide(fw, FB > 4, INTERP), (BT // 64, 64))
            tok_ex = tl.reshape(tl.cumsum(cnt, axis=1) - cnt, (BT,))  # outliers earlier in the 64-block
            c = pad_cols(NC)
            fl = (fw[:, None] >> c[None, :]) & 1
            if FB > 4:
                below = (tl.full(c.shape, 1, FT) << c) - 1
            else:  # (the expression as before the 64-bit words: head dims to 128 compile as they did)
                below = (1 << c) - 1
            ch_ex = popc_wide(fw[:, None] & below[None, :], FB > 4, INTERP)  # outliers earlier in the token
            base = tl.load(oidx_ptr + bh64 * isb + tok // 64, mask=tmask, other=0)
            oi = (base + tok_ex).to(tl.int64)[:, None] + ch_ex
            om = fl != 0
            o0, o1, o2, o3 = f16x4(tl.load(outl_ptr + bh64 * osb + oi, mask=om, other=0), FAST and TAB == 1)
            v0 = tl.where(om, o0, v0)
            v1 = tl.where(om, o1, v1)
            v2 = tl.where(om, o2, v2)
            v3 = tl.where(om, o3, v3)
    out = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BT, 4 * NCP))  # element 4c+k = v_k[c]
    return finish(out, FAST, RND), tmask


@triton.jit
def _hqmq_split_kernel(q_ptr,
                       kc, kr, km, kf, ko, ki, kt, kl,
                       vc, vr, vm, vf, vo, vi, vt, vl, ptab,
                       po_ptr, pm_ptr, pl_ptr,
                       T, tiles_per_split, qk_scale,
                       k_cs, k_rs, k_ms, k_fs, k_os, k_is, v_cs, v_rs, v_ms, v_fs, v_os, v_is, vlen_ptr,
                       rs_ptr, VLEN: tl.constexpr, RSTART: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                       BT: tl.constexpr,
                       K_CW: tl.constexpr, K_CB: tl.constexpr, K_CNB: tl.constexpr, K_CG: tl.constexpr,
                       K_CGW: tl.constexpr, K_CGL: tl.constexpr, K_RW: tl.constexpr,
                       K_RB: tl.constexpr, K_RNB: tl.constexpr, K_S: tl.constexpr, K_OUT: tl.constexpr,
                       K_TAB: tl.constexpr, K_LOGR: tl.constexpr,
                       V_CW: tl.constexpr, V_CB: tl.constexpr, V_CNB: tl.constexpr, V_CG: tl.constexpr,
                       V_CGW: tl.constexpr, V_CGL: tl.constexpr, V_RW: tl.constexpr,
                       V_RB: tl.constexpr, V_RNB: tl.constexpr, V_S: tl.constexpr, V_OUT: tl.constexpr,
                       V_TAB: tl.constexpr, V_LOGR: tl.constexpr,
                       FB: tl.constexpr, FAST: tl.constexpr, INTERP: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    h = pid_bh % HKV
    lo = row_floor(rs_ptr, pid_bh, HKV, RSTART)
    for ti in range(first_tile(first, lo, BT, RSTART), last):
        t0 = ti * BT
        k, tmask = _hqmq_tile(kc, kr, km, kf, ko, ki, kt, ptab, kl, pid_bh, h, t0, T,
                              k_cs, k_rs, k_ms, k_fs, k_os, k_is,
                              BT, D, K_CW, K_CB, K_CNB, K_CG, K_CGW, K_CGL, K_RW, K_RB, K_RNB, FB, K_S, K_OUT, K_TAB, K_LOGR,
                              FAST, INTERP, RND)
        s = scores(q, tl.trans(k), from_floor(tmask, t0 + tl.arange(0, BT), lo, RSTART), qk_scale, FAST)
        v, tmask = _hqmq_tile(vc, vr, vm, vf, vo, vi, vt, ptab, vl, pid_bh, h, t0, T,
                              v_cs, v_rs, v_ms, v_fs, v_os, v_is,
                              BT, D, V_CW, V_CB, V_CNB, V_CG, V_CGW, V_CGL, V_RW, V_RB, V_RNB, FB, V_S, V_OUT, V_TAB, V_LOGR,
                              FAST, INTERP, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)



_PLANS = PlanCache()


def _flat_tensors(f: HQMQFlat) -> tuple:
    return f.codes, f.radius, f.r_max, f.flags, f.outliers, f.outlier_index, f.table, f.rel, f.rel16


def wide_launch(k: HQMQFlat) -> bool:
    """Whether the default launch is 64-token tiles of 8 warps: past 128 columns with an fp32
    table. There 128-token tiles of 4 warps spill (19-21 ms at 256 columns on an H100 against
    3.2-3.7 for 64 / 8). With the engine's fp16 codebook they are the fastest but for Med3x at
    256 columns (B=8 T=32k, H100, eager, one run, 2026-12-07; 192 / 256 columns, us): plain 806
    / 965 against 918 / 1101 for 64 / 8 and 902 / 1062 for 64 / 4; Med3x 1208 / 1781 against
    2074 / 2310 and 1535 / 1643 (reports/kernels/NOTES.md). int8 codewords (1-byte tables)
    take the same rule, untimed there."""
    return k.D > 128 and k.table.element_size() > 2


def hqmq_decode_attention(q: torch.Tensor, k: HQMQFlat, v: HQMQFlat, *, num_splits: int | None = None,
                          block_t: int | None = None, num_warps: int | None = None, num_stages: int = 1,
                          programs_per_sm: int = 8, workspace: Workspace | None = None,
                          out_dtype=None, valid_len: torch.Tensor | None = None,
                          row_start: torch.Tensor | None = None) -> torch.Tensor:
    """block_t / num_warps: 128-token tiles of 4 warps, except past 128 columns with an fp32
    codeword table (not the engine's: `formats.hqmq.engine_table`), 64-token tiles of 8 warps
    (`wide_launch`)."""
    T = k.T
    wide = wide_launch(k)
    if block_t is None:
        block_t = 64 if wide else 128
    if num_warps is None:
        num_warps = 8 if wide else 4
    ts = _flat_tensors(k) + _flat_tensors(v) + (k.ptab,)
    layout = (type(k), type(v), *map(identity, ts), k.B, k.H, k.D, k.S, k.code_bits, k.r_bits, k.table_mode, k.dtype,
           k.log_radius, k.code_pack, v.B, v.H, v.D, v.S, v.code_bits, v.r_bits, v.table_mode, v.dtype, v.log_radius,
           v.code_pack)
    plan = _PLANS.lookup(layout, ts, _hqmq_plan, q, k, v, valid_len, num_splits, block_t, num_warps, num_stages,
                         programs_per_sm, out_dtype, row_start=row_start)
    vl, _ = check_valid_len(valid_len, q)
    rs, _ = check_row_start(row_start, q)
    if v.T != T:
        raise ValueError("K and V caches differ in shape")
    nsplit, per = plan.splits(-(-T // block_t))
    args, strides = plan.extra
    if k.has_outliers or v.has_outliers:  # the outlier buffers' int64 views, made per call (never kept)
        args = list(args)
        for i, f in ((4, k), (12, v)):
            if f.has_outliers and f.outliers.numel():
                args[i] = f.outliers.view(torch.int64)
    return run_split(plan, q.contiguous(), args, [T, per, *strides, vl, rs], nsplit, workspace)


def _hqmq_plan(q, k, v, valid_len, num_splits, block_t, num_warps, num_stages, programs_per_sm, out_dtype,
               row_start=None):
    """Every check of a call and what it derives from the layout (once per plan)."""
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    _, has_vl = check_valid_len(valid_len, q)
    _, has_rs = check_row_start(row_start, q)
    if (v.B, v.H, v.T, v.D) != (B, H, T, D):
        raise ValueError("K and V caches differ in shape")
    if block_t % OUTLIER_BLOCK:
        raise ValueError(f"block_t must be a multiple of {OUTLIER_BLOCK}")
    nc = D // 4
    fast = fast_path(q)

    def tab(f: HQMQFlat) -> int:
        if f.table.dtype not in (torch.float16, torch.float32) or f.table_mode not in ("codebook", "secondaries"):
            raise ValueError(f"unsupported HQMQ table {f.table_mode}/{f.table.dtype}")
        return (0 if f.table_mode == "codebook" else 2) + (f.table.dtype == torch.float16)

    def args(f: HQMQFlat):
        dummy = f.codes
        # Without outliers the kernel never reads this argument: any int64 view will do
        # (no allocation per call on the decode path). With them the call puts the
        # outliers' view here (slot 4 of the flat's 8).
        table = f.table.view(torch.int64)
        rel = f.rel16 if fast and tab(f) == 1 else f.rel
        return [f.codes, f.radius, f.r_max, f.flags if f.has_outliers else dummy, table,
                f.outlier_index if f.has_outliers else dummy, table, rel]

    def strides(f: HQMQFlat):
        if f.has_outliers:
            o = [bh_stride(f.flags, "flags"), bh_stride(f.outliers, "outliers") // 4,
                 bh_stride(f.outlier_index, "outlier_index")]
        else:
            o = [0, 0, 0]
        return [bh_stride(f.codes, "codes"), bh_stride(f.radius, "radius"), bh_stride(f.r_max, "r_max")] + o

    def ce(f: HQMQFlat, p):
        G, W, WL, cb = f.code_layout
        if f.codes.shape[-1] != cb:
            raise ValueError(f"HQMQ code rows of {f.codes.shape[-1]} bytes, {cb} expected ({f.code_pack} codes)")
        cnb = nbytes_span(nc, f.code_bits) if G == 1 else max(((j * W) % 8 + W + 7) // 8 for j in range(8))
        return {f"{p}_CW": f.code_bits, f"{p}_CB": cb, f"{p}_CNB": cnb,
                f"{p}_CG": G, f"{p}_CGW": W, f"{p}_CGL": WL,
                f"{p}_RW": f.r_bits, f"{p}_RB": f.radius.shape[-1], f"{p}_RNB": nbytes_span(nc, f.r_bits),
                f"{p}_S": f.S, f"{p}_OUT": f.has_outliers, f"{p}_TAB": tab(f), f"{p}_LOGR": f.log_radius}

    runtime = [LOG2E / math.sqrt(D)] + strides(k) + strides(v)
    const = {**ce(k, "K"), **ce(v, "V"), "VLEN": has_vl, "RSTART": has_rs, "HKV": H, "BT": block_t, "FB": (nc + 7) // 8, "INTERP": interpreting()}
    ptab = k.ptab.float().contiguous()
    plan = SplitPlan(_hqmq_split_kernel, const, q, B, H, D, num_warps, num_stages, k.dtype, out_dtype)
    plan.want = split_want(B * H, q.device, num_splits, programs_per_sm)
    plan.extra = (args(k) + args(v) + [ptab], runtime)
    return plan


__all__ = ["hqmq_decode_attention"]
