"""Values derived from a stored tensor (unpacked sign bits, a rotation's inverse, an fp16
codebook), built once per tensor and reused while it lives unchanged.

A decode step writes one token per layer and role; a quantizer that rebuilt such values
on every write spent most of its torch ops there (spherical: Sylvester's matrix and a
Newton-Schulz inverse per call, ~170 of ~450 ops per layer and step; avq / hadamard-int:
the sign bits unpacked per call). The cache is keyed by the source TENSOR, not its
address: an entry holds a weak reference and the tensor's in-place write counter, so a
freed tensor whose address is reused, or a tensor written in place, never serves a stale
value (kernels/cuda_hqmq.py learnt this keying by data_ptr). An entry goes with its
tensor. Callers must not modify a returned value in place.
"""
from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")
_CACHE: dict = {}  # (identity(source), key) -> (weak reference, version, value)

# The identity number of an object in a per-call cache key: `object.__hash__`, not `id`.
# CPython audits every id() call (event "builtins.id"), so once any library has installed a
# Python audit hook each id() runs Python: filelock >= 4.3 installs one on CPython >= 3.12
# when it is imported (so does every process that imports transformers), and an HQMQ CUDA plan
# key's 16 ids then cost ~3 us more per call (H100 host, 2026-12-07; Python 3.12 on a CPU
# shows it: id() 25 -> 445 ns, reports/latency/audit_hook_cpu_2026-12-07.txt). object's
# hash is CPython's pointer hash, the address rotated by 4 bits: one number per live
# object, as id() is, and not audited. (A tensor's own __hash__ calls id().)
identity = object.__hash__


def tensor_version(t: torch.Tensor) -> int:
    """t's in-place write counter; an inference tensor has none (reading it raises) and
    cannot be written in place outside inference mode: -1, a constant."""
    return -1 if t.is_inference() else t._version


def derived(source: torch.Tensor, key: Hashable, build: Callable[[], T]) -> T:
    """build(), computed once per (source, key) while `source` lives unwritten."""
    k = (identity(source), key)
    hit = _CACHE.get(k)
    if hit is not None and hit[0]() is source and hit[1] == tensor_version(source):
        return hit[2]
    value = build()
    ref = weakref.ref(source, lambda _dead, k=k: _drop(k, _dead))
    _CACHE[k] = (ref, tensor_version(source), value)
    return value


def _drop(k, dead_ref) -> None:
    hit = _CACHE.get(k)
    if hit is not None and hit[0] is dead_ref:  # (a newer entry under a reused address stays)
        del _CACHE[k]


__all__ = ["derived", "identity", "tensor_version"]
