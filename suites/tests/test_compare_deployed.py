"""`kvqbench compare` with the deployed protocol and generation fidelity, and
`kvqbench generate`, on the tiny model (CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from kvqbench.suites.compare import cli
from kvqbench.suites.compare.run import UsageError, protocols_for
from kvqbench.suites.harness.tiny_model import make_tiny_model, tiny_compare_args, tiny_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {"model": str(make_tiny_model(d / "model")), "corpus": str(tiny_corpus(d / "text.txt"))}


def args(tiny, out, *extra, specs="fp16;int4;int2"):
    return tiny_compare_args(tiny, out, "--protocol", "quantize-on-write,deployed", "--context", "20",
                             "--decode-tokens", "8", *extra, specs=specs)


def test_deployed_rows_fidelity_and_report(tiny, tmp_path, capsys):
    assert cli.main(args(tiny, tmp_path)) == 0
    stages = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("time per stage: ")]
    assert len(stages) == 1 and all(k in stages[0] for k in ("load", "rows ", "fidelity ", "report "))
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    dep = {r["spec"]: r for r in data["results"] if r["protocol"] == "deployed"}
    assert set(dep) == {"fp16", "int4", "int2"}
    for r in dep.values():  # 2 windows x (8 - 1) decode-step predictions
        assert r["n_predicted"] == 2 * 7 and r["context"] == 20 and r["decode_steps"] == 7
    fid = data["fidelity"]
    assert len(fid["reference"]["tokens"]) == 2 and all(len(t) == 8 for t in fid["reference"]["tokens"])
    assert set(fid["rows"]) == {"fp16", "int4", "int2"}
    for f in fid["rows"].values():
        assert 0 <= f["first_diff_min"] <= f["first_diff_mean"] <= 8 and 0 <= f["match_rate"] <= 1
        assert f["wall_s"] > 0  # the fidelity pass's share of a run's time, per spec
    assert fid["reference_wall_s"] > 0
    assert data["meta"]["fidelity"] == {"prompt_tokens": 20, "new_tokens": 8}
    v = data["meta"]["versions"]  # the code that measured it: kvqbench's version and commit, each plugin's
    assert v["kvqbench"]["version"] and len(v["kvqbench"]["commit"] or "x" * 40) == 40
    assert v["plugins"]["int"] == {"distribution": "kvqbench", "version": v["kvqbench"]["version"]}
    report = (tmp_path / "r" / "report.md").read_text()
    assert "## deployed" in report and "## Generation fidelity (deployed)" in report
    assert "`deployed` is what a serving engine does" in report
    assert (tmp_path / "r" / "fidelity_vs_bits.png").stat().st_size > 0


def test_a_rerun_keeps_the_fidelity_it_measured(tiny, tmp_path, monkeypatch):
    assert cli.main(args(tiny, tmp_path)) == 0
    before = json.loads((tmp_path / "r" / "results.json").read_text())["fidelity"]
    import kvqbench.suites.harness.fidelity as F

    def boom(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(F, "fidelity", boom)
    monkeypatch.setattr(F, "reference_continuations", boom)
    assert cli.main(args(tiny, tmp_path)) == 0
    assert json.loads((tmp_path / "r" / "results.json").read_text())["fidelity"] == before


def test_a_failed_fidelity_row_is_recorded_and_the_run_goes_on(tiny, tmp_path, monkeypatch):
    """int2's twins are scored as its deployed row finishes; that fails, so the fidelity
    stage generates int2 on its own, fails again, and records it; the rows stand."""
    import kvqbench.suites.harness.fidelity as F

    real = F.score_continuations
    monkeypatch.setattr(F, "score_continuations", lambda m, p, t, ref, **k: (_ for _ in ()).throw(
        RuntimeError("boom")) if k["spec"] == "int2" else real(m, p, t, ref, **k))
    assert cli.main(args(tiny, tmp_path)) == 3  # partial: the report is written, a row failed
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    rows = data["fidelity"]["rows"]
    assert rows["int2"]["error"] == "RuntimeError: boom" and "error" not in rows["int4"]
    assert "FAILED fidelity `int2`" in (tmp_path / "r" / "report.md").read_text()
    assert all("error" not in r for r in data["results"])


def test_fidelity_rides_in_the_deployed_rows_where_it_can(tiny, tmp_path, monkeypatch, capsys):
    """Twin-able formats get their fidelity from their deployed rows' greedy twins, every
    seed of a stochastic one; the rest (Med3x's outlier list, fp8's scale over rows) from
    a generation of their own, as before; the report says which made each row."""
    import kvqbench.suites.harness.fidelity as F

    generated = []
    real = F.fidelity
    monkeypatch.setattr(F, "fidelity", lambda m, p, spec, ref, **k: generated.append(spec) or real(m, p, spec, ref, **k))
    specs = "fp16;int2;spherical3;fp8-e4m3;hqmq:S=8,r=3,outliers=med3"
    assert cli.main(args(tiny, tmp_path, "--seeds", "2", specs=specs)) == 0
    assert sorted(generated) == ["fp8-e4m3", "hqmq:S=8,r=3,outliers=med3"]
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    rows = data["fidelity"]["rows"]
    assert {s: f["source"] for s, f in rows.items()} == {
        "fp16": "deployed twins", "int2": "deployed twins", "spherical3": "deployed twins",
        "fp8-e4m3": "generate", "hqmq:S=8,r=3,outliers=med3": "generate"}
    assert sorted(rows["spherical3"]["by_seed"]) == ["0", "1"] and sorted(rows["int2"]["by_seed"]) == ["0"]
    assert rows["spherical3"]["by_seed"]["0"]["match_rate"] == rows["spherical3"]["match_rate"]
    dep = {(r["spec"], r["seed"]): r for r in data["results"] if r["protocol"] == "deployed"}
    assert dep[("spherical3", 1)]["continuation_rows"] == 2 and "continuation_rows" not in dep[("fp8-e4m3", 0)]
    assert all("continuations" not in r for r in data["results"])  # the tokens are scored, not kept
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| twins |" in report and "| generate |" in report


def test_protocol_choices_and_defaults():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert protocols_for(None, cpu) == ["quantize-on-write"]  # deployed's decode steps cost minutes on a CPU
    assert protocols_for(None, gpu) == ["quantize-on-write", "deployed"]
    assert protocols_for("both", cpu) == ["quantize-on-write", "prefill-then-decode"]
    assert protocols_for("all", cpu) == ["quantize-on-write", "prefill-then-decode", "deployed"]
    assert protocols_for("deployed", cpu) == ["deployed"]
    with pytest.raises(UsageError, match="--protocol 'deploy'"):
        protocols_for("deploy", cpu)


def test_bad_protocol_is_a_usage_error(tiny, tmp_path, capsys):
    assert cli.main(tiny_compare_args(tiny, tmp_path, "--protocol", "fast")) == 2
    assert "--protocol 'fast'" in capsys.readouterr().err


def test_generate_command(tiny, tmp_path, capsys):
    out = tmp_path / "g.json"
    assert cli.main(["generate", "--model", tiny["model"], "--spec", "int4", "--prompt", "the quick brown",
                     "--prompt", "a lazy dog", "--max-new-tokens", "6", "--device", "cpu", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["tokens"]) == 2 and all(len(t) <= 6 for t in res["tokens"]) and res["tokens_per_s"] > 0
    err = capsys.readouterr().err
    assert "tokens/s" in err and "steps: eager" in err
    # --repeat: each call timed; greedy, so the same tokens every call
    again = tmp_path / "g2.json"
    assert cli.main(["generate", "--model", tiny["model"], "--spec", "int4", "--prompt", "the quick brown",
                     "--max-new-tokens", "4", "--device", "cpu", "--repeat", "2", "--json", str(again)]) == 0
    two = json.loads(again.read_text())
    assert len(two["calls"]) == 2 and all(c["tokens_per_s"] > 0 for c in two["calls"])
    # the headline is the last call, timed whole (wall >= the engine's own prefill + steps)
    last = two["calls"][-1]
    assert two["tokens_per_s"] == last["tokens_per_s"] and two["wall_s"] == last["wall_s"]
    assert all(c["wall_s"] >= c["prefill_s"] + c["decode_s"] for c in two["calls"])
    cap = capsys.readouterr()
    assert "call 1 of 2" in cap.err and "call 2 of 2" in cap.err and cap.out.count("--- [0]") == 1  # texts once
    assert cli.main(["generate", "--model", tiny["model"], "--repeat", "0"]) == 2
    assert cli.main(["generate", "--model", tiny["model"], "--spec", "int9", "--device", "cpu"]) == 2
    assert cli.main(["generate", "--model", tiny["model"], "--max-new-tokens", "0"]) == 2
