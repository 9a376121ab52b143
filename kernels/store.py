"""The packed KV store on the model's device, in the layout the fused kernels read.

One `KernelStore` per (layer, role) of a quantized cache. Its buffers are
preallocated along the token axis with a CAPACITY (`[B, H, Tcap, ...]`) that grows
by doubling, so a decode step's append writes in place (amortised O(1)); the
`*Flat` it hands to the kernels (`flat`) carries the buffers and the valid length
(the store <-> kernel contract in kernels/layout.py).

Generic over formats: the cache's format (kernels/registry.py, found through the Flat
type `flatten` returns for the first write) says which Segment fields lie along the
token axis (`Format.token_fields`: codes, scale, zero / codes, radius, r_max, flags /
codes; static parts such as codebook tables and fp8's per-head scale come from the first
write's flatten) and how a one-token write is encoded on the device (`Format.step`). A
format with another append rule brings a subclass (`Format.store`): KIVI's groups and
fp16 window (kernels/formats/kivi.py), HQMQ's Med3x outlier lists (kernels/formats/hqmq.py).
Names with one underscore are this class's and its subclasses'.

What is stored comes from each write's `Segment` fields (the quantizer's bytes), so
`Packed.nbytes` stays the one source of measured bits; `stored_nbytes` (the valid
bytes the store holds, derived kernel-side state excluded) equals the Packed's
segment bytes, which the tests check. To avoid holding every byte twice, the
store re-points the token-axis fields of the segments it has absorbed at views of
its buffers (`adopt`), and re-points them again when a buffer grows.

Decode steps (`step`): a one-token write of a quantizer whose format has a step encoder
(the format's own quantizer class exactly: plugins' subclasses take the old path) is
encoded on the device straight into the buffers at the current length: one launch per
step, no host read. Such writes make no Segment: they form a RUN, and `run_segments`
gives the Segments that hold exactly the bytes the old path would have stored (views of
the buffers), made only when someone reads the Packed. `end_run` turns them into
ordinary absorbed segments (the next old-path write appends after them).

Multi-token writes on the device (`steps`): where the format's step encoder takes t
tokens in one launch and the quantizer fits nothing on its first write
(`Format.multi_step`: fp16, per-token int, KIVI, HQMQ), a fused cache's prefill
is encoded the same way, into a store made before any write (`create_empty`, from the
quantizer's `empty`): its tokens form a run exactly as t steps would, one launch per
(layer, role) instead of the quantizer's torch `append` and the copy into the store.
HQMQ + Med3x too, its median over the write (two launches; kernels/formats/hqmq.py: the
write's segment, whose outlier count only the device knows, is made when read).
KIVI too (`_create_empty`, the store class's hook: groups and a window, two launches, its
window kernel over the write's tokens and its groups straight from x; formats/kivi.py).

Decode steps at a device position (`step_at`, for CUDA graphs; suites/harness/kv_cache.py
`device_steps`): the same encoders write at a position read from a device int32 tensor
and touch no host state; `advance(n)` then does the host bookkeeping `step` does, for
n steps that ran; `reserve` allocates the room up front (a graph holds the buffers'
addresses) and `graph_view` is the flat attention reads, its T the reserved capacity
(the valid length is a device argument); `graph_unsupported` names why not.

Host synchronisation (old path, `append`): none per step (HQMQ + Med3x: see
kernels/formats/hqmq.py). (The quantizers' own encode still synchronises: input
checks, pack range checks and Med3x's boolean-mask indexing.)

(About 600 lines: the one store every format's buffers live in, generic over formats;
the formats' own rules are in kernels/formats/, what stays is growth, rewind, refit,
graph views and the device-position bookkeeping they all share.)
"""
from __future__ import annotations

import dataclasses

import torch

from ..quantizers import Packed, Segment, parse_spec
from ..quantizers.fitted import FitsOnFirstWrite
from . import layout, registry

