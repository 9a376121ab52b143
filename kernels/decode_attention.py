"""Fused decode attention over packed KV caches (Triton), with a torch reference.

One decode step: queries `q [B, Hq, 1, d]` (GQA: Hq = GROUP * Hkv, q head
`h*GROUP + i` reads kv head `h`) attend to ALL T cached keys of their kv head,
non-causally: `softmax(q K^T / sqrt(d)) V`. K and V are decoded from the
packed bytes inside the kernel, tile by tile in registers, and never written
out.

Flash-decoding: the grid is (B*Hkv, NSPLIT). Each program takes one kv head and
a contiguous run of token tiles, decodes each K tile, scores the GROUP query
heads of that kv head against it in one `tl.dot` (the GROUP rows are padded to
16, the smallest dot), keeps an online softmax (running max, sum, unnormalised
output, base 2), decodes the V tile and accumulates. It writes its partial
(output, max, sum); `_combine_kernel` merges the NSPLIT partials of each query
head. NSPLIT is chosen so that about 8 programs per multiprocessor exist (the
best of 2/4/8/16 on the H200), so batch 1 fills the GPU too.

Launch defaults are what tuned best on an H200 (kernels/NOTES.md): HQMQ BLOCK_T
64, 4 warps, num_stages=1 (Triton's software pipelining turns the scattered
gathers into cp.async through shared memory: 2-3x slower). The fastest HQMQ
codeword source there is the fp16 codebook (`flatten(..., table_mode="codebook",
table_dtype=torch.float16)`, within an fp16 ulp per codeword); the default, the
fp32 secondaries, is bit-identical to `HQMQ.decode_tokens` but ~1.9x slower.

Formats (see layout.py): `hqmq_decode_attention` (HQMQ, with or without Med3x
outliers), `int_decode_attention` (naive per-token int groups),
`kivi_decode_attention` (KIVI: per-channel key groups, per-token value groups,
fp16 window). Dot operands are the query's dtype (fp16/bf16; a decoded value is
rounded to it, exactly as `Quantizer.decode` rounds to the cache dtype when the
two agree), accumulation fp32. Under the Triton interpreter (CPU) everything is
fp32 (the interpreter's bf16 arithmetic is not trustworthy).

Reference: `reference_decode_attention(q, k, v)`: fp32 softmax attention over
`Quantizer.decode(packed)` tensors.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.0
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice

from .layout import OUTLIER_BLOCK, HQMQFlat, IntFlat, KIVIFlat


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
# bit unpacking helpers
# ---------------------------------------------------------------------------------------
@triton.jit
def _byte_fields(b, W: tl.constexpr):
    """Fields of width W (1, 2, 4 or 8) of bytes b (int32), LSB first, as a nested
    join whose row-major flattening of the new trailing dims is the field order."""
    if W == 8:
        out = b
    elif W == 4:
        out = tl.join(b & 15, (b >> 4) & 15)
    elif W == 2:
        out = tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, (b >> 6) & 3))
    else:
        out = tl.join(
            tl.join(tl.join(b & 1, (b >> 4) & 1), tl.join((b >> 2) & 1, (b >> 6) & 1)),
            tl.join(tl.join((b >> 1) & 1, (b >> 5) & 1), tl.join((b >> 3) & 1, (b >> 7) & 1)),
        )
    return out


@triton.jit
def _unpack_rows(ptr, row_off, rmask, BT: tl.constexpr, NCOLS: tl.constexpr, W: tl.constexpr,
                 ROWB: tl.constexpr, NBYTES: tl.constexpr):
    """`[BT, NCOLS]` int32 fields of width W from BT packed rows (byte offsets row_off [BT])."""
    if 8 % W == 0:
        cols = tl.arange(0, NCOLS * W // 8)
        b = tl.load(ptr + row_off[:, None] + cols[None, :], mask=rmask[:, None], other=0).to(tl.int32)
        out = tl.reshape(_byte_fields(b, W), (BT, NCOLS))
    else:
        c = tl.arange(0, NCOLS)
        bit = c * W
        byte = bit // 8
        p = ptr + row_off[:, None] + byte[None, :]
        acc = tl.load(p, mask=rmask[:, None], other=0).to(tl.int32)
        for i in tl.static_range(1, NBYTES):
            nb = tl.load(p + i, mask=rmask[:, None] & (byte[None, :] + i < ROWB), other=0).to(tl.int32)
            acc = acc | (nb << (8 * i))
        out = (acc >> (bit % 8)[None, :]) & ((1 << W) - 1)
    return out


def _nbytes_span(n: int, width: int) -> int:
    """Most bytes one field of `width` bits spans, over the n fields of a row."""
    return max(((i * width) % 8 + width + 7) // 8 for i in range(min(n, 8)))


# ---------------------------------------------------------------------------------------
# tile decoders: [BT, D] float32 of tokens t0 .. t0+BT-1 of kv row bh
# ---------------------------------------------------------------------------------------
@triton.jit
def _f16_lane(w, K: tl.constexpr):
    """fp16 number K (0..3) packed in int64 w, as float32."""
    return ((w >> (16 * K)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32_pair(w):
    """The two fp32 numbers packed in int64 w (low word first)."""
    return w.to(tl.int32).to(tl.float32, bitcast=True), (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _popc(x, INTERP: tl.constexpr):
    """Set bits of int32 x."""
    if INTERP:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24) & 0xFF
    else:
        return libdevice.popc(x)


@triton.jit
def _hqmq_tile(codes_ptr, rad_ptr, rmax_ptr, flags_ptr, outl_ptr, oidx_ptr, table_ptr, ptab_ptr, rel_ptr,
               bh, h, t0, T, NBLK,
               BT: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
               RW: tl.constexpr, RB: tl.constexpr, RNB: tl.constexpr, FB: tl.constexpr,
               S: tl.constexpr, HAS_OUT: tl.constexpr, TAB: tl.constexpr, LOGR: tl.constexpr,
               INTERP: tl.constexpr):
    """Decode tokens t0..t0+BT-1 of kv row bh: [BT, D] float32.

    Codeword of chunk code = p*S + s (TAB): 0/1 the codebook [H, 24S, 4] fp32/fp16,
    one or two 8-byte gathers; 2/3 the secondaries [H, S, 4] fp32/fp16 and the 24
    units P [24, 4] fp32, then P[p]*S[s] as HQMQ.decode_tokens computes it (the
    products by 0, +-1, +-1/2 are exact, the sums in the same order: bit identical
    for fp32). Tables are viewed as int64 so a gather moves 8 bytes."""
    NC: tl.constexpr = D // 4
    tok = t0 + tl.arange(0, BT)
    tmask = tok < T
    row = bh.to(tl.int64) * T + tok
    if CW == 12:  # two 12-bit codes in three bytes
        i3 = 3 * tl.arange(0, NC // 2)
        pc = codes_ptr + (row * CB)[:, None] + i3[None, :]
        b0 = tl.load(pc, mask=tmask[:, None], other=0).to(tl.int32)
        b1 = tl.load(pc + 1, mask=tmask[:, None], other=0).to(tl.int32)
        b2 = tl.load(pc + 2, mask=tmask[:, None], other=0).to(tl.int32)
        code = tl.reshape(tl.join(b0 | ((b1 & 15) << 8), (b1 >> 4) | (b2 << 4)), (BT, NC))
    else:
        code = _unpack_rows(codes_ptr, row * CB, tmask, BT, NC, CW, CB, CNB)  # [BT, NC]
    rq = _unpack_rows(rad_ptr, row * RB, tmask, BT, NC, RW, RB, RNB)
    rmax = tl.load(rmax_ptr + row, mask=tmask, other=0).to(tl.float32)
    if LOGR:
        rel = tl.load(rel_ptr + rq)
    else:  # uniform levels: q / L, the IEEE quotient torch computes
        rel = tl.div_rn(rq.to(tl.float32), tl.full([BT, NC], (1 << RW) - 1, tl.float32))
    rhat = rmax[:, None] * rel  # as HQMQ.radius_levels: r_max * rel[q]
    if TAB < 2:
        cidx = (h * (24 * S) + code).to(tl.int64)
        if TAB == 1:  # codebook fp16 [H, 24S, 4] as int64 [H*24S]
            w = tl.load(table_ptr + cidx)
            c0 = _f16_lane(w, 0)
            c1 = _f16_lane(w, 1)
            c2 = _f16_lane(w, 2)
            c3 = _f16_lane(w, 3)
        else:  # codebook fp32 [H, 24S, 4] as int64 [H*24S*2]
            c0, c1 = _f32_pair(tl.load(table_ptr + cidx * 2))
            c2, c3 = _f32_pair(tl.load(table_ptr + cidx * 2 + 1))
    else:
        p = code // S
        sidx = (h * S + (code - p * S)).to(tl.int64)
        a0, a1 = _f32_pair(tl.load(ptab_ptr + p * 2))  # P [24, 4] fp32 as int64 [48]
        a2, a3 = _f32_pair(tl.load(ptab_ptr + p * 2 + 1))
        if TAB == 3:  # secondaries fp16 [H, S, 4] as int64 [H*S]
            w = tl.load(table_ptr + sidx)
            s0 = _f16_lane(w, 0)
            s1 = _f16_lane(w, 1)
            s2 = _f16_lane(w, 2)
            s3 = _f16_lane(w, 3)
        else:  # secondaries fp32 [H, S, 4] as int64 [H*S*2]
            s0, s1 = _f32_pair(tl.load(table_ptr + sidx * 2))
            s2, s3 = _f32_pair(tl.load(table_ptr + sidx * 2 + 1))
        # quaternion.hamilton(a, s), term order as there
        c0 = a0 * s0 - a1 * s1 - a2 * s2 - a3 * s3
        c1 = a0 * s1 + a1 * s0 + a2 * s3 - a3 * s2
        c2 = a0 * s2 - a1 * s3 + a2 * s0 + a3 * s1
        c3 = a0 * s3 + a1 * s2 - a2 * s1 + a3 * s0
    v0 = c0 * rhat
    v1 = c1 * rhat
    v2 = c2 * rhat
    v3 = c3 * rhat
    if HAS_OUT:
        fw = tl.zeros([BT], tl.int32)  # the token's flag bits, chunk c at bit c
        for i in tl.static_range(FB):
            fw = fw | (tl.load(flags_ptr + row * FB + i, mask=tmask, other=0).to(tl.int32) << (8 * i))
        if tl.sum((fw != 0).to(tl.int32), axis=0) > 0:  # skip tiles without outliers
            cnt = tl.reshape(_popc(fw, INTERP), (BT // 64, 64))
            tok_ex = tl.reshape(tl.cumsum(cnt, axis=1) - cnt, (BT,))  # outliers earlier in the 64-block
            c = tl.arange(0, NC)
            fl = (fw[:, None] >> c[None, :]) & 1
            ch_ex = _popc(fw[:, None] & ((1 << c) - 1)[None, :], INTERP)  # outliers earlier in the token
            base = tl.load(oidx_ptr + bh.to(tl.int64) * NBLK + tok // 64, mask=tmask, other=0)
            oi = (base + tok_ex).to(tl.int64)[:, None] + ch_ex
            om = fl != 0
            ow = tl.load(outl_ptr + oi, mask=om, other=0)  # outliers [n, 4] fp16 as int64 [n]
            v0 = tl.where(om, _f16_lane(ow, 0), v0)
            v1 = tl.where(om, _f16_lane(ow, 1), v1)
            v2 = tl.where(om, _f16_lane(ow, 2), v2)
            v3 = tl.where(om, _f16_lane(ow, 3), v3)
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BT, D))  # element 4c+k = v_k[c]


@triton.jit
def _int_tile(codes_ptr, scale_ptr, zero_ptr, row, tmask,
              BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
              G: tl.constexpr):
    """Per-token groups of G along the head dim: codes row `row` [BT] (int64)."""
    NG: tl.constexpr = D // G
    code = _unpack_rows(codes_ptr, row * CB, tmask, BT, D, W, CB, CNB).to(tl.float32)
    g = tl.arange(0, NG)
    so = row[:, None] * NG + g[None, :]
    sc = tl.load(scale_ptr + so, mask=tmask[:, None], other=0).to(tl.float32)
    ze = tl.load(zero_ptr + so, mask=tmask[:, None], other=0).to(tl.float32)
    val = tl.reshape(code, (BT, NG, G)) * sc[:, :, None] + ze[:, :, None]
    return tl.reshape(val, (BT, D))


@triton.jit
def _kivi_k_tile(codes_ptr, scale_ptr, zero_ptr, bh, t0, TQ, NG,
                 BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, G: tl.constexpr, GB: tl.constexpr):
    """Keys per channel over G-token groups: codes [NG, D, GB] per kv row bh."""
    E: tl.constexpr = 8 // W  # tokens per byte
    NR: tl.constexpr = BT // E
    NGT: tl.constexpr = BT // G
    i = tl.arange(0, NR)
    j = tl.arange(0, D)
    tok0 = t0 + i * E
    rmask = tok0 < TQ
    gi = tok0 // G
    off = ((bh * NG + gi).to(tl.int64)[:, None] * D + j[None, :]) * GB + ((tok0 % G) // E)[:, None]
    b = tl.load(codes_ptr + off, mask=rmask[:, None], other=0).to(tl.int32)  # [NR, D]
    if W == 8:
        code = b.to(tl.float32)
    else:
        f = tl.reshape(_byte_fields(b, W), (NR, D, E))
        code = tl.reshape(tl.permute(f, (0, 2, 1)), (BT, D)).to(tl.float32)
    gg = t0 // G + tl.arange(0, NGT)
    gm = gg < NG
    so = (bh * NG + gg).to(tl.int64)[:, None] * D + j[None, :]
    sc = tl.load(scale_ptr + so, mask=gm[:, None], other=0).to(tl.float32)  # [NGT, D]
    ze = tl.load(zero_ptr + so, mask=gm[:, None], other=0).to(tl.float32)
    val = tl.reshape(code, (NGT, G, D)) * sc[:, None, :] + ze[:, None, :]
    return tl.reshape(val, (BT, D))


@triton.jit
def _fp16_tile(ptr, bh, t0, TR, BT: tl.constexpr, D: tl.constexpr):
    tok = t0 + tl.arange(0, BT)
    tmask = tok < TR
    j = tl.arange(0, D)
    off = (bh.to(tl.int64) * TR + tok)[:, None] * D + j[None, :]
    return tl.load(ptr + off, mask=tmask[:, None], other=0).to(tl.float32), tmask


# ---------------------------------------------------------------------------------------
# online softmax pieces
# ---------------------------------------------------------------------------------------
@triton.jit
def _scores(q, k, tmask, qk_scale, DOT_F32: tl.constexpr, RND: tl.constexpr):
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(RND).to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = s * qk_scale
    return tl.where(tmask[None, :], s, float("-inf"))


@triton.jit
def _update(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr, DT: tl.constexpr, RND: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        pv = tl.dot(p, v.to(RND).to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(DT), v.to(DT))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _load_q(q_ptr, pid_bh, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr):
    hr = tl.arange(0, BH)
    hmask = hr < GROUP
    qrow = pid_bh * GROUP + hr  # (b*Hkv + h)*GROUP + i == b*Hq + h*GROUP + i
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow.to(tl.int64)[:, None] * D + d[None, :], mask=hmask[:, None], other=0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q, qrow, hmask


@triton.jit
def _store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D: tl.constexpr):
    d = tl.arange(0, D)
    prow = qrow.to(tl.int64) * nsplit + sp
    tl.store(po_ptr + prow[:, None] * D + d[None, :], acc, mask=hmask[:, None])
    tl.store(pm_ptr + prow, m_i, mask=hmask)
    tl.store(pl_ptr + prow, l_i, mask=hmask)


# ---------------------------------------------------------------------------------------
# split kernels
# ---------------------------------------------------------------------------------------
@triton.jit
def _hqmq_split_kernel(q_ptr,
                       kc, kr, km, kf, ko, ki, kt, kl,
                       vc, vr, vm, vf, vo, vi, vt, vl, ptab,
                       po_ptr, pm_ptr, pl_ptr,
                       T, NBLK, tiles_per_split, qk_scale,
                       HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                       BT: tl.constexpr,
                       K_CW: tl.constexpr, K_CB: tl.constexpr, K_CNB: tl.constexpr, K_RW: tl.constexpr,
                       K_RB: tl.constexpr, K_RNB: tl.constexpr, K_S: tl.constexpr, K_OUT: tl.constexpr,
                       K_TAB: tl.constexpr, K_LOGR: tl.constexpr,
                       V_CW: tl.constexpr, V_CB: tl.constexpr, V_CNB: tl.constexpr, V_RW: tl.constexpr,
                       V_RB: tl.constexpr, V_RNB: tl.constexpr, V_S: tl.constexpr, V_OUT: tl.constexpr,
                       V_TAB: tl.constexpr, V_LOGR: tl.constexpr,
                       FB: tl.constexpr, DOT_F32: tl.constexpr, RND: tl.constexpr):
    pid_bh = tl.program_id(0)
    sp = tl.program_id(1)
    nsplit = tl.num_programs(1)
    h = pid_bh % HKV
    q, qrow, hmask = _load_q(q_ptr, pid_bh, GROUP, BH, D, DOT_F32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    ntiles = tl.cdiv(T, BT)
    first = sp * tiles_per_split
    last = tl.minimum(first + tiles_per_split, ntiles)
    for ti in range(first, last):
        t0 = ti * BT
        tmask = (t0 + tl.arange(0, BT)) < T
        k = _hqmq_tile(kc, kr, km, kf, ko, ki, kt, ptab, kl, pid_bh, h, t0, T, NBLK,
                       BT, D, K_CW, K_CB, K_CNB, K_RW, K_RB, K_RNB, FB, K_S, K_OUT, K_TAB, K_LOGR, DOT_F32)
        s = _scores(q, k, tmask, qk_scale, DOT_F32, RND)
        v = _hqmq_tile(vc, vr, vm, vf, vo, vi, vt, ptab, vl, pid_bh, h, t0, T, NBLK,
                       BT, D, V_CW, V_CB, V_CNB, V_RW, V_RB, V_RNB, FB, V_S, V_OUT, V_TAB, V_LOGR, DOT_F32)
        m_i, l_i, acc = _update(s, v, m_i, l_i, acc, DOT_F32, q.dtype, RND)
    _store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


@triton.jit
def _int_split_kernel(q_ptr, kc, ks, kz, vc, vs, vz, po_ptr, pm_ptr, pl_ptr,
                      T, tiles_per_split, qk_scale,
                      GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                      W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr, G: tl.constexpr,
                      DOT_F32: tl.constexpr, RND: tl.constexpr):
    pid_bh = tl.program_id(0)
    sp = tl.program_id(1)
    nsplit = tl.num_programs(1)
    q, qrow, hmask = _load_q(q_ptr, pid_bh, GROUP, BH, D, DOT_F32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    ntiles = tl.cdiv(T, BT)
    first = sp * tiles_per_split
    last = tl.minimum(first + tiles_per_split, ntiles)
    for ti in range(first, last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        row = pid_bh.to(tl.int64) * T + tok
        k = _int_tile(kc, ks, kz, row, tmask, BT, D, W, CB, CNB, G)
        s = _scores(q, k, tmask, qk_scale, DOT_F32, RND)
        v = _int_tile(vc, vs, vz, row, tmask, BT, D, W, CB, CNB, G)
        m_i, l_i, acc = _update(s, v, m_i, l_i, acc, DOT_F32, q.dtype, RND)
    _store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


@triton.jit
def _kivi_split_kernel(q_ptr, kc, ks, kz, kres, vc, vs, vz, vres, po_ptr, pm_ptr, pl_ptr,
                       TQ, NG, TR, tiles_per_split, qk_scale,
                       GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                       W: tl.constexpr, G: tl.constexpr, GB: tl.constexpr,
                       VCB: tl.constexpr, VCNB: tl.constexpr, DOT_F32: tl.constexpr,
                       RND: tl.constexpr):
    pid_bh = tl.program_id(0)
    sp = tl.program_id(1)
    nsplit = tl.num_programs(1)
    q, qrow, hmask = _load_q(q_ptr, pid_bh, GROUP, BH, D, DOT_F32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    ntiles = tl.cdiv(TQ, BT)
    first = sp * tiles_per_split
    last = tl.minimum(first + tiles_per_split, ntiles)
    for ti in range(first, last):
        t0 = ti * BT
        tok = t0 + tl.arange(0, BT)
        tmask = tok < TQ
        k = _kivi_k_tile(kc, ks, kz, pid_bh, t0, TQ, NG, BT, D, W, G, GB)
        s = _scores(q, k, tmask, qk_scale, DOT_F32, RND)
        row = pid_bh.to(tl.int64) * TQ + tok
        v = _int_tile(vc, vs, vz, row, tmask, BT, D, W, VCB, VCNB, G)
        m_i, l_i, acc = _update(s, v, m_i, l_i, acc, DOT_F32, q.dtype, RND)
    # the fp16 window (KIVI's residual) goes to the last split
    n_res = tl.where(sp == nsplit - 1, tl.cdiv(TR, BT), 0)
    for ri in range(0, n_res):
        k, tmask = _fp16_tile(kres, pid_bh, ri * BT, TR, BT, D)
        s = _scores(q, k, tmask, qk_scale, DOT_F32, RND)
        v, tmask = _fp16_tile(vres, pid_bh, ri * BT, TR, BT, D)
        m_i, l_i, acc = _update(s, v, m_i, l_i, acc, DOT_F32, q.dtype, RND)
    _store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


@triton.jit
def _combine_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, NSPLIT, D: tl.constexpr, SB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SB)
    d = tl.arange(0, D)
    mx = tl.full([SB], float("-inf"), tl.float32)
    for s0 in range(0, NSPLIT, SB):
        sm = (s0 + s) < NSPLIT
        mx = tl.maximum(mx, tl.load(pm_ptr + row * NSPLIT + s0 + s, mask=sm, other=float("-inf")))
    M = tl.max(mx, axis=0)
    num = tl.zeros([D], tl.float32)
    den = tl.zeros([SB], tl.float32)
    for s0 in range(0, NSPLIT, SB):
        sm = (s0 + s) < NSPLIT
        m = tl.load(pm_ptr + row * NSPLIT + s0 + s, mask=sm, other=float("-inf"))
        w = tl.where(m > float("-inf"), tl.exp2(m - M), 0.0)
        den += w * tl.load(pl_ptr + row * NSPLIT + s0 + s, mask=sm, other=0)
        o = tl.load(po_ptr + (row * NSPLIT + s0 + s)[:, None] * D + d[None, :], mask=sm[:, None], other=0)
        num += tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + row * D + d, (num / tl.sum(den, axis=0)).to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------
_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    if interpreting() or device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_splits(rows: int, ntiles: int, device, num_splits: int | None = None,
                  programs_per_sm: int = 8) -> tuple[int, int]:
    """(number of splits, tiles per split): about programs_per_sm programs per SM,
    every split non-empty."""
    if ntiles <= 0:
        return 1, 0
    want = num_splits or max(1, math.ceil(programs_per_sm * _sm_count(device) / max(1, rows)))
    want = max(1, min(want, ntiles))
    per = math.ceil(ntiles / want)
    return math.ceil(ntiles / per), per


def _check_q(q: torch.Tensor, H: int, D: int, B: int):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, Hq, 1, d] (one decode token), got {tuple(q.shape)}")
    if q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of B={B}, Hkv={H}, d={D}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} not supported")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")


class _Workspace:
    """Partial-result buffers for one shape, reused between calls."""

    def __init__(self, rows_q, nsplit, D, device, out_dtype=torch.float32):
        self.po = torch.empty(rows_q * nsplit * D, dtype=torch.float32, device=device)
        self.pm = torch.empty(rows_q * nsplit, dtype=torch.float32, device=device)
        self.pl = torch.empty(rows_q * nsplit, dtype=torch.float32, device=device)
        self.out = torch.empty(rows_q * D, dtype=out_dtype, device=device)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _launch(kernel, args, kw, q, B, H, nsplit, D, num_warps, num_stages, ws: _Workspace | None,
            cache_dtype, out_dtype):
    Hq = q.shape[1]
    rows_q = B * Hq
    out_dtype = out_dtype or q.dtype
    ws = ws or _Workspace(rows_q, nsplit, D, q.device, out_dtype)
    dot_f32 = interpreting() or q.dtype == torch.float32
    group = Hq // H
    bh = max(16, triton.next_power_of_2(group))
    extra = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
    kernel[(B * H, nsplit)](q, *args, ws.po, ws.pm, ws.pl, *kw["rt"],
                            GROUP=group, BH=bh, D=D, DOT_F32=dot_f32, RND=_TL_DTYPES[cache_dtype],
                            **kw["ce"], **extra)
    _combine_kernel[(rows_q,)](ws.po, ws.pm, ws.pl, ws.out, nsplit, D=D, SB=16)
    return ws.out.view(B, Hq, 1, D).to(out_dtype)


def hqmq_decode_attention(q: torch.Tensor, k: HQMQFlat, v: HQMQFlat, *, num_splits: int | None = None,
                          block_t: int = 64, num_warps: int = 4, num_stages: int = 1,
                          workspace: _Workspace | None = None, out_dtype=None) -> torch.Tensor:
    B, H, T, D = k.B, k.H, k.T, k.D
    _check_q(q, H, D, B)
    if (v.B, v.H, v.T, v.D) != (B, H, T, D):
        raise ValueError("K and V caches differ in shape")
    if block_t % OUTLIER_BLOCK:
        raise ValueError(f"block_t must be a multiple of {OUTLIER_BLOCK}")
    q = q.contiguous()
    ntiles = triton.cdiv(T, block_t)
    nsplit, per = choose_splits(B * H, ntiles, q.device, num_splits)
    nc = D // 4

    def args(f: HQMQFlat):
        dummy = f.codes
        outl = (f.outliers.view(torch.int64) if f.has_outliers and f.outliers.numel()
                else torch.zeros(1, dtype=torch.int64, device=f.codes.device))
        return [f.codes, f.radius, f.r_max, f.flags if f.has_outliers else dummy, outl,
                f.outlier_index if f.has_outliers else dummy, f.table.view(torch.int64), f.rel]

    def ce(f: HQMQFlat, p):
        return {f"{p}_CW": f.code_bits, f"{p}_CB": f.codes.shape[-1], f"{p}_CNB": _nbytes_span(nc, f.code_bits),
                f"{p}_RW": f.r_bits, f"{p}_RB": f.radius.shape[-1], f"{p}_RNB": _nbytes_span(nc, f.r_bits),
                f"{p}_S": f.S, f"{p}_OUT": f.has_outliers,
                f"{p}_TAB": (0 if f.table_mode == "codebook" else 2) + (f.table.dtype == torch.float16),
                f"{p}_LOGR": f.log_radius}

    nblk = triton.cdiv(T, OUTLIER_BLOCK)
    kw = {"rt": [T, nblk, per, 1.4426950408889634 / math.sqrt(D)],
          "ce": {**ce(k, "K"), **ce(v, "V"), "HKV": H, "BT": block_t, "FB": (nc + 7) // 8}}
    for f in (k, v):
        if f.table.dtype not in (torch.float16, torch.float32) or f.table_mode not in ("codebook", "secondaries"):
            raise ValueError(f"unsupported HQMQ table {f.table_mode}/{f.table.dtype}")
    ptab = k.ptab.float().contiguous().view(torch.int64)
    return _launch(_hqmq_split_kernel, args(k) + args(v) + [ptab], kw, q, B, H, nsplit, D, num_warps, num_stages,
                   workspace, k.dtype, out_dtype)


def int_decode_attention(q: torch.Tensor, k: IntFlat, v: IntFlat, *, num_splits: int | None = None,
                         block_t: int = 64, num_warps: int = 4, num_stages: int = 2,
                         workspace: _Workspace | None = None, out_dtype=None) -> torch.Tensor:
    B, H, T, D = k.B, k.H, k.T, k.D
    _check_q(q, H, D, B)
    if (v.B, v.H, v.T, v.D, v.bits, v.group) != (B, H, T, D, k.bits, k.group):
        raise ValueError("K and V int caches differ in shape or config")
    G = k.group
    if D % G or (D // G) & (D // G - 1):
        raise ValueError(f"fused int kernel needs head_dim/group a power of two, got {D}/{G}")
    q = q.contiguous()
    ntiles = triton.cdiv(T, block_t)
    nsplit, per = choose_splits(B * H, ntiles, q.device, num_splits)
    kw = {"rt": [T, per, 1.4426950408889634 / math.sqrt(D)],
          "ce": {"BT": block_t, "W": k.bits, "CB": k.codes.shape[-1], "CNB": _nbytes_span(D, k.bits), "G": G}}
    return _launch(_int_split_kernel, [k.codes, k.scale, k.zero, v.codes, v.scale, v.zero], kw,
                   q, B, H, nsplit, D, num_warps, num_stages, workspace, k.dtype, out_dtype)


def kivi_decode_attention(q: torch.Tensor, k: KIVIFlat, v: KIVIFlat, *, num_splits: int | None = None,
                          block_t: int = 64, num_warps: int = 4, num_stages: int = 2,
                          workspace: _Workspace | None = None, out_dtype=None) -> torch.Tensor:
    B, H, D = k.B, k.H, k.D
    _check_q(q, H, D, B)
    if (v.B, v.H, v.D, v.n_groups, v.T_res, v.bits, v.group) != (B, H, D, k.n_groups, k.T_res, k.bits, k.group):
        raise ValueError("K and V KIVI caches differ in shape or config")
    if k.role != "K" or v.role != "V":
        raise ValueError("pass the keys' KIVIFlat (role K) then the values' (role V)")
    G, W = k.group, k.bits
    if 8 % W:
        raise ValueError(f"fused KIVI kernel supports 1, 2, 4 or 8 bits, got {W}")
    if G & (G - 1) or D % G or (D // G) & (D // G - 1):
        raise ValueError(f"fused KIVI kernel needs a power-of-two group dividing head_dim, got G={G}")
    bt = max(block_t, G)
    if bt % G:
        raise ValueError(f"block_t {block_t} must be a multiple of the group {G}")
    q = q.contiguous()
    TQ, NG, TR = k.T_quant, k.n_groups, k.T_res
    ntiles = triton.cdiv(TQ, bt)
    nsplit, per = choose_splits(B * H, ntiles, q.device, num_splits)
    dummy8 = k.residual if NG == 0 else None
    kargs = [k.codes if NG else dummy8, k.scale if NG else dummy8, k.zero if NG else dummy8, k.residual,
             v.codes if NG else dummy8, v.scale if NG else dummy8, v.zero if NG else dummy8, v.residual]
    vcb = D * W // 8
    kw = {"rt": [TQ, NG, TR, per, 1.4426950408889634 / math.sqrt(D)],
          "ce": {"BT": bt, "W": W, "G": G, "GB": G * W // 8, "VCB": vcb, "VCNB": _nbytes_span(D, W)}}
    return _launch(_kivi_split_kernel, kargs, kw, q, B, H, nsplit, D, num_warps, num_stages, workspace,
                   k.dtype, out_dtype)


def decode_attention(q: torch.Tensor, k, v, **kw) -> torch.Tensor:
    """Dispatch on the flattened cache type."""
    if isinstance(k, HQMQFlat):
        return hqmq_decode_attention(q, k, v, **kw)
    if isinstance(k, IntFlat):
        return int_decode_attention(q, k, v, **kw)
    if isinstance(k, KIVIFlat):
        return kivi_decode_attention(q, k, v, **kw)
    raise TypeError(f"no fused kernel for {type(k).__name__}")


__all__ = ["decode_attention", "hqmq_decode_attention", "int_decode_attention", "kivi_decode_attention",
           "reference_decode_attention", "choose_splits", "interpreting"]
