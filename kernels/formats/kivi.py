"""The KIVI format (keys per channel over G-token groups, values per-token groups, an fp16
window): `KIVIFlat` and its graph view `KIVIGraphFlat` (kernels/layout.py), its flatten,
its store (`KIVIStore`), its device step encoder (`encode_step`), its kernels (Triton,
kernels/triton/kivi.py; CUDA KIVI-2/4 g32 d64/128/256, kernels/cuda/decode_attention.py, host
counts only: no valid_len).

The store: the new segments of a write are flattened by `flatten_kivi` (so the KIVI
layout has one definition) and their quantized groups appended; the fp16 window is
replaced by the write's window (its buffer is sized for the window, not for the capacity
hint). KIVI's quantized segments are re-pointed at the buffers too; its window segment (a
few groups of fp16) keeps its own bytes. A decode step writes the token into the window
(kernels/step_encode.py's `kivi_window`), and when the token fills it one int launch
quantizes the window's first P tokens into the groups and one shift keeps the rest (every
G or R steps); its run's Segments are one per flushed group and a copy of the window.

At a device position (CUDA graphs) the group count and window length are functions of
the token count by the window policy (`kivi_policy`: max(0, t - A) // P * P tokens
quantized, the window fills at A + P, a flush quantizes P and keeps A), so the device
token count at `pos` is the one device state: the window write goes to row p - q(p), the
flush (`int_rows` with `flush=`) and the shift (`kivi_shift`) launch every step and do
nothing unless the token fills the window, and the attention derives each side's counts
from the valid length the same way (`KIVIGraphFlat`, `graph_view`). `reserve` sizes the
group buffers for the capacity and the window for A + P rows; `advance` sets n_groups,
the window length and the buffers' lengths from the host's token count (no device read).

A multi-token write of a fused cache (a prefill, a later chunk: `Format.multi_step`,
`KernelStore.create_empty` / `steps`, `KIVIStore._step_tokens`) is encoded on the device
too, storing what t one-token steps (and the old path's `append_windowed`) store: a
prefill of T tokens quantizes its first q(T) tokens in whole groups straight from x
rounded to fp16 (one `int_rows` launch with `half`, none when q(T) = 0) and one window
launch checks all T tokens and stores the last T - q(T) as the window: two launches per
(layer, role), no host read, in place of the quantizer's torch `append` (a launch or
more per group, host reads) and the store's copy; its groups' Segments are views made
in one op per field (`_group_views`). A later chunk takes up to four launches (the
window's last group completed from x, the window's groups, x's groups, the new window;
or a flush of the window alone, then the chunk into the window).

(About 530 lines: one format's file, as kernels/FORMATS.md asks: its Flat, store, window
policy and device step encoders; KIVI's fp16 window makes each of them longer than the
other formats'.)
"""
from __future__ import annotations

import dataclasses

import torch

from ...quantizers import Packed, Segment, parse_spec
from ...quantizers.kivi import KIVI
from ...quantizers.packing import packed_nbytes
from .. import step_encode
from ..cuda import decode_attention as cuda_decode
from ..layout import KIVIFlat, KIVIGraphFlat
from ..registry import Format, Kernel
from ..store import KernelStore
from ..triton.kivi import kivi_decode_attention


def flatten_kivi(packed: Packed, role: str | None = "K") -> KIVIFlat:
    cls, cfg = parse_spec(packed.spec)
    if not issubclass(cls, KIVI):
        raise ValueError(f"flatten_kivi needs a kivi cache, got {packed.spec!r}")
    role = role or "K"
    if role not in ("K", "V"):
        raise ValueError(f"role must be K or V, got {role!r}")
    B, H, D = packed.batch, packed.heads, packed.head_dim
    quant = [s for s in packed.segments if "residual" not in s.fields]
    res = [s for s in packed.segments if "residual" in s.fields]
    if len(res) > 1 or (res and packed.segments[-1] is not res[0]):
        raise ValueError("KIVI cache must hold its fp16 window last, once")
    residual = (res[0].fields["residual"] if res else
                torch.zeros(B, H, 0, D, dtype=torch.float16, device=packed.device)).contiguous()
    ng = len(quant)
    codes = scale = zero = None
    if ng:
        join = torch.stack if role == "K" else torch.cat

        def field(name):
            ts = [s.fields[name] for s in quant]
            if role == "K" and name != "codes":
                ts = [t.squeeze(-1) for t in ts]
            return join(ts, dim=2).contiguous()

        codes, scale, zero = field("codes"), field("scale"), field("zero")
    return KIVIFlat(B=B, H=H, D=D, bits=cfg.bits, group=cfg.group, role=role, n_groups=ng,
                    codes=codes, scale=scale, zero=zero, residual=residual, dtype=packed.dtype)


