"""Issue 28's rules across head dims (suites/bench/latency/head_dims.py), read off synthetic
latency suite runs: which run stands for each head dim, the shares of the d 128 speed-up,
the rules each cell meets or misses, and the command's files and exit code."""
from __future__ import annotations

import json

from kvqbench.suites.bench.latency import head_dims as hd

SDPA = {64: 200.0, 128: 400.0, 256: 800.0}


def run(d, fused: dict, time="2026-12-07 10:00:00", gpu="GPU-A", b1=None):
    """A latency.json at head dim d: graphed SDPA rows at B=8 / 1 (B=1 a quarter of B=8's
    time), and per method (name without fused-) its (backend, B=8 us[, B=1 us])."""
    rows = [{"method": "fp16-sdpa-graph", "B": 8, "T": 32768, "latency_us": SDPA[d]},
            {"method": "fp16-sdpa-graph", "B": 1, "T": 32768, "latency_us": SDPA[d] / 4}]
    for m, (backend, us, *us1) in fused.items():
        rows.append({"method": f"fused-{m}-graph", "B": 8, "T": 32768, "latency_us": us, "backend": backend})
        rows.append({"method": f"fused-{m}-graph", "B": 1, "T": 32768, "latency_us": us1[0] if us1 else us / 4,
                     "backend": backend})
    return {"env": {"gpu": gpu, "time": time, "kvqbench": {"commit": "abc"}}, "shape": {"d": d},
            "method_specs": {f"fused-{m}": m for m in fused} | {"fused-fp16": "fp16"}, "latency": rows}


def write(root, name, lat):
    (root / name).mkdir(parents=True)
    (root / name / "latency.json").write_text(json.dumps(lat))


def test_the_shares_and_the_rules_per_cell(tmp_path):
    write(tmp_path, "d128", run(128, {"int4": ("cuda", 100.0), "hqmq": ("cuda", 160.0),
                                      "hqmq-med3": ("cuda", 200.0)}))
    # d 64: int4 at 0.95 of its d 128 share (met), hqmq 0.8 (missed), Med3x on Triton at a met
    # share (missed: the rule wants CUDA), its B=1 call too slow (1.2x: missed)
    write(tmp_path, "d64", run(64, {"int4": ("cuda", 200 / 3.8), "hqmq": ("cuda", 200 / 2.0),
                                    "hqmq-med3": ("triton", 200 / 2.0, 50 / 1.2)}))
    board = hd.scoreboard(hd.newest_runs(tmp_path, keep=hd.has_focus))
    f = board["formats"]
    assert set(f) == {"fused-int4", "fused-hqmq", "fused-hqmq-med3"}  # (fused-fp16 is the baseline's format)
    int4, hqmq, med3 = (f[m]["by_head_dim"] for m in ("fused-int4", "fused-hqmq", "fused-hqmq-med3"))
    assert abs(int4[64]["share_of_d128"] - 0.95) < 1e-9 and int4[64]["share_met"] is True
    assert abs(hqmq[64]["share_of_d128"] - 0.8) < 1e-9 and hqmq[64]["share_met"] is False
    assert med3[64]["share_met"] is False and med3[64]["b1_met"] is False
    # d 128: int4 400 / 100 = 4.0x meets its 2.7, HQMQ 400 / 160 = 2.5x its 2.4
    assert int4[128]["target_met"] is True and hqmq[128]["target_met"] is True
    # Med3x's time against HQMQ's: 200 / 160 = 1.25 > 1.15 at d 128; 1.0 at d 64
    assert abs(med3[128]["time_to_hqmq"] - 1.25) < 1e-9 and med3[128]["within_met"] is False
    assert med3[64]["within_met"] is True
    md = hd.markdown(board)
    assert "| hqmq | 2.00 (cuda) | 0.80 **no** |" in md and "| int4 | 3.80 (cuda) | 0.95 |" in md


