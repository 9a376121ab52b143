"""`kvqbench compare` under torchrun (suites/compare/distributed.py): who scores what,
how the figures are put back together, and, with two gloo ranks on the CPU, the same
results.json figures as one process, resumed across a changed world size.

The exactness argument: each rank scores the very window batches one process scores
(same shapes, same code), and rank 0 adds their float64 NLL sums in batch order, as the
single-process loop does; so figures agree to the last bit unless a kernel's rounding
depends on the thread count (torchrun sets OMP_NUM_THREADS=1). The bound asserted is
the brief's 1e-9 relative; on this machine they are bit-identical.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from unittest import mock

import pytest

from kvqbench.quantizers import parse_spec
from kvqbench.suites.compare import cli
from kvqbench.suites.compare import distributed as D
from kvqbench.suites.harness.perplexity import rows_independent

pytestmark = pytest.mark.usefixtures("one_thread")

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


# --- ranks from torchrun's environment -------------------------------------------------

def test_launched_only_with_torchruns_variables():
    assert D.launched(TORCHRUN_ENV)
    assert not D.launched({})
    assert not D.launched({"RANK": "0", "WORLD_SIZE": "1"})  # no LOCAL_RANK: not torchrun


def test_cpu_ranks_use_gloo_and_gpu_ranks_nccl_on_their_local_gpu():
    cpu = D.plan_ranks("cpu", environ=TORCHRUN_ENV)
    assert (cpu.backend, cpu.device, cpu.rank, cpu.world_size, cpu.is_main) == ("gloo", "cpu", 1, 4, False)
    gpu = D.plan_ranks("cuda", environ=TORCHRUN_ENV, cuda_count=2)
    assert (gpu.backend, gpu.device) == ("nccl", "cuda:1")
    spread = D.plan_ranks("cuda", "auto", environ={**TORCHRUN_ENV, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
                          cuda_count=8)
    assert (spread.backend, spread.device) == ("nccl", "cuda:0")
    # more ranks than GPUs share them round-robin, over gloo (NCCL refuses two ranks on a GPU)
    shared = [D.plan_ranks("cuda", environ={"RANK": str(r), "WORLD_SIZE": "5", "LOCAL_RANK": str(r),
                                            "LOCAL_WORLD_SIZE": "5"}, cuda_count=2) for r in range(5)]
    assert [(x.backend, x.device) for x in shared] == [("gloo", f"cuda:{r % 2}") for r in range(5)]


@pytest.mark.parametrize("device,device_map,env,count,message", [
    ("cuda", None, {}, 0, "no GPU is visible"),
    ("cuda:1", None, {}, 2, "takes the GPU of its LOCAL_RANK"),
    ("cuda", "auto", {}, 8, "one rank per node"),
    ("cpu", "auto", {}, 0, "this run is on the CPU"),
    ("cpu", None, {"RANK": "4"}, 0, "inconsistent torchrun variables"),
    ("cpu", None, {"WORLD_SIZE": "two"}, 0, "WORLD_SIZE='two' is not an integer"),
])
def test_setups_that_cannot_work_are_refused_with_the_reason(device, device_map, env, count, message):
    with pytest.raises(D.DistributedSetupError, match=message):
        D.plan_ranks(device, device_map, environ={**TORCHRUN_ENV, **env}, cuda_count=count)


def test_weights_are_sized_from_the_safetensors_headers(tiny):
    import torch

    from kvqbench.suites.harness.models import load_model

    model, _, _ = load_model(tiny["model"], device="cpu")
    n = sum(p.numel() for p in model.parameters())
    assert D.weights_bytes(tiny["model"], torch.float32) == 4 * n
    assert D.weights_bytes(tiny["model"], torch.bfloat16) == 2 * n


def test_device_map_is_for_gpus(tiny, tmp_path, capsys):
    import torch

    assert D.choose_device_map(None, tiny["model"], torch.float32, "cpu") is None
    assert D.choose_device_map("none", tiny["model"], torch.float32, "cpu") is None
    with pytest.raises(D.DistributedSetupError, match="over GPUs; this run is on cpu"):
        D.choose_device_map("auto", tiny["model"], torch.float32, "cpu")
    assert cli.main(compare_args(tiny, tmp_path) + ["--device-map", "auto"]) == 2
    assert "--device-map auto spreads a model over GPUs" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_xdist_workers_are_pinned_one_gpu_each():
    env = {"PYTEST_XDIST_WORKER": "gw5"}
    assert D.pin_xdist_worker_gpu(env, gpus=4) == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    env = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "4,6"}  # a runner's own choice is kept
    assert D.pin_xdist_worker_gpu(env) == "6" and env["CUDA_VISIBLE_DEVICES"] == "6"
    for env in ({}, {"PYTEST_XDIST_WORKER": "master"}, {"PYTEST_XDIST_WORKER": "gw0"}):
        gpus = 0 if env else 2
        assert D.pin_xdist_worker_gpu(env, gpus=gpus) is None and "CUDA_VISIBLE_DEVICES" not in env


# --- units, rounds, assignment ---------------------------------------------------------

def test_workers_relaunch_the_same_command_line():
    assert D.worker_argv(["--debug", "compare", "--workers", "4", "--run", "x", "--specs", "fp16;int4"]) == [
        "--debug", "compare", "--run-name", "x", "--specs", "fp16;int4"]
    assert D.worker_argv(["compare", "--workers=2", "--run=y", "--run-name", "z"]) == [
        "compare", "--run-name=y", "--run-name", "z"]


def test_workers_exit_status_is_the_single_process_one(tmp_path, monkeypatch):
    """torchrun exits 1 when any rank failed; a report this launch wrote with failed rows
    in it is the single process's exit 3 (partial), anything else stays 1."""
    import argparse
    import time as time_mod

    from kvqbench.suites.compare import run as R

    args = argparse.Namespace(workers=2, argv=["compare", "--workers", "2"], out=str(tmp_path))
    plan = {"device": "cpu", "run": "r"}
    rc = [0]
    monkeypatch.setattr(subprocess, "run", lambda cmd, env: argparse.Namespace(returncode=rc[0]))
    assert R.launch_workers(args, plan) == 0
    rc[0] = 1
    assert R.launch_workers(args, plan) == 1  # no report at all
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"results": [{"spec": "int4"}, {"spec": "x", "error": "boom"}]}))
    (folder / "report.md").write_text("old")
    old = time_mod.time() - 3600
    os.utime(folder / "report.md", (old, old))
    assert R.launch_workers(args, plan) == 1  # a report from before this launch
    def ranks_failing_after_the_report(cmd, env):
        (folder / "report.md").write_text("new")
        return argparse.Namespace(returncode=1)
    monkeypatch.setattr(subprocess, "run", ranks_failing_after_the_report)
    assert R.launch_workers(args, plan) == R.EXIT_PARTIAL


