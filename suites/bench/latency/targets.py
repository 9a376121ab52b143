"""Issue 10's targets, read off the rows of one run (reported, not asserted):

- at the focus shape (B=8, T=32k in the full run), the shipped row (`fused-<x>`, what
  decode_attention(backend="auto") runs) against the same run's fp16 SDPA: int4 >= 2.0x,
  KIVI-2 >= 2.5x, KIVI-4 >= 2.0x, fp8 >= 1.6x, HQMQ >= 1.5x; HQMQ + Med3x within 1.25x
  of HQMQ's time;
- at B=1 and the focus T, every shipped kernel at least as fast as fp16 SDPA, eager or
  as CUDA-graph replays (each against the baseline timed the same way);
- where a CUDA kernel was measured by opt-in (`fused-<x>-cuda`: not what auto runs),
  the same figures for it, beside, never in place of the shipped row's;
- as before: fused HQMQ against fake-quant at T >= 32k, and latency grows with T.

`add_speedups` puts each row's speed-up over the same run's fp16 SDPA into the row.
"""
from __future__ import annotations

SPEEDUP_TARGETS = {"fused-int4": 2.0, "fused-kivi2": 2.5, "fused-kivi4": 2.0, "fused-fp8": 1.6, "fused-hqmq": 1.5}
MED3, MED3_WITHIN = "fused-hqmq-med3", 1.25
SHIPPED = (*SPEEDUP_TARGETS, MED3)
# Issue 28 ("kernels at the byte limit"), on graphed calls against the graphed fp16 SDPA: at
# the focus, these speed-ups and Med3x within 1.15x of HQMQ; at B=1 and the focus T, every
# shipped format >= 1.5x and its eager call's host time <= 20 us.
GRAPHED_TARGETS = {"fused-int4": 2.7, "fused-fp8": 1.9, "fused-kivi4": 2.7, "fused-kivi2": 3.8, "fused-hqmq": 2.4}
MED3_WITHIN_GRAPHED, B1_GRAPHED, HOST_US = 1.15, 1.5, 20.0
# Read beside, never in place of, the exact codebook's row: HQMQ's graphed target for its int8
# codebook (`codebook=int8`: the same codes and bytes, each codeword component rounded to
# k / 127; its own PPL row in compare), for a deployment that takes that decode rule.
BESIDE_GRAPHED = {"fused-hqmq-int8": ("fused-hqmq", "HQMQ's target, for its int8 codebook")}


def baseline_method(method: str) -> str:
    """The fp16 row a row is compared with: graph replays with graph replays."""
    return "fp16-sdpa-graph" if method.endswith("-graph") else "fp16-sdpa"


def add_speedups(rows: list[dict]):
    """speedup_vs_fp16_sdpa on every measured row whose (B, T) has its fp16 baseline."""
    base = {(r["method"], r["B"], r["T"]): r["latency_us"] for r in rows if "latency_us" in r}
    for r in rows:
        s = base.get((baseline_method(r.get("method", "")), r["B"], r["T"]))
        if "latency_us" in r and s:
            r["speedup_vs_fp16_sdpa"] = s / r["latency_us"]


