"""A left-padded batch in a quantized cache: prompts of different lengths in one batch,
each row's prompt right-aligned after its pad count (its "row start").

The mechanics `QuantizedCache.set_row_start` and its layers use (kv_cache.py): the
starts checked, each row's keys, the masked attention of a dense read, the pads' K/V
written as copies of the row's first real token, and each row's own positions.
"""
from __future__ import annotations

import torch


def row_starts(starts) -> tuple[torch.Tensor, list[int]]:
    """(int32 tensor `[B]`, host ints) of row starts given as a sequence of ints or an
    integer tensor; a clear error for anything else (empty, not 1-D, not integers, < 0).
    A device tensor is read once (the host ints: before the prefill, not per step)."""
    t = starts if isinstance(starts, torch.Tensor) else torch.tensor(list(starts))
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"row starts must be a non-empty 1-D integer sequence [B], got {tuple(t.shape)} {t.dtype}")
    host = [int(x) for x in t.tolist()]
    if min(host) < 0:
        raise ValueError(f"row starts must be >= 0 (pad counts), got {host}")
    return t.to(torch.int32), host


def keys_from(row_start: torch.Tensor, T: int, device, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, T]` bool: key t is attended by row b (t >= row_start[b], and t < valid if given)."""
    pos = torch.arange(T, device=device)
    keep = pos[None, :] >= row_start.to(device)[:, None]
    return keep & (pos < valid)[None, :] if valid is not None else keep


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                     row_start: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V of one decode query `[B, Hq, 1, D]` over the rows of
    `[B, Hkv, T, D]` each batch row attends to: from its row start on (None: every row
    from 0, one mask for the batch) and below the device valid length `valid` (int32
    `[1]`, or None: all T). A row with no key left gets 0 (SDPA's fully masked row), as
    the fused kernels. The dense layers' graphed decode steps read their reserved rows
    through it (dense_steps.py)."""
    if row_start is None:
        keep = (torch.arange(k.shape[2], device=k.device) < valid).view(1, 1, 1, -1)
    else:
        keep = keys_from(row_start, k.shape[2], k.device, valid)[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                            enable_gqa=q.shape[1] != k.shape[1])


def fill_pads(x: torch.Tensor, row_start: torch.Tensor, t0: int) -> torch.Tensor:
    """x `[B, H, t, D]`, written at token t0, with each row's pad positions (before its
    row start) holding a copy of the row's first real token: what is stored for them is
    masked out of every read, and duplicates of a real token leave per-write / per-group
    statistics of the real tokens unmoved (KIVI's per-channel key min / max, fp8's amax
    scale, int's per-token groups). A Med3x write median does see the duplicates (a
    median moves with repeated values). A row whose first real token is past this write
    gets copies of the write's last token (all masked). A gather: no host read."""
    t = x.shape[-2]
    pos = torch.arange(t0, t0 + t, device=x.device)
    idx = torch.maximum(pos[None, :], row_start.to(x.device).long()[:, None]).clamp_(max=t0 + t - 1) - t0
    return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def position_ids(row_start: torch.Tensor, t0: int, n: int) -> torch.Tensor:
    """`[B, n]` position ids of n tokens written at token t0 of every row: the token index
    minus the row's start (pads: 0), as the row alone would have them."""
    pos = torch.arange(t0, t0 + n, device=row_start.device)
    return (pos[None, :] - row_start.long()[:, None]).clamp_(min=0)


__all__ = ["fill_pads", "keys_from", "masked_attention", "position_ids", "row_starts"]
