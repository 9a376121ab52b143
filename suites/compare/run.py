"""`kvqbench compare`: the main job. Perplexity of a real model with its KV cache
quantized by every registered quantizer's example configs (or `--specs`), on
fixed windows of a named corpus, under a named protocol; writes
`reports/<run>/results.json`, `report.md` and plots.

Resumable: results.json is rewritten after every configuration, and a rerun
with the same run name, model, corpus, windows and protocol skips what is
already measured (`--fresh` starts over). A configuration that fails is
recorded with its error and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "canterbury"
SEED_SPEC = "hqmq:S=96,r=4,outliers=med3"  # the HQMQ setting run over several seeds


def default_specs() -> list[str]:
    """fp16 first, then every example config of every registered quantizer: a new
    plugin is compared without touching this file."""
    from ...quantizers import registry

    specs = ["fp16"]
    for name in sorted(registry()):
        specs += [s for s in registry()[name].examples() if s not in specs]
    return specs


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def hardware(device: str) -> dict:
    hw = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device}
    if device.startswith("cuda"):
        hw["gpu"] = torch.cuda.get_device_name(0)
    return hw


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


def _identity(meta: dict) -> tuple:
    """What must match for a rerun to resume: the same model bytes, text, windows
    and protocols (not, say, how long the model took to load)."""
    m, c = meta["model"], meta["corpus"]
    return (m.get("name"), m.get("sha256"), c.get("name"), c.get("sha256"),
            json.dumps(meta["windows"], sort_keys=True), tuple(meta["protocols"]))


class Run:
    """results.json of one run: meta + one record per (protocol, spec, seed)."""

    def __init__(self, folder: Path, meta: dict, fresh: bool):
        self.folder, self.path = folder, folder / "results.json"
        folder.mkdir(parents=True, exist_ok=True)
        self.data = {"meta": meta, "results": [], "diagnostics": None}
        if self.path.exists() and not fresh:
            old = json.loads(self.path.read_text())
            if _identity(old["meta"]) == _identity(meta):
                self.data["results"] = [r for r in old["results"] if "error" not in r]
                self.data["diagnostics"] = old.get("diagnostics")
            else:
                raise SystemExit(f"{self.path} holds a run with another model/corpus/windows/protocol; "
                                 "use --run NAME for a new run or --fresh to overwrite")

    def done(self, protocol: str, spec: str, seed: int) -> bool:
        return any((r["protocol"], r["spec"], r["seed"]) == (protocol, spec, seed) for r in self.data["results"])

    def add(self, record: dict) -> None:
        self.data["results"].append(record)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)  # atomic: an interrupt never leaves half a file


def run_compare(args) -> Path:
    from tqdm import tqdm

    from ...quantizers import get_quantizer
    from . import report
    from ..harness.corpora import _special_prefix, _tokenize, load_corpus, token_windows, window_starts
    from ..harness.models import load_model
    from ..harness.perplexity import ppl_prefill_then_decode, ppl_quantize_on_write

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    specs = args.specs.split(";") if args.specs else default_specs()
    for spec in specs:  # fail on a typo before an hour of work, not after
        get_quantizer(spec)
    protocols = ["quantize-on-write", "prefill-then-decode"] if args.protocol == "both" else [args.protocol]

    print(f"loading model {args.model} and corpus {args.corpus} ...", file=sys.stderr, flush=True)
    model, tok, model_info = load_model(args.model, device=device, dtype=getattr(torch, args.dtype))
    text, corpus_info = load_corpus(args.corpus)
    window = args.window if "prefill-then-decode" not in protocols else max(args.window, args.context + args.decode_tokens)
    windows = token_windows(tok, text, window, args.windows)
    n_tokens = len(_tokenize(tok, text))  # memoised by token_windows
    meta = {
        "model": model_info, "corpus": corpus_info, "protocols": protocols,
        "windows": {"n": args.windows, "tokens": window,
                    "starts": window_starts(n_tokens, window - len(_special_prefix(tok)), args.windows),
                    "placement": "evenly spaced over the whole tokenized corpus, disjoint; only the special "
                                 "tokens the tokenizer itself prepends (Gemma's BOS)"},
        "prefill_then_decode": {"context": args.context, "decode_tokens": window - args.context},
        "dtype": args.dtype, "versions": versions(), "hardware": hardware(device),
        "seed_spec": SEED_SPEC, "seeds": list(range(args.seeds)),
    }
    name = args.run or f"{args.model}_{args.corpus}".replace("/", "-")
    run = Run(Path(args.out) / name, meta, args.fresh)
    if run.data["diagnostics"] is None:
        run.data["diagnostics"] = outlier_diagnostics(model, windows[0])
        run.save()

    jobs = [(p, s, 0) for p in protocols for s in specs]
    if SEED_SPEC in specs:
        jobs += [(p, SEED_SPEC, seed) for p in protocols for seed in range(1, args.seeds)]
    todo = [j for j in jobs if not run.done(*j)]
    print(f"{len(jobs)} configurations, {len(jobs) - len(todo)} already measured in {run.path}", file=sys.stderr)
    bar = tqdm(total=len(todo) * len(windows), unit="window", dynamic_ncols=True)
    for protocol, spec, seed in todo:
        bar.set_postfix_str(f"{protocol} {spec} seed={seed}")
        step = lambda done, total: bar.update(1)  # noqa: E731
        try:
            if protocol == "quantize-on-write":
                r = ppl_quantize_on_write(model, windows, spec, seed, progress=step)
            else:
                r = ppl_prefill_then_decode(model, windows, spec, seed, context=args.context, progress=step)
            q = get_quantizer(spec)
            r["formula_bits"] = q.formula_bits(model_info["head_dim"])
            r["family"] = q.name
            run.add(r)
            tqdm.write(f"{protocol:20s} {spec:34s} seed={seed}  PPL {r['ppl']:10.4f}  "
                       f"bits {r['bits_per_element']:6.3f} (formula {r['formula_bits']:6.3f})  {r['wall_s']:6.1f} s")
        except Exception as e:  # keep what is measured; record the failure
            run.add({"protocol": protocol, "spec": spec, "seed": seed, "error": f"{type(e).__name__}: {e}"})
            tqdm.write(f"FAILED {protocol} {spec} seed={seed}: {type(e).__name__}: {e}")
    bar.close()
    if args.lm_eval:  # lm-eval task scores beside PPL and bits: seed 0, first protocol's records
        from ..lm_eval.model import compare_scores

        meta_le = json.loads(args.lm_eval_metadata) if args.lm_eval_metadata else None
        for rec in [r for r in run.data["results"] if "error" not in r and r["seed"] == 0
                    and r["protocol"] == protocols[0] and r["spec"] in specs]:
            if rec.get("lm_eval", {}).get("requested") == [args.lm_eval, args.lm_eval_limit, meta_le] \
                    and "error" not in rec["lm_eval"]:
                continue  # measured in an earlier run of the same request
            print(f"lm-eval {args.lm_eval} with {rec['spec']} ...", file=sys.stderr, flush=True)
            try:
                rec["lm_eval"] = compare_scores(model, tok, rec["spec"], 0, args.lm_eval, args.lm_eval_limit, meta_le)
            except Exception as e:  # keep the PPL results; record the failure
                rec["lm_eval"] = {"requested": [args.lm_eval, args.lm_eval_limit, meta_le],
                                  "error": f"{type(e).__name__}: {e}"}
            run.save()
    out = report.write_report(run.folder)
    print(f"\nreport: {out}", file=sys.stderr)
    return out


def add_arguments(sub) -> None:
    p = sub.add_parser("compare", help="perplexity of every quantizer on a real model; writes reports/<run>/",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name, local folder or hub id")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="canterbury, austen, wikitext2, wikitext103 or a text file")
    p.add_argument("--protocol", default="quantize-on-write",
                   choices=["quantize-on-write", "prefill-then-decode", "both"])
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--windows", type=int, default=4, help="number of windows")
    p.add_argument("--context", type=int, default=384, help="prefill-then-decode: prefill tokens L")
    p.add_argument("--decode-tokens", type=int, default=64, help="prefill-then-decode: decode steps M")
    p.add_argument("--specs", default=None, help="';'-separated quantizer specs (default: every registered example)")
    p.add_argument("--seeds", type=int, default=3, help=f"codebook seeds for {SEED_SPEC}")
    p.add_argument("--run", default=None, help="run name (default <model>_<corpus>; reruns resume)")
    p.add_argument("--out", default="reports", help="reports folder")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fresh", action="store_true", help="discard earlier results of this run")
    p.add_argument("--lm-eval", default=None, metavar="TASKS",
                   help="also run these lm-eval tasks per spec (comma-separated; kvqbench_local = the offline "
                        "passkey and rolling tasks; hub tasks such as piqa where the hub is reachable)")
    p.add_argument("--lm-eval-limit", type=int, default=None, help="lm-eval: at most this many documents per task")
    p.add_argument("--lm-eval-metadata", default=None, metavar="JSON",
                   help='lm-eval task knobs, e.g. \'{"passkey_docs": 10}\' (see kvqbench.suites.lm_eval.tasks)')
    p.set_defaults(func=run_compare)