MIN_CAPACITY = 256  # tokens; small caches would otherwise regrow every few steps


def grown_capacity(need: int, current: int = 0) -> int:
    """Capacity for `need` valid tokens: at least double the current one, a multiple of
    OUTLIER_BLOCK (the kernels tile tokens in 64s)."""
    return layout.whole_blocks(max(need, 2 * current, MIN_CAPACITY))


class TokenBuffer:
    """A `[B, H, cap, *rest]` tensor whose valid prefix `[:, :, :length]` grows in place.

    `write(start, x)` writes x at tokens start.. (growing by doubling if needed) and
    sets the valid length to start + x.shape[2]; `valid` is a view of the prefix."""

    def __init__(self, like: torch.Tensor, capacity: int, zeroed: bool = False):
        shape = like.shape[:2] + (capacity,) + like.shape[3:]
        self.buf = like.new_zeros(shape) if zeroed else like.new_empty(shape)
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


def multi_steps(fmt: registry.Format, quantizer) -> bool:
    """Whether `fmt`'s step encoder takes multi-token writes of this quantizer: its own
    class (`Format.encodes_steps_of`) and `Format.multi_step` saying so for its config."""
    if not fmt.encodes_steps_of(type(quantizer)) or not fmt.multi_step:
        return False
    return bool(fmt.multi_step(quantizer)) if callable(fmt.multi_step) else True


def concat_tokens(segs: list[Segment], name: str) -> torch.Tensor:
    """Field `name` of the segments, concatenated along the token axis."""
    ts = [s.fields[name] for s in segs]
    return torch.cat(ts, dim=2) if len(ts) > 1 else ts[0]


