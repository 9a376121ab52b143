"""Fused decode attention over packed KV caches (Triton), with a torch reference.

One decode step: queries `q [B, Hq, 1, d]` (GQA: Hq = GROUP * Hkv, q head
`h*GROUP + i` reads kv head `h`) attend to ALL T valid cached keys of their kv
head, non-causally: `softmax(q K^T / sqrt(d)) V`. K and V are decoded from the
packed bytes inside the kernel, tile by tile in registers, and never written out.

Flash-decoding: the grid is (B*Hkv, NSPLIT). Each program takes one kv head (the
whole GQA group of queries, padded to 16 rows for `tl.dot`) and a contiguous run of
token tiles: decode a K tile, score it with one `tl.dot`, online softmax (base 2),
decode the V tile, accumulate with a second `tl.dot`. Partials are merged by
`combine_kernel`. NSPLIT gives about `programs_per_sm` programs per multiprocessor,
so batch 1 fills the GPU too.

Two decode paths (kernels/triton_common.py says why): on a GPU with fp16/bf16
queries (`FAST`) tiles are decoded straight to fp16 with bit tricks (inline PTX, no
conversion instructions) and the dots run on fp16 operands (bf16 queries are cast
to fp16), fp32 accumulation; under the CPU interpreter, or with fp32 queries,
decoding is plain fp32 arithmetic rounded to the cache dtype and the dots are
fp32 (`input_precision="ieee"`): the tests match `Quantizer.decode` to ~1e-6 there.

Buffers follow the store <-> kernel contract (layout.py): `[B, H, Tcap, ...]`
with T valid tokens; every buffer is indexed with its real per-(b, h) stride.

Formats: `hqmq_decode_attention` (HQMQ, with or without Med3x outliers),
`int_decode_attention` (naive per-token int groups), `kivi_decode_attention`
(KIVI: per-channel key groups, per-token value groups, fp16 window),
`fp8_decode_attention` (fp8 e4m3/e5m2 with a per-kv-head scale folded into the
score scale and the output). Reference: `reference_decode_attention(q, k, v)`.

Launch defaults are the best of a sweep at B=8, T=32k on an H200 (kernels/NOTES.md,
run 8): HQMQ 128-token tiles, 4 warps, no pipelining; int 128/4, 2 stages; KIVI
64/4, 2 stages, 12 programs per SM; fp8 64/4, 3 stages, 12 per SM.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .common import Workspace, bh_stride, check_q, check_valid_len, choose_splits, interpreting, pow2
from .layout import OUTLIER_BLOCK, FP8Flat, HQMQFlat, IntFlat, KIVIFlat
from .triton_common import (LOG2E, combine_kernel, dq_bytes, f16x4, hamilton, popc, scores, softmax_update,
                            split_prologue, store_partial, table_quad)


# ---------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------
def reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 softmax(q K^T / sqrt(d)) V over every key; q `[B,Hq,1,d]`, k/v `[B,Hkv,T,d]`.
    Returns float32."""
    B, Hq, _, D = q.shape
    g = Hq // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(D)
    return torch.softmax(s, dim=-1) @ vf


# ---------------------------------------------------------------------------------------
# generic bit unpacking (widths that do not divide a byte)
# ---------------------------------------------------------------------------------------
@triton.jit
def _unpack_rows(ptr, row_off, rmask, BT: tl.constexpr, NCOLS: tl.constexpr, W: tl.constexpr,
                 ROWB: tl.constexpr, NBYTES: tl.constexpr):
    """`[BT, NCOLS]` int32 fields of width W from BT packed rows (byte offsets row_off [BT])."""
    c = tl.arange(0, NCOLS)
    bit = c * W
    byte = bit // 8
    p = ptr + row_off[:, None] + byte[None, :]
    acc = tl.load(p, mask=rmask[:, None], other=0).to(tl.int32)
    for i in tl.static_range(1, NBYTES):
        nb = tl.load(p + i, mask=rmask[:, None] & (byte[None, :] + i < ROWB), other=0).to(tl.int32)
        acc = acc | (nb << (8 * i))
    return (acc >> (bit % 8)[None, :]) & ((1 << W) - 1)