def kivi_policy(q) -> tuple[int, int] | None:
    """(A, P) with `q.quantized_tokens(t) == max(0, t - A) // P * P` for a KIVI quantizer q:
    its window holds t - that many tokens, fills at A + P, and a flush quantizes P (whole
    groups) and keeps A. Keys of the paper's window: (0, R rounded up to groups); values and
    the fixed window: (R, G). Checked against `quantized_tokens` over several periods; None
    when it does not fit (a changed policy: device steps then refuse the format)."""
    key = (type(q), q.spec, q.role)
    if "quantized_tokens" in vars(q):  # an instance's own policy: checked, never remembered
        return _checked_policy(q)
    # The check runs ~600 calls of quantized_tokens: once per format and role, not per store
    # (per store, a generate call at 2 layers made 9252 of them on the CPU; at 30 layers it is
    # the suspected cause of KIVI's extra ~0.18 s per call on the H200, 2026-12-05, not yet
    # re-measured)
    if key not in KNOWN_POLICIES:
        KNOWN_POLICIES[key] = _checked_policy(q)
    return KNOWN_POLICIES[key]


KNOWN_POLICIES: dict = {}  # (quantizer class, spec, role) -> kivi_policy's answer


def _checked_policy(q) -> tuple[int, int] | None:
    c = q.config
    if c.window == "paper" and q.role == "K":
        a, p = 0, -(-max(c.residual, 1) // c.group) * c.group
    else:
        a, p = c.residual, c.group
    if p % c.group or any(q.quantized_tokens(t) != max(0, t - a) // p * p for t in range(4 * (a + p) + 2)):
        return None
    return a, p


def encode_step(store: "KIVIStore", x: torch.Tensor, errors: torch.Tensor, t0: int, pos=None) -> None:
    """KIVI's one-token write on the device: the window row, then the flush and the shift
    when the token fills the window (at the host position the store's counts decide and
    advance; at a device position `pos` the kernels decide from it, see the module
    docstring). A write of t tokens `[B, H, t, D]` (a prefill, a later chunk; host
    position only): `KIVIStore._step_tokens`, a few launches."""
    if pos is not None:
        store._step_window_at(x, errors, pos)
    elif x.shape[2] == 1:
        store._step_window(x, errors)
    else:
        store._step_tokens(x, errors)


class KIVIStore(KernelStore):
    """Quantized groups in growable buffers (K: one row of axis 2 per group; V: one per
    token) and the fp16 window (module docstring)."""

    def __init__(self, flat, packed: Packed, role: str, fmt):
        super().__init__(dataclasses.replace(flat, n_groups=0), packed, role, fmt)
        self._run_groups: list[Segment] = []  # the current run's flushed groups' Segments

    @classmethod
    def _create_empty(cls, packed: Packed, role: str, fmt, stepper, tokens: int, capacity: int | None,
                      table=None) -> "KIVIStore | None":
        """`KernelStore.create_empty` of KIVI: no group and an empty fp16 window, the window
        buffer sized for the window the first write of `tokens` tokens leaves (as the old
        path's `append` sizes it), zeroed (a cost-counting `launch_hook` leaves finite
        bytes); the group buffers come with the first group. None (the old path) where the
        window policy is not `kivi_policy`'s or the values' groups of G channels do not
        divide the head dim (the quantizer's own error, from its own write)."""
        if kivi_policy(stepper) is None or (role == "V" and packed.head_dim % stepper.config.group):
            return None
        store = cls(flatten_kivi(packed, role), packed, role, fmt)
        store.capacity_hint = capacity or 0
        res = store._buffer("residual", store.flat.residual, max(tokens - stepper.quantized_tokens(tokens), 1),
                            hinted=False, zeroed=True)
        store.flat.residual, store.flat.n_res = res.buf, 0
        store.stepper = stepper
        store._steps_begin()
        return store

    def append(self, new: list[Segment], shared_tokens: int) -> None:
        if not new:
            return
        self._append_kivi(new, shared_tokens)
        self.tokens = shared_tokens + sum(s.tokens for s in new)

    def _append_kivi(self, new: list[Segment], shared_tokens: int) -> None:
        f = self.flat
        if shared_tokens != f.n_groups * f.group:
            raise ValueError(f"KIVI append shares {shared_tokens} tokens, the store holds "
                             f"{f.n_groups} groups of {f.group}")
        dtype, device, shared, spec = self._meta
        piece = self.format.flatten(Packed(self.B, self.H, self.D, dtype, device, new, shared, spec), self.role)
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

    def _segment_views(self, seg: Segment, start: int) -> dict[str, torch.Tensor]:
        b = self.buffers
        if self.role == "K":  # one group per row: codes [B,H,D,GB], scale/zero [B,H,D,1]
            return {n: b[n].buf[:, :, start] if n == "codes" else b[n].buf[:, :, start].unsqueeze(-1)
                    for n in ("codes", "scale", "zero")}
        return {n: b[n].buf[:, :, start : start + seg.tokens] for n in ("codes", "scale", "zero")}

    # ---- decode steps ------------------------------------------------------------------
    def _run_position(self) -> int:
        return self.flat.n_groups

    def _step(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        self.format.step(self, x, errors, self.tokens)

    def _step_window(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        n, _ = self.begin_write(1)
        step_encode.kivi_window(x, self.buffers["residual"].buf, n, errors, self.tokens)
        self.end_write(self.tokens + 1, errors)

    def begin_write(self, t: int) -> tuple[int, dict]:
        """A one-token window step's room (KernelStore.begin_write's contract): the window
        row it is written at (the token is `tokens`); `end_write` then flushes if it filled
        the window. (kernels/cuda/step_write.py writes both roles' rows in one launch.)"""
        if t != 1:
            raise ValueError("a KIVI window step writes one token (more: _step_tokens)")
        self._open_run()
        res = self.buffers["residual"]
        n = res.length
        res.extend(n + 1)
        return n, {}

    def end_write(self, end: int, errors: torch.Tensor | None = None) -> None:
        """After the window row's launch: the flush (and shift) when the token filled the
        window, the flat's window and the token count (`end`: tokens + 1)."""
        f, res = self.flat, self.buffers["residual"]
        res.length += 1
        done = f.n_groups * f.group
        flush = self.stepper.quantized_tokens(done + res.length) - done
        if flush:
            self._flush(flush, errors)
        f.residual, f.n_res = res.buf, res.length
        self.tokens = end

    def _flush(self, n: int, errors: torch.Tensor) -> None:
        """Quantize the window's first n tokens (whole groups) as KIVI's `append_windowed`
        does, into the group buffers, and shift the rest of the window down."""
        f, res = self.flat, self.buffers["residual"]
        G, ng, new = f.group, f.n_groups, n // f.group
        w, D = res.buf, self.D
        key = self.role == "K"
        per = 1 if key else G  # rows of axis 2 per group
        self._group_buffers((ng + new) * per)
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

    @property
    def multi_steps(self) -> bool:
        # (a store the old path made: values whose channel groups do not divide the head
        # dim keep the quantizer's own write, which names the problem)
        return super().multi_steps and not (self.role == "V" and self.D % self.flat.group)

    def _step_tokens(self, x: torch.Tensor, errors: torch.Tensor) -> None:
        """A write of t tokens at the host position, exactly what t `_step_window`s store
        (and the old path's `append_windowed`): of the window's W rows then x's tokens, the
        first n = q(total) - (quantized so far) are quantized in whole groups, the rest
        become the window. No host read (n, W from the host's counts).
        - n <= W (the window alone fills the new groups, or none is due: a chunk while the
          values' window holds R tokens): `_flush` of n rows (an int launch and a shift,
          2 torch ops), then x's tokens appended to the window (one window launch);
        - n > W (a prefill: W = 0): x's first s tokens complete the window's last group
          (a window launch, none when W is whole groups), the window's rows are quantized
          (an int launch, none when W = 0), x's next n - W - s tokens straight from x
          rounded to fp16 (an int launch, `int_rows` with `half`), and a window launch
          writes x's remaining tokens at row 0, checking the skipped ones: a prefill is two
          launches (one without a group), a chunk up to four.
        The window kernel checks every token of x (NaN/Inf, fp16 range) and flags the
        first bad one; the int launches of x add only a group's step overflow."""
        f, res = self.flat, self.buffers["residual"]
        G, t, W, ng = f.group, x.shape[2], res.length, f.n_groups
        done, tok = ng * G, self.tokens
        n = self.stepper.quantized_tokens(done + W + t) - done
        if n <= W:
            if n:
                self._flush(n, errors)
            w0 = res.length
            res.extend(w0 + t)
            step_encode.kivi_window(x, res.buf, w0, errors, tok)
            res.length = w0 + t
        else:
            up = -(-W // G) * G  # the window's rows, completed to whole groups by x's first s tokens
            s, direct = up - W, n - up  # x's tokens s .. s + direct: whole groups straight from x
            res.extend(max(up, t - s - direct, 1))
            if s:
                step_encode.kivi_window(x[:, :, :s], res.buf, W, errors, tok)
            grew = self._group_room(ng + n // G)
            if up:
                self._quantize(res.buf, ng, up, errors, tok - W)
            if direct:
                self._quantize(x[:, :, s:] if s else x, ng + up // G, direct, errors, tok + s)
            if t > s:
                step_encode.kivi_window(x[:, :, s:] if s else x, res.buf, 0, errors, tok + s, skip=direct)
            res.length = t - s - direct
            f.n_groups = ng + n // G
            if grew:
                self._adopt([], True)
        f.residual, f.n_res = res.buf, res.length
        self.tokens += t

    def _group_room(self, groups: int) -> bool:
        """The group buffers sized for `groups` groups (made zeroed if absent), their
        lengths set to it and the flat pointed at them; True when one was reallocated."""
        per = 1 if self.role == "K" else self.flat.group
        self._group_buffers(groups * per, zeroed=True)
        grew = False
        for name in ("codes", "scale", "zero"):
            grew |= self.buffers[name].extend(groups * per)
            self.buffers[name].length = groups * per
        f = self.flat
        f.codes, f.scale, f.zero = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        return grew

    def _quantize(self, src: torch.Tensor, g0: int, n: int, errors: torch.Tensor, tok0: int) -> None:
        """`int_rows` with `half`: src's first n tokens (`[B, H, >= n, D]`, the window buffer
        or x) rounded to fp16 and quantized as n / G groups, written as groups g0...
        (token tok0 is src's first, for a group's step-overflow flag). Keys: rows the
        channels, blocks the groups; values: rows a group's G tokens, blocks the groups
        (grid dimensions stay small however long the write)."""
        f, G, D = self.flat, self.flat.group, self.D
        c, sc, z = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        s0, s1, s2 = src.stride(0), src.stride(1), src.stride(2)
        if self.role == "K":
            step_encode.int_rows(src, (s0, s1, 1, s2, G * s2), D, n // G,
                                 c, (c.stride(0), c.stride(1), c.stride(3), c.stride(2)), sc, z,
                                 (sc.stride(0), sc.stride(1), 1, sc.stride(2)), 0, g0, n=G, group=G, bits=f.bits,
                                 err=errors, tok0=tok0, token_rows=False, half=True, tok_blocks=G)
        else:
            step_encode.int_rows(src, (s0, s1, s2, 1, G * s2), G, n // G,
                                 c, (c.stride(0), c.stride(1), c.stride(2), G * c.stride(2)), sc, z,
                                 (sc.stride(0), sc.stride(1), sc.stride(2), G * sc.stride(2)), 0, g0, n=D, group=G,
                                 bits=f.bits, err=errors, tok0=tok0, token_rows=True, half=True, tok_blocks=G)

    def _group_buffers(self, rows: int, zeroed: bool = False) -> None:
        """KIVI's group buffers (codes, scale, zero), created for `rows` rows of axis 2 (or
        the capacity hint) when no group was stored yet: shaped like one group's fields
        (`zeroed`: filled with zeros)."""
        if "codes" in self.buffers:
            return
        f, w, B, H, D = self.flat, self.buffers["residual"].buf, self.B, self.H, self.D
        G, key = f.group, self.role == "K"
        per = 1 if key else G
        codes = w.new_empty((B, H, 1, D, packed_nbytes(G, f.bits)) if key else
                            (B, H, 1, packed_nbytes(D, f.bits)), dtype=torch.uint8)
        scale = w.new_empty((B, H, 1, D) if key else (B, H, 1, D // G))
        for name, like in (("codes", codes), ("scale", scale), ("zero", scale)):
            self._buffer(name, like, rows, G // per, zeroed=zeroed)

    def _step_window_at(self, x: torch.Tensor, errors: torch.Tensor, pos: torch.Tensor) -> None:
        """KIVI's step at the device position p: the window write at row p - q(p), then the
        flush `_flush` does, decided on the device (the launches do nothing unless
        this token fills the window): the first P window rows quantized into the groups
        after the q(p) / G held, then rows P .. A+P-1 shifted down. Two launches (the
        paper's keys: the window empties) or three, every step."""
        f, pol = self.flat, self.kivi_policy
        w = self.buffers["residual"].buf
        step_encode.kivi_window(x, w, 0, errors, 0, pos=pos, policy=pol)
        G, P = f.group, pol[1]
        c, sc, z = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        if self.role == "K":  # as `_flush`: rows channels, blocks groups (one block per group)
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

    def graph_unsupported(self) -> str | None:
        why = super().graph_unsupported()
        if why is not None:
            return why
        if self.kivi_policy is None:
            return ("KIVI's window policy is not max(0, t - A) // P * P quantized tokens "
                    "(kivi_policy), so the device cannot decide its flushes")
        if 8 % self.flat.bits:  # (the attention kernel's own limit: the device path is Triton's)
            return f"KIVI with {self.flat.bits} bits: the fused kernel reads 2, 4 or 8"
        return None

    @property
    def kivi_policy(self) -> tuple[int, int] | None:
        """(A, P) of `kivi_policy` (quantized tokens max(0, t - A) // P * P; the window fills
        at A + P, a flush quantizes P tokens and keeps A); None without a stepper."""
        if self.stepper is None:
            return None
        if not hasattr(self, "_policy"):
            self._policy = kivi_policy(self.stepper)
        return self._policy

    def _counts(self, tokens: int) -> tuple[int, int]:
        """(quantized groups, window rows) of a KIVI store holding `tokens` tokens."""
        a, p = self.kivi_policy
        q = max(0, tokens - a) // p * p
        return q // self.flat.group, tokens - q

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens, allocated now: the group buffers for the groups they
        hold, the window for the A + P rows it reaches before a flush."""
        a, p = self.kivi_policy
        f, res = self.flat, self.buffers["residual"]
        per = 1 if self.role == "K" else f.group
        rows = self._counts(tokens)[0] * per
        if res.extend(a + p):
            f.residual = res.buf
        self._group_buffers(max(rows, per))
        grew = False
        for name in ("codes", "scale", "zero"):
            grew |= self.buffers[name].extend(max(rows, per))
        f.codes, f.scale, f.zero = (self.buffers[k].buf for k in ("codes", "scale", "zero"))
        f.residual, f.n_res = res.buf, res.length
        if grew:
            self._adopt([], True)

    @property
    def token_capacity(self) -> int:
        """Tokens whose groups the group buffers hold, with a window that can fill."""
        a, p = self.kivi_policy
        if "codes" not in self.buffers or self.buffers["residual"].capacity < a + p:
            return self.tokens
        per = 1 if self.role == "K" else self.flat.group
        # the most tokens t with q(t) / G groups within the buffers: q(t) <= cap * G
        # (per row of axis 2: one group (K) or one token (V))
        qcap = self.buffers["codes"].capacity // per * self.flat.group // p * p
        return qcap + a + p - 1

    def _advance(self, end: int) -> None:
        self._open_run()
        ng, n_res = self._counts(end)
        per = 1 if self.role == "K" else self.flat.group
        for name in ("codes", "scale", "zero"):
            self.buffers[name].length = ng * per
        self.buffers["residual"].length = n_res
        self.flat.n_groups, self.flat.n_res = ng, n_res
        self.tokens = end

    def _graph_stale(self, view) -> bool:
        # (KIVI's flat is updated in place: its buffers are compared too)
        return view.codes is not self.flat.codes or view.residual is not self.buffers["residual"].buf

    def _graph_flat_of(self, capacity: int):
        # the counts follow the valid length by the window policy
        f = self.flat
        view = KIVIGraphFlat(**{k.name: getattr(f, k.name) for k in dataclasses.fields(KIVIFlat)})
        view.n_res, view.policy, view.capacity = self.buffers["residual"].capacity, self.kivi_policy, capacity
        return view

    def run_segments(self, base: list[Segment]) -> list[Segment]:
        """The run's Segments: one per flushed group and a copy of the window."""
        if self._run_start is None:
            return base
        return self._run_segments(base)

    def _run_segments(self, base: list[Segment]) -> list[Segment]:
        if base and "residual" in base[-1].fields:
            base = base[:-1]  # the window of the run's start: now in the buffer
        f = self.flat
        per = 1 if self.role == "K" else f.group
        g0 = self._run_start + len(self._run_groups)
        for g, fields in enumerate(self._group_views(g0, f.n_groups), g0):
            seg = Segment(fields, f.group)
            self._adopted.append((seg, g * per))  # written once: re-pointed like absorbed segments
            self._run_groups.append(seg)
        out = base + self._run_groups
        n_res = self.buffers["residual"].length
        if n_res:  # rewritten in place by later steps: a copy (a few groups of fp16)
            out = out + [Segment({"residual": self.buffers["residual"].buf[:, :, :n_res].clone()}, n_res)]
        return out

    def _group_views(self, g0: int, g1: int) -> list[dict[str, torch.Tensor]]:
        """`_segment_views` of groups g0 .. g1-1, one torch op per field for them all (a
        prefill's 1024 groups are 1024 Segments; a Python op per view and field was most of
        its host time)."""
        if g1 <= g0:
            return []
        b, n, G = self.buffers, g1 - g0, self.flat.group
        if self.role == "K":  # group g: row g (codes [B,H,D,GB], scale/zero [B,H,D,1])
            parts = {k: (b[k].buf[:, :, g0:g1] if k == "codes" else b[k].buf[:, :, g0:g1].unsqueeze(-1)).unbind(2)
                     for k in ("codes", "scale", "zero")}
        else:  # group g: token rows g*G .. (g+1)*G
            parts = {k: b[k].buf[:, :, g0 * G : g1 * G].unflatten(2, (n, G)).unbind(2)
                     for k in ("codes", "scale", "zero")}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]

    def end_run(self) -> None:
        super().end_run()
        self._run_groups = []

    def _rewind_more(self, check: bool) -> bool:
        # groups and window are lengths over the buffers (KernelStore.rewind zeroes them)
        if not check:
            self._run_groups = []
        return "residual" in self.buffers

    def _empty_flat(self) -> None:
        f = self.flat
        f.n_groups, f.residual, f.n_res = 0, self.buffers["residual"].buf, 0

    @property
    def stored_nbytes(self) -> int:
        per_group = 1 if self.role == "K" else self.flat.group
        return sum(self._valid_rows(k, per_group) for k in self.buffers)

    def _valid_rows(self, name: str, per_group: int) -> int:
        b = self.buffers[name]
        rows = b.length if name == "residual" else self.flat.n_groups * per_group
        v = b.buf[:, :, :rows]
        return v.numel() * v.element_size()


CUDA = Kernel("cuda", lambda q, k, v, **kw: cuda_decode.decode(q, k, v, **kw), title="CUDA KIVI kernel",
              auto=lambda k: cuda_decode.auto_refusal(k), options=cuda_decode.OPTIONS,
              row_start=True, row_start_auto=lambda: cuda_decode.row_start_refusal("kivi"),
              # graph views only: the kernel derives each side's counts from the device length
              # by the window policies (kernels/cuda/decode_attention.py)
              valid_len=True,
              unsupported=lambda q, k, v: cuda_decode.unsupported(q, k, v),
              why_unavailable=lambda: cuda_decode.why_unavailable(), renamed=cuda_decode.RENAMED,
              fast=lambda q, k, v, valid_len=None: cuda_decode.fast(q, k, v, valid_len),
              fits=lambda q, k, v: cuda_decode.fits(q, k, v))

FORMAT = Format(
    name="kivi", quantizer=KIVI, flat=(KIVIFlat, KIVIGraphFlat), flatten=flatten_kivi, store=KIVIStore,
    step=encode_step,
    multi_step=lambda q: kivi_policy(q) is not None,  # prefills and chunks: `KIVIStore._step_tokens`
    kernels=(Kernel("triton", kivi_decode_attention, title="Triton KIVI kernel", row_start=True), CUDA),
    bench={"kivi4": "kivi:bits=4", "kivi2": "kivi:bits=2"},
)
