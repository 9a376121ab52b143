"""The planned call path, shared by the loaders of this folder (decode_attention.py,
hqmq_decode.py): what a launch needs beside its library (library.py builds and loads those).
At B=1 a decode call's time is host time, so what does not change between calls on one cache
layout (the checks, strides, the split plan, the launch arguments as a ctypes struct the .cu
reads) is made once and kept: the plans follow the token count (`follow_tokens`), the auto
route hands its plan to the launch (`RoutedPlan`), the partials come from kept buffers
(`Scratch`), and the GQA groups and residency each loader refuses are decided here once.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..common import check_row_start


def check_token_counts(tk: int, tv: int) -> None:
    """The checks of a plan build that involve the token counts (K's tk, V's tv), for a kept
    plan used at other counts (`follow_tokens`; KIVI's retarget, which reads its lengths once)."""
    if tv != tk:
        raise ValueError("K and V caches differ in shape")
    if tk == 0:
        raise ValueError("empty cache (T = 0)")


def follow_tokens(plan, T: int, Tv: int, resplit, *how) -> None:
    """A kept plan set to this call's token count T (K's; Tv V's): an eager decode step
    calls on the same cache buffers with one token more each time, and T is out of the plan
    keys, so a step pays this instead of a build (the per-call path: 59-93 us of host time
    per call on the H200, reports/kernels/NOTES.md). The plan's `args.T` follows T; its split
    fields only when T's 16-token tile count moves (the split rules read the tiles only):
    `resplit(*how)` sets them as a build does and returns the split count. In place: a plan
    serves one call at a time (two threads decoding the same cache buffers at once would
    race on it, as on the cache). Inline arithmetic, no closure: this runs on every eager
    step (2026-12-06, CUDA path walked on a 2-core CPU: an HQMQ retarget 1.14 -> 0.69 us)."""
    a = plan.args
    if T != Tv or T <= 0:
        check_token_counts(T, Tv)  # (raises)
    if (T - 1) >> 4 != (a.T - 1) >> 4:  # token_tiles(T) - 1 for T >= 1: another tile count
        plan.nsplit = resplit(*how)
    a.T = T


def residency_refusal(occupancy: int, instance: str, device) -> str | None:
    """A loader's `fits` answer from its occupancy query of the instance a call would launch:
    None when at least one CTA is resident per SM, else why not (its shared memory past this
    GPU's per-block opt-in: the query reads 0, or the opt-in's error)."""
    if occupancy > 0:
        return None
    return (f"{instance} cannot be resident on {torch.cuda.get_device_name(device)} (occupancy query "
            f"{occupancy}: its shared memory is past this GPU's per-block limit)")


# GQA groups: a CTA holds at most 8 q heads of its kv head (the n8 of mma.m16n8k16). An even
# group of 10..16 runs as 2 CTAs per kv row, half the heads each; both read the kv head's
# bytes, side by side in the grid, so the second read mostly hits L2 (Qwen3-235B: 64 q heads
# over 4 kv heads). The kernels find the kv row by a shift (Params.qsh = log2 of the CTAs per
# row): a division there cost up to 15 more registers in every instance, spills in some.
MAX_GQA = 16


def head_split(gqa: int) -> int:
    """CTAs per kv row for a GQA group of `gqa` q heads: 1 for 1..8, 2 for 10, 12, 14, 16;
    0 when the kernels do not take it (odd groups over 8, groups over 16)."""
    if 1 <= gqa <= 8:
        return 1
    return 2 if 8 < gqa <= MAX_GQA and gqa % 2 == 0 else 0


class HeadSplitField:
    """`qs` (CTAs per kv row: 1 or 2) over a launch struct's `qsh` field (its log2, what the
    kernels shift by); mixed into the loaders' ctypes structs."""

    @property
    def qs(self) -> int:
        return 1 << self.qsh

    @qs.setter
    def qs(self, n: int) -> None:
        self.qsh = head_split_shift(n)


def head_split_shift(qs: int) -> int:
    """The kernels' `qsh` for `qs` CTAs per kv row (1 or 2): the shift from a CTA's row to
    its kv row."""
    return {1: 0, 2: 1}[qs]


def gqa_refusal(q: torch.Tensor, H: int) -> str | None:
    """Why the CUDA kernels do not take q's GQA group over H kv heads (None: they do)."""
    if q.dim() != 4 or q.shape[1] % H or not head_split(q.shape[1] // H):
        return (f"GQA group of q {tuple(q.shape)} over {H} kv heads (the CUDA kernels take 1..8, and 10, 12, 14, 16 "
                f"as two CTAs of half the heads)")
    return None


def row_start_ptr(row_start, q: torch.Tensor) -> int | None:
    """The device pointer of a call's row_start (int32 `[B]` on q's device, each batch row's
    first key: a left-padded batch), None without one; ValueError naming what is wrong
    (kernels/common.py `check_row_start`, the Triton kernels' check). The kernels read it on
    the device: a CUDA graph replays with the tensor's new values."""
    if row_start is None:
        return None
    check_row_start(row_start, q)
    return row_start.data_ptr()


class RoutedPlan:
    """The plan the auto route's `unsupported` check found for a call, handed to the same
    call's launch so it does not look the plan up a second time (a lookup builds a key of
    ~10-30 fields: a few us of an eager call's host time). One slot: `offer` keeps (q, k,
    v, options, plan); `take` returns the plan only to a call on the very same q, k and v
    objects with the same options, and empties the slot either way, so a plan never
    outlives the call that found it (another call, or thread, finds the slot empty or
    holding other objects and looks up as before). Off while `enabled` is False."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.slot = None

    def offer(self, q, k, v, options, plan) -> None:
        if self.enabled:  # (weak references: a slot never keeps a dropped cache's buffers alive)
            self.slot = (weakref.ref(q), weakref.ref(k), weakref.ref(v), options, plan)

    def take(self, q, k, v, options):
        slot, self.slot = self.slot, None
        if slot is None or slot[0]() is not q or slot[1]() is not k or slot[2]() is not v or slot[3] != options:
            return None
        return slot[4]


# the current device and its current stream's handle without a torch.cuda.Stream object (a
# few microseconds less per call than torch.cuda.current_stream); None on torch builds without them
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cur_device = getattr(torch._C, "_cuda_getDevice", None)


def on_current_stream(dev: int, entry, *args) -> int:
    """entry(*args, stream) on device dev's current stream, with dev made the current device
    around the call when it is not (the .cu entries launch on the current device)."""
    if _cur_device is not None and _raw_stream is not None and _cur_device() == dev:
        return entry(*args, _raw_stream(dev))
    with torch.cuda.device(dev):
        return entry(*args, torch.cuda.current_stream(dev).cuda_stream)



class Scratch:
    """The fp32 partials of CUDA calls without a workspace, one buffer per (device, stream,
    thread), grown as needed and reused by every later call there (the result must be
    fresh, the partials need not). Kept for the partials' allocation it saves, though on an
    H100 (2026-12-06, host_time at T = 32768) the calls' host time did not move measurably
    with it: fp8 +0.6, KIVI-4 -0.8, HQMQ +0.4 us per call (the ~6 us of two allocations in
    --breakdown's cProfile was mostly cProfile's). Safe by stream order: a call's kernels
    read its partials before a later call on the same stream runs; a buffer grown out of (or dropped
    when `limit` are held) returns to the caching allocator, which hands its memory again to
    work on that stream only. The thread is in the key because a ctypes call releases the
    GIL between a call's two launches: two threads on one stream would interleave them
    over one buffer. A fresh buffer instead (from the graph's pool while capturing) when the
    stream may be capturing into a CUDA graph (a graph must not point into a buffer this
    cache may drop): the capture query reads the current device's stream, so also when the
    call's device is not the current one, and where torch lacks the raw stream queries.
    A stream handle destroyed and made again aliases its old key (ExternalStream): the
    same stream-order argument then no longer holds; torch's own streams are pooled, not
    destroyed."""

    def __init__(self, limit: int = 16, alloc=None, zeros=None):
        self.limit = limit
        self.bufs: dict = {}
        self.cnts: dict = {}  # fused calls' counters, by take's key (`counters`)
        self.alloc = alloc or (lambda size, device: torch.empty(size, dtype=torch.float32, device=device))
        self.zeros = zeros or (lambda n, device: torch.zeros(n, dtype=torch.int32, device=device))

    def take(self, size: int, device) -> torch.Tensor:
        """An fp32 buffer of at least `size` elements for one call on device's current stream."""
        key = self._key(device)
        return self.alloc(size, device) if key is None else self._kept(self.bufs, key, size, self.alloc, device)

    def counters(self, n: int, device) -> torch.Tensor:
        """n int32 counters at zero for one fused call (FusedCombine) beside `take`'s buffer,
        under its key. Zeroed once, when allocated (torch.zeros: a memset on the current
        stream, before the launch); every fused launch leaves the ones it used at zero, so
        kept counters serve the next call as they are. Fresh where `take`'s buffer is fresh:
        while capturing, the memset is a node of the graph, replayed before the kernel."""
        key = self._key(device)
        return self.zeros(n, device) if key is None else self._kept(self.cnts, key, n, self.zeros, device)

    @staticmethod
    def _key(device):
        """The (device, stream, thread) a kept buffer serves; None: a fresh one (the class docstring says when)."""
        if (device.type != "cuda" or _raw_stream is None or _cur_device is None or _cur_device() != device.index
                or _capturing()):
            return None
        return device.index, _raw_stream(device.index), threading.get_ident()

    def _kept(self, table: dict, key, n: int, make, device) -> torch.Tensor:
        t = table.get(key)
        if t is None or t.numel() < n:
            if len(table) >= self.limit:
                table.clear()
            t = table[key] = make(n, device)
        return t

    def held_bytes(self) -> int:
        """Device bytes the kept buffers hold (a memory benchmark's cache figure leaves them out)."""
        return sum(b.numel() * b.element_size() for b in (*self.bufs.values(), *self.cnts.values()))

    def clear(self) -> None:
        self.bufs.clear()
        self.cnts.clear()


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
SCRATCH = Scratch()


def fresh_partials(rows_q: int, nsplit: int, D: int, shape, out_dtype, device, counters: bool = False):
    """(held buffers, out tensor, po, pm, pl, out pointer, counters pointer or None) of a
    call without a fitting workspace: the three fp32 partials ([rows_q, nsplit, D], then
    [rows_q, nsplit] twice) in one buffer from SCRATCH, the result a fresh tensor of
    `shape`; `counters` (a fused call): rows_q int32 counters (>= its B * Hkv row groups)
    from SCRATCH too. The caller holds the buffers until its launch is queued (a fresh one,
    freed earlier, could be handed out again before the kernel writes it)."""
    n = rows_q * nsplit
    part = SCRATCH.take(n * (D + 2), device)
    cnt = SCRATCH.counters(rows_q, device) if counters else None
    out = torch.empty(shape, dtype=out_dtype, device=device)
    po = part.data_ptr()
    pm = po + 4 * n * D
    return (part, cnt), out, po, pm, pm + 4 * n, out.data_ptr(), None if cnt is None else cnt.data_ptr()


def workspace_counters(ws, n: int, device) -> int:
    """The device pointer of a workspace's own fused-call counters (n int32 at zero), made
    with it the first time (kernels/common.py `Workspace` is shared with the Triton backend:
    they are kept on the object as `_kvq_counters`). Two workspaces never share counters;
    make_workspace / workspace() attach them when FUSED_COMBINE is on, so a capture that
    uses the workspace allocates nothing (made while capturing, the memset is a node of the
    graph, replayed each time: still correct)."""
    cnt = ws.__dict__.get("_kvq_counters")
    if cnt is None or cnt.numel() < n:
        cnt = ws._kvq_counters = torch.zeros(n, dtype=torch.int32, device=device)
    return cnt.data_ptr()


__all__ = ["MAX_GQA", "HeadSplitField", "RoutedPlan", "SCRATCH", "Scratch", "check_token_counts", "follow_tokens",
           "fresh_partials", "gqa_refusal", "head_split", "on_current_stream", "residency_refusal", "row_start_ptr",
           "workspace_counters"]
