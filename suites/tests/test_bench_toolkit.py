"""The benchmark toolkit (suites/bench/toolkit.py) and the rigs' hygiene around it: the
synthetic data is seeded and has its outlier channels, the tiler fits every layout
(KIVI's window included) and refuses what does not fit, the timer, yardstick and
environment record work on the CPU (their GPU paths where there is one), latency runs set
side by side (latency/ab.py), a call's kernels told apart in a trace
(latency/kernel_times.py), the asv benchmarks read the same toolkit from the checkout,
the GPU-only rigs import here, and
no rig under suites/bench/ defines its own copy of a toolkit helper, imports a private
name from another file or edits sys.path."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before kvqbench.kernels is imported (see test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.suites.bench import toolkit as tk  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH = Path(__file__).resolve().parents[1] / "bench"
CUDA = torch.cuda.is_available()


def test_synthetic_kv_is_seeded_fp16_with_three_outlier_channels():
    k, v = tk.synthetic_kv(2, 3, 50, 64, "cpu", seed=4)
    assert k.shape == v.shape == (2, 3, 50, 64) and k.dtype == v.dtype == torch.float16
    k2, v2 = tk.synthetic_kv(2, 3, 50, 64, "cpu", seed=4)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert not torch.equal(k, tk.synthetic_kv(2, 3, 50, 64, "cpu", seed=5)[0])
    rms = k.float().pow(2).mean((0, 1, 2)).sqrt()
    assert set(torch.nonzero(rms > 10).flatten().tolist()) == {3, 64 // 2 + 1, 64 - 2}
    assert v.float().abs().max() < 10


def test_fp16_sdpa_baseline_draws_q_then_k_v():
    torch.manual_seed(1)
    q, call = tk.fp16_sdpa(2, 16, "cpu", hq=4, hkv=2, d=8)
    torch.manual_seed(1)
    q2, k, v = (torch.randn(*s).half() for s in ((2, 4, 1, 8), (2, 2, 16, 8), (2, 2, 16, 8)))
    assert torch.equal(q, q2) and q.dtype == torch.float16
    want = torch.nn.functional.scaled_dot_product_attention(q2, k, v, enable_gqa=True)
    assert torch.equal(call(), want) and want.shape == (2, 4, 1, 8)


@pytest.mark.parametrize("spec", ["int4", "fp8-e4m3", "hqmq:S=24,r=3,outliers=med3", "kivi:bits=2,group=8,residual=8"])
def test_tile_to_fits_every_layout_and_refuses_what_does_not_fit(spec):
    from kvqbench.kernels.layout import flatten

    k, v = tk.synthetic_kv(1, 2, 60 if spec.startswith("kivi") else 64, 64, "cpu")  # KIVI: fp16 windows of 4 and 12
    (_, pk), (_, pv) = tk.encode_kv(spec, k, v)
    for flat in (flatten(pk, "K"), flatten(pv, "V")):
        kivi = hasattr(flat, "T_res")
        T = flat.T_res + 2 * flat.n_groups * flat.group if kivi else 2 * flat.T
        tiled = tk.tile_to(flat, 2, T)
        assert (tiled.B, tiled.T) == (2, T)
        if kivi:  # the fp16 window stays last, as long as it was
            assert tiled.T_res == flat.T_res and tiled.n_groups == 2 * flat.n_groups
        with pytest.raises(ValueError, match="does not fit" if kivi else "not a multiple"):
            tk.tile_to(flat, 2, T + 1)
        with pytest.raises(ValueError, match="sequences"):
            tk.tile_to(tiled, 3, T)


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,group=8,residual=8"])
def test_stepping_alternates_the_token_count_and_puts_it_back(spec):
    """toolkit.stepping: every other call one token fewer (KIVI: one window row fewer on
    each side), T equal on both sides throughout, the flats restored after; a KIVI side
    without window rows is refused."""
    from kvqbench.kernels.layout import flatten

    k, v = tk.synthetic_kv(1, 2, 60, 64, "cpu")  # (KIVI: fp16 windows of 4 and 12 rows)
    (_, pk), (_, pv) = tk.encode_kv(spec, k, v)
    kf, vf = flatten(pk, "K"), flatten(pv, "V")
    before = (kf.T, vf.T, getattr(kf, "n_res", None), getattr(vf, "n_res", None))
    seen = []
    step = tk.stepping(lambda: seen.append((kf.T, vf.T)), kf, vf)
    for _ in range(4):
        step()
    assert seen == [(59, 59), (60, 60)] * 2
    step()
    step.restore()
    assert (kf.T, vf.T, getattr(kf, "n_res", None), getattr(vf, "n_res", None)) == before
    if hasattr(kf, "T_res"):
        import dataclasses

        with pytest.raises(ValueError, match="window row"):
            tk.stepping(lambda: None, dataclasses.replace(kf, n_res=0), vf)


def test_kernel_flats_hold_kivis_window_length_as_the_store_does():
    # the decode store's KIVI flats carry their window length as an int (kernels/formats/kivi.py);
    # the benchmarks' tiled flats too (KIVIFlat.tile), so their host figures time what an engine
    # call reads (None made every length read a tensor shape read: KIVI-4 14.3 -> 12.8 us per call
    # through the CUDA path walked on a 2-core CPU, B=1, T=4096, 2026-12-06)
    kf, vf = tk.kernel_flats("kivi:bits=4", 2, 320, 2, 64, 288)
    assert [f.n_res for f in (kf, vf)] == [f.residual.shape[2] for f in (kf, vf)]
    assert all(type(f.n_res) is int for f in (kf, vf)) and kf.T == vf.T == 320
    assert not hasattr(tk.kernel_flats("int4", 1, 64, 2, 64, 64)[0], "n_res")


def test_timer_yardstick_and_environment_on_this_machine():
    calls = []
    t = tk.timeit_us(lambda: calls.append(1), rep_ms=5, warmup_ms=1)
    assert t > 0 and calls
    copy = tk.copy_bandwidth(1 << 16)
    assert copy["bytes_copied"] == 1 << 16 and copy["time_us"] > 0
    assert copy["GBps_read_plus_write"] == pytest.approx(2 * (1 << 16) / copy["time_us"] / 1e3)
    env = tk.env_info()
    assert {"torch", "triton", "python", "cuda", "time", "gpu", "sm_count"} <= set(env)
    assert tk.sm_clock_mhz({"sm_clock_max_MHz": "[N/A]"}) == 0.0 and tk.sm_clock_mhz({}) == 0.0
    tk.synchronize("cpu")
    a = torch.ones(8)
    assert tk.rel_err(a * 1.5, a) == pytest.approx(0.5)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and the host-time helpers need a CUDA device")
def test_graph_replay_and_host_times_on_a_gpu():
    x = torch.zeros(1, device="cuda")
    replay = tk.graph_replay(lambda: x.add_(1))  # two warm-up calls; the capture runs nothing
    torch.cuda.synchronize()
    assert x.item() == 2
    replay()
    torch.cuda.synchronize()
    assert x.item() == 3
    assert tk.host_us(lambda: x.add_(1), n=10) > 0
    assert isinstance(tk.host_overhead(lambda: x.add_(1), replay, n=10), float)


def test_asv_benchmarks_read_the_same_toolkit_from_the_checkout():
    name = "_test_asv_common"
    spec = importlib.util.spec_from_file_location(name, BENCH / "asv_benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(common)
        src = common.toolkit()
        assert Path(src.__file__) == BENCH / "toolkit.py" and src is not tk and src is common.toolkit()
        assert all(torch.equal(a, b) for a, b in zip(src.synthetic_kv(1, 2, 16, 32, "cpu"),
                                                     tk.synthetic_kv(1, 2, 16, 32, "cpu")))
    finally:
        sys.modules.pop(common._TOOLKIT_ALIAS, None)


@pytest.mark.parametrize("module", ["cuda.bench", "cuda.hqmq_bench", "kernel_sweep.measure", "kernel_sweep.__main__",
                                    "decode.host_profile", "latency.run"])
def test_gpu_only_rigs_import_here(module):
    importlib.import_module(f"kvqbench.suites.bench.{module}")


def _rig_files():
    return [p for p in sorted(BENCH.rglob("*.py")) if "__pycache__" not in p.parts]


def test_no_rig_keeps_a_copy_of_a_toolkit_helper_or_edits_sys_path_or_imports_private_names():
    helpers = {n for n, obj in vars(tk).items() if callable(obj) and getattr(obj, "__module__", "") == tk.__name__
               and not n.startswith("_")}
    assert {"synthetic_kv", "tile_to", "timeit_us", "graph_replay", "copy_bandwidth", "env_info"} <= helpers
    problems = []
    for path in _rig_files():
        if path.name == "toolkit.py":
            continue
        tree = ast.parse(path.read_text())
        rel = path.relative_to(BENCH)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in helpers:
                problems.append(f"{rel}:{node.lineno} defines {node.name} (the toolkit has it)")
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                problems += [f"{rel}:{node.lineno} imports the private {a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                problems.append(f"{rel}:{node.lineno} uses sys.path")
    assert not problems, "\n".join(problems)


def test_ab_table_sets_runs_side_by_side_against_each_runs_own_sdpa(tmp_path):
    from kvqbench.suites.bench.latency.ab import table

    def run(name, sdpa, hqmq):  # an eager row (not a column's) and one without d (kept out, no error)
        rows = [{"method": m, "B": 8, "T": 64, "d": 128, "latency_us": us}
                for m, us in (("fp16-sdpa-graph", sdpa), ("fused-hqmq-graph", hqmq), ("fused-hqmq", 1.0))]
        rows.append({"method": "fake-quant", "B": 8, "T": 64, "latency_us": 9.0})
        (tmp_path / name).mkdir()
        (tmp_path / name / "latency.json").write_text(json.dumps({"latency": rows}))
        return tmp_path / name
    out = table([run("new", 300.0, 150.0), run("base", 200.0, 160.0)]).splitlines()
    assert out[0] == "| B | T | d | method | new | base |"
    hq = next(line for line in out if "fused-hqmq-graph" in line)
    assert "150.0 (2.00x)" in hq and "160.0 (1.25x)" in hq  # each run's ratio is to its own SDPA
    assert not any("| fused-hqmq |" in line for line in out)


def test_kernel_times_splits_a_trace_into_calls():
    """A call is its split kernel(s) up to its combine; gaps are measured between them (a
    combine that starts before its split kernel ends, as a programmatic dependent: negative);
    kernels after the last combine are no call; the medians skip a field a row lacks."""
    from kvqbench.suites.bench.latency.kernel_times import call_times, main, medians

    k = lambda name, ts, dur: {"name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [k("combine_kernel<half>", 105.0, 4.0), k("split_kernel<Int4>", 0.0, 100.0),
              k("split_kernel<Int4>", 110.0, 90.0), k("combine_kernel<half>", 195.0, 6.0),
              k("split_kernel<Int4>", 203.0, 95.0)]  # (the last: no combine yet)
    rows = call_times(events)
    assert rows == [{"split_us": 100.0, "gap_us": 5.0, "combine_us": 4.0, "call_us": 109.0, "next_gap_us": 1.0},
                    {"split_us": 90.0, "gap_us": -5.0, "combine_us": 6.0, "call_us": 91.0}]
    assert medians(rows) == {"split_us": 95.0, "gap_us": 0.0, "combine_us": 5.0, "call_us": 100.0,
                             "next_gap_us": 1.0}
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main([])
        assert e.value.code == 2
