"""The HQMQ format, with or without Med3x outliers: `HQMQFlat` (kernels/layout.py), its
flatten (the outliers regrouped per (b, h), the outlier index derived), its store
(`HQMQStore`: the token fields codes, radius, r_max, flags, plus the per-(b, h) outlier
lists), its device step encoder (kernels/hqmq_encode.py's `hqmq_tokens`), its kernels
(Triton, kernels/triton/hqmq.py; CUDA 12-bit codes r=4 d64/128/256, kernels/cuda/hqmq_decode.py).

Mixed-radix codes (`pack=mixed`, quantizers/hqmq.py): the flat declares them
(`HQMQFlat.code_pack`, `code_layout`); the Triton kernel and the step encoder read and
write them; the CUDA kernel reads them at S=96, head_dim 64 / 128 (its MIX instances
rewrite a tile's rows as 12-bit rows in shared memory) and declines the rest with
the reason (`cuda/hqmq_decode.py` `_flat_reason`), which `explain_backend` reports.

Med3x in the store: the outliers PER (b, h), `outliers [B, H, Ocap, 4]`, and
`outlier_index [B, H, ceil(Tcap/64)]`, the start of each 64-token block within its (b, h)
list, updated for the blocks a write starts. Their bytes are the one exception to the
store holding each byte once: the segment keeps its (b, h, t, chunk)-ordered list, the
store a per-(b, h) copy (outliers are a few percent of the chunks). A decode step at a
device position appends the outliers at the device list ends and writes an index block
start when the token at the position opens one; `reserve` makes room for the real
longest list plus the worst case of the steps to come, half the chunks of each token.

Med3x writes of several tokens (a fused cache's prefill, a later chunk) are encoded on
the device too (`hqmq_med3_write`, two launches per (layer, role), no host read): the
median over the write per (b, h), each token's place in its list and the index blocks
the write opens, then the token-parallel encode. Room for the worst case (t*D/8 outliers
per list) is made before it without reading the lists (`_write_room`); since the write's
segment holds its outliers `[n, 4]`, a count only the device knows, the store keeps it
in the run, cut at the write's end (`segment_on_read`), and makes it when the cache is
read (`run_segments`): one segment for the write, one for the steps after it, as the
old path appends them.

Held memory: that worst case is tens of times what real data stores (a few percent of the chunks
are outliers; at 32k tokens it made an H100 decode run's Med3x stores 3.1 GiB for 1.1 GiB
stored, 2026-12-06), so it is given back after the write, where the buffer may move and
the real lengths cost no sync: the write leaves a copy of its lengths on its way to the
host (`LengthSnapshot`, kernels/formats/hqmq_lengths.py), and the first host-position step
that finds it landed sets the bound from it and cuts the buffer to the bound plus the
steps' slack (`_release_write_room`); `reserve`, never captured, reads the lengths itself.
A long write (`MED3_CUT_AT_WRITE_BYTES`) reads its lengths at once and cuts before the
next layer writes, so a long prefill's peak holds one layer's worst case, not every
layer's. A later multi-token write makes room without a cut (a rewound engine's graph
holds the buffer; if its write still moves it, `generate` captures the step anew).
No overflow: every device write still has room for its worst case over the bound, and the
bound stays an upper bound of the longest list (`_tighten_bound`).

Med3x with `median=prefill` (the prefill's median kept, quantizers/hqmq.py) is declined
(`device_refusal`): neither device encoder takes the kept median, so the store encodes no
write of it (`multi_step` says no, `_steps_begin` drops the stepper, `graph_unsupported`
says why) and the cache writes through the quantizer's reference `append`, whose segments
the store absorbs as for any old-path write. Exactness first: the one-token kernel and
`hqmq_med3_write` would each need the kept fp16 `[B, H]` as an input and a max in their
threshold, and the prefill's kept median written by the device (a third output).

Host synchronisation: the old path's appends need the largest per-(b, h) outlier count
only when a host-side upper bound (previous bound plus the write's total outlier count,
a shape, so known without a sync) says the outlier buffer might overflow: the bound grows
B*H times faster than the largest list, so that is about B*H*log(T) syncs over T tokens,
not one per step; host-position steps one every >= 64 steps (`OUTLIER_SLACK_STEPS`).

(About 550 lines: one format's file, as kernels/FORMATS.md asks, for two formats that
share a store: HQMQ and HQMQ + Med3x, whose outlier buffers take half of it.)
"""
from __future__ import annotations

