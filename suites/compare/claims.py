"""The paper's claims (METHOD.md section 6), each judged from the data of one run and
one protocol: the PPL rows with their seed spread and per-window NLL, the lm-eval
scores when the run has them, the latency report when one sits beside the run.

Every verdict names how it was reached: the PPL protocol of the rows (claims() runs
once per protocol), the lm-eval scores (loglikelihood under quantize-on-write,
generation through the deployed engine), the kernel benchmark, or the unit tests. A
figure that is not in the data is "not measured" with no verdict, never a fixed
sentence; every verdict can fail (suites/tests/test_claims.py builds rows where each
must fail).

How PPL verdicts are reached (verdicts.py): matched bits compare Pareto fronts family
against family, never one method's best front against single rows; a configuration
beats another only when the seed bands are apart; two configurations scored on the
same windows are compared window by window (`paired`).
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from .verdicts import (SPREAD, HQMQ_FRONTS, at, band, compare_fronts, config_of, describe_front, dominance,
                       family_front, field_split, fmt, front_word, hqmq_front, hqmq_standing, interp, is_config,
                       off_front, order, paired, paired_text, pareto_rows, tally)

NOT_RUN = "not measured in this run"
PAPER_STEP_US = 33  # claim 8: the paper's flat fused decode step (0.033 ms)
# "~0.033 ms": read at the precision the tilde gives it, one significant figure (~0.03 ms),
# a step rounds to it up to 35 us. Faster is no failure: the claim is "this fast at any context".
STEP_TOLERANCE_US = 35
PAPER_HQMQ = dict(S=96, r=4, outliers="none", fill=False, radius="uniform")   # claims 2, 5: 3.79 bits
PAPER_HQMQ_317 = dict(S=24, r=3, outliers="none", fill=False, radius="uniform")  # claim 7: 3.17 bits
ZERO_SHOT_TASKS = ("piqa", "hellaswag", "arc_easy")  # claim 2
# claim 5: generation tasks and the tolerance on HQMQ's deficit against KIVI-4 (scores in [0, 1])
GENERATION_TASKS = {"coqa": (0.01, "the paper's"), "gsm8k": (0.023, "the paper's"),
                    # offline proxy: retrieval from the context, as CoQA's answers are; CoQA's 1 point
                    "kvqbench_passkey": (0.01, "offline proxy (passkey retrieval, CoQA's 1-point tolerance)")}
GROUPS = ("kvqbench_local",)
LLAMA3_70B = dict(layers=80, kv_heads=8, head_dim=128, tokens=128 * 1024)  # claim 7's 43 GB at 128k


def _under(protocol: str) -> str:
    return f"[{protocol} rows]"


def _paper_specs(rows_or_recs, want) -> list[str]:
    specs = dict.fromkeys(r["spec"] for r in rows_or_recs)
    return [s for s in specs if is_config(s, "hqmq", **want)]


def _nearest(rows, family, bits, has=(), without=()):
    cands = [r for r in rows if r["family"] == family and all(m in r["spec"] for m in has)
             and not any(m in r["spec"] for m in without)]
    return min(cands, key=lambda r: abs(r["bits"] - bits)) if cands else None


# ---- 1, 3, 9: PPL rows --------------------------------------------------------------------
def claim_5bits(rows, model, fp16, protocol="?", recs=()):
    h5 = _nearest(rows, "hqmq", 5.0)
    if not (fp16 and h5):
        return None
    d, dmin, dmax = (h5[k] - fp16["ppl"] for k in ("ppl", "ppl_min", "ppl_max"))
    verdict = ("holds" if dmax <= 0.03 else "does not hold" if dmin > 0.03 else
               "holds for some seeds only")
    p = paired(list(recs), h5["spec"], "fp16")
    return ("1. ~5 bits within 0.02-0.03 PPL of fp16 (Mistral-7B, Llama-3-8B)", "Llama-3-8B 6.28 -> 6.32",
            f"{model}: fp16 {fp16['ppl']:.3f}, {h5['spec']} at {h5['bits']:.2f} measured bits {fmt(h5)} "
            f"({d:+.3f}, {100 * d / fp16['ppl']:+.2f}%" + (f"; worst seed {dmax:+.3f})" if h5["n"] > 1 else ")")
            + (f"; {paired_text(p, h5['spec'], 'fp16')}" if p is not None else ""),
            f"{verdict} on this model (a different, smaller model than the paper's) {_under(protocol)}")


def claim_outliers(rows, model, by, protocol="?"):
    fp16, i4, hm = by.get("fp16"), by.get("int4"), _nearest(rows, "hqmq", 5.0, has=["med3"])
    if not (fp16 and i4 and hm):
        return None
    collapse = i4["ppl"] > 2 * fp16["ppl"]
    rescue = hm["ppl_max"] < 0.5 * i4["ppl"] and hm["bits"] <= i4["bits"] + 0.5
    verdict = ("holds" if collapse and rescue else
               "does not hold: naive int4 does not collapse here" if not collapse else
               "does not hold: HQMQ+Med3x does not recover (worst seed)")
    return ("3. outlier-heavy GQA models: naive int4 collapses, HQMQ+Med3x ~5 bits recovers",
            "Qwen2.5-7B: int4 17,000-18,000; HQMQ+Med3x 9.0-9.7; fp16 7.59",
            f"{model}: fp16 {fp16['ppl']:.3f}; int4 ({i4['bits']:.2f} b) {i4['ppl']:.3f}; "
            f"{hm['spec']} ({hm['bits']:.2f} b) {fmt(hm)}",
            verdict + ("" if "qwen" in model else " (on this model; run with --model qwen2.5-coder-0.5b "
                                                 "for the outlier-heavy family)") + f" {_under(protocol)}")


def claim_seed_spread(rows, protocol="?"):
    claim = "9. seed-to-seed PPL spread under 0.14%"
    st = [r for r in rows if r["family"] == "hqmq" and r["n"] >= 2]
    if not st:
        return (claim, "< 0.14%", "-", f"{NOT_RUN}: no HQMQ configuration ran over two or more seeds (--seeds)")
    spreads = {r["spec"]: 100 * (r["ppl_max"] - r["ppl_min"]) / r["ppl"] for r in st}
    worst = max(spreads, key=spreads.get)
    ours = "; ".join(f"{s}: {v:.3f}% over {next(r['n'] for r in st if r['spec'] == s)} seeds"
                     for s, v in spreads.items())
    verdict = "holds" if spreads[worst] < 0.14 else f"does not hold ({worst}: {spreads[worst]:.2f}%)"
    return (claim, "< 0.14%", ours, f"{verdict} {_under(protocol)}")


# ---- 2, 5: lm-eval at the paper's configuration -------------------------------------------------
def _stderr_key(metric: str) -> str:
    """lm-eval's name for a metric's standard error: 'acc' -> 'acc_stderr',
    'exact_match,strict-match' -> 'exact_match_stderr,strict-match' (evaluate.task_scores)."""
    name, sep, flt = metric.partition(",")
    return f"{name}_stderr{sep}{flt}"


def _metric_pairs(a: dict, b: dict, tasks=None):
    """(task, metric, value a, value b, combined standard error or None)."""
    for task, ms in a.get("scores", {}).items():
        if task in GROUPS or (tasks is not None and not tasks(task)):
            continue
        for m, va in ms.items():
            vb = b.get("scores", {}).get(task, {}).get(m)
            if m.partition(",")[0].endswith("_stderr") or m == "sample_len" or vb is None:
                continue
            sa, sb = ms.get(_stderr_key(m)), b["scores"][task].get(_stderr_key(m))
            se = math.hypot(sa, sb) if all(isinstance(s, float) and math.isfinite(s) for s in (sa, sb)) else None
            yield task, m, va, vb, se


def _generation_task(task: str):
    """(tolerance, source) of a generation task claim 5 reads, or None."""
    for name, tol in GENERATION_TASKS.items():
        if task == name or task.startswith(name + "_"):
            return tol
    return None


def _scored(recs):
    return [r for r in recs if isinstance(r.get("lm_eval"), dict) and "error" not in r["lm_eval"]]


def _lm_eval_note(recs, specs) -> str:
    failed = [r["spec"] for r in recs if r.get("spec") in specs and isinstance(r.get("lm_eval"), dict)
              and "error" in r["lm_eval"]]
    return f" (lm-eval failed for {', '.join(failed)})" if failed else ""


def claim_zero_shot(recs: list[dict], protocol="?"):
    """Claim 2 from the lm-eval scores of this run, at the paper's configuration
    (hqmq:S=96,r=4): against fp16, metric by metric; a difference beyond 2 combined
    standard errors fails it (unpaired: lm-eval keeps no per-sample scores)."""
    claim = "2. 3.79 bits (S=96, b_r=4) matches fp16 zero-shot PIQA/HellaSwag/ARC-Easy"
    paper = _paper_specs(recs, PAPER_HQMQ)
    ppl_ctx = "; ".join(paired_text(paired(recs, s, "fp16"), s, "fp16") for s in paper
                        if paired(recs, s, "fp16") is not None)
    ppl_ctx = f" PPL, not the claim's measure {_under(protocol)}: {ppl_ctx}" if ppl_ctx else ""
    if not paper:
        return (claim, "matches", "-", f"{NOT_RUN}: hqmq:S=96,r=4 (the paper's configuration) was not run")
    scored = _scored(recs)
    fp16 = next((r for r in scored if r["spec"] == "fp16"), None)
    hq = [r for r in scored if r["spec"] in paper]
    if not (fp16 and hq):
        return (claim, "matches", ppl_ctx.strip() or "-",
                f"{NOT_RUN}: no lm-eval scores for fp16 and {paper[0]} on these records"
                + _lm_eval_note(recs, paper + ["fp16"]) + " (`--lm-eval piqa,hellaswag,arc_easy` where the hub is "
                "reachable; compare scores the first protocol's records)")
    figures, verdicts = [], []
    not_gen = lambda t: _generation_task(t) is None  # noqa: E731
    for h in hq:
        pairs = list(_metric_pairs(h["lm_eval"], fp16["lm_eval"], not_gen))
        judged = [(t, m, a, b, se) for t, m, a, b, se in pairs if se is not None and se > 0]
        figures.append(f"{h['spec']} at {h['bits_per_element']:.2f} b: " + ("; ".join(
            f"{t} {m}: {a:.4g} vs fp16 {b:.4g}" + (f" (se {se:.2g})" if se else "") for t, m, a, b, se in pairs)
            or "no shared metrics"))
        tasks = sorted({t for t, *_ in pairs})
        scope = "" if set(ZERO_SHOT_TASKS) <= set(tasks) else \
            f" (tasks run: {', '.join(tasks) or 'none'}; not the paper's {', '.join(ZERO_SHOT_TASKS)}: a proxy)"
        who = f"{h['spec']}: " if len(hq) > 1 else ""
        if not judged:
            verdicts.append(f"{NOT_RUN}: {who}no accuracy with a standard error among the zero-shot tasks run{scope}")
            continue
        off = [f"{t} {m} off by {abs(a - b):.3g} > 2 se" for t, m, a, b, se in judged if abs(a - b) > 2 * se]
        verdicts.append(("does not hold: " + who + "; ".join(off) if off else
                         f"holds: {who}{len(judged)} metric(s) within 2 standard errors of fp16") + scope)
    how = " [lm-eval loglikelihood, quantize-on-write, seed 0]"
    return (claim, "matches", "; ".join(figures) + ppl_ctx,
            "; ".join(verdicts) + (how if not all(v.startswith(NOT_RUN) for v in verdicts) else ""))


def _kivi4(recs_or_rows) -> str | None:
    specs = list(dict.fromkeys(r["spec"] for r in recs_or_rows))
    if "kivi:bits=4" in specs:
        return "kivi:bits=4"
    k = [s for s in specs if is_config(s, "kivi", bits=4)]
    return sorted(k)[0] if k else None


def claim_kivi(recs: list[dict], protocol="?"):
    """Claim 5: HQMQ at the paper's configuration against KIVI-4 on generation tasks.
    The paper's deficit: ~1 point CoQA, 2.3 GSM8K. Per metric the deficit
    d = KIVI - HQMQ (scores in [0, 1]) with its 2-se band (unpaired): holds where the band
    lies at or under the tolerance, fails where it lies above it, else unresolved."""
    claim = "5. vs KIVI-4 (~4.5 b): within ~1 point CoQA, 2.3 GSM8K at 3.79 bits (S=96, b_r=4)"
    paper, k4 = _paper_specs(recs, PAPER_HQMQ), _kivi4(recs)
    if not paper or not k4:
        missing = " and ".join(x for x, ok in (("hqmq:S=96,r=4 (the paper's configuration)", paper),
                                               ("KIVI-4 (kivi:bits=4)", k4)) if not ok)
        return (claim, "CoQA -1, GSM8K -2.3", "-", f"{NOT_RUN}: {missing} not run")
    ppl_ctx = "; ".join(paired_text(paired(recs, s, k4), s, k4) for s in paper)
    ppl_ctx = f"PPL, not the claim's measure {_under(protocol)}: {ppl_ctx}"
    scored = _scored(recs)
    kr = next((r for r in scored if r["spec"] == k4), None)
    hq = [r for r in scored if r["spec"] in paper]
    gen = [t for r in hq + [kr] if r for t in r["lm_eval"].get("scores", {}) if _generation_task(t)]
    if not (kr and hq and gen):
        return (claim, "CoQA -1, GSM8K -2.3", ppl_ctx,
                f"{NOT_RUN}: no lm-eval generation-task scores (coqa, gsm8k, or the offline proxy "
                f"kvqbench_passkey) for {k4} and {paper[0]} on these records" + _lm_eval_note(recs, paper + [k4])
                + " (`--lm-eval kvqbench_passkey` offline); the PPL above gives no verdict")
    figures, states = [], []
    for h in hq:
        for t, m, a, b, se in _metric_pairs(h["lm_eval"], kr["lm_eval"], _generation_task):
            tol, source = _generation_task(t)
            d, s2 = b - a, 2 * se if se is not None else math.inf
            state = ("holds" if d + s2 <= tol else "fails" if d - s2 > tol else "unresolved")
            states.append(state)
            figures.append(f"{h['spec']} vs {k4}, {t} {m}: {a:.4g} vs {b:.4g}, deficit {d:+.3g}"
                           + (f" +- {s2:.2g} (2 se)" if se is not None else " (no standard error)")
                           + f", tolerance {tol:g} ({source}): {state}")
    if not states:
        return (claim, "CoQA -1, GSM8K -2.3", ppl_ctx, f"{NOT_RUN}: no generation metric shared by both")
    verdict = ("does not hold" if "fails" in states else "holds" if all(s == "holds" for s in states) else
               "not resolved: the 2-se band of a deficit straddles its tolerance (more samples: --lm-eval-limit)")
    proxy = "" if any(_generation_task(t)[1] == "the paper's" for t in gen) else " on the offline proxy only"
    return (claim, "CoQA -1, GSM8K -2.3", "; ".join(figures) + "; " + ppl_ctx,
            f"{verdict}{proxy} [lm-eval generation: deployed engine, exact prefill then decode steps; seed 0]")


# ---- 6: front against front ------------------------------------------------------------------
def claim_matched_bits(rows, protocol="?"):
    """Claim 6: the spherical family's front and the additive-VQ family's front against
    HQMQ's plain front (no Med3x, no fill); HQMQ + Med3x's front beside it, no verdict."""
    claim = "6. beats spherical random codebooks and additive VQ at matched bits"
    plain, med3 = hqmq_front(rows, "plain"), hqmq_front(rows, "med3")
    lines, points, extra = [], [], []
    for fam in ("spherical", "avq"):
        base = family_front(rows, fam)
        if not base:
            lines.append(f"{fam}: not run")
            continue
        dominated = [r["spec"] for r in off_front(rows, fam, base)]
        c = compare_fronts(base, plain)
        beaten = [] if c["points"] else dominance(base, plain)
        points += c["points"] + beaten
        if beaten:
            lines.append(f"{fam} front ({describe_front(base)}) shares no bits with {HQMQ_FRONTS['plain']}; "
                         + "; ".join(f"{p['vertex']}: {band(p['hq'])} vs {band(p['base'])}" for p in beaten))
        elif c["points"]:
            lo, hi = c["overlap"]
            lines.append(f"{fam} front ({describe_front(base)}) vs {HQMQ_FRONTS['plain']} over {lo:.2f}-{hi:.2f} b: "
                         + "; ".join(f"{p['bits']:.2f} b HQMQ {band(p['hq'])} vs {band(p['base'])}: "
                                     f"{ {'<': 'HQMQ lower', '>': 'HQMQ higher', '~': SPREAD}[p['order']]}"
                                     for p in c["points"]))
        else:
            lines.append(f"{fam} front ({describe_front(base)}): no bits in common with the plain HQMQ front")
        if dominated:
            lines.append(f"not compared (off the {fam} front): {', '.join(dominated)}")
        m = compare_fronts(base, med3)
        if m["points"]:
            extra.append(f"{fam}: {front_word(m['points'])}")
    if not plain:
        return (claim, "beats", "-", f"{NOT_RUN}: no plain HQMQ row (no Med3x, no fill)")
    if not points:
        return (claim, "beats", "; ".join(lines),
                f"{NOT_RUN}: no spherical / additive VQ front shares bits with HQMQ's plain front "
                f"({describe_front(plain)})")
    t, n = tally(points), len(points)
    verdict = ("holds" if t["<"] == n else "does not hold" if t[">"] and not t["<"] else
               f"holds in part: HQMQ lower at {t['<']}, higher at {t['>']}, {SPREAD} at {t['~']} of {n} points"
               if t["<"] or t[">"] else f"not resolved: {SPREAD} at all {n} points")
    if extra:
        lines.append(f"{HQMQ_FRONTS['med3']} front (no verdict): " + "; ".join(extra))
    return (claim, "beats", "; ".join(lines) + " (fronts of seed means, log PPL interpolated, seed bands alike)",
            f"{verdict}: HQMQ plain front vs family fronts {_under(protocol)}")


# ---- 7: compression, from the bytes -----------------------------------------------------------
def claim_compression(rows, meta, protocol="?"):
    claim = "7. up to 5.05x compression (S=24, b_r=3: 3.17 bits); Llama-3-70B at 128k: 43 GB -> 8.5 GB"
    paper = "3.17 bits, 5.05x"
    specs = _paper_specs(rows, PAPER_HQMQ_317)
    if not specs:
        return (claim, paper, "-", f"{NOT_RUN}: hqmq:S=24,r=3 (the paper's configuration) was not run")
    m = meta.get("model", {})
    d, heads = m.get("head_dim"), m.get("n_kv_heads")
    w = meta.get("windows", {})
    tokens = w.get("per_protocol", {}).get(protocol, w.get("tokens"))
    ours, verdicts = [], []
    for spec in specs:
        r = next(r for r in rows if r["spec"] == spec)
        ratio = 16 / r["bits"]
        text = f"{spec}: measured {r['bits']:.3f} bits -> {ratio:.2f}x vs fp16 (formula {r['formula_bits']:.3f})"
        why = ""
        if isinstance(d, int) and isinstance(heads, int) and isinstance(tokens, int):
            split = field_split(spec, d, heads, tokens)
            cache = {k: b for k, (b, const) in split.items() if not const}
            const = {k: b for k, (b, const) in split.items() if const}
            text += (f"; fields on a synthetic [1, {heads}, {tokens}, {d}] tensor (records carry no per-field "
                     "bytes): " + ", ".join(f"{k} {b:.3f}" for k, b in cache.items())
                     + f" = {sum(cache.values()):.3f} b" + (
                         f"; model constants apart ({', '.join(f'{k} {b:.3f}' for k, b in const.items())} b "
                         "at this window, once per model)" if const else ""))
            ideal_codes = math.log2(24 * 24) / 4
            terms = []
            mixed = getattr(config_of(spec)[1], "pack", "bits") == "mixed"
            if "codes" in cache and cache["codes"] > ideal_codes + 1e-6:
                terms.append(f"mixed-radix code packing {cache['codes']:.3f} b vs log2(24 S)/4 = {ideal_codes:.3f} "
                             f"(+{cache['codes'] - ideal_codes:.3f} b left: whole-bit groups, byte padding)" if mixed
                             else f"whole-bit code packing {cache['codes']:.3f} b vs log2(24 S)/4 = {ideal_codes:.3f} "
                             f"(+{cache['codes'] - ideal_codes:.3f} b; mixed-radix packing, pack=mixed, recovers most "
                             "of it)")
            if "r_max" in cache and d != 128:
                terms.append(f"r_max 16/head_dim = {cache['r_max']:.3f} b at head_dim {d} (the paper's 3.17 "
                             "assumes head_dim 128: 0.125)")
            other = {k: b for k, b in cache.items() if k not in ("codes", "radius", "r_max")}
            if other:
                terms.append("other per-write fields " + ", ".join(f"{k} {b:.3f} b" for k, b in other.items()))
            gap = r["bits"] - sum(cache.values())
            if abs(gap) > 0.005:
                terms.append(f"the row's measured bits minus these fields: {gap:+.3f} b (model constants or fp16 "
                             "windows counted in the row's bits, or the row's spec differs from the synthetic one)")
            why = "; ".join(terms)
            big = field_split(spec, LLAMA3_70B["head_dim"], 1, 256)
            b128 = sum(b for b, const in big.values() if not const)
            elems = 2 * LLAMA3_70B["layers"] * LLAMA3_70B["kv_heads"] * LLAMA3_70B["head_dim"] * LLAMA3_70B["tokens"]
            text += (f"; at head_dim 128 the same fields give {b128:.3f} b ({16 / b128:.2f}x): Llama-3-70B at 128k "
                     f"{elems * 2 / 1e9:.1f} GB fp16 -> {elems * b128 / 8 / 1e9:.1f} GB (computed, not measured)")
        ours.append(text)
        verdicts.append((f"{spec}: " if len(specs) > 1 else "")
                        + ("holds" if ratio >= 5.05 else "does not hold" + (f": {why}" if why else "")))
    return (claim, paper, "; ".join(ours), "; ".join(verdicts) + f" {_under(protocol)} (bits: the row's measured bits)")


# ---- 8: the graphed kernel figure --------------------------------------------------------------
def latency_file(folder: Path) -> Path:
    """Where `python -m kvqbench.suites.bench.latency --out reports/latency` writes, beside the compare runs."""
    return Path(folder).parent / "latency" / "latency.json"


def claim_latency(folder: Path):
    """Claim 8 on the engine's graphed figure: `fused-hqmq-graph` (the shipped kernel,
    backend auto, replayed as a CUDA graph as a decode step is in kernels/graphs.py),
    B=1 (the paper's one-sequence step), every context measured. Tolerance: the paper's
    "~0.033 ms" read at one significant figure (~0.03 ms): a step up to 35 us rounds to
    it; faster is no failure. The fake-quant speed-up is shown, never judged (METHOD.md 5:
    the paper's range is an artefact of causal=True with one query)."""
    claim = "8. fused kernel ~0.033 ms per decode step at any context; 7.4-82.9x over fake-quant"
    path = latency_file(folder)
    try:
        lat = json.loads(path.read_text())
        rows = [r for r in lat["latency"] if isinstance(r.get("latency_us"), (int, float))]  # not skipped
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return (claim, "0.033 ms flat", "-", f"{NOT_RUN}: no latency report at {path} "
                "(python -m kvqbench.suites.bench.latency --out reports/latency, on a GPU)")
    graphed = sorted((r for r in rows if r.get("method") == "fused-hqmq-graph" and r.get("B") == 1),
                     key=lambda r: r["T"])
    if not graphed:
        eager = any(r.get("method") == "fused-hqmq" for r in rows)
        return (claim, "0.033 ms flat", "-", f"{NOT_RUN}: {path} has no graphed fused-hqmq row at B=1"
                + (" (eager rows only: their host time per call is not the engine's decode step)" if eager else ""))
    fake = {r["T"]: r["latency_us"] for r in rows if r.get("method") == "fake-quant" and r.get("B") == 1}
    speed = [fake[r["T"]] / r["latency_us"] for r in graphed if r["T"] in fake]
    spec = graphed[0].get("spec", "hqmq")
    ours = (f"{lat.get('env', {}).get('gpu', '?')}, fused-hqmq-graph ({spec}, CUDA graph replay, B=1): "
            + ", ".join(f"T={r['T']}: {r['latency_us']:.1f} us" for r in graphed)
            + f" ({graphed[-1]['latency_us'] / graphed[0]['latency_us']:.1f}x from the shortest to the longest context)"
            + (f"; {min(speed):.1f}-{max(speed):.1f}x over eager fake-quant (not judged: fake-quant is not graphed, "
               "and the paper's range is an artefact, METHOD.md 5)" if speed else ""))
    over = [r for r in graphed if r["latency_us"] > STEP_TOLERANCE_US]
    tol = (f"tolerance: up to {STEP_TOLERANCE_US} us, the paper's ~0.033 ms at the one significant figure its "
           "tilde gives (~0.03 ms)")
    verdict = ("holds at every context measured" if not over else
               "does not hold: above it at " + ", ".join(f"T={r['T']} ({r['latency_us']:.0f} us, "
                                                        f"{r['latency_us'] / PAPER_STEP_US:.1f}x the paper's)"
                                                        for r in over)
               + " (the paper's flat figure came from causal=True with one query, METHOD.md 5)")
    return (claim, "0.033 ms flat", ours, f"{verdict}; {tol} [kernel benchmark, graphed; {path.name}]")


# ---- 10: a property of the codebook --------------------------------------------------------------
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
            f"{distinct} distinct codewords for S=96",
            ("holds" if ok else "does not hold")
            + " [a property of the codebook, not of this run: computed here and unit-tested for random S "
              "(suites/tests/test_properties.py)]")


# ---- all of them -------------------------------------------------------------------------------
def claims(rows: list[dict], recs: list[dict], meta: dict, folder: Path,
           protocol: str | None = None) -> list[tuple[str, str, str, str]]:
    """(claim, paper's figure, ours, verdict) for each claim of METHOD.md section 6.
    rows: one per spec of one protocol (report.summarize); recs: that protocol's records,
    whose `protocol` names it where `protocol` is not given."""
    protocol = protocol or next((r["protocol"] for r in recs if "protocol" in r), "?")
    by = {r["spec"]: r for r in rows}
    model = meta["model"]["name"]
    out = [claim_5bits(rows, model, by.get("fp16"), protocol, recs),
           claim_zero_shot(recs, protocol),
           claim_outliers(rows, model, by, protocol),
           ("4. gpt-oss-20b: 3-3.5x Pareto advantage over naive", "3-3.5x", "-",
            f"{NOT_RUN}: gpt-oss-20b is not available offline (this run: {model})"),
           claim_kivi(recs, protocol),
           claim_matched_bits(rows, protocol),
           claim_compression(rows, meta, protocol),
           claim_latency(folder),
           claim_seed_spread(rows, protocol),
           claim_structure()]
    return [c for c in out if c]


__all__ = ["NOT_RUN", "claims", "hqmq_standing", "pareto_rows", "interp", "order", "fmt", "at", "paired",
           "claim_5bits", "claim_zero_shot", "claim_outliers", "claim_kivi", "claim_matched_bits",
           "claim_compression", "claim_latency", "claim_seed_spread", "claim_structure", "latency_file"]