def targets(rows: list[dict], focus: tuple[int, int]) -> dict:
    ok = {(r["method"], r["B"], r["T"]): r for r in rows if "latency_us" in r}
    b1 = (1, focus[1])

    def x(m, shape):
        """(row's us, fp16 SDPA's us, speed-up) or None where either is missing."""
        r, s = ok.get((m, *shape)), ok.get((baseline_method(m), *shape))
        return (r["latency_us"], s["latency_us"], s["latency_us"] / r["latency_us"]) if r and s else None

    def judged(m, need, shape):
        got = x(m, shape)
        if got is None:
            return {"row": m, "target": f">= {need}x", "met": None, "missing": f"no {m} or fp16 SDPA row at "
                    f"B={shape[0]} T={shape[1]} in this run"}
        r = ok[(m, *shape)]
        return {"row": m, "backend": r.get("backend"), "us": got[0], "fp16_sdpa_us": got[1], "speedup": got[2],
                "target": f">= {need}x", "met": got[2] >= need}

    def med3(suffix, within=MED3_WITHIN):
        m, h = ok.get((MED3 + suffix, *focus)), ok.get(("fused-hqmq" + suffix, *focus))
        if not (m and h):
            return {"row": MED3 + suffix, "target": f"<= {within}x fused-hqmq{suffix}", "met": None,
                    "missing": f"no {MED3 + suffix} or fused-hqmq{suffix} row at the focus"}
        ratio = m["latency_us"] / h["latency_us"]
        return {"row": MED3 + suffix, "backend": m.get("backend"), "us": m["latency_us"],
                "hqmq_row": "fused-hqmq" + suffix, "hqmq_us": h["latency_us"], "ratio_to_hqmq": ratio,
                "target": f"<= {within}x fused-hqmq{suffix}", "met": ratio <= within}

    def host(m):
        r = ok.get((m, *b1))
        if r is None or "host_us" not in r:
            return {"row": m, "target": f"<= {HOST_US:g} us host per eager call", "met": None,
                    "missing": f"no eager {m} row with host_us at B={b1[0]} T={b1[1]}"}
        # judged on the larger of the fixed-T call and the step call (another token count each
        # call: what eager decode pays); rows before 2026-12-06 have the fixed-T figure only
        us = max(r["host_us"], r.get("host_us_step", r["host_us"]))
        return {"row": m, "backend": r.get("backend"), "host_us": us,
                "judged_on": "max(fixed T, step)" if "host_us_step" in r else "fixed T (no step figure)",
                "target": f"<= {HOST_US:g} us host per eager call", "met": us <= HOST_US}

    def b1_row(m):
        eager, graph = x(m, b1), x(m + "-graph", b1)
        t = {"row": m, "target": ">= 1.0x (eager or graph, like for like)"}
        t.update({"eager_speedup": eager[2]} if eager else {})
        t.update({"graph_speedup": graph[2]} if graph else {})
        ratios = [g[2] for g in (eager, graph) if g]
        t["met"] = max(ratios) >= 1.0 if ratios else None
        return t

    out = {"shapes": {"focus_B_T": list(focus), "b1_B_T": list(b1)},
           "focus": {**{m: judged(m, need, focus) for m, need in SPEEDUP_TARGETS.items()}, MED3: med3("")},
           "b1": {m: b1_row(m) for m in SHIPPED},
           "graphed": {**{m + "-graph": judged(m + "-graph", need, focus) for m, need in GRAPHED_TARGETS.items()},
                       MED3 + "-graph": med3("-graph", MED3_WITHIN_GRAPHED),
                       **{m + "-graph@b1": judged(m + "-graph", B1_GRAPHED, b1) for m in SHIPPED},
                       **{m + "@host": host(m) for m in SHIPPED}}}
    for m, (of, why) in BESIDE_GRAPHED.items():
        if (m + "-graph", *focus) in ok:  # judged where the run has the row (older runs do not)
            row = judged(m + "-graph", GRAPHED_TARGETS[of], focus)
            out["graphed"][m + "-graph"] = {**row, "target": f"{row['target']} ({why})"}
    opt_in = {m + "-cuda": judged(m + "-cuda", SPEEDUP_TARGETS.get(m, 1.0), focus)
              for m in SHIPPED if (m + "-cuda", *focus) in ok}
    if (MED3 + "-cuda", *focus) in ok:  # the Med3x kernel by opt-in against HQMQ as shipped
        m, h = ok[(MED3 + "-cuda", *focus)], ok.get(("fused-hqmq", *focus))
        if h:
            opt_in[MED3 + "-cuda"] = {**opt_in[MED3 + "-cuda"], "target": f"<= {MED3_WITHIN}x fused-hqmq",
                                      "ratio_to_hqmq": m["latency_us"] / h["latency_us"],
                                      "met": m["latency_us"] / h["latency_us"] <= MED3_WITHIN}
    out["cuda_opt_in_not_shipped"] = opt_in
    out["fake_quant"] = _vs_fake_quant(ok)
    grows = {}
    for m, B in sorted({(m, B) for m, B, _ in ok}):
        seq = sorted((T, r["latency_us"]) for (mm, BB, T), r in ok.items() if (mm, BB) == (m, B))
        if len(seq) > 1:
            grows[f"{m} B={B}"] = all(b[1] > a[1] for a, b in zip(seq, seq[1:]))
    out["latency_grows_with_T"] = grows
    return out


def _vs_fake_quant(ok: dict) -> dict:
    """Shipped fused HQMQ (+ Med3x) against fake-quant at T >= 32k: >= 10x (the paper's claim)."""
    out = {}
    for m in ("fused-hqmq", MED3):
        sp = [{"B": B, "T": T, "speedup": r["latency_us"] / ok[(m, B, T)]["latency_us"]}
              for (mm, B, T), r in ok.items() if mm == "fake-quant" and T >= 32768 and (m, B, T) in ok]
        out[m] = {"speedups": sp, "target_10x_met": all(s["speedup"] >= 10 for s in sp) if sp else None}
    return out
