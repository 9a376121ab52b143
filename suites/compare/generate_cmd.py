"""`kvqbench generate`: text from a model through a quantized KV cache, at engine speed
(suites/harness/generate.py: exact prefill, graphed decode steps where the cache can
take them), with tokens/s and how the steps ran.

    kvqbench generate --spec int4 --prompt "Alice was beginning to get very tired"
    kvqbench generate --spec "hqmq:S=96,r=4" --windows 8 --prompt-len 512 --max-new-tokens 128
    kvqbench generate --spec plain --prompt "..." --temperature 0.8 --top-p 0.95 --stop "\\n\\n"
    kvqbench generate --spec avq2-cal --windows 4 --calibration-windows 2

A calibrated spec (e.g. avq2-cal) is fitted once on the fp16 K/V of --calibration-windows
windows of --prompt-len tokens of --corpus: after the prompt windows (disjoint from
them) with --windows, else contiguous and centred in the corpus (the token ranges are
printed and written to --json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(sub, parents) -> None:
    p = sub.add_parser("generate", parents=parents, help="generate text through a quantized KV cache (engine speed)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="embedded model name, local folder or hub id")
    p.add_argument("--spec", default="int4", help="quantizer spec; 'plain' = the model's own cache (StaticCache)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    src.add_argument("--windows", type=int, default=None,
                     help="prompts cut from the corpus instead: this many windows of --prompt-len tokens")
    p.add_argument("--corpus", default="canterbury", help="with --windows: the corpus (as `compare`)")
    p.add_argument("--prompt-len", type=int, default=512,
                   help="with --windows: tokens per prompt; also the length of each calibration window")
    p.add_argument("--calibration-windows", type=int, default=2,
                   help="calibrated specs (e.g. avq2-cal): windows of --corpus whose fp16 K/V fit them, after the "
                        "--windows prompts (disjoint) or centred in the corpus with --prompt; 0 = none (a "
                        "calibrated spec is then refused)"),
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="the quantizer's and the sampler's seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="model dtype (default: float16 on a GPU, float32 on a CPU)")
    p.add_argument("--no-graph", action="store_true", help="eager decode steps (no CUDA graph)")
    p.add_argument("--compile", action="store_true",
                   help="compile the model's decoder layers (torch.compile) around the cache for the decode steps "
                        "(the prefill runs them uncompiled): faster steps after a first call that pays the compile")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the same generation N times and report each call's tokens/s (whole calls; --json's "
                        "headline is the last): the first pays the graph capture (and --compile's compile), later "
                        "calls reuse the kept engine, as a server does after warm-up")
    p.add_argument("--json", type=Path, default=None, help="also write the texts, tokens and timings here")
    p.set_defaults(func=cmd_generate)


def _check(args):
    from ...quantizers import get_quantizer
    from ..harness.calibration import spec_needs_calibration
    from ..harness.models import check_model_name
    from .run import UsageError

    for name in ("max_new_tokens", "prompt_len", "repeat"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.windows is not None and args.windows < 1:
        raise UsageError("--windows must be >= 1")
    if args.prompt is not None and any(not p for p in args.prompt):
        raise UsageError("--prompt must not be empty")
    if args.calibration_windows < 0:
        raise UsageError(f"--calibration-windows must be >= 0, got {args.calibration_windows}")
    if args.spec != "plain":
        try:
            get_quantizer(args.spec)
        except Exception as e:  # noqa: BLE001 (the registry's own message names the problem)
            raise UsageError(str(e)) from None
        if args.calibration_windows == 0 and spec_needs_calibration(args.spec):
            raise UsageError(f"--spec {args.spec} is a calibrated quantizer (fitted once per model on calibration "
                             "K/V) and --calibration-windows 0 gives it none: use --calibration-windows N "
                             "(N >= 1 windows of --corpus, default 2)")
    try:
        check_model_name(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device is not None:
        import torch

        try:
            dev = torch.device(args.device)
        except RuntimeError as e:
            raise UsageError(f"--device {args.device!r}: {e}") from None
        if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
            raise UsageError(f"--device {args.device!r}: use cpu, or cuda[:N] on a machine with a GPU")
    if args.json is not None and args.json.exists() and args.json.is_dir():
        raise UsageError(f"--json {args.json} is a folder")


def cmd_generate(args) -> int:
    import torch

    from ..harness.calibration import corpus_calibration, spec_needs_calibration
    from ..harness.corpora import load_corpus, special_prefix, token_windows, tokenize_text, window_starts
    from ..harness.generate import generate
    from ..harness.models import load_model
    from .run import UsageError

    _check(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float16" if device.startswith("cuda") else "float32"))
    print(f"loading {args.model} on {device} ({dtype}) ...", file=sys.stderr, flush=True)
    model, tok, _ = load_model(args.model, device=device, dtype=dtype)
    spec = None if args.spec == "plain" else args.spec
    calibrated = spec_needs_calibration(spec)
    text = scored = None
    if args.windows is not None or calibrated:
        text, corpus_info = load_corpus(args.corpus)
    if args.windows is not None:
        prompts = token_windows(tok, text, args.prompt_len, args.windows).tolist()
        body = args.prompt_len - len(special_prefix(tok))
        scored = window_starts(len(tokenize_text(tok, text)), body, args.windows)
    else:
        texts = args.prompt or ["Alice was beginning to get very tired of sitting by her sister on the bank, and"]
        prompts = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
    calibration = cal_info = None
    if calibrated:
        try:
            calibration, cal_info = corpus_calibration(model, tok, text, args.calibration_windows, args.prompt_len,
                                                       scored_starts=scored)
        except ValueError as e:
            raise UsageError(f"--calibration-windows {args.calibration_windows} of --prompt-len {args.prompt_len} "
                             f"tokens of --corpus {args.corpus}: {e}") from None
        cal_info = {"corpus": {k: corpus_info.get(k) for k in ("name", "sha256")}, **cal_info}
        print(f"{spec}: calibrated on {cal_info['n']} window(s) of {cal_info['tokens']} tokens of "
              f"{corpus_info.get('name')}, token ranges {cal_info['ranges']}", file=sys.stderr, flush=True)
    calls, walls = [], []
    for call in range(args.repeat):
        # timed as a whole call (engine lookup, rewind, prefill, steps, tokens back), the way
        # the generate benchmark times both engines; generate synchronises before it returns
        t0 = time.perf_counter()
        out = generate(model, prompts, spec, max_new_tokens=args.max_new_tokens, tokenizer=tok, stop=args.stop,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       graph=False if args.no_graph else None, compile=args.compile, calibration=calibration)
        walls.append(time.perf_counter() - t0)
        calls.append(out)
        if call == 0:
            for i, text in enumerate(out.texts):
                print(f"--- [{i}] {len(prompts[i])} prompt tokens -> {len(out.tokens[i])} new")
                print(text)
        label = f"call {call + 1} of {args.repeat}: " if args.repeat > 1 else ""
        print(f"{args.spec}: {label}{out.new_tokens} new tokens in {walls[-1]:.2f} s "
              f"({out.new_tokens / walls[-1]:.1f} tokens/s, whole call; prefill {out.prefill_s:.2f} s, decode steps "
              f"{out.decode_tokens_per_s:.1f} tokens/s), batches {[len(b) for b in out.batches]}, "
              f"steps: {out.mode}" + (f" ({out.why})" if out.why else ""), file=sys.stderr)
    out, wall = calls[-1], walls[-1]  # the headline: the last call (after --repeat's warm-up calls)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(spec=args.spec, model=args.model, device=device, prompts=prompts,
                                             tokens=out.tokens, texts=out.texts,
                                             timed=f"the last of {args.repeat} call(s), whole call (wall)",
                                             tokens_per_s=out.new_tokens / wall, wall_s=wall,
                                             decode_tokens_per_s=out.decode_tokens_per_s, prefill_s=out.prefill_s,
                                             decode_s=out.decode_s, mode=out.mode, why=out.why,
                                             calibration=cal_info,
                                             calls=[dict(tokens_per_s=c.new_tokens / w, wall_s=w, prefill_s=c.prefill_s,
                                                         decode_s=c.decode_s, decode_tokens_per_s=c.decode_tokens_per_s)
                                                    for c, w in zip(calls, walls)]), indent=1))
    return 0
