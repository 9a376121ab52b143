"""The memory section: stored bytes per token per layer of each quantizer against
fp16, measured from `Packed.nbytes` at two lengths (so the per-token slope and
the fixed bytes, codebooks and windows, are told apart), and a PROJECTION to a
large model at long context computed from those two figures and a config.
"""
from __future__ import annotations

from ....quantizers import get_quantizer
from ..toolkit import DEVICE, synthetic_kv
from .config import MEMORY_SPECS, PROJECTION, LatencyConfig


def memory_section(cfg: LatencyConfig, log) -> dict:
    H, d = cfg.hkv, cfg.d
    t1, t2 = cfg.memory_tokens // 2, cfg.memory_tokens
    k, v = synthetic_kv(1, H, t2, d, DEVICE, seed=9)
    rows = []
    fp16_per_token = 2 * H * d * 2
    for spec in MEMORY_SPECS:
        nb = {}
        for t in (t1, t2):
            qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
            nb[t] = qk.encode(k[:, :, :t]).nbytes + qv.encode(v[:, :, :t]).nbytes
        slope = (nb[t2] - nb[t1]) / (t2 - t1)
        fixed = nb[t2] - slope * t2
        L, T = PROJECTION["layers"], PROJECTION["tokens"]
        proj = L * (slope * T + fixed) * (PROJECTION["kv_heads"] / H) * (PROJECTION["head_dim"] / d)
        row = {"spec": spec, "measured_at_tokens": t2, "bytes_per_token_per_layer": nb[t2] / t2,
               "per_token_slope_bytes": slope, "fixed_bytes_per_layer": fixed,
               "ratio_vs_fp16": fp16_per_token / (nb[t2] / t2),
               "bits_per_element": nb[t2] * 8 / (2 * H * t2 * d),
               "projection_GB": proj / 1e9}
        rows.append(row)
        log(f"memory {spec:30s} {row['bytes_per_token_per_layer']:8.1f} B/token/layer "
            f"({row['bits_per_element']:.3f} bits, {row['ratio_vs_fp16']:.2f}x); projection {row['projection_GB']:.2f} GB")
    return {"kv_heads": H, "head_dim": d, "fp16_bytes_per_token_per_layer": fp16_per_token, "rows": rows,
            "projection": {**PROJECTION, "label": "PROJECTION (computed from a config, not measured on the model)",
                           "paper_claim": "43 GB fp16 -> 8.5 GB (S=24, r=3)"},
            "data": "synthetic K/V: Gaussian, keys with three 25x outlier channels (Med3x outlier counts are data-dependent)"}
