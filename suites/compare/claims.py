"""The paper's claims (METHOD.md section 6), each judged from the data of one run:
the PPL rows with their seed spread, the lm-eval scores when the run has them,
and the latency report when one sits beside the run. A figure that is not in
the data gives "not measured in this run", never a fixed sentence.

Spread-aware comparisons: a stochastic configuration is a range of PPL over
its seeds (min..max); one configuration beats another only when its whole
range is below the other's, and overlapping ranges are "within the seed spread".
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

NOT_RUN = "not measured in this run"
PAPER_STEP_US = 33  # claim 8: the paper's flat fused decode step (0.033 ms)


def pareto_rows(rows: list[dict]) -> list[dict]:
    """Rows not beaten on both measured bits and mean PPL, sorted by bits."""
    front, best = [], math.inf
    for r in sorted(rows, key=lambda r: (r["bits"], r["ppl"])):
        if r["ppl"] < best:
            front.append(r)
            best = r["ppl"]
    return front


def interp(rows: list[dict], family: str, bits: float) -> dict | None:
    """PPL (mean, min, max) of `family` at `bits`, interpolated in log PPL along its
    own Pareto front of means; None outside the family's measured bit range."""
    front = pareto_rows([r for r in rows if r["family"] == family])
    for a, b in zip(front, front[1:]):
        if a["bits"] <= bits <= b["bits"]:
            t = (bits - a["bits"]) / (b["bits"] - a["bits"])
            f = {k: math.exp((1 - t) * math.log(a[k]) + t * math.log(b[k])) for k in ("ppl", "ppl_min", "ppl_max")}
            return {**f, "between": (a["spec"], b["spec"])}
    exact = [r for r in front if r["bits"] == bits]
    return {k: exact[0][k] for k in ("ppl", "ppl_min", "ppl_max")} | {"between": (exact[0]["spec"],)} if exact else None


def order(a: dict, b: dict) -> str:
    """'<' if a's PPL range lies below b's, '>' if above, '~' if they overlap."""
    if a["ppl_max"] < b["ppl_min"]:
        return "<"
    if a["ppl_min"] > b["ppl_max"]:
        return ">"
    return "~"


def fmt(r: dict) -> str:
    """'48.605' or '48.605 (48.60-48.89 over 3 seeds)'."""
    if r.get("n", 1) > 1:
        return f"{r['ppl']:.3f} ({r['ppl_min']:.3f}-{r['ppl_max']:.3f} over {r['n']} seeds)"
    return f"{r['ppl']:.3f}"


def _nearest(rows, family, bits, has=(), without=()):
    cands = [r for r in rows if r["family"] == family and all(m in r["spec"] for m in has)
             and not any(m in r["spec"] for m in without)]
    return min(cands, key=lambda r: abs(r["bits"] - bits)) if cands else None


def claim_5bits(rows, model, fp16):
    h5 = _nearest(rows, "hqmq", 5.0)
    if not (fp16 and h5):
        return None
    d, dmin, dmax = (h5[k] - fp16["ppl"] for k in ("ppl", "ppl_min", "ppl_max"))
    verdict = ("holds" if dmax <= 0.03 else "does not hold" if dmin > 0.03 else
               "holds for some seeds only")
    return ("1. ~5 bits within 0.02-0.03 PPL of fp16 (Mistral-7B, Llama-3-8B)", "Llama-3-8B 6.28 -> 6.32",
            f"{model}: fp16 {fp16['ppl']:.3f}, {h5['spec']} at {h5['bits']:.2f} measured bits {fmt(h5)} "
            f"(+{d:.3f}, {100 * d / fp16['ppl']:+.2f}%" + (f"; worst seed +{dmax:.3f})" if h5["n"] > 1 else ")"),
            f"{verdict} on this model (a different, smaller model than the paper's)")


