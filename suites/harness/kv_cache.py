"""A transformers KV cache that stores K and V through any registered quantizer.

    cache = QuantizedCache("hqmq:S=96,r=4", config=model.config, seed=0)
    out = model(input_ids, **cache_kwargs(model, cache), use_cache=True)
    cache.bits_per_element()      # measured from the packed bytes of every layer (total)
    cache.cache_bits_per_element(), cache.constant_nbytes()   # the cache's own; model constants

Every write goes into the packed store of its (layer, role) through the quantizer's
`append`; what attention reads is the quantized history, the current write included.
Two ways to read it:

- dense (any quantizer, any attention): the layer keeps the DECODED history in a
  buffer that grows in place (kernels/store.py `TokenBuffer`); each write decodes only
  its new segments into it (KIVI's replaced fp16 window included), so a decode step
  costs O(1) decode work and no O(T) copy. Attention is the model's own (SDPA, eager).
- fused (the model runs the "kvqbench" attention of suites/harness/attention.py, and
  the quantizer has a fused kernel, on CUDA; `fused=True` also under the Triton
  interpreter on a CPU, TRITON_INTERPRET=1, for tests): the layer
  keeps a `KernelStore` (device buffers in the kernels' layout, appended in place)
  and NO decoded history. A one-token decode step hands attention a `PackedHistory`
  handle and the fused kernel reads the store; a multi-token write (prefill) decodes
  the history once into a transient tensor for SDPA. Where the format's step encoder
  takes t tokens (fp16, per-token int, KIVI, HQMQ with or without Med3x:
  `Format.multi_step`), a multi-token write is encoded on the device as well, one to
  four launches per (layer, role), into stores made before it (`_device_write`); the
  others (fp8, whose scale is fitted on the first write; per-channel int keys; the
  dense formats) go through `append`.

Device-position decode steps (CUDA graphs, kernels/graphs.py `GraphedDecodeStep`): a
fused cache whose every layer has a device step encoder (int, fp8, KIVI, HQMQ, Med3x
included) can take one-token steps that read the number of stored tokens from a device
int32 counter instead of the host (`reserve`, `device_steps`, `step_done`, `advance`):
the step encoders write at it, attention reads it as its valid length over the
reserved capacity, and the step adds 1 to it on the device, so the step has no host
value in it and can be captured once and replayed. The host's bookkeeping (token
counts, store lengths, the Packed views behind `bits_per_element`) is advanced after
each step by `advance(n)`, without reading the device. KIVI's window flushes are
decided on the device from the same counter (its group and window counts are functions
of the token count: kernels/formats/kivi.py); the host computes them in `advance` from the
steps it ran. Dense layers take such steps too when their quantizer's one-token write is
one segment of fixed shapes made by tensor ops (fp16, spherical, additive / flat VQ,
Hadamard int: dense_steps.py): the quantizer's own encode and decode run at the device
position and attention masks the decoded history's reserved rows by the device valid
length. Windowed appends (per-channel int keys) and data-dependent field lengths in a
dense layer are not graphable: `graph_unsupported()` names the reason and their steps
stay eager.

Left-padded batches (`set_row_start`: each row's pad count): every read masks each
row's pads (the fused kernels' `row_start`, the dense history's SDPA, device-position
steps alike: a one-token write hands attention a handle in every mode), the pads' K/V
are stored as copies of the row's first real token, and `position_ids` /
`device_position_ids` give each row its own positions; the prompt's write is masked by
the model's 2-D attention mask (generate.py passes it).

Protocols (METHOD.md 4): `quantize-on-write` is one forward pass over a window from a
fresh cache; `prefill-then-decode` is a prefill call then one-token calls, each
appending its token, so quantizers whose state spans writes (KIVI's fp16 window, a
per-write Med3x median) see the write pattern a deployed cache sees.

Keys arrive AFTER RoPE (transformers applies the rotary embedding before
`cache.update`), so quantizers code rotated keys, as a deployed cache stores them.

One quantizer instance per (layer, role), built by `get_quantizer(spec, layer=i,
role="K"|"V", seed=seed)`; each instance derives per-head seeds from them.

Robustness across transformers 5.x: the layer subclasses `DynamicLayer` (so mask
sizing, `is_sliding`, `get_max_length` and the rest of the layer contract come from
the installed version) and overrides only what touches storage; the cache subclasses
`Cache` with an explicit layer list (what transformers' own QuantizedCache does),
not `DynamicCache`, whose config-driven layer dispatch would build plain layers.
Models with sliding-window layers (Gemma-3) are supported by keeping the full
history in every layer: the model still builds a sliding mask for those layers, so
attention is exact (such layers never take the fused path: it has no mask).

The installed transformers names the forward/generate argument either `cache`
(newer 5.x; `past_key_values` is a deprecated alias) or `past_key_values` (older):
`cache_kwargs(model, cache)` returns the right one.

(About 1000 lines: one transformers cache layer, and the cache around it, whose dense,
fused, device-step and left-padded paths share one state, so they stay together; the
store and the kernels live in kernels/, dense device steps in dense_steps.py, a padded
batch's mechanics in padding.py.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Mapping

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ...kernels import registry as kernel_registry
from ...kernels.cuda import step_write
from ...kernels.formats.hqmq import engine_table
from ...kernels.step_encode import StepErrors
from ...kernels.store import KernelStore, TokenBuffer, grown_capacity, multi_steps
from ...quantizers import Packed, Segment, get_quantizer
from ...quantizers.base import SUPPORTED_DTYPES
from ...quantizers.calibrated import needs_calibration
from ...quantizers.fitted import nbytes_as_row_caches
from . import dense_steps, padding
from .attention import PackedHistory, uses_fused_attention

ROLES = ("K", "V")
# What the first write's own attention reads: "quantized" (the paper's protocols: the
# decoded K/V, as every later read) or "exact" (a deployed engine: the K/V it computed).
PREFILL_MODES = ("quantized", "exact")
# Layer types whose K/V a full-history quantized layer serves correctly (the model's
# mask does the windowing); anything else (KV sharing, linear attention) is refused.
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def cache_kwarg_name(model) -> str:
    """'cache' or 'past_key_values': what this transformers' forward calls the cache."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{name: cache} for `model(...)` and `model.generate(...)` on this transformers."""
    return {cache_kwarg_name(model): cache}


def _triton_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _new_segments(old: Packed | None, new: Packed) -> tuple[list[Segment], int]:
    """(segments of `new` not shared with `old`, tokens of the shared prefix).
    Segments are immutable: a shared object holds the same bytes (KIVI replaces its
    trailing fp16 window on each write; a tampered segment is a new object). A full
    scan: for diagnostics (`replace_packed`), where any segment may be new."""
    n, t = 0, 0
    if old is not None:
        for a, b in zip(old.segments, new.segments):
            if a is not b:
                break
            n, t = n + 1, t + a.tokens
    return new.segments[n:], t