def _nbytes_span(n: int, width: int) -> int:
    """Most bytes one field of `width` bits spans, over the n fields of a row."""
    return max(((i * width) % 8 + width + 7) // 8 for i in range(min(n, 8)))


@triton.jit
def _finish(v, FAST: tl.constexpr, RND: tl.constexpr):
    """A decoded tile as the dot operand: fp16 (FAST) or fp32 rounded to the cache dtype."""
    if FAST:
        return v.to(tl.float16)
    else:
        return v.to(RND).to(tl.float32)


# ---------------------------------------------------------------------------------------
# tile decoders
# ---------------------------------------------------------------------------------------
@triton.jit
def _hqmq_tile(codes_ptr, rad_ptr, rmax_ptr, flags_ptr, outl_ptr, oidx_ptr, table_ptr, ptab_ptr, rel_ptr,
               bh, h, t0, T, cs, rs, ms, fs, osb, isb,
               BT: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
               RW: tl.constexpr, RB: tl.constexpr, RNB: tl.constexpr, FB: tl.constexpr,
               S: tl.constexpr, HAS_OUT: tl.constexpr, TAB: tl.constexpr, LOGR: tl.constexpr,
               FAST: tl.constexpr, INTERP: tl.constexpr, RND: tl.constexpr):
    """Tokens t0..t0+BT-1 of kv row bh: [BT, D]. Codeword of chunk code = p*S + s (TAB):
    0/1 the codebook [H, 24S, 4] fp32/fp16, 2/3 the secondaries [H, S, 4] fp32/fp16
    and the 24 units, P[p]*S[s] formed here (bit identical to HQMQ.decode_tokens in
    fp32). Tables are viewed as int64 so a gather moves 8 bytes. FAST with the fp16
    codebook: everything in fp16 (radius level table `rel_ptr` fp16 then)."""
    NC: tl.constexpr = D // 4
    tok = t0 + tl.arange(0, BT)
    tmask = tok < T
    bh64 = bh.to(tl.int64)
    if CW == 12 and NC % 8 == 0:  # eight 12-bit codes in three 32-bit words: 3 loads, not 12
        g = tl.arange(0, NC // 8)
        pw = (codes_ptr + bh64 * cs + (tok * CB)[:, None] + (g * 12)[None, :]).to(tl.pointer_type(tl.int32))
        w0 = tl.load(pw, mask=tmask[:, None], other=0)
        w1 = tl.load(pw + 1, mask=tmask[:, None], other=0)
        w2 = tl.load(pw + 2, mask=tmask[:, None], other=0)
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
                                  tl.join(tl.join(x1, x5), tl.join(x3, x7))), (BT, NC))  # x_{4p+2q+r}
    elif CW == 12:  # two 12-bit codes in three bytes
        i3 = 3 * tl.arange(0, NC // 2)
        pc = codes_ptr + bh64 * cs + (tok * CB)[:, None] + i3[None, :]
        b0 = tl.load(pc, mask=tmask[:, None], other=0).to(tl.int32)
        b1 = tl.load(pc + 1, mask=tmask[:, None], other=0).to(tl.int32)
        b2 = tl.load(pc + 2, mask=tmask[:, None], other=0).to(tl.int32)
        code = tl.reshape(tl.join(b0 | ((b1 & 15) << 8), (b1 >> 4) | (b2 << 4)), (BT, NC))
    else:
        code = _unpack_rows(codes_ptr + bh64 * cs, tok * CB, tmask, BT, NC, CW, CB, CNB)
    if RW == 4:  # two radius codes per byte: one vector load of the row
        rb = tl.load(rad_ptr + bh64 * rs + (tok * RB)[:, None] + tl.arange(0, NC // 2)[None, :],
                     mask=tmask[:, None], other=0).to(tl.int32)
        rq = tl.reshape(tl.join(rb & 15, rb >> 4), (BT, NC))
    else:
        rq = _unpack_rows(rad_ptr + bh64 * rs, tok * RB, tmask, BT, NC, RW, RB, RNB)
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
            rel = tl.div_rn(rq.to(tl.float32), tl.full([BT, NC], (1 << RW) - 1, tl.float32))
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
        fw = tl.zeros([BT], tl.int32)  # the token's flag bits, chunk c at bit c
        for i in tl.static_range(FB):
            fw = fw | (tl.load(flags_ptr + bh64 * fs + tok * FB + i, mask=tmask, other=0).to(tl.int32) << (8 * i))
        if tl.sum((fw != 0).to(tl.int32), axis=0) > 0:  # skip tiles without outliers
            cnt = tl.reshape(popc(fw, INTERP), (BT // 64, 64))
            tok_ex = tl.reshape(tl.cumsum(cnt, axis=1) - cnt, (BT,))  # outliers earlier in the 64-block
            c = tl.arange(0, NC)
            fl = (fw[:, None] >> c[None, :]) & 1
            ch_ex = popc(fw[:, None] & ((1 << c) - 1)[None, :], INTERP)  # outliers earlier in the token
            base = tl.load(oidx_ptr + bh64 * isb + tok // 64, mask=tmask, other=0)
            oi = (base + tok_ex).to(tl.int64)[:, None] + ch_ex
            om = fl != 0
            o0, o1, o2, o3 = f16x4(tl.load(outl_ptr + bh64 * osb + oi, mask=om, other=0), FAST and TAB == 1)
            v0 = tl.where(om, o0, v0)
            v1 = tl.where(om, o1, v1)
            v2 = tl.where(om, o2, v2)
            v3 = tl.where(om, o3, v3)
    out = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BT, D))  # element 4c+k = v_k[c]
    return _finish(out, FAST, RND), tmask


@triton.jit
def _int_tile(codes_ptr, scale_ptr, zero_ptr, bh, tok, tmask, cs, ss,
              BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
              G: tl.constexpr, VEC: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    """Per-token groups of G along the head dim: [BT, D] of rows `tok` of kv row bh.
    VEC: W divides 8 and a group is whole bytes: bytes [BT, D/G, G*W/8], bit-trick decode."""
    NG: tl.constexpr = D // G
    bh64 = bh.to(tl.int64)
    g = tl.arange(0, NG)
    so = bh64 * ss + tok[:, None] * NG + g[None, :]
    sc = tl.load(scale_ptr + so, mask=tmask[:, None], other=0)
    ze = tl.load(zero_ptr + so, mask=tmask[:, None], other=0)
    if not FAST:
        sc = sc.to(tl.float32)
        ze = ze.to(tl.float32)
    if VEC:
        GBY: tl.constexpr = G * W // 8
        j = tl.arange(0, GBY)
        off = bh64 * cs + (tok * CB)[:, None, None] + (g * GBY)[None, :, None] + j[None, None, :]
        b = tl.load(codes_ptr + off, mask=tmask[:, None, None], other=0)
        shp: tl.constexpr = (BT, NG, GBY)
        val = dq_bytes(b, tl.broadcast_to(sc[:, :, None], shp), tl.broadcast_to(ze[:, :, None], shp), W, FAST, RND)
        return tl.reshape(val, (BT, D))
    else:
        code = _unpack_rows(codes_ptr + bh64 * cs, tok * CB, tmask, BT, D, W, CB, CNB).to(tl.float32)
        val = tl.reshape(code, (BT, NG, G)) * sc.to(tl.float32)[:, :, None] + ze.to(tl.float32)[:, :, None]
        return _finish(tl.reshape(val, (BT, D)), FAST, RND)


@triton.jit
def _kivi_kt_tile(codes_ptr, scale_ptr, zero_ptr, bh, t0, NG, cs, ss,
                  BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, G: tl.constexpr, GB: tl.constexpr,
                  FAST: tl.constexpr, RND: tl.constexpr):
    """Keys per channel over G-token groups (codes [NGcap, D, GB] per kv row): the
    TRANSPOSED tile k^T [D, BT] of tokens t0.. (BT a multiple of G, t0 too)."""
    NGT: tl.constexpr = BT // G
    bh64 = bh.to(tl.int64)
    gi = t0 // G + tl.arange(0, NGT)
    gm = gi < NG
    j = tl.arange(0, D)
    by = tl.arange(0, GB)
    off = bh64 * cs + ((gi.to(tl.int64)[:, None] * D + j[None, :]) * GB)[:, :, None] + by[None, None, :]
    b = tl.load(codes_ptr + off, mask=gm[:, None, None], other=0)  # [NGT, D, GB]
    so = bh64 * ss + gi.to(tl.int64)[:, None] * D + j[None, :]
    sc = tl.load(scale_ptr + so, mask=gm[:, None], other=0)  # [NGT, D]
    ze = tl.load(zero_ptr + so, mask=gm[:, None], other=0)
    if not FAST:
        sc = sc.to(tl.float32)
        ze = ze.to(tl.float32)
    shp: tl.constexpr = (NGT, D, GB)
    val = dq_bytes(b, tl.broadcast_to(sc[:, :, None], shp), tl.broadcast_to(ze[:, :, None], shp), W, FAST, RND)
    if NGT == 1:  # one group per tile: no transposition of groups and channels
        return tl.reshape(val, (D, BT))  # token within its group = byte * (8/W) + field
    else:
        val = tl.reshape(val, (NGT, D, G))
        return tl.reshape(tl.permute(val, (1, 0, 2)), (D, BT))


@triton.jit
def _fp16_tile(ptr, bh, t0, TR, rs, BT: tl.constexpr, D: tl.constexpr, FAST: tl.constexpr):
    tok = t0 + tl.arange(0, BT)
    tmask = (tok >= 0) & (tok < TR)
    j = tl.arange(0, D)
    off = bh.to(tl.int64) * rs + tl.maximum(tok, 0)[:, None] * D + j[None, :]
    x = tl.load(ptr + off, mask=tmask[:, None], other=0)
    if FAST:
        return x.to(tl.float16), tmask
    else:
        return x.to(tl.float32), tmask


@triton.jit
def _fp8_tile(codes_ptr, bh, tok, tmask, cs, scale, D: tl.constexpr, E5: tl.constexpr,
              FAST: tl.constexpr, RND: tl.constexpr):
    """fp8 codes [BT, D]: FAST the unscaled fp16 values (the scale is folded by the
    caller); else the scaled values rounded to the cache dtype, as decode rounds them."""
    j = tl.arange(0, D)
    b = tl.load(codes_ptr + bh.to(tl.int64) * cs + tok[:, None] * D + j[None, :], mask=tmask[:, None], other=0)
    if FAST:
        if E5:
            return b.to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            return b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        x = b.to(tl.int32)
        if E5:  # 1-5-2, bias 15
            e = (x >> 2) & 31
            m = (x & 3).to(tl.float32)
            mag = tl.where(e == 0, m * (2.0 ** -16), (4.0 + m) * tl.exp2((e - 17).to(tl.float32)))
        else:  # 1-4-3, bias 7
            e = (x >> 3) & 15
            m = (x & 7).to(tl.float32)
            mag = tl.where(e == 0, m * (2.0 ** -9), (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        val = tl.where((x & 128) != 0, -mag, mag)
        return (val * scale).to(RND).to(tl.float32)


# ---------------------------------------------------------------------------------------
# split kernels
# ---------------------------------------------------------------------------------------
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
def _hqmq_split_kernel(q_ptr,
                       kc, kr, km, kf, ko, ki, kt, kl,
                       vc, vr, vm, vf, vo, vi, vt, vl, ptab,
                       po_ptr, pm_ptr, pl_ptr,
                       T, tiles_per_split, qk_scale,
                       k_cs, k_rs, k_ms, k_fs, k_os, k_is, v_cs, v_rs, v_ms, v_fs, v_os, v_is, vlen_ptr,
                       VLEN: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                       BT: tl.constexpr,
                       K_CW: tl.constexpr, K_CB: tl.constexpr, K_CNB: tl.constexpr, K_RW: tl.constexpr,
                       K_RB: tl.constexpr, K_RNB: tl.constexpr, K_S: tl.constexpr, K_OUT: tl.constexpr,
                       K_TAB: tl.constexpr, K_LOGR: tl.constexpr,
                       V_CW: tl.constexpr, V_CB: tl.constexpr, V_CNB: tl.constexpr, V_RW: tl.constexpr,
                       V_RB: tl.constexpr, V_RNB: tl.constexpr, V_S: tl.constexpr, V_OUT: tl.constexpr,
                       V_TAB: tl.constexpr, V_LOGR: tl.constexpr,
                       FB: tl.constexpr, FAST: tl.constexpr, INTERP: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    h = pid_bh % HKV
    for ti in range(first, last):
        t0 = ti * BT
        k, tmask = _hqmq_tile(kc, kr, km, kf, ko, ki, kt, ptab, kl, pid_bh, h, t0, T,
                              k_cs, k_rs, k_ms, k_fs, k_os, k_is,
                              BT, D, K_CW, K_CB, K_CNB, K_RW, K_RB, K_RNB, FB, K_S, K_OUT, K_TAB, K_LOGR,
                              FAST, INTERP, RND)
        s = scores(q, tl.trans(k), tmask, qk_scale, FAST)
        v, tmask = _hqmq_tile(vc, vr, vm, vf, vo, vi, vt, ptab, vl, pid_bh, h, t0, T,
                              v_cs, v_rs, v_ms, v_fs, v_os, v_is,
                              BT, D, V_CW, V_CB, V_CNB, V_RW, V_RB, V_RNB, FB, V_S, V_OUT, V_TAB, V_LOGR,
                              FAST, INTERP, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


@triton.jit
def _int_split_kernel(q_ptr, kc, ks, kz, vc, vs, vz, po_ptr, pm_ptr, pl_ptr,
                      T, tiles_per_split, qk_scale, k_cs, k_ss, v_cs, v_ss, vlen_ptr, VLEN: tl.constexpr,
                      GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                      W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr, G: tl.constexpr,
                      VEC: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    for ti in range(first, last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        k = _int_tile(kc, ks, kz, pid_bh, tok, tmask, k_cs, k_ss, BT, D, W, CB, CNB, G, VEC, FAST, RND)
        s = scores(q, tl.trans(k), tmask, qk_scale, FAST)
        v = _int_tile(vc, vs, vz, pid_bh, tok, tmask, v_cs, v_ss, BT, D, W, CB, CNB, G, VEC, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


@triton.jit
def _kivi_split_kernel(q_ptr, kc, ks, kz, kres, vc, vs, vz, vres, po_ptr, pm_ptr, pl_ptr,
                       NGK, TRK, NGV, TRV, tiles_per_split, qk_scale, k_cs, k_ss, k_rs, v_cs, v_ss, v_rs,
                       vlen_ptr, TCAP,
                       GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                       W: tl.constexpr, G: tl.constexpr, GB: tl.constexpr,
                       VCB: tl.constexpr, VCNB: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr,
                       VLEN: tl.constexpr = False, KA: tl.constexpr = 0, KP: tl.constexpr = 1,
                       VA: tl.constexpr = 0, VP: tl.constexpr = 1):
    """Keys: NGK quantized groups then TRK window rows; values: NGV groups then TRV rows
    (KIVI keeps different windows for K and V; both cover the same T tokens). The
    tiles where both are quantized are split over the programs; the tail from there
    to T (under a window plus a tile) goes to the last split (the host adds one for it,
    so it does not lengthen a split that also has main tiles), each side decoded from
    whichever part holds the token.
    VLEN: the counts come from the device valid length T at vlen_ptr (clamped to the
    capacity TCAP) by each side's window policy (KA, KP) / (VA, VP): q(T) = max(0, T - A)
    // P * P tokens quantized, the rest in the window (`step_encode.kivi_policy`); the
    grid is cut for TCAP, so splits past the device's main tiles run none."""
    if VLEN:
        T = tl.minimum(tl.load(vlen_ptr), TCAP)
        TQK = tl.maximum(T - KA, 0) // KP * KP
        TQV = tl.maximum(T - VA, 0) // VP * VP
        NGK = TQK // G
        TRK = T - TQK
        TRV = T - TQV
    else:
        TQK = NGK * G
        TQV = NGV * G
    T = TQK + TRK
    n_main = tl.minimum(TQK, TQV) // BT
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, n_main, tiles_per_split, GROUP, BH, D, FAST)
    for ti in range(first, last):
        t0 = ti * BT
        tok = t0 + tl.arange(0, BT)
        tmask = tok < T
        kt = _kivi_kt_tile(kc, ks, kz, pid_bh, t0, NGK, k_cs, k_ss, BT, D, W, G, GB, FAST, RND)
        s = scores(q, kt, tmask, qk_scale, FAST)
        v = _int_tile(vc, vs, vz, pid_bh, tok, tmask, v_cs, v_ss, BT, D, W, VCB, VCNB, G, True, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    n_tail = tl.where(sp == nsplit - 1, tl.cdiv(T - n_main * BT, BT), 0)
    for ri in range(0, n_tail):
        t0 = (n_main + ri) * BT
        tok = t0 + tl.arange(0, BT)
        tmask = tok < T
        kq = _kivi_kt_tile(kc, ks, kz, pid_bh, t0, NGK, k_cs, k_ss, BT, D, W, G, GB, FAST, RND)
        kr, _ = _fp16_tile(kres, pid_bh, t0 - TQK, TRK, k_rs, BT, D, FAST)
        kt = tl.where((tok < TQK)[None, :], kq, tl.trans(kr))
        s = scores(q, kt, tmask, qk_scale, FAST)
        vq = _int_tile(vc, vs, vz, pid_bh, tok, tok < TQV, v_cs, v_ss, BT, D, W, VCB, VCNB, G, True, FAST, RND)
        vr, _ = _fp16_tile(vres, pid_bh, t0 - TQV, TRV, v_rs, BT, D, FAST)
        v = tl.where((tok < TQV)[:, None], vq, vr)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


@triton.jit
def _fp8_split_kernel(q_ptr, kc, vc, ksc_ptr, vsc_ptr, po_ptr, pm_ptr, pl_ptr,
                      T, tiles_per_split, qk_scale, k_cs, v_cs, vlen_ptr, VLEN: tl.constexpr,
                      HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                      BT: tl.constexpr, E5: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    h = pid_bh % HKV
    ksc = tl.load(ksc_ptr + h)
    vsc = tl.load(vsc_ptr + h)
    if FAST:  # q.(s k8) = s (q.k8); sum p (s v8) = s sum p v8
        qk_scale = qk_scale * ksc
    for ti in range(first, last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        k = _fp8_tile(kc, pid_bh, tok, tmask, k_cs, ksc, D, E5, FAST, RND)
        s = scores(q, tl.trans(k), tmask, qk_scale, FAST)
        v = _fp8_tile(vc, pid_bh, tok, tmask, v_cs, vsc, D, E5, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    if FAST:
        acc = acc * vsc
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _fast(q: torch.Tensor) -> bool:
    return not interpreting() and q.dtype in (torch.float16, torch.bfloat16)


def _launch(kernel, args, runtime, const, q, B, H, nsplit, D, num_warps, num_stages, ws, cache_dtype, out_dtype):
    Hq = q.shape[1]
    rows_q = B * Hq
    out_dtype = out_dtype or q.dtype
    if ws is None or ws.nsplit != nsplit or ws.out.dtype != out_dtype or ws.out.numel() != rows_q * D:
        ws = Workspace(rows_q, nsplit, D, q.device, out_dtype)
    group = Hq // H
    bh = max(16, triton.next_power_of_2(group))
    extra = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
    kernel[(B * H, nsplit)](q, *args, ws.po, ws.pm, ws.pl, *runtime,
                            GROUP=group, BH=bh, D=D, FAST=_fast(q), RND=_TL_DTYPES[cache_dtype],
                            **const, **extra)
    combine_kernel[(rows_q,)](ws.po, ws.pm, ws.pl, ws.out, nsplit, D=D, SB=16)
    return ws.out.view(B, Hq, 1, D)


def hqmq_decode_attention(q: torch.Tensor, k: HQMQFlat, v: HQMQFlat, *, num_splits: int | None = None,
                          block_t: int = 128, num_warps: int = 4, num_stages: int = 1,
                          programs_per_sm: int = 8, workspace: Workspace | None = None,
                          out_dtype=None, valid_len: torch.Tensor | None = None) -> torch.Tensor:
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    vl, has_vl = check_valid_len(valid_len, q)
    if (v.B, v.H, v.T, v.D) != (B, H, T, D):
        raise ValueError("K and V caches differ in shape")
    if block_t % OUTLIER_BLOCK:
        raise ValueError(f"block_t must be a multiple of {OUTLIER_BLOCK}")
    q = q.contiguous()
    nsplit, per = choose_splits(B * H, triton.cdiv(T, block_t), q.device, num_splits, programs_per_sm)
    nc = D // 4
    fast = _fast(q)

    def tab(f: HQMQFlat) -> int:
        if f.table.dtype not in (torch.float16, torch.float32) or f.table_mode not in ("codebook", "secondaries"):
            raise ValueError(f"unsupported HQMQ table {f.table_mode}/{f.table.dtype}")
        return (0 if f.table_mode == "codebook" else 2) + (f.table.dtype == torch.float16)

    def args(f: HQMQFlat):
        dummy = f.codes
        # Without outliers the kernel never reads this argument: any int64 view will do
        # (no allocation per call on the decode path).
        outl = f.outliers.view(torch.int64) if f.has_outliers and f.outliers.numel() else f.table.view(torch.int64)
        rel = f.rel16 if fast and tab(f) == 1 else f.rel
        return [f.codes, f.radius, f.r_max, f.flags if f.has_outliers else dummy, outl,
                f.outlier_index if f.has_outliers else dummy, f.table.view(torch.int64), rel]

    def strides(f: HQMQFlat):
        if f.has_outliers:
            o = [bh_stride(f.flags, "flags"), bh_stride(f.outliers, "outliers") // 4,
                 bh_stride(f.outlier_index, "outlier_index")]
        else:
            o = [0, 0, 0]
        return [bh_stride(f.codes, "codes"), bh_stride(f.radius, "radius"), bh_stride(f.r_max, "r_max")] + o

    def ce(f: HQMQFlat, p):
        return {f"{p}_CW": f.code_bits, f"{p}_CB": f.codes.shape[-1], f"{p}_CNB": _nbytes_span(nc, f.code_bits),
                f"{p}_RW": f.r_bits, f"{p}_RB": f.radius.shape[-1], f"{p}_RNB": _nbytes_span(nc, f.r_bits),
                f"{p}_S": f.S, f"{p}_OUT": f.has_outliers, f"{p}_TAB": tab(f), f"{p}_LOGR": f.log_radius}

    runtime = [T, per, LOG2E / math.sqrt(D)] + strides(k) + strides(v) + [vl]
    const = {**ce(k, "K"), **ce(v, "V"), "VLEN": has_vl, "HKV": H, "BT": block_t, "FB": (nc + 7) // 8, "INTERP": interpreting()}
    ptab = k.ptab.float().contiguous()
    return _launch(_hqmq_split_kernel, args(k) + args(v) + [ptab], runtime, const, q, B, H, nsplit, D,
                   num_warps, num_stages, workspace, k.dtype, out_dtype)


def int_decode_attention(q: torch.Tensor, k: IntFlat, v: IntFlat, *, num_splits: int | None = None,
                         block_t: int = 128, num_warps: int = 4, num_stages: int = 2, programs_per_sm: int = 8,
                         workspace: Workspace | None = None, out_dtype=None,
                         valid_len: torch.Tensor | None = None) -> torch.Tensor:
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    vl, has_vl = check_valid_len(valid_len, q)
    if (v.B, v.H, v.T, v.D, v.bits, v.group) != (B, H, T, D, k.bits, k.group):
        raise ValueError("K and V int caches differ in shape or config")
    G, W = k.group, k.bits
    if D % G or not pow2(D // G):
        raise ValueError(f"fused int kernel needs head_dim/group a power of two, got {D}/{G}")
    vec = 8 % W == 0 and (G * W) % 8 == 0 and pow2(G * W // 8)
    q = q.contiguous()
    nsplit, per = choose_splits(B * H, triton.cdiv(T, block_t), q.device, num_splits, programs_per_sm)
    runtime = [T, per, LOG2E / math.sqrt(D), bh_stride(k.codes, "codes"), bh_stride(k.scale, "scale"),
               bh_stride(v.codes, "codes"), bh_stride(v.scale, "scale"), vl]
    for f in (k, v):
        if f.zero.stride() != f.scale.stride():
            raise ValueError("int scale and zero buffers must share a layout")
    const = {"VLEN": has_vl, "BT": block_t, "W": W, "CB": k.codes.shape[-1], "CNB": _nbytes_span(D, W), "G": G,
             "VEC": vec}
    return _launch(_int_split_kernel, [k.codes, k.scale, k.zero, v.codes, v.scale, v.zero], runtime, const,
                   q, B, H, nsplit, D, num_warps, num_stages, workspace, k.dtype, out_dtype)


@dataclasses.dataclass
class KIVIGraphFlat(KIVIFlat):
    """A `KIVIFlat` whose group and window counts follow a device valid length (CUDA graphs;
    `KernelStore.graph_view`): `policy` (A, P), the window policy of
    `step_encode.kivi_policy` (q(T) = max(0, T - A) // P * P tokens quantized, T - q(T) in
    the window), and `capacity`, the tokens the buffers hold (the bound the grid is cut
    for). The buffers are the store's, at capacity; n_groups / n_res are not read by a
    call with `valid_len`. (Its own class because kernels/layout.py's KIVIFlat has no
    policy field.)"""
    policy: tuple[int, int] | None = None
    capacity: int = 0


def kivi_decode_attention(q: torch.Tensor, k: KIVIFlat, v: KIVIFlat, *, num_splits: int | None = None,
                          block_t: int = 64, num_warps: int = 4, num_stages: int = 2, programs_per_sm: int = 12,
                          workspace: Workspace | None = None, out_dtype=None, valid_len=None) -> torch.Tensor:
    """`valid_len` (a device token count, see `decode_attention`): k and v must be
    `KIVIGraphFlat`s (the window policy turns the length into each side's counts, on the
    device) of one capacity."""
    B, H, D = k.B, k.H, k.D
    check_q(q, H, D, B)
    vl, has_vl = check_valid_len(valid_len, q)
    if has_vl:
        if not (isinstance(k, KIVIGraphFlat) and isinstance(v, KIVIGraphFlat) and k.policy and v.policy):
            raise ValueError("the KIVI kernel takes valid_len only with KIVIGraphFlat caches (the window policy "
                             "that splits the length into groups and window: KernelStore.graph_view)")
        if k.capacity != v.capacity or k.codes is None or v.codes is None:
            raise ValueError("KIVI K and V graph views differ in capacity or have no group buffers")
        if (v.B, v.H, v.D, v.bits, v.group) != (B, H, D, k.bits, k.group):
            raise ValueError("K and V KIVI caches differ in shape or config")
    elif (v.B, v.H, v.D, v.T, v.bits, v.group) != (B, H, D, k.T, k.bits, k.group):
        raise ValueError("K and V KIVI caches differ in shape or config")
    if k.role != "K" or v.role != "V":
        raise ValueError("pass the keys' KIVIFlat (role K) then the values' (role V)")
    G, W = k.group, k.bits
    if 8 % W:
        raise ValueError(f"fused KIVI kernel supports 2, 4 or 8 bits, got {W}")
    if not pow2(G) or D % G or not pow2(D // G) or G * W < 8:
        raise ValueError(f"fused KIVI kernel needs a power-of-two group dividing head_dim, got G={G}")
    bt = max(block_t, G)
    if bt % G:
        raise ValueError(f"block_t {block_t} must be a multiple of the group {G}")
    q = q.contiguous()
    if has_vl:  # cut for the capacity: at most capacity // bt main tiles, always a tail split
        n_main = k.capacity // bt
        nsplit, per = choose_splits(B * H, n_main, q.device, num_splits, programs_per_sm)
        nsplit += 1 if n_main else 0
    else:
        n_main = min(k.n_groups, v.n_groups) * G // bt
        nsplit, per = choose_splits(B * H, n_main, q.device, num_splits, programs_per_sm)
        if n_main and k.T > n_main * bt:  # the tail gets a program of its own (its first tile is past n_main)
            nsplit += 1

    def parts(f: KIVIFlat, role: str):
        if f.n_groups or has_vl:
            return ([f.codes, f.scale, f.zero, f.residual],
                    [bh_stride(f.codes, f"{role} codes"), bh_stride(f.scale, f"{role} scale"),
                     bh_stride(f.residual, f"{role} window")])
        codes = torch.zeros(1, dtype=torch.uint8, device=f.residual.device)  # never read; typed as codes are
        return [codes, f.residual, f.residual, f.residual], [0, 0, bh_stride(f.residual, f"{role} window")]

    kb, ks = parts(k, "K")
    vb, vs = parts(v, "V")
    runtime = [k.n_groups, k.T_res, v.n_groups, v.T_res, per, LOG2E / math.sqrt(D)] + ks + vs
    runtime += [vl, k.capacity if has_vl else 0]
    const = {"BT": bt, "W": W, "G": G, "GB": G * W // 8, "VCB": D * W // 8, "VCNB": _nbytes_span(D, W)}
    if has_vl:
        const.update(VLEN=True, KA=k.policy[0], KP=k.policy[1], VA=v.policy[0], VP=v.policy[1])
    return _launch(_kivi_split_kernel, kb + vb, runtime, const, q, B, H, nsplit, D, num_warps, num_stages,
                   workspace, k.dtype, out_dtype)


def fp8_decode_attention(q: torch.Tensor, k: FP8Flat, v: FP8Flat, *, num_splits: int | None = None,
                         block_t: int = 64, num_warps: int = 4, num_stages: int = 3, programs_per_sm: int = 12,
                         workspace: Workspace | None = None, out_dtype=None,
                         valid_len: torch.Tensor | None = None) -> torch.Tensor:
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    vl, has_vl = check_valid_len(valid_len, q)
    if (v.B, v.H, v.T, v.D, v.fmt) != (B, H, T, D, k.fmt):
        raise ValueError("K and V fp8 caches differ in shape or format")
    q = q.contiguous()
    nsplit, per = choose_splits(B * H, triton.cdiv(T, block_t), q.device, num_splits, programs_per_sm)
    runtime = [T, per, LOG2E / math.sqrt(D), bh_stride(k.codes, "codes"), bh_stride(v.codes, "codes"), vl]
    const = {"VLEN": has_vl, "HKV": H, "BT": block_t, "E5": k.fmt == "e5m2"}
    return _launch(_fp8_split_kernel, [k.codes, v.codes, k.scale.float(), v.scale.float()], runtime, const,
                   q, B, H, nsplit, D, num_warps, num_stages, workspace, k.dtype, out_dtype)


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


__all__ = ["decode_attention", "hqmq_decode_attention", "int_decode_attention", "kivi_decode_attention",
           "fp8_decode_attention", "reference_decode_attention", "KIVIGraphFlat"]
