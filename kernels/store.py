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

Host synchronisation: none per step for int, fp8 and KIVI. HQMQ + Med3x needs the largest
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

from ..quantizers import Packed, Segment
from ..quantizers.packing import unpack_bits
from . import layout

OUTLIER_BLOCK = layout.OUTLIER_BLOCK
MIN_CAPACITY = 256  # tokens; small caches would otherwise regrow every few steps


def grown_capacity(need: int, current: int = 0) -> int:
    """Capacity for `need` valid tokens: at least double the current one, a multiple of
    OUTLIER_BLOCK (the kernels tile tokens in 64s)."""
    cap = max(need, 2 * current, MIN_CAPACITY)
    return -(-cap // OUTLIER_BLOCK) * OUTLIER_BLOCK


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

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def create(cls, packed: Packed, role: str, capacity: int | None = None,
               hqmq_table: tuple[str, torch.dtype] | None = None) -> "KernelStore | None":
        """`hqmq_table`: (table_mode, dtype) of the HQMQ codeword source the kernel gathers
        from (`HQMQFlat.with_table`); None keeps layout's default (exact fp32 secondaries)."""
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
        for seg, start in (self._adopted if grew else new):
            for name, view in self._segment_views(seg, start).items():
                old = seg.fields.get(name)
                if old is not None and old.shape == view.shape and old.dtype == view.dtype:
                    seg.fields[name] = view

    def _segment_views(self, seg: Segment, start: int) -> dict[str, torch.Tensor]:
        b = self.buffers
        if self.kind is not layout.KIVIFlat:
            return {n: b[n].buf[:, :, start : start + seg.tokens] for n in self.TOKEN_FIELDS[self.kind]
                    if n in seg.fields and n in b}
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
            self.outliers = vals.new_zeros(B, H, max(OUTLIER_BLOCK, 2 * n // max(1, B * H)), 4)
            self.outlier_index = TokenBuffer(torch.zeros(B, H, 1, dtype=torch.int32, device=vals.device),
                                             grown_capacity(t) // OUTLIER_BLOCK)
        ocap = self.outliers.shape[2]
        if self._outlier_bound + n > ocap:  # might overflow: look at the real counts (a sync)
            self._outlier_bound = int(self.outlier_len.max())
            if self._outlier_bound + n > ocap:
                grown = self.outliers.new_zeros(B, H, max(2 * ocap, self._outlier_bound + n), 4)
                grown[:, :, :ocap] = self.outliers
                self.outliers = grown
                ocap = grown.shape[2]
        self._outlier_bound += n
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
            residual=self.buffers["residual"].valid)

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
