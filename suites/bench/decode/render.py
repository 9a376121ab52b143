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


PLAIN = ("plain", "plain-static")


def _run_of(r) -> str:
    return r.get("run", "eager")  # runs before the graph mode: eager


def _index(rows):
    idx = {}
    for r in rows:  # a repeated configuration: the later row counts
        if "error" not in r and "skipped" not in r:
            idx[(r["spec"], r["context"], r["batch"], _run_of(r))] = r
    return idx


def _rehearsed(idx) -> bool:
    """Whether the plain DynamicCache rows were timed after a rehearsal over the same
    lengths (runs before that change timed cuDNN SDPA's per-length plan builds: ~10x)."""
    plain = [r for k, r in idx.items() if k[0] == "plain"]
    return bool(plain) and all("ms_per_step_cold" in r for r in plain)


def best_plain(idx, ctx: int, b: int):
    """The fastest plain fp16 row at (ctx, b) over caches and runs (DynamicCache eager,
    StaticCache eager or graphed): (row, its label) or (None, None)."""
    rows = [(r["ms_per_step"], f"{k[0]} {k[3]}", r) for k, r in idx.items() if k[0] in PLAIN and k[1:3] == (ctx, b)]
    if not rows:
        return None, None
    ms, label, r = min(rows, key=lambda x: x[0])
    return r, label


