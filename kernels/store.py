"""The packed KV store on the model's device, in the layout the fused kernels read.

One `KernelStore` per (layer, role) of a quantized cache. Its buffers are
preallocated along the token axis with a CAPACITY (`[B, H, Tcap, ...]`) that grows
by doubling, so a decode step's append writes in place (amortised O(1)); the
`*Flat` it hands to the kernels (`flat`) carries the buffers and the valid length
(the store <-> kernel contract in kernels/layout.py).

What is stored comes from each write's `Segment` fields (the quantizer's bytes), so
`Packed.nbytes` stays the one source of measured bits; `stored_nbytes` (the valid
bytes the store holds, derived kernel-side state excluded) equals the Packed's
segment bytes, which the tests check. To avoid holding every byte twice, the
store re-points the token-axis fields of the segments it has absorbed at views of
its buffers (`adopt`), and re-points them again when a buffer grows. Med3x's
outlier chunks are the exception: the segment keeps its (b, h, t, chunk)-ordered
list, the store a per-(b, h) copy (outliers are a few percent of the chunks).

Formats (by the `*Flat` type `flatten` returns for the first write):
- `IntFlat`, `HQMQFlat`, `FP8Flat`: token-axis fields copied from the segments
  (codes, scale, zero / codes, radius, r_max, flags / codes; static parts such as
  codebook tables and fp8's per-head scale come from the first write's flatten).
  HQMQ + Med3x outliers per (b, h):
  `outliers [B, H, Ocap, 4]`, and `outlier_index [B, H, ceil(Tcap/64)]`, the start of
  each 64-token block within its (b, h) list, updated for the blocks a write starts.
- `KIVIFlat`: the new segments of a write are flattened by `layout.flatten` (so the
  KIVI layout has one definition) and their quantized groups appended; the fp16
  window is replaced by the write's window (its buffer is sized for the window, not
  for the capacity hint). KIVI's quantized segments are re-pointed at the buffers
  too; its window segment (a few groups of fp16) keeps its own bytes.

Decode steps (`step`): a one-token write of a format with a step encoder (the
built-in int per-token groups, fp8, KIVI and HQMQ classes exactly; plugins and
subclasses take the old path) is encoded on the device by kernels/step_encode.py
straight into the buffers at the current length: one launch per step (KIVI: plus
one int launch and one shift when its window flushes, every G or R steps), no host
read (Med3x: one every >= 64 steps, see `_reserve_outliers`). Such writes make no
Segment: they form a RUN, and `run_segments` gives the Segments that hold exactly the
bytes the old path would have stored (views of the buffers; KIVI's window and
Med3x's (b, h, t, chunk)-ordered outliers copied), made only when someone reads the
Packed. `end_run` turns them into ordinary absorbed segments (the next old-path
write appends after them).

Decode steps at a device position (`step_at`, for CUDA graphs; suites/harness/kv_cache.py
`device_steps`): the same encoders write at a position read from a device int32 tensor
and touch no host state; `advance(n)` then does the host bookkeeping `step` does, for
n steps that ran; `reserve` allocates the room up front (a graph holds the buffers'
addresses) and `graph_view` is the flat attention reads, its T the reserved capacity
(the valid length is a device argument). Int, fp8, KIVI and HQMQ (Med3x included:
`reserve` makes room for the worst case of the steps to come, half the chunks of each
token, and the step kernel appends the outliers at the device list ends and writes an
index block start when the token at the position opens one); `graph_unsupported` names
why not for the others.
KIVI at a device position: its group count and window length are functions of the
token count by its window policy (`step_encode.kivi_policy`: max(0, t - A) // P * P
tokens quantized, the window fills at A + P, a flush quantizes P and keeps A), so the
device token count at `pos` is the one device state: the window write goes to row
p - q(p), the flush (`int_rows` with `flush=`) and the shift (`kivi_shift`) launch every
step and do nothing unless the token fills the window, and the attention derives each
side's counts from the valid length the same way (`KIVIGraphFlat`, `graph_view`).
`reserve` sizes the group buffers for the capacity and the window for A + P rows;
`advance` sets n_groups, the window length and the buffers' lengths from the host's
token count (no device read).

Host synchronisation (old path, `append`): none per step for int, fp8 and KIVI. HQMQ + Med3x needs the largest
per-(b, h) outlier count only when a host-side upper bound (previous bound plus the
write's total outlier count, a shape, so known without a sync) says the outlier
buffer might overflow: the bound grows B*H times faster than the largest list, so that
is about B*H*log(T) syncs over T tokens, not one per step. (The
quantizers' own encode still synchronises: input checks, pack range checks and
Med3x's boolean-mask indexing.)
"""
from __future__ import annotations

import dataclasses

import torch

from ..quantizers import Packed, Segment, parse_spec
from ..quantizers.fp8 import FP8
from ..quantizers.hqmq import HQMQ
from ..quantizers.kivi import KIVI
from ..quantizers.naive_int import NaiveInt
from ..quantizers.packing import packed_nbytes, unpack_bits
from . import layout, step_encode