def _metric_pairs(a: dict, b: dict):
    """(task, metric, value a, value b, combined standard error or None)."""
    for task, ms in a.get("scores", {}).items():
        for m, va in ms.items():
            vb = b.get("scores", {}).get(task, {}).get(m)
            if m.endswith("_stderr") or m == "sample_len" or vb is None:
                continue
            sa, sb = ms.get(m + "_stderr"), b["scores"][task].get(m + "_stderr")
            se = math.hypot(sa, sb) if all(isinstance(s, float) and math.isfinite(s) for s in (sa, sb)) else None
            yield task, m, va, vb, se


def claim_zero_shot(recs: list[dict]):
    """Claim 2 from the lm-eval scores of this run: the HQMQ config nearest 3.79 bits
    against fp16, metric by metric, a match meaning a difference within 2 standard errors."""
    claim = "2. 3.79 bits matches fp16 zero-shot PIQA/HellaSwag/ARC-Easy"
    scored = [r for r in recs if "lm_eval" in r and "error" not in r["lm_eval"]]
    fp16 = next((r for r in scored if r["spec"] == "fp16"), None)
    hq = [r for r in scored if r.get("family") == "hqmq"]
    if not (fp16 and hq):
        return (claim, "matches", "-", f"{NOT_RUN}: needs `--lm-eval TASKS` with fp16 and an HQMQ spec "
                "(piqa,hellaswag,arc_easy where the hub is reachable; kvqbench_local offline)")
    h = min(hq, key=lambda r: abs(r["bits_per_element"] - 3.79))
    pairs = list(_metric_pairs(h["lm_eval"], fp16["lm_eval"]))
    judged = [(t, m, a, b, se) for t, m, a, b, se in pairs if se is not None]
    figures = "; ".join(f"{t} {m}: {a:.4g} vs fp16 {b:.4g}" + (f" (se {se:.2g})" if se else "")
                        for t, m, a, b, se in pairs) or "no shared metrics"
    tasks = sorted({t for t, *_ in pairs})
    paper_tasks = {"piqa", "hellaswag", "arc_easy"}
    scope = "" if paper_tasks <= set(tasks) else f" (tasks run: {', '.join(tasks)}; not all of the paper's)"
    if not judged:
        verdict = f"not judged: no metric with a standard error{scope}"
    else:
        off = [f"{t} {m} off by {abs(a - b):.3g} > 2 se" for t, m, a, b, se in judged if abs(a - b) > 2 * se]
        verdict = ("does not hold: " + "; ".join(off) if off else
                   f"holds: {len(judged)} metric(s) within 2 standard errors") + scope
    return (claim, "matches", f"{h['spec']} at {h['bits_per_element']:.2f} b: {figures}", verdict)


def latency_file(folder: Path) -> Path:
    """Where `python -m kvqbench.suites.bench.latency --out reports/latency` writes, beside the compare runs."""
    return Path(folder).parent / "latency" / "latency.json"


