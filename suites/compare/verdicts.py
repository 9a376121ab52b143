"""How the claims (claims.py) reach a verdict: Pareto fronts compared front against
front, paired per-window differences, and the byte split of a packed cache.

Fronts (METHOD.md 4, last paragraph: "Matched-bits verdicts compare Pareto fronts,
family against family"). A family's front is its rows not beaten on both measured
bits and mean PPL (seed means); between two vertices PPL is interpolated linearly in
log PPL, the seed min and max alike, so a front is a band. HQMQ has two fronts: PLAIN
(no Med3x, no fill) and + MED3X (outliers=med3, no fill); `fill=true` rows are judged
apart (whether they move the front). Two fronts are compared only over the overlap of
their bit ranges (never extrapolated), at every vertex of either front inside it: both
fronts are piecewise linear in log PPL, so their difference is linear between those
points and its sign can change only there. At each point the verdict is a win or a
loss only when the two seed bands do not overlap (`order`), else "within the seed
spread". A row off its family's front (dominated by the family's own rows) is never
compared: it is listed as such. Fronts that share no bits are not interpolated either;
they reach a verdict only by dominance (`dominance`): a vertex of the costlier front
beaten by the cheaper front's best vertex, fewer bits and seed bands apart.

Paired differences (`paired`): records carry `window_nll`, the NLL summed over each
window (harness/perplexity.py). Two configurations scored on the same windows are
compared window by window: the mean per-token NLL difference, and a band of two
standard errors over the windows for each seed, the union over seeds.
"""
from __future__ import annotations

import math
import statistics

SPREAD = "within the seed spread"


# ---- fronts ----------------------------------------------------------------------------------
def pareto_rows(rows: list[dict]) -> list[dict]:
    """Rows not beaten on both measured bits and mean PPL, sorted by bits."""
    front, best = [], math.inf
    for r in sorted(rows, key=lambda r: (r["bits"], r["ppl"])):
        if r["ppl"] < best:
            front.append(r)
            best = r["ppl"]
    return front


def at(front: list[dict], bits: float) -> dict | None:
    """PPL (mean, min, max) of a front at `bits`: log-PPL interpolation between the two
    vertices around it (seed min and max interpolated alike); None outside its range."""
    for a, b in zip(front, front[1:]):
        if a["bits"] <= bits <= b["bits"]:
            t = (bits - a["bits"]) / (b["bits"] - a["bits"])
            f = {k: math.exp((1 - t) * math.log(a[k]) + t * math.log(b[k])) for k in ("ppl", "ppl_min", "ppl_max")}
            return {**f, "between": (a["spec"], b["spec"])}
    exact = [r for r in front if math.isclose(r["bits"], bits, rel_tol=0, abs_tol=1e-9)]
    return {k: exact[0][k] for k in ("ppl", "ppl_min", "ppl_max")} | {"between": (exact[0]["spec"],)} if exact else None


def interp(rows: list[dict], family: str, bits: float) -> dict | None:
    """`at` on the front of every row of `family`."""
    return at(pareto_rows([r for r in rows if r["family"] == family]), bits)


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


def band(r: dict) -> str:
    """An interpolated point: '44.721 (43.71-45.73)'."""
    return f"{r['ppl']:.3f} ({r['ppl_min']:.3f}-{r['ppl_max']:.3f})"


def config_of(spec: str):
    """(quantizer name, Config) of a spec, or (None, None) where it does not parse."""
    try:
        from ...quantizers import parse_spec

        cls, cfg = parse_spec(spec)
        return cls.name, cfg
    except Exception:  # noqa: BLE001 (an unregistered plugin, a hand-edited spec)
        return None, None


def is_config(spec: str, family: str, **want) -> bool:
    """Whether `spec` is `family` with every field of `want` as given (other fields free)."""
    name, cfg = config_of(spec)
    return name == family and all(getattr(cfg, k, object()) == v for k, v in want.items())


def hqmq_variant(spec: str) -> str:
    """'fill', 'med3' or 'plain' (no Med3x, no fill) for an HQMQ spec."""
    _, cfg = config_of(spec)
    fill = getattr(cfg, "fill", None) if cfg is not None else "fill=true" in spec
    med3 = getattr(cfg, "outliers", None) == "med3" if cfg is not None else "outliers=med3" in spec
    return "fill" if fill else "med3" if med3 else "plain"


