"""`python -m kvqbench.suites.bench.latency`: the latency report from the command line.

    python -m kvqbench.suites.bench.latency --out reports/latency    # GPU: everything
    python -m kvqbench.suites.bench.latency --heads 64 4 --tokens 32768 --batches 8 1   # a model's GQA group
    python -m kvqbench.suites.bench.latency --smoke --out /tmp/x     # CPU: plumbing only
    python -m kvqbench.suites.bench.latency --render reports/latency/latency.json

Exit status: 0 all measured, 2 bad usage (argparse's, or no GPU without --smoke),
3 the report was written but something in it failed (an error row or section).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


PARTIAL_FAILURE = 3


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.latency",
                                 description="Decode-step latency of attention over quantized KV caches.")
    ap.add_argument("--out", default="reports/latency",
                    help="folder for latency.json, latency.md, latency.png, latency_roofline.png")
    ap.add_argument("--budget-s", type=float, default=400, help="start no new shape after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter) to test the plumbing")
    ap.add_argument("--no-tune", action="store_true", help="the Triton rows at their default launch config too")
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--head-dim", type=int, help="head dim of the GPU run (default 128; the models' 64 and 256 too)")
    ap.add_argument("--heads", type=int, nargs=2, metavar=("HQ", "HKV"),
                    help="query and kv heads of the GPU run (default 32 8, Llama-3-8B's; e.g. 64 4, Qwen3-235B's "
                         "group of 16)")
    ap.add_argument("--tokens", type=int, nargs="+", help="cached tokens T of the GPU run (default 4k 16k 32k 128k)")
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes B of the GPU run (default 1 8 32)")
    ap.add_argument("--render", metavar="LATENCY_JSON", type=Path,
                    help="measure nothing: write latency.md and the plots beside this JSON")
    return ap


def main(argv=None) -> dict:
    """Measure (or, with --render, read latency.json), then write latency.md and the plots."""
    ap = build_parser()
    a = ap.parse_args(argv)
    from .render import render  # imports no kernels

    if a.render:
        try:
            res = json.loads(a.render.read_text())
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"--render: cannot read {a.render}: {e}")
        render(a.render.parent, res)
        return res
    gpu = torch.cuda.is_available()
    if not gpu:
        if not a.smoke:
            ap.error("the latency benchmark needs a CUDA GPU (use --smoke to test the plumbing)")
        # before kvqbench.kernels is imported: its kernels are built for the interpreter then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .config import LatencyConfig
    from .run import run_latency

    options = dict(budget_s=a.budget_s, tune=not a.no_tune, encode=not a.skip_encode, memory=not a.skip_memory)
    shape = {k: v for k, v in dict(d=a.head_dim, tokens=a.tokens and tuple(a.tokens),
                                   batches=a.batches and tuple(a.batches), hq=a.heads and a.heads[0],
                                   hkv=a.heads and a.heads[1]).items() if v}
    if shape and a.smoke:
        ap.error("--head-dim / --heads / --tokens / --batches set the GPU run's shapes; --smoke has its own")
    if a.heads and min(a.heads) < 1:
        ap.error(f"--heads {a.heads[0]} {a.heads[1]}: head counts must be positive")
    if shape:
        full = LatencyConfig.full()
        b, t = shape.get("batches", full.batches), shape.get("tokens", full.tokens)
        # the focus (tuning, targets) stays B=8, T=32k where it is measured, else the largest
        shape["focus"] = (8 if 8 in b else max(b), 32768 if 32768 in t else max(t))
    try:
        cfg = LatencyConfig.smoke(**options) if a.smoke else LatencyConfig.full(**options, **shape)
    except ValueError as e:
        ap.error(str(e))
    res = run_latency(cfg, Path(a.out), log=lambda s: print(s, flush=True))
    render(Path(a.out), res)
    return res


def failures(res: dict) -> list[str]:
    """What in a report failed: error rows and failed sections."""
    out = [f"{r.get('method')} B={r['B']} T={r['T']}: {r['error']}" for r in res.get("latency", []) if "error" in r]
    return out + [f"{k}: {res[k]}" for k in ("encode_error", "memory_error") if k in res]


if __name__ == "__main__":
    failed = failures(main(sys.argv[1:]))
    if failed:
        print(f"{len(failed)} failure(s) in the report:", *failed, sep="\n  ", file=sys.stderr)
    sys.exit(PARTIAL_FAILURE if failed else 0)
