"""python -m kvqbench.suites.bench.decode: run the decode benchmark, write JSON, Markdown, plot.

Results are saved after every configuration (write to a temp file, then rename), so
a run stopped by its time budget still leaves what it measured; `--budget-s` stops
starting new configurations once that many seconds have passed, and `--resume` measures
only what the JSON at the output path lacks (a later call fills in a cut grid).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

BASELINES = ["plain", "plain-static", "plain-compiled"]  # transformers' DynamicCache, StaticCache, StaticCache + compile


def default_specs() -> list[str]:
    """The baselines, then every registered format's benchmark specs (kernels/registry.py)."""
    from ....kernels import registry

    return BASELINES + list(dict.fromkeys(registry.bench_specs().values()))


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.decode", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b-4l", help="model shape (measure.SHAPES); random weights")
    p.add_argument("--specs", nargs="+", default=None,
                   help="'plain' = DynamicCache, 'plain-static' = StaticCache, 'plain-compiled' = StaticCache + "
                        "torch.compile; else quantizer specs ('fp16': the engine's fp16 store) "
                        "(default: both, then every fused format's benchmark specs)")
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384, 32768])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--pairs", nargs="+", default=None, metavar="CTX:BATCH",
                   help="measure these (context, batch) pairs instead of every context x batch")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"],
                   help="run modes, each timed after one shared prefill: eager (the model called per step) and "
                        "graph (the step captured in a CUDA graph and replayed, kernels/graphs.py)")
    p.add_argument("--no-write-cost", action="store_true", help="skip the per-step write cost table")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--check", nargs="*", default=None, metavar="SPEC",
                   help="first compare fused and dense decoding of these specs (default: every fused one)")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no configuration after this")
    p.add_argument("--out", type=Path, default=Path("reports/decode"))
    p.add_argument("--name", default=None,
                   help="file stem of the JSON / Markdown / plot (default: decode, or decode_<shape> "
                        "for a shape other than llama3-8b-4l, so two shapes never overwrite each other)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of the JSON already at the output path and measure only the missing "
                        "(cache, context, batch); it must come from the same settings, GPU and versions")
    p.add_argument("--remeasure", nargs="+", default=[], metavar="SPEC",
                   help="with --resume: measure these caches again at the requested pairs, replacing their rows")
    p.add_argument("--render", type=Path, default=None, help="only render this JSON to Markdown + plot")
    a = p.parse_args(argv)
    for name in ("contexts", "batches"):
        if any(v < 1 for v in getattr(a, name)):
            p.error(f"--{name} must be positive")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if a.pairs is not None:
        try:
            a.pairs = [tuple(int(x) for x in s.split(":")) for s in a.pairs]
        except ValueError:
            p.error("--pairs takes CTX:BATCH, e.g. 4096:1 32768:8")
        if any(len(pr) != 2 or min(pr) < 1 for pr in a.pairs):
            p.error("--pairs takes CTX:BATCH with positive numbers, e.g. 4096:1 32768:8")
        a.contexts = sorted({c for c, _ in a.pairs})
    if a.remeasure and not a.resume:
        p.error("--remeasure goes with --resume (without it every row is measured anyway)")
    return a


def _save(path: Path, run: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(run, indent=1))
    os.replace(tmp, path)


# Differences between two runs' environments that do not make their rows incomparable.
# (readings; filelock_audit_hook is the state. A resumed run may land on another host of the same GPU)
RESUME_FREE = {"time", "sm_clock_now_MHz", "id_call", "host_cpu", "host_load_1min"}


def resumed(path: Path, run: dict) -> dict:
    """`run` continued from the earlier run saved at `path`: its checks, write costs, rows and
    notes kept, the earlier start times in `resumed_from`. Refuses (ValueError, naming what
    differs) a file of other settings or another machine's GPU / versions: rows measured
    under different conditions never share a table."""
    try:
        old = json.loads(path.read_text())
        old_cfg, old_env, results, checks = old["config"], old["environment"], old["results"], old["checks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: cannot read an earlier run from {path}: {e}") from e
    diff = [f"config {k}: {old_cfg.get(k)!r} there, {v!r} now" for k, v in run["config"].items()
            if old_cfg.get(k) != v]
    env = run["environment"]
    diff += [f"{k}: {old_env.get(k)!r} there, {env.get(k)!r} now" for k in sorted(set(env) | set(old_env))
             if k not in RESUME_FREE and old_env.get(k) != env.get(k)]
    if diff:
        raise ValueError(f"--resume: {path} was measured under other conditions ({'; '.join(diff)}); "
                         "write to another --out or --name")
    return {**run, "checks": checks, "results": results, "write_cost": old.get("write_cost", []),
            "notes": old.get("notes", []),  # kept: a note on rows a --remeasure replaces is the caller's to edit
            "resumed_from": old.get("resumed_from", []) + [old_env.get("time")]}


