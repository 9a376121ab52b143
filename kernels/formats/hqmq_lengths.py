"""What the host knows of HQMQ + Med3x's per-(b, h) outlier list lengths without waiting on
the device, for `HQMQStore` (kernels/formats/hqmq.py), and the list buffer's reallocation.

A Med3x write of several tokens (`hqmq_med3_write`) is given room for its worst case, half
the chunks of each token, where real data makes a few percent outliers (kernels/formats/
hqmq.py, "Held memory", has the measured case); its lengths are left on the device (the
write makes no host read). `LengthSnapshot` copies them to the host behind the write (CUDA:
pinned memory, non-blocking, an event; a CPU tensor is read in place, as
kernels/step_encode.py's `StepErrors` reads its flags), so a later host step can release
the excess once the copy has landed, with no sync and no torch op to look.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch


def _host_values(t: torch.Tensor) -> np.ndarray:
    """A contiguous int64 host tensor's values, read in place with no torch op (`.numpy()`
    dispatches four, which a step's op count would show)."""
    return np.ctypeslib.as_array((ctypes.c_int64 * t.numel()).from_address(t.data_ptr()))


class LengthSnapshot:
    """The longest list right after a write, and the store's host-side bound then: any
    later bound minus `bound` is what the writes since may have added to any list."""

    def __init__(self, lengths: torch.Tensor, bound: int):
        self.bound, self._longest, self.event = bound, None, None
        if lengths.is_cuda:
            self.host = torch.empty(lengths.shape, dtype=lengths.dtype, pin_memory=True)
            self.host.copy_(lengths, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # (the write has run: the value now, before a later step moves it)
            self._longest = int(_host_values(lengths).max(initial=0))

    def longest(self) -> int | None:
        """The longest list at the snapshot, or None while the copy is still under way."""
        if self._longest is None and self.event.query():
            self._longest = int(_host_values(self.host).max(initial=0))
        return self._longest


def resized(outliers: torch.Tensor, cap: int, keep: int) -> torch.Tensor:
    """`outliers` `[B, H, Ocap, 4]` reallocated to `cap` entries per list, the first `keep`
    (at least every list's length) copied; the rest is never read. Made under the old
    buffer's inference mode, as `TokenBuffer.extend` makes its buffers."""
    with torch.inference_mode(outliers.is_inference()):
        out = outliers.new_empty(outliers.shape[:2] + (cap,) + outliers.shape[3:])
        keep = min(keep, cap, outliers.shape[2])
        out[:, :, :keep] = outliers[:, :, :keep]
    return out


__all__ = ["LengthSnapshot", "resized"]
