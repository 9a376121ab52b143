"""One latency run: the sections in order, the result dict saved after each.

`latency.json` is rewritten (temp file + fsync + rename) after the latency section and
again at the end, so a run cut short keeps what it measured; the Markdown and
the plot are rendered from it by the caller (`render.render`), so rendering
never costs a measurement.
A section that runs out of device memory or kernel resources records the error
in the report (`encode_error`, `memory_error`); any other exception is a bug
and stops the run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ...harness.fetch import write_atomic
from ..toolkit import DEVICE, LAUNCH_ERRORS, copy_bandwidth, describe_error, env_info, sm_clock_mhz
from .caches import encode_caches
from .config import METHOD_SPECS, LatencyConfig
from .decode_step import latency_section
from .encode_throughput import encode_section
from .memory import memory_section
from .targets import add_speedups, targets


def run_latency(cfg: LatencyConfig, out: Path, log=print) -> dict:
    """Measure everything `cfg` asks for; write latency.json into out; return the result dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    env = env_info()
    log(json.dumps(env))
    res = {"env": env, "shape": cfg.shape, "method_specs": dict(METHOD_SPECS)}
    res["copy_bandwidth"] = copy_bandwidth(cfg.copy_bytes)
    copy_GBps = res["copy_bandwidth"]["GBps_read_plus_write"]
    log(f"copy bandwidth {copy_GBps:.0f} GB/s (read+write)")
    torch.manual_seed(0)
    caches = encode_caches(DEVICE, cfg.hkv, cfg.t0, cfg.d)
    log(f"bases built in {time.time() - t_start:.1f} s")
    sm_count = env.get("sm_count") or 0

    def save():
        res["elapsed_s"] = time.time() - t_start
        write_atomic(out / "latency.json", json.dumps(res, indent=1, default=str).encode())

    res["latency"], res["tuning"] = latency_section(cfg, caches, copy_GBps, sm_count, log, t_start)
    add_speedups(res["latency"])
    res["targets"] = targets(res["latency"], cfg.focus)
    save()
    if cfg.encode:
        try:
            res["encode"] = encode_section(cfg, sm_count, sm_clock_mhz(env), log)
        except LAUNCH_ERRORS as e:
            res["encode_error"] = describe_error(e, 10_000)
            log(f"encode section failed: {e}")
    if cfg.memory:
        try:
            res["memory"] = memory_section(cfg, log)
        except LAUNCH_ERRORS as e:
            res["memory_error"] = describe_error(e, 10_000)
            log(f"memory section failed: {e}")
    save()
    log(json.dumps(res["targets"], indent=1))
    log(f"done in {time.time() - t_start:.0f} s -> {out}")
    return res
