"""`python -m kvqbench.suites.bench.latency`: the latency report from the command line.

    python -m kvqbench.suites.bench.latency --out reports/latency    # GPU: everything
    python -m kvqbench.suites.bench.latency --smoke --out /tmp/x     # CPU: plumbing only
    python -m kvqbench.suites.bench.latency --render reports/latency/latency.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.latency",
                                 description="Decode-step latency of attention over quantized KV caches.")
    ap.add_argument("--out", default="reports/latency", help="folder for latency.json, latency.md, latency.png")
    ap.add_argument("--budget-s", type=float, default=400, help="start no new shape after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter) to test the plumbing")
    ap.add_argument("--no-tune", action="store_true", help="default launch config everywhere")
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--render", metavar="LATENCY_JSON", type=Path,
                    help="measure nothing: write latency.md and latency.png beside this JSON")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    """Measure (or, with --render, read latency.json), then write latency.md and latency.png."""
    a = parse_args(argv)
    from .render import render  # imports no kernels

    if a.render:
        res = json.loads(a.render.read_text())
        render(a.render.parent, res)
        return res
    gpu = torch.cuda.is_available()
    if not gpu:
        if not a.smoke:
            raise SystemExit("the latency benchmark needs a CUDA GPU (use --smoke to test the plumbing)")
        # before kvqbench.kernels is imported: its kernels are built for the interpreter then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .config import LatencyConfig
    from .run import run_latency

    options = dict(budget_s=a.budget_s, tune=not a.no_tune, encode=not a.skip_encode, memory=not a.skip_memory)
    cfg = LatencyConfig.smoke(**options) if a.smoke else LatencyConfig.full(**options)
    res = run_latency(cfg, Path(a.out), log=lambda s: print(s, flush=True))
    render(Path(a.out), res)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
