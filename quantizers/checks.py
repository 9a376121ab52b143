"""Value checks that need not synchronise with the device on every call.

A check that reads a tensor's value (NaN/Inf in the input, a scale beyond fp16, a
code out of range, a decode that overflows) makes the host wait for the device. A
decode step of a quantized cache ran ~6-20 of them per layer and role (measured on
SmolLM2: 190-560 host reads per decode step), which serialises host and device.

    require(bad, lambda: QuantizerInputError(f"... {float(mx):.4g} ..."))

Outside `deferred_checks()` this raises at once, as an `if bool(bad): raise` would.
Inside, the verdict (a bool tensor on the device) is queued and `flush()` reads all
queued verdicts with ONE synchronisation and raises the error of the first failed
check, so a bad value still fails loudly with the same message, only later: at the
end of the block, or wherever its owner flushes (the perplexity protocols flush
before they read the loss, which synchronises anyway). The error factory runs only
on failure; keep what it captures small (reductions such as a max or a count, not
the input), since queued checks hold it until the flush.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

_local = threading.local()
MAX_QUEUED = 4096


def _queue() -> list | None:
    return getattr(_local, "queue", None)


class StickyChecks:
    """Verdicts of a piece of work that is replayed (a CUDA graph of a decode step): inside
    `with checks.step():`, the k-th `require` of the step ORs its verdict into persistent
    device flag k (an in-place op, so a captured step keeps ORing on every replay) and
    remembers its error factory; `check()` reads every flag with one synchronisation and
    raises the first failed check's error. The same code runs every step, so the k-th
    require is the same check each time. A factory that quotes a tensor quotes its value
    as of the last run (a replay overwrites it): the message says so."""

    def __init__(self, where: str):
        self.where = where
        self.flags: list[torch.Tensor] = []
        self.errors: list[Callable[[], Exception]] = []
        self.watched: list[tuple[torch.Tensor, Callable[[], Exception]]] = []
        self._next: int | None = None

    @contextlib.contextmanager
    def step(self):
        saved = getattr(_local, "sticky", None)
        _local.sticky, self._next = self, 0
        try:
            yield
        finally:
            _local.sticky, self._next = saved, None

    def _note(self, bad: torch.Tensor, error: Callable[[], Exception]) -> None:
        k, self._next = self._next, self._next + 1
        if k == len(self.flags):  # first run of the step (a warm-up, before any capture)
            self.flags.append(torch.zeros((), dtype=torch.bool, device=bad.device))
            self.errors.append(error)
        self.errors[k] = error
        self.flags[k].logical_or_(bad.reshape(()))

    def watch(self, flag: torch.Tensor, error: Callable[[], Exception]) -> None:
        """A flag a kernel of the step raises itself (one element, nonzero: failed), read by
        `check` after the `require` flags (kept apart: those are matched by their order)."""
        self.watched.append((flag.reshape(()), error))

    def check(self) -> None:
        flags = self.flags + [f for f, _ in self.watched]
        if not flags:
            return
        errors = self.errors + [e for _, e in self.watched]
        for failed, error in zip(torch.stack([f.bool() for f in flags]).tolist(), errors):
            if failed:
                e = error()
                raise type(e)(f"{self.where} (values quoted are those of the last step): {e}") from e


def require(bad: torch.Tensor | bool, error: Callable[[], Exception]) -> None:
    """Raise `error()` if `bad` (a bool, or a bool tensor of one element) is true: now,
    or at the next `flush()` inside `deferred_checks()` (inside a `StickyChecks.step()`:
    at its `check()`)."""
    sticky = getattr(_local, "sticky", None)
    if sticky is not None and isinstance(bad, torch.Tensor):
        sticky._note(bad, error)
        return
    queue = _queue()
    if queue is None or not isinstance(bad, torch.Tensor):
        if bool(bad):
            raise error()
        return
    queue.append((bad.reshape(()), error))
    if len(queue) >= MAX_QUEUED:  # bound what waits (and the one stack at the flush)
        flush()


def flush() -> None:
    """Read every queued verdict (one host synchronisation) and raise the first failure."""
    queue = _queue()
    if not queue:
        return
    items = list(queue)
    queue.clear()
    verdicts = torch.stack([b.to(items[0][0].device) for b, _ in items]).tolist()
    for (_, error), failed in zip(items, verdicts):
        if failed:
            raise error()


@contextlib.contextmanager
def deferred_checks():
    """Queue the value checks made inside and flush them on leaving; an error raised
    inside propagates as it is (the queue is dropped). Nested blocks share the queue."""
    if _queue() is not None:
        yield
        return
    _local.queue = []
    ok = False
    try:
        yield
        ok = True
    finally:
        try:
            if ok:
                flush()
        finally:
            _local.queue = None


__all__ = ["StickyChecks", "deferred_checks", "flush", "require"]