def targets(run: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows for the run's main shape: every speed target for
    each run mode (eager, graph) against the plain DynamicCache (the issue's baseline,
    eager: it cannot be graphed) and against the fastest plain row of that shape."""
    idx = _index(run["results"])
    out = []
    runs = sorted({k[3] for k in idx if k[0] not in PLAIN}, key=lambda m: m != "eager")

    skipped = {(r["spec"], r["context"], r["batch"], _run_of(r)) for r in run["results"] if "skipped" in r}

    def verdict(spec, ctx, b, mode, limit, base):
        a = idx.get((spec, ctx, b, mode))
        if base == "plain":
            p, label = idx.get(("plain", ctx, b, "eager")), "plain DynamicCache (eager)"
        else:
            p, label = best_plain(idx, ctx, b)
            label = f"the fastest plain ({label})" if label else "the fastest plain"
        if a is None and (spec, ctx, b, mode) in skipped:
            return label, "not graphable (see above)", "-"
        if a is None or p is None:
            return label, "not run", "-"
        r = a["ms_per_step"] / p["ms_per_step"]
        if base == "plain" and not _rehearsed(idx):
            return label, f"{r:.2f}x", "not judged: plain timed cold (measure.py)"
        return label, f"{r:.2f}x ({a['ms_per_step']:.2f} / {p['ms_per_step']:.2f} ms)", "met" if r <= limit else "NOT met"

    fused = sorted({r["spec"] for r in run["results"] if "fused" in r.get("mode", [])})
    for base in ("plain", "best"):
        for mode in runs:
            for spec, ctx, b, limit in SPEED_TARGETS:
                label, m, v = verdict(spec, ctx, b, mode, limit, base)
                out.append((f"{spec} {mode} ms/step <= {limit}x {label} (ctx {ctx}, batch {b})", m, v))
            for spec in fused:
                label, m, v = verdict(spec, *BIG, mode, 1.0, base)
                if m != "not run":
                    out.append((f"{spec} {mode} at least as fast as {label} (ctx {BIG[0]}, batch {BIG[1]})", m, v))
    spec, limit = MEMORY_TARGET
    a, p = idx.get((spec, *BIG, "eager")), idx.get(("plain", *BIG, "eager"))
    r = None if a is None or p is None else a["kv_live_bytes"] / p["kv_live_bytes"]
    out.append((f"{spec} KV memory <= {limit}x plain (ctx {BIG[0]}, batch {BIG[1]}, measured)",
                "not run" if r is None else f"{r:.3f}x", "-" if r is None else ("met" if r <= limit else "NOT met")))
    return out


def markdown(run: dict) -> str:
    env, cfg = run["environment"], run["config"]
    lines = [f"# Decode benchmark: {cfg['shape']} (random weights), {cfg['dtype']}", "",
             f"{env.get('gpu', '?')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}, CUDA {env.get('cuda')}, driver {env.get('driver', '?')}; "
             f"{env.get('time', '')}" + (f" (resumed: earlier calls started {', '.join(map(str, run['resumed_from']))}; "
                                        "same GPU, versions and settings)" if run.get("resumed_from") else "") + ".", "",
             "Greedy decoding after a prefill of `context` random tokens per row; ms per decode step "
             f"(median of {cfg['steps']} steps, synchronised per step, after {cfg['warmup']} warm-up steps). "
             "`plain` is transformers' DynamicCache (SDPA; grows by torch.cat, a new allocation per step "
             "and layer; timed on a second pass over the same lengths, since cuDNN SDPA builds a plan per new "
             "length: the first pass is the `cold` column), "
             "`plain-static` its StaticCache (preallocated, written in place); the others are kvqbench's QuantizedCache under the 'kvqbench' "
             "attention (mode `fused`: the fused kernel reads the packed device store; `dense`: "
             "dequantized history + SDPA). Run `eager`: the model is called per step; `graph`: the step is "
             "captured once in a CUDA graph (kernels/graphs.py `GraphedDecodeStep`: the quantized cache keeps "
             "its length on the device, the kernels read it) and replayed; both runs share one prefill, the "
             "graph run starting warm-up + steps tokens later. `x plain`: against the plain DynamicCache (eager) "
             "of the same shape; `x best`: against the fastest plain row of the shape (any cache, any run). "
             "Weights are random (real shapes): speed and memory do not "
             "depend on them. KV = memory held by the cache after decoding (allocator, model excluded; graph "
             "runs include the graph's memory pool).", "",
             "| context | batch | cache | run | mode | ms/step | mean | cold | x plain | x best | tokens/s | KV GiB | "
             "x plain | bits/elem | prefill s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    idx = _index(run["results"])
    skipped = []
    for r in run["results"]:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['batch']} | {r['spec']} | {_run_of(r)} | error | {r['error'][:80]} "
                         "||||||||||")
            continue
        if "skipped" in r:
            skipped.append(r)
            continue
        p = idx.get(("plain", r["context"], r["batch"], "eager"))
        best, _ = best_plain(idx, r["context"], r["batch"])
        xs = f"{r['ms_per_step'] / p['ms_per_step']:.2f}" if p else "-"
        xb = f"{r['ms_per_step'] / best['ms_per_step']:.2f}" if best else "-"
        xm = f"{r['kv_live_bytes'] / p['kv_live_bytes']:.3f}" if p and p["kv_live_bytes"] else "-"
        mode = "/".join(r.get("mode", [])) + (f" ({r['fallbacks']} fallbacks)" if r.get("fallbacks") else "")
        if _run_of(r) == "graph" and r.get("graph_mode") != "graph":  # e.g. a capture that failed
            mode += f" (uncaptured: {r.get('graph_why')})"
        mean = f"{r['ms_per_step_mean']:.1f}" if "ms_per_step_mean" in r else "-"
        cold = f"{r['ms_per_step_cold']:.2f}" if "ms_per_step_cold" in r else "-"
        lines.append(f"| {r['context']} | {r['batch']} | {r['spec']} | {_run_of(r)} | {mode} | {r['ms_per_step']:.2f} | "
                     f"{mean} | {cold} | {xs} | {xb} | {r['tokens_per_s']:.0f} | {r['kv_live_bytes'] / GiB:.3f} | {xm} | "
                     f"{r['bits_per_element']:.3f} | {r['prefill_s']:.2f} |")
    if skipped:
        lines += ["", "Not graphed (the graph run of these falls back to eager steps, so it is not timed twice):", ""]
        seen = set()
        for r in skipped:
            if (r["spec"], r["skipped"]) not in seen:
                seen.add((r["spec"], r["skipped"]))
                lines.append(f"- {r['spec']}: {r['skipped']}")
    if run.get("checks"):
        lines += ["", "## Fused vs dense decoding, and graphed vs eager fused (same model, same tokens fed to all)",
                  "", "Graph: the same steps through `GraphedDecodeStep` (captured, replayed) against the eager "
                  "fused steps: greedy tokens equal, max abs logit difference, and whether the cache's measured "
                  "bytes and bits agree after the steps.", "",
                  "| cache | context | batch | greedy tokens equal | max abs logit diff | max abs logit | fallbacks | "
                  "graph run | graph tokens equal | graph max abs logit diff | graph bytes, bits equal |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in run["checks"]:
            g = ("| - | - | - | - |" if "graph_mode" not in c else
                 f"| {c['graph_mode'][:90]} | {c['graph_agree']}/{c['greedy_total']} | "
                 f"{c['graph_max_abs_logit_diff']:.3g} | {c['graph_same_nbytes']}, {c['graph_same_bits']} |")
            lines.append(f"| {c['spec']} | {c['context']} | {c['batch']} | {c['greedy_agree']}/{c['greedy_total']} | "
                         f"{c['max_abs_logit_diff']:.3g} | {c['max_abs_logit']:.3g} | {c['fallbacks']} {g}")
    if run.get("write_cost"):
        lines += ["", "## One decode step's write through the cache, per layer (K and V)", "",
                  "`QuantizedLayer.update` of one token (attention excluded), "
                  "`measure.write_cost`: step encode = the device kernels write into the store; "
                  "off = the quantizer's `append` + the store's `append`. Maxima over the counted steps; host us = "
                  "host wall time per update (eager runs; a graph replay runs none of it).", "",
                  "| cache | step encode | torch ops | Triton launches | host reads | host us |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['spec']} | {'on' if c['step_encode'] else 'off'} | {c['max_ops']} | {c['max_launches']} | "
                  f"{c['max_host_reads']} | {c['host_us']:.0f} |" for c in run["write_cost"]]
    lines += ["", "## Targets (issue 9)", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(run)]
    if run.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in run["notes"]]
    return "\n".join(lines) + "\n"


def plot(run: dict, path: Path) -> bool:
    """tokens/s and KV memory against context: one row of panels per batch size, a colour
    per cache, solid eager / dotted graph; the legend below the panels (a full grid has
    too many lines for one inside). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    rows = [r for r in run["results"] if "error" not in r and "skipped" not in r]
    specs = sorted({r["spec"] for r in rows})
    batches = sorted({r["batch"] for r in rows}) or [1]
    fig, axes = plt.subplots(len(batches), 2, figsize=(12, 3.6 * len(batches) + 1.2), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for (a, b), batch in zip(axes, batches):
        for i, spec in enumerate(specs):
            c = colors[i % len(colors)]
            for mode, style, marker in (("eager", "-", "o"), ("graph", ":", "s")):
                pts = sorted((r["context"], r["tokens_per_s"], r["kv_live_bytes"] / GiB) for r in rows
                             if r["spec"] == spec and r["batch"] == batch and _run_of(r) == mode)
                if not pts:
                    continue
                x = [p[0] for p in pts]
                a.plot(x, [p[1] for p in pts], style, color=c, marker=marker)
                if mode == "eager":  # the same cache either way: one memory line
                    b.plot(x, [p[2] for p in pts], style, color=c, marker=marker)
        for ax, label in ((a, "tokens/s (decode, median step)"), (b, "KV cache memory (GiB, measured)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"batch {batch}", fontsize=9)
            ax.grid(alpha=0.3)
        if any(r["kv_live_bytes"] > 0 for r in rows if r["batch"] == batch):
            b.set_yscale("log")
    handles = [Line2D([], [], color=colors[i % len(colors)], lw=2, label=s) for i, s in enumerate(specs)]
    handles += [Line2D([], [], color="gray", ls="-", marker="o", label="eager steps"),
                Line2D([], [], color="gray", ls=":", marker="s", label="CUDA-graph steps")]
    fig.legend(handles=handles, loc="lower center", ncol=min(5, len(handles)), fontsize=8, frameon=False)
    env = run["environment"]
    fig.suptitle(f"{run['config']['shape']} (random weights), {env.get('gpu', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.1 if len(batches) < 2 else 0.07, 1, 1))
    fig.savefig(path, dpi=110)
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


__all__ = ["best_plain", "markdown", "plot", "render", "targets"]
