"""Issue 28's rules across head dims, read off the newest latency suite run at each head dim
(its latency.json under a reports folder; nothing is measured here, so it runs on a CPU).

Per shipped format (`fused-<x>`, what backend="auto" runs) and head dim: the graphed call's
speed-up over the same run's graphed fp16 SDPA at the focus shape (B=8, T=32k) and at B=1,
and the backend auto took. Against issue 28: at d 64 and d 256, every format on CUDA and at
least HEAD_DIM_SHARE of its d 128 speed-up; at B=1, every format >= targets.B1_GRAPHED; at
d 128, the per-format targets of targets.GRAPHED_TARGETS; Med3x's time within
targets.MED3_WITHIN_GRAPHED of HQMQ's (and Med3x mixed of HQMQ mixed). Each speed-up is a
same-run ratio, but the runs at different head dims may come from different machines: each
column names its GPU and date, and a share across two GPUs is marked so.

    python -m kvqbench.suites.bench.latency.head_dims                 # reports/latency -> reports/latency/head_dims/
    python -m kvqbench.suites.bench.latency.head_dims --root DIR --out DIR
    python -m kvqbench.suites.bench.latency.head_dims --gpu H200     # only runs on that card (issue 28's)

Writes head_dims.md, head_dims.json and head_dims.png (the B=8 speed-ups per format and head
dim, issue 28's d 128 targets marked). Exit 2 when no run at d 128 is found.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .targets import B1_GRAPHED, BESIDE_GRAPHED, GRAPHED_TARGETS, MED3_WITHIN_GRAPHED

HEAD_DIM_SHARE = 0.9  # issue 28: d 64 / d 256 speed-up >= 0.9 of the format's d 128 one
SHARE_RULED = (64, 256)  # the head dims the rule names (others, e.g. d 96, show the share unjudged)
FOCUS, B1 = (8, 32768), (1, 32768)
ISSUE_HEADS = (32, 8)  # (Hq, Hkv): the shape issue 28's rules are set for
BASE = "fp16-sdpa-graph"
# Med3x and the HQMQ row its time is held to
MED3_PAIRS = {"fused-hqmq-med3": "fused-hqmq", "fused-hqmq-med3-mixed": "fused-hqmq-mixed"}


def _rows(lat: dict) -> dict:
    return {(r["method"], r["B"], r["T"]): r for r in lat.get("latency", []) if "latency_us" in r}


def newest_runs(root: Path, keep=None) -> dict[int, tuple[Path, dict]]:
    """{head dim: (path, parsed latency.json)}: per head dim the run with the newest recorded
    time among root/**/latency.json (files that are not a latency suite's are skipped);
    keep(lat): a run must also pass it."""
    best: dict[int, tuple[str, Path, dict]] = {}
    for path in Path(root).glob("**/latency.json"):
        try:
            lat = json.loads(path.read_text())
            d, when = int(lat["shape"]["d"]), str(lat["env"].get("time", ""))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (keep is None or keep(lat)) and (d not in best or when > best[d][0]):
            best[d] = (when, path, lat)
    return {d: (p, lat) for d, (_, p, lat) in sorted(best.items())}


def issue_shape(lat: dict) -> bool:
    """Whether a run has issue 28's heads (Hq 32 / Hkv 8; a run at another GQA group, e.g.
    `--heads 64 4`, is not one of its columns). Runs before the shape named its heads had them."""
    shape = lat.get("shape", {})
    return (shape.get("Hq", ISSUE_HEADS[0]), shape.get("Hkv", ISSUE_HEADS[1])) == ISSUE_HEADS


def has_focus(lat: dict) -> bool:
    """Whether a run has the graphed fp16 SDPA rows at the focus and at B=1 (what every ratio needs)."""
    rows = _rows(lat)
    return (BASE, *FOCUS) in rows and (BASE, *B1) in rows


def _cell(rows: dict, method: str, shape) -> dict | None:
    r, s = rows.get((method + "-graph", *shape)), rows.get((BASE, *shape))
    if r is None or s is None:
        return None
    return {"us": r["latency_us"], "x": s["latency_us"] / r["latency_us"], "backend": r.get("backend")}


def scoreboard(runs: dict[int, tuple[Path, dict]]) -> dict:
    """The rules per format and head dim (see the module docstring); met None = not measured."""
    dims = sorted(runs)
    rows = {d: _rows(lat) for d, (_, lat) in runs.items()}
    gpu = {d: lat["env"].get("gpu", "?") for d, (_, lat) in runs.items()}
    methods = sorted({m for _, lat in runs.values() for m in lat.get("method_specs", {})
                      if m.startswith("fused-") and m != "fused-fp16"})
    out = {"runs": {d: {"path": str(p), "gpu": gpu[d], "time": lat["env"].get("time"),
                        "commit": (lat["env"].get("kvqbench") or {}).get("commit")} for d, (p, lat) in runs.items()},
           "formats": {}}
    for m in methods:
        spec = next((lat["method_specs"][m] for _, lat in runs.values() if m in lat.get("method_specs", {})), None)
        per = {}
        ref = _cell(rows[128], m, FOCUS) if 128 in rows else None
        for d in dims:
            focus, b1 = _cell(rows[d], m, FOCUS), _cell(rows[d], m, B1)
            c = {"B8": focus, "B1": b1,
                 "b1_met": None if b1 is None else b1["x"] >= B1_GRAPHED}
            if d == 128:
                need = GRAPHED_TARGETS.get(m) or GRAPHED_TARGETS.get(BESIDE_GRAPHED.get(m, ("",))[0])
                c["target"] = need
                c["target_met"] = None if focus is None or need is None else focus["x"] >= need
            elif focus is not None and ref is not None:
                share = focus["x"] / ref["x"]
                c["share_of_d128"] = share
                c["cross_gpu"] = gpu[d] != gpu[128]
                c["share_met"] = (share >= HEAD_DIM_SHARE and focus["backend"] == "cuda") if d in SHARE_RULED else None
            else:
                c["share_met"] = None
            if m in MED3_PAIRS and focus is not None:
                h = _cell(rows[d], MED3_PAIRS[m], FOCUS)
                if h is not None:
                    c["time_to_hqmq"] = focus["us"] / h["us"]
                    c["within_met"] = c["time_to_hqmq"] <= MED3_WITHIN_GRAPHED
            per[d] = c
        out["formats"][m] = {"spec": spec, "by_head_dim": per}
    return out


def _mark(ok) -> str:
    return {True: "", False: " **no**", None: ""}[ok]


def markdown(board: dict) -> str:
    dims = sorted(int(d) for d in board["runs"])
    L = ["# Issue 28 across head dims", "",
         f"Graphed calls against the same run's graphed fp16 SDPA, at B={FOCUS[0]} T={FOCUS[1]} (x B=8) and "
         f"B={B1[0]} T={B1[1]} (x B=1); the backend auto took. Issue 28: d 128 targets per format; at the other "
         f"head dims every format on CUDA and >= {HEAD_DIM_SHARE} of its d 128 speed-up (share; judged at d "
         f"{' and '.join(map(str, SHARE_RULED))}); x B=1 >= {B1_GRAPHED}; Med3x's time <= {MED3_WITHIN_GRAPHED}x "
         "HQMQ's (Med3x mixed: HQMQ mixed's); hqmq-int8 is read against HQMQ's target. **no** marks a rule "
         "missed. Nothing measured here: each column is the newest latency suite run at its head dim"
         + (f" on a GPU named *{board['gpu']}*." if board.get("gpu") else "."), "",
         "| head dim | run | GPU | time | commit |", "|---:|---|---|---|---|"]
    for d in dims:
        r = board["runs"][d]
        L.append(f"| {d} | `{r['path']}` | {r['gpu']} | {(r['time'] or '')[:16]} | {(r['commit'] or '')[:8]} |")
    head = ["format"]
    for d in dims:
        head += [f"d {d} x B=8", f"d {d} share" if d != 128 else "d 128 target", f"d {d} x B=1"]
    L += ["", "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for m, f in board["formats"].items():
        cells = [f"{m.removeprefix('fused-')}"]
        for d in dims:
            c = f["by_head_dim"].get(d) or {}
            b8, b1 = c.get("B8"), c.get("B1")
            x8 = "" if b8 is None else f"{b8['x']:.2f} ({b8['backend']})"
            if "time_to_hqmq" in c:
                x8 += f", {c['time_to_hqmq']:.2f}x {MED3_PAIRS[m].removeprefix('fused-')}{_mark(c['within_met'])}"
            if d == 128:
                mid = "" if c.get("target") is None else f">= {c['target']}{_mark(c.get('target_met'))}"
            else:
                mid = ("" if "share_of_d128" not in c else
                       f"{c['share_of_d128']:.2f}{' (2 GPUs)' if c['cross_gpu'] else ''}{_mark(c['share_met'])}")
            cells += [x8, mid, "" if b1 is None else f"{b1['x']:.2f}{_mark(c['b1_met'])}"]
        L.append("| " + " | ".join(cells) + " |")
    return "\n".join(L) + "\n"


def plot(board: dict, path: Path) -> bool:
    """Grouped bars: per format, its B=8 graphed speed-up at each head dim; d 128 targets as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted(int(d) for d in board["runs"])
    fmts = list(board["formats"])
    if not fmts:
        return False
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(fmts)), 4.5))
    w = 0.8 / max(1, len(dims))
    for i, d in enumerate(dims):
        xs = [board["formats"][m]["by_head_dim"].get(d, {}).get("B8") for m in fmts]
        ax.bar([j + (i - (len(dims) - 1) / 2) * w for j in range(len(fmts))],
               [0 if x is None else x["x"] for x in xs], w, label=f"d {d}")
    for j, m in enumerate(fmts):
        need = board["formats"][m]["by_head_dim"].get(128, {}).get("target")
        if need:
            ax.plot([j - 0.45, j + 0.45], [need, need], "k--", lw=1)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(fmts)))
    ax.set_xticklabels([m.removeprefix("fused-") for m in fmts], rotation=30, ha="right")
    ax.set_ylabel("x graphed fp16 SDPA (same run), B=8 T=32k")
    gpus = ", ".join(sorted({r["gpu"] for r in board["runs"].values()}))
    ax.set_title(f"Decode attention per head dim, {gpus} (dashed: issue 28's d 128 target)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.latency.head_dims",
                                description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("reports/latency"), help="folder searched for latency.json")
    p.add_argument("--out", type=Path, help="output folder (default <root>/head_dims)")
    p.add_argument("--gpu", default="", help="only runs whose GPU name contains this (e.g. H200: the card issue "
                                             "28's rules name), so that no column comes from another card")
    a = p.parse_args(argv)
    runs = newest_runs(a.root, keep=lambda lat: has_focus(lat) and issue_shape(lat)
                       and a.gpu in str(lat["env"].get("gpu", "")))
    if 128 not in runs:
        print(f"head_dims: no latency suite run at head dim 128 with graphed rows at B={FOCUS[0]} / {B1[0]}, "
              f"T={FOCUS[1]}{f' on a {a.gpu}' if a.gpu else ''} under {a.root}", file=sys.stderr)
        return 2
    board = scoreboard(runs) | {"gpu": a.gpu}
    out = a.out or a.root / "head_dims"
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_dims.json").write_text(json.dumps(board, indent=1))
    md = markdown(board)
    (out / "head_dims.md").write_text(md)
    plot(board, out / "head_dims.png")
    print(md)
    print(f"-> {out}/head_dims.md, head_dims.json, head_dims.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
