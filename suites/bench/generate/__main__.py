"""python -m kvqbench.suites.bench.generate: time generation per cache, write JSON + Markdown.

Saved after every row (temp file + rename), so a run cut by its time budget keeps what
it measured."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from ...harness.generate import generate
from ..decode.measure import SHAPES, build_model
from ..toolkit import env_info
from .profile import profile_call
from .render import render_files

DEFAULT_SPECS = ["plain", "fp16", "fp8-e4m3", "int4", "kivi:bits=2", "kivi:bits=4", "hqmq:S=96,r=4",
                 "hqmq:S=96,r=4,outliers=med3"]


# the engine rows: name prefix -> generate()'s arguments
ENGINES = {"kvqbench": {}, "kvqbench+compile": {"compile": True}, "kvqbench-eager": {"graph": False}}


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.generate", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="model shape, random weights")
    p.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="'plain' = the engine over a StaticCache")
    p.add_argument("--baselines", nargs="*", default=["hf-dynamic", "hf-static-compile"],
                   choices=["hf-dynamic", "hf-static-compile"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="calls per row; the figure is the fastest after the first")
    p.add_argument("--compile", action="store_true",
                   help="also a `kvqbench+compile:<spec>` row per spec: generate(compile=True), the decode "
                        "steps' decoder layers through torch.compile around our attention and cache")
    p.add_argument("--eager", action="store_true",
                   help="also a `kvqbench-eager:<spec>` row per spec: generate(graph=False), eager decode steps "
                        "over the fused kernels (each layer's call pays its host path: what an uncaptured "
                        "engine, or model.generate with our cache, runs)")
    p.add_argument("--compiled-only", action="store_true",
                   help="with --compile: only the `kvqbench+compile:<spec>` rows (beside the baselines)")
    p.add_argument("--ragged", type=int, default=0, metavar="N",
                   help="also N prompts of N lengths (prompt, prompt-s, ..., s ~ prompt/(4N)) per row: one "
                        "left-padded call (hf-*: attention_mask) and N separate batch-1 calls, in their own table")
    p.add_argument("--dtype", default="float16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU, 8+4 tokens: the plumbing only")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no row after this many seconds")
    p.add_argument("--out", type=Path, default=Path("reports/generate"))
    p.add_argument("--profile", action="store_true",
                   help="after each kvqbench row's timed runs, one more call under torch.profiler: "
                        "profile_<row>_b<batch>.txt in --out (prefill and whole-call operators, syncs)")
    p.add_argument("--render", nargs="+", type=Path, metavar="RUN.json",
                   help="measure nothing: re-render saved runs' Markdown and plot beside their JSON")
    a = p.parse_args(argv)
    for f in a.render or ():
        if not f.is_file():
            p.error(f"--render: no file {f}")
    if min(a.batches) < 1 or a.prompt < 1 or a.new < 2 or a.runs < 1:
        p.error("--batches, --prompt, --runs must be >= 1 and --new >= 2")
    if a.smoke:
        a.shape, a.prompt, a.new, a.runs, a.dtype = "tiny", 8, 4, 1, "float32"
        a.batches = [1, 2]
    if a.compiled_only and not a.compile:
        p.error("--compiled-only needs --compile")
    if a.ragged and not 2 <= a.ragged <= a.prompt:
        p.error(f"--ragged N needs 2 <= N <= --prompt ({a.prompt})")
    return a


def ragged_lengths(prompt: int, n: int) -> list[int]:
    """n prompt lengths from `prompt` down by a step of about prompt / (4n) (at least 1)."""
    step = max(1, prompt // (4 * n))
    return [prompt - i * step for i in range(n)]


def ragged_fields(lengths, separate: bool) -> dict:
    """What a ragged row carries beside the others: its table, lengths and kind of calls."""
    return dict(section=f"ragged batch of {len(lengths)} prompts, lengths {min(lengths)}..{max(lengths)}",
                lengths=list(lengths), calls="separate" if separate else "padded")


def _walled(fn, cuda: bool):
    """(wall seconds of the whole call fn(), synchronised on both sides, its result): how
    every row is timed, transformers' and ours alike."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def _hf(model, ids, new: int, static: bool, mask=None) -> tuple[float, str]:
    kw = {"cache_implementation": "static"} if static else {}
    if mask is not None:  # left padded: pads masked, pad id 0 as generate's
        kw.update(attention_mask=mask, pad_token_id=0)
    s, out = _walled(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw),
                     ids.is_cuda)
    assert out.shape[1] == ids.shape[1] + new, out.shape
    return s, "static+compile" if static else "dynamic"


