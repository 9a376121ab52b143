"""Triton decode attention over the fp16 store (`FP16Flat`): the engine's unquantized
baseline. The same split-K flash-decoding skeleton as the quantized formats, reading
only the valid tokens (a device length under a CUDA graph), so "x fp16" compares a
quantized format with an fp16 cache in the same engine, not with a framework's cache.
Launch defaults: 64-token tiles, 4 warps, 3 stages, 8 programs per SM (fp8's tile, the
nearest format in bytes per token; not swept yet).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quantizers.derived import identity
from ..common import Workspace, bh_stride, check_q, check_row_start, check_valid_len
from ..layout import FP16Flat
from .common import (LOG2E, PlanCache, SplitPlan, finish, first_tile, from_floor, pad_cols, pad_mask, row_floor,
                     run_split, scores, softmax_update, split_prologue, split_want, store_partial, valid_tokens)


@triton.jit
def _fp16_tile(ptr, bh, tok, tmask, cs, D: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    """Rows `tok` of kv row bh, [BT, D] (D padded: `pad_cols`): fp16 as stored (FAST) or
    upcast and rounded to the cache dtype, as `Quantizer.decode` rounds them (the
    interpreter's bf16 is wrong unless upcast first)."""
    j = pad_cols(D)
    x = tl.load(ptr + bh.to(tl.int64) * cs + tok[:, None] * D + j[None, :],
                mask=pad_mask(tmask[:, None], j[None, :], D), other=0.0)
    return finish(x.to(tl.float32), FAST, RND)


@triton.jit
def _fp16_split_kernel(q_ptr, kv_ptr, vv_ptr, po_ptr, pm_ptr, pl_ptr,
                       T, tiles_per_split, qk_scale, k_cs, v_cs, vlen_ptr, rs_ptr, VLEN: tl.constexpr,
                       RSTART: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                       FAST: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    lo = row_floor(rs_ptr, pid_bh, HKV, RSTART)
    for ti in range(first_tile(first, lo, BT, RSTART), last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        k = _fp16_tile(kv_ptr, pid_bh, tok, tmask, k_cs, D, FAST, RND)
        s = scores(q, tl.trans(k), from_floor(tmask, tok, lo, RSTART), qk_scale, FAST)
        v = _fp16_tile(vv_ptr, pid_bh, tok, tmask, v_cs, D, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


_PLANS = PlanCache()


def fp16_decode_attention(q: torch.Tensor, k: FP16Flat, v: FP16Flat, *, num_splits: int | None = None,
                          block_t: int = 64, num_warps: int = 4, num_stages: int = 3, programs_per_sm: int = 8,
                          workspace: Workspace | None = None, out_dtype=None,
                          valid_len: torch.Tensor | None = None,
                          row_start: torch.Tensor | None = None) -> torch.Tensor:
    T = k.T
    ts = (k.values, v.values)
    layout = (type(k), type(v), *map(identity, ts), k.B, k.H, k.D, k.dtype, v.B, v.H, v.D)
    plan = _PLANS.lookup(layout, ts, _fp16_plan, q, k, v, valid_len, num_splits, block_t, num_warps, num_stages,
                         programs_per_sm, out_dtype, row_start=row_start)
    vl, _ = check_valid_len(valid_len, q)
    rs, _ = check_row_start(row_start, q)
    if v.T != T:
        raise ValueError(f"K and V fp16 caches differ in shape: {(k.B, k.H, T, k.D)} vs {(v.B, v.H, v.T, v.D)}")
    nsplit, per = plan.splits(-(-T // block_t))
    return run_split(plan, q.contiguous(), ts, [T, per, *plan.extra, vl, rs], nsplit, workspace)


def _fp16_plan(q, k, v, valid_len, num_splits, block_t, num_warps, num_stages, programs_per_sm, out_dtype,
               row_start=None):
    """Every check of a call and what it derives from the layout (once per plan)."""
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    _, has_vl = check_valid_len(valid_len, q)
    _, has_rs = check_row_start(row_start, q)
    if (v.B, v.H, v.T, v.D) != (B, H, T, D):
        raise ValueError(f"K and V fp16 caches differ in shape: {(B, H, T, D)} vs {(v.B, v.H, v.T, v.D)}")
    plan = SplitPlan(_fp16_split_kernel, {"VLEN": has_vl, "RSTART": has_rs, "HKV": H, "BT": block_t}, q, B, H, D, num_warps, num_stages,
                     k.dtype, out_dtype)
    plan.want = split_want(B * H, q.device, num_splits, programs_per_sm)
    plan.extra = (LOG2E / math.sqrt(D), bh_stride(k.values, "values"), bh_stride(v.values, "values"))
    return plan


__all__ = ["fp16_decode_attention"]
