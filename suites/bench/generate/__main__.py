"""python -m kvqbench.suites.bench.generate: time generation per cache, write JSON + Markdown.

Saved after every row (temp file + rename), so a run cut by its time budget keeps what
it measured."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ...harness.generate import generate
from ..decode.measure import SHAPES, build_model
from ..toolkit import env_info

DEFAULT_SPECS = ["plain", "fp16", "fp8-e4m3", "int4", "kivi:bits=2", "kivi:bits=4", "hqmq:S=96,r=4",
                 "hqmq:S=96,r=4,outliers=med3"]


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.generate", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="model shape, random weights")
    p.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="'plain' = the engine over a StaticCache")
    p.add_argument("--baselines", nargs="*", default=["hf-dynamic", "hf-static-compile"],
                   choices=["hf-dynamic", "hf-static-compile"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--compile", action="store_true",
                   help="also a `kvqbench+compile:<spec>` row per spec: generate(compile=True), the model's norms "
                        "and MLPs through torch.compile around our attention and cache")
    p.add_argument("--dtype", default="float16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU, 8+4 tokens: the plumbing only")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no row after this many seconds")
    p.add_argument("--out", type=Path, default=Path("reports/generate"))
    a = p.parse_args(argv)
    if min(a.batches) < 1 or a.prompt < 1 or a.new < 2 or a.runs < 1:
        p.error("--batches, --prompt, --runs must be >= 1 and --new >= 2")
    if a.smoke:
        a.shape, a.prompt, a.new, a.runs, a.dtype = "tiny", 8, 4, 1, "float32"
        a.batches = [1, 2]
    return a


def _hf(model, ids, new: int, static: bool) -> tuple[float, str]:
    kw = {"cache_implementation": "static"} if static else {}
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    sync()
    assert out.shape[1] == ids.shape[1] + new, out.shape
    return time.perf_counter() - t0, "static+compile" if static else "dynamic"


def measure_row(model, name: str, batch: int, prompt: int, new: int, runs: int) -> dict:
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(batch))
    times, mode, why, decode_tps = [], None, None, []
    for _ in range(runs):
        if name.startswith("hf-"):
            s, mode = _hf(model, ids, new, static=name == "hf-static-compile")
        else:
            engine, spec = name.split(":", 1)
            g = generate(model, ids, None if spec == "plain" else spec, max_new_tokens=new,
                         compile=engine == "kvqbench+compile")
            s, mode, why = g.prefill_s + g.decode_s, g.mode, g.why
            decode_tps.append(g.decode_tokens_per_s)
        times.append(s)
    return dict(row=name, batch=batch, prompt=prompt, new=new, seconds=times, tokens_per_s=batch * new / times[-1],
                decode_tokens_per_s=decode_tps[-1] if decode_tps else None, mode=mode, why=why)


def environment() -> dict:
    import transformers

    return dict(env_info(), transformers=transformers.__version__)


def render(data: dict) -> str:
    rows = data["rows"]
    lines = [f"# Generation throughput: {data['shape']} (random weights), {data['dtype']}, prompt {data['prompt']}, "
             f"{data['new']} new tokens, greedy", "",
             f"{data['environment']}", "",
             "tokens/s = batch x new tokens / wall seconds of the whole call (prefill included), last of "
             f"{data['runs']} runs; x = ratio to the row named, same run, same batch.", ""]
    for batch in sorted({r["batch"] for r in rows}):
        sub = [r for r in rows if r["batch"] == batch and "error" not in r]
        base = {r["row"]: r["tokens_per_s"] for r in sub}
        lines += [f"## batch {batch}", "", "| row | tokens/s | x hf-dynamic | x hf-static-compile | decode-only tokens/s "
                  "| step mode |", "|---|---|---|---|---|---|"]
        for r in sub:
            ratio = lambda b: f"{r['tokens_per_s'] / base[b]:.2f}" if b in base else "-"  # noqa: E731
            dec = f"{r['decode_tokens_per_s']:.0f}" if r.get("decode_tokens_per_s") else "-"
            lines.append(f"| {r['row']} | {r['tokens_per_s']:.1f} | {ratio('hf-dynamic')} | "
                         f"{ratio('hf-static-compile')} | {dec} | {r['mode']}{' (' + r['why'] + ')' if r['why'] else ''} |")
        lines.append("")
    for r in rows:
        if "error" in r:
            lines.append(f"- {r['row']} batch {r['batch']}: FAILED: {r['error']}")
    return "\n".join(lines) + "\n"


def _save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    a = _args(argv)
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    model = build_model(a.shape, dtype=getattr(torch, a.dtype), device=dev, max_positions=a.prompt + a.new + 16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    a.out.mkdir(parents=True, exist_ok=True)
    data = dict(shape=a.shape, dtype=a.dtype, prompt=a.prompt, new=a.new, runs=a.runs, device=dev,
                environment=environment(), rows=[])
    names = list(a.baselines) + [f"kvqbench:{s}" for s in a.specs]
    if a.compile:
        names += [f"kvqbench+compile:{s}" for s in a.specs]
    t0, failed = time.perf_counter(), 0
    for batch in a.batches:
        for name in names:
            if time.perf_counter() - t0 > a.budget_s:
                print(f"budget reached: {name} batch {batch} and later rows not started", file=sys.stderr)
                break
            try:
                row = measure_row(model, name, batch, a.prompt, a.new, a.runs)
            except Exception as e:  # noqa: BLE001 (a failed row is recorded; the run goes on)
                failed += 1
                row = dict(row=name, batch=batch, error=f"{type(e).__name__}: {str(e)[:300]}")
            data["rows"].append(row)
            print(json.dumps(row), flush=True)
            _save(a.out / "generate.json", data)
    (a.out / "generate.md").write_text(render(data))
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
