"""Shared tensors fitted on the first write, for the calibration-free methods
that learn something from the data they store (flat VQ's and additive VQ's
codebooks, spherical's outlier channels, fp8's scale).

`make_shared` still creates every shared tensor, with its final shape and dtype
(unfitted values), so a packed cache's format never depends on the data. The
first write into an empty cache (no segments yet) replaces them with values
fitted on that write, and every later append codes with them unchanged: at
prefill-then-decode the prefill fits, the decode steps reuse (a one-token
write could not fit a codebook, and re-fitting per write would store a
codebook per token). Under quantize-on-write each window is one write, so the
fit sees the whole window, later tokens included (METHOD.md section 4 caveat).
Appended writes therefore differ from one big write.

Per row (`fit_per_row = True`, the default): a cache of B sequences (batch rows)
fits B sets of tensors, row b's on row b's tokens alone, as a deployed cache
serves each sequence, and codes row b with row b's. The per-row tensors
(`per_row_shared()`) are stored with a leading row dimension: `make_shared`
gives them as ONE row, `[1, ...]`; an empty cache of B rows holds B copies,
`[B, ...]`, each replaced by its row's fit. `fit_shared` sees one row at a time
(`x[b:b+1]`, the shared tensors with row b's), so row b's tensors are, byte for
byte, what a one-row cache of that sequence fits; the segments of a B-row write
are those of B one-row writes (the quantizers broadcast row b's tensors over
row b), and `nbytes_as_row_caches` counts per-row tensors once per row (they
ARE one per row) and the rest once per row too: a batch measures the bits of
one window at a time. A quantizer whose fit spans rows sets `fit_per_row =
False` (fp8, whose `[H]` scale the fused kernels read): `fit_shared` then sees
the whole write and the batch harness scores it one window at a time.

Error bounds of such a quantizer depend on what was fitted, so `error_bound(x)`
bounds x as coded with `fitted_shared(x)`: the shared tensors of the first
write this instance coded last (x is then a write into that cache: the
prefill itself or a later append), or, before any write or for another
shape, those that x's own first write would store. A quantizer instance
serves one (layer, role) of one cache, so "last" is that cache.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import CorruptPackedError, Packed, check_stored_finite


class FitsOnFirstWrite:
    """Mixin for a Quantizer: implement `fit_shared(x, shared) -> dict` (float32 x
    of the first write, one row `[1, H, T, D]` when `fit_per_row`; returns the
    shared tensors it replaces, per-row ones as one row `[1, ...]`) and, when
    `fit_per_row`, `per_row_shared()` (the names it may return)."""

    append_matches_single_write = False
    # One fit per batch row (module docstring); False: one fit over the whole write.
    fit_per_row: ClassVar[bool] = True

    def fit_shared(self, x: torch.Tensor, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def fits_rows_at_once(self) -> bool:
        """Whether `fit_shared_rows` fits every row of a write at once (a plugin that defines it
        may decline per config)."""
        return type(self).fit_shared_rows is not FitsOnFirstWrite.fit_shared_rows

    def fit_shared_rows(self, x: torch.Tensor, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Optional: what `fit_shared` returns for each row of x `[B, H, T, D]`, concatenated
        over rows (`[B, ...]`), each row's fit exactly what `fit_shared` gives it alone (its
        seeded draws included). Defined where the fit batches over rows (vq's k-means takes
        independent groups), so a B-row write costs one fit's launches, not B. Byte for byte
        on the CPU (test_fitted_rows); on a GPU a batched matmul may sum in another order
        than a one-row one (cuBLAS picks kernels per batch shape), as batching windows does."""
        raise NotImplementedError

    def per_row_shared(self) -> tuple[str, ...]:
        """Names of the shared tensors fitted per row, stored `[rows, ...]` (this config's;
        empty when it fits nothing)."""
        return ()

    def _row_names(self) -> tuple[str, ...]:
        return tuple(self.per_row_shared()) if self.fit_per_row else ()

    def empty(self, like: torch.Tensor) -> Packed:
        """A cache of `like`'s B rows: the per-row shared tensors repeated to B rows."""
        packed = super().empty(like)
        names = self._row_names()
        if not names:
            return packed
        B = like.shape[0]
        shared = {k: v.repeat(B, *[1] * (v.dim() - 1)) if k in names else v for k, v in packed.shared.items()}
        return dataclasses.replace(packed, shared=shared)

    def empty_for(self, first: torch.Tensor) -> Packed:
        """`empty(first)` with the tensors `append` fits on the first write fitted on `first`
        (checked as `append` checks it); no segment."""
        self.check_input(first)
        packed = self.empty(first)
        return dataclasses.replace(packed, shared={**packed.shared, **self._fit(first.float(), packed.shared)})

    def _fit(self, x: torch.Tensor, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the first write `x` (float32) replaces in `shared` (a cache of x's rows)."""
        names = self._row_names()
        if not self.fit_per_row:
            return self.fit_shared(x, shared)

        def per_row_only(fitted: dict, method: str) -> dict:
            extra = set(fitted) - set(names)
            if extra:  # a plugin bug: these would be fitted on one row but shared by all
                raise TypeError(f"{type(self).__name__}.{method} returned {sorted(extra)}, not in per_row_shared()")
            return fitted
        if x.shape[0] > 1 and self.fits_rows_at_once():
            # the rows' fits as one batched fit: the same tensors as the loop below, in one
            # launch per step instead of one per row on a GPU
            return per_row_only(self.fit_shared_rows(x, shared), "fit_shared_rows")
        rows = [per_row_only(self.fit_shared(x[b:b + 1], {k: v[b:b + 1] if k in names else v
                                                          for k, v in shared.items()}), "fit_shared")
                for b in range(x.shape[0])]  # row b's fit sees row b's tokens and tensors only
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def fitted_shared(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The shared tensors x is coded with (see the module docstring)."""
        key = (x.shape[0], x.shape[1], x.shape[3], x.device)
        last = getattr(self, "_last_fit", None)
        if last is not None and last[0] == key:
            return last[1]
        shared = self.empty(x).shared
        return {**shared, **self._fit(x.float(), shared)}

    def append(self, packed, x):
        if packed is not None and not packed.segments:
            self.check_input(x)
            self._check_compatible(packed, x)
            fitted = self._fit(x.float(), packed.shared)
            packed = dataclasses.replace(packed, shared={**packed.shared, **fitted})
            self._last_fit = ((x.shape[0], x.shape[1], x.shape[3], x.device), packed.shared)
        return super().append(packed, x)

    def appends_one_segment(self) -> bool:
        # After the first write's fit this append is the base's (shared tensors fixed).
        return type(self).append is FitsOnFirstWrite.append

    def check_packed(self, packed) -> None:
        """The base checks, with each per-row shared tensor checked for one row per batch
        row (`[packed.batch, ...]`, each row of the one-row layout, every value finite)."""
        names = self._row_names()
        if (names and isinstance(packed, Packed) and packed.spec == self.spec and isinstance(packed.shared, dict)
                and isinstance(packed.batch, int) and packed.batch > 0):
            shared = dict(packed.shared)
            for name in names:
                t = shared.get(name)
                if not isinstance(t, torch.Tensor):
                    continue  # the base check names it
                if t.dim() == 0 or t.shape[0] != packed.batch:
                    raise CorruptPackedError(f"shared tensor {name!r} has shape {tuple(t.shape)}; the format stores "
                                             f"one per batch row: [{packed.batch}, ...]")
                if t.is_floating_point():
                    check_stored_finite(t, f"shared tensor {name!r}")
                shared[name] = t[:1]  # the base compares one row with make_shared's one-row layout
            packed = dataclasses.replace(packed, shared=shared)
        super().check_packed(packed)


def nbytes_as_row_caches(packed: Packed, quantizer=None, *, constants: bool = True) -> int:
    """Bytes the rows of `packed` would store as separate one-row caches: every segment
    byte, the per-row shared tensors as stored (one row each already), and every other
    shared tensor (a seeded rotation, a whole-write fit) once PER ROW. `constants=False`
    leaves out the model constants (`packed.constant`, base.py): the CACHE bytes of the
    rows, to which a model's constants are never charged. `quantizer`: the one that
    wrote `packed` (default: its spec's)."""
    if quantizer is None:
        from . import get_quantizer

        quantizer = get_quantizer(packed.spec)
    per_row = set(quantizer._row_names()) if isinstance(quantizer, FitsOnFirstWrite) else set()
    left_out = set() if constants else set(packed.constant)
    common = sum(t.numel() * t.element_size() for k, t in packed.shared.items()
                 if k not in per_row and k not in left_out)
    return (packed.nbytes if constants else packed.cache_nbytes) + (packed.batch - 1) * common


def fold_rows(r: torch.Tensor, cb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks r `[B, H, N, dim]` and per-row codebooks cb `[R, G, M, K, dim]` (R = 1 or B
    rows, G = H or 1 groups) as the `[B', G', N', dim]` and `[G', M, K, dim]` that
    vq.residual_search takes, so that every chunk meets its own row's (and head's)
    codebooks, with no copy of the codebooks per row or head: R = 1 is the one-row
    call itself; shared by the heads (G = 1), rows become groups and each row's heads
    one run of chunks; else every (row, head) is a group. Codes come back in r's order
    (reshape to `[B, H, N, M]`)."""
    B, H, N, dim = r.shape
    if cb.shape[0] == 1:
        return r, cb[0]
    if cb.shape[1] == 1:
        return r.reshape(1, B, H * N, dim), cb[:, 0]
    return r.reshape(1, B * H, N, dim), cb.flatten(0, 1)


def row_index(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """arange over the row dimension of a per-row tensor `t` ([1 or B, ...]), shaped to
    broadcast over `ndim` index dims: a one-row tensor serves every row."""
    return torch.arange(t.shape[0], device=t.device).view(-1, *[1] * (ndim - 1))


__all__ = ["FitsOnFirstWrite", "fold_rows", "nbytes_as_row_caches", "row_index"]
