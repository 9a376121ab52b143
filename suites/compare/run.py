"""`kvqbench compare`: the main job. Perplexity of a real model with its KV cache
quantized by every registered quantizer's example configs (or `--specs`), on
fixed windows of a named corpus, under a named protocol; writes
`reports/<run>/results.json`, `report.md` and plots.

Every argument is checked before any model work (`validate`). Stochastic
quantizers (codebooks or rotations drawn from a seed) run over `--seeds` seeds;
the report shows their mean and spread. Resumable: results.json is rewritten
after every configuration, and a rerun that would measure the same figures
(results.identity) skips what is already measured (`--fresh` starts over). A
configuration that fails is recorded with its error, the run goes on, and the
command exits with EXIT_PARTIAL after writing the report.

Provenance (versions, commit, plugin distributions) lives in provenance.py, the
Triton-ahead compile pool in ahead.py.

(About 570 lines: the one command's flow from arguments to report, its validation,
resume and lm-eval stage, read top to bottom; its parts with a life of their own already
moved out: provenance.py, ahead.py, results.py, report.py, fidelity_stage.py, and the
launch of `--workers` to distributed.py.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from ..harness.perplexity import DEFAULT_BATCH
from . import fidelity_stage
from .ahead import triton_ahead
from .provenance import hardware, row_stamps, versions
from .results import Run, RunError, calibration_stamps

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "canterbury"
EXIT_PARTIAL = 3  # the report was written, but some configuration failed
# Default windows of --window tokens. On a CPU the default sweep (33 specs, 21 of them
# stochastic, 3 seeds each: 75 jobs) costs ~480 CPU-seconds per 512-token window (the whole
# sweep, 16 min of user time for 2; the calibrated and fitted avq / flatvq rows dominate), so 2 windows,
# not 4: measured 8 min 41 s wall from a fresh clone on a 2-core x86-64 VM (rows 507 s with
# the calibrated AVQ's EM fits; 2026-12-06, the model and corpus already cached: 31 s more
# on an empty cache, reports/cpu2core_smollm2-135m_canterbury). A GPU affords 16.
CPU_WINDOWS, GPU_WINDOWS = 2, 16


class UsageError(Exception):
    """A bad argument: reported in one line, exit status 2, before any model work."""


def default_specs() -> list[str]:
    """fp16 first, then every example config of every registered quantizer, and its
    calibrated examples (`calibrated_example_specs`: the run calibrates them): a new
    plugin is compared without touching this file."""
    from ...quantizers import registry

    specs = ["fp16"]
    for name in sorted(registry()):
        cls = registry()[name]
        specs += [s for s in (*cls.examples(), *getattr(cls, "calibrated_example_specs", ())) if s not in specs]
    return specs


def is_stochastic(spec: str) -> bool:
    """Does the figure of `spec` depend on its seed? The plugin says so with a class
    attribute `stochastic = True` (every built-in with seeded codebooks or rotations
    does); a plugin that says nothing is run with one seed."""
    from ...quantizers import parse_spec

    return bool(getattr(parse_spec(spec)[0], "stochastic", False))


def outlier_diagnostics(model, window: torch.Tensor) -> list[dict]:
    """Per layer, for K (after RoPE) and V: max/median chunk radius (4-element
    chunks, over all tokens and kv-heads of one window) and max/median channel
    magnitude, from the K/V an fp16 cache stores."""
    from ..harness.kv_cache import QuantizedCache, cache_kwargs

    cache = QuantizedCache("fp16", config=model.config)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=window.to(dev).unsqueeze(0), **cache_kwargs(model, cache), use_cache=True)
    rows = []
    for layer in range(len(cache.layers)):
        row = {"layer": layer}
        for role, packed in cache.packed(layer).items():
            x = cache.layers[layer].read(role).float()  # [1, H, T, D]
            r = x.unflatten(-1, (-1, 4)).norm(dim=-1)
            chan = x.abs().amax(dim=(0, 2)).flatten()  # per (head, channel)
            row[f"{role}_radius_max_over_median"] = (r.max() / r.median()).item()
            row[f"{role}_channel_max_over_median"] = (chan.max() / chan.median()).item()
        rows.append(row)
    return rows


def spec_list(text: str) -> list[str]:
    """The specs of a ';'-separated option, stripped, empty ones and repeats dropped."""
    return list(dict.fromkeys(s.strip() for s in text.split(";") if s.strip()))


def validate(args) -> dict:
    """Every check that needs no model: returns the normalised plan, or raises
    UsageError naming the bad argument."""
    from ...quantizers import QuantizerInputError, get_quantizer
    from ..harness.corpora import CORPORA
    from ..harness.models import check_model_name

    if args.windows is None:  # see CPU_WINDOWS
        dev = str(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        args.windows = CPU_WINDOWS if dev.startswith("cpu") else GPU_WINDOWS
    for flag, value, low in (("--windows", args.windows, 1), ("--window", args.window, 2),
                             ("--context", args.context, 1), ("--decode-tokens", args.decode_tokens, 1),
                             ("--seeds", args.seeds, 1), ("--batch-size", args.batch_size, 1),
                             ("--calibration-windows", getattr(args, "calibration_windows", 2), 1)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    workers = getattr(args, "workers", 1)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and os.environ.get("WORLD_SIZE") is not None:
        raise UsageError("--workers launches its own ranks; under torchrun, give torchrun --nproc-per-node instead")
    if workers > 1 and args.device_map == "auto":
        raise UsageError("--workers with --device-map auto: a model spread over every GPU runs as one process")
    if args.lm_eval_limit is not None and args.lm_eval_limit < 1:
        raise UsageError(f"--lm-eval-limit must be >= 1, got {args.lm_eval_limit}")
    if args.specs is None:
        specs = default_specs()
    else:
        specs = spec_list(args.specs)
        if not specs:
            raise UsageError(f"--specs {args.specs!r} names no quantizer spec (';'-separated, e.g. 'fp16;int4')")
    for spec in specs:  # fail on a typo before an hour of work, not after
        try:
            get_quantizer(spec)
        except QuantizerInputError as e:
            raise UsageError(f"--specs: {e}") from None
    try:
        check_model_name(args.model)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from None
    if args.corpus not in CORPORA and not Path(args.corpus).expanduser().is_file():
        raise UsageError(f"--corpus: {args.corpus!r} is not one of {sorted(CORPORA)} and not an existing text file")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise UsageError(f"--device: {e}") from None
    if device.type not in ("cpu", "cuda"):  # e.g. meta: its tensors hold no data, nothing can be scored
        raise UsageError(f"--device {args.device}: kvqbench compare runs on cpu or cuda[:N], not {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} GPU(s)")
    if workers > 1 and device.index is not None:
        raise UsageError(f"--device {args.device} with --workers: the ranks take the GPUs round-robin; pass --device "
                         "cuda (CUDA_VISIBLE_DEVICES chooses which)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a folder")
    # A plain name: results go to --out/NAME and nowhere else.
    if args.run is not None and (args.run in ("", ".", "..") or any(c in args.run for c in "/\\\0")):
        raise UsageError(f"--run {args.run!r} must be a plain name (no path separators, not '.' or '..'); "
                         "choose the folder with --out")
    lm_meta = None
    if args.lm_eval_metadata is not None:
        try:
            lm_meta = json.loads(args.lm_eval_metadata)
        except ValueError as e:
            raise UsageError(f"--lm-eval-metadata is not JSON ({e}): {args.lm_eval_metadata!r}") from None
        if not isinstance(lm_meta, dict):
            raise UsageError(f"--lm-eval-metadata must be a JSON object, got {args.lm_eval_metadata!r}")
    if args.lm_eval:
        _check_lm_eval_tasks(args.lm_eval, lm_meta)
    lm_specs = specs
    if args.lm_eval_specs is not None:
        if not args.lm_eval:
            raise UsageError("--lm-eval-specs needs --lm-eval TASKS")
        lm_specs = spec_list(args.lm_eval_specs)
        stray = [s for s in lm_specs if s not in specs]
        if not lm_specs or stray:
            raise UsageError(f"--lm-eval-specs must name specs of this run ({'; '.join(specs)}), got "
                             f"{args.lm_eval_specs!r}" + (f": {', '.join(stray)} not among them" if stray else ""))
    threads = os.environ.get("KVQBENCH_PRECOMPILE_THREADS")
    if threads and not threads.strip().isdigit():
        raise UsageError(f"KVQBENCH_PRECOMPILE_THREADS must be a whole number of threads (0: off), got {threads!r}")
    protocols = protocols_for(args.protocol, device)
    # Each protocol's own window length: prefill-then-decode and deployed write `context`
    # tokens and score what follows (`decode_tokens` steps); quantize-on-write scores
    # `window` tokens. All read the same windows (one tokenized set, cut to each length).
    decode = args.context + args.decode_tokens
    lengths = {"quantize-on-write": args.window, "prefill-then-decode": decode, "deployed": decode}
    fidelity = args.fidelity if args.fidelity is not None else "deployed" in protocols
    window = max([lengths[p] for p in protocols] + ([decode] if fidelity else []))
    check_context(window, model_context(args.model), args.model)
    return {"specs": specs, "protocols": protocols, "device": str(device), "lm_eval_metadata": lm_meta,
            "lm_eval_specs": lm_specs,
            "lengths": {p: lengths[p] for p in protocols}, "fidelity": fidelity, "window": window,
            "run": args.run or f"{args.model}_{args.corpus}".replace("/", "-")}


def _context_of(config) -> int | None:
    n = getattr(config.get_text_config(), "max_position_embeddings", None)  # Gemma3 nests the text part
    return n if isinstance(n, int) and n > 0 else None


def model_context(name: str) -> int | None:
    """The model's context length from its config alone (no weights): a local folder, an
    embedded model already converted into the cache, a hub model in the local hub cache.
    None where it is not at hand without a download; run_compare checks after the load."""
    from transformers import AutoConfig

    from ..harness.fetch import cache_dir
    from ..harness.models import EMBEDDED_MODELS

    where = cache_dir() / "models" / name if name in EMBEDDED_MODELS else Path(name).expanduser()
    if name in EMBEDDED_MODELS and not where.is_dir():
        return None  # not fetched yet
    try:
        if where.is_dir():
            return _context_of(AutoConfig.from_pretrained(where)) if (where / "config.json").is_file() else None
        return _context_of(AutoConfig.from_pretrained(name, local_files_only=True))
    except Exception:  # noqa: BLE001 (unreadable here: the load says what is wrong)
        return None


def check_context(window: int, context: int | None, model: str) -> None:
    if context is not None and window > context:  # positions past it are untrained, and the memory is the user's
        raise UsageError(f"--window/--context + --decode-tokens: windows of {window} tokens exceed the "
                         f"{context}-token context of {model} (max_position_embeddings)")


def check_writable(folder: Path, flag: str) -> None:
    """Create `folder` and a temp file in it now, not after an hour of measuring."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvqbench-write-check-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {folder} ({e.strerror or e})") from None


