"""Shared tensors fitted on the first write, for the calibration-free methods
that learn something from the data they store (fp8's scale, flat VQ's and
additive VQ's codebooks).

`make_shared` still creates every shared tensor, with its final shape and dtype
(unfitted values), so a packed cache's format never depends on the data. The
first write into an empty cache (no segments yet) replaces them with values
fitted on that write, and every later append codes with them unchanged: at
prefill-then-decode the prefill fits, the decode steps reuse (a one-token
write could not fit a codebook, and re-fitting per write would store a
codebook per token). Under quantize-on-write each window is one write, so the
fit sees the whole window, later tokens included (METHOD.md section 4 caveat).
Appended writes therefore differ from one big write.

Error bounds of such a quantizer depend on what was fitted, so `error_bound(x)`
bounds x as coded with `fitted_shared(x)`: the shared tensors of the first
write this instance coded last (x is then a write into that cache: the
prefill itself or a later append), or, before any write or for another
shape, those that x's own first write would store. A quantizer instance
serves one (layer, role) of one cache, so "last" is that cache.
"""
from __future__ import annotations

import dataclasses

import torch


class FitsOnFirstWrite:
    """Mixin for a Quantizer: implement `fit_shared(x, shared) -> dict` (float32
    x of the first write; returns the shared tensors it replaces)."""

    append_matches_single_write = False

    def fit_shared(self, x: torch.Tensor, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def fitted_shared(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The shared tensors x is coded with (see the module docstring)."""
        key = (x.shape[1], x.shape[3], x.device)
        last = getattr(self, "_last_fit", None)
        if last is not None and last[0] == key:
            return last[1]
        shared = self.empty(x).shared
        return {**shared, **self.fit_shared(x.float(), shared)}

    def append(self, packed, x):
        if packed is not None and not packed.segments:
            self.check_input(x)
            self._check_compatible(packed, x)
            fitted = self.fit_shared(x.float(), packed.shared)
            packed = dataclasses.replace(packed, shared={**packed.shared, **fitted})
            self._last_fit = ((x.shape[1], x.shape[3], x.device), packed.shared)
        return super().append(packed, x)


__all__ = ["FitsOnFirstWrite"]