def environment() -> dict:
    import transformers

    from ..toolkit import env_info

    return {**env_info(), "transformers": transformers.__version__}


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    from .render import render

    if a.render:
        for p in render(a.render):
            print(p)
        return 0
    from ...harness.kv_cache import QuantizedCache  # noqa: F401  (fail early on a broken install)
    from ....quantizers import get_quantizer
    from .measure import PLAIN_SPECS, build_model, compare_paths, measure_modes, write_cost

    specs = [None if s == "plain" else s for s in (a.specs if a.specs is not None else default_specs())]
    for s in specs:
        if s not in PLAIN_SPECS:
            get_quantizer(s)  # a bad spec fails now, before the model is built
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t_start = time.perf_counter()
    name = a.name or ("decode" if a.shape == "llama3-8b-4l" else f"decode_{a.shape}")
    path = a.out / f"{name}.json"
    run = {"config": {"shape": a.shape, "dtype": a.dtype, "steps": a.steps, "warmup": a.warmup,
                      "device": device, "weights": "random", "modes": a.modes},
           "environment": environment(), "checks": [], "write_cost": [], "results": []}
    if a.resume and path.exists():  # refused before the model is built
        try:
            run = resumed(path, run)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        print(f"resuming {path}: {len(run['results'])} rows kept", flush=True)
    model = build_model(a.shape, getattr(torch, a.dtype), device, max_positions=max(a.contexts) + a.steps + 64)
    a.out.mkdir(parents=True, exist_ok=True)
    done = {(r["spec"], r["context"], r["batch"]) for r in run["results"]
            if "error" not in r and r["spec"] not in a.remeasure}
    quantized = [s for s in specs if s not in PLAIN_SPECS]
    checked = {c.get("spec") for c in run["checks"]}
    for spec in (a.check or quantized) if a.check is not None else []:
        if spec in checked:
            continue
        r = compare_paths(model, spec, context=min(1024, max(a.contexts)), batch=2)
        print(f"check {spec}: {r}", flush=True)
        run["checks"].append(r)
        _save(path, run)
    # The configurations the targets name come first (a budget cut drops the rest).
    pairs = a.pairs or [(c, b) for c in a.contexts for b in a.batches]
    pairs.sort(key=lambda cb: (cb not in ((4096, 1), (max(a.contexts), max(a.batches))), cb))
    cfg = model.config
    # A decode step's write (device encode into the store) and the old path (append) beside it.
    if not (a.no_write_cost or run["write_cost"]):  # a resumed run keeps the costs it has
        run["write_cost"] = [write_cost(s, heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, device=device,
                                        step_encode=fast) for s in quantized for fast in (True, False)]
    _save(path, run)
    for ctx, batch in pairs:
        for spec in specs:
            if (spec or "plain", ctx, batch) in done:
                continue
            if time.perf_counter() - t_start > a.budget_s:
                print(f"budget reached: skipping {spec} ctx {ctx} batch {batch}", flush=True)
                continue
            try:
                rows = measure_modes(model, spec, context=ctx, batch=batch, steps=a.steps, warmup=a.warmup,
                                     modes=a.modes)
            except torch.OutOfMemoryError as e:  # a shape too large for the card: recorded, not fatal
                rows = [{"spec": spec or "plain", "context": ctx, "batch": batch,
                         "error": f"OutOfMemoryError: {e}"[:300]}]
                torch.cuda.empty_cache()
            for r in rows:
                print(json.dumps({k: v for k, v in r.items()}), flush=True)
            run["results"] = [r for r in run["results"] if (r["spec"], r["context"], r["batch"])
                              != (spec or "plain", ctx, batch)] + rows  # an earlier error row replaced
            _save(path, run)
    for p in render(path):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