def _appended_segments(old: Packed | None, new: Packed, old_tokens: int) -> tuple[list[Segment], int]:
    """`_new_segments` for `new = quantizer.append(old, x)`, in time independent of the
    history's length: an append shares a prefix of `old`'s segments and replaces only
    trailing ones (KIVI's window), so scan back from the end of what both hold."""
    if old is None:
        return new.segments, 0
    k = min(len(old.segments), len(new.segments))
    t = old_tokens
    for i in range(len(old.segments) - 1, k - 1, -1):  # old segments past new's length
        t -= old.segments[i].tokens
    while k and old.segments[k - 1] is not new.segments[k - 1]:
        k -= 1
        t -= old.segments[k].tokens
    return new.segments[k:], t


def _calibration_of(spec: str, calibration, layer: int, role: str, q) -> dict:
    """The fitted shared tensors of (layer, role) from `calibration` ((layer, role) -> captured
    K/V [N, H, T, D], fitted here, or the dict `calibrate` returned); a clear error without."""
    entry = calibration.get((layer, role)) if isinstance(calibration, Mapping) else None
    if entry is None:
        why = "none was given" if calibration is None else f"it has no entry for (layer {layer}, {role!r})"
        raise ValueError(f"{spec} is a calibrated quantizer (fitted once per model on calibration K/V) and "
                         f"QuantizedCache(calibration=) is needed for it: {why}. Capture calibration K/V with "
                         "suites/harness/calibration.py capture_kv on windows that are not scored")
    return q.calibrate(entry) if isinstance(entry, torch.Tensor) else entry


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V of one decode query `[B, Hq, 1, D]` over `[B, Hkv, T, D]`."""
    g = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


class QuantizedLayer(DynamicLayer):
    """One model layer: packed K and V, plus either the decoded history (dense mode) or
    the kernels' device store (fused mode); the packed bytes are the only thing counted."""

    is_croppable = False  # the packed store cannot be rolled back token by token

    def __init__(self, spec: str, layer_idx: int, seed: int = 0, layer_type: str | None = None,
                 calibration=None):
        super().__init__()
        self.spec, self.layer_idx, self.seed = spec, layer_idx, seed
        self.layer_type = layer_type
        self.quantizers = {r: get_quantizer(spec, layer=layer_idx, role=r, seed=seed) for r in ROLES}
        for role, q in self.quantizers.items():  # calibrated quantizers (quantizers/calibrated.py)
            if needs_calibration(q):
                q.load_calibration(_calibration_of(spec, calibration, layer_idx, role, q))
        self.fused_wanted: bool | None = False  # set by the cache before the first write
        self.capacity_hint = 0  # tokens to preallocate for (e.g. prompt + new tokens)
        self.hqmq_table: tuple[str, torch.dtype] | None = None  # HQMQ codeword source of the kernel
        self.step_encode = True  # fused decode steps encoded on the device (kernels/step_encode.py)
        self.prefill = "quantized"  # "exact": the first write attends to its own K/V unquantized
        # Device-position steps (CUDA graphs, set by `QuantizedCache.device_steps`): (write
        # position, valid length, capacity) -- int32 views of the cache's counter and the
        # token bound the attention grid is cut for; None: host positions.
        self.device_pos: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # A left-padded batch (set by the cache, `QuantizedCache.set_row_start`): the first
        # real token of each batch row (int32 [B] on the device; None: no padding) and the
        # largest of them on the host (writes below it hold pads, `_fill_pads`).
        self.row_start: torch.Tensor | None = None
        self.pad_max = 0
        # role (fused) or ("dense", role) -> the quantizer a multi-token write goes through (`_writer`)
        self._device_writers: dict = {}
        self._clear()

    def _clear(self) -> None:
        # Packed per role as of the last write through the quantizer; fused steps since
        # are in the stores' runs (`packed` brings it up to date).
        self._packed: dict[str, Packed | None] = {r: None for r in ROLES}
        self._view: dict[str, tuple[int, Packed]] = {}  # role -> (tokens, up-to-date Packed)
        self.errors: StepErrors | None = None  # fused mode: the step kernels' input-error flags
        self._unchecked = False  # a device-encoded multi-token write since the last check
        self.decoded: dict[str, TokenBuffer | None] = {r: None for r in ROLES}  # dense mode
        # dense mode, device-position steps (dense_steps.py): per role, made by `reserve`
        self.dense_steps: dict[str, dense_steps.DenseSteps | None] = {r: None for r in ROLES}
        self._dense_why: str | None = None  # why this dense layer is not graphable (after _dense_probed)
        self._dense_probed = False
        self.stores: dict[str, KernelStore | None] = {r: None for r in ROLES}  # fused mode
        self.mode: str | None = None  # "dense" or "fused", fixed at the first write
        self.fallbacks = 0  # fused steps the kernel refused (served densely instead)
        self.tokens = 0
        self.keys = self.values = None

    # Signature differs across 5.x (value_states was added); accept both.
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 0:  # nothing written (e.g. an early-init probe)
            return self.keys, self.values
        if self.device_pos is not None:
            return self._device_step(key_states, value_states)
        computed = key_states, value_states
        if self.row_start is not None and self.tokens < self.pad_max:  # (host ints: no device read)
            key_states, value_states = self._fill_pads(key_states), self._fill_pads(value_states)
        if self.prefill == "exact" and self.tokens == 0:
            # A deployed engine's prefill: attention inside the prompt reads the K/V it
            # just computed at full precision; they are stored quantized, and only later
            # reads (decode steps) see the quantized cache. (Pads: the model's 2-D mask.)
            self._write(key_states, value_states, read=False)
            return computed
        if self.mode == "fused" and self._step(key_states, value_states):
            handle = PackedHistory(self)
            return handle, handle
        return self._write(key_states, value_states)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, read: bool = True):
        """A write through the quantizers' `append`; returns what attention reads (with
        `read=False` the fused mode skips the prefill's transient decode)."""
        self._end_runs()
        if self._device_write(key_states, value_states):
            return (self.read("K"), self.read("V")) if read else (None, None)  # prefill: a transient decode
        new = {}
        for role, x in (("K", key_states), ("V", value_states)):
            old = self._packed[role]
            q = self._writer(role, x)
            self._packed[role] = q.append(old, x)  # append(None, x) == encode(x)
            new[role] = _appended_segments(old, self._packed[role], self.tokens)
        self.tokens += key_states.shape[-2]  # (Packed.tokens would sum over every segment)
        if self.mode is None:  # the first write decides (and a new store absorbs it)
            self.mode = "fused" if self._start_stores() else "dense"
        elif self.mode == "fused":
            for role in ROLES:
                self.stores[role].append(*new[role])
        if self.mode == "fused":
            if key_states.shape[-2] == 1:
                handle = PackedHistory(self)
                return handle, handle
            return (self.read("K"), self.read("V")) if read else (None, None)  # prefill: a transient decode
        self.keys = self._decode_into("K", *new["K"])
        self.values = self._decode_into("V", *new["V"])
        if self.row_start is not None and key_states.shape[-2] == 1:
            # A left-padded batch's step: no mask comes with it (the model's is built for an
            # unpadded step), so attention gets the handle, which masks each row's pads
            handle = PackedHistory(self)
            return handle, handle
        return self.keys, self.values

    def _fill_pads(self, x: torch.Tensor) -> torch.Tensor:
        """x, written at token `self.tokens`, its pads holding copies of each row's first
        real token (padding.py `fill_pads`)."""
        if x.shape[0] != self.row_start.shape[0]:
            raise ValueError(f"layer {self.layer_idx}: a write of batch {x.shape[0]} to a cache whose row starts "
                             f"are for batch {self.row_start.shape[0]} (QuantizedCache.set_row_start)")
        return padding.fill_pads(x, self.row_start, self.tokens)

    def _device_write(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A multi-token write (a prefill, a later chunk) of a fused cache encoded on the
        device by both stores (`KernelStore.steps`: one launch per role, the bytes t
        one-token steps store), where the format's step encoder takes t tokens
        (`Format.multi_step`); the first write makes the stores empty first
        (`KernelStore.create_empty`). False: the old path serves it (host-side checks
        only; a write this path cannot take goes there, whose checks name the problem).
        The write becomes one ordinary segment per role, as the old path's append (HQMQ +
        Med3x: made when the cache is next read, `KernelStore.segment_on_read`); input
        errors are flagged on the device (`StepErrors`) and raised when results are next
        read (`_current`) or at the next step's poll."""
        if not self.step_encode or k.shape[-2] < 2 or self.mode == "dense":
            return False
        xs = (("K", k), ("V", v))
        if any(x.dim() != 4 or x.dtype not in SUPPORTED_DTYPES or x.device != self.device for _, x in xs):
            return False
        if self.mode is None:
            if not self._fused_possible():
                return False
            packed, stores = {}, {}
            for role, x in xs:
                q = self.quantizers[role]
                fmt = kernel_registry.format_of_quantizer(type(q))
                if fmt is None or not multi_steps(fmt, q) or x.shape[-1] % q.head_dim_multiple:
                    return False
                packed[role] = q.empty_for(x)  # fp8: its scale fitted on this write
                stores[role] = KernelStore.create_empty(packed[role], role, x.shape[-2], capacity=self.capacity_hint,
                                                        table=self._table())
                if stores[role] is None:
                    return False
            self.mode, self.stores, self._packed = "fused", stores, packed
            self.errors = StepErrors(self.device)
        else:
            for role, x in xs:
                p, store = self._packed[role], self.stores[role]
                if (not store.multi_steps or x.shape[:2] + x.shape[3:] != (p.batch, p.heads, p.head_dim)
                        or x.dtype != p.dtype):
                    return False
            if self.tokens == 0:  # the first write after a rewind: what it fits, fitted again, in place
                for role, x in xs:
                    if self.stores[role].refits:
                        self._packed[role] = self.stores[role].refit(self.quantizers[role].empty_for(x))
            if self.errors.poll():
                self.errors.check(self.layer_idx)
        for i, (role, x) in enumerate(xs):
            self.stores[role].steps(x, self.errors.rows[i])
        for role in ROLES:  # the write as one ordinary segment, as the old path appends it
            if self.stores[role].segment_on_read:  # (Med3x: made when read, `_current`; no host read here)
                continue
            base = self._packed[role]
            self._packed[role] = dataclasses.replace(base, segments=self._run_segments(role, self.stores[role], base))
            self.stores[role].end_run()
        self._view.clear()
        self._unchecked = True
        self.tokens += k.shape[-2]
        return True

    def _writer(self, role: str, x: torch.Tensor):
        """The quantizer a multi-token write goes through: a dense format's kernel writer
        where it has one (dense_steps.segment_writer); on CUDA, for a cache that may run
        fused, the format's device encoder where it has one (registry `device_encoder`:
        HQMQ's search as a Triton kernel, the same fields; a deployed engine encodes its
        prefill on the device); else the quantizer itself."""
        q = self.quantizers[role]
        if x.shape[-2] >= 2 and self.mode != "fused":  # a dense format's multi-token encode in one launch
            dense = dense_steps.segment_writer(q, x.device, self._device_writers, role)
            if dense is not None:
                return dense
        if x.device.type != "cuda" or x.shape[-2] < 2 or self.fused_wanted is False or self.mode == "dense":
            return q
        cached = self._device_writers.get(role)
        if cached is None:
            fmt = kernel_registry.format_of_quantizer(type(q))
            enc = getattr(fmt, "device_encoder", None) if fmt is not None and fmt.quantizer is type(q) else None
            cached = enc(q) if enc is not None else q
            self._device_writers[role] = cached
        return cached

    def _step(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A fused one-token write encoded on the device by both stores (see the module
        docstring); False when the old path must serve it. Host-side checks only: a
        write this cache cannot take goes to the old path, whose checks name the problem."""
        if not self.step_encode or k.shape[-2] != 1:
            return False
        for role, x in (("K", k), ("V", v)):
            p, store = self._packed[role], self.stores[role]
            if (store.stepper is None or x.shape != (p.batch, p.heads, 1, p.head_dim) or x.dtype != p.dtype
                    or x.device != p.device):
                return False
        if self.errors.poll():
            self.errors.check(self.layer_idx)
        if not step_write.write_pair(self.stores["K"], self.stores["V"], k, v, self.errors):
            self.stores["K"].step(k, self.errors.rows[0])  # (one launch per role: the format's encoder)
            self.stores["V"].step(v, self.errors.rows[1])
        self.tokens += 1
        return True

    def _device_step(self, k: torch.Tensor, v: torch.Tensor):
        """A one-token write at the cache's device position (`QuantizedCache.device_steps`):
        both stores encode it there (`KernelStore.step_at`) and no host state changes (the
        cache's `advance` accounts for it). Anything else raises: a CUDA graph cannot
        take the host path, and silently serving it another way would be wrong."""
        ready = self.dense_steps["K"] is not None if self.mode == "dense" else self.mode == "fused"
        for role, x in (("K", k), ("V", v)):
            p = self._packed[role]
            if p is None or not ready or x.shape != (p.batch, p.heads, 1, p.head_dim) \
                    or x.dtype != p.dtype or x.device != p.device:
                got = f"{tuple(x.shape)} {x.dtype} on {x.device}"
                want = "a reserved layer" if p is None or not ready else \
                    f"{(p.batch, p.heads, 1, p.head_dim)} {p.dtype} on {p.device}"
                raise RuntimeError(f"layer {self.layer_idx} {role}: a device-position step takes one token "
                                   f"of {want}, got {got}")
        pos = self.device_pos[0]
        if self.mode == "dense":
            for role, x in (("K", k), ("V", v)):
                self.dense_steps[role].step_at(x, pos, self._packed[role])
        else:
            self.stores["K"].step_at(k, self.errors.rows[0], pos)
            self.stores["V"].step_at(v, self.errors.rows[1], pos)
        handle = PackedHistory(self)
        return handle, handle

    def graph_unsupported(self) -> str | None:
        """Why this layer cannot take device-position steps (None: it can)."""
        if self.mode == "dense":
            return self._dense_unsupported()
        if self.mode != "fused":
            return f"layer {self.layer_idx} is empty (prefill first)"
        for role in ROLES:
            why = self.stores[role].graph_unsupported()
            if why:
                return f"layer {self.layer_idx} {role}: {why}"
        return None

    def _dense_unsupported(self) -> str | None:
        """A dense layer's reason (dense_steps.py): the format's, found once per layer (on
        CUDA with a probe write, which dense_steps.probe makes once per format, role and
        shape in a process)."""
        if self.layer_type not in (None, "full_attention"):
            return f"layer {self.layer_idx} is {self.layer_type} (the model's mask windows it; a step's has none)"
        if not self._dense_probed:  # the format's answer: once per layer
            why = next(filter(None, (dense_steps.unsupported(self.quantizers[r], self._packed[r]) for r in ROLES)),
                       None)
            if why is None:
                why = next(filter(None, (dense_steps.probe(self.quantizers[r], self._packed[r], self.decoded[r])
                                         for r in ROLES)), None)
            self._dense_why, self._dense_probed = why and f"layer {self.layer_idx}: {why}", True
        return self._dense_why

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens (device-position steps never grow a buffer)."""
        if self.mode == "fused":
            for role in ROLES:
                self.stores[role].reserve(tokens)
            return
        self._end_runs()
        self.dense_steps = {r: dense_steps.DenseSteps(self.quantizers[r], self._packed[r], self.decoded[r], tokens,
                                                      f"layer {self.layer_idx} {r}: a device-position decode step")
                            for r in ROLES}

    def advance(self, n: int) -> None:
        """Host bookkeeping of n device-position steps that ran (see `_device_step`)."""
        for role in ROLES:
            if self.mode == "dense":
                self.dense_steps[role].advance(self.tokens, n)
            else:
                self.stores[role].advance(n)
        self.tokens += n

    def can_rewind(self) -> bool:
        return self.mode == "fused" and self.errors is not None and all(
            self.stores[r].can_rewind for r in ROLES)

    def rewind(self) -> None:
        """Forget every token; the stores' buffers and the error flags stay where they are
        (`QuantizedCache.rewind`). An input error the last use flagged is raised first."""
        self.check()
        for role in ROLES:
            self.stores[role].rewind()
            self._packed[role] = dataclasses.replace(self._packed[role], segments=[])
        self.errors.reset()
        self._view.clear()
        self._unchecked = False
        self.tokens = 0
        self.keys = self.values = None

    def device_buffers(self) -> list[torch.Tensor]:
        """Every buffer a device-position step of this layer writes or reads."""
        out = [self.errors.flags] if self.errors is not None else []
        for role in ROLES:
            if self.stores[role] is not None:
                out.extend(self.stores[role].device_buffers())
            if self.dense_steps[role] is not None:
                out.extend(self.dense_steps[role].buffers())
        return out

    def check(self) -> None:
        """Raise an input error a device-encoded step of this layer flagged (a host sync)."""
        if self.errors is not None:
            self.errors.check(self.layer_idx)
        self._unchecked = False
        for steps in self.dense_steps.values():
            if steps is not None:
                steps.checks.check()

    def _current(self, role: str) -> Packed | None:
        """The Packed of `role` holding every token written: the last one written through
        the quantizer plus the store's run of device-encoded steps. Checks the step
        kernels' input-error flags first (results are being read)."""
        store = self.stores[role] if self.mode == "fused" else self.dense_steps[role]
        if self._unchecked:  # a multi-token write encoded on the device (`_device_write`)
            self.check()
        if store is None or not store.in_run:
            return self._packed[role]
        self.check()
        at, p = self._view.get(role, (None, None))
        if at != self.tokens:
            base = self._packed[role]
            p = dataclasses.replace(base, segments=self._run_segments(role, store, base))
            self._view[role] = (self.tokens, p)
        return p

    def _run_segments(self, role: str, store, base: Packed) -> list[Segment]:
        """base's segments plus the store's run, whose layouts the role's quantizer learns
        as its own writes' (`Quantizer.learn_layout`: the device encoders store exactly
        `encode_tokens`' fields), so reading them never probes their shapes on the host."""
        segs = store.run_segments(base.segments)
        q = self.quantizers[role]
        for seg in segs[len(base.segments):]:
            q.learn_layout((base.batch, base.heads, seg.tokens, base.head_dim), seg)
        return segs

    @property
    def packed(self) -> dict[str, Packed | None]:
        """{"K": Packed, "V": Packed} holding everything written (None before the first write)."""
        return {r: self._current(r) for r in ROLES}

    def _end_runs(self) -> None:
        """Before a write through the quantizers: fold the device-encoded steps into the
        Packed they append to."""
        for role in ROLES:
            for store in (self.stores[role], self.dense_steps[role]):
                if store is not None and store.in_run:
                    self._packed[role] = self._current(role)
                    store.end_run()
        self._view.clear()

    def _start_stores(self) -> bool:
        """Fused mode: a store per role, when asked for and a kernel reads this format.
        `fused_wanted` None (automatic) means on CUDA only; True also runs the kernels
        under the Triton interpreter on a CPU (tests: slow, exact fp32)."""
        if not self._fused_possible():
            return False
        stores = {r: KernelStore.create(self._packed[r], r, capacity=self.capacity_hint, table=self._table(),
                                        step=self.step_encode) for r in ROLES}
        if any(s is None for s in stores.values()):
            return False
        self.stores = stores
        self.errors = StepErrors(self.device)
        return True

    def _fused_possible(self) -> bool:
        """Whether this layer may run fused (`_start_stores`), before its first write."""
        can = self.device.type == "cuda" if self.fused_wanted is None else (
            bool(self.fused_wanted) and _triton_can_run(self.device))
        return can and self.layer_type in (None, "full_attention")

    def _table(self) -> tuple[str, torch.dtype] | None:
        if self.hqmq_table == "auto":  # the fastest source on a GPU: fp16 codebook
            return engine_table(self.device)
        return self.hqmq_table

    def _decode_into(self, role: str, new: list[Segment], shared_tokens: int) -> torch.Tensor:
        """Decode a write's new segments into the growing decoded buffer at `shared_tokens`."""
        part = self._decode_segments(role, new)
        if self.decoded[role] is None:
            self.decoded[role] = TokenBuffer(part, grown_capacity(max(part.shape[2], self.capacity_hint)))
        self.decoded[role].write(shared_tokens, part)
        return self.decoded[role].valid

    def _decode_segments(self, role: str, segs: list[Segment]) -> torch.Tensor:
        """Decoded tokens of `segs`, in the written dtype, without caching them on the
        segments (a cached copy would be a dense history beside the packed bytes)."""
        # Through the quantizer's own `decode` (plugins may override it), on throwaway
        # Segment objects over the same fields, so its per-segment cache dies with them.
        p = self._current(role)
        fresh = [Segment(s.fields, s.tokens) for s in segs]
        return self.quantizers[role].decode(dataclasses.replace(p, segments=fresh))

    def read(self, role: str) -> torch.Tensor:
        """The decoded history of `role` ("K" or "V"), `[B, H, T, D]`, in the written dtype
        (fused mode: decoded now, transiently)."""
        if self.mode == "dense":
            return self.decoded[role].valid
        return self._decode_segments(role, self._current(role).segments)

    def attention_route(self, n_heads: int, dtype: torch.dtype) -> str:
        """What this layer's decode steps read the history with, as a step with an
        n_heads-head query of `dtype` would now: the fused kernel's backend ("cuda",
        "triton"; with "+dense" when the kernel refused some steps, served densely) or
        "dense" (the decoded history through SDPA). Asked after the steps, outside any
        capture: the front's own routing (explain_backend), no kernel runs."""
        from ...kernels.decode_attention import explain_backend

        if self.mode != "fused":
            return "dense"
        ks = self.stores["K"]  # (its shape, not `packed`: that would make a run's segments, Med3x's lists)
        q = torch.zeros(ks.B, n_heads, 1, ks.D, dtype=dtype, device=self.device)
        try:
            if self.device_pos is not None:
                _, valid, cap = self.device_pos
                route = explain_backend(q, ks.graph_view(cap), self.stores["V"].graph_view(cap),
                                        valid_len=valid, row_start=self.row_start).backend
            else:
                route = explain_backend(q, ks.kernel_view(), self.stores["V"].kernel_view(),
                                        row_start=self.row_start).backend
        except ValueError:  # a layout every kernel refuses: its steps were served densely
            return "dense"
        except Exception as e:  # noqa: BLE001 (a label: never the end of the measurement it labels)
            return f"unknown ({type(e).__name__})"
        return route + ("+dense" if self.fallbacks else "")

    def fused_attend(self, query: torch.Tensor) -> torch.Tensor:
        """The fused kernel over the K and V stores: `[B, Hq, 1, D]`."""
        from ...kernels.decode_attention import decode_attention

        rs = self.row_start  # a left-padded batch: keys before row_start[b] masked for row b
        if self.device_pos is not None and self.mode == "dense":  # dense_steps.py
            _, valid, cap = self.device_pos
            k, v = self.decoded["K"].buf[:, :, :cap], self.decoded["V"].buf[:, :, :cap]
            return padding.masked_attention(query, k, v, valid, rs)
        if self.mode == "dense":  # a padded batch's host-path step (`_write` hands out the handle)
            return padding.masked_attention(query, self.decoded["K"].valid, self.decoded["V"].valid, None, rs)
        if self.device_pos is not None:  # the valid length on the device; no fallback (module docstring)
            _, valid, cap = self.device_pos
            try:
                return decode_attention(query, self.stores["K"].graph_view(cap), self.stores["V"].graph_view(cap),
                                        valid_len=valid, row_start=rs)
            except ValueError as e:
                raise RuntimeError(f"layer {self.layer_idx}: the fused kernel refused a device-position "
                                   f"step ({e})") from e
        try:
            return decode_attention(query, self.stores["K"].kernel_view(), self.stores["V"].kernel_view(),
                                    row_start=rs)
        except ValueError:
            # A shape the kernel refuses (e.g. K and V windows of different lengths on
            # kernels that need them equal): exact dense attention instead, counted.
            self.fallbacks += 1
            if rs is not None:
                return padding.masked_attention(query, self.read("K"), self.read("V"), None, rs)
            return _dense_attention(query, self.read("K"), self.read("V"))

    def pad_mask(self) -> torch.Tensor | None:
        """`[B, 1, 1, T]` bool, True for the keys each row attends to (from its row start
        on), over the T tokens held; None without row starts."""
        if self.row_start is None:
            return None
        return padding.keys_from(self.row_start, self.tokens, self.row_start.device)[:, None, None, :]

    def replace_packed(self, role: str, packed: Packed) -> None:
        """Swap in another packed store (diagnostics: e.g. tampered bytes). Every segment
        from the first new object on is decoded (dense) or absorbed (fused) afresh."""
        self._end_runs()
        new, shared = _new_segments(self._packed[role], packed)
        self._packed[role] = packed
        if self.mode == "fused":
            self.stores[role] = KernelStore.create(packed, role, capacity=self.capacity_hint,
                                                   table=self._table(), step=self.step_encode)
        elif new:
            out = self._decode_into(role, new, shared)
            if role == "K":
                self.keys = out
            else:
                self.values = out

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.tokens

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packed.values() if p is not None)

    def cache_nbytes(self) -> int:
        host, dev = self.cache_nbytes_parts()
        return host + sum(int(t) for t in dev)

    def cache_nbytes_parts(self) -> tuple[int, list[torch.Tensor]]:
        """`cache_nbytes` as (host bytes, device scalars to add): a store in a run counts
        its run's bytes itself where it can (`KernelStore.run_nbytes`) instead of making
        the run's segments; the input-error flags are checked as any read of results does."""
        host, dev, checked = 0, [], False
        for role in ROLES:
            store = self.stores[role] if self.mode == "fused" else None
            run = store.run_nbytes() if store is not None and store.in_run else None
            if run is None:
                p = self._current(role)
                host += p.cache_nbytes if p is not None else 0
                continue
            if not checked:  # (one read of the layer's flags covers both roles)
                self.check()
                checked = True
            host += self._packed[role].cache_nbytes + run[0]
            dev += [] if run[1] is None else [run[1]]
        return host, dev

    def constant_nbytes(self) -> int:
        return sum(p.constant_nbytes for p in self.packed.values() if p is not None)

    def numel(self) -> int:
        """K/V elements held; a store in a run counts its run's tokens itself (making the
        run's segments gathers Med3x's outlier lists: ~40 ms of a batch-8 generate call of the
        SmolLM2 shape on an H100, 2026-12-05)."""
        n = 0
        for role in ROLES:
            store = self.stores[role] if self.mode == "fused" else None
            run = store.run_numel() if store is not None and store.in_run else None
            if run is not None:
                base = self._packed[role]
                n += (base.numel if base is not None else 0) + run
            else:
                p = self._current(role)
                n += p.numel if p is not None else 0
        return n

    def reset(self) -> None:
        # Drop (never zero in place) the buffers; with is_initialized cleared first, the
        # base reset only resets its own bookkeeping.
        self._clear()
        self.is_initialized = False
        super().reset()

    # Anything that edits the decoded tensors alone would desynchronise them from the
    # packed store; refuse instead of silently measuring the wrong thing.
    def _refuse(self, what: str) -> None:
        if self.get_seq_length() > 0:
            raise NotImplementedError(f"kvqbench QuantizedCache does not support {what}")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            self._refuse("crop (assisted / speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse("batch_repeat_interleave on a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("batch_select_indices (contrastive search)")

    def offload(self):  # the packed store would stay put; not supported
        if self.get_seq_length() > 0:
            raise NotImplementedError("kvqbench QuantizedCache does not support offloading")

    def prefetch(self):
        pass


class QuantizedCache(Cache):
    """A transformers Cache whose every layer stores K/V through quantizer `spec`.

    QuantizedCache(spec, n_layers=None, *, config=None, seed=0, fused=None, capacity=0,
                   hqmq_table="auto", step_encode=True)

    Give `config=model.config` (preferred: the layer count and layer types are
    checked) or `n_layers`; with neither, layers are created as `update` reaches them.
    `fused`: None (default) uses the fused decode path on CUDA when the model runs the
    "kvqbench" attention (`attention.fused_attention(model)`; needs `config`); True /
    False force it on / off (on still needs a format a kernel reads and CUDA or
    TRITON_INTERPRET=1; otherwise the layer stays dense). `capacity`: tokens to
    preallocate per layer (e.g. prompt + new tokens); buffers grow by doubling anyway.
    `hqmq_table`: the codeword source HQMQ's kernel gathers from, (table_mode, dtype) of
    `HQMQFlat.with_table`; "auto" is the fp16 codebook on CUDA (the fastest measured;
    within an fp16 ulp per codeword component) and the exact fp32 secondaries elsewhere.
    `step_encode`: fused decode steps encoded on the device (see the module docstring);
    False sends every write through the quantizer's `append` (the old path).
    `prefill`: "quantized" (default) or "exact": the first write (the prompt) attends to
    its own K/V at full precision, as deployed engines do, while storing them quantized;
    every later write reads the quantized cache (the `deployed` protocol).
    `calibration`: for a calibrated quantizer (quantizers/calibrated.py; e.g. avq2-cal) a
    mapping (layer, role) -> calibration K/V `[N, H, T, D]` (suites/harness/calibration.py
    `capture_kv`; fitted when each layer is built) or -> the dict its `calibrate` returned
    (`fit_calibration`: fit once, share among caches). Required for such a spec (a
    ValueError naming it otherwise); ignored for the others.
    """

    def __init__(self, spec: str, n_layers: int | None = None, *, config=None, seed: int = 0,
                 fused: bool | None = None, capacity: int = 0, hqmq_table="auto", step_encode: bool = True,
                 prefill: str = "quantized", calibration=None):
        if needs_calibration(get_quantizer(spec)):  # fail on a bad spec now, not inside the forward pass
            if not isinstance(calibration, Mapping) or not calibration:
                _calibration_of(spec, None, 0, "K", None)  # raises, naming the spec
        self.calibration = calibration
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.prefill = prefill
        self.spec, self.seed, self.fused, self.capacity = spec, int(seed), fused, int(capacity)
        self.hqmq_table, self.step_encode = hqmq_table, bool(step_encode)
        self.model_config, types = config, None
        if config is not None:
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            types = getattr(text, "layer_types", None)
            bad = set(types or ()) - SUPPORTED_LAYER_TYPES
            if bad:
                raise ValueError(f"QuantizedCache supports layer types {sorted(SUPPORTED_LAYER_TYPES)}, "
                                 f"the model has {sorted(bad)}")
            if n_layers is not None and n_layers != text.num_hidden_layers:
                raise ValueError(f"n_layers={n_layers} but the config has {text.num_hidden_layers} layers")
            n_layers = text.num_hidden_layers
        self.layer_types = list(types) if types else None
        # device-position steps (`device_steps`): the reserved capacity, the device counter
        # and the host token count it holds (None: not yet set)
        self.reserved = 0
        self._pos: torch.Tensor | None = None
        self._pos_at: int | None = None
        # a left-padded batch (`set_row_start`): each row's first real token, int32 [B] on
        # the device (None: no padding), and the largest of them on the host
        self.row_start: torch.Tensor | None = None
        self._pad_max = 0
        layers = [self._new_layer(i) for i in range(n_layers or 0)]
        super().__init__(layers=layers)  # an explicit (possibly empty) list: no layer_class_to_replicate

    def _new_layer(self, i: int) -> QuantizedLayer:
        lt = self.layer_types[i] if self.layer_types and i < len(self.layer_types) else None
        return QuantizedLayer(self.spec, i, self.seed, layer_type=lt, calibration=self.calibration)

    def fused_wanted(self) -> bool | None:
        """True / False when forced; None (automatic: CUDA only) when the model runs the
        "kvqbench" attention; False otherwise."""
        if self.fused is not None:
            return self.fused
        return None if self.model_config is not None and uses_fused_attention(self.model_config) else False

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # lazily grown when no layer count was given
            self.layers.append(self._new_layer(len(self.layers)))
        layer = self.layers[layer_idx]
        if self.row_start is not None and self.row_start.device != key_states.device:
            self.row_start = self.row_start.to(key_states.device)  # (starts given as host ints: once)
        layer.row_start, layer.pad_max = self.row_start, self._pad_max
        if layer.mode is None:
            layer.fused_wanted, layer.capacity_hint = self.fused_wanted(), self.capacity
            layer.hqmq_table, layer.step_encode = self.hqmq_table, self.step_encode
            layer.prefill = self.prefill
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if (isinstance(out[0], PackedHistory) and self.model_config is not None
                and not uses_fused_attention(self.model_config)):
            raise RuntimeError("a fused QuantizedCache (or one with row starts: a left-padded batch) hands "
                               "attention its packed store: run the model under "
                               "kvqbench.suites.harness.attention.fused_attention(model), or use fused=False "
                               "without row starts")
        return out

    # ---- a left-padded batch ----------------------------------------------------------------
    def set_row_start(self, starts, device=None) -> None:
        """Serve a LEFT-PADDED batch: row b's first real token is at position starts[b] (its
        pad count; a sequence of ints or an integer tensor `[B]`; None: no padding). Set
        before the prompt's write (a fresh or `rewind`ed cache). Then:
        - every read masks each row's keys before its start: the fused kernels
          (`decode_attention(row_start=)`, CUDA or Triton), the dense
          history's SDPA and device-position steps alike; a one-token write hands attention
          a `PackedHistory` handle in every mode, so the model must run the "kvqbench"
          attention (`fused_attention(model)`); a multi-token write (the prompt) is masked
          by the model's own mask: pass the 2-D `attention_mask`;
        - the pad positions' K/V are stored as copies of the row's first real token
          (`QuantizedLayer._fill_pads`: per-write / per-group statistics unmoved, except a
          Med3x median);
        - positions: `position_ids(t0, n)` (host steps, the prefill) and the device step's
          (`device_position_ids`) are the token index minus the row's start, as the row
          alone would have them.
        The starts live in one device tensor (on `device`, else the layers', else the given
        tensor's), overwritten in place by a later call of the same batch (a CUDA graph
        captured over the cache reads that buffer). Host ints need no device read; a
        device tensor is read once (its largest start)."""
        if starts is None:
            if self.get_seq_length():
                raise ValueError("set_row_start(None) on a cache holding tokens")
            self.row_start, self._pad_max = None, 0
            return
        new, host = padding.row_starts(starts)
        if self.get_seq_length():
            raise ValueError(f"set_row_start on a cache holding {self.get_seq_length()} tokens: set it before the "
                             "prompt's write (a fresh cache, or after rewind())")
        batch = {layer._packed["K"].batch for layer in self.layers if layer._packed["K"] is not None}
        if batch and batch != {len(host)}:
            raise ValueError(f"{len(host)} row starts for a cache of batch {batch.pop()}")
        if self.row_start is not None and self.row_start.shape == new.shape:
            with torch.inference_mode(self.row_start.is_inference()):
                self.row_start.copy_(new)  # in place: a captured step reads this buffer
        else:
            dev = device or (self.layers[0].device if self.layers and self.layers[0].is_initialized else new.device)
            self.row_start = new.to(dev, copy=True)  # (its own buffer: never the caller's tensor)
        self._pad_max = max(host)

    def position_ids(self, t0: int, n: int) -> torch.Tensor | None:
        """`[B, n]` position ids of n tokens written at token t0 of every row: the token index
        minus the row's start (pads: 0); None without row starts (the model's own)."""
        return None if self.row_start is None else padding.position_ids(self.row_start, t0, n)

    def device_position_ids(self) -> torch.Tensor | None:
        """`[B, 1]` position ids of a device-position step (inside `device_steps`): the
        device write position minus each row's start, on the device (no host value: a
        CUDA graph replays it); None without row starts."""
        if self.row_start is None:
            return None
        return (self.device_position()[0:1].long() - self.row_start.long())[:, None]

    # ---- decode steps at a device position (CUDA graphs: kernels/graphs.py) -----------------
    def graph_unsupported(self) -> str | None:
        """Why this cache cannot take device-position decode steps (None: it can): every
        layer fused with a device step encoder (int, fp8, KIVI, HQMQ with or without Med3x) or
        dense with a quantizer whose one-token write is graphable (dense_steps.py), all
        holding the same number of tokens. Host checks, plus one probe write per dense
        layer on CUDA."""
        if not self.layers or self.get_seq_length() == 0:
            return "the cache is empty: prefill first (the first write decides each layer's store)"
        for layer in self.layers:
            why = layer.graph_unsupported()
            if why:
                return why
        if len({layer.tokens for layer in self.layers}) != 1:
            return "layers hold different numbers of tokens"
        return None

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens in every layer's stores, allocated now, and the bound the
        attention grid of device-position steps is cut for (`device_steps` steps never
        grow a buffer: a CUDA graph holds their addresses)."""
        why = self.graph_unsupported()
        if why:
            raise ValueError(f"reserve: {why}")
        if tokens < self.get_seq_length():
            raise ValueError(f"reserve({tokens}) below the {self.get_seq_length()} tokens held")
        for layer in self.layers:
            layer.reserve(tokens)
        self.reserved = int(tokens)

    def device_position(self) -> torch.Tensor:
        """The device step counter, int32 `[2]`: (write position, valid length) of the next
        device-position step, brought up to the host's token count when it lags (a step
        written through the host path in between): two fills, no host read."""
        t = self.get_seq_length()
        if self._pos is None:
            self._pos = torch.zeros(2, dtype=torch.int32, device=self.layers[0].device)
        if self._pos_at != t:
            with torch.inference_mode(self._pos.is_inference()):
                self._pos[0].fill_(t)
                self._pos[1].fill_(t + 1)
            self._pos_at = t
        return self._pos

    @contextlib.contextmanager
    def device_steps(self):
        """Inside the block, one-token writes go to every layer at the device write position
        (`device_position()[0]`, read by the step kernels) and attention reads the device
        valid length (`[1]`), over the `reserve`d capacity; nothing on the host changes,
        so the block's work can be captured in a CUDA graph and replayed. After each step
        run inside it: `step_done()` (captured with the step: the counter + 1 on the
        device), and after it ran, `advance(1)` on the host (per replay)."""
        why = self.graph_unsupported()
        if why:
            raise ValueError(f"device steps: {why}")
        if self.reserved <= self.get_seq_length():
            raise ValueError(f"device steps: no reserved room past the {self.get_seq_length()} tokens held "
                             f"(cache.reserve(total tokens) first)")
        pos = self.device_position()
        views = (pos[0:1], pos[1:2], self.reserved)
        for layer in self.layers:
            layer.device_pos = views
        try:
            yield pos
        finally:
            for layer in self.layers:
                layer.device_pos = None

    def buffer_signature(self) -> tuple:
        """The addresses of every buffer a device-position step touches (the stores' token
        buffers, the step counter, the error flags): a CUDA graph holds them, so a graphed
        step compares this before each replay (e.g. `replace_packed` builds new stores)."""
        sig = [self._pos.data_ptr() if self._pos is not None else 0,
               self.row_start.data_ptr() if self.row_start is not None else 0]
        for layer in self.layers:
            sig.extend(t.data_ptr() for t in layer.device_buffers())
        return tuple(sig)

    def step_done(self) -> None:
        """The device counter + 1 (on the device: call it inside the captured step)."""
        with torch.inference_mode(self._pos.is_inference()):
            self._pos.add_(1)

    def advance(self, n: int = 1) -> None:
        """Host bookkeeping after n device-position steps ran (each wrote one token at the
        counter and advanced it): token counts, store lengths, the Packed segments'
        views. Refuses to pass the reserved room (the steps would have been dropped)."""
        t = self.get_seq_length()
        if t + n > self.reserved:
            raise RuntimeError(f"{n} device steps after {t} tokens pass the {self.reserved} reserved")
        for layer in self.layers:
            layer.advance(n)
        if self._pos_at == t:
            self._pos_at = t + n

    def reset(self) -> None:
        super().reset()
        self.reserved, self._pos_at = 0, None  # new stores: reserve again
        self.row_start, self._pad_max = None, 0

    def rewind(self) -> bool:
        """Empty the cache for a new prompt, keeping every buffer where it is (an engine's
        preallocated pool): a `GraphedDecodeStep` captured over it replays on the next
        prompt's steps without a new capture (what `generate` does between calls). Only
        where every layer is fused and its format writes a prefill on the device with
        model-constant tables (fp16, per-token int, KIVI, HQMQ with or without Med3x; not fp8,
        whose scale is fitted on the first write: `KernelStore.
        can_rewind`); False (nothing changed) otherwise: make a new cache. The reserved
        room stays; the device counter is re-set at the next step. Row starts (a left-padded
        batch) are zeroed in place (no padding) and kept where they are: `set_row_start`
        writes the next batch's into the same buffer."""
        if not self.layers or not all(layer.can_rewind() for layer in self.layers):
            return False
        for layer in self.layers:
            layer.rewind()
        self._pos_at = None
        if self.row_start is not None:
            with torch.inference_mode(self.row_start.is_inference()):
                self.row_start.zero_()
            self._pad_max = 0
        return True

    # ---- measurement and diagnostics ----------------------------------------------------
    def check(self) -> None:
        """Raise now any input error a device-encoded decode step flagged (a host sync)."""
        for layer in self.layers:
            layer.check()

    def poll_errors(self) -> None:
        """Raise an input error a device-encoded step flagged, if the host already knows
        of one (`StepErrors.poll`: no sync; what a host-path step does before its write).
        Device-position steps call it after each step, outside the graph."""
        for layer in self.layers:
            if layer.errors is not None and layer.errors.poll():
                layer.errors.check(layer.layer_idx)

    def packed(self, layer_idx: int) -> dict[str, Packed | None]:
        """{"K": Packed, "V": Packed} of one layer (None before its first write)."""
        return dict(self.layers[layer_idx].packed)

    def nbytes(self) -> int:
        """TOTAL bytes, all layers, K and V: `cache_nbytes() + constant_nbytes()`."""
        return sum(layer.nbytes() for layer in self.layers)

    def cache_nbytes(self) -> int:
        """Bytes the cache stores for its writes, all layers, K and V: codes, scales, fitted
        codebooks; not the model constants (quantizers/base.py `Packed.cache_nbytes`)."""
        parts = [layer.cache_nbytes_parts() for layer in self.layers]
        dev = [t for _, d in parts for t in d]  # read once for all layers (one sync, not one per store)
        return sum(h for h, _ in parts) + (int(torch.stack(dev).sum()) if dev else 0)

    def constant_nbytes(self) -> int:
        """Bytes of the model constants (seeded rotations, sketches, secondaries) of every
        layer and role: what a deployment regenerates once per MODEL, whatever the batch
        or the number of caches (0 before the first write)."""
        return sum(layer.constant_nbytes() for layer in self.layers)

    def numel(self) -> int:
        """Number of K/V elements held, all layers, K and V."""
        return sum(layer.numel() for layer in self.layers)

    def attention_route(self, n_heads: int, dtype: torch.dtype) -> str:
        """The routes of the layers' decode steps (`QuantizedLayer.attention_route`), "+"-joined
        where layers differ (e.g. "cuda+dense" when some layers are dense); "" before a write."""
        return "+".join(sorted({layer.attention_route(n_heads, dtype) for layer in self.layers
                                if layer.mode is not None}))

    def nbytes_as_row_caches(self) -> int:
        """What the batch's rows would store as separate one-row caches (batched scoring
        reports this, so its bits equal a one-window-at-a-time run's): the rule of
        `quantizers.fitted.nbytes_as_row_caches` per (layer, role): segments and per-row
        fitted tensors as stored, every other shared tensor once PER ROW."""
        return sum(nbytes_as_row_caches(p, layer.quantizers[role])
                   for layer in self.layers for role, p in layer.packed.items() if p is not None)

    def cache_nbytes_as_row_caches(self) -> int:
        """`nbytes_as_row_caches` without the model constants: the cache bytes of the rows as
        separate one-row caches (fitted tensors once per row, constants never)."""
        return sum(nbytes_as_row_caches(p, layer.quantizers[role], constants=False)
                   for layer in self.layers for role, p in layer.packed.items() if p is not None)

    def bits_per_element(self) -> float:
        """Measured TOTAL: sum of stored bytes (model constants included) x 8 / sum of K/V
        elements over every layer."""
        n = self.numel()
        return self.nbytes() * 8 / n if n else float("nan")

    def cache_bits_per_element(self) -> float:
        """Measured cache bits: `cache_nbytes()` x 8 / K/V elements (constants apart)."""
        n = self.numel()
        return self.cache_nbytes() * 8 / n if n else float("nan")

    def __repr__(self) -> str:
        return f"QuantizedCache({self.spec!r}, layers={len(self.layers)}, seed={self.seed}, tokens={self.get_seq_length()})"


def plain_cache_stats(cache) -> tuple[int, int]:
    """(nbytes, numel) of a plain transformers cache (DynamicCache): its K/V tensors."""
    nbytes = numel = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                nbytes += t.numel() * t.element_size()
                numel += t.numel()
    return nbytes, numel


__all__ = ["QuantizedCache", "QuantizedLayer", "cache_kwarg_name", "cache_kwargs", "plain_cache_stats"]