PROTOCOLS = ("quantize-on-write", "prefill-then-decode", "deployed")


def protocols_for(choice: str | None, device: torch.device) -> list[str]:
    """--protocol: one name, a comma-separated list, "both" (the paper's two), "all";
    default: quantize-on-write, plus deployed on a GPU (where its decode steps run fused
    and graphed; on a CPU they cost minutes, so it runs on request there)."""
    if choice is None:
        return ["quantize-on-write"] + (["deployed"] if device.type == "cuda" else [])
    if choice == "both":
        return ["quantize-on-write", "prefill-then-decode"]
    if choice == "all":
        return list(PROTOCOLS)
    names = list(dict.fromkeys(p.strip() for p in choice.split(",") if p.strip()))
    bad = [p for p in names if p not in PROTOCOLS]
    if bad or not names:
        raise UsageError(f"--protocol {choice!r}: use {', '.join(PROTOCOLS)}, a comma-separated list of them, "
                         "both (quantize-on-write,prefill-then-decode) or all")
    return names


def _check_lm_eval_tasks(tasks: str, metadata) -> None:
    try:
        from ..lm_eval.evaluate import task_manager
    except ImportError as e:
        raise UsageError(f"--lm-eval needs lm-eval (pip install 'kvqbench[eval]'): {e}") from None
    names = [t for t in tasks.split(",") if t]
    if not names:
        raise UsageError(f"--lm-eval {tasks!r} names no task")
    tm = task_manager(metadata, names)
    unknown = [t for t in names if t not in tm.all_tasks]
    if unknown:
        raise UsageError(f"--lm-eval: unknown task(s) {', '.join(unknown)} (offline tasks: kvqbench_local, "
                         "kvqbench_rolling, kvqbench_passkey; hub tasks need lm-eval's task index)")


