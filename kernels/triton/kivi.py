"""Triton decode attention over KIVI caches (`KIVIFlat`, `KIVIGraphFlat`): keys per channel
over G-token groups (a transposed tile), values per-token groups (naive_int's tile), the
fp16 windows; the split kernel gives the tail (windows plus a tile) a program of its own.
Launch defaults (H200 sweep, reports/kernels/NOTES.md run 8): 64-token tiles, 4 warps, 2 stages,
12 programs per SM; one stage past 128 columns or at a padded head dim (`default_stages`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quantizers.derived import identity
from ..common import Workspace, bh_stride, check_q, check_row_start, check_valid_len, pow2
from ..layout import KIVIFlat, KIVIGraphFlat
from .common import (LOG2E, PlanCache, SplitPlan, default_stages, dq_bytes, first_tile, from_floor, nbytes_span,
                     pad_cols, pad_mask, row_floor, run_split, scores, softmax_update, split_prologue, split_want,
                     store_partial)
from .naive_int import int_tile


@triton.jit
def _kivi_kt_tile(codes_ptr, scale_ptr, zero_ptr, bh, t0, NG, cs, ss,
                  BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, G: tl.constexpr, GB: tl.constexpr,
                  FAST: tl.constexpr, RND: tl.constexpr):
    """Keys per channel over G-token groups (codes [NGcap, D, GB] per kv row): the
    TRANSPOSED tile k^T [D, BT] of tokens t0.. (BT a multiple of G, t0 too; D padded:
    `pad_cols`)."""
    NGT: tl.constexpr = BT // G
    bh64 = bh.to(tl.int64)
    gi = t0 // G + tl.arange(0, NGT)
    gm = gi < NG
    j = pad_cols(D)
    DP: tl.constexpr = j.shape[0]
    by = tl.arange(0, GB)
    off = bh64 * cs + ((gi.to(tl.int64)[:, None] * D + j[None, :]) * GB)[:, :, None] + by[None, None, :]
    b = tl.load(codes_ptr + off, mask=pad_mask(gm[:, None, None], j[None, :, None], D), other=0)  # [NGT, DP, GB]
    so = bh64 * ss + gi.to(tl.int64)[:, None] * D + j[None, :]
    sc = tl.load(scale_ptr + so, mask=pad_mask(gm[:, None], j[None, :], D), other=0)  # [NGT, DP]
    ze = tl.load(zero_ptr + so, mask=pad_mask(gm[:, None], j[None, :], D), other=0)
    if not FAST:
        sc = sc.to(tl.float32)
        ze = ze.to(tl.float32)
    shp: tl.constexpr = (NGT, DP, GB)
    val = dq_bytes(b, tl.broadcast_to(sc[:, :, None], shp), tl.broadcast_to(ze[:, :, None], shp), W, FAST, RND)
    if NGT == 1:  # one group per tile: no transposition of groups and channels
        return tl.reshape(val, (DP, BT))  # token within its group = byte * (8/W) + field
    else:
        val = tl.reshape(val, (NGT, DP, G))
        return tl.reshape(tl.permute(val, (1, 0, 2)), (DP, BT))


@triton.jit
def _fp16_tile(ptr, bh, t0, TR, rs, BT: tl.constexpr, D: tl.constexpr, FAST: tl.constexpr):
    tok = t0 + tl.arange(0, BT)
    tmask = (tok >= 0) & (tok < TR)
    j = pad_cols(D)
    off = bh.to(tl.int64) * rs + tl.maximum(tok, 0)[:, None] * D + j[None, :]
    x = tl.load(ptr + off, mask=pad_mask(tmask[:, None], j[None, :], D), other=0)
    if FAST:
        return x.to(tl.float16), tmask
    else:
        return x.to(tl.float32), tmask


@triton.jit
def _kivi_split_kernel(q_ptr, kc, ks, kz, kres, vc, vs, vz, vres, po_ptr, pm_ptr, pl_ptr,
                       NGK, TRK, NGV, TRV, tiles_per_split, qk_scale, k_cs, k_ss, k_rs, v_cs, v_ss, v_rs,
                       vlen_ptr, TCAP, rs_ptr,
                       GROUP: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                       W: tl.constexpr, G: tl.constexpr, GB: tl.constexpr,
                       VCB: tl.constexpr, VCNB: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr,
                       VLEN: tl.constexpr = False, KA: tl.constexpr = 0, KP: tl.constexpr = 1,
                       VA: tl.constexpr = 0, VP: tl.constexpr = 1,
                       RSTART: tl.constexpr = False, HKV: tl.constexpr = 1):
    """Keys: NGK quantized groups then TRK window rows; values: NGV groups then TRV rows
    (KIVI keeps different windows for K and V; both cover the same T tokens). The
    tiles where both are quantized are split over the programs; the tail from there
    to T (under a window plus a tile) goes to the last split (the host adds one for it,
    so it does not lengthen a split that also has main tiles), each side decoded from
    whichever part holds the token.
    VLEN: the counts come from the device valid length T at vlen_ptr (clamped to the
    capacity TCAP) by each side's window policy (KA, KP) / (VA, VP): q(T) = max(0, T - A)
    // P * P tokens quantized, the rest in the window (`step_encode.kivi_policy`); the
    grid is cut for TCAP, so splits past the device's main tiles run none.
    RSTART: keys before row_start[b] (rs_ptr, batch row b = kv row // HKV) are masked."""
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
    lo = row_floor(rs_ptr, pid_bh, HKV, RSTART)
    for ti in range(first_tile(first, lo, BT, RSTART), last):
        t0 = ti * BT
        tok = t0 + tl.arange(0, BT)
        tmask = tok < T
        kt = _kivi_kt_tile(kc, ks, kz, pid_bh, t0, NGK, k_cs, k_ss, BT, D, W, G, GB, FAST, RND)
        s = scores(q, kt, from_floor(tmask, tok, lo, RSTART), qk_scale, FAST)
        v = int_tile(vc, vs, vz, pid_bh, tok, tmask, v_cs, v_ss, BT, D, W, VCB, VCNB, G, True, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    n_tail = tl.where(sp == nsplit - 1, tl.cdiv(T - n_main * BT, BT), 0)
    for ri in range(0, n_tail):
        t0 = (n_main + ri) * BT
        tok = t0 + tl.arange(0, BT)
        tmask = tok < T
        kq = _kivi_kt_tile(kc, ks, kz, pid_bh, t0, NGK, k_cs, k_ss, BT, D, W, G, GB, FAST, RND)
        kr, _ = _fp16_tile(kres, pid_bh, t0 - TQK, TRK, k_rs, BT, D, FAST)
        kt = tl.where((tok < TQK)[None, :], kq, tl.trans(kr))
        s = scores(q, kt, from_floor(tmask, tok, lo, RSTART), qk_scale, FAST)
        vq = int_tile(vc, vs, vz, pid_bh, tok, tok < TQV, v_cs, v_ss, BT, D, W, VCB, VCNB, G, True, FAST, RND)
        vr, _ = _fp16_tile(vres, pid_bh, t0 - TQV, TRV, v_rs, BT, D, FAST)
        v = tl.where((tok < TQV)[:, None], vq, vr)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)



_PLANS = PlanCache()


def kivi_decode_attention(q: torch.Tensor, k: KIVIFlat, v: KIVIFlat, *, num_splits: int | None = None,
                          block_t: int = 64, num_warps: int = 4, num_stages: int | None = None,
                          programs_per_sm: int = 12,
                          workspace: Workspace | None = None, out_dtype=None, valid_len=None,
                          row_start=None) -> torch.Tensor:
    """`valid_len` (a device token count, see `decode_attention`): k and v must be
    `KIVIGraphFlat`s (the window policy turns the length into each side's counts, on the
    device) of one capacity. `row_start`: per-row key starts (`decode_attention`).
    num_stages: `default_stages(D)` unless given."""
    if num_stages is None:
        num_stages = default_stages(k.D)
    ts = (k.codes, k.scale, k.zero, k.residual, v.codes, v.scale, v.zero, v.residual)
    kg, vg = type(k) is KIVIGraphFlat, type(v) is KIVIGraphFlat
    layout = (type(k), type(v), *map(identity, ts), k.B, k.H, k.D, k.bits, k.group, k.role, k.dtype, k.n_groups == 0,
           v.B, v.H, v.D, v.bits, v.group, v.role, v.n_groups == 0, k.policy if kg else None,
           k.capacity if kg else None, v.policy if vg else None, v.capacity if vg else None)
    plan = _PLANS.lookup(layout, ts, _kivi_plan, q, k, v, valid_len, num_splits, block_t, num_warps, num_stages,
                         programs_per_sm, out_dtype, row_start=row_start)
    vl, has_vl = check_valid_len(valid_len, q)
    rs, _ = check_row_start(row_start, q)
    kb, vb, ks, vs, bt, cap_split = plan.extra
    if has_vl:
        nsplit, per = cap_split
    else:
        if v.T != k.T:
            raise ValueError("K and V KIVI caches differ in shape or config")
        n_main = min(k.n_groups, v.n_groups) * k.group // bt
        nsplit, per = plan.splits(n_main)
        if n_main and k.T > n_main * bt:  # the tail gets a program of its own (its first tile is past n_main)
            nsplit += 1
    # (a new list: `kb` is the plan's and must not grow with each call)
    bufs = ([k.codes, k.scale, k.zero, k.residual] if kb is None else kb) + \
        ([v.codes, v.scale, v.zero, v.residual] if vb is None else vb)
    runtime = [k.n_groups, k.T_res, v.n_groups, v.T_res, per, LOG2E / math.sqrt(k.D), *ks, *vs, vl,
               k.capacity if has_vl else 0, rs]
    return run_split(plan, q.contiguous(), bufs, runtime, nsplit, workspace)


def _kivi_plan(q, k, v, valid_len, num_splits, block_t, num_warps, num_stages, programs_per_sm, out_dtype,
               row_start=None):
    """Every check of a call and what it derives from the layout (once per plan)."""
    B, H, D = k.B, k.H, k.D
    check_q(q, H, D, B)
    vl, has_vl = check_valid_len(valid_len, q)
    _, has_rs = check_row_start(row_start, q)
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
    if not pow2(G) or D % G or G * W < 8:
        raise ValueError(f"fused KIVI kernel needs a power-of-two group dividing head_dim, got G={G} at head_dim {D}")
    bt = max(block_t, G)
    if bt % G:
        raise ValueError(f"block_t {block_t} must be a multiple of the group {G}")
    want = split_want(B * H, q.device, num_splits, programs_per_sm)

    def parts(f: KIVIFlat, role: str):
        """(the buffers, None: the flat's own four per call; the strides)."""
        if f.n_groups or has_vl:
            return None, [bh_stride(f.codes, f"{role} codes"), bh_stride(f.scale, f"{role} scale"),
                          bh_stride(f.residual, f"{role} window")]
        codes = torch.zeros(1, dtype=torch.uint8, device=f.residual.device)  # never read; typed as codes are
        return [codes, f.residual, f.residual, f.residual], [0, 0, bh_stride(f.residual, f"{role} window")]

    kb, ks = parts(k, "K")
    vb, vs = parts(v, "V")
    const = {"BT": bt, "W": W, "G": G, "GB": G * W // 8, "VCB": D * W // 8, "VCNB": nbytes_span(D, W)}
    if has_rs:
        const.update(RSTART=True, HKV=H)
    if has_vl:
        const.update(VLEN=True, KA=k.policy[0], KP=k.policy[1], VA=v.policy[0], VP=v.policy[1])
    plan = SplitPlan(_kivi_split_kernel, const, q, B, H, D, num_warps, num_stages, k.dtype, out_dtype)
    plan.want = want
    cap_split = None
    if has_vl:  # cut for the capacity: at most capacity // bt main tiles, always a tail split
        n_main = k.capacity // bt
        nsplit, per = plan.splits(n_main)
        cap_split = (nsplit + (1 if n_main else 0), per)
    plan.extra = (kb, vb, ks, vs, bt, cap_split)
    return plan


__all__ = ["kivi_decode_attention"]
