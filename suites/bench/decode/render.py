"""Markdown report and plot of a decode benchmark run (`decode.json` -> `decode.md`, `decode.png`)."""
from __future__ import annotations

import json
from pathlib import Path

GiB = 2**30
# Issue 9's "done when" targets at the Llama-3-8B shape: (spec, context, batch, max ratio of
# ms/step to the plain cache's); and the KV-memory target at ctx 32k, batch 8.
SPEED_TARGETS = [("hqmq:S=96,r=4", 4096, 1, 1.3), ("int4", 4096, 1, 1.15), ("kivi:bits=4", 4096, 1, 1.15)]
BIG = (32768, 8)
MEMORY_TARGET = ("hqmq:S=96,r=4", 0.35)


def _index(rows):
    idx = {}
    for r in rows:  # a repeated configuration: the later row counts
        if "error" not in r:
            idx[(r["spec"], r["context"], r["batch"])] = r
    return idx


def targets(run: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows for the run's main shape."""
    idx = _index(run["results"])
    out = []

    def ratio(spec, ctx, b, key):
        a, p = idx.get((spec, ctx, b)), idx.get(("plain", ctx, b))
        return None if a is None or p is None else a[key] / p[key]

    for spec, ctx, b, limit in SPEED_TARGETS:
        r = ratio(spec, ctx, b, "ms_per_step")
        out.append((f"{spec} ms/step <= {limit}x plain (ctx {ctx}, batch {b})",
                    "not run" if r is None else f"{r:.2f}x", "-" if r is None else ("met" if r <= limit else "NOT met")))
    fused = sorted({r["spec"] for r in run["results"] if "fused" in r.get("mode", [])})
    for spec in fused:
        r = ratio(spec, *BIG, "ms_per_step")
        out.append((f"{spec} at least as fast as plain (ctx {BIG[0]}, batch {BIG[1]})",
                    "not run" if r is None else f"{r:.2f}x", "-" if r is None else ("met" if r <= 1.0 else "NOT met")))
    spec, limit = MEMORY_TARGET
    r = ratio(spec, *BIG, "kv_live_bytes")
    out.append((f"{spec} KV memory <= {limit}x plain (ctx {BIG[0]}, batch {BIG[1]}, measured)",
                "not run" if r is None else f"{r:.3f}x", "-" if r is None else ("met" if r <= limit else "NOT met")))
    return out


def markdown(run: dict) -> str:
    env, cfg = run["environment"], run["config"]
    lines = [f"# Decode benchmark: {cfg['shape']} (random weights), {cfg['dtype']}", "",
             f"{env.get('gpu', '?')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}, CUDA {env.get('cuda')}, driver {env.get('driver', '?')}; "
             f"{env.get('time', '')}.", "",
             "Greedy decoding after a prefill of `context` random tokens per row; ms per decode step "
             f"(median of {cfg['steps']} steps, synchronised per step, after {cfg['warmup']} warm-up steps). "
             "`plain` is transformers' DynamicCache (SDPA; grows by torch.cat, a new allocation per step "
             "and layer), `plain-static` its StaticCache (preallocated, written in place); the others are kvqbench's QuantizedCache under the 'kvqbench' "
             "attention (mode `fused`: the fused kernel reads the packed device store; `dense`: "
             "dequantized history + SDPA). Weights are random (real shapes): speed and memory do not "
             "depend on them. KV = memory held by the cache after decoding (allocator, model excluded). "
             "No CUDA graphs (the valid length changes every step).", "",
             "| context | batch | cache | mode | ms/step | x plain | tokens/s | KV GiB | x plain | bits/elem | prefill s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    idx = _index(run["results"])
    for r in run["results"]:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['batch']} | {r['spec']} | error | {r['error'][:80]} |||||||")
            continue
        p = idx.get(("plain", r["context"], r["batch"]))
        xs = f"{r['ms_per_step'] / p['ms_per_step']:.2f}" if p else "-"
        xm = f"{r['kv_live_bytes'] / p['kv_live_bytes']:.3f}" if p and p["kv_live_bytes"] else "-"
        mode = "/".join(r.get("mode", [])) + (f" ({r['fallbacks']} fallbacks)" if r.get("fallbacks") else "")
        lines.append(f"| {r['context']} | {r['batch']} | {r['spec']} | {mode} | {r['ms_per_step']:.2f} | {xs} | "
                     f"{r['tokens_per_s']:.0f} | {r['kv_live_bytes'] / GiB:.3f} | {xm} | "
                     f"{r['bits_per_element']:.3f} | {r['prefill_s']:.2f} |")
    lines += ["", "## Targets (issue 9)", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(run)]
    return "\n".join(lines) + "\n"


def plot(run: dict, path: Path) -> bool:
    """tokens/s and KV memory against context, one line per (cache, batch). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in run["results"] if "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec in sorted({r["spec"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            pts = sorted((r["context"], r["tokens_per_s"], r["kv_live_bytes"] / GiB) for r in rows
                         if r["spec"] == spec and r["batch"] == batch)
            if pts:
                x = [p[0] for p in pts]
                style = "-" if batch == max(r["batch"] for r in rows) else "--"
                a.plot(x, [p[1] for p in pts], style, marker="o", label=f"{spec}, batch {batch}")
                b.plot(x, [p[2] for p in pts], style, marker="o", label=f"{spec}, batch {batch}")
    for ax, label in ((a, "tokens/s (decode)"), (b, "KV cache memory (GiB, measured)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if any(r["kv_live_bytes"] > 0 for r in rows):
        b.set_yscale("log")
    a.legend(fontsize=7)
    env = run["environment"]
    fig.suptitle(f"{run['config']['shape']} (random weights), {env.get('gpu', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def render(json_path: Path) -> list[Path]:
    run = json.loads(Path(json_path).read_text())
    md = Path(json_path).with_suffix(".md")
    md.write_text(markdown(run))
    out = [md]
    png = Path(json_path).with_suffix(".png")
    if plot(run, png):
        out.append(png)
    return out


__all__ = ["markdown", "plot", "render", "targets"]
