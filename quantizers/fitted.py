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
        """The shared tensors a first write of x would store (for error bounds)."""
        shared = self.empty(x).shared
        return {**shared, **self.fit_shared(x.float(), shared)}

    def append(self, packed, x):
        if packed is not None and not packed.segments:
            self.check_input(x)
            self._check_compatible(packed, x)
            fitted = self.fit_shared(x.float(), packed.shared)
            packed = dataclasses.replace(packed, shared={**packed.shared, **fitted})
        return super().append(packed, x)


__all__ = ["FitsOnFirstWrite"]
