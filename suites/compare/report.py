"""Turn a run's results.json into report.md and plots: PPL against measured
bits (the Pareto front, seed spread as error bars), per-layer outlier
diagnostics, and the paper's claims (METHOD.md section 6) with our figures and
a verdict on each, computed from the run's data (claims.py)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .claims import claims, hqmq_standing, pareto_rows
from .results import row_problem
from .serving import serving_section

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAMILY_STYLE = {"fp16": "k*", "int": "s", "kivi": "D", "spherical": "^", "avq": "v", "hqmq": "o"}


def _ok(results, protocol):
    return [r for r in results if "error" not in r and r["protocol"] == protocol]


def cache_bits(r: dict) -> float:
    """A record's cache bits per element (model constants apart); a record made before the
    split (no `cache_bits_per_element`) has only its total, which is returned instead."""
    v = r.get("cache_bits_per_element")
    return v if v is not None else r["bits_per_element"]


def summarize(results, protocol) -> list[dict]:
    """One row per spec of `protocol`, its seeds pooled: `bits` = CACHE bits per element
    (mean; what a deployed cache stores per token, model constants apart: the Pareto
    front and the verdicts use it), `bits_total` (mean; the constants charged to every
    window, as before the split), `constant_nbytes` (the model constants of one model,
    every layer and role, counted once; None for old records), `bits_split` (False when
    the records predate the split: `bits` is then the total), PPL mean, min, max and
    sample sd over seeds (sd None for one seed), n seeds, wall time summed."""
    rows = []
    for spec in dict.fromkeys(r["spec"] for r in _ok(results, protocol)):
        rs = sorted((r for r in _ok(results, protocol) if r["spec"] == spec), key=lambda r: r["seed"])
        ppl = [r["ppl"] for r in rs]
        split = all(r.get("cache_bits_per_element") is not None and r.get("constant_nbytes") is not None for r in rs)
        rows.append({"spec": spec, "family": rs[0]["family"], "seeds": [r["seed"] for r in rs], "n": len(rs),
                     "bits": statistics.fmean(r["cache_bits_per_element"] if split else r["bits_per_element"]
                                              for r in rs),
                     "bits_total": statistics.fmean(r["bits_per_element"] for r in rs),
                     "constant_nbytes": max(r["constant_nbytes"] for r in rs) if split else None,
                     "bits_split": split,
                     "formula_bits": rs[0]["formula_bits"], "ppl": statistics.fmean(ppl),
                     "ppl_min": min(ppl), "ppl_max": max(ppl),
                     "ppl_sd": statistics.stdev(ppl) if len(ppl) > 1 else None,
                     "wall_s": sum(r["wall_s"] for r in rs)})
    return sorted(rows, key=lambda r: (r["bits"], r["spec"]))


def plot_pareto(rows, protocol, meta, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 6))
    for fam in sorted({r["family"] for r in rows}):
        pts = [r for r in rows if r["family"] == fam]
        # Error bars: the min..max of PPL over seeds (none for a deterministic quantizer).
        yerr = [[max(r["ppl"] - r["ppl_min"], 0) for r in pts], [max(r["ppl_max"] - r["ppl"], 0) for r in pts]]
        ax.errorbar([r["bits"] for r in pts], [r["ppl"] for r in pts], yerr=yerr, fmt=FAMILY_STYLE.get(fam, "x"),
                    label=fam, markersize=8, capsize=3, linestyle="none")
        for r in pts:
            ax.annotate(r["spec"], (r["bits"], r["ppl"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    front = pareto_rows(rows)
    ax.plot([r["bits"] for r in front], [r["ppl"] for r in front], "-", color="gray", alpha=0.5,
            label="Pareto front (seed means)")
    fp16 = [r["ppl"] for r in rows if r["spec"] == "fp16"]
    if fp16:
        ax.axhline(fp16[0], color="k", linestyle=":", linewidth=1, label=f"fp16 PPL {fp16[0]:.3f}")
    ppls = [r["ppl"] for r in rows]
    if max(ppls) / min(ppls) > 3:
        ax.set_yscale("log")
    old = [r["spec"] for r in rows if not r.get("bits_split", True)]
    ax.set_xlabel("cache bits per element (measured from stored bytes; model constants apart)"
                  + (f"\n(total bits for {len(old)} spec(s) whose records predate the split)" if old else ""))
    ax.set_ylabel("perplexity (mean over seeds; bars: min-max)")
    w = meta["windows"]
    ax.set_title(f"{meta['model']['name']} on {meta['corpus']['name']}: {protocol}, "
                 f"{w['n']} windows x {w.get('per_protocol', {}).get(protocol, w['tokens'])} tokens", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_outliers(diag, meta, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    layers = [d["layer"] for d in diag]
    for ax, what in zip(axes, ("radius", "channel")):
        for role, style in (("K", "o-"), ("V", "s--")):
            ax.plot(layers, [d[f"{role}_{what}_max_over_median"] for d in diag], style, label=role)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel(f"max / median {'chunk radius' if what == 'radius' else 'channel |value|'}")
        if what == "radius":
            ax.axhline(3, color="gray", linestyle=":", linewidth=1, label="Med3x threshold (3x median)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Outliers in the K (after RoPE) and V cache of {meta['model']['name']}, one window", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def lm_eval_section(results) -> list[str]:
    """Markdown for the lm-eval task scores of `compare --lm-eval` (none: no lines)."""
    rows = sorted((r for r in results if "error" not in r and "lm_eval" in r),
                  key=lambda r: (cache_bits(r), r["spec"]))
    if not rows:
        return []
    cols = []  # (task, metric) in first-seen order; stderr shown beside its metric
    for r in rows:
        for task, ms in r["lm_eval"].get("scores", {}).items():
            cols += [(task, m) for m in ms if not m.endswith("_stderr") and m != "sample_len" and (task, m) not in cols]
    heads = [f"{t} {m}" for t, m in cols] or ["lm-eval"]
    req = rows[0]["lm_eval"]["requested"]
    lines = ["## Downstream tasks (lm-eval)", "",
             f"Tasks `{req[0]}`, limit {req[1]}, task knobs {req[2]}; seed 0. Loglikelihood requests run "
             "`quantize-on-write` (a fresh quantized cache per sequence); generation requests run through the "
             "generation engine (the deployed protocol: an exact prefill stored quantized, then decode steps "
             "reading the quantized cache, graphed where they can be): its tokens/s (all generation calls, "
             "prefills included), step mode and requests per engine call beside the scores.", "",
             "| spec | cache bits measured (PPL run) | PPL | " + " | ".join(heads)
             + " | generation tokens/s (steps, requests per call) |",
             "|---|---|---|" + "---|" * len(heads) + "---|"]
    for r in rows:
        le, cells = r["lm_eval"], []
        for t, m in cols:
            ms = le.get("scores", {}).get(t, {})
            v, se = ms.get(m), ms.get(m + "_stderr")
            cells.append("-" if v is None else f"{v:.4g}" + (f" ± {se:.2g}" if isinstance(se, float) and se == se else ""))
        if "error" in le:
            cells = [f"FAILED: {le['error']}".replace("|", "\\|")] + [""] * (len(heads) - 1)
        gen = le.get("kv_generation") or {}  # (records before 2026-12-06 have none)
        cells.append(f"{gen['tokens_per_s']:.1f} ({'+'.join(gen.get('modes') or []) or '?'}, "
                     f"{gen.get('batch_size', '?')})" if gen.get("tokens_per_s") else "-")
        lines.append(f"| `{r['spec']}` | {cache_bits(r):.3f} | {r['ppl']:.4f} | " + " | ".join(cells) + " |")
    return lines + [""]


def _spec_bits(results) -> dict:
    """spec -> measured cache bits (`cache_bits`; seed 0; the deployed protocol's record
    where there is one)."""
    out = {}
    for r in sorted((r for r in results if "error" not in r and r["seed"] == 0),
                    key=lambda r: r["protocol"] == "deployed"):
        out[r["spec"]] = cache_bits(r)
    return out


def plot_fidelity(rows, bits, meta, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in ((axes[0], "first_diff_mean", "first generated token that differs (mean over prompts)"),
                           (axes[1], "match_rate", "tokens equal to the unquantized continuation (rate)")):
        for spec, f in rows:
            fam = spec.split(":")[0].rstrip("0123456789")
            ax.plot(bits[spec], f[key], FAMILY_STYLE.get(fam, "x"), markersize=7)
            ax.annotate(spec, (bits[spec], f[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("cache bits per element (measured from stored bytes; model constants apart)")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    fid = meta["fidelity"] or {}
    fig.suptitle(f"Greedy generation fidelity on {meta['model']['name']}: {fid.get('prompt_tokens')}-token prompts, "
                 f"{fid.get('new_tokens')} new tokens, against the model's own cache", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def fidelity_section(data, folder: Path) -> list[str]:
    """Markdown (and fidelity_vs_bits.png) for the run's generation fidelity (none: no lines)."""
    store, meta = data.get("fidelity") or {}, data["meta"]
    bits = _spec_bits(data["results"])
    rows = sorted(((s, f) for s, f in (store.get("rows") or {}).items() if "error" not in f and s in bits),
                  key=lambda sf: (bits[sf[0]], sf[0]))
    failed = [(s, f) for s, f in (store.get("rows") or {}).items() if "error" in f]
    if not rows and not failed:
        return []
    fid = meta.get("fidelity") or {}
    lines = ["## Generation fidelity (deployed)", "",
             f"Greedy continuations of {rows[0][1]['prompts'] if rows else '?'} prompts (the first "
             f"{fid.get('prompt_tokens')} tokens of each window) for {fid.get('new_tokens')} new tokens through each "
             "quantized cache (exact prefill, then decode steps reading the quantized cache: the deployed protocol), "
             "against the same model's own cache. First diff: index of the first generated token that differs "
             "(rows that never diverged count at the full length, so the mean is a lower bound where any did not); "
             "match: positions equal to the reference; NLL/token: what the unquantized model assigns to the "
             "quantized continuation (its own greedy continuation: the reference column). Seed 0; where the "
             "deployed rows of every seed carried greedy twins of their windows (made by: twins), the match rate's "
             "range over the seeds beside it. Made by: `twins`, the greedy twin of each window in the deployed "
             "perplexity run's own batch and replayed steps; `generate`, a generation of its own (formats whose "
             "rows cannot share a cache that way).", ""]
    if rows:
        plot_fidelity(rows, bits, meta, folder / "fidelity_vs_bits.png")
        lines += ["![fidelity against measured bits](fidelity_vs_bits.png)", "",
                  "| spec | cache bits measured | first diff mean | min | never diverged | match rate | "
                  "match rate over seeds | NLL/token | reference NLL/token | decode steps | made by |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for spec, f in rows:
            seeds = [v["match_rate"] for v in (f.get("by_seed") or {}).values()]
            spread = f"{min(seeds):.3f}-{max(seeds):.3f} ({len(seeds)})" if len(seeds) > 1 else "-"
            made = "twins" if f.get("source") == "deployed twins" else "generate"
            lines.append(f"| `{spec}` | {bits[spec]:.3f} | {f['first_diff_mean']:.1f} | {f['first_diff_min']} | "
                         f"{f['never_diverged']}/{f['prompts']} | {f['match_rate']:.3f} | {spread} | "
                         f"{f['nll_per_token']:.3f} | {f['ref_nll_per_token']:.3f} | {f['decode_mode']} | {made} |")
    for spec, f in failed:
        lines.append(f"\nFAILED fidelity `{spec}`: {f['error']}")
    return lines + [""]


def broken_plugins_section() -> list[str]:
    """Plugins that could not be registered when the report was written (none: no lines)."""
    from ...quantizers import broken_plugins

    broken = broken_plugins()
    if not broken:
        return []
    return ["## Plugins left out", "", "These quantizer plugins could not be registered, so they were not "
            "measured (every other quantizer was):", ""] + [f"- {b}".replace("|", "\\|") for b in broken] + [""]


def _stochastic_families(results, meta) -> list[str]:
    # Records made before the `stochastic` field: the run's list, or more than one seed.
    named = set(meta.get("stochastic_specs", []))
    return sorted({r["family"] for r in results if "error" not in r
                   and (r.get("stochastic") or r["spec"] in named or r["seed"] > 0)})


def _window_note(results) -> str:
    """What the fp16 windows of the quantizers run here keep, read from their configs."""
    from ...quantizers import parse_spec

    notes = []
    for spec in dict.fromkeys(r["spec"] for r in results if "error" not in r):
        try:
            cfg = parse_spec(spec)[1]
        except ValueError:
            continue
        if getattr(cfg, "residual", 0):
            notes.append(f"`{spec}` keeps up to {cfg.residual} recent tokens fp16"
                         + (f" (window policy {cfg.window})" if hasattr(cfg, "window") else ""))
    if not notes:
        return ""
    return ("Quantizers with an fp16 window of recent tokens keep part of a short window unquantized (their "
            "measured bits show it): " + "; ".join(notes) + ".")


def write_report(folder: Path) -> Path:
    folder = Path(folder)
    data = json.loads((folder / "results.json").read_text())
    # A malformed record (a hand edit, another tool) is left out, never a crash (results.row_problem).
    data["results"] = [r for r in data["results"] if row_problem(r) is None]
    meta, results = data["meta"], data["results"]
    m, c, w = meta["model"], meta["corpus"], meta["windows"]
    ptd = meta.get("prefill_then_decode", {})
    lines = [
        f"# KV-cache quantizers on {m['name']} / {c['name']}",
        "",
        f"- model: {m['name']} ({m.get('source', '')}); {m.get('n_layers')} layers, {m.get('n_heads')} heads / "
        f"{m.get('n_kv_heads')} kv heads, head_dim {m.get('head_dim')}. {m.get('note', '')}",
        f"- corpus: {c['name']} ({c.get('source', '')}), sha256 {str(c.get('sha256', ''))[:16]}",
        f"- windows: {w['n']} x {w['tokens']} tokens, {w['placement']}; starts {w['starts']}",
        f"- protocols: {', '.join(meta['protocols'])}"
        + (f" (prefill {ptd.get('context')} tokens, then {ptd.get('decode_tokens')} tokens scored after it; "
           "deployed scores those its decode steps predict, one fewer)"
           if {"prefill-then-decode", "deployed"} & set(meta["protocols"]) else ""),
        f"- dtype {meta['dtype']}; hardware {meta['hardware']}; versions {meta['versions']}",
        "- bits per element are measured from every byte the packed cache stores (codes, scales, radii, flags, "
        "outliers, fp16 windows, codebooks fitted on the write amortised over the window): the CACHE bits, which "
        "the Pareto fronts and verdicts use; the formula value is beside them. Tensors drawn from a seed and "
        "independent of the data (rotations, QJL sketch matrices, HQMQ's secondaries, Hadamard signs) are model "
        "constants, regenerated once per model: reported apart, in bytes for the whole model (every layer, K and "
        "V), and charged to every window only in the total column (how earlier versions counted them).",
        "- PPL = exp(total NLL / predicted tokens) over all windows; same windows for every quantizer.",
        f"- seeds: stochastic quantizers (codebooks or rotations drawn from a seed: "
        f"{', '.join(_stochastic_families(results, meta)) or 'none run'}) ran over seeds "
        f"{meta.get('seeds', [0])}; the tables give the mean PPL, its min-max over seeds and the sample sd, "
        "and the claims count a difference only when the seed ranges do not overlap. The arithmetic is a draw "
        "too: another CPU or GPU (another reduction order) flips rounding and clustering decisions, so quantized "
        "rows, deterministic ones included, move by up to a few percent of PPL between machines (fp16 does not; "
        "reports/README.md has a measured case), and a verdict near the seed spread can move with them.",
        "",
        "Which protocol answers which question: `quantize-on-write` (the paper's) quantizes every K/V read, the "
        "prompt's own attention included, and a window is one write, so per-write statistics (KIVI's per-channel "
        "key groups, the Med3x median) include tokens later than the query that reads them: the harshest case, "
        "comparable with the paper. `prefill-then-decode` scores tokens that come after every statistic was fixed, "
        "still with a quantized prefill. `deployed` is what a serving engine does: the prompt attends to its own "
        "K/V at full precision and stores them quantized; only decode steps read the quantized cache, and only "
        "their predictions are scored (a quantizer's fp16 window of recent tokens then serves what it was made "
        "for). Each verdict below names its protocol. " + _window_note(results),
        "",
    ]
    lines += serving_section(data, folder, summarize)
    for protocol in meta["protocols"]:
        rows = summarize(results, protocol)
        if not rows:
            continue
        fp16 = next((r["ppl"] for r in rows if r["spec"] == "fp16"), None)
        plot = f"ppl_vs_bits_{protocol}.png"
        plot_pareto(rows, protocol, meta, folder / plot)
        tokens = w.get("per_protocol", {}).get(protocol, w["tokens"])
        lines += [f"## {protocol}", "", f"![PPL against measured cache bits]({plot})", "",
                  f"| spec | seeds | cache bits measured | model constants (bytes per model) | "
                  f"total bits ({tokens}-token windows) | bits formula | PPL (mean) | min-max over seeds | sd | "
                  "vs fp16 | wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            rel = f"{100 * (r['ppl'] / fp16 - 1):+.2f}%" if fp16 else "-"
            spread = f"{r['ppl_min']:.4f}-{r['ppl_max']:.4f}" if r["n"] > 1 else "-"
            sd = f"{r['ppl_sd']:.4f}" if r["ppl_sd"] is not None else "-"
            bits = f"{r['bits']:.3f}" if r["bits_split"] else f"{r['bits']:.3f}*"
            const = f"{r['constant_nbytes']:,}" if r["constant_nbytes"] is not None else "?*"
            lines.append(f"| `{r['spec']}` | {r['n']} | {bits} | {const} | {r['bits_total']:.3f} | "
                         f"{r['formula_bits']:.3f} | {r['ppl']:.4f} | {spread} | {sd} | {rel} | {r['wall_s']:.1f} |")
        if not all(r["bits_split"] for r in rows):
            lines += ["", "\\* records made before model constants were counted apart: no cache bits or constant "
                      "bytes were recorded, so the total bits (constants charged to every window) stand in for the "
                      "cache bits, in the table, the plot and the verdicts."]
        failed = [r for r in results if "error" in r and r["protocol"] == protocol]
        for r in failed:
            lines.append(f"\nFAILED `{r['spec']}` seed {r['seed']}: {r['error']}")
        lines += ["", f"### Claims of the paper ({protocol})", "",
                  "| claim | paper | ours | verdict |", "|---|---|---|---|"]
        for claim in claims(rows, _ok(results, protocol), meta, folder):
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in claim) + " |")
        lines.append("")
        standing = hqmq_standing(rows)
        if standing:
            lines += [f"### Where HQMQ wins and loses at matched measured bits ({protocol})", "", *standing, ""]
    lines += fidelity_section(data, folder)
    lines += broken_plugins_section()
    lines += lm_eval_section(results)
    if data.get("diagnostics"):
        plot_outliers(data["diagnostics"], meta, folder / "outliers.png")
        worst = max(data["diagnostics"], key=lambda d: d["K_channel_max_over_median"])
        lines += ["## Outlier diagnostics", "", "![per-layer outliers](outliers.png)", "",
                  f"Largest key channel max/median: {worst['K_channel_max_over_median']:.1f} (layer {worst['layer']}); "
                  f"largest key chunk-radius max/median: "
                  f"{max(d['K_radius_max_over_median'] for d in data['diagnostics']):.1f}.", ""]
    out = folder / "report.md"
    out.write_text("\n".join(lines))
    return out
