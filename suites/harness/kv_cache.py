"""A transformers KV cache that stores K and V through any registered quantizer.

    cache = QuantizedCache("hqmq:S=96,r=4", config=model.config, seed=0)
    out = model(input_ids, **cache_kwargs(model, cache), use_cache=True)
    cache.bits_per_element()      # measured from the packed bytes of every layer

Every write goes into the packed store of its (layer, role) through the quantizer's
`append`, and what attention reads back is the DECODED history, the current write
included. So:

- `quantize-on-write`: one forward pass over a window from a fresh cache; every K/V
  that attention reads, prefill included, has been through quantize/dequantize.
- `prefill-then-decode`: the same cache, used with a prefill call and then one-token
  calls; each decode step appends its one token to the packed store (`append`) and
  attention reads the dequantized history. Quantizers whose state spans writes
  (KIVI's fp16 window, a per-write Med3x median) see exactly the write pattern a
  deployed cache sees.

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
attention is exact; the cache just stores (and counts) more than a sliding cache would.

The installed transformers names the forward/generate argument either `cache`
(newer 5.x; `past_key_values` is a deprecated alias) or `past_key_values` (older):
`cache_kwargs(model, cache)` returns the right one.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ...quantizers import Packed, get_quantizer

ROLES = ("K", "V")
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


class QuantizedLayer(DynamicLayer):
    """One model layer: packed K and V stores plus the decoded history attention reads.

    `self.keys` / `self.values` always hold the decoded history (what attention read
    last), so the inherited DynamicLayer bookkeeping stays valid; the packed stores
    are the ground truth and the only thing counted as storage.
    """

    is_croppable = False  # the packed store cannot be rolled back token by token

    def __init__(self, spec: str, layer_idx: int, seed: int = 0):
        super().__init__()
        self.spec, self.layer_idx, self.seed = spec, layer_idx, seed
        self.quantizers = {r: get_quantizer(spec, layer=layer_idx, role=r, seed=seed) for r in ROLES}
        self.packed: dict[str, Packed | None] = {r: None for r in ROLES}
        # (packed, decoded) of the last read per role: segments shared with it are
        # not re-concatenated from their pieces on the next read.
        self._last_read: dict[str, tuple[Packed, torch.Tensor] | None] = {r: None for r in ROLES}
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
        self.keys = self._write("K", key_states)
        self.values = self._write("V", value_states)
        return self.keys, self.values

    def _write(self, role: str, x: torch.Tensor) -> torch.Tensor:
        q = self.quantizers[role]
        self.packed[role] = q.append(self.packed[role], x)  # append(None, x) == encode(x)
        return self.read(role)

    def read(self, role: str) -> torch.Tensor:
        """The decoded history of `role` ("K" or "V"), `[B, H, T, D]`, in the written dtype."""
        q, packed = self.quantizers[role], self.packed[role]
        last = self._last_read[role]
        n_same, t_same = 0, 0
        if last is not None:
            # Segments are immutable; a segment object shared with the last read decodes
            # to the same values. (KIVI replaces its trailing fp16 segment on each write,
            # a tampered segment is a new object: both end the shared prefix.)
            for a, b in zip(last[0].segments, packed.segments):
                if a is not b:
                    break
                n_same, t_same = n_same + 1, t_same + a.tokens
        if n_same == 0:
            out = q.decode(packed)
        elif n_same == len(packed.segments) and t_same == last[1].shape[2]:
            out = last[1]
        else:
            rest = q.decode(dataclasses.replace(packed, segments=packed.segments[n_same:]))
            out = torch.cat([last[1][:, :, :t_same], rest], dim=2)
        self._last_read[role] = (packed, out)
        return out

    def replace_packed(self, role: str, packed: Packed) -> None:
        """Swap in another packed store (diagnostics: e.g. tampered bytes). The next
        read decodes it afresh for every segment that is a new object."""
        self.packed[role] = packed
        if role == "K":
            self.keys = self.read("K")
        else:
            self.values = self.read("V")

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packed.values() if p is not None)

    def numel(self) -> int:
        return sum(p.numel for p in self.packed.values() if p is not None)

    def reset(self) -> None:
        self.packed = {r: None for r in ROLES}
        self._last_read = {r: None for r in ROLES}
        # Drop (never zero in place) the decoded tensors: they may be the very tensors the
        # segments cache as their decoded values. With is_initialized cleared first, the
        # base reset only resets its own bookkeeping.
        self.keys = self.values = None
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

    QuantizedCache(spec, n_layers=None, *, config=None, seed=0)

    Give `config=model.config` (preferred: the layer count and layer types are
    checked) or `n_layers`; with neither, layers are created as `update` reaches them.
    """

    def __init__(self, spec: str, n_layers: int | None = None, *, config=None, seed: int = 0):
        get_quantizer(spec)  # fail on a bad spec now, not inside the forward pass
        self.spec, self.seed = spec, int(seed)
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
        layers = [QuantizedLayer(spec, i, self.seed) for i in range(n_layers or 0)]
        super().__init__(layers=layers)  # an explicit (possibly empty) list: no layer_class_to_replicate

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # lazily grown when no layer count was given
            self.layers.append(QuantizedLayer(self.spec, len(self.layers), self.seed))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ---- measurement and diagnostics ----------------------------------------------------
    def packed(self, layer_idx: int) -> dict[str, Packed | None]:
        """{"K": Packed, "V": Packed} of one layer (None before its first write)."""
        return dict(self.layers[layer_idx].packed)

    def nbytes(self) -> int:
        """Every byte the quantized cache stores, all layers, K and V (codebooks included)."""
        return sum(layer.nbytes() for layer in self.layers)

    def numel(self) -> int:
        """Number of K/V elements held, all layers, K and V."""
        return sum(layer.numel() for layer in self.layers)

    def bits_per_element(self) -> float:
        """Measured: sum of stored bytes x 8 / sum of K/V elements over every layer."""
        n = self.numel()
        return self.nbytes() * 8 / n if n else float("nan")

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
