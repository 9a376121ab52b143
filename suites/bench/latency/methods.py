"""The decode-step attention calls being timed, each built once per shape:

- `fp16-sdpa`: fp16 K/V through torch SDPA (flash backend with native GQA when it
  runs here, else torch's default, said so in the row);
- `fused-*`: kvqbench.kernels' fused decode attention over the packed bytes,
  with a launch config (block/warps/stages, splits, HQMQ's codeword table);
- `fake-quant`: what the public benchmark compared against: the whole packed
  HQMQ cache decoded to fp16 by the quantizer's torch decode, then the same SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....kernels.decode_attention import decode_attention
from .caches import EncodedCache, hqmq_segment
from .timing import DEVICE, GPU

# HQMQ codeword sources (layout.HQMQFlat.with_table): secondaries + arithmetic, or the full codebook
TABLES = {"sec32": ("secondaries", torch.float32), "sec16": ("secondaries", torch.float16),
          "cb32": ("codebook", torch.float32), "cb16": ("codebook", torch.float16)}


def run_sdpa(q, k, v, backend: str):
    if backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


_SDPA_BACKEND: dict = {}


def sdpa_backend() -> tuple[str, list[str]]:
    """The flash backend with native GQA if it runs here, else torch's default, and why
    flash was refused (found once per process)."""
    if not _SDPA_BACKEND:
        q = torch.randn(1, 4, 1, 64, device=DEVICE, dtype=torch.float16)
        k = torch.randn(1, 2, 256, 64, device=DEVICE, dtype=torch.float16)
        errors = []
        if GPU:
            try:
                run_sdpa(q, k, k, "flash")
                _SDPA_BACKEND.update(name="flash", errors=errors)
            except RuntimeError as e:  # "No available kernel" on GPUs or builds without flash
                errors.append(f"flash: {type(e).__name__}: {str(e)[:200]}")
        if not _SDPA_BACKEND:
            run_sdpa(q, k, k, "default")
            _SDPA_BACKEND.update(name="default", errors=errors)
    return _SDPA_BACKEND["name"], _SDPA_BACKEND["errors"]


def sdpa_callable(q, k, v):
    """(call, backend name, why flash was refused)."""
    backend, errors = sdpa_backend()
    return (lambda: run_sdpa(q, k, v, backend)), backend, errors


def fused_callable(q, kf, vf, launch: dict):
    """The fused call with a launch config: decode_attention's keywords (block_t,
    num_warps, num_stages, programs_per_sm, ...), plus `table` (HQMQ: one of TABLES,
    the codeword source the kernel gathers from)."""
    launch = dict(launch)
    table = launch.pop("table", None)
    if table:
        mode, dtype = TABLES[table]
        kf, vf = kf.with_table(mode, dtype), vf.with_table(mode, dtype)
    return lambda: decode_attention(q, kf, vf, **launch)


def fake_quant_callable(q, cache: EncodedCache, kf, vf):
    """Decode the whole tiled HQMQ cache with the quantizer's torch decode, then SDPA
    (the same backend as the fp16 baseline)."""
    shape = (kf.B, kf.H, kf.T, kf.D)
    sk, sv = hqmq_segment(kf), hqmq_segment(vf)
    backend, _ = sdpa_backend()

    def fn():
        kh = cache.qk.decode_tokens(sk, cache.pk.shared, shape).to(torch.float16)
        vh = cache.qv.decode_tokens(sv, cache.pv.shared, shape).to(torch.float16)
        return run_sdpa(q, kh, vh, backend)

    return fn