def test_units_are_the_single_process_batches():
    units = D.units_of(("quantize-on-write", "int4", 0), n_windows=7, rows=3)
    assert [(u.batch, u.start, u.stop, u.rows) for u in units] == [(0, 0, 3, 3), (1, 3, 6, 3), (2, 6, 7, 3)]
    with pytest.raises(ValueError, match="rows >= 1"):
        D.units_of(("p", "s", 0), n_windows=4, rows=0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_unit_is_scored_once_and_rounds_hold_whole_configurations(world_size):
    jobs = [("quantize-on-write", f"spec{i}", i % 2) for i in range(7)]
    by_job = {job: D.units_of(job, n_windows=5, rows=1 + i % 3) for i, job in enumerate(jobs)}
    rounds = D.plan_rounds(jobs, by_job, world_size, per_rank=2)
    flat = [u for r in rounds for u in r]
    assert flat == [u for job in jobs for u in by_job[job]]  # grid order, nothing lost or repeated
    for r in rounds[:-1]:
        assert len(r) >= 2 * world_size
    for r in rounds:  # a configuration never straddles two rounds
        for job in {u.job for u in r}:
            assert sum(u.job == job for u in r) == len(by_job[job])
        dealt = [u for rank in range(world_size) for u in D.mine(r, rank, world_size)]
        assert sorted(dealt, key=flat.index) == r


# --- exact reduction -------------------------------------------------------------------

def _record(nll, n_pred=10, nbytes=100, numel=50, constant=3):
    # cache bytes, constants (3 bytes of one model) and the total charging them to each of 2 windows
    return {"protocol": "quantize-on-write", "spec": "int4", "seed": 0, "n_windows": 2, "window": 32,
            "nll_sum": nll, "n_predicted": n_pred, "ppl": float("nan"), "bits_per_element": 0.0,
            "cache_bits_per_element": 0.0, "cache_nbytes": nbytes, "constant_nbytes": constant,
            "total_nbytes": nbytes + 2 * constant, "cache_elements": numel, "batch_size": 2, "wall_s": 0.5}


def test_combine_adds_in_batch_order_whatever_order_the_parts_arrive():
    # Float addition is not associative: these sums differ by order, so only a fixed
    # order (the single process's: batch 0, 1, 2, ...) gives the same last bit.
    nlls = [1e16, 1.0, -1e16, 3.0, 0.1]
    parts = [(b, _record(x, nbytes=100 + b)) for b, x in enumerate(nlls)]
    sequential = 0.0
    for x in nlls:
        sequential += x
    assert sequential != sum(sorted(nlls))  # the example does discriminate orders
    rng = random.Random(0)
    for _ in range(5):
        rng.shuffle(parts)
        r = D.combine(("quantize-on-write", "int4", 0), parts)
        assert r["nll_sum"] == sequential
        assert (r["n_predicted"], r["n_windows"], r["cache_nbytes"], r["cache_elements"]) == (50, 10, 510, 250)
        assert r["ppl"] == math.exp(sequential / 50) and r["cache_bits_per_element"] == 510 * 8 / 250
        # the total charges the constants to every window (10: 30 bytes); they are one model's 3 bytes
        assert r["total_nbytes"] == 540 and r["bits_per_element"] == 540 * 8 / 250 and r["constant_nbytes"] == 3
        assert r["batch_size"] == 2 and r["wall_s"] == pytest.approx(2.5)


def test_a_failed_batch_fails_the_configuration_and_a_missing_one_is_a_bug():
    job = ("prefill-then-decode", "int4", 0)
    r = D.combine(job, [(0, _record(1.0)), (1, {"error": "RuntimeError: out of memory"})])
    assert r == {"protocol": "prefill-then-decode", "spec": "int4", "seed": 0,
                 "error": "RuntimeError: out of memory (window batch 1)"}
    with pytest.raises(RuntimeError, match="expected 0..1"):
        D.combine(job, [(0, _record(1.0)), (2, _record(1.0))])


# --- two gloo ranks vs one process ----------------------------------------------------

SPECS = "fp16;int4;spherical3"  # spherical3 is stochastic: seed 1 is a configuration too
FIGURES = ("nll_sum", "ppl", "bits_per_element", "cache_bits_per_element", "n_predicted", "cache_nbytes",
           "constant_nbytes", "total_nbytes", "cache_elements", "n_windows", "window", "batch_size")


def compare_args(tiny, out):
    # 3 windows in batches of 2: an uneven last batch; both protocols; 8 configurations.
    return ["compare", "--model", tiny["model"], "--corpus", tiny["corpus"], "--device", "cpu",
            "--window", "24", "--windows", "3", "--batch-size", "2", "--seeds", "2", "--specs", SPECS,
            "--protocol", "both", "--context", "16", "--decode-tokens", "4", "--out", str(out), "--run-name", "r"]


def records(out) -> dict:
    data = json.loads((out / "r" / "results.json").read_text())
    return {(r["protocol"], r["spec"], r["seed"]): r for r in data["results"]}


def keep_only(src, dst, keys) -> None:
    """A copy of run `src` as if killed after measuring `keys`."""
    (dst / "r").mkdir(parents=True)
    data = json.loads((src / "r" / "results.json").read_text())
    data["results"] = [r for r in data["results"] if (r["protocol"], r["spec"], r["seed"]) in keys]
    (dst / "r" / "results.json").write_text(json.dumps(data))


def torchrun(args, nproc=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "kvqbench.suites.compare.cli", *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


def assert_same_figures(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert "error" not in g and "error" not in w, (key, g, w)
        for f in FIGURES:
            if isinstance(w[f], float):
                assert g[f] == pytest.approx(w[f], rel=1e-9, abs=0), (key, f, g[f], w[f])
            else:
                assert g[f] == w[f], (key, f, g[f], w[f])


def test_two_gloo_ranks_give_the_single_process_figures_and_resume_across_world_sizes(tiny, tmp_path, capfd):
    single, dist2, back1 = tmp_path / "single", tmp_path / "dist2", tmp_path / "back1"
    assert cli.main(compare_args(tiny, single)) == 0
    want = records(single)
    assert len(want) == 8

    # World 1 -> 2: a single-process run "killed" after one configuration, resumed by two
    # ranks that the command launches itself (`--workers 2`: torch.distributed.run)
    kept = ("quantize-on-write", "fp16", 0)
    keep_only(single, dist2, {kept})
    capfd.readouterr()
    assert cli.main(compare_args(tiny, dist2) + ["--workers", "2"]) == 0
    assert "8 configurations, 1 already measured" in capfd.readouterr().err
    got = records(dist2)
    assert got[kept] == want[kept]  # not redone: the very record, wall time included
    assert_same_figures(got, want)
    meta = json.loads((dist2 / "r" / "results.json").read_text())["meta"]["distributed"]
    assert (meta["world_size"], meta["backend"]) == (2, "gloo")
    assert [(r["rank"], r["device"]) for r in meta["ranks"]] == [(0, "cpu"), (1, "cpu")]
    # 3 windows in batches of 2 (2 batches), or one at a time for quantizers whose rows share a fit
    batches = {spec: 2 if rows_independent(parse_spec(spec)[0]) else 3 for spec in SPECS.split(";")}
    assert meta["scoring"]["configurations"] == 7
    assert meta["scoring"]["units"] == sum(batches[spec] for (_, spec, _) in set(want) - {kept})
    assert (dist2 / "r" / "report.md").is_file()

    # World 2 -> 1: the two-rank run "killed" with two configurations to go.
    redo = {("prefill-then-decode", "spherical3", 1), ("quantize-on-write", "int4", 0)}
    keep_only(dist2, back1, set(got) - redo)
    capfd.readouterr()
    assert cli.main(compare_args(tiny, back1)) == 0
    assert "8 configurations, 6 already measured" in capfd.readouterr().err

    # --workers: refused where it cannot work, before any work
    assert cli.main(compare_args(tiny, back1) + ["--workers", "0"]) == 2
    assert "--workers must be >= 1" in capfd.readouterr().err
    assert cli.main(compare_args(tiny, back1) + ["--workers", "2", "--device", "cpu:0"]) == 2
    assert "the ranks take the GPUs round-robin" in capfd.readouterr().err
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2"}):
        assert cli.main(compare_args(tiny, back1) + ["--workers", "2"]) == 2
    assert "under torchrun, give torchrun --nproc-per-node" in capfd.readouterr().err
    again = records(back1)
    assert all(again[k] == got[k] for k in set(got) - redo)
    assert_same_figures(again, want)



def test_greedy_twins_ride_in_the_ranks_units_and_give_the_single_process_fidelity(tiny, tmp_path):
    """The deployed protocol under two gloo ranks: each unit (a window batch) carries its
    windows' greedy twins, combine() puts their tokens back in window order, and rank 0
    scores them: the same fidelity figures as one process (same batches, same arithmetic)."""
    args = lambda out: ["compare", "--model", tiny["model"], "--corpus", tiny["corpus"], "--device", "cpu",  # noqa: E731
                        "--windows", "3", "--batch-size", "2", "--seeds", "2", "--specs", "fp16;int2;spherical3",
                        "--protocol", "deployed", "--context", "16", "--decode-tokens", "6", "--out", str(out),
                        "--run-name", "r"]
    single, dist2 = tmp_path / "single", tmp_path / "dist2"
    assert cli.main(args(single)) == 0
    torchrun(args(dist2))
    want, got = (json.loads((d / "r" / "results.json").read_text())["fidelity"]["rows"] for d in (single, dist2))
    assert sorted(got) == sorted(want) == ["fp16", "int2", "spherical3"]
    for spec, w in want.items():
        g = got[spec]
        assert g["source"] == w["source"] == "deployed twins" and g["prompts"] == 3
        for key in ("first_diff", "match_rate", "nll_per_token", "by_seed"):
            assert g[key] == w[key], (spec, key)
    assert sorted(got["spherical3"]["by_seed"]) == ["0", "1"]


# --- the scaling benchmark's arithmetic (its runs are GPU work; suites/bench/scaling.py) ----

def _scaling_run(ranks: int, wall_s: float, nll_shift: float = 0.0) -> dict:
    results = [{"protocol": "quantize-on-write", "spec": s, "seed": 0, "n_predicted": 100,
                "ppl": 10.0 * (1 + nll_shift), "nll_sum": 230.0 + nll_shift, "cache_nbytes": 64}
               for s in ("fp16", "int4")]
    results.append({"protocol": "quantize-on-write", "spec": "int2", "seed": 0, "error": "boom"})
    return {"meta": {"distributed": {"scoring": {"wall_s": wall_s, "busy_s_per_rank": [wall_s] * ranks,
                                                 "rounds": 1, "units": 2},
                                     "ranks": [{"device": f"cuda:{r}", "gpu": "H200"} for r in range(ranks)]}},
            "results": results}


def test_scaling_throughput_speedup_and_agreement():
    from kvqbench.suites.bench.scaling import measure as scaling

    s = scaling.summarise({1: _scaling_run(1, 10.0), 2: _scaling_run(2, 5.5)})
    one, two = s["rows"]
    assert one["scored_tokens"] == two["scored_tokens"] == 200  # failed configurations score nothing
    assert one["tokens_per_s"] == 20.0 and two["speedup"] == pytest.approx(10 / 5.5)
    assert two["efficiency"] == pytest.approx(10 / 5.5 / 2)
    assert two["agreement"]["same"] and two["agreement"]["bit_identical"] == 2
    off = scaling.summarise({1: _scaling_run(1, 10.0), 2: _scaling_run(2, 5.0, nll_shift=1e-5)})["rows"][1]
    assert not off["agreement"]["same"] and off["agreement"]["max_ppl_rel_diff"] == pytest.approx(1e-5)
    assert scaling.compare_command(2, ["--device", "cpu"], "out", "r")[1:4] == [
        "-m", "torch.distributed.run", "--standalone"]
