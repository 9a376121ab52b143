"""Triton decode attention over fp8 caches (`FP8Flat`, e4m3 / e5m2) with a per-kv-head scale
folded into the score scale (K) and the output (V): the tile decoder, the split kernel
and its host wrapper. Launch defaults (H200 sweep, reports/kernels/NOTES.md run 8): 64-token
tiles, 4 warps, 3 stages, 12 programs per SM.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quantizers.derived import identity
from ..common import Workspace, bh_stride, check_q, check_row_start, check_valid_len
from ..layout import FP8Flat
from .common import (LOG2E, PlanCache, SplitPlan, first_tile, from_floor, pad_cols, pad_mask, row_floor, run_split,
                     scores, softmax_update, split_prologue, split_want, store_partial, valid_tokens)


@triton.jit
def _fp8_tile(codes_ptr, bh, tok, tmask, cs, scale, D: tl.constexpr, E5: tl.constexpr,
              FAST: tl.constexpr, RND: tl.constexpr):
    """fp8 codes [BT, D] (D padded: `pad_cols`): FAST the unscaled fp16 values (the scale is
    folded by the caller); else the scaled values rounded to the cache dtype, as decode rounds them."""
    j = pad_cols(D)
    b = tl.load(codes_ptr + bh.to(tl.int64) * cs + tok[:, None] * D + j[None, :],
                mask=pad_mask(tmask[:, None], j[None, :], D), other=0)
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


@triton.jit
def _fp8_split_kernel(q_ptr, kc, vc, ksc_ptr, vsc_ptr, po_ptr, pm_ptr, pl_ptr,
                      T, tiles_per_split, qk_scale, k_cs, v_cs, vlen_ptr, rs_ptr, VLEN: tl.constexpr,
                      RSTART: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr,
                      BT: tl.constexpr, E5: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    h = pid_bh % HKV
    ksc = tl.load(ksc_ptr + h)
    vsc = tl.load(vsc_ptr + h)
    if FAST:  # q.(s k8) = s (q.k8); sum p (s v8) = s sum p v8
        qk_scale = qk_scale * ksc
    lo = row_floor(rs_ptr, pid_bh, HKV, RSTART)
    for ti in range(first_tile(first, lo, BT, RSTART), last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        k = _fp8_tile(kc, pid_bh, tok, tmask, k_cs, ksc, D, E5, FAST, RND)
        s = scores(q, tl.trans(k), from_floor(tmask, tok, lo, RSTART), qk_scale, FAST)
        v = _fp8_tile(vc, pid_bh, tok, tmask, v_cs, vsc, D, E5, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    if FAST:
        acc = acc * vsc
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)



_PLANS = PlanCache()


def fp8_decode_attention(q: torch.Tensor, k: FP8Flat, v: FP8Flat, *, num_splits: int | None = None,
                         block_t: int = 64, num_warps: int = 4, num_stages: int = 3, programs_per_sm: int = 12,
                         workspace: Workspace | None = None, out_dtype=None,
                         valid_len: torch.Tensor | None = None,
                         row_start: torch.Tensor | None = None) -> torch.Tensor:
    T = k.T
    ts = (k.codes, v.codes, k.scale, v.scale)
    layout = (type(k), type(v), *map(identity, ts), k.B, k.H, k.D, k.fmt, k.dtype, v.B, v.H, v.D, v.fmt)
    plan = _PLANS.lookup(layout, ts, _fp8_plan, q, k, v, valid_len, num_splits, block_t, num_warps, num_stages,
                         programs_per_sm, out_dtype, row_start=row_start)
    vl, _ = check_valid_len(valid_len, q)
    rs, _ = check_row_start(row_start, q)
    if v.T != T:
        raise ValueError("K and V fp8 caches differ in shape or format")
    nsplit, per = plan.splits(-(-T // block_t))
    qk_scale, k_cs, v_cs, ksc, vsc = plan.extra
    return run_split(plan, q.contiguous(), [k.codes, v.codes, ksc, vsc], [T, per, qk_scale, k_cs, v_cs, vl, rs], nsplit,
                     workspace)


def _fp8_plan(q, k, v, valid_len, num_splits, block_t, num_warps, num_stages, programs_per_sm, out_dtype,
              row_start=None):
    """Every check of a call and what it derives from the layout (once per plan)."""
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    _, has_vl = check_valid_len(valid_len, q)
    _, has_rs = check_row_start(row_start, q)
    if (v.B, v.H, v.T, v.D, v.fmt) != (B, H, T, D, k.fmt):
        raise ValueError("K and V fp8 caches differ in shape or format")
    const = {"VLEN": has_vl, "RSTART": has_rs, "HKV": H, "BT": block_t, "E5": k.fmt == "e5m2"}
    plan = SplitPlan(_fp8_split_kernel, const, q, B, H, D, num_warps, num_stages, k.dtype, out_dtype)
    plan.want = split_want(B * H, q.device, num_splits, programs_per_sm)
    # the per-head scales in fp32 (the flat's own tensors when they are fp32 already, as FP8Flat keeps them)
    plan.extra = (LOG2E / math.sqrt(D), bh_stride(k.codes, "codes"), bh_stride(v.codes, "codes"),
                  k.scale.float(), v.scale.float())
    return plan


__all__ = ["fp8_decode_attention"]
