"""The claim verdicts (suites/compare/claims.py, verdicts.py), each built from rows
where it must hold and rows where it must fail, so no verdict is unable to fail:
fronts compared front against front (a dominated baseline row never counts), paired
per-window differences, the paper's configuration or "not run", lm-eval verdicts or
"not measured", the graphed latency figure, the byte split of claim 7, the protocol
named on every verdict."""
from __future__ import annotations

import json

import pytest

from kvqbench.suites.compare import claims, verdicts

pytestmark = pytest.mark.usefixtures("one_thread")

P = "quantize-on-write"


def _row(spec, family, bits, ppl, lo=None, hi=None, n=1):
    return {"spec": spec, "family": family, "bits": bits, "formula_bits": bits, "ppl": ppl,
            "ppl_min": lo if lo is not None else ppl, "ppl_max": hi if hi is not None else ppl, "n": n}


def _hq(ppl3, ppl5, spread=1.0, suffix=""):
    """A plain HQMQ front of two vertices, 3.0 and 5.0 bits."""
    return [_row(f"hqmq:S=24,r=3{suffix}", "hqmq", 3.0, ppl3, ppl3 - spread, ppl3 + spread, 3),
            _row(f"hqmq:S=256,r=5{suffix}", "hqmq", 5.0, ppl5, ppl5 - spread, ppl5 + spread, 3)]


# ---- front against front ------------------------------------------------------------------------
def test_compare_fronts_wins_loses_and_spread_at_the_vertices_of_the_overlap():
    hq = verdicts.pareto_rows(_hq(50, 40))
    base = verdicts.pareto_rows([_row("b3", "x", 3.5, 60), _row("b4", "x", 4.5, 50), _row("b9", "x", 9.0, 30)])
    c = verdicts.compare_fronts(base, hq)
    assert c["overlap"] == (3.5, 5.0)  # never extrapolated past either front
    assert [p["bits"] for p in c["points"]] == [3.5, 4.5, 5.0]  # baseline vertices 3.5, 4.5; HQMQ's 5.0
    assert "HQMQ `hqmq:S=256,r=5`" in c["points"][2]["vertex"]
    assert [p["order"] for p in c["points"]] == ["<", "<", "<"]
    assert c["points"][2]["base"]["ppl"] == pytest.approx(50 * 0.6 ** (0.5 / 4.5))  # log-PPL interpolation
    loses = verdicts.compare_fronts(verdicts.pareto_rows([_row("b", "x", 4.0, 30)]), hq)
    assert [p["order"] for p in loses["points"]] == [">"]
    near = verdicts.compare_fronts(verdicts.pareto_rows([_row("b", "x", 4.0, 44.9)]), hq)
    assert [p["order"] for p in near["points"]] == ["~"]  # HQMQ 44.72 (43.7-45.7): the bands overlap
    assert verdicts.compare_fronts(verdicts.pareto_rows([_row("b", "x", 8.0, 30)]), hq)["points"] == []


def test_claim_6_is_front_against_front_and_a_dominated_row_does_not_count():
    # spherical4-qjl is dominated by spherical3 (fewer bits, lower PPL): HQMQ beats it, but
    # it is not on the family's front, so it must not turn the verdict.
    sph = [_row("spherical3", "spherical", 3.5, 40), _row("spherical4", "spherical", 4.5, 35),
           _row("spherical4-qjl", "spherical", 4.0, 80)]
    c = claims.claim_matched_bits(_hq(45, 40) + sph, P)
    assert c[3].startswith("does not hold") and "[quantize-on-write rows]" in c[3]
    assert "not compared (off the spherical front): spherical4-qjl" in c[2]
    md = "\n".join(claims.hqmq_standing(_hq(45, 40) + sph))
    assert "| HQMQ wins |" not in md and "spherical4-qjl" in md.split("Off their family's front")[1]
    # the same front with HQMQ below it everywhere: holds
    assert claims.claim_matched_bits(_hq(30, 25) + sph, P)[3].startswith("holds")


def test_claim_6_uses_the_plain_front_not_med3_nor_fill():
    sph = [_row("spherical3", "spherical", 3.5, 40), _row("spherical4", "spherical", 4.5, 35)]
    strong = [_row("hqmq:S=96,r=4,outliers=med3", "hqmq", 4.0, 20, 19, 21, 3),
              _row("hqmq:S=96,r=4,fill=true", "hqmq", 4.0, 20, 19, 21, 3)]
    c = claims.claim_matched_bits(_hq(45, 40) + sph + strong, P)
    assert c[3].startswith("does not hold") and "HQMQ + Med3x (no fill) front (no verdict)" in c[2]
    assert claims.claim_matched_bits(strong + sph, P)[3].startswith(claims.NOT_RUN)  # no plain front