OUTLIER_BLOCK = layout.OUTLIER_BLOCK
MIN_CAPACITY = 256  # tokens; small caches would otherwise regrow every few steps
OUTLIER_SLACK_STEPS = 64  # Med3x decode steps of worst-case outliers to spare when the list grows
# Quantizer classes whose encode the step encoders reproduce (exact classes: a subclass may
# encode differently), with the Flat kind they write.
STEP_ENCODED = {NaiveInt: layout.IntFlat, FP8: layout.FP8Flat, KIVI: layout.KIVIFlat, HQMQ: layout.HQMQFlat}


def grown_capacity(need: int, current: int = 0) -> int:
    """Capacity for `need` valid tokens: at least double the current one, a multiple of
    OUTLIER_BLOCK (the kernels tile tokens in 64s)."""
    return layout.whole_blocks(max(need, 2 * current, MIN_CAPACITY))


class TokenBuffer:
    """A `[B, H, cap, *rest]` tensor whose valid prefix `[:, :, :length]` grows in place.

    `write(start, x)` writes x at tokens start.. (growing by doubling if needed) and
    sets the valid length to start + x.shape[2]; `valid` is a view of the prefix."""

    def __init__(self, like: torch.Tensor, capacity: int):
        self.buf = like.new_empty(like.shape[:2] + (capacity,) + like.shape[3:])
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.buf.shape[2]

    def ensure(self, need: int) -> bool:
        """Room for `need` tokens; True when the buffer was reallocated (views went stale)."""
        if need <= self.capacity:
            return False
        new = self.buf.new_empty(self.buf.shape[:2] + (grown_capacity(need, self.capacity),) + self.buf.shape[3:])
        new[:, :, : self.length] = self.buf[:, :, : self.length]
        self.buf = new
        return True

    def extend(self, need: int) -> bool:
        """Room for `need` valid tokens, which the caller writes in place (a kernel);
        True when the buffer was reallocated."""
        if need <= self.capacity:
            return False
        with torch.inference_mode(self.buf.is_inference()):
            return self.ensure(need)

    def write(self, start: int, x: torch.Tensor) -> bool:
        if start > self.length:
            raise ValueError(f"write at token {start} leaves a gap after {self.length} valid tokens")
        # A buffer made under inference_mode can only be written under it (a later
        # write outside it, e.g. a diagnostic edit, would otherwise raise).
        with torch.inference_mode(self.buf.is_inference()):
            grew = self.ensure(start + x.shape[2])
            self.buf[:, :, start : start + x.shape[2]] = x
        self.length = start + x.shape[2]
        return grew

    @property
    def valid(self) -> torch.Tensor:
        return self.buf[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


def _cat_tokens(segs: list[Segment], name: str) -> torch.Tensor:
    ts = [s.fields[name] for s in segs]
    return torch.cat(ts, dim=2) if len(ts) > 1 else ts[0]


class KernelStore:
    """The device store of one (layer, role). Build it with `KernelStore.create(packed,
    role)` from the first write (None when no fused kernel reads this format), then
    `append(new_segments, shared_tokens)` after every later write."""

    # Segment fields that lie along the token axis as [B, H, t, ...], per Flat type
    TOKEN_FIELDS = {layout.IntFlat: ("codes", "scale", "zero"),
                    layout.HQMQFlat: ("codes", "radius", "r_max", "flags"),
                    layout.FP8Flat: ("codes",)}

    def __init__(self, flat, packed: Packed, role: str):
        self.role, self.kind = role, type(flat)
        self.B, self.H, self.D = packed.batch, packed.heads, packed.head_dim
        # Static parts (tables) from the first write's flatten; buffers are swapped in below.
        self.flat = dataclasses.replace(flat, n_groups=0) if isinstance(flat, layout.KIVIFlat) else flat
        # What a KIVI piece needs to be flattened exactly like the whole cache.
        self._meta = (packed.dtype, packed.device, packed.shared, packed.spec)
        self.tokens = 0
        self._adopted: list[tuple[Segment, int]] = []  # (segment, first row) whose fields view our buffers
        self.buffers: dict[str, TokenBuffer] = {}
        self.outliers: torch.Tensor | None = None  # HQMQ + Med3x: [B, H, Ocap, 4]
        self.outlier_len: torch.Tensor | None = None  # [B, H] int64, valid entries per (b, h)
        self.outlier_index: TokenBuffer | None = None  # [B, H, nblk_cap] int32 (one entry per block)
        self._outlier_bound = 0  # host-side upper bound of outlier_len.max()
        self.capacity_hint = 0  # tokens to allocate for at the first write (e.g. prompt + new tokens)
        self.stepper = None  # the quantizer (exact built-in class) when `step` can encode its writes
        # The current run of `step` writes: where it began (tokens; KIVI: groups), the last
        # Segment made for it (with its first row) and KIVI's flushed groups' Segments.
        self._run_start: int | None = None
        self._run_seg: tuple[Segment, int] | None = None
        self._run_groups: list[Segment] = []
        self._graph_flat = None  # (flat, capacity, flat with T = capacity): `graph_view`'s cache

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def create(cls, packed: Packed, role: str, capacity: int | None = None,
               hqmq_table: tuple[str, torch.dtype] | None = None, step: bool = True) -> "KernelStore | None":
        """`hqmq_table`: (table_mode, dtype) of the HQMQ codeword source the kernel gathers
        from (`HQMQFlat.with_table`); None keeps layout's default (exact fp32 secondaries).
        `step`: encode decode steps on the device (`step`) where a step encoder exists."""
        try:
            flat = layout.flatten(packed, role)
        except (ValueError, TypeError, NotImplementedError):
            return None  # no fused kernel reads this format (the dense path serves it)
        if not isinstance(flat, tuple(cls.TOKEN_FIELDS) + (layout.KIVIFlat,)):
            return None
        if hqmq_table is not None and isinstance(flat, layout.HQMQFlat):
            flat = flat.with_table(*hqmq_table)
        store = cls(flat, packed, role)
        store.capacity_hint = capacity or 0
        store.append(packed.segments, 0)
        q_cls, cfg = parse_spec(packed.spec)
        if step and STEP_ENCODED.get(q_cls) is store.kind:
            store.stepper = q_cls(cfg, role=role)
            if store.outliers is not None:  # the exact bound now (the first write syncs anyway), room to spare
                store._sync_outliers(OUTLIER_SLACK_STEPS * (store.D // 8))
                store._refresh_flat()
        return store

    # ---- appends ----------------------------------------------------------------------
    def append(self, new: list[Segment], shared_tokens: int) -> None:
        """Absorb the segments a write added; `shared_tokens` is the number of tokens
        of the previous write's segments the new Packed still shares (KIVI drops its
        trailing fp16 window segment on every write)."""
        if not new:
            return
        if self.kind is layout.KIVIFlat:
            self._append_kivi(new, shared_tokens)
        else:
            if shared_tokens != self.tokens:
                raise ValueError(f"append after {shared_tokens} shared tokens to a store of {self.tokens}")
            self._append_tokens(new)
        self.tokens = shared_tokens + sum(s.tokens for s in new)

    def _buffer(self, name: str, like: torch.Tensor, need: int, unit: int = 1, hinted: bool = True) -> TokenBuffer:
        """The buffer `name`, created for `need` rows of axis 2 (each `unit` tokens), or
        for the capacity hint if larger (`hinted`)."""
        if name not in self.buffers:
            cap = -(-grown_capacity(max(need * unit, self.capacity_hint if hinted else 0)) // unit)
            self.buffers[name] = TokenBuffer(like, cap)
        return self.buffers[name]

    def _append_tokens(self, new: list[Segment]) -> None:
        t0, t = self.tokens, sum(s.tokens for s in new)
        grew = False
        for name in self.TOKEN_FIELDS[self.kind]:
            if name not in new[0].fields:
                continue
            buf = self._buffer(name, new[0].fields[name], t0 + t)
            grew |= buf.write(t0, _cat_tokens(new, name))
        if "outliers" in new[0].fields:
            self._append_outliers(new, t0, t)
        starts, t = [], t0
        for seg in new:
            starts.append((seg, t))
            t += seg.tokens
        self._adopt(starts, grew)
        self._refresh_flat()

    def _adopt(self, new: list[tuple[Segment, int]], grew: bool) -> None:
        """Point the absorbed segments' fields at views of the store's buffers, so each
        byte is held once; `new` pairs each segment with its first row on axis 2
        (tokens; KIVI keys: groups). After a reallocation every adopted segment is
        re-pointed. A view whose shape or dtype differs from the field is not used."""
        self._adopted.extend(new)
        every = self._adopted + ([self._run_seg] if self._run_seg is not None else [])
        for seg, start in (every if grew else new):
            for name, view in self._segment_views(seg, start).items():
                old = seg.fields.get(name)
                if old is not None and old.shape == view.shape and old.dtype == view.dtype:
                    seg.fields[name] = view

    def _segment_views(self, seg: Segment, start: int) -> dict[str, torch.Tensor]:
        b = self.buffers
        if self.kind is not layout.KIVIFlat:
            return {n: b[n].buf[:, :, start : start + seg.tokens] for n in self.TOKEN_FIELDS[self.kind]
                    if n in b and (n in seg.fields or not seg.fields)}
        if self.role == "K":  # one group per row: codes [B,H,D,GB], scale/zero [B,H,D,1]
            return {n: b[n].buf[:, :, start] if n == "codes" else b[n].buf[:, :, start].unsqueeze(-1)
                    for n in ("codes", "scale", "zero")}
        return {n: b[n].buf[:, :, start : start + seg.tokens] for n in ("codes", "scale", "zero")}

    def _append_outliers(self, new: list[Segment], t0: int, t: int) -> None:
        """Med3x outliers of the write, from (b, h, t, chunk) order into per-(b, h) lists."""
        B, H, nc = self.B, self.H, self.D // 4
        flags = unpack_bits(_cat_tokens(new, "flags"), 1, nc).bool()  # [B, H, t, nc]
        vals = torch.cat([s.fields["outliers"] for s in new]) if len(new) > 1 else new[0].fields["outliers"]
        per_tok = flags.sum(-1)  # [B, H, t]
        per_row = per_tok.sum(-1).flatten()  # [B*H]
        n = vals.shape[0]  # host-known: the segment's shape
        if self.outliers is None:
            self.outlier_len = torch.zeros(B * H, dtype=torch.int64, device=vals.device)
            # capacities in whole blocks: Triton compiles one step-kernel variant whatever the data
            self.outliers = vals.new_zeros(B, H, layout.whole_blocks(max(1, 2 * n // max(1, B * H))), 4)
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
        self._outlier_bound = int(self.outlier_len.max())
        if self._outlier_bound + room <= ocap:
            return False
        cap = layout.whole_blocks(max(2 * ocap, self._outlier_bound + room))
        grown = self.outliers.new_zeros(self.B, self.H, cap, 4)
        grown[:, :, :ocap] = self.outliers
        self.outliers = grown
        return True

    def _append_kivi(self, new: list[Segment], shared_tokens: int) -> None:
        f = self.flat
        if shared_tokens != f.n_groups * f.group:
            raise ValueError(f"KIVI append shares {shared_tokens} tokens, the store holds "
                             f"{f.n_groups} groups of {f.group}")
        dtype, device, shared, spec = self._meta
        piece = layout.flatten(Packed(self.B, self.H, self.D, dtype, device, new, shared, spec), self.role)
        ng, ng_new = f.n_groups, piece.n_groups
        per_group = 1 if self.role == "K" else f.group  # rows of axis 2 per group
        grew = False
        if ng_new:
            for name in ("codes", "scale", "zero"):
                buf = self._buffer(name, getattr(piece, name), (ng + ng_new) * per_group, f.group // per_group)
                grew |= buf.write(ng * per_group, getattr(piece, name))
        # The window is bounded (a few groups), so no capacity hint: it would size an
        # fp16 buffer for the whole context.
        self._buffer("residual", piece.residual, max(piece.T_res, 1), hinted=False).write(0, piece.residual)
        quant = [s for s in new if "residual" not in s.fields]
        # (The window segment keeps its own bytes: the window buffer is rewritten in place
        # on every write, which would change what an earlier Packed's window reads.)
        self._adopt([(s, (ng + i) * per_group) for i, s in enumerate(quant)], grew)
        self.flat = dataclasses.replace(
            f, n_groups=ng + ng_new,
            codes=self.buffers["codes"].buf if "codes" in self.buffers else None,
            scale=self.buffers["scale"].buf if "scale" in self.buffers else None,
            zero=self.buffers["zero"].buf if "zero" in self.buffers else None,
            residual=self.buffers["residual"].valid, n_res=None)

    # ---- decode steps encoded on the device ----------------------------------------------
    def step(self, x: torch.Tensor, errors: torch.Tensor) -> bool:
        """Encode the one-token write x `[B, H, 1, D]` (checked by the caller: this
        store's B, H, D, dtype and device) straight into the buffers; False (nothing
        done) when no step encoder serves it, and the caller takes the old path. Input
        errors raise `errors` (a `StepErrors` row) on the device instead of an exception."""
        if self.stepper is None or x.shape[2] != 1:
            return False
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self._run_start is None:
            self._run_start = self.flat.n_groups if self.kind is layout.KIVIFlat else self.tokens
        if self.kind is layout.KIVIFlat:
            self._step_kivi(x, errors)
        else:
            self._step_tokens(x, errors)
        return True

    def _step_tokens(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        t0 = self.tokens
        end = t0 + 1
        grew = False
        for name in self.TOKEN_FIELDS[self.kind]:
            if name in self.buffers:
                grew |= self.buffers[name].extend(end)
        f, q = self.flat, self.stepper
        if self.kind is layout.HQMQFlat:
            block, moved = None, False
            if self.outliers is not None:  # Med3x: a one-token write adds at most nc/2 outliers per (b, h)
                most = self.D // 8  # (half the chunks can exceed C times their median)
                moved = self._reserve_outliers(most, OUTLIER_SLACK_STEPS * most)
                if t0 % OUTLIER_BLOCK == 0:  # the token opens a block: the kernel writes its start
                    block = t0 // OUTLIER_BLOCK
                    moved |= self.outlier_index.extend(block + 1)
                    self.outlier_index.length = block + 1
            if grew:
                self._repoint()
            elif moved:  # no segment views these: the flat alone
                self._refresh_flat()
            f = self.flat
            step_encode.hqmq_tokens(x, f, f.S, f.rel, t0, errors, C=q.config.C, med3=f.has_outliers,
                                    outlier_len=self.outlier_len, index_block=block)
        else:
            if grew:
                self._repoint()
                f = self.flat
            if self.kind is layout.FP8Flat:
                step_encode.fp8_tokens(x, f.codes, f.scale, f.fmt, t0, errors)
            else:
                c, sc = f.codes, f.scale
                step_encode.int_rows(x, x.stride()[:4] + (0,), 1, 1, c, c.stride()[:3] + (0,), sc, f.zero,
                                     sc.stride()[:3] + (0,), t0, 0, n=self.D, group=f.group, bits=f.bits,
                                     err=errors, tok0=t0, token_rows=True)
        for name in self.TOKEN_FIELDS[self.kind]:
            if name in self.buffers:
                self.buffers[name].length = end
        self.tokens = f.T = end  # the flat is the store's live view: its length grows in place

    def _repoint(self) -> None:
        """After a reallocation: segments and the flat onto the new buffers."""
        self._adopt([], True)
        self._refresh_flat()

    def _step_kivi(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        f, res = self.flat, self.buffers["residual"]
        n = res.length
        res.extend(n + 1)
        step_encode.kivi_window(x, res.buf, n, errors, self.tokens)
        res.length = n + 1
        done = f.n_groups * f.group
        flush = self.stepper.quantized_tokens(done + n + 1) - done
        if flush:
            self._flush_kivi(flush, errors)
        f.residual, f.n_res = res.buf, res.length
        self.tokens += 1

    def _flush_kivi(self, n: int, errors: torch.Tensor) -> None:
        """Quantize the window's first n tokens (whole groups) as KIVI's `append_windowed`
        does, into the group buffers, and shift the rest of the window down."""
        f, res = self.flat, self.buffers["residual"]
        G, ng, new = f.group, f.n_groups, n // f.group
        w, D = res.buf, self.D
        key = self.role == "K"
        per = 1 if key else G  # rows of axis 2 per group
        self._kivi_group_buffers((ng + new) * per)
        grew = False
        for name in ("codes", "scale", "zero"):
            grew |= self.buffers[name].extend((ng + new) * per)
        c, sc, z = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        if key:  # rows: channels, their G tokens D apart; blocks: groups
            step_encode.int_rows(w, (w.stride(0), w.stride(1), 1, w.stride(2), G * w.stride(2)), D, new,
                                 c, (c.stride(0), c.stride(1), c.stride(3), c.stride(2)), sc, z,
                                 (sc.stride(0), sc.stride(1), 1, sc.stride(2)), 0, ng, n=G, group=G, bits=f.bits,
                                 err=errors, tok0=self.tokens, token_rows=False)
        else:  # rows: tokens, groups of G channels
            step_encode.int_rows(w, (w.stride(0), w.stride(1), w.stride(2), 1, 0), n, 1,
                                 c, (c.stride(0), c.stride(1), c.stride(2), 0), sc, z,
                                 (sc.stride(0), sc.stride(1), sc.stride(2), 0), ng * G, 0, n=D, group=G,
                                 bits=f.bits, err=errors, tok0=self.tokens, token_rows=False)
        rest = res.length - n
        if rest:
            with torch.inference_mode(w.is_inference()):
                w[:, :, :rest] = w[:, :, n : n + rest].clone()  # overlapping ranges: through a copy
        res.length = rest
        for name in ("codes", "scale", "zero"):
            self.buffers[name].length = (ng + new) * per
        f.n_groups, f.codes, f.scale, f.zero = ng + new, c, sc, z
        if grew:
            self._adopt([], True)

    def _kivi_group_buffers(self, rows: int) -> None:
        """KIVI's group buffers (codes, scale, zero), created for `rows` rows of axis 2 (or
        the capacity hint) when no group was stored yet: shaped like one group's fields."""
        if "codes" in self.buffers:
            return
        f, w, B, H, D = self.flat, self.buffers["residual"].buf, self.B, self.H, self.D
        G, key = f.group, self.role == "K"
        per = 1 if key else G
        codes = w.new_empty((B, H, 1, D, packed_nbytes(G, f.bits)) if key else
                            (B, H, 1, packed_nbytes(D, f.bits)), dtype=torch.uint8)
        scale = w.new_empty((B, H, 1, D) if key else (B, H, 1, D // G))
        for name, like in (("codes", codes), ("scale", scale), ("zero", scale)):
            self._buffer(name, like, rows, G // per)

    # ---- decode steps at a device position (CUDA graphs) ----------------------------------------
    def graph_unsupported(self) -> str | None:
        """Why `step_at` cannot serve this store's decode steps (None: it can)."""
        if self.stepper is None:
            return "no device step encoder for this format (a plugin, a subclass or step_encode=False)"
        if self.kind is layout.KIVIFlat:
            if self.kivi_policy is None:
                return ("KIVI's window policy is not max(0, t - A) // P * P quantized tokens "
                        "(step_encode.kivi_policy), so the device cannot decide its flushes")
            if 8 % self.flat.bits:  # (the attention kernel's own limit: the device path is Triton's)
                return f"KIVI with {self.flat.bits} bits: the fused kernel reads 2, 4 or 8"
            return None
        return None

    @property
    def kivi_policy(self) -> tuple[int, int] | None:
        """KIVI: (A, P) of `step_encode.kivi_policy` (quantized tokens max(0, t - A) // P * P;
        the window fills at A + P, a flush quantizes P tokens and keeps A)."""
        if self.stepper is None or self.kind is not layout.KIVIFlat:
            return None
        if not hasattr(self, "_policy"):
            self._policy = step_encode.kivi_policy(self.stepper)
        return self._policy

    def _kivi_counts(self, tokens: int) -> tuple[int, int]:
        """(quantized groups, window rows) of a KIVI store holding `tokens` tokens."""
        a, p = self.kivi_policy
        q = max(0, tokens - a) // p * p
        return q // self.flat.group, tokens - q

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` valid tokens in every token buffer, allocated now: steps at a
        device position must never move a buffer (a CUDA graph holds their addresses).
        KIVI: the group buffers for the groups `tokens` tokens hold, the window for the
        A + P rows it reaches before a flush."""
        if self.kind is layout.KIVIFlat:
            self._reserve_kivi(tokens)
            return
        grew = moved = False
        for name in self.TOKEN_FIELDS[self.kind]:
            if name in self.buffers:
                grew |= self.buffers[name].extend(tokens)
        if self.outliers is not None:
            # Med3x: the worst case of the steps to come (half the chunks of each token), the
            # index blocks they open; flags past the valid tokens zeroed, so no kernel looks
            # up outliers for a capacity row (the kernels' device step writes each token's).
            moved = self._reserve_outliers(max(0, tokens - self.tokens) * (self.D // 8))
            moved |= self.outlier_index.extend(-(-tokens // OUTLIER_BLOCK))
            flags = self.buffers["flags"].buf
            with torch.inference_mode(flags.is_inference()):
                flags[:, :, self.tokens:].zero_()
        if grew:
            self._repoint()
        elif moved:
            self._refresh_flat()

    def _reserve_kivi(self, tokens: int) -> None:
        a, p = self.kivi_policy
        f, res = self.flat, self.buffers["residual"]
        per = 1 if self.role == "K" else f.group
        rows = self._kivi_counts(tokens)[0] * per
        if res.extend(a + p):
            f.residual = res.buf
        self._kivi_group_buffers(max(rows, per))
        grew = False
        for name in ("codes", "scale", "zero"):
            grew |= self.buffers[name].extend(max(rows, per))
        f.codes, f.scale, f.zero = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        f.residual, f.n_res = res.buf, res.length
        if grew:
            self._adopt([], True)

    @property
    def token_capacity(self) -> int:
        """Tokens the token buffers hold without growing (KIVI: the tokens whose groups the
        group buffers hold, with a window that can fill)."""
        if self.kind is layout.KIVIFlat:
            a, p = self.kivi_policy
            if "codes" not in self.buffers or self.buffers["residual"].capacity < a + p:
                return self.tokens
            per = 1 if self.role == "K" else self.flat.group
            # the most tokens t with q(t) / G groups within the buffers: q(t) <= cap * G
            # (per row of axis 2: one group (K) or one token (V))
            qcap = self.buffers["codes"].capacity // per * self.flat.group // p * p
            return qcap + a + p - 1
        return min(self.buffers[n].capacity for n in self.TOKEN_FIELDS[self.kind] if n in self.buffers)

    def step_at(self, x: torch.Tensor, errors: torch.Tensor, pos: torch.Tensor) -> None:
        """Encode the one-token write x `[B, H, 1, D]` (checked by the caller, as for
        `step`) at the device position `pos` (int32, its first element: tokens stored
        before it; the kernel reads it, the host does not), touching no host state: the
        caller accounts for the steps that ran with `advance` (the host knows how many it
        replayed) and must have `reserve`d room (`graph_unsupported` must be None)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        f, q = self.flat, self.stepper
        if self.kind is layout.KIVIFlat:
            self._step_at_kivi(x, errors, pos)
        elif self.kind is layout.HQMQFlat:
            step_encode.hqmq_tokens(x, f, f.S, f.rel, 0, errors, C=q.config.C, med3=f.has_outliers,
                                    outlier_len=self.outlier_len, pos=pos)
        elif self.kind is layout.FP8Flat:
            step_encode.fp8_tokens(x, f.codes, f.scale, f.fmt, 0, errors, pos=pos)
        else:
            c, sc = f.codes, f.scale
            step_encode.int_rows(x, x.stride()[:4] + (0,), 1, 1, c, c.stride()[:3] + (0,), sc, f.zero,
                                 sc.stride()[:3] + (0,), 0, 0, n=self.D, group=f.group, bits=f.bits,
                                 err=errors, tok0=0, token_rows=True, pos=pos)

    def _step_at_kivi(self, x: torch.Tensor, errors: torch.Tensor, pos: torch.Tensor) -> None:
        """KIVI's step at the device position p: the window write at row p - q(p), then the
        flush `_flush_kivi` does, decided on the device (the launches do nothing unless
        this token fills the window): the first P window rows quantized into the groups
        after the q(p) / G held, then rows P .. A+P-1 shifted down. Two launches (the
        paper's keys: the window empties) or three, every step."""
        f, pol = self.flat, self.kivi_policy
        w = self.buffers["residual"].buf
        step_encode.kivi_window(x, w, 0, errors, 0, pos=pos, policy=pol)
        G, P = f.group, pol[1]
        c, sc, z = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        if self.role == "K":  # as `_flush_kivi`: rows channels, blocks groups (one block per group)
            step_encode.int_rows(w, (w.stride(0), w.stride(1), 1, w.stride(2), G * w.stride(2)), self.D, P // G,
                                 c, (c.stride(0), c.stride(1), c.stride(3), c.stride(2)), sc, z,
                                 (sc.stride(0), sc.stride(1), 1, sc.stride(2)), 0, 0, n=G, group=G, bits=f.bits,
                                 err=errors, tok0=0, token_rows=False, pos=pos, flush=(pol, G, 0, 1))
        else:  # rows tokens (G rows per group)
            step_encode.int_rows(w, (w.stride(0), w.stride(1), w.stride(2), 1, 0), P, 1,
                                 c, (c.stride(0), c.stride(1), c.stride(2), 0), sc, z,
                                 (sc.stride(0), sc.stride(1), sc.stride(2), 0), 0, 0, n=self.D, group=G,
                                 bits=f.bits, err=errors, tok0=0, token_rows=False, pos=pos, flush=(pol, G, G, 0))
        step_encode.kivi_shift(w, pos, pol)

    def advance(self, n: int) -> None:
        """Host bookkeeping of n `step_at` steps that ran (tokens, lengths, the flat's T, the
        run `run_segments` turns into a Segment), exactly what `step` keeps per step
        (KIVI: the group count and window length of the token count, the policy's)."""
        end = self.tokens + n
        if end > self.token_capacity:
            raise RuntimeError(f"{n} device steps after {self.tokens} tokens overran the reserved "
                               f"{self.token_capacity}: the store's bytes past it were not written")
        if self.kind is layout.KIVIFlat:
            if self._run_start is None:
                self._run_start = self.flat.n_groups
            ng, n_res = self._kivi_counts(end)
            per = 1 if self.role == "K" else self.flat.group
            for name in ("codes", "scale", "zero"):
                self.buffers[name].length = ng * per
            self.buffers["residual"].length = n_res
            self.flat.n_groups, self.flat.n_res = ng, n_res
            self.tokens = end
            return
        if self._run_start is None:
            self._run_start = self.tokens
        for name in self.TOKEN_FIELDS[self.kind]:
            if name in self.buffers:
                self.buffers[name].length = end
        if self.outliers is not None:  # the blocks the steps opened (their room was reserved)
            self.outlier_index.length = max(self.outlier_index.length, -(-end // OUTLIER_BLOCK))
        self.tokens = self.flat.T = end

    def device_buffers(self) -> list[torch.Tensor]:
        """Every tensor a device-position step writes or reads (a CUDA graph holds them)."""
        out = [b.buf for b in self.buffers.values()]
        if self.outliers is not None:
            out += [self.outliers, self.outlier_len, self.outlier_index.buf]
        return out

    def graph_view(self, capacity: int):
        """What the attention of a device-position step reads: the flat with T = `capacity`,
        the bound the launch grid is cut for (the valid length is a device argument).
        Cached per (flat, capacity): no allocation per step."""
        hit = self._graph_flat
        if hit is not None and self.kind is layout.KIVIFlat and (
                hit[2].codes is not self.flat.codes or hit[2].residual is not self.buffers["residual"].buf):
            hit = None  # (KIVI's flat is updated in place: its buffers are compared too)
        if hit is None or hit[0] is not self.flat or hit[1] != capacity:
            if capacity > self.token_capacity:
                raise ValueError(f"capacity {capacity} beyond the {self.token_capacity} tokens reserved")
            if self.kind is layout.KIVIFlat:  # the counts follow the valid length by the window policy
                from .layout import KIVIGraphFlat

                f = self.flat
                view = KIVIGraphFlat(**{k.name: getattr(f, k.name) for k in dataclasses.fields(layout.KIVIFlat)})
                view.n_res, view.policy, view.capacity = self.buffers["residual"].capacity, self.kivi_policy, capacity
            else:
                view = dataclasses.replace(self.flat, T=capacity)
            hit = self._graph_flat = (self.flat, capacity, view)
        return hit[2]

    @property
    def in_run(self) -> bool:
        return self._run_start is not None

    def run_segments(self, base: list[Segment]) -> list[Segment]:
        """The segments of a Packed holding `base` (the Packed's segments when the run
        began) then the run's writes: exactly the bytes the old path stores for them (one
        segment for the run's tokens; KIVI: one per flushed group and a copy of the
        window). Reads the device (Med3x outlier counts): for when results are read."""
        if self._run_start is None:
            return base
        if self.kind is layout.KIVIFlat:
            return self._run_segments_kivi(base)
        start, t = self._run_start, self.tokens - self._run_start
        if not t:
            return base
        seg = Segment({}, t)
        seg.fields.update(self._segment_views(seg, start))
        if self.outliers is not None:
            seg.fields["outliers"] = self._run_outliers(start)
        self._run_seg = (seg, start)
        return base + [seg]

    def _run_outliers(self, start: int) -> torch.Tensor:
        """The run's Med3x outliers in (b, h, t, chunk) order (a segment's order), from the
        ends of the per-(b, h) lists: each row's count from the run's flags."""
        BH, nc = self.B * self.H, self.D // 4
        flags = self.buffers["flags"].buf[:, :, start : self.tokens]
        per_row = unpack_bits(flags, 1, nc).sum((-1, -2)).flatten()  # [B*H]
        n = int(per_row.sum())
        row = torch.repeat_interleave(torch.arange(BH, device=per_row.device), per_row, output_size=n)
        first = self.outlier_len - per_row  # each row's first outlier of the run
        pos = first[row] + torch.arange(n, device=row.device) - (torch.cumsum(per_row, 0) - per_row)[row]
        return self.outliers.view(BH, -1, 4)[row, pos].clone()

    def _run_segments_kivi(self, base: list[Segment]) -> list[Segment]:
        if base and "residual" in base[-1].fields:
            base = base[:-1]  # the window of the run's start: now in the buffer
        f = self.flat
        per = 1 if self.role == "K" else f.group
        for g in range(self._run_start + len(self._run_groups), f.n_groups):
            seg = Segment({}, f.group)
            seg.fields.update(self._segment_views(seg, g * per))
            self._adopted.append((seg, g * per))  # written once: re-pointed like absorbed segments
            self._run_groups.append(seg)
        out = base + self._run_groups
        n_res = self.buffers["residual"].length
        if n_res:  # rewritten in place by later steps: a copy (a few groups of fp16)
            out = out + [Segment({"residual": self.buffers["residual"].buf[:, :, :n_res].clone()}, n_res)]
        return out

    def end_run(self) -> None:
        """The run's segments (the last `run_segments`) become ordinary absorbed segments;
        the next `step` starts a new run."""
        if self._run_seg is not None:
            self._adopted.append(self._run_seg)
        self._run_start, self._run_seg, self._run_groups = None, None, []

    # ---- what the kernels read ------------------------------------------------------------
    def _refresh_flat(self) -> None:
        kw = {name: self.buffers[name].buf for name in self.TOKEN_FIELDS[self.kind] if name in self.buffers}
        if self.outliers is not None:
            kw.update(outliers=self.outliers, outlier_index=self.outlier_index.buf)
        self.flat = dataclasses.replace(self.flat, T=self.buffers["codes"].length, **kw)

    def kernel_view(self):
        """The `*Flat` the fused kernels read: the capacity buffers themselves, with the
        valid length (the contract in layout.py)."""
        return self.flat

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def stored_nbytes(self) -> int:
        """Valid quantizer bytes held (derived outlier_index excluded): equals the segment
        bytes of the Packed (less any field the quantizer stores that the kernel derives)."""
        n = sum(b.valid.numel() * b.valid.element_size() for k, b in self.buffers.items())
        if self.kind is layout.KIVIFlat:
            per_group = 1 if self.role == "K" else self.flat.group
            n = sum(self._valid_kivi(k, per_group) for k in self.buffers)
        if self.outliers is not None:
            n += self._outlier_total() * 4 * self.outliers.element_size()
        return n

    def _valid_kivi(self, name: str, per_group: int) -> int:
        b = self.buffers[name]
        rows = b.length if name == "residual" else self.flat.n_groups * per_group
        v = b.buf[:, :, :rows]
        return v.numel() * v.element_size()

    def _outlier_total(self) -> int:
        return int(self.outlier_len.sum())  # accounting only: a sync is fine here

    @property
    def allocated_nbytes(self) -> int:
        """Device bytes the store holds: buffers at capacity, outliers, outlier_index."""
        n = sum(b.nbytes for b in self.buffers.values())
        if self.outliers is not None:
            n += self.outliers.numel() * self.outliers.element_size() + self.outlier_index.nbytes
        return n


__all__ = ["KernelStore", "TokenBuffer", "grown_capacity", "MIN_CAPACITY"]