def jobs_for(specs: list[str], protocols: list[str], n_seeds: int) -> list[tuple[str, str, int]]:
    """(protocol, spec, seed): seeds 0..n-1 for stochastic specs, seed 0 for the rest;
    seed 0 of everything first so a short run already has every row."""
    first = [(p, s, 0) for p in protocols for s in specs]
    more = [(p, s, seed) for seed in range(1, n_seeds) for p in protocols for s in specs if is_stochastic(s)]
    return first + more


def run_compare(args) -> int:
    from tqdm import tqdm

    from ...quantizers import get_quantizer
    from . import report
    from ..harness.corpora import special_prefix, tokenize_text, load_corpus, token_windows, window_starts
    from ..harness.models import load_model
    from ..harness.calibration import spec_needs_calibration
    from ..harness.perplexity import (batch_rows, ppl_deployed, ppl_prefill_then_decode, ppl_quantize_on_write,
                                      twins_unsupported)
    from . import distributed

    plan = validate(args)
    if getattr(args, "workers", 1) > 1:
        return launch_workers(args, plan)
    specs, protocols, device = plan["specs"], plan["protocols"], plan["device"]
    folder = Path(args.out) / plan["run"]
    if os.environ.get("RANK", "0") == "0":  # rank 0 alone writes (distributed.py)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--run: the run folder {folder} exists and is not a folder")
        check_writable(folder if folder.is_dir() else Path(args.out), "--out")
    try:  # under torchrun: one rank of several (distributed.py); else a single process, as ever
        device_map = distributed.choose_device_map(args.device_map, args.model, getattr(torch, args.dtype), device)
        ranks = distributed.start(device, device_map) if distributed.launched() else None
    except distributed.DistributedSetupError as e:
        raise UsageError(str(e)) from None
    print(f"loading model {args.model} and corpus {args.corpus} ...", file=sys.stderr, flush=True)
    stages, t_stage = {}, time.perf_counter()  # seconds per stage, printed at the end: where a run's time went

    def stage_done(name):
        nonlocal t_stage
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - t_stage
        t_stage = time.perf_counter()
    try:  # before the model: a text file that is not UTF-8 is the user's to fix
        text, corpus_info = load_corpus(args.corpus)
    except ValueError as e:
        raise UsageError(f"--corpus: {e}") from None
    with distributed.local_main_first(ranks):
        model, tok, model_info = load_model(args.model, device=ranks.device if ranks else device,
                                            dtype=getattr(torch, args.dtype), verify=args.verify,
                                            device_map=device_map)
    check_context(plan["window"], _context_of(model.config), args.model)  # where validate could not read it
    try:
        windows = token_windows(tok, text, plan["window"], args.windows)
    except ValueError as e:  # corpus too short for these windows: the user's numbers
        raise UsageError(f"--window/--windows: {e}") from None
    n_tokens = len(tokenize_text(tok, text))  # memoised by token_windows
    meta = {
        "model": model_info, "corpus": corpus_info, "protocols": protocols,
        "windows": {"n": args.windows, "tokens": plan["window"], "per_protocol": plan["lengths"],
                    "starts": window_starts(n_tokens, plan["window"] - len(special_prefix(tok)), args.windows),
                    "placement": "evenly spaced over the whole tokenized corpus, disjoint; only the special "
                                 "tokens the tokenizer itself prepends (Gemma's BOS); each protocol reads the "
                                 "first per_protocol[p] tokens of each window"},
        "prefill_then_decode": {"context": args.context, "decode_tokens": args.decode_tokens},
        "fidelity": {"prompt_tokens": args.context, "new_tokens": args.decode_tokens} if plan["fidelity"] else None,
        "dtype": args.dtype, "versions": versions(), "hardware": hardware(device),
        "batch_size": args.batch_size,
        "seeds": list(range(args.seeds)), "stochastic_specs": [s for s in specs if is_stochastic(s)],
    }

    cal_for = _calibration(args, model, tok, text, plan, specs, n_tokens, meta)

    # Generation fidelity rides in the deployed rows where a format allows (greedy twins of
    # the windows in the same batch and replayed steps: suites/harness/fidelity.py); the
    # fidelity stage after the rows generates only for the others (and for every spec when
    # the run has no deployed protocol, or on a resume whose rows are already measured).
    twins = {s: twins_unsupported(model, s) is None for s in specs} if plan["fidelity"] and \
        "deployed" in protocols else {}

    def measure(protocol, spec, seed, rows=slice(None), batch_size=args.batch_size, progress=None):
        w = windows[rows, :plan["lengths"][protocol]]
        cal = cal_for(spec, seed)
        kw = {"calibration": cal} if cal is not None else {}
        if protocol == "quantize-on-write":
            return ppl_quantize_on_write(model, w, spec, seed, progress=progress, batch_size=batch_size, **kw)
        if protocol == "deployed" and twins.get(spec):
            kw["continuations"] = True
        scorer = ppl_deployed if protocol == "deployed" else ppl_prefill_then_decode
        return scorer(model, w, spec, seed, context=args.context, progress=progress, batch_size=batch_size, **kw)

    if ranks is not None:  # the same window batches as one process, dealt over the ranks
        meta["distributed"] = distributed.describe(ranks)
        distributed.check_same(ranks, windows, "token windows")
        rows_of = lambda job: batch_rows(model, job[1], windows, args.batch_size,  # noqa: E731
                                         plan["lengths"][job[0]] if job[0] == "quantize-on-write" else 1)
        measure_unit = lambda u: measure(*u.job, rows=slice(u.start, u.stop), batch_size=u.rows)  # noqa: E731
        if not ranks.is_main:  # scores its share; rank 0 alone writes results.json and the report
            # (the Triton pool on every rank: each process needs the kernels in its own memory)
            with triton_ahead(args, ranks.device, model_info, plan, specs, record=False):
                distributed.score_rounds(ranks, None, rows_of, len(windows), measure_unit)
            return 0
    stamps = calibration_stamps(row_stamps(specs), meta, [s for s in specs if spec_needs_calibration(s)])
    with Run(folder, meta, args.fresh) as run:
        if run.data["diagnostics"] is None:
            run.data["diagnostics"] = outlier_diagnostics(model, windows[0])
            run.save()
        jobs = jobs_for(specs, protocols, args.seeds)
        todo = [j for j in jobs if not run.done(*j, stamp=stamps[j[1]])]
        print(f"{len(jobs)} configurations, {len(jobs) - len(todo)} already measured in {run.path}", file=sys.stderr)
        stale = run.stale(jobs, stamps)
        if stale:  # a rerun after a commit measures again: say why, and how to only re-render
            made = sorted({str((r.get("versions") or {}).get("commit"))[:7] for r in stale})
            now = str(next(iter(stamps.values()))["versions"]["commit"])[:7] if stamps else "?"
            print(f"{len(stale)} of them were measured by other code (commit {', '.join(made)}; now {now}, or "
                  "another config) and are measured again; `kvqbench report "
                  f"{run.folder}` re-renders the report from the records as they are", file=sys.stderr)
        stage_done("load, calibration, diagnostics")
        bar = tqdm(total=len(todo) * len(windows), unit="window", dynamic_ncols=True)

        if twins:  # before the rows: their twins are scored against it as they finish
            fidelity_stage.reference(run, model, windows[:, :args.context], args.decode_tokens)

        def on_record(job, r, windows_done: int = len(windows)):  # one finished configuration
            bar.update(windows_done)
            r.update(stamps[job[1]])
            continued = r.pop("continuations", None)
            if "error" not in r and not math.isfinite(r["ppl"]):  # not a figure: a failure, retried on resume
                r["error"] = f"non-finite perplexity {r['ppl']} (NLL sum {r['nll_sum']})"
            if "error" in r:
                run.add(r)
                tqdm.write(f"FAILED {' '.join(map(str, job))}: {r['error']}")
                return
            q = get_quantizer(job[1])
            # the cache holds as many K as V elements: the mean of the two roles' formulas
            # (they differ where keys code differently, e.g. TurboQuant's QJL keys)
            formula = sum(get_quantizer(job[1], role=role).formula_bits(model_info["head_dim"])
                          for role in ("K", "V")) / 2
            r.update(formula_bits=formula, family=q.name, stochastic=is_stochastic(job[1]))
            run.add(r)
            steps = (f"  decode steps: {r['decode_mode']}, reading with {r.get('decode_attention') or '?'}"
                     if r.get("decode_mode") else "")  # graph / eager; cuda / triton / dense
            tqdm.write(f"{job[0]:20s} {job[1]:34s} seed={job[2]}  PPL {r['ppl']:10.4f}  cache bits "
                       f"{r['cache_bits_per_element']:6.3f} (formula {r['formula_bits']:6.3f}; model constants "
                       f"{r['constant_nbytes']} B)  {r['wall_s']:6.1f} s{steps}")
            if continued is not None:
                fidelity_stage.from_twins(run, model, windows[:, :args.context], r, continued, stamps[job[1]])

        with triton_ahead(args, device if ranks is None else ranks.device, model_info, plan,
                          [j[1] for j in todo]) as ahead:
            if ranks is not None:
                def labelled(u):  # the recorder files what rank 0's rows compile under their spec
                    ahead.row(u.job[1])
                    return measure_unit(u)
                run.data["meta"]["distributed"]["scoring"] = distributed.score_rounds(
                    ranks, todo, rows_of, len(windows), labelled, on_record)
                run.save()
            for protocol, spec, seed in todo if ranks is None else []:
                bar.set_postfix_str(f"{protocol} {spec} seed={seed}")
                ahead.row(spec)
                seen = [0]  # windows of this configuration already on the bar

                def step(done, total, seen=seen):  # called once per batch of windows, `done` so far
                    bar.update(done - seen[0])
                    seen[0] = done
                try:
                    r = measure(protocol, spec, seed, progress=step)
                except Exception as e:  # keep what is measured; record the failure
                    if args.debug:
                        import traceback

                        traceback.print_exc()
                    r = {"protocol": protocol, "spec": spec, "seed": seed, "error": f"{type(e).__name__}: {e}"}
                on_record((protocol, spec, seed), r, windows_done=0)  # the bar moved window by window
        bar.close()
        stage_done("rows")
        if plan["fidelity"]:
            fidelity_stage.generated(run, model, windows[:, :args.context], specs, args.decode_tokens, stamps,
                                     cal_for)
            stage_done("fidelity")
        if args.lm_eval:
            _lm_eval_scores(args, run, model, tok, plan["lm_eval_specs"], protocols[0], plan["lm_eval_metadata"],
                            cal_for)
            stage_done("lm-eval")
        out = report.write_report(run.folder)
        stage_done("report")
        failures = run.failures()
    print(f"\nreport: {out}", file=sys.stderr)
    print("time per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()), file=sys.stderr)
    if failures:
        print(f"kvqbench compare: {len(failures)} configuration(s) failed (recorded in {out}):", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return EXIT_PARTIAL
    return 0


def launch_workers(args, plan) -> int:
    """`--workers N`: this same command as N ranks on this machine (distributed.launch);
    returns the exit status a single process would: 0, EXIT_PARTIAL when the report was
    written with failed rows, else 1 (torchrun's 1 for any rank that failed)."""
    from . import distributed

    print(f"kvqbench compare: {args.workers} workers on {plan['device']} (torch.distributed.run)", file=sys.stderr,
          flush=True)
    outcome = distributed.launch(args.argv, args.workers, Path(args.out) / plan["run"])
    return {"ok": 0, "partial": EXIT_PARTIAL}.get(outcome, 1)


def _calibration(args, model, tok, text, plan, specs, n_tokens: int, meta: dict):
    """For calibrated specs (quantizers/calibrated.py): K/V captured from an fp16 pass over
    --calibration-windows windows of the corpus AFTER the scored ones (disjoint;
    harness/calibration.py), recorded in meta["calibration"]; returns (spec, seed) -> the
    fitted calibration (fitted once per spec and seed, memoised) or None."""
    from ..harness.calibration import (calibration_starts, capture_kv, describe, fit_calibration,
                                       spec_needs_calibration)
    from ..harness.corpora import special_prefix, tokenize_text

    if not any(spec_needs_calibration(s) for s in specs):
        return lambda spec, seed: None
    prefix = special_prefix(tok)
    body = plan["window"] - len(prefix)
    try:
        starts = calibration_starts(n_tokens, meta["windows"]["starts"], body, body, args.calibration_windows)
    except ValueError as e:
        raise UsageError(f"--calibration-windows: {e}") from None
    ids = tokenize_text(tok, text)
    t0 = time.perf_counter()
    captured = capture_kv(model, torch.tensor([prefix + ids[s:s + body] for s in starts], dtype=torch.long))
    meta["calibration"] = describe(starts, body, captured, time.perf_counter() - t0)
    fitted: dict = {}

    def cal_for(spec, seed):
        if not spec_needs_calibration(spec):
            return None
        if (spec, seed) not in fitted:
            t1 = time.perf_counter()
            fitted[(spec, seed)] = fit_calibration(spec, captured, seed, device=next(model.parameters()).device)
            meta["calibration"].setdefault("fit_s", {})[f"{spec} seed={seed}"] = round(time.perf_counter() - t1, 2)
        return fitted[(spec, seed)]
    return cal_for


def _lm_eval_scores(args, run, model, tok, specs, protocol, meta_le, cal_for=lambda spec, seed: None) -> None:
    """lm-eval task scores beside PPL and bits: seed 0, first protocol's records (a
    calibrated spec with the run's calibration, `cal_for`)."""
    from ..lm_eval.evaluate import compare_scores

    requested = [args.lm_eval, args.lm_eval_limit, meta_le]
    for rec in [r for r in run.data["results"] if "error" not in r and r["seed"] == 0
                and r["protocol"] == protocol and r["spec"] in specs]:
        if rec.get("lm_eval", {}).get("requested") == requested and "error" not in rec["lm_eval"]:
            continue  # measured in an earlier run of the same request
        print(f"lm-eval {args.lm_eval} with {rec['spec']} ...", file=sys.stderr, flush=True)
        try:
            rec["lm_eval"] = compare_scores(model, tok, rec["spec"], 0, args.lm_eval, args.lm_eval_limit, meta_le,
                                            calibration=cal_for(rec["spec"], 0))
        except Exception as e:  # keep the PPL results; record the failure
            rec["lm_eval"] = {"requested": requested, "error": f"{type(e).__name__}: {e}"}
        run.save()


def add_arguments(sub, parents=()) -> None:
    p = sub.add_parser("compare", help="perplexity of every quantizer on a real model; writes reports/<run>/",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, parents=list(parents))
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name, local folder or hub id")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="canterbury, austen, wikitext2, wikitext103 or a text file")
    p.add_argument("--protocol", default=None,
                   help="quantize-on-write (the paper's), prefill-then-decode, deployed (exact prefill, decode "
                        "steps read the quantized cache: a serving engine), a comma-separated list, both "
                        "(the paper's two) or all; default quantize-on-write, plus deployed on a GPU")
    p.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=None,
                   help="generation fidelity against the model's own cache (greedy, --context prompt tokens, "
                        "--decode-tokens new); default: on when deployed runs")
    p.add_argument("--window", type=int, default=512, help="quantize-on-write: tokens per window")
    p.add_argument("--windows", type=int, default=None,
                   help=f"number of windows (default {CPU_WINDOWS} on a CPU, {GPU_WINDOWS} on a GPU)")
    p.add_argument("--context", type=int, default=384, help="prefill-then-decode / deployed: prefill tokens L")
    p.add_argument("--decode-tokens", type=int, default=64,
                   help="prefill-then-decode / deployed: tokens M after the prefill (window = L + M)")
    p.add_argument("--specs", default=None, help="';'-separated quantizer specs (default: every registered example)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every stochastic quantizer")
    p.add_argument("--calibration-windows", type=int, default=2,
                   help="calibrated quantizers (e.g. avq2-cal): windows (of --window tokens) of the corpus after "
                        "the scored ones whose fp16 K/V fit them, once per model")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help="windows scored per forward pass (same figures as one at a time, up to float rounding)")
    # --run-name: torchrun (Python < 3.12 argparse) refuses "--run" as an ambiguous prefix of its --run-path
    p.add_argument("--run", "--run-name", dest="run", default=None,
                   help="run name (default <model>_<corpus>; reruns resume)")
    p.add_argument("--out", default="reports", help="reports folder")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-map", default=None, choices=["auto", "none"],
                   help="auto: spread the model over the node's GPUs (accelerate; then one rank per node under "
                        "torchrun); default: auto when a local model folder exceeds 3/4 of one GPU")
    p.add_argument("--workers", type=int, default=1,
                   help="score the rows in N processes on this machine's device (torchrun's launcher, "
                        "distributed.py); same figures as one process. On one H200 four ranks sharing the GPU "
                        "were slower than one (2026-12-05); it pays where ranks get GPUs of their own")
    p.add_argument("--fresh", action="store_true", help="discard earlier results of this run")
    p.add_argument("--verify", action="store_true",
                   help="hash every file of the cached model, not only those whose size or mtime changed")
    p.add_argument("--lm-eval", default=None, metavar="TASKS",
                   help="also run these lm-eval tasks per spec (comma-separated; kvqbench_local = the offline "
                        "passkey and rolling tasks; hub tasks such as piqa where the hub is reachable)")
    p.add_argument("--lm-eval-specs", default=None, metavar="SPECS",
                   help="';'-separated specs of this run that lm-eval scores (default: every spec), e.g. "
                        "'kivi:bits=4;hqmq:S=96,r=4' for claim 5's pair in a full sweep")
    p.add_argument("--lm-eval-limit", type=int, default=None, help="lm-eval: at most this many documents per task")
    p.add_argument("--lm-eval-metadata", default=None, metavar="JSON",
                   help='lm-eval task knobs, e.g. \'{"passkey_docs": 10}\' (see kvqbench.suites.lm_eval.tasks)')
    p.set_defaults(func=run_compare)


__all__ = ["run_compare", "validate", "jobs_for", "is_stochastic", "default_specs", "add_arguments",
           "UsageError", "RunError", "EXIT_PARTIAL"]