def _calls(model, batch: int, prompt: int, lengths, separate: bool) -> list[tuple]:
    """(ids, attention mask or None) of each call of a row: one [batch, prompt] call; or
    (`lengths`) one prompt per length, left padded with pad id 0 into one call, or with
    `separate` one [1, length] call each."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(batch if lengths is None else 1000 + len(lengths))
    if lengths is None:
        return [(torch.randint(0, model.config.vocab_size, (batch, prompt), device=dev, generator=gen), None)]
    rows = [torch.randint(0, model.config.vocab_size, (1, n), device=dev, generator=gen) for n in lengths]
    if separate:
        return [(r, None) for r in rows]
    pad = lambda x: torch.nn.functional.pad(x, (max(lengths) - x.shape[1], 0))  # noqa: E731
    return [(torch.cat([pad(r) for r in rows]), torch.cat([pad(torch.ones_like(r)) for r in rows]))]


def measure_row(model, name: str, batch: int, prompt: int, new: int, runs: int, lengths=None,
                separate: bool = False) -> dict:
    """One row: `batch` prompts of `prompt` tokens in one call; or (`lengths`, a ragged
    row) one prompt per length as one left-padded call, or with `separate` as one batch-1
    call per prompt, the calls' seconds summed."""
    calls = _calls(model, batch, prompt, lengths, separate)
    batch = sum(ids.shape[0] for ids, _ in calls)
    times, splits = [], []
    for _ in range(runs):  # the figure: the fastest run after the first (which pays compiles and captures)
        times.append(0.0)
        modes, whys, dec_tokens, dec_s, pre_s = set(), set(), 0, 0.0, 0.0
        for ids, mask in calls:
            if name.startswith("hf-"):
                s, mode = _hf(model, ids, new, static=name == "hf-static-compile", mask=mask)
            else:
                engine, spec = name.split(":", 1)
                prompts = ids if mask is None else [r[m.bool()].tolist() for r, m in zip(ids, mask)]
                # the whole call's wall time (generate's own prefill_s + decode_s leave out
                # its engine lookup, rewind or new cache, and setup; before 2026-12-05 rows used them)
                s, g = _walled(lambda: generate(model, prompts, None if spec == "plain" else spec,
                                                max_new_tokens=new, **ENGINES[engine]), ids.is_cuda)
                mode = g.mode
                whys.update([g.why] if g.why else [])
                dec_tokens, dec_s = dec_tokens + g.steps * sum(map(len, g.batches)), dec_s + g.decode_s
                pre_s += g.prefill_s
            times[-1] += s
            modes.add(mode)
        splits.append((pre_s, dec_s, dec_tokens))
    # A one-off stall in one warm run (an H100 run of 2026-12-05 had a 605 ms prefill in one
    # of its calls, 36 ms in every other) must not become the row's figure: the fastest warm run.
    best = min(range(1, runs), key=times.__getitem__) if runs > 1 else 0
    pre_s, dec_s, dec_tokens = splits[best]
    row = dict(row=name, batch=batch, prompt=prompt, new=new, seconds=times, figure_run=best,
               tokens_per_s=batch * new / times[best],
               decode_tokens_per_s=dec_tokens / dec_s if dec_s > 0 else None, mode="+".join(sorted(modes)),
               why="; ".join(sorted(whys)) or None)
    if not name.startswith("hf-"):
        # where the figure run's time goes: the prefill, the decode steps, and the rest (engine
        # lookup, rewind or a new cache, room, graph capture, reading the tokens back)
        row.update(prefill_s=pre_s, decode_s=dec_s, other_s=times[best] - pre_s - dec_s)
    if lengths is not None:
        row.update(ragged_fields(lengths, separate))
    return row


def environment() -> dict:
    import transformers

    return dict(env_info(), transformers=transformers.__version__)


def _save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    a = _args(argv)
    if a.render:
        for f in a.render:
            print(*render_files(f))
        return 0
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    model = build_model(a.shape, dtype=getattr(torch, a.dtype), device=dev, max_positions=a.prompt + a.new + 16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    a.out.mkdir(parents=True, exist_ok=True)
    data = dict(shape=a.shape, dtype=a.dtype, prompt=a.prompt, new=a.new, runs=a.runs, ragged=a.ragged, device=dev,
                environment=environment(), rows=[])
    names = list(a.baselines) + ([] if a.compiled_only else [f"kvqbench:{s}" for s in a.specs])
    if a.compile:
        names += [f"kvqbench+compile:{s}" for s in a.specs]
    if a.eager:
        names += [f"kvqbench-eager:{s}" for s in a.specs]
    jobs = [(name, batch, None, False) for batch in a.batches for name in names]
    # A ragged row exists because generate runs prompts of different lengths as ONE
    # left-padded batch (suites/harness/padding.py): it is timed against what a user
    # without padding support does (one batch-1 call per prompt) and against transformers'
    # own generate of the same padded batch.
    lengths = ragged_lengths(a.prompt, a.ragged) if a.ragged else None
    jobs += [(name, a.ragged, lengths, sep) for name in names for sep in (False, True)] if a.ragged else []
    t0, failed = time.perf_counter(), 0
    for name, batch, lens, sep in jobs:
        if time.perf_counter() - t0 > a.budget_s:
            print(f"budget reached: {name} batch {batch}{' ragged' if lens else ''} and later rows not started",
                  file=sys.stderr)
            break
        try:
            row = measure_row(model, name, batch, a.prompt, a.new, a.runs, lengths=lens, separate=sep)
        except Exception as e:  # noqa: BLE001 (a failed row is recorded; the run goes on)
            failed += 1
            row = dict(row=name, batch=batch, error=f"{type(e).__name__}: {str(e)[:300]}")
            if lens:
                row.update(ragged_fields(lens, sep))
        if a.profile and not name.startswith("hf-") and "error" not in row and not lens:
            engine, spec = name.split(":", 1)
            ids = _calls(model, batch, a.prompt, None, False)[0][0]
            tag = re.sub(r"[^A-Za-z0-9._-]+", "_", name)  # (plain names: files travel back from a GPU call)
            profile_call(lambda: generate(model, ids, None if spec == "plain" else spec, max_new_tokens=a.new,
                                          **ENGINES[engine]),
                         a.out / f"profile_{tag}_b{batch}.txt", f"{name}, batch {batch}, prompt {a.prompt}, "
                         f"{a.new} new tokens (one call after the timed runs)")
        data["rows"].append(row)
        print(json.dumps(row), flush=True)
        _save(a.out / "generate.json", data)
    render_files(a.out / "generate.json")
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
