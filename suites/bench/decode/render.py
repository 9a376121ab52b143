"""Markdown report and plot of a decode benchmark run (`decode.json` -> `decode.md`, `decode.png`)."""
from __future__ import annotations

import json
from pathlib import Path

GiB = 2**30
# The engine comparison (issue 29): each quantized format's graphed step against the fp16
# store's graphed step (same engine, same run) at these (context, batch) cells of the
# Llama-3-8B shape; and the KV-memory target at ctx 32k, batch 8 (issue 9).
ENGINE_CELLS = [(4096, 1), (32768, 1), (32768, 8)]
BIG = (32768, 8)
MEMORY_TARGET = ("hqmq:S=96,r=4", 0.35)
ENGINE_FP16 = "fp16"  # the engine's fp16 store (kernels/formats/fp16.py)

PLAIN = ("plain", "plain-static", "plain-compiled")


def _run_of(r) -> str:
    return r.get("run", "eager")  # runs before the graph mode: eager


def _index(rows):
    idx = {}
    for r in rows:  # a repeated configuration: the later row counts
        if "error" not in r and "skipped" not in r:
            idx[(r["spec"], r["context"], r["batch"], _run_of(r))] = r
    return idx


def best_plain(idx, ctx: int, b: int):
    """The fastest plain fp16 row at (ctx, b) over transformers' caches and runs
    (DynamicCache eager, StaticCache eager / graphed / compiled): (row, its label) or (None, None)."""
    rows = [(r["ms_per_step"], f"{k[0]} {k[3]}", r) for k, r in idx.items() if k[0] in PLAIN and k[1:3] == (ctx, b)]
    if not rows:
        return None, None
    ms, label, r = min(rows, key=lambda x: x[0])
    return r, label


def engine_table(run: dict) -> list[str]:
    """Markdown: at each ENGINE_CELLS cell, the fp16 engine's graphed ms/step, transformers'
    rows beside it, and every quantized format's graphed step as a speed-up over the fp16
    engine (fp16 ms / its ms: above 1 is faster)."""
    idx = _index(run["results"])
    cells = [c for c in ENGINE_CELLS if any(k[1:3] == c for k in idx)]
    if not cells:
        return []
    head = "| | " + " | ".join(f"ctx {c}, batch {b}" for c, b in cells) + " |"
    lines = [head, "|---|" + "---|" * len(cells)]

    def ms(spec, run_, c):
        r = idx.get((spec, *c, run_))
        return None if r is None else r["ms_per_step"]

    def row(label, vals):
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    fp = {c: ms(ENGINE_FP16, "graph", c) for c in cells}
    row("fp16 engine, graphed (ms/step)", [f"{fp[c]:.3f}" if fp[c] else "not run" for c in cells])
    for spec, run_, label in (("plain-compiled", "compiled", "transformers StaticCache + torch.compile"),
                              ("plain-static", "graph", "transformers StaticCache, graphed"),
                              ("plain", "eager", "transformers DynamicCache, eager")):
        row(f"{label} (ms/step; fp16 engine speed-up)",
            [f"{m:.3f} ({m / fp[c]:.2f}x)" if m and fp[c] else (f"{m:.3f}" if m else "not run")
             for c in cells for m in [ms(spec, run_, c)]])
    specs = sorted({k[0] for k in idx if k[0] not in PLAIN and k[0] != ENGINE_FP16 and k[3] == "graph"})
    for spec in specs:
        row(f"`{spec}` graphed: speed-up over fp16 engine (ms/step)",
            [f"**{fp[c] / m:.2f}x** ({m:.3f})" if m and fp[c] else "not run"
             for c in cells for m in [ms(spec, "graph", c)]])
    return lines


def targets(run: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict): the KV-memory target at ctx 32k, batch 8."""
    idx = _index(run["results"])
    spec, limit = MEMORY_TARGET
    a, p = idx.get((spec, *BIG, "eager")), idx.get(("plain", *BIG, "eager"))
    r = None if a is None or p is None else a["kv_live_bytes"] / p["kv_live_bytes"]
    return [(f"{spec} KV memory <= {limit}x plain (ctx {BIG[0]}, batch {BIG[1]}, measured)",
             "not run" if r is None else f"{r:.3f}x", "-" if r is None else ("met" if r <= limit else "NOT met"))]


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
             "`plain-static` its StaticCache (preallocated, written in place; attends over its whole capacity), "
             "`plain-compiled` that StaticCache with the forward under torch.compile (mode reduce-overhead, "
             "its own CUDA graphs; run `compiled`, timed after its compile); `fp16` is kvqbench's fp16 store "
             "in the engine (split-K kernel over the valid tokens); the others are kvqbench's QuantizedCache under the 'kvqbench' "
             "attention (mode `fused`: the fused kernel reads the packed device store; `dense`: "
             "dequantized history + SDPA). Run `eager`: the model is called per step; `graph`: the step is "
             "captured once in a CUDA graph (kernels/graphs.py `GraphedDecodeStep`: the quantized cache keeps "
             "its length on the device, the kernels read it) and replayed; both runs share one prefill, the "
             "graph run starting warm-up + steps tokens later. `x fp16`: ms/step against the engine's fp16 row "
             "of the same run mode (graph with graph); `x best`: against the fastest of transformers' rows of the "
             "shape (any cache, any run). "
             "Weights are random (real shapes): speed and memory do not "
             "depend on them. KV = memory held by the cache after decoding (allocator, model excluded; graph "
             "runs include the graph's memory pool).", "",
             "| context | batch | cache | run | mode | ms/step | mean | cold | x fp16 | x best | tokens/s | KV GiB | "
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
        e = idx.get((ENGINE_FP16, r["context"], r["batch"], _run_of(r)))
        xs = f"{r['ms_per_step'] / e['ms_per_step']:.2f}" if e else "-"
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
                  "| cache | step encode | torch ops | encoder launches | host reads | host us |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['spec']} | {'on' if c['step_encode'] else 'off'} | {c['max_ops']} | {c['max_launches']} | "
                  f"{c['max_host_reads']} | {c['host_us']:.0f} |" for c in run["write_cost"]]
    engine = engine_table(run)
    if engine:
        lines += ["", "## Against fp16 in the same engine (graphed steps, same run)", "",
                  "Each quantized format's graphed step against the engine's fp16 store, graphed, at the same "
                  "context and batch (speed-up = fp16 ms / its ms; above 1 is faster); transformers' own fp16 "
                  "rows beside, as the fp16 engine's speed-up over them.", ""] + engine
    lines += ["", "## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
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
