"""The latency suite's plumbing on the CPU (Triton interpreter, tiny shapes): the
report's schema (shipped, Triton and CUDA rows; CUDA ones "not run here" with the
reason), the in-benchmark correctness check, which backend the shipped row says ran,
the issue-10 targets and the roofline figure from a synthetic result, rendering from
the JSON, the time budget, and the launch-config tuner. No timing is asserted (speed
lives in `python -m kvqbench.suites.bench.latency` on a GPU)."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # before kvqbench.kernels is imported (see test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.suites.bench.latency.config import FUSED_SPECS, METHOD_SPECS, LatencyConfig  # noqa: E402

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]
if torch.cuda.is_available():  # the GPU run is the real benchmark; this checks the CPU path
    pytestmark.append(pytest.mark.skip(reason="CPU plumbing test"))

TOP_KEYS = ["env", "shape", "method_specs", "copy_bandwidth", "latency", "tuning", "targets", "elapsed_s",
            "encode", "memory"]
ROW_KEYS = {"method", "B", "T", "Hq", "Hkv", "d", "latency_us", "bytes", "GBps", "frac_copy_bw"}


@pytest.fixture(scope="module")
def one_shape_run(tmp_path_factory):
    """One (B, T) = (1, t0): every method once, the correctness check on every fused one."""
    from kvqbench.suites.bench.latency.render import render
    from kvqbench.suites.bench.latency.run import run_latency

    out = tmp_path_factory.mktemp("latency")
    cfg = LatencyConfig.smoke(hq=2, hkv=1, tokens=(256,), batches=(1,), focus=(1, 256), encode_tokens=64)
    res = run_latency(cfg, out, log=lambda s: None)
    render(out, res)
    return res, out


def test_report_schema_and_files(one_shape_run):
    res, out = one_shape_run
    assert list(json.loads((out / "latency.json").read_text())) == TOP_KEYS
    rows = {r["method"]: r for r in res["latency"] if "latency_us" in r}
    triton = {f"{m}-triton" for m in FUSED_SPECS}
    padded = {f"{m}-padded" for m in FUSED_SPECS}  # the focus's left-padded batch, auto with row_start
    assert set(rows) == {"fp16-sdpa", *METHOD_SPECS, *triton, *padded}
    for method, row in rows.items():
        assert ROW_KEYS <= set(row), method
        assert row["bytes"] > 0 and row["latency_us"] > 0
        assert row["speedup_vs_fp16_sdpa"] == pytest.approx(rows["fp16-sdpa"]["latency_us"] / row["latency_us"])
    fp16_bytes = 2 * 1 * 1 * 256 * 64 * 2 + 2 * (1 * 2 * 64) * 2  # K+V, then q and the output
    assert rows["fp16-sdpa"]["bytes"] == fp16_bytes
    for method, spec in FUSED_SPECS.items():  # every packed cache reads fewer bytes than fp16, whichever kernel
        if spec == "fp16":  # the engine's fp16 store reads what SDPA reads
            assert rows[method]["bytes"] == rows[f"{method}-triton"]["bytes"] == fp16_bytes
            assert rows[method]["bits_per_element"] == 16
            continue
        assert rows[method]["bytes"] == rows[f"{method}-triton"]["bytes"]
        if "codebook=int8" in spec:  # its kernel table is the whole fp32 codebook here (74 KB), more than
            exact = rows["fused-hqmq"]  # this cache: exact HQMQ's stored bits, more bytes read
            assert rows[method]["bits_per_element"] == exact["bits_per_element"] and rows[method]["bytes"] > exact["bytes"]
        else:
            assert rows[method]["bytes"] < fp16_bytes
        assert 0 < rows[method]["bits_per_element"] < 16
        # no GPU here: what auto runs is Triton, and the row says why not CUDA (explain_backend's words)
        assert rows[method]["backend"] == rows[f"{method}-triton"]["backend"] == "triton"
        assert rows[method]["why_not_cuda"] == "q is not on a CUDA device"
    # the CUDA rows and the B=1 graph replays: reported as not run, with the reason, never a number
    skipped = {r["method"]: r["skipped"] for r in res["latency"] if "skipped" in r}
    want = ({f"{m}-cuda" for m in FUSED_SPECS} | {f"{m}-graph" for m in ["fp16-sdpa", *FUSED_SPECS, *triton, *padded]}
            | {f"{m}-padded-cuda" for m in FUSED_SPECS}
            # FlashInfer's peer rows: a GPU's, where it is installed
            | {"flashinfer-fp16", "flashinfer-fp8", "flashinfer-fp16-tc", "flashinfer-fp8-tc"})
    assert set(skipped) == want
    assert all(why.startswith("not run here: ") for why in skipped.values())
    assert skipped["fused-int4-cuda"] == skipped["fused-int4-padded-cuda"] == "not run here: torch has no CUDA device"
    for m in padded:  # (B=1 here: its one row starts at 0)
        assert rows[m]["backend"] == "triton" and rows[m]["pad_fraction"] == 0.0 and "row_start" in rows[m]["config"]
    assert "FlashInfer" in skipped["flashinfer-fp8"]
    assert set(res["memory"]["rows"][0]) >= {"spec", "bits_per_element", "projection_GB"}
    assert res["memory"]["rows"][0]["bits_per_element"] == 16.0  # fp16 first
    assert set(res["encode"]) == {"shape", "chunks", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"}
    md = (out / "latency.md").read_text()
    assert md.count("| 1 | 256 |") == len(rows)
    assert "fused-kivi2-cuda: not run here: torch has no CUDA device" in md
    assert (out / "latency.png").stat().st_size > 0
    assert (out / "latency_roofline.png").stat().st_size > 0


def test_the_padded_batch_starts_each_row_later():
    from kvqbench.suites.bench.latency.methods import padded_starts

    rs = padded_starts(8, 32768, "cpu")
    assert rs.dtype == torch.int32 and rs.tolist() == [1024 * b for b in range(8)]
    assert float(rs.sum()) / (8 * 32768) == pytest.approx(0.109, abs=1e-3)
    assert padded_starts(40, 64, "cpu").max() == 63  # (every row keeps a key)


def test_fused_output_matches_the_reference(one_shape_run):
    """Shipped and Triton rows vs fp32 attention over the quantizer's own decode: observed
    ~2e-4 (fp16 output rounding) for every method; 1e-3 leaves a 5x margin."""
    res, _ = one_shape_run
    want = {*FUSED_SPECS, *(f"{m}-triton" for m in FUSED_SPECS)}
    errs = {r["method"]: r["rel_err_vs_reference"] for r in res["latency"] if r["method"] in want and "latency_us" in r}
    assert set(errs) == want
    assert all(e < 1e-3 for e in errs.values()), errs


def _flats(spec: str):
    from kvqbench.kernels.layout import flatten
    from kvqbench.quantizers import get_quantizer
    from kvqbench.suites.bench.toolkit import synthetic_kv

    k, v = synthetic_kv(1, 1, 64, 128, "cpu")  # head_dim 128: every CUDA kernel's auto route takes it (VERIFIED_HEAD_DIMS)
    return (flatten(get_quantizer(spec, role="K").encode(k), "K"),
            flatten(get_quantizer(spec, role="V").encode(v), "V"))


@pytest.mark.parametrize("spec", ["int4", "fp8-e4m3", "kivi:bits=2", "hqmq:S=24,r=3",
                                  "hqmq:S=24,r=3,outliers=med3"])
@pytest.mark.parametrize("builds,refusal", [(True, None), (True, "head_dim 64"), (False, None)])
def test_auto_backend_agrees_with_the_dispatcher(monkeypatch, spec, builds, refusal):
    """The shipped row's `backend` is what decode_attention(backend="auto") runs (the
    suite asks the front's explain_backend; no copy of its rules): the dispatcher is
    driven with a stand-in CUDA query and stubbed kernels (each returns its name), the
    library built or not, the layout taken or refused."""
    import dataclasses
    from types import SimpleNamespace

    from kvqbench.kernels import decode_attention as da
    from kvqbench.kernels import registry
    from kvqbench.kernels.cuda import decode_attention as cuda_decode
    from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq
    from kvqbench.suites.bench.latency.methods import auto_backend

    kf, vf = _flats(spec)
    for m in (cuda_decode, cuda_hqmq):
        monkeypatch.setattr(m, "why_unavailable", lambda: None if builds else "no nvcc found")
        monkeypatch.setattr(m, "available", lambda: builds)  # (not always a wrapper of why_unavailable)
        monkeypatch.setattr(m, "unsupported", lambda q, k, v: refusal)
        monkeypatch.setattr(m, "decode", lambda q, k, v, **kw: "cuda")
    fmt = registry.format_of_flat(type(kf))  # its Triton kernel stubbed the same way
    monkeypatch.setattr(fmt, "kernels", tuple(dataclasses.replace(x, fn=lambda q, k, v, **kw: "triton")
                                              if x.backend == "triton" else x for x in fmt.kernels))
    q = SimpleNamespace(is_cuda=True)
    backend, why = auto_backend(q, kf, vf)
    assert backend == da.decode_attention(q, kf, vf)
    if "med3" in spec and not cuda_hqmq.AUTO_MED3:
        assert backend == "triton" and "AUTO_MED3" in why
    elif builds and refusal is None:
        assert (backend, why) == ("cuda", None)
    else:
        assert backend == "triton" and why == (refusal or "no nvcc found")
    route = da.explain_backend(q, kf, vf)
    assert (route.backend, route.declined.get("cuda")) == (backend, why) and route.format == fmt.name
    assert da.explain_backend(q, kf, vf, backend="triton").backend == "triton"
    opt = da.explain_backend(q, kf, vf, block_t=64)  # a Triton launch option: the Triton kernel's call
    assert opt.backend == "triton" and ("block_t" in opt.declined["cuda"] or "AUTO" in opt.declined["cuda"])


def _synthetic_result() -> dict:
    """A run's result dict at the full run's shapes, made up (not measured): shipped rows
    slower than the Triton rows at the focus, so reading the wrong row flips a verdict."""
    us = {(8, "fp16-sdpa"): 250.0, (8, "fused-int4"): 110.0, (8, "fused-int4-triton"): 100.0,
          (8, "fused-kivi2"): 110.0, (8, "fused-kivi2-triton"): 90.0, (8, "fused-kivi4"): 120.0,
          (8, "fused-fp8"): 150.0, (8, "fused-hqmq"): 160.0, (8, "fused-hqmq-med3"): 1150.0,
          (8, "fused-hqmq-med3-cuda"): 190.0,
          (1, "fp16-sdpa"): 50.0, (1, "fp16-sdpa-graph"): 40.0, (1, "fused-int4"): 45.0, (1, "fused-int4-graph"): 42.0,
          (1, "fused-fp8"): 60.0, (1, "fused-fp8-graph"): 39.0, (1, "fused-kivi2"): 30.0, (1, "fused-kivi4"): 35.0,
          (1, "fused-hqmq"): 70.0, (1, "fused-hqmq-graph"): 33.0}
    rows = [{"method": m, "B": B, "T": 32768, "latency_us": t, "bytes": int(1e6 * t), "GBps": 1.0,
             "frac_copy_bw": 0.5, "backend": "triton" if "med3" in m and "cuda" not in m else "cuda"}
            for (B, m), t in us.items()]
    rows.append({"method": "fused-hqmq-med3", "B": 1, "T": 32768, "error": "OutOfMemoryError: ..."})
    return {"env": {"gpu": "synthetic"}, "shape": {"Hq": 32, "Hkv": 8, "d": 128, "encoded_tokens": 4096},
            "copy_bandwidth": {"GBps_read_plus_write": 4000.0}, "latency": rows, "tuning": {}}


def test_targets_read_the_shipped_rows_of_the_run():
    from kvqbench.suites.bench.latency.targets import add_speedups, targets

    res = _synthetic_result()
    add_speedups(res["latency"])
    t = targets(res["latency"], (8, 32768))
    f = t["focus"]
    assert f["fused-int4"]["row"] == "fused-int4" and f["fused-int4"]["speedup"] == pytest.approx(250 / 110)
    assert f["fused-int4"]["met"] is True and f["fused-int4"]["backend"] == "cuda"
    assert f["fused-kivi2"]["met"] is False  # 2.27x shipped (its Triton row's 2.78x does not count)
    assert f["fused-kivi4"]["met"] is True and f["fused-fp8"]["met"] is True and f["fused-hqmq"]["met"] is True
    assert f["fused-hqmq-med3"]["ratio_to_hqmq"] == pytest.approx(1150 / 160) and f["fused-hqmq-med3"]["met"] is False
    opt = t["cuda_opt_in_not_shipped"]["fused-hqmq-med3-cuda"]  # beside, not instead of, the shipped row
    assert opt["ratio_to_hqmq"] == pytest.approx(190 / 160) and opt["met"] is True
    b1 = t["b1"]
    assert b1["fused-int4"]["eager_speedup"] == pytest.approx(50 / 45)
    assert b1["fused-int4"]["graph_speedup"] == pytest.approx(40 / 42) and b1["fused-int4"]["met"] is True
    assert b1["fused-fp8"]["met"] is True  # eager 0.83x, graph 40/39 like for like
    assert b1["fused-hqmq"]["met"] is True and b1["fused-kivi4"]["met"] is True
    assert b1["fused-hqmq-med3"]["met"] is None  # its row failed: not judged, not "met"
    sp = {r["method"]: r.get("speedup_vs_fp16_sdpa") for r in res["latency"] if r["B"] == 1}
    assert sp["fused-fp8-graph"] == pytest.approx(40 / 39) and sp["fused-fp8"] == pytest.approx(50 / 60)
    missing = targets([r for r in res["latency"] if r["method"] != "fused-fp8"], (8, 32768))["focus"]["fused-fp8"]
    assert missing["met"] is None and "no fused-fp8" in missing["missing"]


def test_issue28_targets_read_graphed_rows_and_host_time():
    """Issue 28's block: graphed rows against the graphed fp16 SDPA (the eager focus rows do
    not count), Med3x within 1.15x graphed, B=1 graphed >= 1.5x, eager host us <= 20."""
    from kvqbench.suites.bench.latency.targets import add_speedups, targets

    res = _synthetic_result()
    res["latency"] += [{"method": m, "B": 8, "T": 32768, "latency_us": t, "backend": "cuda"} for m, t in
                       (("fp16-sdpa-graph", 240.0), ("fused-int4-graph", 80.0), ("fused-hqmq-graph", 110.0),
                        ("fused-hqmq-med3-graph", 130.0))]
    for r in res["latency"]:
        if (r["method"], r["B"]) in (("fused-int4", 1), ("fused-hqmq", 1)):
            r["host_us"] = 12.0 if r["method"] == "fused-int4" else 60.0
    add_speedups(res["latency"])
    g = targets(res["latency"], (8, 32768))["graphed"]
    assert g["fused-int4-graph"]["speedup"] == pytest.approx(3.0) and g["fused-int4-graph"]["met"] is True
    assert g["fused-hqmq-graph"]["met"] is False  # 2.18x < 2.4x
    assert g["fused-fp8-graph"]["met"] is None  # no graphed fp8 row at the focus: not judged
    assert g["fused-hqmq-med3-graph"]["ratio_to_hqmq"] == pytest.approx(130 / 110)
    assert g["fused-hqmq-med3-graph"]["met"] is False  # 1.18x > 1.15x
    assert g["fused-int4-graph@b1"]["speedup"] == pytest.approx(40 / 42) and g["fused-int4-graph@b1"]["met"] is False
    assert g["fused-int4@host"]["met"] is True and g["fused-hqmq@host"]["met"] is False
    assert g["fused-fp8@host"]["met"] is None
    assert "fused-hqmq-int8-graph" not in g  # the int8 codebook's row: judged beside HQMQ only where run
    res["latency"].append({"method": "fused-hqmq-int8-graph", "B": 8, "T": 32768, "latency_us": 96.0, "backend": "cuda"})
    g8 = targets(res["latency"], (8, 32768))["graphed"]["fused-hqmq-int8-graph"]
    assert g8["speedup"] == pytest.approx(2.5) and g8["met"] is True and "int8 codebook" in g8["target"]
    for r in res["latency"]:  # an eager decode step pays the step figure: judged on the larger
        if (r["method"], r["B"]) == ("fused-int4", 1):
            r["host_us_step"] = 25.0
    g = targets(res["latency"], (8, 32768))["graphed"]
    assert g["fused-int4@host"]["met"] is False and g["fused-int4@host"]["host_us"] == 25.0


def test_render_writes_the_roofline_and_the_targets_table(tmp_path):
    from kvqbench.suites.bench.latency.render import render, write_roofline
    from kvqbench.suites.bench.latency.targets import add_speedups, targets

    res = _synthetic_result()
    add_speedups(res["latency"])
    res["targets"] = targets(res["latency"], (8, 32768))
    render(tmp_path, res)
    assert (tmp_path / "latency_roofline.png").stat().st_size > 10_000
    md = (tmp_path / "latency.md").read_text()
    assert "| focus B=8 T=32768 | fused-kivi2 | cuda | 110.0 | 250.0 / 2.27x | >= 2.5x | **no** |" in md
    assert "| B=1 T=32768 | fused-hqmq-med3 | | |  | >= 1.0x (eager or graph, like for like) | not measured |" in md
    elsewhere = {**res, "latency": [{**r, "T": 4096} for r in res["latency"]]}
    assert write_roofline(tmp_path / "none.png", elsewhere) is False  # no row at the two shapes: no figure
    assert not (tmp_path / "none.png").exists()


def test_render_from_json_alone(one_shape_run, tmp_path):
    from kvqbench.suites.bench.latency.__main__ import main

    _, out = one_shape_run
    (tmp_path / "latency.json").write_text((out / "latency.json").read_text())
    main(["--render", str(tmp_path / "latency.json")])
    assert (tmp_path / "latency.md").read_text() == (out / "latency.md").read_text()


def test_time_budget_skips_every_shape(tmp_path, capsys):
    """Through the command line: --smoke on the CPU, with a budget already spent."""
    from kvqbench.suites.bench.latency.__main__ import main

    res = main(["--smoke", "--budget-s", "-1", "--skip-encode", "--skip-memory", "--out", str(tmp_path)])
    assert [r["skipped"] for r in res["latency"]] == ["time budget"] * 4
    assert "Not measured:" in (tmp_path / "latency.md").read_text()
    assert "skipped (time budget)" in capsys.readouterr().out


def test_failures_and_usage_errors(tmp_path, capsys):
    from kvqbench.suites.bench.latency.__main__ import failures, main

    res = {"latency": [{"method": "fp16-sdpa", "B": 1, "T": 256, "latency_us": 1.0},
                       {"method": "fused-int4", "B": 8, "T": 4096, "error": "OutOfMemoryError: ..."}],
           "memory_error": "OutOfMemoryError: ..."}
    assert failures(res) == ["fused-int4 B=8 T=4096: OutOfMemoryError: ...", "memory_error: OutOfMemoryError: ..."]
    with pytest.raises(SystemExit) as e:
        main(["--render", str(tmp_path / "missing.json")])
    assert e.value.code == 2 and "cannot read" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path)])
        assert e.value.code == 2 and "--smoke" in capsys.readouterr().err
    for opts in (["--head-dim", "64"], ["--heads", "64", "4"]):  # shape options set the GPU run, not the smoke run
        with pytest.raises(SystemExit) as e:
            main(["--smoke", *opts, "--out", str(tmp_path)])
        assert e.value.code == 2 and "--head-dim / --heads" in capsys.readouterr().err


def test_targets_section_names_a_run_at_other_heads():
    from kvqbench.suites.bench.latency.render import target_lines

    assert not any("Hq 64" in ln for ln in target_lines({}, {"Hq": 32, "Hkv": 8, "d": 128}))
    lines = target_lines({}, {"Hq": 64, "Hkv": 4, "d": 128})
    assert any("Hq 64 / Hkv 4" in ln and "not as the issues' verdicts" in ln for ln in lines)


def test_heads_set_the_gpu_runs_gqa_group(monkeypatch, tmp_path, capsys):
    """--heads HQ HKV: the GPU run's query / kv heads (a model's GQA group); a group that does
    not divide, or a head count below 1, is a usage error naming it. (The run itself is
    stood in: this test reads the config it is given.)"""
    from kvqbench.suites.bench.latency.__main__ import main

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kvqbench.suites.bench.latency.run.run_latency",
                        lambda cfg, out, log: seen.setdefault("cfg", cfg) and {})
    monkeypatch.setattr("kvqbench.suites.bench.latency.render.render", lambda out, res: None)
    main(["--heads", "64", "4", "--tokens", "32768", "--batches", "8", "1", "--out", str(tmp_path)])
    cfg = seen["cfg"]
    assert (cfg.hq, cfg.hkv, cfg.d, cfg.focus) == (64, 4, 128, (8, 32768)) and cfg.shape["Hq"] == 64
    for heads, word in ((["30", "8"], "multiple of KV heads"), (["32", "0"], "positive")):
        with pytest.raises(SystemExit) as e:
            main(["--heads", *heads, "--out", str(tmp_path)])
        assert e.value.code == 2 and word in capsys.readouterr().err


def test_config_refuses_a_focus_it_does_not_measure():
    with pytest.raises(ValueError, match="focus"):
        LatencyConfig.smoke(focus=(3, 512))
    with pytest.raises(ValueError, match="multiple of 64"):
        LatencyConfig.smoke(t0=100)


def test_tuner_keeps_only_real_gains_and_records_failures():
    from triton.runtime.errors import OutOfResources

    from kvqbench.suites.bench.latency.tuning import greedy_tune, launch_stages

    def time_us(cfg):
        if cfg.get("num_warps") == 16:
            raise OutOfResources(1 << 20, 1 << 16, "shared memory")
        t = 100.0 - (10 if cfg.get("block_t") == 128 else 0) - (1 if cfg.get("table") == "sec32" else 0)
        return t - (20 if cfg.get("programs_per_sm") == 8 else 0)

    best, trials = greedy_tune(time_us, launch_stages(hqmq=True, has_sms=True), log=lambda s: None)
    # 10% (block 128) and 20% (8 programs per SM) gains kept; sec32's 1% is noise
    assert best == {"block_t": 128, "num_warps": 8, "table": "cb16", "num_stages": 1, "programs_per_sm": 8}
    assert trials[0] == {"time_us": 100.0}  # the kernel's own defaults compete first
    assert len(trials) == 6 + 4 + 3
    assert [t for t in trials if "error" in t] == [trials[5]] and "OutOfResources" in trials[5]["error"]


def test_fake_quant_reads_the_tiled_cache_back():
    """hqmq_segment(tiled layout) decodes, through the quantizer's own torch decode, to
    the encoded cache repeated along batch and tokens (outliers included)."""
    from kvqbench.kernels.layout import flatten
    from kvqbench.quantizers import get_quantizer
    from kvqbench.suites.bench.latency.caches import hqmq_segment
    from kvqbench.suites.bench.toolkit import synthetic_kv

    k, _ = synthetic_kv(1, 2, 128, 64, "cpu")
    q = get_quantizer("hqmq:S=24,r=3,outliers=med3", role="K")
    packed = q.encode(k)
    seg = hqmq_segment(flatten(packed, "K").tile(2, 2))
    assert seg.fields["outliers"].shape[0] == 4 * packed.segments[0].fields["outliers"].shape[0] > 0
    got = q.decode_tokens(seg, packed.shared, (2, 2, 256, 64))
    want = q.decode(packed).repeat(2, 1, 2, 1)
    assert torch.equal(got.to(want.dtype), want)


def test_flashinfer_rows_page_the_same_kv_the_sdpa_row_reads():
    """The FlashInfer peer rows (issue 28): K/V in FlashInfer's HND pages, its page table
    and its call, checked here against a stand-in module that attends over the pages it
    is given as the documented layout says (FlashInfer itself runs on a GPU only)."""
    import types

    from kvqbench.suites.bench.latency import methods as M

    made = []

    class Wrapper:  # BatchDecodeWithPagedKVCacheWrapper's plan / run, in torch
        def __init__(self, workspace, layout, use_tensor_cores=False):
            assert layout == "HND" and workspace.dtype == torch.uint8
            made.append(use_tensor_cores)

        def plan(self, indptr, indices, last_len, hq, hkv, d, page, pos_encoding_mode, q_data_type, kv_data_type):
            self.args = (indptr, indices, last_len, hq, hkv, d, page)
            assert pos_encoding_mode == "NONE"

        def run(self, q, kv):
            indptr, indices, last_len, hq, hkv, d, page = self.args
            outs = []
            for b in range(q.shape[0]):
                pages = indices[indptr[b]:indptr[b + 1]].long()
                k, v = (x[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d) for x in kv)
                n = (len(pages) - 1) * page + int(last_len[b])
                k, v = k[:, :n].repeat_interleave(hq // hkv, 0), v[:, :n].repeat_interleave(hq // hkv, 0)
                w = torch.softmax(q[b].float()[:, None] @ k.transpose(1, 2) / d ** 0.5, -1)
                outs.append((w @ v)[:, 0])
            return torch.stack(outs).to(q.dtype)

    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=g).half()
    k, v = (torch.randn(2, 2, 48, 32, generator=g).half() for _ in range(2))
    ref = M.run_sdpa(q.float(), k.float(), v.float(), "default")
    got = M.flashinfer_callable(q, k, v, torch.float16, flashinfer=fake)()
    assert got.shape == ref.shape and torch.allclose(got.float(), ref, atol=2e-3)
    swapped = M.flashinfer_callable(q, k.flip(0), v.flip(0), torch.float16, flashinfer=fake)()  # rows kept apart
    assert not torch.allclose(swapped.float(), ref, atol=2e-3)
    assert made == [False, False]
    M.flashinfer_callable(q, k, v, torch.float16, True, flashinfer=fake)
    assert made[-1] is True  # the -tc rows ask for FlashInfer's tensor-core kernel
    assert not torch.allclose(swapped.float(), ref, atol=2e-3)
    assert M.flashinfer_refusal(1, 48) is not None  # no GPU here: the reason, never a number