def claim_latency(folder: Path):
    claim = "8. fused kernel ~0.033 ms per decode step at any context; 7.4-82.9x over fake-quant"
    path = latency_file(folder)
    try:
        lat = json.loads(path.read_text())
        rows = [r for r in lat["latency"] if isinstance(r.get("latency_us"), (int, float))]  # not skipped
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return (claim, "0.033 ms flat", "-", f"{NOT_RUN}: no latency report at {path} "
                "(python -m kvqbench.suites.bench.latency --out reports/latency, on a GPU)")
    # Per shape the faster of the eager call and its CUDA-graph replay (B=1 rows): both run
    # the shipped kernel; the graph drops the ~50-70 us of Python per eager call, which a
    # decode step replayed as a graph (kernels/graphs.py) does not pay either.
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("method") in ("fused-hqmq", "fused-hqmq-graph"):
            key = (r["B"], r["T"])
            if key not in best or r["latency_us"] < best[key]["latency_us"]:
                best[key] = r
    fused = list(best.values())
    if not fused:
        return (claim, "0.033 ms flat", "-", f"{NOT_RUN}: {path} has no fused-hqmq rows")
    fake = {(r["B"], r["T"]): r["latency_us"] for r in rows if r.get("method") == "fake-quant"}
    speed = [fake[(r["B"], r["T"])] / r["latency_us"] for r in fused if (r["B"], r["T"]) in fake]
    parts = []
    for b in sorted({r["B"] for r in fused}):
        rs = sorted((r for r in fused if r["B"] == b), key=lambda r: r["T"])
        parts.append(f"B={b}: {rs[0]['latency_us']:.0f}-{max(r['latency_us'] for r in rs):.0f} us "
                     f"over T={rs[0]['T']}..{rs[-1]['T']}")
    b0 = min(r["B"] for r in fused)  # judged at the smallest batch, the paper's one-sequence step
    worst = max(r["latency_us"] for r in fused if r["B"] == b0)
    graphed = sorted({r["B"] for r in fused if r["method"].endswith("-graph")})
    ours = (f"{lat.get('env', {}).get('gpu', '?')}, fused-hqmq"
            + (f" (B={','.join(map(str, graphed))}: the faster of eager and CUDA graph)" if graphed else "")
            + ": " + "; ".join(parts)
            + (f"; {min(speed):.1f}-{max(speed):.1f}x over fake-quant" if speed else ""))
    # The paper's flat 0.033 ms is an artefact of causal=True with one query (METHOD.md 5):
    # allow twice it before calling the figure not reproduced.
    verdict = ("holds" if worst <= 2 * PAPER_STEP_US else
               f"does not hold: at B={b0} latency grows with the context, up to {worst / PAPER_STEP_US:.0f}x the paper's {PAPER_STEP_US} us "
               "(its flat figure came from causal=True with one query, METHOD.md 5)")
    return (claim, "0.033 ms flat", ours, verdict + f" [{path.name}]")


def claim_seed_spread(rows):
    st = [r for r in rows if r["family"] == "hqmq" and r["n"] >= 2]
    if not st:
        return ("9. seed-to-seed PPL spread under 0.14%", "< 0.14%", "-",
                f"{NOT_RUN}: no HQMQ configuration ran over two or more seeds (--seeds)")
    spreads = {r["spec"]: 100 * (r["ppl_max"] - r["ppl_min"]) / r["ppl"] for r in st}
    worst = max(spreads, key=spreads.get)
    ours = "; ".join(f"{s}: {v:.3f}% over {next(r['n'] for r in st if r['spec'] == s)} seeds"
                     for s, v in spreads.items())
    verdict = "holds" if spreads[worst] < 0.14 else f"does not hold ({worst}: {spreads[worst]:.2f}%)"
    return ("9. seed-to-seed PPL spread under 0.14%", "< 0.14%", ours, verdict)


def claim_matched_bits(rows):
    """Claim 6: HQMQ (interpolated along its front) against each spherical / additive VQ
    row inside HQMQ's bit range."""
    lines, tally = [], {"<": 0, ">": 0, "~": 0}
    for r in [r for r in rows if r["family"] in ("spherical", "avq")]:
        h = interp(rows, "hqmq", r["bits"])
        if h is None:
            continue
        o = order(h, r)
        tally[o] += 1
        word = {"<": "HQMQ lower", ">": "HQMQ higher", "~": "within the seed spread"}[o]
        lines.append(f"{r['spec']} {fmt(r)} vs HQMQ {h['ppl']:.3f} ({h['ppl_min']:.3f}-{h['ppl_max']:.3f}) "
                     f"at {r['bits']:.2f} b: {word}")
    if not lines:
        return ("6. beats spherical and additive VQ at matched bits", "beats", "-",
                f"{NOT_RUN}: no spherical / additive VQ row inside HQMQ's measured bit range")
    n = sum(tally.values())
    verdict = ("holds" if tally["<"] == n else "does not hold" if tally[">"] == n else
               f"holds in part: HQMQ lower in {tally['<']}, higher in {tally['>']}, within the seed spread "
               f"in {tally['~']} of {n}")
    return ("6. beats spherical random codebooks and additive VQ at matched bits", "beats",
            "; ".join(lines) + " (HQMQ interpolated along its Pareto front of seed means)", verdict)