HQMQ_FRONTS = {"plain": "HQMQ plain (no Med3x, no fill)", "med3": "HQMQ + Med3x (no fill)"}


def hqmq_front(rows: list[dict], variant: str) -> list[dict]:
    return pareto_rows([r for r in rows if r["family"] == "hqmq" and hqmq_variant(r["spec"]) == variant])


def family_front(rows: list[dict], family: str) -> list[dict]:
    return pareto_rows([r for r in rows if r["family"] == family])


def compare_fronts(base: list[dict], hq: list[dict]) -> dict:
    """The HQMQ front `hq` against a baseline family's front `base`, over the overlap of
    their bit ranges, at every vertex of either front inside it.

    Returns {"overlap": (lo, hi) or None, "points": [{bits, vertex, base, hq, order}]}
    with `order` HQMQ's ('<': HQMQ lower PPL, seed bands apart)."""
    if not base or not hq:
        return {"overlap": None, "points": []}
    lo, hi = max(base[0]["bits"], hq[0]["bits"]), min(base[-1]["bits"], hq[-1]["bits"])
    if lo > hi + 1e-12:
        return {"overlap": None, "points": []}
    pts: dict[float, str] = {}
    for who, front in (("baseline", base), ("HQMQ", hq)):
        for r in front:
            if lo - 1e-12 <= r["bits"] <= hi + 1e-12:
                key = round(r["bits"], 9)
                pts[key] = (pts[key] + " = " if key in pts else "") + f"{who} `{r['spec']}`"
    points = []
    for bits in sorted(pts):
        b, h = at(base, bits), at(hq, bits)
        if b is None or h is None:  # rounding at an end of the overlap
            continue
        points.append({"bits": bits, "vertex": pts[bits], "base": b, "hq": h, "order": order(h, b)})
    return {"overlap": (lo, hi), "points": points}


def dominance(base: list[dict], hq: list[dict]) -> list[dict]:
    """Where two fronts share no bits (`compare_fronts` finds no point): the vertices of the
    costlier front that the cheaper front's best vertex (its most bits, lowest PPL) beats
    with fewer bits, seed bands apart. Points as `compare_fronts`'s, `order` HQMQ's: '>'
    for an HQMQ vertex beaten by a cheaper baseline, '<' for a baseline vertex beaten by a
    cheaper HQMQ. Without overlap nothing else is compared: a cheaper front whose best
    PPL is not below is no verdict either way (it trades bits for PPL)."""
    if not base or not hq:
        return []
    if base[-1]["bits"] < hq[0]["bits"]:
        b = base[-1]
        return [{"bits": h["bits"], "vertex": f"HQMQ `{h['spec']}`, beaten with fewer bits by `{b['spec']}` "
                 f"({b['bits']:.3f} b)", "base": b, "hq": h, "order": ">"} for h in hq if order(h, b) == ">"]
    if hq[-1]["bits"] < base[0]["bits"]:
        h = hq[-1]
        return [{"bits": b["bits"], "vertex": f"baseline `{b['spec']}`, beaten with fewer bits by `{h['spec']}` "
                 f"({h['bits']:.3f} b)", "base": b, "hq": h, "order": "<"} for b in base if order(h, b) == "<"]
    return []


def tally(points: list[dict]) -> dict:
    t = {"<": 0, ">": 0, "~": 0}
    for p in points:
        t[p["order"]] += 1
    return t


def front_word(points: list[dict]) -> str:
    """One phrase for HQMQ against a family over the points compared."""
    t, n = tally(points), len(points)
    if not n:
        return "no bits in common"
    if t["<"] == n:
        return f"HQMQ wins at all {n} point(s)"
    if t[">"] == n:
        return f"HQMQ loses at all {n} point(s)"
    if t["~"] == n:
        return f"{SPREAD} at all {n} point(s)"
    return f"mixed: HQMQ wins at {t['<']}, loses at {t['>']}, {SPREAD} at {t['~']} of {n} points"


def describe_front(front: list[dict]) -> str:
    if not front:
        return "no rows"
    return (f"{front[0]['bits']:.2f}-{front[-1]['bits']:.2f} b, vertices "
            + ", ".join(f"`{r['spec']}`" for r in front))


def off_front(rows: list[dict], family: str, front: list[dict]) -> list[dict]:
    on = {r["spec"] for r in front}
    return [r for r in rows if r["family"] == family and r["spec"] not in on]