import dataclasses

import torch

from ...quantizers import Packed, Segment, parse_spec
from ...quantizers.hqmq import HQMQ, OUTLIER_BLOCK, outlier_block_starts
from ...quantizers.packing import unpack_bits
from ..cuda import hqmq_decode as cuda_hqmq
from ..hqmq_encode import hqmq_med3_write, hqmq_tokens, kernel_quantizer
from ..layout import HQMQFlat, concat_field, normalised_secondaries, units_on, whole_blocks
from ..registry import Format, Kernel
from ..store import KernelStore, TokenBuffer, concat_tokens, grown_capacity
from ..triton.hqmq import hqmq_decode_attention
from .hqmq_lengths import LengthSnapshot, resized

OUTLIER_SLACK_STEPS = 64  # Med3x decode steps of worst-case outliers to spare when the list grows
# A Med3x write whose worst-case outlier room passes this many bytes reads its lengths at
# once (one host read per layer and role) and gives the room back before the next layer
# writes: else every layer of a long prefill holds its worst case until its first step,
# half an fp16 cache on top (at 32768 x 8 tokens, 8 heads of 128: 256 MiB per layer and
# role). Shorter writes (a prompt of a few hundred tokens) keep the write free of host reads.
MED3_CUT_AT_WRITE_BYTES = 64 << 20


def per_head_outliers(packed: Packed, nc: int):
    """Med3x outliers of every segment as per-(b, h) lists `[B, H, Ocap, 4]` in (t, chunk)
    order, and the per-token outlier counts `[B, H, T]`. Each segment stores its outliers
    in (b, h, t, chunk) order; a stable sort by (b, h) over the segments in time order
    keeps (t, chunk) order within each (b, h). No token (an empty store's flat,
    `HQMQStore._create_empty`): empty lists, and no device op."""
    B, H = packed.batch, packed.heads
    if packed.tokens == 0:  # (no entry is valid: nothing to fill)
        return (torch.empty(B, H, OUTLIER_BLOCK, 4, dtype=torch.float16, device=packed.device),
                torch.empty(B, H, 0, dtype=torch.int64, device=packed.device))
    rows, vals, per_tok = [], [], []
    for seg in packed.segments:
        m = unpack_bits(seg.fields["flags"], 1, nc).bool()  # [B, H, Ts, nc]
        per_tok.append(m.sum(-1))
        rows.append(m.nonzero()[:, 0] * H + m.nonzero()[:, 1])
        vals.append(seg.fields["outliers"])
    per_tok = torch.cat(per_tok, dim=2)
    row = torch.cat(rows)
    val = torch.cat(vals)
    order = torch.sort(row, stable=True).indices
    row, val = row[order], val[order]
    n_bh = torch.bincount(row, minlength=B * H)
    first = torch.cumsum(n_bh, 0) - n_bh
    rank = torch.arange(row.numel(), device=row.device) - first[row]
    ocap = whole_blocks(max(1, int(n_bh.max()) if row.numel() else 1))
    out = torch.zeros(B * H, ocap, 4, dtype=torch.float16, device=per_tok.device)
    out[row, rank] = val.to(torch.float16)
    return out.view(B, H, ocap, 4), per_tok