def test_claim_6_in_part_unresolved_and_not_run():
    hq = _hq(50, 40)
    mixed = hq + [_row("spherical3", "spherical", 3.5, 60), _row("avq3", "avq", 4.5, 30)]
    assert claims.claim_matched_bits(mixed, P)[3].startswith("holds in part")
    close = hq + [_row("spherical4", "spherical", 4.0, 44.9)]
    assert claims.claim_matched_bits(close, P)[3].startswith("not resolved")
    far = hq + [_row("spherical8", "spherical", 8.0, 10)]
    assert claims.claim_matched_bits(far, P)[3].startswith(claims.NOT_RUN)


def test_fronts_without_common_bits_judged_by_dominance_only():
    """No bits in common: a cheaper front's best vertex beating the costlier front's
    vertices (seed bands apart) is a verdict; a cheaper front that is not lower is none."""
    hq = verdicts.pareto_rows(_hq(50, 40))  # 3.0 and 5.0 bits, bands +-1
    cheap_good = verdicts.pareto_rows([_row("avq2-cal", "avq", 2.25, 60), _row("avq3-cal", "avq", 2.75, 45)])
    d = verdicts.dominance(cheap_good, hq)  # 45 at 2.75 b beats HQMQ's 50 at 3 b, not its 40 at 5 b
    assert [(p["bits"], p["order"]) for p in d] == [(3.0, ">")] and "`avq3-cal` (2.750 b)" in d[0]["vertex"]
    c = claims.claim_matched_bits(_hq(50, 40) + [_row("avq3-cal", "avq", 2.75, 45)], P)
    assert c[3].startswith("does not hold") and "beaten with fewer bits by `avq3-cal`" in c[2]
    md = "\n".join(claims.hqmq_standing(_hq(50, 40) + [_row("avq3-cal", "avq", 2.75, 45)]))
    assert "avq (2.75-2.75 b, no bits in common): 1 of HQMQ's vertices beaten with fewer bits (HQMQ loses)" in md
    assert "| avq | plain | 3.000 | HQMQ `hqmq:S=24,r=3`, beaten with fewer bits" in md
    # the other way: HQMQ cheaper and lower than a costly baseline
    costly = verdicts.pareto_rows([_row("int8", "int", 8.0, 45), _row("fp8", "int", 9.0, 39.5)])
    assert [(p["bits"], p["order"]) for p in verdicts.dominance(costly, hq)] == [(8.0, "<")]
    assert claims.claim_matched_bits(_hq(50, 40) + [_row("spherical8", "spherical", 8.0, 45)], P)[3].startswith(
        "holds")
    # a cheaper front that is not lower, or bands that touch: no verdict, as before
    assert verdicts.dominance(verdicts.pareto_rows([_row("a", "avq", 2.5, 55)]), hq) == []
    assert verdicts.dominance(verdicts.pareto_rows([_row("a", "avq", 2.5, 49.5, 48, 51)]), hq) == []


def test_hqmq_standing_front_against_front_for_both_hqmq_fronts_and_fill():
    rows = (_hq(50, 40) + _hq(48, 39, suffix=",outliers=med3")
            + [_row("fp16", "fp16", 16, 30), _row("int3", "int", 3.5, 60), _row("int4", "int", 4.5, 52),
               _row("int4:keys=per-channel", "int", 4.5, 51), _row("kivi:bits=4", "kivi", 4.0, 30),
               _row("fp8-e4m3", "fp8", 8.0, 30.5)])
    md = "\n".join(claims.hqmq_standing(rows))
    assert "| int | plain | 3.500 | baseline `int3` |" in md and "| int | med3 | 3.500 |" in md
    assert "int (3.50-4.50 b): HQMQ wins at all 2 point(s)" in md
    assert "kivi (4.00-4.00 b): HQMQ loses at all 1 point(s)" in md
    assert "No bits in common (not compared): fp8 (8.00-8.00 b)" in md and "| fp16 |" not in md
    assert "`int4`" in md.split("Off their family's front")[1]  # dominated by int4:keys=per-channel
    fill = [_row("hqmq:S=96,r=4,fill=true", "hqmq", 4.0, 30, 29, 31, 3)]
    assert "moves the front down" in "\n".join(claims.hqmq_standing(rows + fill))
    fill = [_row("hqmq:S=96,r=4,fill=true", "hqmq", 4.0, 44.7, 44, 45.5, 3)]
    assert "does not move the front" in "\n".join(claims.hqmq_standing(rows + fill))
    assert claims.hqmq_standing([_row("int4", "int", 4.0, 60)]) == []


