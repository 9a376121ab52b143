"""The encode section: HQMQ encode throughput (chunks/s) beside an arithmetic floor.

Three figures per spec on the same synthetic keys: the kernel search alone, the
full encode with the kernel search (torch radii/median/u + kernel search +
torch radius codes and bit packing), and the torch search (on at most 2^18
chunks per head, it is slow). The floor is what the FP32 lanes of the GPU could
do if the search loop body were its only work.
"""
from __future__ import annotations

import torch

from ....kernels.hqmq_encode import encode_with_kernel, hqmq_search
from ....quantizers import get_quantizer
from ..toolkit import DEVICE, synthetic_kv, timeit_us
from .config import ENCODE_SPECS, LatencyConfig

OPS_PER_CHUNK_SECONDARY = 32  # FP32-pipe instructions of the search loop body, counted from the source
FP32_LANES_PER_SM = 128


def unit_chunks(x: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, d]` as unit quaternions `[B, H, T*d/4, 4]` (zero chunks -> 1)."""
    B, H = x.shape[:2]
    chunks = x.float().reshape(B, H, -1, 4)
    r = chunks.norm(dim=-1, keepdim=True)
    return torch.where(r > 0, chunks / torch.where(r > 0, r, torch.ones_like(r)), chunks.new_tensor([1.0, 0, 0, 0]))


def encode_section(cfg: LatencyConfig, sm_count: int, clock_mhz: float, log) -> dict:
    B, H, T, d = 1, cfg.hkv, cfg.encode_tokens, cfg.d
    x, _ = synthetic_kv(B, H, T, d, DEVICE, seed=5)
    n = B * H * T * d // 4
    out = {"shape": [B, H, T, d], "chunks": n}
    u = unit_chunks(x)
    for spec in ENCODE_SPECS:
        q = get_quantizer(spec, role="K")
        shared = {k: v.to(DEVICE) for k, v in q.make_shared(H, d).items()}
        sec = q.secondaries(shared)
        S = q.config.S
        res = {"spec": spec}
        t = timeit_us(lambda: hqmq_search(u, sec), rep_ms=200)
        res["kernel_search_us"], res["kernel_search_chunks_per_s"] = t, n / t * 1e6
        t = timeit_us(lambda: encode_with_kernel(q, x), rep_ms=200)
        res["full_encode_us"], res["full_encode_chunks_per_s"] = t, n / t * 1e6
        n_small = min(u.shape[2], 1 << 18)
        t = timeit_us(lambda: q.search(u[:, :, :n_small], shared), rep_ms=200)
        res["torch_search_chunks_per_s"] = B * H * n_small / t * 1e6
        if sm_count and clock_mhz:
            lanes = sm_count * FP32_LANES_PER_SM * clock_mhz * 1e6
            res["arith_floor_chunks_per_s"] = lanes / (OPS_PER_CHUNK_SECONDARY * S)
            res["floor_note"] = (f"{sm_count} SMs x {FP32_LANES_PER_SM} FP32 lanes x {clock_mhz} MHz / "
                                 f"({OPS_PER_CHUNK_SECONDARY} instructions per (chunk, secondary) x S={S})")
            res["kernel_frac_of_floor"] = res["kernel_search_chunks_per_s"] / res["arith_floor_chunks_per_s"]
        log(f"encode {spec}: kernel search {res['kernel_search_chunks_per_s']:.3g} chunks/s, full encode "
            f"{res['full_encode_chunks_per_s']:.3g}, torch search {res['torch_search_chunks_per_s']:.3g}"
            + (f", floor {res['arith_floor_chunks_per_s']:.3g}" if "arith_floor_chunks_per_s" in res else ""))
        out[spec] = res
    return out
