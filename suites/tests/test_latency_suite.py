"""The latency suite's plumbing on the CPU (Triton interpreter, tiny shapes): the
report's schema, the in-benchmark correctness check, rendering from the JSON, the
time budget, and the launch-config tuner. No timing is asserted (speed lives in
`python -m kvqbench.suites.bench.latency` on a GPU)."""
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
    rows = {r["method"]: r for r in res["latency"]}
    assert set(rows) == {"fp16-sdpa", *METHOD_SPECS}
    for method, row in rows.items():
        assert ROW_KEYS <= set(row), method
        assert row["bytes"] > 0 and row["latency_us"] > 0
    fp16_bytes = 2 * 1 * 1 * 256 * 64 * 2 + 2 * (1 * 2 * 64) * 2  # K+V, then q and the output
    assert rows["fp16-sdpa"]["bytes"] == fp16_bytes
    for method in FUSED_SPECS:  # every packed cache reads fewer bytes than fp16
        assert rows[method]["bytes"] < fp16_bytes and 0 < rows[method]["bits_per_element"] < 16
    assert set(res["memory"]["rows"][0]) >= {"spec", "bits_per_element", "projection_GB"}
    assert res["memory"]["rows"][0]["bits_per_element"] == 16.0  # fp16 first
    assert set(res["encode"]) == {"shape", "chunks", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"}
    md = (out / "latency.md").read_text()
    assert md.count("| 1 | 256 |") == len(rows)
    assert (out / "latency.png").stat().st_size > 0


def test_fused_output_matches_the_reference(one_shape_run):
    """Fused kernels vs fp32 attention over the quantizer's own decode: observed ~2e-4
    (fp16 output rounding) for every method; 1e-3 leaves a 5x margin."""
    res, _ = one_shape_run
    errs = {r["method"]: r["rel_err_vs_reference"] for r in res["latency"] if r["method"] in FUSED_SPECS}
    assert set(errs) == set(FUSED_SPECS)
    assert all(e < 1e-3 for e in errs.values()), errs


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
    from kvqbench.suites.bench.latency.caches import hqmq_segment, synthetic_kv

    k, _ = synthetic_kv(1, 2, 128, 64, "cpu")
    q = get_quantizer("hqmq:S=24,r=3,outliers=med3", role="K")
    packed = q.encode(k)
    seg = hqmq_segment(flatten(packed, "K").tile(2, 2))
    assert seg.fields["outliers"].shape[0] == 4 * packed.segments[0].fields["outliers"].shape[0] > 0
    got = q.decode_tokens(seg, packed.shared, (2, 2, 256, 64))
    want = q.decode(packed).repeat(2, 1, 2, 1)
    assert torch.equal(got.to(want.dtype), want)