# ---- paired per-window differences --------------------------------------------------------------
def _rec(spec, seed, window_nll, family="hqmq", bits=4.0, tokens=100, **kw):
    return {"protocol": P, "spec": spec, "seed": seed, "family": family, "bits_per_element": bits,
            "n_windows": len(window_nll), "n_predicted": tokens * len(window_nll), "window_nll": window_nll,
            "nll_sum": sum(window_nll), **kw}


def test_paired_difference_over_windows_and_seeds():
    base = [300.0, 350.0, 280.0, 410.0, 330.0, 290.0]
    fp16 = _rec("fp16", 0, base, family="fp16", bits=16)
    worse = [_rec("hqmq:S=96,r=4", s, [x + 5 + 0.3 * ((i + s) % 3) for i, x in enumerate(base)]) for s in range(3)]
    p = verdicts.paired([fp16] + worse, "hqmq:S=96,r=4", "fp16")
    assert p["apart"] and p["lo"] > 0 and p["n_windows"] == 6 and p["n_pairs"] == 3
    assert p["mean"] == pytest.approx(0.053, abs=2e-3)  # ~5.3 NLL over 100 tokens per window
    assert "higher" in verdicts.paired_text(p, "hqmq:S=96,r=4", "fp16")
    noisy = [_rec("hqmq:S=96,r=4", 0, [x + (20 if i % 2 else -20) for i, x in enumerate(base)])]
    q = verdicts.paired([fp16] + noisy, "hqmq:S=96,r=4", "fp16")
    assert not q["apart"] and "no difference resolved" in verdicts.paired_text(q, "a", "b")
    old = [dict(fp16), _rec("hqmq:S=96,r=4", 0, base)]
    del old[0]["window_nll"]
    assert "not paired" in verdicts.paired(old, "hqmq:S=96,r=4", "fp16")
    assert verdicts.paired([fp16], "hqmq:S=96,r=4", "fp16") is None
    short = [fp16, _rec("hqmq:S=96,r=4", 0, base[:5])]
    assert "same windows" in verdicts.paired(short, "hqmq:S=96,r=4", "fp16")


# ---- claims 2 and 5: the paper's configuration, lm-eval ------------------------------------------
def _lm(scores):
    return {"requested": ["t", None, None], "scores": scores}


def test_claim_2_at_the_paper_configuration_or_not_run():
    near = [_rec("fp16", 0, [1.0], family="fp16", bits=16, lm_eval=_lm({"piqa": {"acc": 0.7, "acc_stderr": 0.01}})),
            _rec("hqmq:S=96,r=4,outliers=med3", 0, [1.0], bits=3.79,
                 lm_eval=_lm({"piqa": {"acc": 0.7, "acc_stderr": 0.01}}))]
    c = claims.claim_zero_shot(near, P)  # 3.79 bits exactly, but not the paper's configuration
    assert c[3].startswith(claims.NOT_RUN) and "hqmq:S=96,r=4 (the paper's configuration) was not run" in c[3]
    recs = [near[0], _rec("hqmq:S=96,r=4", 0, [1.1], lm_eval=_lm({"piqa": {"acc": 0.69, "acc_stderr": 0.01}}))]
    c = claims.claim_zero_shot(recs, P)
    assert c[3].startswith("holds") and "piqa acc: 0.69 vs fp16 0.7" in c[2] and "lm-eval loglikelihood" in c[3]
    assert "not the paper's piqa, hellaswag, arc_easy: a proxy" in c[3]
    recs[1]["lm_eval"] = _lm({"piqa": {"acc": 0.60, "acc_stderr": 0.01}})
    assert claims.claim_zero_shot(recs, P)[3].startswith("does not hold")
    recs[1].pop("lm_eval")
    c = claims.claim_zero_shot(recs, P)
    assert c[3].startswith(claims.NOT_RUN) and "hqmq:S=96,r=4 - fp16, paired over 1 windows" in c[2]
    # a generation task is claim 5's, not a zero-shot score
    gen = {"kvqbench_passkey": {"exact_match": 0.1, "exact_match_stderr": 0.01}}
    recs[0]["lm_eval"], recs[1]["lm_eval"] = _lm(gen), _lm({"kvqbench_passkey": {"exact_match": 0.9,
                                                                                "exact_match_stderr": 0.01}})
    assert claims.claim_zero_shot(recs, P)[3].startswith(claims.NOT_RUN)


