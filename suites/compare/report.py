"""Turn a run's results.json into report.md and plots: PPL against measured
bits (the Pareto front), per-layer outlier diagnostics, and the paper's claims
(METHOD.md section 6) with our figures and a verdict on each."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAMILY_STYLE = {"fp16": "k*", "int": "s", "kivi": "D", "spherical": "^", "avq": "v", "hqmq": "o"}


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both bits and PPL, sorted by bits."""
    front, best = [], math.inf
    for b, p in sorted(points):
        if p < best:
            front.append((b, p))
            best = p
    return front


def _ok(results, protocol):
    return [r for r in results if "error" not in r and r["protocol"] == protocol]


def plot_pareto(results, protocol, meta, path: Path) -> None:
    rs = [r for r in _ok(results, protocol) if r["seed"] == 0]
    fig, ax = plt.subplots(figsize=(9, 6))
    for fam in sorted({r["family"] for r in rs}):
        pts = [r for r in rs if r["family"] == fam]
        ax.plot([r["bits_per_element"] for r in pts], [r["ppl"] for r in pts],
                FAMILY_STYLE.get(fam, "x"), label=fam, markersize=8, linestyle="none")
        for r in pts:
            ax.annotate(r["spec"], (r["bits_per_element"], r["ppl"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    front = pareto([(r["bits_per_element"], r["ppl"]) for r in rs])
    ax.plot(*zip(*front), "-", color="gray", alpha=0.5, label="Pareto front")
    fp16 = [r["ppl"] for r in rs if r["spec"] == "fp16"]
    if fp16:
        ax.axhline(fp16[0], color="k", linestyle=":", linewidth=1, label=f"fp16 PPL {fp16[0]:.3f}")
    ppls = [r["ppl"] for r in rs]
    if max(ppls) / min(ppls) > 3:
        ax.set_yscale("log")
    ax.set_xlabel("bits per element (measured from stored bytes)")
    ax.set_ylabel("perplexity")
    w = meta["windows"]
    ax.set_title(f"{meta['model']['name']} on {meta['corpus']['name']}: {protocol}, "
                 f"{w['n']} windows x {w['tokens']} tokens", fontsize=10)
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


def _nearest(rs, family, bits, **must):
    cands = [r for r in rs if r["family"] == family and all(m in r["spec"] for m in must.get("has", []))
             and not any(m in r["spec"] for m in must.get("not", []))]
    return min(cands, key=lambda r: abs(r["bits_per_element"] - bits)) if cands else None


def _interp_ppl(rs, family, bits):
    """PPL of `family` at `bits`, interpolated in log PPL along its own Pareto front;
    None outside the family's measured bit range."""
    front = pareto([(r["bits_per_element"], r["ppl"]) for r in rs if r["family"] == family])
    for (b0, p0), (b1, p1) in zip(front, front[1:]):
        if b0 <= bits <= b1:
            t = (bits - b0) / (b1 - b0)
            return math.exp((1 - t) * math.log(p0) + t * math.log(p1))
    return None


def claims(results, meta, protocol) -> list[tuple[str, str, str, str]]:
    """(claim, paper's figure, ours, verdict) for each claim of METHOD.md section 6."""
    rs = [r for r in _ok(results, protocol) if r["seed"] == 0]
    by = {r["spec"]: r for r in rs}
    model = meta["model"]["name"]
    fp16 = by.get("fp16")
    out = []
    not_here = "not measurable here"

    # 1. ~5 bits lossless
    h5 = _nearest(rs, "hqmq", 5.0)
    if fp16 and h5:
        d = h5["ppl"] - fp16["ppl"]
        verdict = "holds" if d <= 0.03 else "does not hold"
        out.append(("1. ~5 bits within 0.02-0.03 PPL of fp16 (Mistral-7B, Llama-3-8B)",
                    "Llama-3-8B 6.28 -> 6.32",
                    f"{model}: fp16 {fp16['ppl']:.3f}, {h5['spec']} at {h5['bits_per_element']:.2f} measured bits "
                    f"{h5['ppl']:.3f} (+{d:.3f}, {100 * d / fp16['ppl']:+.2f}%)",
                    f"{verdict} on this model (a different, smaller model than the paper's)"))
    out.append(("2. 3.79 bits matches fp16 zero-shot PIQA/HellaSwag/ARC-Easy", "matches", "-",
                f"{not_here}: hub datasets unreachable; use the lm-eval model (README) where the hub is"))
    # 3. outlier-heavy rescue
    i4, hm = by.get("int4"), _nearest(rs, "hqmq", 5.0, has=["med3"])
    if fp16 and i4 and hm:
        collapse = i4["ppl"] > 2 * fp16["ppl"]
        rescue = hm["ppl"] < 0.5 * i4["ppl"] and hm["bits_per_element"] <= i4["bits_per_element"] + 0.5
        verdict = ("holds" if collapse and rescue else
                   "does not hold: naive int4 does not collapse here" if not collapse else
                   "does not hold: HQMQ+Med3x does not recover")
        out.append(("3. outlier-heavy GQA models: naive int4 collapses, HQMQ+Med3x ~5 bits recovers",
                    "Qwen2.5-7B: int4 17,000-18,000; HQMQ+Med3x 9.0-9.7; fp16 7.59",
                    f"{model}: fp16 {fp16['ppl']:.3f}; int4 ({i4['bits_per_element']:.2f} b) {i4['ppl']:.3f}; "
                    f"{hm['spec']} ({hm['bits_per_element']:.2f} b) {hm['ppl']:.3f}",
                    verdict + ("" if "qwen" in model else " (on this model; run with --model qwen2.5-coder-0.5b "
                                                         "for the outlier-heavy family)")))
    out.append(("4. gpt-oss-20b: 3-3.5x Pareto advantage over naive", "3-3.5x", "-", f"{not_here}: model not available offline"))
    k4, h379 = by.get("kivi:bits=4"), _nearest(rs, "hqmq", 3.79)
    if k4 and h379:
        out.append(("5. vs KIVI-4: within ~1 point CoQA, 2.3 GSM8K at 3.79 bits", "CoQA -1, GSM8K -2.3",
                    f"PPL proxy: KIVI-4 ({k4['bits_per_element']:.2f} b) {k4['ppl']:.3f} vs {h379['spec']} "
                    f"({h379['bits_per_element']:.2f} b) {h379['ppl']:.3f}",
                    f"{not_here} as stated (tasks need the hub); the PPL proxy is shown"))
    # 6. matched-bits comparison with spherical and additive VQ
    lines, wins = [], []
    for r in [r for r in rs if r["family"] in ("spherical", "avq")]:
        h = _interp_ppl(rs, "hqmq", r["bits_per_element"])
        if h is not None:
            lines.append(f"{r['spec']} {r['ppl']:.3f} vs HQMQ {h:.3f} at {r['bits_per_element']:.2f} b")
            wins.append(h < r["ppl"])
    if lines:
        verdict = "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"
        out.append(("6. beats spherical random codebooks and additive VQ at matched bits", "beats",
                    "; ".join(lines) + " (HQMQ interpolated along its Pareto front)", verdict))
    else:
        out.append(("6. beats spherical and additive VQ at matched bits", "beats", "-",
                    "not measurable in this run: no baseline inside HQMQ's measured bit range"))
    s24 = by.get("hqmq:S=24,r=3")
    if s24:
        ratio = 16 / s24["bits_per_element"]
        out.append(("7. up to 5.05x compression (S=24, b_r=3: 3.17 bits)", "3.17 bits, 5.05x",
                    f"measured {s24['bits_per_element']:.3f} bits -> {ratio:.2f}x vs fp16 (formula "
                    f"{s24['formula_bits']:.3f})", "holds" if ratio >= 5.05 else
                    "does not hold: the measured bytes include the per-token fp16 r_max and codebooks"))
    out.append(("8. fused kernel ~0.033 ms per decode step at any context; 7.4-82.9x over fake-quant",
                "0.033 ms flat", "see reports/latency/ (H200)",
                "an artefact of causal=True with one query (METHOD.md 5); measured in the latency report"))
    seeds = [r["ppl"] for r in _ok(results, protocol) if r["spec"] == meta.get("seed_spec")]
    if len(seeds) >= 2:
        spread = 100 * (max(seeds) - min(seeds)) / statistics.mean(seeds)
        out.append(("9. seed-to-seed PPL spread under 0.14%", "< 0.14%",
                    f"{meta['seed_spec']}: {len(seeds)} seeds, PPL {min(seeds):.4f}-{max(seeds):.4f}, "
                    f"spread {spread:.3f}% (sd {statistics.pstdev(seeds):.4f})",
                    "holds" if spread < 0.14 else "does not hold"))
    out.append(_structure_claim())
    return out


def _structure_claim():
    import torch

    from ...quantizers.quaternion import group_closure_table, hamilton, hurwitz_units, random_unit_quaternions

    P = hurwitz_units(torch.float64)
    closed = bool((group_closure_table() >= 0).all())
    sep = float((P @ P.T - 2 * torch.eye(24, dtype=torch.float64)).max())
    s = random_unit_quaternions(96, torch.Generator().manual_seed(0)).double()
    C = hamilton(P[:, None], s[None]).reshape(-1, 4)
    distinct = int((torch.cdist(C, C) + torch.eye(len(C), dtype=torch.float64) > 1e-9).all(1).sum())
    ok = closed and sep <= 0.5 + 1e-12 and distinct == 24 * 96
    return ("10. 2T closed, 60-degree separation, |C| = 24 S", "yes",
            f"closed: {closed}; max inner product of distinct elements {sep:.3f} (cos 60 = 0.5); "
            f"{distinct} distinct codewords for S=96 (also property-tested for random S)",
            "holds" if ok else "does not hold")


def lm_eval_section(results) -> list[str]:
    """Markdown for the lm-eval task scores of `compare --lm-eval` (none: no lines)."""
    rows = sorted((r for r in results if "error" not in r and "lm_eval" in r),
                  key=lambda r: (r["bits_per_element"], r["spec"]))
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
             "`quantize-on-write` (a fresh quantized cache per sequence); generation runs the real quantized "
             "cache through `generate` (prompt as one prefill write, then one append per token).", "",
             "| spec | bits measured (PPL run) | PPL | " + " | ".join(heads) + " |",
             "|---|---|---|" + "---|" * len(heads)]
    for r in rows:
        le, cells = r["lm_eval"], []
        for t, m in cols:
            ms = le.get("scores", {}).get(t, {})
            v, se = ms.get(m), ms.get(m + "_stderr")
            cells.append("-" if v is None else f"{v:.4g}" + (f" ± {se:.2g}" if isinstance(se, float) and se == se else ""))
        if "error" in le:
            cells = [f"FAILED: {le['error']}".replace("|", "\\|")] + [""] * (len(heads) - 1)
        lines.append(f"| `{r['spec']}` | {r['bits_per_element']:.3f} | {r['ppl']:.4f} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_report(folder: Path) -> Path:
    folder = Path(folder)
    data = json.loads((folder / "results.json").read_text())
    meta, results = data["meta"], data["results"]
    m, c, w = meta["model"], meta["corpus"], meta["windows"]
    lines = [
        f"# KV-cache quantizers on {m['name']} / {c['name']}",
        "",
        f"- model: {m['name']} ({m.get('source', '')}); {m.get('n_layers')} layers, {m.get('n_heads')} heads / "
        f"{m.get('n_kv_heads')} kv heads, head_dim {m.get('head_dim')}. {m.get('note', '')}",
        f"- corpus: {c['name']} ({c.get('source', '')}), sha256 {str(c.get('sha256', ''))[:16]}",
        f"- windows: {w['n']} x {w['tokens']} tokens, {w['placement']}; starts {w['starts']}",
        f"- protocols: {', '.join(meta['protocols'])}"
        + (f" (prefill-then-decode: context {meta['prefill_then_decode']['context']}, "
           f"{meta['prefill_then_decode']['decode_tokens']} decode steps)" if "prefill-then-decode" in meta["protocols"] else ""),
        f"- dtype {meta['dtype']}; hardware {meta['hardware']}; versions {meta['versions']}",
        "- bits per element are measured from every byte the packed cache stores (codes, scales, radii, flags, "
        "outliers, fp16 windows, codebooks amortised over the window); the formula value is beside it.",
        "- PPL = exp(total NLL / predicted tokens) over all windows; same windows for every quantizer.",
        "",
        "Caveat: under `quantize-on-write` a window is one write, so per-write statistics (KIVI's per-channel key "
        "groups, the Med3x median) include tokens later than the query that reads them; `prefill-then-decode` "
        "scores tokens that come after every statistic was fixed. KIVI keeps its last 128 tokens in fp16, so in "
        "short windows much of its cache is fp16 (its measured bits show it).",
        "",
    ]
    for protocol in meta["protocols"]:
        rs = _ok(results, protocol)
        if not rs:
            continue
        fp16 = next((r["ppl"] for r in rs if r["spec"] == "fp16" and r["seed"] == 0), None)
        plot = f"ppl_vs_bits_{protocol}.png"
        plot_pareto(results, protocol, meta, folder / plot)
        lines += [f"## {protocol}", "", f"![PPL against measured bits]({plot})", "",
                  "| spec | seed | bits measured | bits formula | PPL | vs fp16 | wall s |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(rs, key=lambda r: (r["bits_per_element"], r["spec"], r["seed"])):
            rel = f"{100 * (r['ppl'] / fp16 - 1):+.2f}%" if fp16 else "-"
            lines.append(f"| `{r['spec']}` | {r['seed']} | {r['bits_per_element']:.3f} | {r['formula_bits']:.3f} | "
                         f"{r['ppl']:.4f} | {rel} | {r['wall_s']:.1f} |")
        failed = [r for r in results if "error" in r and r["protocol"] == protocol]
        for r in failed:
            lines.append(f"\nFAILED `{r['spec']}` seed {r['seed']}: {r['error']}")
        lines += ["", f"### Claims of the paper ({protocol})", "",
                  "| claim | paper | ours | verdict |", "|---|---|---|---|"]
        for claim in claims(results, meta, protocol):
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in claim) + " |")
        lines.append("")
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