# ---- paired per-window differences -----------------------------------------------------------
def paired(recs: list[dict], spec_a: str, spec_b: str) -> dict | None | str:
    """Per-token NLL of `spec_a` minus `spec_b`, window by window on the same windows.

    Seeds are paired by number; a configuration with one seed (deterministic) pairs with
    every seed of the other. For each seed pair: the mean over windows of
    (NLL_a - NLL_b) / tokens per window and its standard error over windows; the result's
    band is the union over seed pairs of mean +- 2 se. Returns None when either spec has
    no record, a string saying why when they cannot be paired (records without
    `window_nll`, different windows)."""
    a = {r["seed"]: r for r in recs if r.get("spec") == spec_a and "error" not in r}
    b = {r["seed"]: r for r in recs if r.get("spec") == spec_b and "error" not in r}
    if not a or not b:
        return None
    if not all(isinstance(r.get("window_nll"), list) for r in (*a.values(), *b.values())):
        return "not paired: records without per-window NLL (made before `window_nll`)"
    pairs = ([(a[s], b[s]) for s in sorted(a) if s in b] if len(a) > 1 and len(b) > 1 else
             [(ra, b[min(b)]) for _, ra in sorted(a.items())] if len(b) == 1 else
             [(a[min(a)], rb) for _, rb in sorted(b.items())])
    if not pairs:
        return "not paired: no seed in common"
    means, los, his, n_w = [], [], [], None
    for ra, rb in pairs:
        wa, wb = ra["window_nll"], rb["window_nll"]
        tok = ra["n_predicted"] / ra["n_windows"]
        if len(wa) != len(wb) or ra["n_predicted"] != rb["n_predicted"] or len(wa) != ra["n_windows"] or tok <= 0:
            return "not paired: the two records did not score the same windows"
        d = [(x - y) / tok for x, y in zip(wa, wb)]
        m = statistics.fmean(d)
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.inf
        means.append(m)
        los.append(m - 2 * se)
        his.append(m + 2 * se)
        n_w = len(d)
    mean, lo, hi = statistics.fmean(means), min(los), max(his)
    return {"mean": mean, "lo": lo, "hi": hi, "n_windows": n_w, "n_pairs": len(pairs),
            "seed_min": min(means), "seed_max": max(means), "apart": lo > 0 or hi < 0}


def paired_text(p, a: str, b: str) -> str:
    """'hqmq:S=96,r=4 - fp16, paired over 16 windows x 3 seeds: ...'."""
    if p is None:
        return f"{a} vs {b}: not both run"
    if isinstance(p, str):
        return f"{a} vs {b}: {p}"
    side = ("higher" if p["lo"] > 0 else "lower") if p["apart"] else "no difference resolved"
    return (f"{a} - {b}, paired over {p['n_windows']} windows x {p['n_pairs']} seed(s): NLL/token "
            f"{p['mean']:+.4f} (PPL x{math.exp(p['mean']):.4f}), 2-se band over windows and seeds "
            f"[{p['lo']:+.4f}, {p['hi']:+.4f}]: {side}")


# ---- the bytes of a packed cache, field by field ---------------------------------------------
def field_split(spec: str, head_dim: int, heads: int, tokens: int, seed: int = 0) -> dict:
    """Bits per element of each stored field of `spec` on a synthetic (normal) tensor
    [1, heads, tokens, head_dim]: {field: (bits per element, is a model constant)}.
    The per-token fields (codes, radius, r_max) do not depend on the values; Med3x's
    outliers do, so a synthetic tensor says nothing of them."""
    import torch

    from ...quantizers import get_quantizer

    q = get_quantizer(spec, seed=seed)
    x = torch.randn(1, heads, tokens, head_dim, generator=torch.Generator().manual_seed(seed))
    p = q.encode(x)
    const = getattr(p, "constant", frozenset())
    return {k: (b * 8 / p.numel, k.removeprefix("shared:") in const) for k, b in p.nbytes_by_field().items()}


# ---- HQMQ against every family, front against front ------------------------------------------
def _word(o: str) -> str:
    return {"<": "HQMQ wins", ">": "HQMQ loses", "~": SPREAD}[o]


