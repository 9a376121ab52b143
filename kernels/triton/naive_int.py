"""Triton decode attention over naive int caches with per-token groups (`IntFlat`): the
tile decoder (also KIVI's for its values), the split kernel and its host wrapper.
Launch defaults (H200 sweep, reports/kernels/NOTES.md run 8): 128-token tiles, 4 warps, 2 stages;
one stage past 128 columns or at a padded head dim (`default_stages`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quantizers.derived import identity
from ..common import Workspace, bh_stride, check_q, check_row_start, check_valid_len, pow2
from ..layout import IntFlat
from .common import (LOG2E, PlanCache, SplitPlan, default_stages, dq_bytes, finish, first_tile, from_floor,
                     nbytes_span, pad_cols, pad_mask, row_floor, run_split, scores, softmax_update, split_prologue,
                     split_want, store_partial, unpack_rows, valid_tokens)


@triton.jit
def int_tile(codes_ptr, scale_ptr, zero_ptr, bh, tok, tmask, cs, ss,
              BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
              G: tl.constexpr, VEC: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    """Per-token groups of G along the head dim: [BT, D] of rows `tok` of kv row bh (D
    padded: `pad_cols`; G a power of two, so the padded groups fill the padded columns).
    VEC: W divides 8 and a group is whole bytes: bytes [BT, D/G, G*W/8], bit-trick decode."""
    NG: tl.constexpr = D // G
    bh64 = bh.to(tl.int64)
    g = pad_cols(NG)
    NGP: tl.constexpr = g.shape[0]
    so = bh64 * ss + tok[:, None] * NG + g[None, :]
    gm = pad_mask(tmask[:, None], g[None, :], NG)
    sc = tl.load(scale_ptr + so, mask=gm, other=0)
    ze = tl.load(zero_ptr + so, mask=gm, other=0)
    if not FAST:
        sc = sc.to(tl.float32)
        ze = ze.to(tl.float32)
    if VEC:
        GBY: tl.constexpr = G * W // 8
        j = tl.arange(0, GBY)
        off = bh64 * cs + (tok * CB)[:, None, None] + (g * GBY)[None, :, None] + j[None, None, :]
        b = tl.load(codes_ptr + off, mask=pad_mask(tmask[:, None, None], g[None, :, None], NG), other=0)
        shp: tl.constexpr = (BT, NGP, GBY)
        val = dq_bytes(b, tl.broadcast_to(sc[:, :, None], shp), tl.broadcast_to(ze[:, :, None], shp), W, FAST, RND)
        return tl.reshape(val, (BT, NGP * G))
    else:
        code = unpack_rows(codes_ptr + bh64 * cs, tok * CB, tmask, BT, D, W, CB, CNB).to(tl.float32)
        val = tl.reshape(code, (BT, NGP, G)) * sc.to(tl.float32)[:, :, None] + ze.to(tl.float32)[:, :, None]
        return finish(tl.reshape(val, (BT, NGP * G)), FAST, RND)


@triton.jit
def _int_split_kernel(q_ptr, kc, ks, kz, vc, vs, vz, po_ptr, pm_ptr, pl_ptr,
                      T, tiles_per_split, qk_scale, k_cs, k_ss, v_cs, v_ss, vlen_ptr, rs_ptr, VLEN: tl.constexpr,
                      RSTART: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                      W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr, G: tl.constexpr,
                      VEC: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    lo = row_floor(rs_ptr, pid_bh, HKV, RSTART)
    for ti in range(first_tile(first, lo, BT, RSTART), last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        k = int_tile(kc, ks, kz, pid_bh, tok, tmask, k_cs, k_ss, BT, D, W, CB, CNB, G, VEC, FAST, RND)
        s = scores(q, tl.trans(k), from_floor(tmask, tok, lo, RSTART), qk_scale, FAST)
        v = int_tile(vc, vs, vz, pid_bh, tok, tmask, v_cs, v_ss, BT, D, W, CB, CNB, G, VEC, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)



_PLANS = PlanCache()


def int_decode_attention(q: torch.Tensor, k: IntFlat, v: IntFlat, *, num_splits: int | None = None,
                         block_t: int = 128, num_warps: int = 4, num_stages: int | None = None,
                         programs_per_sm: int = 8,
                         workspace: Workspace | None = None, out_dtype=None,
                         valid_len: torch.Tensor | None = None,
                         row_start: torch.Tensor | None = None) -> torch.Tensor:
    """num_stages: `default_stages(D)` unless given."""
    T = k.T
    if num_stages is None:
        num_stages = default_stages(k.D)
    ts = (k.codes, k.scale, k.zero, v.codes, v.scale, v.zero)
    layout = (type(k), type(v), *map(identity, ts), k.B, k.H, k.D, k.bits, k.group, k.dtype,
              v.B, v.H, v.D, v.bits, v.group)
    plan = _PLANS.lookup(layout, ts, _int_plan, q, k, v, valid_len, num_splits, block_t, num_warps, num_stages,
                         programs_per_sm, out_dtype, row_start=row_start)
    vl, _ = check_valid_len(valid_len, q)
    rs, _ = check_row_start(row_start, q)
    if v.T != T:
        raise ValueError("K and V int caches differ in shape or config")
    nsplit, per = plan.splits(-(-T // block_t))
    return run_split(plan, q.contiguous(), ts, [T, per, *plan.extra, vl, rs], nsplit, workspace)


def _int_plan(q, k, v, valid_len, num_splits, block_t, num_warps, num_stages, programs_per_sm, out_dtype,
              row_start=None):
    """Every check of a call and what it derives from the layout (once per plan)."""
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    _, has_vl = check_valid_len(valid_len, q)
    _, has_rs = check_row_start(row_start, q)
    if (v.B, v.H, v.T, v.D, v.bits, v.group) != (B, H, T, D, k.bits, k.group):
        raise ValueError("K and V int caches differ in shape or config")
    G, W = k.group, k.bits
    if D % G or not pow2(G):
        raise ValueError(f"fused int kernel needs a power-of-two group dividing head_dim, got {D}/{G}")
    vec = 8 % W == 0 and (G * W) % 8 == 0 and pow2(G * W // 8)
    strides = [LOG2E / math.sqrt(D), bh_stride(k.codes, "codes"), bh_stride(k.scale, "scale"),
               bh_stride(v.codes, "codes"), bh_stride(v.scale, "scale")]
    for f in (k, v):
        if f.zero.stride() != f.scale.stride():
            raise ValueError("int scale and zero buffers must share a layout")
    const = {"VLEN": has_vl, "RSTART": has_rs, "HKV": H, "BT": block_t, "W": W, "CB": k.codes.shape[-1], "CNB": nbytes_span(D, W), "G": G,
             "VEC": vec}
    plan = SplitPlan(_int_split_kernel, const, q, B, H, D, num_warps, num_stages, k.dtype, out_dtype)
    plan.want = split_want(B * H, q.device, num_splits, programs_per_sm)
    plan.extra = strides
    return plan


__all__ = ["int_decode_attention", "int_tile"]