def _kivi_recs(hq_score, kivi_score, se):
    task = lambda v: _lm({"kvqbench_passkey": {"exact_match": v, "exact_match_stderr": se}})  # noqa: E731
    return [_rec("kivi:bits=4", 0, [300.0, 320.0], family="kivi", bits=4.5, lm_eval=task(kivi_score)),
            _rec("hqmq:S=96,r=4", 0, [301.0, 321.0], bits=3.8, lm_eval=task(hq_score))]


def test_claim_5_measured_on_generation_tasks_can_hold_and_fail():
    c = claims.claim_kivi(_kivi_recs(0.80, 0.80, 0.001), P)
    assert c[3].startswith("holds on the offline proxy only") and "deployed engine" in c[3]
    assert "PPL, not the claim's measure [quantize-on-write rows]: hqmq:S=96,r=4 - kivi:bits=4" in c[2]
    assert claims.claim_kivi(_kivi_recs(0.60, 0.80, 0.001), P)[3].startswith("does not hold")
    assert claims.claim_kivi(_kivi_recs(0.78, 0.80, 0.05), P)[3].startswith("not resolved")
    gsm = _kivi_recs(0.5, 0.5, 0.001)
    for r, v in zip(gsm, (0.40, 0.39)):
        r["lm_eval"]["scores"]["gsm8k"] = {"exact_match,strict-match": v, "exact_match_stderr,strict-match": 0.001}
    c = claims.claim_kivi(gsm, P)  # 1 point deficit, within the paper's 2.3
    assert c[3].startswith("holds [") and "deficit +0.01 +- 0.0028 (2 se), tolerance 0.023 (the paper's)" in c[2]
    assert "exact_match_stderr" not in c[2]  # a standard error is never judged as a metric
    gsm[1]["lm_eval"]["scores"]["gsm8k"]["exact_match,strict-match"] = 0.35  # 4 points down
    assert claims.claim_kivi(gsm, P)[3].startswith("does not hold")


def test_claim_5_not_measured_without_a_verdict():
    recs = _kivi_recs(0.8, 0.8, 0.01)
    for r in recs:
        r.pop("lm_eval")
    c = claims.claim_kivi(recs, P)
    assert c[3].startswith(claims.NOT_RUN) and "holds" not in c[3] and "the PPL above gives no verdict" in c[3]
    rolling = _kivi_recs(0.8, 0.8, 0.01)
    for r in rolling:
        r["lm_eval"] = _lm({"kvqbench_rolling": {"word_perplexity": 30.0}})
    assert claims.claim_kivi(rolling, P)[3].startswith(claims.NOT_RUN)
    assert "not run" in claims.claim_kivi(recs[:1], P)[3]  # no hqmq:S=96,r=4


# ---- claims 7, 8, 10, 4 ---------------------------------------------------------------------------
META = {"model": {"name": "m", "head_dim": 64, "n_kv_heads": 1}, "windows": {"tokens": 8, "per_protocol": {P: 8}}}


def test_claim_7_explains_the_bits_from_the_fields():
    bad = claims.claim_compression([_row("hqmq:S=24,r=3", "hqmq", 3.5, 50)], META, P)
    assert bad[3].startswith("does not hold: whole-bit code packing 2.500 b vs log2(24 S)/4 = 2.292")
    assert "r_max 16/head_dim = 0.250 b at head_dim 64" in bad[3]
    assert "codes 2.500, radius 0.750, r_max 0.250 = 3.500 b" in bad[2] and "synthetic" in bad[2]
    assert "Llama-3-70B at 128k 42.9 GB fp16 -> 9.1 GB" in bad[2]
    good = claims.claim_compression([_row("hqmq:S=24,r=3", "hqmq", 3.1, 50)], META, P)
    assert good[3].startswith("holds")
    none = claims.claim_compression([_row("hqmq:S=24,r=3,outliers=med3", "hqmq", 3.2, 50)], META, P)
    assert none[3].startswith(claims.NOT_RUN)


def _latency(tmp_path, rows):
    run = tmp_path / "reports" / "run"
    run.mkdir(parents=True, exist_ok=True)
    (tmp_path / "reports" / "latency").mkdir(exist_ok=True)
    claims.latency_file(run).write_text(json.dumps({"env": {"gpu": "G"}, "latency": rows}))
    return run