def hqmq_standing(rows: list[dict]) -> list[str]:
    """Markdown: each baseline family's Pareto front against HQMQ's plain front and,
    separately, HQMQ + Med3x's front (module docstring); then whether `fill=true` moves
    the front it belongs to."""
    hq = [r for r in rows if r["family"] == "hqmq"]
    if not hq:
        return []
    fronts = {v: hqmq_front(rows, v) for v in HQMQ_FRONTS}
    families = sorted({r["family"] for r in rows if r["family"] not in ("hqmq", "fp16")})
    out = ["Front against front (METHOD.md 4): each family's Pareto front of seed means against HQMQ's, "
           "log PPL interpolated along each front (seed min/max alike), compared at every vertex of either "
           "front inside the overlap of their bit ranges; a win or loss needs the seed bands apart. Rows off "
           "their family's front are not compared.", ""]
    out += [f"- {HQMQ_FRONTS[v]} front: {describe_front(f)}" for v, f in fronts.items()]
    if not families:
        return []
    out += ["", "| family front | HQMQ front | bits | vertex of | family PPL (seed band) | HQMQ PPL (seed band) | "
            "HQMQ / family | verdict |", "|---|---|---|---|---|---|---|---|"]
    table_at = len(out)
    summary: dict[str, list[str]] = {v: [] for v in fronts}
    outside: dict[str, list[str]] = {v: [] for v in fronts}
    dominated = []
    for fam in families:
        base = family_front(rows, fam)
        dominated += [f"`{r['spec']}`" for r in off_front(rows, fam, base)]
        for v, front in fronts.items():
            if not front:
                continue
            c = compare_fronts(base, front)
            points = c["points"] or dominance(base, front)
            if not points:
                outside[v].append(f"{fam} ({base[0]['bits']:.2f}-{base[-1]['bits']:.2f} b)")
                continue
            for p in points:
                out.append(f"| {fam} | {v} | {p['bits']:.3f} | {p['vertex']} | {band(p['base'])} | {band(p['hq'])} | "
                           f"{p['hq']['ppl'] / p['base']['ppl']:.3f} | {_word(p['order'])} |")
            if c["points"]:
                lo, hi = c["overlap"]
                summary[v].append(f"{fam} ({lo:.2f}-{hi:.2f} b): {front_word(c['points'])}")
            else:
                who = "HQMQ's" if points[0]["order"] == ">" else f"{fam}'s"
                summary[v].append(f"{fam} ({base[0]['bits']:.2f}-{base[-1]['bits']:.2f} b, no bits in common): "
                                  f"{len(points)} of {who} vertices beaten with fewer bits "
                                  f"({'HQMQ loses' if points[0]['order'] == '>' else 'HQMQ wins'})")
    if not any(summary.values()):  # no table: no family front shares bits with an HQMQ front
        out = out[:table_at - 3]
    out.append("")
    for v in fronts:
        if not fronts[v]:
            continue
        line = f"{HQMQ_FRONTS[v]} front against each family front: " + ("; ".join(summary[v]) or "no overlap") + "."
        if outside[v]:
            line += f" No bits in common (not compared): {', '.join(outside[v])}."
        out.append(line)
    if dominated:
        out.append(f"Off their family's front (dominated within the family, not compared): {', '.join(dominated)}.")
    for f in (r for r in hq if hqmq_variant(r["spec"]) == "fill"):
        v = "med3" if "outliers=med3" in f["spec"] else "plain"
        h = at(fronts[v], f["bits"])
        if h is None:
            out.append(f"\n`{f['spec']}` ({f['bits']:.2f} b) lies outside the bit range of the {HQMQ_FRONTS[v]} "
                       "front: whether fill moves it is not measured in this run.")
            continue
        moved = {"<": "moves the front down (lower PPL at its bits, seed ranges apart)",
                 ">": "lies above the front (higher PPL at its bits, seed ranges apart)",
                 "~": "does not move the front beyond the seed spread"}[order(f, h)]
        same = next((r for r in hq if r["spec"] == f["spec"].replace(",fill=true", "")), None)
        vs_same = "" if same is None else (
            f" Against `{same['spec']}` {fmt(same)} at {same['bits']:.2f} b (same S and radius bits, "
            f"{f['bits'] - same['bits']:+.2f} b): {_word(order(f, same)).replace('HQMQ', 'fill')}.")
        out.append(f"\n`{f['spec']}` {fmt(f)} at {f['bits']:.2f} b vs the {HQMQ_FRONTS[v]} front there "
                   f"{band(h)}: {moved}." + vs_same)
    return out
