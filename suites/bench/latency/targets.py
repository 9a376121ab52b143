"""The targets, read off the measured rows (reported, not asserted):

- fused HQMQ at least 2x faster than fp16 SDPA at the focus shape;
- fused HQMQ at 50% or more of the measured copy bandwidth there;
- fused HQMQ at least 10x faster than fake-quant at T >= 32k;
- and, as a sanity check, every method's latency grows with T.
"""
from __future__ import annotations

TARGET_METHODS = ("fused-hqmq", "fused-hqmq-med3")


def targets(rows: list[dict], focus: tuple[int, int]) -> dict:
    ok = [r for r in rows if "latency_us" in r]

    def lat(m, B, T):
        return next((r for r in ok if r["method"] == m and r["B"] == B and r["T"] == T), None)

    out = {}
    for m in TARGET_METHODS:
        f, s = lat(m, *focus), lat("fp16-sdpa", *focus)
        t = {}
        if f and s:
            t["speedup_vs_fp16_sdpa_at_focus"] = s["latency_us"] / f["latency_us"]
            t["target_2x_vs_fp16_met"] = t["speedup_vs_fp16_sdpa_at_focus"] >= 2
        if f:
            t["focus_B_T"] = list(focus)
            t["frac_copy_bw_at_focus"] = f["frac_copy_bw"]
            t["target_50pct_copy_bw_met"] = f["frac_copy_bw"] >= 0.5
        sp = []
        for r in ok:
            if r["method"] == "fake-quant" and r["T"] >= 32768:
                g = lat(m, r["B"], r["T"])
                if g:
                    sp.append({"B": r["B"], "T": r["T"], "speedup": r["latency_us"] / g["latency_us"]})
        t["speedup_vs_fake_quant_T_ge_32k"] = sp
        if sp:
            t["target_10x_vs_fake_met"] = all(x["speedup"] >= 10 for x in sp)
        out[m] = t
    grows = {}
    for m in sorted({r["method"] for r in ok}):
        for B in sorted({r["B"] for r in ok}):
            seq = sorted((r["T"], r["latency_us"]) for r in ok if r["method"] == m and r["B"] == B)
            if len(seq) > 1:
                grows[f"{m} B={B}"] = all(b[1] > a[1] for a, b in zip(seq, seq[1:]))
    out["latency_grows_with_T"] = grows
    return out
