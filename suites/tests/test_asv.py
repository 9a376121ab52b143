"""The asv set-up: asv.conf.json loads and says what the README says, asv's own
discovery finds the benchmarks (parameterized over the registry), and the cheap
ones run here on a few specs. The full `asv continuous` run is in the README."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "suites" / "bench" / "asv_benchmarks"
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def bench():
    """asv's discovery (asv_runner) over the benchmark folder: {name: benchmark}, and
    the imported modules. Its importer and modules are removed afterwards."""
    discovery = pytest.importorskip("asv_runner.discovery")
    from asv_runner._aux import update_sys_path  # what asv's own discovery step calls

    meta_path = list(sys.meta_path)
    try:
        update_sys_path(str(BENCH_DIR))  # an importer for the name `asv_benchmarks` only
        found = {b.name: b for b in discovery.disc_benchmarks(str(BENCH_DIR))}
        mods = {k.rpartition(".")[2]: m for k, m in sys.modules.items() if k.startswith("asv_benchmarks.")}
        yield found, mods
    finally:
        sys.meta_path[:] = meta_path
        for k in [k for k in sys.modules if k.split(".")[0] in ("asv_benchmarks", "_kvqbench_asv_source_quantizers")]:
            del sys.modules[k]


def test_config_loads_as_documented():
    config = pytest.importorskip("asv.config")
    conf = config.Config.load(str(ROOT / "asv.conf.json"))
    assert conf.environment_type == "virtualenv"  # existing-env mode refuses commit ranges
    assert conf.repo == "."
    assert Path(conf.benchmark_dir).resolve() == BENCH_DIR
    assert Path(conf.html_dir).resolve() == ROOT / "reports" / "asv"
    assert conf.launch_method == "forkserver"
    # the environment gets the tested set, as .ci/setup does
    assert any("-c {conf_dir}/.ci/constraints.txt -c {conf_dir}/.ci/constraints-cpu.txt" in c
               for c in conf.install_command)
    assert (ROOT / ".ci" / "constraints-cpu.txt").is_file() and (ROOT / ".ci" / "constraints.txt").is_file()


def test_discovery_finds_every_benchmark_for_every_spec(bench):
    from kvqbench.quantizers import registry

    found, _ = bench
    specs = ["fp16"] + [s for n in sorted(registry()) for s in registry()[n].examples() if s != "fp16"]
    for name in ("quantizer_figures.Figures.track_bits_per_element",
                 "quantizer_figures.Figures.track_roundtrip_error",
                 "quantizer_figures.Codec.time_encode", "quantizer_figures.Codec.time_decode",
                 "quantizer_figures.PackedCache.peakmem_packed_cache",
                 "model_ppl.Perplexity.track_ppl", "model_ppl.Perplexity.track_model_cache_bits"):
        assert name in found, sorted(found)
        assert [eval(p) for p in found[name].params[0]] == specs, name  # asv stores params as reprs
    assert "fused_decode.FusedDecode.time_fused_decode" in found
    assert "fused_decode.SdpaFp16.time_sdpa_decode" in found
    ratio = found["fused_decode.FusedOverFp16.track_time_over_fp16_sdpa"]
    assert ratio.unit == "x fp16 SDPA time"  # issue 28, at every head size it names
    assert [eval(p) for p in ratio.params[1]] == [64, 128, 256]
    assert found["quantizer_figures.Figures.track_bits_per_element"].unit == "bits"
    assert found["model_ppl.Perplexity.track_ppl"].unit == "PPL"


def test_params_do_not_depend_on_the_installed_commit(bench, monkeypatch):
    """asv runs parameters by index at every commit: the list comes from the source
    tree, so an installed commit with other example configs cannot shift it."""
    import kvqbench.quantizers as Q

    common = bench[1]["common"]
    before = common.example_specs()
    assert before == common.SPECS
    older = {n: c for n, c in Q.registry().items() if n in ("fp16", "int")}  # an "older commit"
    monkeypatch.setattr(Q, "registry", lambda refresh=False: older)
    assert common.example_specs() == before


def test_figures_on_a_few_specs(bench, monkeypatch):
    mod = bench[1]["quantizer_figures"]
    monkeypatch.setattr(mod, "SPECS", ["fp16", "int4", "int2", "hqmq:S=24,r=3"])
    b = mod.Figures()
    cache = b.setup_cache()
    bits = {s: b.track_bits_per_element(cache, s) for s in cache}
    err = {s: b.track_roundtrip_error(cache, s) for s in cache}
    assert bits["fp16"] == 16.0 and bits["int4"] == 5.0 and bits["int2"] == 3.0
    cache_bits = {s: b.track_cache_bits_per_element(cache, s) for s in cache}
    # HQMQ's secondaries (4 heads x 24 x 4 fp16 over 4 x 256 x 64 elements) are model constants
    assert cache_bits["hqmq:S=24,r=3"] == bits["hqmq:S=24,r=3"] - 4 * 24 * 4 * 16 / (4 * 256 * 64) == 3.5
    assert cache_bits["int4"] == bits["int4"]
    assert err["fp16"] < 1e-3 < err["int4"] < err["int2"]
    assert b.setup_cache() == cache  # deterministic: track_ figures move only with the code
    with pytest.raises(NotImplementedError):
        b.setup(cache, "int8")  # not in this (patched) commit's cache: skipped, not failed


def test_codec_and_peakmem_run(bench):
    mod = bench[1]["quantizer_figures"]
    c = mod.Codec()
    c.setup("kivi:bits=4")
    c.time_encode("kivi:bits=4")
    c.time_decode("kivi:bits=4")
    with pytest.raises(NotImplementedError):  # a spec an older commit does not know: skipped
        c.setup("nosuchquantizer:bits=4")
    p = mod.PackedCache()
    p.setup("int4")
    store = p.peakmem_packed_cache("int4")
    assert len(store) == 2 * p.LAYERS and all(s.bits_per_element == 5.0 for s in store)


def test_ppl_track_on_fp16(bench, monkeypatch):
    mod = bench[1]["model_ppl"]
    monkeypatch.setattr(mod, "SPECS", ["fp16"])
    b = mod.Perplexity()
    cache = b.setup_cache()
    ppl = b.track_ppl(cache, "fp16")
    assert math.isfinite(ppl) and 1 < ppl < 1000
    assert b.track_model_cache_bits(cache, "fp16") == 16.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip path")
def test_gpu_benchmarks_skip_cleanly_on_cpu(bench):
    mod = bench[1]["fused_decode"]
    with pytest.raises(NotImplementedError):
        mod.FusedDecode().setup("int4")
    with pytest.raises(NotImplementedError):
        mod.SdpaFp16().setup()
    mod = bench[1]["decode_step"]
    b = mod.DecodeStep()
    figures = b.setup_cache()
    assert figures == {"why": "needs a CUDA GPU"}
    for cache in mod.CACHES:
        with pytest.raises(NotImplementedError, match="CUDA"):
            b.setup(figures, cache, "graph")


def test_decode_step_is_discovered_over_caches_and_runs(bench):
    found, mods = bench
    for name in ("decode_step.DecodeStep.track_ms_per_step", "decode_step.DecodeStep.track_kv_bytes",
                 "decode_step.DecodeStep.track_decode_peak_bytes"):
        assert name in found, sorted(found)
        assert [[eval(p) for p in ps] for ps in found[name].params] == [mods["decode_step"].CACHES, ["eager", "graph"]]
    # what setup_cache stores is what the tracks read, and a pair it could not take is skipped
    b = mods["decode_step"].DecodeStep()
    figures = {"int4 graph": {"ms_per_step": 1.4, "kv_live_bytes": 10, "decode_peak_bytes": 20},
               "plain graph": {"skipped": "not graphable: DynamicCache"}}
    b.setup(figures, "int4", "graph")
    assert (b.track_ms_per_step(figures, "int4", "graph"), b.track_kv_bytes(figures, "int4", "graph"),
            b.track_decode_peak_bytes(figures, "int4", "graph")) == (1.4, 10, 20)
    with pytest.raises(NotImplementedError, match="DynamicCache"):
        b.setup(figures, "plain", "graph")
