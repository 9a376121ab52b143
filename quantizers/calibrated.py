"""Quantizers calibrated on data other than what they code: the hook.

A calibrated quantizer fits model constants of its (layer, role) (codebooks, say)
ONCE per model, on calibration K/V disjoint from what is scored, and codes every
later write with them. The protocol (three names; `Calibrated` below implements
the last two for a plugin):

- `needs_calibration`: True on an instance that cannot code without calibration
  (it may depend on the config: avq's `codebooks=calibrated`);
- `calibrate(x) -> dict[str, Tensor]`: x is float32 `[N, H, T, D]`, N calibration
  windows of this (layer, role)'s K or V (keys after RoPE, as the cache sees
  them); returns the shared tensors it fits, of the shapes and dtypes
  `make_shared` gives (CPU tensors; the cache moves them to the data's device);
- `load_calibration(shared)`: installs them; `empty()` then starts every cache
  with them. An instance that needs calibration and has none refuses to start a
  cache, naming its spec.

Where the calibration K/V come from: suites/harness/calibration.py (an fp16
forward pass over calibration token windows, captured per (layer, role)); the
harness's QuantizedCache takes them (`calibration=`) and refuses, naming the
spec, to build a calibrated quantizer without them.

The calibrated tensors are model constants (fitted once per model, not per write):
a quantizer declares them in `constant_shared()` (quantizers/base.py), so the
cache's own bits do not count them per window. A Packed holds them in its
`shared` tensors, so any instance of the spec decodes it, calibrated or not.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import Packed, QuantizerInputError


class CalibrationMissingError(QuantizerInputError):
    """A calibrated quantizer asked to code without its calibration."""


class Calibrated:
    """Mixin for a Quantizer (list it first). Implement `calibrate(x)`; set
    `needs_calibration` (class or instance: per config) to say whether it is needed."""

    needs_calibration: ClassVar[bool] = True

    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @property
    def calibration(self) -> dict[str, torch.Tensor] | None:
        return getattr(self, "_calibration", None)

    def load_calibration(self, shared: dict[str, torch.Tensor]) -> None:
        """Install fitted shared tensors (what `calibrate` returns): names, dtypes and all but
        the head-dependent shape are checked against `make_shared` when a cache starts."""
        if not isinstance(shared, dict) or not shared or not all(isinstance(t, torch.Tensor)
                                                                 for t in shared.values()):
            raise QuantizerInputError(f"{self.spec}: calibration must be a non-empty dict of tensors, "
                                      f"got {type(shared).__name__}")
        bad = [k for k, t in shared.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise QuantizerInputError(f"{self.spec}: calibrated tensors {bad} hold NaN/Inf")
        self._calibration = {k: t.detach() for k, t in shared.items()}

    def empty(self, like: torch.Tensor) -> Packed:
        packed = super().empty(like)
        if not self.needs_calibration:
            return packed
        cal = self.calibration
        if cal is None:
            raise CalibrationMissingError(
                f"{self.spec} (layer {self.layer}, {self.role}) is calibrated: it codes with tensors fitted once "
                "per model on calibration data, and none were given. Give QuantizedCache(..., calibration=) "
                "the K/V of calibration windows (suites/harness/calibration.py capture_kv), or call "
                "q.load_calibration(q.calibrate(x)) with x [N, H, T, D] K/V not scored")
        shared = dict(packed.shared)
        for name, t in cal.items():
            want = shared.get(name)
            if want is None or want.shape != t.shape or want.dtype != t.dtype:
                got = f"{tuple(t.shape)} {t.dtype}"
                exp = "no such tensor" if want is None else f"{tuple(want.shape)} {want.dtype}"
                raise QuantizerInputError(f"{self.spec} (layer {self.layer}, {self.role}): calibrated tensor "
                                          f"{name!r} is {got}; a cache of {like.shape[1]} kv-heads x "
                                          f"{like.shape[3]} dims stores {exp} (calibrated on another shape?)")
            shared[name] = t.to(like.device)
        return dataclasses.replace(packed, shared=shared)


def needs_calibration(quantizer) -> bool:
    """Whether this quantizer instance must be calibrated before it codes (any plugin
    may say so with a `needs_calibration` attribute)."""
    return bool(getattr(quantizer, "needs_calibration", False))


__all__ = ["Calibrated", "CalibrationMissingError", "needs_calibration"]
