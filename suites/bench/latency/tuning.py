"""One small tuner for the fused kernels' launch configs (greedy coordinate search).

The knobs are not all kernel meta-parameters (HQMQ's codeword table is a data
layout, the number of splits depends on the shape), so triton.autotune cannot
see them all; this tries them in stages instead, at the focus shape only, and
the chosen config is then used at every shape.
"""
from __future__ import annotations

from typing import Callable

from ..toolkit import LAUNCH_ERRORS, describe_error
from .config import DEFAULT_LAUNCH

# A stage is a list of overrides, each tried on top of the best config so far.
# A change is kept only if it beats the best by more than the noise margin.
NOISE_MARGIN = 0.02


def launch_stages(hqmq: bool, has_sms: bool) -> list[list[dict]]:
    """The search: the kernel's own defaults and block/warps first (HQMQ: fp16
    codebook, no software pipelining, the best in run 3), then HQMQ's other codeword
    sources and pipelining, or the pipelining depth alone, then (GPU) the number of
    splits, as programs per SM (decode_attention's `programs_per_sm`)."""
    shapes = [dict(block_t=64, num_warps=4), dict(block_t=64, num_warps=8), dict(block_t=128, num_warps=8),
              dict(block_t=128, num_warps=4)]
    if hqmq:
        shapes.append(dict(block_t=64, num_warps=16))
        stages = [[DEFAULT_LAUNCH] + [{**s, "table": "cb16", "num_stages": 1} for s in shapes],
                  [{"table": t} for t in ("sec32", "sec16", "cb32")] + [{"num_stages": 2}]]
    else:
        shapes.append(dict(block_t=32, num_warps=4))
        stages = [[DEFAULT_LAUNCH] + shapes, [{"num_stages": n} for n in (1, 3)]]
    if has_sms:
        stages.append([{"programs_per_sm": p} for p in (2, 8, 16)])
    return stages


def greedy_tune(time_us: Callable[[dict], float], stages: list[list[dict]], log=print,
                label: str = "") -> tuple[dict, list[dict]]:
    """(best config, every trial) over `stages`; a config whose launch fails (out of
    shared memory, registers or device memory) is recorded with its error and skipped."""
    best_cfg, best_us, trials = dict(DEFAULT_LAUNCH), float("inf"), []
    for stage in stages:
        base = dict(best_cfg)
        for override in stage:
            cfg = {**base, **override}
            try:
                t = time_us(cfg)
            except LAUNCH_ERRORS as e:
                trials.append({**cfg, "error": describe_error(e, 300)})
                log(f"  tune {label} {cfg}: ERROR {describe_error(e, 200)}")
                continue
            trials.append({**cfg, "time_us": t})
            log(f"  tune {label} {cfg}: {t:.1f} us")
            if t < best_us * (1 - NOISE_MARGIN):
                best_cfg, best_us = cfg, t
    return best_cfg, trials
