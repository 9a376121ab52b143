"""The generate benchmark's plumbing on the tiny CPU shape (`--smoke`): rows written, and
`--profile` finds generate's prefill range and writes its tables."""
import json
import sys

import torch

from kvqbench.suites.bench.generate.__main__ import main


def test_smoke_rows_and_profile(tmp_path):
    assert main(["--smoke", "--specs", "int4", "--baselines", "hf-dynamic", "--profile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert [(r["row"], r["batch"]) for r in rows] == [("hf-dynamic", 1), ("kvqbench:int4", 1),
                                                      ("hf-dynamic", 2), ("kvqbench:int4", 2)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "generate.md").is_file() and (tmp_path / "generate.png").stat().st_size > 0
    profiles = sorted(p.name for p in tmp_path.glob("profile_*.txt"))
    assert profiles == ["profile_kvqbench_int4_b1.txt", "profile_kvqbench_int4_b2.txt"]  # none for hf-* rows
    text = (tmp_path / profiles[1]).read_text()
    assert "## prefill (1 range(s))" in text and "## whole call" in text and "## Python by function" in text
    prefill_events = int(text.split("## prefill (1 range(s)): ")[1].split(" events")[0])
    assert prefill_events > 0  # the range was found and holds the prefill's operators


def test_the_figure_is_the_fastest_warm_run(monkeypatch):
    """A row's figure is its fastest run after the first (a one-off stall in one warm run,
    or the first run's compiles, never becomes it), and its time split is that run's."""
    bench = sys.modules[main.__module__]  # the benchmark's module (its _walled is patched)

    walls = iter([9.0, 4.0, 2.0, 3.0])  # the first run compiles; run 2 is the fastest
    real = bench._walled

    def fake(fn, cuda):
        _, out = real(fn, cuda)
        return next(walls), out

    monkeypatch.setattr(bench, "_walled", fake)
    model = bench.build_model("tiny", dtype=torch.float32, device="cpu", max_positions=32)
    row = bench.measure_row(model, "kvqbench:int4", 1, 8, 4, runs=4)
    assert row["seconds"] == [9.0, 4.0, 2.0, 3.0] and row["figure_run"] == 2
    assert row["tokens_per_s"] == 4 / 2.0 and abs(row["other_s"] - (2.0 - row["prefill_s"] - row["decode_s"])) < 1e-12


def test_render_redraws_a_saved_run_without_measuring(tmp_path, monkeypatch):
    """--render writes RUN.md and RUN.png from RUN.json alone (a cut or older run), with the
    ratio to transformers' compiled path on the table; no model is built."""
    bench = sys.modules[main.__module__]
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    rows = [dict(row="hf-static-compile", batch=8, tokens_per_s=2000.0, decode_tokens_per_s=None, mode="static",
                 why=None),
            dict(row="kvqbench+compile:int4", batch=8, tokens_per_s=3000.0, decode_tokens_per_s=4000.0,
                 mode="graph", why=None, prefill_s=0.01, decode_s=0.3, other_s=0.02),
            dict(row="kvqbench+compile:hqmq:S=96,r=4", batch=8, error="RuntimeError: boom")]
    run = tmp_path / "gen_x.json"
    run.write_text(json.dumps(dict(shape="smollm2-135m", dtype="float16", prompt=512, new=128, runs=3, ragged=0,
                                   device="cuda", environment={"gpu": "H100"}, rows=rows)))
    assert main(["--render", str(run)]) == 0
    md = (tmp_path / "gen_x.md").read_text()
    assert "| kvqbench+compile:int4 | 3000.0 | - | 1.50 |" in md and "FAILED: RuntimeError: boom" in md
    assert (tmp_path / "gen_x.png").stat().st_size > 0


def test_engine_rows_pass_their_mode_to_generate(monkeypatch):
    """`kvqbench:` rows leave graph and compile to generate's defaults, `kvqbench+compile:`
    compiles, `kvqbench-eager:` (--eager) asks for eager steps (graph=False)."""
    bench = sys.modules[main.__module__]
    seen = []
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    model = bench.build_model("tiny", dtype=torch.float32, device="cpu", max_positions=32)
    for name in ("kvqbench:int4", "kvqbench-eager:int4"):
        row = bench.measure_row(model, name, 1, 8, 4, runs=1)
        assert row["tokens_per_s"] > 0 and row["mode"] == "eager"  # (no CUDA here: eager either way)
    assert [{k: v for k, v in kw.items() if k in ("graph", "compile")} for kw in seen] == [{}, {"graph": False}]
    assert bench.ENGINES["kvqbench+compile"] == {"compile": True}
