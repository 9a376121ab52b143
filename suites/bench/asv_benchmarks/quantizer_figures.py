"""Per-quantizer figures for every registered quantizer's example configs.

- track_bits_per_element: bits measured from the stored bytes (METHOD.md 3) of a
  seeded reference tensor `[1, 4, 256, d]` (keys, layer 0, seed 0), the total;
- track_cache_bits_per_element: the same without the model constants (seeded
  rotations, secondaries: quantizers/base.py `Packed.cache_bits_per_element`);
- track_roundtrip_error: relative L2 round-trip error ||x^ - x|| / ||x|| on the
  same tensor with two outlier channels scaled 20x (the structure of real keys);
- time_encode / time_decode: one write of `[1, 2, 256, d]` on the CPU (one thread)
  and the decode of what it stored;
- peakmem_packed_cache: peak RSS while coding K and V of 4 layers x 3 kv heads x
  1024 tokens (SmolLM2's cache shape) and keeping the packed store.

Everything is deterministic (seeded), so track_ figures change only when the code does.
"""
from __future__ import annotations

import torch

from .common import SPECS, CachedFigures, cached_figure, head_dim_for, quantizer_or_skip

OUTLIERS = (1, 35)  # channels scaled up; both < 64


def _reference(d: int, tokens: int, heads: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, tokens, d, generator=g)
    for c in OUTLIERS:
        x[..., c] *= 20.0
    return x


class Figures(CachedFigures):
    """Bits and round-trip error: computed once for all specs (setup_cache)."""

    params = [SPECS]
    param_names = ["spec"]
    timeout = 1200

    def setup_cache(self):
        out = {}
        for spec in SPECS:
            try:
                q = quantizer_or_skip(spec, role="K", layer=0, seed=0)
                x = _reference(head_dim_for(spec), tokens=256, heads=4)
            except NotImplementedError:
                continue
            packed = q.encode(x)
            y = q.decode(packed).float()
            out[spec] = {"bits": packed.bits_per_element, "cache_bits": packed.cache_bits_per_element,
                         "err": ((y - x).norm() / x.norm()).item()}
        return out

    track_bits_per_element = cached_figure("bits", "bits")
    track_cache_bits_per_element = cached_figure("cache_bits", "bits")
    track_roundtrip_error = cached_figure("err", "relative L2 error")


class Codec:
    """CPU time of one write and of decoding it (one thread: stable figures)."""

    params = [SPECS]
    param_names = ["spec"]
    timeout = 300

    def setup(self, spec):
        torch.set_num_threads(1)
        self.q = quantizer_or_skip(spec, role="K", layer=0, seed=0)
        self.x = _reference(head_dim_for(spec), tokens=256, heads=2)
        self.empty = self.q.empty(self.x)  # shared tensors (codebooks) made once, as per layer
        self.packed = self.q.append(self.empty, self.x)

    def time_encode(self, spec):
        self.q.append(self.empty, self.x)

    def time_decode(self, spec):
        # decode_tokens directly: Quantizer.decode memoises each segment's decode.
        p = self.packed
        for seg in p.segments:
            self.q.decode_tokens(seg, p.shared, (p.batch, p.heads, seg.tokens, p.head_dim))


class PackedCache:
    """Peak memory of writing a small model's K/V cache through the quantizer."""

    params = [SPECS]
    param_names = ["spec"]
    timeout = 600
    LAYERS, HEADS, TOKENS = 4, 3, 1024

    def setup(self, spec):
        torch.set_num_threads(1)
        quantizer_or_skip(spec)
        self.d = head_dim_for(spec)

    def peakmem_packed_cache(self, spec):
        store = []
        for layer in range(self.LAYERS):
            for i, role in enumerate(("K", "V")):
                q = quantizer_or_skip(spec, role=role, layer=layer, seed=0)
                x = _reference(self.d, tokens=self.TOKENS, heads=self.HEADS, seed=2 * layer + i)
                store.append(q.encode(x))
                del x
        return store