def test_the_newest_run_with_the_focus_rows_stands_for_its_head_dim(tmp_path):
    write(tmp_path, "old", run(128, {"int4": ("cuda", 100.0)}, time="2026-12-01 00:00:00"))
    write(tmp_path, "new", run(128, {"int4": ("cuda", 80.0)}, time="2026-12-07 00:00:00"))
    smoke = run(128, {"int4": ("cuda", 1.0)}, time="2026-12-09 00:00:00")
    smoke["latency"] = [r for r in smoke["latency"] if r["B"] != 8]  # (no focus rows: a smoke run)
    write(tmp_path, "smoke", smoke)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "latency.json").write_text("{not json")
    runs = hd.newest_runs(tmp_path, keep=hd.has_focus)
    assert list(runs) == [128] and runs[128][0].parent.name == "new"
    assert hd.newest_runs(tmp_path)[128][0].parent.name == "smoke"  # (without the filter, the newest)


def test_the_command_writes_its_files_and_needs_a_d128_run(tmp_path, capsys):
    write(tmp_path, "d256", run(256, {"int4": ("cuda", 300.0)}, gpu="GPU-B"))
    assert hd.main(["--root", str(tmp_path)]) == 2
    assert "no latency suite run at head dim 128" in capsys.readouterr().err
    write(tmp_path, "d128", run(128, {"int4": ("cuda", 150.0)}))
    assert hd.main(["--root", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "head_dims.md").read_text()
    # 800 / 300 = 2.67 against 400 / 150 = 2.67: share 1.00, across two GPUs
    assert "| int4 | 2.67 (cuda) | >= 2.7 **no** |" in md and "1.00 (2 GPUs)" in md
    assert json.loads((tmp_path / "out" / "head_dims.json").read_text())["runs"]["256"]["gpu"] == "GPU-B"
    assert (tmp_path / "out" / "head_dims.png").stat().st_size > 0


def test_a_run_at_other_heads_is_not_a_column(tmp_path):
    """A latency run at another GQA group (`--heads 64 4`) is newer but not issue 28's shape:
    the d 128 column stays the Hq 32 / Hkv 8 run (a run that names no heads had those)."""
    write(tmp_path, "d128", run(128, {"int4": ("cuda", 150.0)}, time="2026-12-07 10:00:00"))
    gqa16 = run(128, {"int4": ("cuda", 90.0)}, time="2026-12-08 10:00:00")
    gqa16["shape"] |= {"Hq": 64, "Hkv": 4}
    write(tmp_path, "gqa16", gqa16)
    assert hd.main(["--root", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "head_dims.md").read_text()
    assert "d128/latency.json" in md and "gqa16" not in md
    assert hd.issue_shape({"shape": {"d": 128, "Hq": 32, "Hkv": 8}}) and not hd.issue_shape(gqa16)


def test_gpu_keeps_every_column_on_one_card(tmp_path, capsys):
    """--gpu: only runs on the named card stand for their head dims (issue 28's rules are the
    H200's), a newer run on another card is passed over, and no d 128 run on it exits 2."""
    write(tmp_path, "h200_d128", run(128, {"int4": ("cuda", 150.0)}, gpu="NVIDIA H200", time="2026-12-07 19:00:00"))
    write(tmp_path, "h100_d128", run(128, {"int4": ("cuda", 120.0)}, gpu="NVIDIA H100 80GB HBM3",
                                     time="2026-12-08 10:00:00"))
    assert hd.main(["--root", str(tmp_path), "--out", str(tmp_path / "a"), "--gpu", "H200"]) == 0
    assert "h200_d128" in (tmp_path / "a" / "head_dims.md").read_text()
    assert "on a GPU named *H200*" in (tmp_path / "a" / "head_dims.md").read_text()
    assert hd.main(["--root", str(tmp_path), "--out", str(tmp_path / "b")]) == 0  # (no filter: the newest)
    assert "h100_d128" in (tmp_path / "b" / "head_dims.md").read_text()
    assert hd.main(["--root", str(tmp_path), "--gpu", "B200"]) == 2
    assert "on a B200" in capsys.readouterr().err