def test_claim_8_judges_the_graphed_figure_only(tmp_path):
    run = tmp_path / "reports" / "run"
    run.mkdir(parents=True)
    assert claims.claim_latency(run)[3].startswith(claims.NOT_RUN)
    eager_fast = [{"method": "fused-hqmq", "B": 1, "T": t, "latency_us": 10.0} for t in (4096, 65536)]
    c = claims.claim_latency(_latency(tmp_path, eager_fast))
    assert c[3].startswith(claims.NOT_RUN) and "eager rows only" in c[3]
    slow_graph = eager_fast + [{"method": "fused-hqmq-graph", "B": 1, "T": 4096, "latency_us": 18.0},
                               {"method": "fused-hqmq-graph", "B": 1, "T": 65536, "latency_us": 84.0},
                               {"method": "fake-quant", "B": 1, "T": 4096, "latency_us": 600.0}]
    c = claims.claim_latency(_latency(tmp_path, slow_graph))  # the faster eager row does not rescue it
    assert c[3].startswith("does not hold: above it at T=65536") and "tolerance: up to 35 us" in c[3]
    assert "T=4096: 18.0 us" in c[2] and "33.3-33.3x over eager fake-quant (not judged" in c[2]
    slow_graph[3]["latency_us"] = 34.0
    assert claims.claim_latency(_latency(tmp_path, slow_graph))[3].startswith("holds at every context")


def test_claims_name_their_protocol_and_the_unmeasurable_ones_give_no_verdict(tmp_path):
    rows = _hq(50, 40) + [_row("fp16", "fp16", 16, 30), _row("spherical4", "spherical", 4.0, 60)]
    recs = [{"protocol": "deployed", "spec": r["spec"], "seed": 0} for r in rows]
    out = {c[0][:2]: c for c in claims.claims(rows, recs, {"model": {"name": "m"}}, tmp_path / "run")}
    for k in ("1.", "6.", "7.", "9."):
        assert "[deployed rows]" in out[k][3], out[k]
    assert out["4."][3].startswith(claims.NOT_RUN) and "not available offline" in out["4."][3]
    assert out["10"][3].startswith("holds [a property of the codebook, not of this run")
    for k in ("2.", "5.", "8."):  # no lm-eval scores, no latency report
        assert out[k][3].startswith(claims.NOT_RUN), out[k]


def test_claims_1_3_9_hold_and_fail():
    fp16 = _row("fp16", "fp16", 16, 10.0)
    tight = _row("hqmq:S=256,r=5", "hqmq", 5.0, 10.01, 10.005, 10.02, 3)
    assert claims.claim_5bits([fp16, tight], "m", fp16, P)[3].startswith("holds")
    loose = _row("hqmq:S=256,r=5", "hqmq", 5.0, 10.02, 10.0, 10.05, 3)
    assert claims.claim_5bits([fp16, loose], "m", fp16, P)[3].startswith("holds for some seeds only")
    far = _row("hqmq:S=256,r=5", "hqmq", 5.0, 10.2, 10.1, 10.3, 3)
    assert claims.claim_5bits([fp16, far], "m", fp16, P)[3].startswith("does not hold")
    assert claims.claim_seed_spread([loose], P)[3].startswith("does not hold")
    assert claims.claim_seed_spread([_row("hqmq:x", "hqmq", 5, 10.0, 9.999, 10.001, 3)], P)[3].startswith("holds")
    assert claims.claim_seed_spread([fp16], P)[3].startswith(claims.NOT_RUN)
    i4, hm = _row("int4", "int", 4.5, 1000.0), _row("hqmq:S=256,r=5,outliers=med3", "hqmq", 5.0, 11.0, 10.9, 11.1, 3)
    rows = [fp16, i4, hm]
    assert claims.claim_outliers(rows, "qwen", {r["spec"]: r for r in rows}, P)[3].startswith("holds")
    i4 = _row("int4", "int", 4.5, 12.0)
    rows = [fp16, i4, hm]
    assert claims.claim_outliers(rows, "qwen", {r["spec"]: r for r in rows}, P)[3].startswith("does not hold")


def test_claim_10_can_fail(monkeypatch):
    from kvqbench.quantizers import quaternion

    assert claims.claim_structure()[3].startswith("holds")
    monkeypatch.setattr(quaternion, "group_closure_table", lambda: -quaternion.torch.ones(24, 24))
    assert claims.claim_structure.__wrapped__()[3].startswith("does not hold")


def test_distributed_combine_keeps_the_window_nll_in_window_order():
    from kvqbench.suites.compare import distributed as D

    def part(w):
        return {"protocol": P, "spec": "int4", "seed": 0, "nll_sum": sum(w), "n_predicted": 10 * len(w),
                "n_windows": len(w), "cache_nbytes": 8, "total_nbytes": 8, "constant_nbytes": 0,
                "cache_elements": 16, "wall_s": 1.0, "window_nll": w}

    out = D.combine((P, "int4", 0), [(1, part([3.0])), (0, part([1.0, 2.0]))])
    assert out["window_nll"] == [1.0, 2.0, 3.0] and out["nll_sum"] == 6.0