def claims(rows: list[dict], recs: list[dict], meta: dict, folder: Path) -> list[tuple[str, str, str, str]]:
    """(claim, paper's figure, ours, verdict) for each claim of METHOD.md section 6.
    rows: one per spec of one protocol (report.summarize); recs: that protocol's records."""
    by = {r["spec"]: r for r in rows}
    model = meta["model"]["name"]
    fp16 = by.get("fp16")
    out = [c for c in (claim_5bits(rows, model, fp16),) if c]
    out.append(claim_zero_shot(recs))
    i4, hm = by.get("int4"), _nearest(rows, "hqmq", 5.0, has=["med3"])
    if fp16 and i4 and hm:
        collapse = i4["ppl"] > 2 * fp16["ppl"]
        rescue = hm["ppl_max"] < 0.5 * i4["ppl"] and hm["bits"] <= i4["bits"] + 0.5
        verdict = ("holds" if collapse and rescue else
                   "does not hold: naive int4 does not collapse here" if not collapse else
                   "does not hold: HQMQ+Med3x does not recover (worst seed)")
        out.append(("3. outlier-heavy GQA models: naive int4 collapses, HQMQ+Med3x ~5 bits recovers",
                    "Qwen2.5-7B: int4 17,000-18,000; HQMQ+Med3x 9.0-9.7; fp16 7.59",
                    f"{model}: fp16 {fp16['ppl']:.3f}; int4 ({i4['bits']:.2f} b) {i4['ppl']:.3f}; "
                    f"{hm['spec']} ({hm['bits']:.2f} b) {fmt(hm)}",
                    verdict + ("" if "qwen" in model else " (on this model; run with --model qwen2.5-coder-0.5b "
                                                         "for the outlier-heavy family)")))
    out.append(("4. gpt-oss-20b: 3-3.5x Pareto advantage over naive", "3-3.5x", "-",
                f"{NOT_RUN}: model not available offline"))
    k4, h379 = by.get("kivi:bits=4"), _nearest(rows, "hqmq", 3.79)
    if k4 and h379:
        o = {"<": "HQMQ lower PPL", ">": "KIVI-4 lower PPL", "~": "within the seed spread"}[order(h379, k4)]
        out.append(("5. vs KIVI-4: within ~1 point CoQA, 2.3 GSM8K at 3.79 bits", "CoQA -1, GSM8K -2.3",
                    f"PPL proxy: KIVI-4 ({k4['bits']:.2f} b) {fmt(k4)} vs {h379['spec']} ({h379['bits']:.2f} b) "
                    f"{fmt(h379)}: {o}", f"{NOT_RUN} as stated (CoQA/GSM8K); the PPL proxy is shown"))
    out.append(claim_matched_bits(rows))
    s24 = by.get("hqmq:S=24,r=3")
    if s24:
        ratio = 16 / s24["bits"]
        out.append(("7. up to 5.05x compression (S=24, b_r=3: 3.17 bits)", "3.17 bits, 5.05x",
                    f"measured {s24['bits']:.3f} bits -> {ratio:.2f}x vs fp16 (formula {s24['formula_bits']:.3f})",
                    "holds" if ratio >= 5.05 else
                    "does not hold: the measured bytes include the per-token fp16 r_max and codebooks"))
    out.append(claim_latency(folder))
    out.append(claim_seed_spread(rows))
    out.append(claim_structure())
    return out


