"""The generate benchmark's Markdown table and plot, from its JSON (written after every row,
so a cut run renders what it measured): `python -m kvqbench.suites.bench.generate --render
RUN.json ...` re-renders saved runs without measuring."""
from __future__ import annotations

import json
from pathlib import Path

BASE = "hf-static-compile"  # the plot's reference line: transformers' fastest fp16 path


def _section(r: dict) -> str:
    return r.get("section") or f"batch {r['batch']}"


def render(data: dict) -> str:
    rows = data["rows"]
    # (the rule the run itself used: runs before `figure_run` was recorded took the last run)
    rule = (f"the fastest of {data['runs']} runs after the first (which compiles)"
            if any("figure_run" in r for r in rows) else f"last of {data['runs']} runs")
    split_col = any("prefill_s" in r for r in rows)  # (runs before the time split had none)
    lines = [f"# Generation throughput: {data['shape']} (random weights), {data['dtype']}, prompt {data['prompt']}, "
             f"{data['new']} new tokens, greedy", "",
             f"{data['environment']}", "",
             f"tokens/s = batch x new tokens / wall seconds of the whole call (prefill included), {rule}; "
             "x = ratio to the row named, same run, same batch.", ""]
    if any("calls" in r for r in rows):
        lines += ["Ragged: N prompts of different lengths, once as one left-padded call (hf-*: with an "
                  "attention_mask, pad id 0) and once as N separate batch-1 calls (`(N separate calls)`: their "
                  "seconds summed); tokens/s = N x new tokens / seconds; x hf-* compares like calls (padded to padded, "
                  "separate to separate); x separate calls = the padded call's tokens/s / the same row's "
                  "separate calls' tokens/s.", ""]
    sections = [f"batch {b}" for b in sorted({r["batch"] for r in rows if "section" not in r})]
    for sec in sections + list(dict.fromkeys(r["section"] for r in rows if "section" in r)):
        sub = [r for r in rows if _section(r) == sec and "error" not in r]
        base = {(r["row"], r.get("calls")): r["tokens_per_s"] for r in sub}
        ragged = any("calls" in r for r in sub)
        lines += [f"## {sec}", "", "| row | tokens/s | x hf-dynamic | x hf-static-compile | decode-only tokens/s "
                  f"|{' prefill / decode / other ms |' if split_col else ''} step mode |"
                  f"{' x separate calls |' if ragged else ''}",
                  "|---|---|---|---|---|" + ("---|" if split_col else "") + "---|" + ("---|" if ragged else "")]
        for r in sub:
            ratio = lambda b, c=r.get("calls"): (  # noqa: E731
                f"{r['tokens_per_s'] / base[b, c]:.2f}" if (b, c) in base else "-")
            dec = f"{r['decode_tokens_per_s']:.0f}" if r.get("decode_tokens_per_s") else "-"
            label = r["row"] + (f" ({r['batch']} separate calls)" if r.get("calls") == "separate" else "")
            sep = f" {ratio(r['row'], 'separate')} |" if r.get("calls") == "padded" else " - |" if ragged else ""
            split = (f"{1e3 * r['prefill_s']:.0f} / {1e3 * r['decode_s']:.0f} / {1e3 * r['other_s']:.0f}"
                     if "prefill_s" in r else "-")
            lines.append(f"| {label} | {r['tokens_per_s']:.1f} | {ratio('hf-dynamic')} | "
                         f"{ratio('hf-static-compile')} | {dec} |{f' {split} |' if split_col else ''} {r['mode']}"
                         f"{' (' + r['why'] + ')' if r['why'] else ''} |{sep}")
        lines.append("")
    for r in rows:
        if "error" in r:
            lines.append(f"- {r['row']} {_section(r)}{', separate calls' if r.get('calls') == 'separate' else ''}: "
                         f"FAILED: {r['error']}")
    return "\n".join(lines) + "\n"


def _label(r: dict) -> str:
    return r["row"] + (" (separate calls)" if r.get("calls") == "separate" else "")


def plot(data: dict, path: Path) -> bool:
    """tokens/s per row, one panel per batch (and ragged) section: transformers' rows grey,
    kvqbench's eager / graphed rows blue, its compiled rows orange; a dashed line at
    transformers' StaticCache + torch.compile and each bar's ratio to it. False without
    matplotlib or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in data["rows"] if "error" not in r]
    sections = list(dict.fromkeys(_section(r) for r in rows))
    if not sections:
        return False
    n = max(len([r for r in rows if _section(r) == s]) for s in sections)
    fig, axes = plt.subplots(1, len(sections), figsize=(5.2 * len(sections), 0.38 * n + 1.8), squeeze=False)
    for ax, sec in zip(axes[0], sections):
        sub = [r for r in rows if _section(r) == sec]
        colour = ["0.6" if r["row"].startswith("hf-") else "tab:orange" if "+compile" in r["row"] else "tab:blue"
                  for r in sub]
        y = list(range(len(sub)))[::-1]
        ax.barh(y, [r["tokens_per_s"] for r in sub], color=colour)
        ax.set_yticks(y, [_label(r) for r in sub], fontsize=7)
        base = {r.get("calls"): r["tokens_per_s"] for r in sub if r["row"] == BASE}
        for yy, r in zip(y, sub):
            b = base.get(r.get("calls"))
            if b and r["row"] != BASE:
                ax.text(r["tokens_per_s"], yy, f" {r['tokens_per_s'] / b:.2f}x", va="center", fontsize=7)
        for b in base.values():
            ax.axvline(b, color="k", ls="--", lw=0.8)
        ax.set_xlabel("tokens/s (whole call, prefill included)")
        ax.set_title(sec, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.18)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color="0.6", label="transformers generate"), Patch(color="tab:blue", label="kvqbench"),
                        Patch(color="tab:orange", label="kvqbench, compile=True")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    env = data.get("environment", {})
    fig.suptitle(f"generate: {data['shape']} (random weights), {data['dtype']}, prompt {data['prompt']}, "
                 f"{data['new']} new tokens; {env.get('gpu') or env.get('device') or data.get('device', '')}\n"
                 f"x = tokens/s over {BASE} (dashed line), same run, same batch and calls",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (long row names: nothing clipped)
    plt.close(fig)
    return True


def render_files(json_path: Path) -> list[Path]:
    """RUN.md and RUN.png beside RUN.json (the plot where matplotlib is installed)."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    md = json_path.with_suffix(".md")
    md.write_text(render(data))
    png = json_path.with_suffix(".png")
    return [md] + ([png] if plot(data, png) else [])