def flatten_hqmq(packed: Packed, role: str | None = None, table_dtype=torch.float32,
                 table_mode: str = "secondaries") -> HQMQFlat:
    cls, cfg = parse_spec(packed.spec)
    if not issubclass(cls, HQMQ):
        raise ValueError(f"flatten_hqmq needs an hqmq cache, got {packed.spec!r}")
    if not packed.segments:
        raise ValueError("empty packed cache")
    q = cls(cfg)
    D = packed.head_dim
    rel = q.radius_levels(torch.ones((), device=packed.device)).float().contiguous()
    flat = HQMQFlat(
        B=packed.batch, H=packed.heads, T=packed.tokens, D=D, S=cfg.S,
        code_bits=q.code_bits, r_bits=cfg.r,
        codes=concat_field(packed, "codes"), radius=concat_field(packed, "radius"), r_max=concat_field(packed, "r_max"),
        table=torch.empty(0), rel=rel, dtype=packed.dtype,
        log_radius=cfg.radius == "log" and cfg.r > 1,
        code_pack="mixed" if q.code_layout(D // 4)[0] > 1 else "bits",  # G = 1: the bits layout exactly
        sec=normalised_secondaries(packed.shared), ptab=units_on(packed.device), codebook=cfg.codebook,
    )
    flat = flat.with_table(table_mode, table_dtype)
    if q.med3:
        flat.flags = concat_field(packed, "flags")
        flat.outliers, per_tok = per_head_outliers(packed, D // 4)
        flat.outlier_index = outlier_block_starts(per_tok)
    return flat


def engine_table(device) -> tuple[str, torch.dtype] | None:
    """The codeword source the engine gives HQMQ's kernels on `device` (None: the flat's
    own, fp32 secondaries): the fp16 codebook on a GPU, the fastest Triton source in the
    H200 sweeps (reports/kernels/NOTES.md; B=8 T=32k d 128, Triton: 409 us with it in the
    latency run of 2026-12-02, 1490 us with the fp32 secondaries in that of 2026-12-05).
    The CUDA kernels gather from the same fp16 codebook (cuda/hqmq_decode.py `codebook16`)."""
    return ("codebook", torch.float16) if torch.device(device).type == "cuda" else None


def configure(flat: HQMQFlat, table=None) -> HQMQFlat:
    """The flat with another codeword source for the kernel, (table_mode, dtype) (None: as is)."""
    return flat if table is None else flat.with_table(*table)


def encode_step(store: "HQMQStore", x: torch.Tensor, errors: torch.Tensor, t0: int, pos=None,
                index_block: int | None = None) -> None:
    """`HQMQ.encode_tokens` of a write on the device, into the store's buffers at token t0
    (or the device position pos): without Med3x t tokens `[B, H, t, D]` in one launch
    (grid (B*H, t)); Med3x one token (a decode step: the median over its chunks), the
    outliers at the (b, h) list ends, the index block start at `index_block` (see
    `hqmq_tokens`); Med3x t > 1 tokens (a prefill, a later chunk: the median over the
    write) in two launches (`hqmq_med3_write`), room made by `HQMQStore._step_room`."""
    f = store.flat
    C = store.stepper.config.C
    if f.has_outliers and x.shape[2] > 1:
        hqmq_med3_write(x, f, f.S, f.rel, t0, errors, C=C, outlier_len=store.outlier_len)
        worst = x.shape[0] * x.shape[1] * x.shape[2] * (store.D // 8)  # entries: half of every token's chunks
        if worst * 4 * store.outliers.element_size() > MED3_CUT_AT_WRITE_BYTES:
            store.release_write_room_now()
        else:
            store._snapshot = LengthSnapshot(store.outlier_len, store._outlier_bound)  # (`_release_write_room`)
        return
    hqmq_tokens(x, f, f.S, f.rel, t0, errors, C=C, med3=f.has_outliers,
                outlier_len=store.outlier_len, index_block=index_block, pos=pos)


def device_refusal(q) -> str | None:
    """Why the device encoders cannot encode this quantizer's writes (None: they can)."""
    median = getattr(getattr(q, "config", None), "median", "write")
    if median != "write":
        return (f"hqmq median={median}: the device encoders take each write's own median only, not the "
                "prefill's kept one (quantizers/hqmq.py); its writes take the reference encoder")
    return None


class HQMQStore(KernelStore):
    """The generic store of the token fields plus, with Med3x, the per-(b, h) outlier lists
    (module docstring)."""

    def __init__(self, flat, packed: Packed, role: str, fmt):
        super().__init__(flat, packed, role, fmt)
        self.outliers: torch.Tensor | None = None  # Med3x: [B, H, Ocap, 4]
        self.outlier_len: torch.Tensor | None = None  # [B, H] int64, valid entries per (b, h)
        self.outlier_index: TokenBuffer | None = None  # [B, H, nblk_cap] int32 (one entry per block)
        self._outlier_bound = 0  # host-side upper bound of outlier_len.max()
        self._snapshot: LengthSnapshot | None = None  # the lengths after the last multi-token write
        # Med3x writes of several tokens on the device (`hqmq_med3_write`): where the current
        # run is cut (each such write's end: its tokens are one segment, as the old path
        # appends them), and the run's segments before its last (`run_segments`)
        self._cuts: list[int] = []
        self._run_extra: list[tuple[Segment, int]] = []
        self._refusal: str | None = None  # why the device encoders decline this config (`device_refusal`)

    def _rewind_more(self, check: bool) -> bool:
        # Without Med3x nothing beside the token fields (KernelStore.rewind). Med3x: the
        # lists are emptied where they are (lengths zeroed on the device, the host bound
        # with them), so a graph captured over them replays; the flags are zeroed, so no
        # capacity row of the old prompt sends a kernel to a list entry.
        if not getattr(self.stepper, "med3", False):
            return self.outliers is None
        if not check:
            if self.outliers is not None:
                self.outlier_len.zero_()
                self._outlier_bound, self._snapshot = 0, None
                self.outlier_index.length = 0
            flags = self.buffers["flags"].buf
            with torch.inference_mode(flags.is_inference()):
                flags.zero_()
            self._cuts, self._run_extra = [], []
        return True

    @classmethod
    def _create_empty(cls, packed: Packed, role: str, fmt, stepper, tokens: int, capacity: int | None,
                      table=None) -> "HQMQStore | None":
        """Med3x: `KernelStore.create_empty` with the outliers aside (their count is data:
        the lists are made by the first write, `_write_room`); without Med3x the generic
        way (NotImplemented)."""
        if not stepper.med3:
            return NotImplemented
        B, H, D = packed.batch, packed.heads, packed.head_dim
        try:
            fields, _ = stepper.segment_layout((B, H, 1, D))
        except (ValueError, TypeError, RuntimeError):
            return None
        if fields is None or set(fields) != set(fmt.token_fields) | {"outliers"}:
            return None
        zero = Segment({name: torch.empty((B, H, 0) + tuple(shape[3:]) if name != "outliers" else (0,) + tuple(shape[1:]),
                                          dtype=dtype, device=packed.device)
                        for name, (shape, dtype) in fields.items()}, 0)
        flat = flatten_hqmq(dataclasses.replace(packed, segments=[zero]), role)
        if table is not None:
            flat = configure(flat, table=table)
        store = cls(flat, packed, role, fmt)
        store.capacity_hint = capacity or 0
        for name in store.fields:  # zeroed, as `create_empty`'s
            store._buffer(name, zero.fields[name], tokens, zeroed=True)
        store._refresh_flat()
        store.stepper = stepper
        store._steps_begin()
        return store

    def _steps_begin(self) -> None:
        self._refusal = device_refusal(self.stepper)
        if self._refusal is not None:  # no device step: the old path (the quantizer's append)
            self.stepper = None
            return
        if self.outliers is not None:  # the exact bound now (the first write syncs anyway), room to spare
            self._sync_outliers(OUTLIER_SLACK_STEPS * (self.D // 8))
            self._refresh_flat()

    def _append_more(self, new: list[Segment], t0: int, t: int) -> None:
        if "outliers" in new[0].fields:
            self._append_outliers(new, t0, t)

    def _append_outliers(self, new: list[Segment], t0: int, t: int) -> None:
        """Med3x outliers of the write, from (b, h, t, chunk) order into per-(b, h) lists."""
        B, H, nc = self.B, self.H, self.D // 4
        flags = unpack_bits(concat_tokens(new, "flags"), 1, nc).bool()  # [B, H, t, nc]
        vals = torch.cat([s.fields["outliers"] for s in new]) if len(new) > 1 else new[0].fields["outliers"]
        per_tok = flags.sum(-1)  # [B, H, t]
        per_row = per_tok.sum(-1).flatten()  # [B*H]
        n = vals.shape[0]  # host-known: the segment's shape
        if self.outliers is None:
            self.outlier_len = torch.zeros(B * H, dtype=torch.int64, device=vals.device)
            # capacities in whole blocks: Triton compiles one step-kernel variant whatever the data
            self.outliers = vals.new_zeros(B, H, whole_blocks(max(1, 2 * n // max(1, B * H))), 4)
            self.outlier_index = TokenBuffer(torch.zeros(B, H, 1, dtype=torch.int32, device=vals.device),
                                             grown_capacity(max(t, self.capacity_hint)) // OUTLIER_BLOCK)
        self._reserve_outliers(n)
        ocap = self.outliers.shape[2]
        # Destination of each outlier: its row's list end plus its rank within the row.
        rows = torch.arange(B * H, device=vals.device)
        row_of = torch.repeat_interleave(rows, per_row, output_size=n)
        rank = torch.arange(n, device=vals.device) - (torch.cumsum(per_row, 0) - per_row)[row_of]
        dest = row_of * ocap + self.outlier_len[row_of] + rank
        self.outliers.view(-1, 4)[dest] = vals.to(self.outliers.dtype)
        # Block starts for the 64-token blocks this write begins: list length before
        # the block's first token.
        first = (-t0) % OUTLIER_BLOCK
        if first < t:
            before = torch.cumsum(per_tok, -1) - per_tok  # outliers of this write before each token
            starts = self.outlier_len.view(B, H, 1) + before[:, :, first::OUTLIER_BLOCK]
            self.outlier_index.write(-(-t0 // OUTLIER_BLOCK), starts.int())
        self.outlier_len += per_row

    def _reserve_outliers(self, extra: int, slack: int = 0) -> bool:
        """Room for `extra` more outliers in every (b, h) list; True when the buffer grew.
        A host-side upper bound of the longest list says when it might overflow; only then
        are the real lengths read (a sync), and the buffer grows with `slack` to spare so
        the next read is that far off."""
        grew = False
        if self._outlier_bound + extra > self.outliers.shape[2]:  # might overflow
            grew = self._sync_outliers(extra + slack)
        self._outlier_bound += extra
        return grew

    def _sync_outliers(self, room: int) -> bool:
        """Read the longest (b, h) list (a sync) into the bound; grow the buffer when it has
        less than `room` to spare. True when it grew."""
        ocap = self.outliers.shape[2]
        self._outlier_bound, self._snapshot = int(self.outlier_len.max()), None
        if self._outlier_bound + room <= ocap:
            return False
        cap = whole_blocks(max(2 * ocap, self._outlier_bound + room))
        self.outliers = resized(self.outliers, cap, self._outlier_bound)
        return True

    def _tighten_bound(self) -> bool:
        """The bound from the real longest list after the last Med3x write of several
        tokens, once the snapshot `encode_step` took of it is on the host (no sync); True
        when it was. Still an upper bound: the longest list then plus what the bound has
        added since (every write adds its worst case to it) is at least the longest now."""
        snap = self._snapshot
        longest = None if snap is None else snap.longest()
        if longest is None:
            return False
        self._snapshot = None
        self._outlier_bound = min(self._outlier_bound, longest + self._outlier_bound - snap.bound)
        return True

    def _release_write_room(self, room: int, exact: bool = False) -> bool:
        """At a host-position step after a Med3x write of several tokens: its worst-case
        room released once the real lengths are known (`_tighten_bound`), the buffer cut
        to the bound plus `room` when it holds more than twice that (a write within the
        slack is not worth a copy; doubling growth leaves up to twice too). True when the
        buffer moved."""
        if not (exact or self._tighten_bound()):
            return False
        cap = whole_blocks(self._outlier_bound + room)
        if self.outliers.shape[2] <= 2 * cap:
            return False
        self.outliers = resized(self.outliers, cap, self._outlier_bound)
        return True

    def release_write_room_now(self) -> None:
        """A long Med3x write's worst-case room given back right after it
        (`MED3_CUT_AT_WRITE_BYTES`): its lengths read (a host read), the lists cut to the
        longest plus the steps' slack, the flat onto them."""
        self._outlier_bound, self._snapshot = int(self.outlier_len.max()), None
        if self._release_write_room((1 + OUTLIER_SLACK_STEPS) * (self.D // 8), exact=True):
            self._refresh_flat()

    def graph_unsupported(self) -> str | None:
        return self._refusal or super().graph_unsupported()

    def _step_room(self, t0: int, t: int = 1) -> tuple[bool, dict]:
        if t > 1 and self.stepper.med3:  # a Med3x write of several tokens (`hqmq_med3_write`)
            return self._write_room(t0, t), {}
        block, moved = None, False
        if self.outliers is not None:  # Med3x: a one-token write adds at most nc/2 outliers per (b, h)
            most = self.D // 8  # (half the chunks can exceed C times their median)
            moved = self._release_write_room((1 + OUTLIER_SLACK_STEPS) * most)
            moved |= self._reserve_outliers(most, OUTLIER_SLACK_STEPS * most)
            if t0 % OUTLIER_BLOCK == 0:  # the token opens a block: the kernel writes its start
                block = t0 // OUTLIER_BLOCK
                moved |= self.outlier_index.extend(block + 1)
                self.outlier_index.length = block + 1
        return moved, {"index_block": block}

    def _write_room(self, t0: int, t: int) -> bool:
        """Room for a Med3x write of t tokens at token t0 (`hqmq_med3_write`), made without a
        host read on the first write: t*D/8 more outliers in every (b, h) list (the worst
        case: at most half the chunks exceed C times their lower median), with the steps'
        slack; the first write makes the lists (a later one may read their lengths, as
        `_reserve_outliers` does), and the index blocks the write opens. The run is cut at
        the write's end. True when a side buffer moved."""
        most, slack = t * (self.D // 8), OUTLIER_SLACK_STEPS * (self.D // 8)
        if self.outliers is None:
            dev = self.buffers["flags"].buf.device
            B, H = self.B, self.H
            self.outlier_len = torch.zeros(B * H, dtype=torch.int64, device=dev)
            # (entries past a list's length are never read: no fill)
            self.outliers = torch.empty(B, H, whole_blocks(most + slack), 4, dtype=torch.float16, device=dev)
            self.outlier_index = TokenBuffer(torch.empty(B, H, 1, dtype=torch.int32, device=dev),
                                             grown_capacity(max(t0 + t, self.capacity_hint)) // OUTLIER_BLOCK)
            self._outlier_bound, moved = most, True
        else:  # (no cut before a write: it needs its worst case; a long one cuts after, `encode_step`)
            self._tighten_bound()
            moved = self._reserve_outliers(most, slack)
        blocks = -(-(t0 + t) // OUTLIER_BLOCK)
        moved |= self.outlier_index.extend(blocks)
        self.outlier_index.length = max(self.outlier_index.length, blocks)
        self._cuts.append(t0 + t)
        return moved

    @property
    def segment_on_read(self) -> bool:
        """Whether the current run holds a Med3x write of several tokens: its segment's
        outliers `[n, 4]` have a count only the device knows, so the segment is made when
        the cache is read (`run_segments`), not after the write."""
        return bool(self._cuts)

    def _reserve_more(self, tokens: int) -> bool:
        if self.outliers is None:
            return False
        # Med3x: the real longest list plus the worst case of the steps to come (half the
        # chunks of each token), read exactly (reserve is never captured) when a write's
        # worst-case room is still held (then released) or the bound says it may not fit;
        # the index blocks they open; flags past the valid tokens zeroed, so no kernel
        # looks up outliers for a capacity row (the kernels' device step writes each token's).
        steps, ocap, moved = max(0, tokens - self.tokens) * (self.D // 8), self.outliers.shape[2], False
        release = self._snapshot is not None
        if release or self._outlier_bound + steps > ocap:
            self._outlier_bound, self._snapshot = int(self.outlier_len.max()), None
            cap = whole_blocks(self._outlier_bound + steps)
            if cap > ocap or (release and cap < ocap):
                self.outliers, moved = resized(self.outliers, cap, self._outlier_bound), True
        self._outlier_bound += steps
        moved |= self.outlier_index.extend(-(-tokens // OUTLIER_BLOCK))
        flags = self.buffers["flags"].buf
        with torch.inference_mode(flags.is_inference()):
            flags[:, :, self.tokens:].zero_()
        return moved

    def _advance(self, end: int) -> None:
        super()._advance(end)
        if self.outliers is not None:  # the blocks the steps opened (their room was reserved)
            self.outlier_index.length = max(self.outlier_index.length, -(-end // OUTLIER_BLOCK))

    def device_buffers(self) -> list[torch.Tensor]:
        out = super().device_buffers()
        if self.outliers is not None:
            out += [self.outliers, self.outlier_len, self.outlier_index.buf]
        return out

    def _run_more(self, seg: Segment, start: int) -> None:
        if self.outliers is not None:
            seg.fields["outliers"] = self._run_outliers(start)

    def run_segments(self, base: list[Segment]) -> list[Segment]:
        """As `KernelStore.run_segments`, the run cut where a Med3x write of several tokens
        ended (`_write_room`): that write one segment, the steps after it another."""
        if self._run_start is None or not self._cuts:
            return super().run_segments(base)
        ends = [c for c in self._cuts if c < self.tokens] + [self.tokens]
        segs, start = [], self._run_start
        for end in ends:
            seg = Segment({}, end - start)
            seg.fields.update(self._segment_views(seg, start))
            seg.fields["outliers"] = self._run_outliers(start, end)
            segs.append((seg, start))
            start = end
        self._run_extra, self._run_seg = segs[:-1], segs[-1]
        return base + [seg for seg, _ in segs]

    def end_run(self) -> None:
        self._adopted.extend(self._run_extra)
        self._run_extra, self._cuts = [], []
        super().end_run()

    def _adopt(self, new: list[tuple[Segment, int]], grew: bool) -> None:
        super()._adopt(new, grew)
        for seg, start in self._run_extra if grew else ():  # the run's earlier segments, as its last
            for name, view in self._segment_views(seg, start).items():
                old = seg.fields.get(name)
                if old is not None and old.shape == view.shape and old.dtype == view.dtype:
                    seg.fields[name] = view

    def _run_outliers(self, start: int, end: int | None = None) -> torch.Tensor:
        """The Med3x outliers of tokens start..end (default: the last stored) in (b, h, t,
        chunk) order (a segment's order), from the per-(b, h) lists, whose ends hold the
        tokens up to the last stored: each row's counts from the flags."""
        BH, nc = self.B * self.H, self.D // 4
        end = self.tokens if end is None else end
        per_tok = unpack_bits(self.buffers["flags"].buf[:, :, start : self.tokens], 1, nc).sum(-1)  # [B, H, t]
        per_row = per_tok[:, :, : end - start].sum(-1).flatten()  # [B*H]
        after = per_tok[:, :, end - start :].sum(-1).flatten()  # the tokens past end
        n = int(per_row.sum())
        row = torch.repeat_interleave(torch.arange(BH, device=per_row.device), per_row, output_size=n)
        first = self.outlier_len - after - per_row  # each row's first outlier of start..end
        pos = first[row] + torch.arange(n, device=row.device) - (torch.cumsum(per_row, 0) - per_row)[row]
        return self.outliers.view(BH, -1, 4)[row, pos].clone()

    def run_nbytes(self) -> tuple[int, torch.Tensor | None]:
        """`run_segments`' bytes without gathering its outliers (`_run_outliers`: a dozen
        ops and a host read per store, ~1.3 ms each on an H100; 78 ms of a 30-layer batch-8
        generate call's size count, 2026-12-05): the token fields' views (however the run
        is cut, their bytes add up to the same) and the run's outlier count from its
        flags, left on the device."""
        if self._run_start is None or self.tokens == self._run_start:
            return 0, None
        start, seg = self._run_start, Segment({}, self.tokens - self._run_start)
        host = sum(v.numel() * v.element_size() for v in self._segment_views(seg, start).values())
        if self.outliers is None:
            return host, None
        n = unpack_bits(self.buffers["flags"].buf[:, :, start : self.tokens], 1, self.D // 4).sum()
        return host, n * (4 * self.outliers.element_size())

    def run_numel(self) -> int:
        """The run's elements: however `run_segments` cuts it, its segments hold the run's tokens."""
        return 0 if self._run_start is None else (self.tokens - self._run_start) * self.B * self.H * self.D

    def _flat_more(self) -> dict:
        if self.outliers is None:
            return {}
        return {"outliers": self.outliers, "outlier_index": self.outlier_index.buf}

    @property
    def stored_nbytes(self) -> int:
        n = super().stored_nbytes
        if self.outliers is not None:
            n += self._outlier_total() * 4 * self.outliers.element_size()
        return n

    def _outlier_total(self) -> int:
        return int(self.outlier_len.sum())  # accounting only: a sync is fine here

    @property
    def allocated_nbytes(self) -> int:
        """Device bytes the store holds: buffers at capacity, outliers, outlier_index."""
        n = super().allocated_nbytes
        if self.outliers is not None:
            n += self.outliers.numel() * self.outliers.element_size() + self.outlier_index.nbytes
        return n



CUDA = Kernel("cuda", lambda q, k, v, **kw: cuda_hqmq.decode(q, k, v, **kw), title="CUDA HQMQ kernel",
              auto=lambda k: cuda_hqmq.auto_refusal(k), options=cuda_hqmq.OPTIONS,
              row_start=True, row_start_auto=lambda: cuda_hqmq.row_start_refusal(),
              unsupported=lambda q, k, v: cuda_hqmq.unsupported(q, k, v),
              why_unavailable=lambda: cuda_hqmq.why_unavailable(), renamed=cuda_hqmq.RENAMED,
              fast=lambda q, k, v, valid_len=None: cuda_hqmq.fast(q, k, v, valid_len),
              fits=lambda q, k, v: cuda_hqmq.fits(q, k, v))

FORMAT = Format(
    name="hqmq", quantizer=HQMQ, flat=HQMQFlat, flatten=flatten_hqmq, store=HQMQStore,
    token_fields=("codes", "radius", "r_max", "flags"), step=encode_step, configure=configure,
    # Med3x's median over the write, per-(b, h) lists: `hqmq_med3_write`, `HQMQStore`; not median=prefill
    multi_step=lambda q: device_refusal(q) is None,
    device_encoder=kernel_quantizer,
    kernels=(Kernel("triton", hqmq_decode_attention, title="Triton HQMQ kernel", row_start=True), CUDA),
    bench={"hqmq": "hqmq:S=96,r=4", "hqmq-med3": "hqmq:S=96,r=4,outliers=med3",
           "hqmq-mixed": "hqmq:S=96,r=4,pack=mixed",  # CUDA under auto since AUTO_MIXED (cuda/hqmq_decode.py)
           "hqmq-med3-mixed": "hqmq:S=96,r=4,outliers=med3,pack=mixed",  # CUDA under auto since AUTO_MIXED_MED3
           "hqmq-int8": "hqmq:S=96,r=4,codebook=int8"},  # CUDA under auto since AUTO_INT8 (cuda/hqmq_decode.py)
)