@functools.lru_cache(maxsize=1)  # independent of the run: the group algebra, computed once
def claim_structure():
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


def _word(o: str) -> str:
    return {"<": "HQMQ wins", ">": "HQMQ loses", "~": "within the seed spread"}[o]


def hqmq_standing(rows: list[dict]) -> list[str]:
    """Markdown: HQMQ against every other quantizer at that quantizer's measured bits.

    HQMQ's PPL at b bits is read off the Pareto front of all HQMQ configurations (seed
    means, log-PPL interpolation between neighbours, their seed min/max interpolated
    alike), so a baseline is compared with the best HQMQ the run measured at its bits.
    A verdict counts only non-overlapping seed ranges (`order`). Rows outside HQMQ's
    measured bit range are listed as such, never extrapolated. The last line asks
    whether `fill=true` (S chosen to fill the code field) moves the front: the fill rows
    against the front of the HQMQ rows without it."""
    hq = [r for r in rows if r["family"] == "hqmq"]
    if not hq:
        return []
    lo, hi = min(r["bits"] for r in hq), max(r["bits"] for r in hq)
    out = ["| baseline | bits measured | baseline PPL | HQMQ at those bits (front, seed range) | HQMQ / baseline PPL | verdict |",
           "|---|---|---|---|---|---|"]
    tally, outside = {"<": [], ">": [], "~": []}, []
    for r in rows:
        if r["family"] == "hqmq" or r["spec"] == "fp16":
            continue
        h = interp(rows, "hqmq", r["bits"])
        if h is None:
            outside.append(f"`{r['spec']}` ({r['bits']:.2f} b)")
            continue
        o = order(h, r)
        tally[o].append(r["spec"])
        out.append(f"| `{r['spec']}` | {r['bits']:.3f} | {fmt(r)} | {h['ppl']:.3f} ({h['ppl_min']:.3f}-"
                   f"{h['ppl_max']:.3f}) | {h['ppl'] / r['ppl']:.3f} | {_word(o)} |")
    if len(out) == 2:
        return []
    out += ["", f"HQMQ's measured bits span {lo:.2f}-{hi:.2f}. In that range HQMQ wins against "
            f"{len(tally['<'])} ({', '.join(tally['<']) or 'none'}), loses against {len(tally['>'])} "
            f"({', '.join(tally['>']) or 'none'}), and is within the seed spread of {len(tally['~'])} "
            f"({', '.join(tally['~']) or 'none'})."
            + (f" Outside it (not compared): {', '.join(outside)}." if outside else "")]
    fill = [r for r in hq if "fill=true" in r["spec"]]
    plain = [r for r in rows if r["family"] != "hqmq" or "fill=true" not in r["spec"]]
    for f in fill:
        h = interp(plain, "hqmq", f["bits"])
        if h is None:
            out.append(f"\n`{f['spec']}` ({f['bits']:.2f} b) lies outside the bit range of the HQMQ rows "
                       "without fill: whether it moves the front is not measured in this run.")
            continue
        o = order(f, h)
        moved = {"<": "moves the front down (lower PPL at its bits, seed ranges apart)",
                 ">": "lies above the front (higher PPL at its bits, seed ranges apart)",
                 "~": "does not move the front beyond the seed spread"}[o]
        same = next((r for r in hq if r["spec"] == f["spec"].replace(",fill=true", "")), None)
        vs_same = "" if same is None else (
            f" Against `{same['spec']}` {fmt(same)} at {same['bits']:.2f} b (same S and radius bits, "
            f"{f['bits'] - same['bits']:+.2f} b): {_word(order(f, same)).replace('HQMQ', 'fill')}.")
        out.append(f"\n`{f['spec']}` {fmt(f)} at {f['bits']:.2f} b vs the front without fill there "
                   f"{h['ppl']:.3f} ({h['ppl_min']:.3f}-{h['ppl_max']:.3f}): {moved}." + vs_same)
    return out