class KernelStore:
    """The device store of one (layer, role). Build it with `KernelStore.create(packed,
    role)` from the first write (None when no fused kernel reads this format, or its
    format has no store), then `append(new_segments, shared_tokens)` after every later
    write. This class keeps the format's `token_fields`; a format's subclass
    (`Format.store`) overrides what its append rule changes, through the hooks below."""

    def __init__(self, flat, packed: Packed, role: str, fmt: registry.Format):
        self.role, self.kind, self.format = role, type(flat), fmt
        self.fields = fmt.token_fields
        self.B, self.H, self.D = packed.batch, packed.heads, packed.head_dim
        # Static parts (tables) from the first write's flatten; buffers are swapped in below.
        self.flat = flat
        # What a piece of the cache needs to be flattened exactly like the whole cache.
        self._meta = (packed.dtype, packed.device, packed.shared, packed.spec)
        self.tokens = 0
        self._adopted: list[tuple[Segment, int]] = []  # (segment, first row) whose fields view our buffers
        self.buffers: dict[str, TokenBuffer] = {}
        self.capacity_hint = 0  # tokens to allocate for at the first write (e.g. prompt + new tokens)
        self.stepper = None  # the quantizer (its format's own class) when `step` can encode its writes
        # The current run of `step` writes: where it began (tokens; KIVI: groups) and the
        # last Segment made for it (with its first row).
        self._run_start: int | None = None
        self._run_seg: tuple[Segment, int] | None = None
        self._graph_flat = None  # (flat, capacity, flat with T = capacity): `graph_view`'s cache

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def create(cls, packed: Packed, role: str, capacity: int | None = None, table=None,
               step: bool = True) -> "KernelStore | None":
        """`table`: the codeword source a format's kernel gathers from, handed to its
        `configure` (HQMQ: (table_mode, dtype), `HQMQFlat.with_table`); None keeps
        flatten's default. `step`: encode decode steps on the device (`step`) where the
        format has a step encoder for this quantizer."""
        try:
            flat = layout.flatten(packed, role)
        except (ValueError, TypeError, NotImplementedError):
            return None  # no fused kernel reads this format (the dense path serves it)
        fmt = registry.format_of_flat(type(flat))
        if fmt is None or not fmt.stores:
            return None
        if table is not None and fmt.configure is not None:
            flat = fmt.configure(flat, table=table)
        store = (fmt.store or KernelStore)(flat, packed, role, fmt)
        store.capacity_hint = capacity or 0
        store.append(packed.segments, 0)
        q_cls, cfg = parse_spec(packed.spec)
        if step and fmt.encodes_steps_of(q_cls):
            store.stepper = q_cls(cfg, role=role)
            store._steps_begin()
        return store

    @classmethod
    def create_empty(cls, packed: Packed, role: str, tokens: int, capacity: int | None = None,
                     table=None) -> "KernelStore | None":
        """A store holding no tokens yet, whose writes are all encoded on the device: from
        `packed`, a quantizer's `empty(x)` (its shared tensors, no segment), with room for
        the `tokens` of the first write (`steps`) or the capacity hint if larger. None
        unless the format's step encoder takes multi-token writes of this quantizer
        (`Format.multi_step`) and a fused kernel reads it. The static parts of the flat
        (tables) come from flattening a zero-token segment of the quantizer's layout
        (`Quantizer.segment_layout`, learnt once per process and shape)."""
        if packed.segments:
            raise ValueError("create_empty takes a Packed without segments (Quantizer.empty)")
        q_cls, cfg = parse_spec(packed.spec)
        fmt = registry.format_of_quantizer(q_cls)
        if fmt is None or not fmt.stores:
            return None
        stepper = q_cls(cfg, role=role)
        if not multi_steps(fmt, stepper):
            return None
        own = (fmt.store or KernelStore)._create_empty(packed, role, fmt, stepper, tokens, capacity, table)
        if own is not NotImplemented:
            return own
        made = cls._zero_flat(packed, role, fmt, stepper)
        if made is None:
            return None
        flat, zero = made
        if table is not None and fmt.configure is not None:
            flat = fmt.configure(flat, table=table)
        store = (fmt.store or KernelStore)(flat, packed, role, fmt)
        store.capacity_hint = capacity or 0
        for name in store.fields:  # zeroed: a launch that did not run (a cost-counting
            if name in zero.fields:  # `launch_hook`) leaves finite bytes, not garbage
                store._buffer(name, zero.fields[name], tokens, zeroed=True)
        store._refresh_flat()
        store.stepper = stepper
        store._steps_begin()
        return store

    @staticmethod
    def _zero_flat(packed: Packed, role: str, fmt: registry.Format, stepper):
        """(the flat of `packed` holding a zero-token segment of the stepper's one-token
        layout, that segment), or None where the layout has a field not along the tokens, of
        data-dependent length, or flattens to another format."""
        B, H, D = packed.batch, packed.heads, packed.head_dim
        try:
            fields, variable = stepper.segment_layout((B, H, 1, D))
        except (ValueError, TypeError, RuntimeError):
            return None
        if fields is None or variable or not all(
                len(shape) >= 3 and tuple(shape[:3]) == (B, H, 1) and name in fmt.token_fields
                for name, (shape, _) in fields.items()):
            return None  # a field not along the tokens (or of data-dependent length)
        zero = Segment({name: torch.empty((B, H, 0) + tuple(shape[3:]), dtype=dtype, device=packed.device)
                        for name, (shape, dtype) in fields.items()}, 0)
        try:
            flat = layout.flatten(dataclasses.replace(packed, segments=[zero]), role)
        except (ValueError, TypeError, NotImplementedError):
            return None
        return (flat, zero) if registry.format_of_flat(type(flat)) is fmt else None

    @classmethod
    def _create_empty(cls, packed: Packed, role: str, fmt: registry.Format, stepper, tokens: int,
                      capacity: int | None, table=None):
        """Hook: a store class whose empty store is not made from the quantizer's one-token
        segment layout (KIVI: groups of G tokens and an fp16 window) makes it here (None:
        it cannot, the old path serves the write); NotImplemented: `create_empty`'s way."""
        return NotImplemented

    def _steps_begin(self) -> None:
        """Hook: the stepper was just set (before the first step)."""

    # ---- appends ----------------------------------------------------------------------
    def append(self, new: list[Segment], shared_tokens: int) -> None:
        """Absorb the segments a write added; `shared_tokens` is the number of tokens
        of the previous write's segments the new Packed still shares (KIVI drops its
        trailing fp16 window segment on every write)."""
        if not new:
            return
        if shared_tokens != self.tokens:
            raise ValueError(f"append after {shared_tokens} shared tokens to a store of {self.tokens}")
        self._append_tokens(new)
        self.tokens = shared_tokens + sum(s.tokens for s in new)

    def _buffer(self, name: str, like: torch.Tensor, need: int, unit: int = 1, hinted: bool = True,
                zeroed: bool = False) -> TokenBuffer:
        """The buffer `name`, created for `need` rows of axis 2 (each `unit` tokens), or
        for the capacity hint if larger (`hinted`); `zeroed`: filled with zeros."""
        if name not in self.buffers:
            cap = -(-grown_capacity(max(need * unit, self.capacity_hint if hinted else 0)) // unit)
            self.buffers[name] = TokenBuffer(like, cap, zeroed)
        return self.buffers[name]

    def _append_tokens(self, new: list[Segment]) -> None:
        t0, t = self.tokens, sum(s.tokens for s in new)
        grew = False
        for name in self.fields:
            if name not in new[0].fields:
                continue
            buf = self._buffer(name, new[0].fields[name], t0 + t)
            grew |= buf.write(t0, concat_tokens(new, name))
        self._append_more(new, t0, t)
        starts, t = [], t0
        for seg in new:
            starts.append((seg, t))
            t += seg.tokens
        self._adopt(starts, grew)
        self._refresh_flat()

    def _append_more(self, new: list[Segment], t0: int, t: int) -> None:
        """Hook: what a write stores beside the token fields (Med3x's outlier lists)."""

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
        return {n: b[n].buf[:, :, start : start + seg.tokens] for n in self.fields
                if n in b and (n in seg.fields or not seg.fields)}

    # ---- decode steps encoded on the device ----------------------------------------------
    def step(self, x: torch.Tensor, errors: torch.Tensor) -> bool:
        """Encode the one-token write x `[B, H, 1, D]` (checked by the caller: this
        store's B, H, D, dtype and device) straight into the buffers; False (nothing
        done) when no step encoder serves it, and the caller takes the old path. Input
        errors raise `errors` (a `StepErrors` row) on the device instead of an exception."""
        if self.stepper is None or x.shape[2] != 1:
            return False
        self._encode_run(x, errors)
        return True

    @property
    def multi_steps(self) -> bool:
        """Whether `steps` takes multi-token writes (the format's step encoder does, for
        this stepper: `Format.multi_step`)."""
        return self.stepper is not None and multi_steps(self.format, self.stepper)

    def steps(self, x: torch.Tensor, errors: torch.Tensor) -> bool:
        """Encode the write x `[B, H, t, D]` (checked by the caller, as for `step`) on the
        device in one launch, exactly as t one-token `step`s would: into the buffers at
        the current length, as part of the current run (`run_segments` gives its bytes).
        False (nothing done) when the format's encoder takes no multi-token write here."""
        if not self.multi_steps or x.shape[2] < 1:
            return False
        self._encode_run(x, errors)
        return True

    # A multi-token write whose segment needs a device read to be made (HQMQ + Med3x: its
    # outlier count) sets this: the caller keeps the run open (no host read at the write),
    # the segment comes from `run_segments` when the cache is read (kv_cache `_device_write`)
    segment_on_read = False

    def _encode_run(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        """x's tokens into the buffers as part of the current run (opened here if none is)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        self._open_run()  # (KIVI's multi-token `_step` takes no begin_write)
        self._step(x, errors)

    def _run_position(self) -> int:
        """Where a run of steps starts on axis 2 of the buffers (tokens; KIVI: groups)."""
        return self.tokens

    def _open_run(self) -> None:
        """Open a run of device writes here unless one is open."""
        if self._run_start is None:
            self._run_start = self._run_position()

    def _step(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        """x's tokens (one; `steps`: t) into the buffers at the current length."""
        t0, extra = self.begin_write(x.shape[2])
        self.format.step(self, x, errors, t0, **extra)
        self.end_write(t0 + x.shape[2])

    def begin_write(self, t: int) -> tuple[int, dict]:
        """Room for a host-position write of t tokens encoded on the device, made before its
        launch: (the first token t0, the keyword arguments of the format's step encoder);
        `end_write(t0 + t)` after the launch. `step` does both around the format's encoder;
        kernels/cuda/step_write.py around one launch for a layer's K and V stores."""
        self._open_run()  # (the write is part of the current run)
        t0 = self.tokens
        end = t0 + t
        grew = False
        for name in self.fields:
            if name in self.buffers:
                grew |= self.buffers[name].extend(end)
        moved, extra = self._step_room(t0, t)
        if grew:
            self._repoint()
        elif moved:  # no segment views these: the flat alone
            self._refresh_flat()
        return t0, extra

    def end_write(self, end: int, errors: torch.Tensor | None = None) -> None:
        """The host bookkeeping of a write that `begin_write` made room for, now `end` tokens
        (errors: the role's flag row, for a store whose bookkeeping launches: KIVI's flush)."""
        for name in self.fields:
            if name in self.buffers:
                self.buffers[name].length = end
        self.tokens = self.flat.T = end  # the flat is the store's live view: its length grows in place

    def _step_room(self, t0: int, t: int = 1) -> tuple[bool, dict]:
        """Hook before a host-position write of t tokens (a step: one) at token t0: (whether
        a side buffer moved, the keyword arguments the format's step encoder takes beside
        the token)."""
        return False, {}

    def _repoint(self) -> None:
        """After a reallocation: segments and the flat onto the new buffers."""
        self._adopt([], True)
        self._refresh_flat()

    # ---- decode steps at a device position (CUDA graphs) ----------------------------------------
    def graph_unsupported(self) -> str | None:
        """Why `step_at` cannot serve this store's decode steps (None: it can)."""
        if self.stepper is None:
            return ("no device step encoder for this quantizer (its format has none, it subclasses the "
                    "format's quantizer, or step_encode=False)")
        return None

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` valid tokens in every token buffer, allocated now: steps at a
        device position must never move a buffer (a CUDA graph holds their addresses)."""
        grew = False
        for name in self.fields:
            if name in self.buffers:
                grew |= self.buffers[name].extend(tokens)
        moved = self._reserve_more(tokens)
        if grew:
            self._repoint()
        elif moved:
            self._refresh_flat()

    def _reserve_more(self, tokens: int) -> bool:
        """Hook: room in the side buffers for `tokens` tokens; True when one moved."""
        return False

    @property
    def token_capacity(self) -> int:
        """Tokens the token buffers hold without growing."""
        return min(self.buffers[n].capacity for n in self.fields if n in self.buffers)

    def step_at(self, x: torch.Tensor, errors: torch.Tensor, pos: torch.Tensor) -> None:
        """Encode the one-token write x `[B, H, 1, D]` (checked by the caller, as for
        `step`) at the device position `pos` (int32, its first element: tokens stored
        before it; the kernel reads it, the host does not), touching no host state: the
        caller accounts for the steps that ran with `advance` (the host knows how many it
        replayed) and must have `reserve`d room (`graph_unsupported` must be None)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        self.format.step(self, x, errors, 0, pos=pos)

    def advance(self, n: int) -> None:
        """Host bookkeeping of n `step_at` steps that ran (tokens, lengths, the flat's T, the
        run `run_segments` turns into a Segment), exactly what `step` keeps per step."""
        end = self.tokens + n
        if end > self.token_capacity:
            raise RuntimeError(f"{n} device steps after {self.tokens} tokens overran the reserved "
                               f"{self.token_capacity}: the store's bytes past it were not written")
        self._advance(end)

    def _advance(self, end: int) -> None:
        self._open_run()
        for name in self.fields:
            if name in self.buffers:
                self.buffers[name].length = end
        self.tokens = self.flat.T = end

    def device_buffers(self) -> list[torch.Tensor]:
        """Every tensor a device-position step writes or reads (a CUDA graph holds them)."""
        return [b.buf for b in self.buffers.values()]

    def graph_view(self, capacity: int):
        """What the attention of a device-position step reads: the flat with T = `capacity`,
        the bound the launch grid is cut for (the valid length is a device argument).
        Cached per (flat, capacity): no allocation per step."""
        hit = self._graph_flat
        if hit is not None and self._graph_stale(hit[2]):
            hit = None
        if hit is None or hit[0] is not self.flat or hit[1] != capacity:
            if capacity > self.token_capacity:
                raise ValueError(f"capacity {capacity} beyond the {self.token_capacity} tokens reserved")
            hit = self._graph_flat = (self.flat, capacity, self._graph_flat_of(capacity))
        return hit[2]

    def _graph_stale(self, view) -> bool:
        """Hook: whether a cached graph view no longer reads the store's buffers."""
        return False

    def _graph_flat_of(self, capacity: int):
        return dataclasses.replace(self.flat, T=capacity)

    @property
    def in_run(self) -> bool:
        return self._run_start is not None

    # ---- reuse (an engine's preallocated pool) -----------------------------------------
    @property
    def can_rewind(self) -> bool:
        """Whether `rewind` may serve: multi-token writes go through the step encoder (a
        new prefill rewrites the buffers in place), the flat's static parts hold model
        constants only or what the next first write refits in place (fp8's scale,
        `refit`), and the store keeps no side state (`_rewind_more`)."""
        shared = self._meta[2]
        const = not shared or getattr(self.stepper, "shared_is_constant", False) or self.refits
        return self.multi_steps and const and self._rewind_more(check=True)

    @property
    def refits(self) -> bool:
        """Whether the flat's static parts are what the stepper fits on a first write
        (fp8's scale: `FitsOnFirstWrite`), which `refit` redoes in place after a rewind."""
        return isinstance(self.stepper, FitsOnFirstWrite)

    def refit(self, packed: Packed) -> Packed:
        """After a rewind, the first write's fit (`packed`: the stepper's `empty_for` of that
        write) into the flat's static tensors IN PLACE (a captured graph and the kernels'
        plans read these buffers); returns `packed`, the layer's new (empty) Packed."""
        if not self.refits or self.tokens:
            raise RuntimeError(f"refit of a store holding {self.tokens} tokens (refits: {self.refits}): only a "
                               "rewound store whose stepper fits on its first write refits")
        made = self._zero_flat(packed, self.role, self.format, self.stepper)
        if made is None:
            raise RuntimeError(f"refit: {packed.spec} no longer flattens from its one-token layout")
        new = made[0]
        for f in dataclasses.fields(self.flat):
            old_t, new_t = getattr(self.flat, f.name), getattr(new, f.name)
            if f.name in self.fields or not isinstance(old_t, torch.Tensor):
                continue
            if old_t.shape != new_t.shape or old_t.dtype != new_t.dtype:
                raise RuntimeError(f"refit: the flat's {f.name} changed layout ({tuple(old_t.shape)} {old_t.dtype} -> "
                                   f"{tuple(new_t.shape)} {new_t.dtype}); make a new cache")
            old_t.copy_(new_t)
        self._meta = (packed.dtype, packed.device, packed.shared, packed.spec)
        return packed

    def rewind(self) -> None:
        """Forget every token and keep every buffer where it is, so a CUDA graph captured
        over them replays on the next tokens (`QuantizedCache.rewind`). Segments of
        earlier Packeds that view the buffers see the new bytes: they are the old cache's."""
        if not self.can_rewind:
            raise RuntimeError(f"{type(self).__name__} of {self.kind.__name__} cannot rewind")
        self._rewind_more(check=False)
        for b in self.buffers.values():
            b.length = 0
        self.tokens = 0
        self._empty_flat()
        self._adopted.clear()
        self._run_start, self._run_seg = None, None

    def _rewind_more(self, check: bool) -> bool:
        """Hook: whether this store can forget its side state (check=True), or forget it
        (check=False). A format's store subclass rewinds only where it says so."""
        return type(self) is KernelStore

    def _empty_flat(self) -> None:
        """Hook of `rewind`: the flat (the store's live view) holding no token."""
        self.flat.T = 0

    def run_segments(self, base: list[Segment]) -> list[Segment]:
        """The segments of a Packed holding `base` (the Packed's segments when the run
        began) then the run's writes: exactly the bytes the old path stores for them (one
        segment for the run's tokens). May read the device: for when results are read."""
        if self._run_start is None:
            return base
        start, t = self._run_start, self.tokens - self._run_start
        if not t:
            return base
        seg = Segment({}, t)
        seg.fields.update(self._segment_views(seg, start))
        self._run_more(seg, start)
        self._run_seg = (seg, start)
        return base + [seg]

    def _run_more(self, seg: Segment, start: int) -> None:
        """Hook: the run's fields beside the token fields (Med3x's outliers)."""

    def run_nbytes(self) -> tuple[int, torch.Tensor | None] | None:
        """The bytes `run_segments` adds to its base, without making its segments: (host
        bytes, a device scalar of bytes more or None); None where only the segments can
        say (the caller makes them). A size count pools the device parts of every store
        into one host read (`QuantizedCache.cache_nbytes`). Here: None; formats whose
        segments cost device work to make (Med3x's outlier lists) count them instead."""
        return None

    def run_numel(self) -> int | None:
        """The elements `run_segments` adds to its base, without making its segments; None
        where only the segments can say (as `run_nbytes`)."""
        return None

    def end_run(self) -> None:
        """The run's segments (the last `run_segments`) become ordinary absorbed segments;
        the next `step` starts a new run."""
        if self._run_seg is not None:
            self._adopted.append(self._run_seg)
        self._run_start, self._run_seg = None, None

    # ---- what the kernels read ------------------------------------------------------------
    def _refresh_flat(self) -> None:
        kw = {name: self.buffers[name].buf for name in self.fields if name in self.buffers}
        kw.update(self._flat_more())
        self.flat = dataclasses.replace(self.flat, T=self.buffers[self.fields[0]].length, **kw)

    def _flat_more(self) -> dict:
        """Hook: the flat's fields beside the token buffers (Med3x's outlier lists)."""
        return {}

    def kernel_view(self):
        """The `*Flat` the fused kernels read: the capacity buffers themselves, with the
        valid length (the contract in layout.py)."""
        return self.flat

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def stored_nbytes(self) -> int:
        """Valid quantizer bytes held (derived kernel-side state excluded): equals the
        segment bytes of the Packed (less any field the quantizer stores that the kernel
        derives)."""
        return sum(b.valid.numel() * b.valid.element_size() for b in self.buffers.values())

    @property
    def allocated_nbytes(self) -> int:
        """Device bytes the store holds: its buffers at capacity."""
        return sum(b.nbytes for b in self.buffers.values())


__all__ = ["KernelStore", "TokenBuffer", "concat_tokens", "grown_capacity", "multi_steps", "MIN_CAPACITY"]
