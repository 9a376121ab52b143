"""Bits per element in two parts (METHOD.md 3 and 4 "Bits:"; quantizers/base.py): the
cache's own bytes, and the model constants (tensors drawn from a seed, independent of
the data: rotations, sketches, HQMQ's secondaries, Hadamard signs), regenerated once per
model and reported apart. Packed, QuantizedCache, perplexity records, the distributed
merge (test_distributed.py), results.json validation, the report and `kvqbench list`;
and that the conformance check of declared constants can fail."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvqbench.quantizers import get_quantizer, registry
from kvqbench.quantizers.base import Quantizer, Segment
from kvqbench.quantizers.flatvq import FlatVQ
from kvqbench.suites import conformance
from kvqbench.suites.compare import cli, report, results
from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs
from kvqbench.suites.harness.perplexity import ppl_prefill_then_decode, ppl_quantize_on_write


def _x(d=64, tokens=512, heads=2, batch=1, seed=0):
    return conformance.reference_tensor(d, tokens=tokens, heads=heads, batch=batch, seed=seed)


# ---- Packed ----------------------------------------------------------------------------

@pytest.mark.parametrize("S, cache, total", [(96, 4.25, 4.4375), (256, 4.75, 5.25)])
def test_hqmq_secondaries_are_model_constants_not_cache_bits(S, cache, total):
    """512 tokens, 2 kv-heads, d = 64: codes ceil(log2 24S) + r bits per 4 elements and an
    fp16 r_max per token; the fp16 secondaries (2 x S x 4 x 2 bytes) are constants, which
    the old total charged to the window (+0.19 bits at S=96, +0.5 at S=256)."""
    r = {96: 4, 256: 5}[S]
    p = get_quantizer(f"hqmq:S={S},r={r}").encode(_x())
    assert p.constant == frozenset({"secondaries"})
    assert p.constant_nbytes == 2 * S * 4 * 2
    assert p.cache_nbytes + p.constant_nbytes == p.nbytes
    assert p.cache_bits_per_element == cache and p.bits_per_element == total
    # the cache bits do not depend on S beyond the code width: per-token bytes only
    assert p.cache_nbytes == sum(s.nbytes for s in p.segments)


def test_which_builtins_declare_constants():
    """Seeded tensors are constants; anything fitted to the write stays cache bytes."""
    expect = {"hqmq:S=96,r=4": {"secondaries"}, "hadamard-int4": {"signs"}, "int4": set(), "fp16": set(),
              "kivi2": set(), "flatvq:dim=4,K_bits=8": set()}  # flatvq's codebook is fitted on the write
    for spec, names in expect.items():
        p = get_quantizer(spec).encode(_x(tokens=64))
        assert p.constant == names, spec
        fitted = set(p.shared) - names
        assert p.cache_nbytes == sum(s.nbytes for s in p.segments) + sum(
            p.shared[k].numel() * p.shared[k].element_size() for k in fitted), spec


def test_every_registered_declaration_names_shared_tensors():
    for cls in registry().values():
        for spec in cls.examples():
            q = get_quantizer(spec)
            d = conformance.head_dim_for(spec)
            assert q.constant_shared() <= set(q.make_shared(2, d)), spec


# ---- the conformance check fails for a wrong declaration --------------------------------

def test_declaring_a_fitted_codebook_constant_fails_conformance(monkeypatch):
    conformance.check_constant_shared("flatvq:dim=4,K_bits=6")  # holds as declared (nothing)
    monkeypatch.setattr(FlatVQ, "constant_shared", lambda self: frozenset({"codebook"}))
    with pytest.raises(AssertionError, match="'codebook' is declared a model constant .* depends on the data"):
        conformance.check_constant_shared("flatvq:dim=4,K_bits=6")


@dataclasses.dataclass
class _Cfg:
    bits: int = 4


class _UnseededRotation(Quantizer):
    """A plugin whose "constant" is drawn without a seeded generator: not a function of
    (config, layer, role, seed), so two instances store other bytes."""
    name = "test-unseeded"
    description = "test"
    Config = _Cfg

    def make_shared(self, heads, head_dim):
        return {"signs": (torch.rand(heads, head_dim) > 0.5).to(torch.uint8)}

    def constant_shared(self):
        return frozenset({"signs"})

    def encode_tokens(self, x, shared):
        return Segment({"v": x.half()}, x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        return seg.fields["v"].float()

    def formula_bits(self, head_dim):
        return 16.0


def test_an_unseeded_constant_fails_conformance(monkeypatch):
    from kvqbench import quantizers

    monkeypatch.setattr(quantizers, "get_quantizer", lambda spec, **kw: _UnseededRotation(**kw))
    monkeypatch.setattr(conformance, "get_quantizer", lambda spec, **kw: _UnseededRotation(**kw))
    monkeypatch.setattr(conformance, "head_dim_for", lambda spec: 64)
    with pytest.raises(AssertionError, match="'signs' is declared a model constant .* a write of other data"):
        conformance.check_constant_shared("test-unseeded")


def test_declaring_a_name_make_shared_does_not_give_is_a_clear_error(monkeypatch):
    from kvqbench.quantizers.naive_int import NaiveInt

    monkeypatch.setattr(NaiveInt, "constant_shared", lambda self: frozenset({"rotation"}))
    with pytest.raises(TypeError, match=r"constant_shared\(\) names \['rotation'\], which make_shared does not give"):
        get_quantizer("int4").encode(_x(tokens=8))
    monkeypatch.setattr(NaiveInt, "constant_shared", lambda self: {"rotation"})
    with pytest.raises(TypeError, match="must return a frozenset"):
        get_quantizer("int4").encode(_x(tokens=8))


# ---- the harness: caches and records -------------------------------------------------------

def _model(d=32, layers=2, kv_heads=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=2 * d, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=d, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def test_a_cache_counts_constants_once_per_model_whatever_the_batch():
    model = _model()
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    cache = QuantizedCache("hqmq:S=24,r=3", config=model.config, seed=0, fused=False)
    with torch.inference_mode():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    per_layer_role = 2 * 24 * 4 * 2  # kv-heads x S x 4 x fp16
    assert cache.constant_nbytes() == 2 * 2 * per_layer_role  # 2 layers x K, V: once, not per row
    assert cache.nbytes() == cache.cache_nbytes() + cache.constant_nbytes()
    # as separate one-row caches: the total charges the constants to each of the 3 rows; the cache bytes never
    assert cache.nbytes_as_row_caches() == cache.cache_nbytes_as_row_caches() + 3 * cache.constant_nbytes()
    assert cache.cache_nbytes_as_row_caches() == cache.cache_nbytes()
    assert cache.cache_bits_per_element() < cache.bits_per_element()


@pytest.mark.parametrize("fn, kw", [(ppl_quantize_on_write, {}), (ppl_prefill_then_decode, {"context": 10})])
def test_records_split_the_bits_and_keep_the_total(fn, kw):
    model = _model()
    windows = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(2))
    for spec, constants in (("hqmq:S=24,r=3", 2 * 2 * (2 * 24 * 4 * 2)), ("hadamard-int4", 2 * 2 * (2 * 32 // 8)),
                            ("int4", 0)):
        rec = {b: fn(model, windows, spec, seed=0, batch_size=b, fused=False, **kw) if kw else
               fn(model, windows, spec, seed=0, batch_size=b) for b in (1, 2)}
        for r in rec.values():
            assert r["constant_nbytes"] == constants, spec
            assert r["total_nbytes"] == r["cache_nbytes"] + r["n_windows"] * constants, spec
            assert r["bits_per_element"] == r["total_nbytes"] * 8 / r["cache_elements"]
            assert r["cache_bits_per_element"] == r["cache_nbytes"] * 8 / r["cache_elements"]
            assert (r["cache_bits_per_element"] < r["bits_per_element"]) == (constants > 0), spec
        # batched or one window at a time: the same bytes in every part
        assert all(rec[1][k] == rec[2][k] for k in ("cache_nbytes", "constant_nbytes", "total_nbytes")), spec


# ---- results.json, the report, `kvqbench list` ---------------------------------------------

def _rec(spec, family, seed, cache_bits, total_bits, constant, ppl=10.0, split=True):
    r = {"protocol": "quantize-on-write", "spec": spec, "seed": seed, "family": family, "ppl": ppl,
         "nll_sum": 100.0, "bits_per_element": total_bits, "formula_bits": cache_bits, "wall_s": 1.0}
    if split:
        r.update(cache_bits_per_element=cache_bits, constant_nbytes=constant)
    return r


def test_row_validation_accepts_old_rows_and_checks_new_fields():
    old = _rec("int4", "int", 0, 5.0, 5.0, 0, split=False)
    assert results.row_problem(old) is None
    assert results.row_problem(_rec("int4", "int", 0, 5.0, 5.0, 0)) is None
    assert "cache_bits_per_element" in results.row_problem(dict(old, cache_bits_per_element="4"))
    assert "constant_nbytes = -1, not an integer >= 0" in results.row_problem(dict(old, constant_nbytes=-1))


def test_summarize_uses_cache_bits_and_falls_back_to_the_total_for_old_records():
    recs = [_rec("hqmq:S=96,r=4", "hqmq", s, 4.25, 4.4375, 184320, ppl=10 + s) for s in (0, 1)]
    recs += [_rec("int4", "int", 0, 5.0, 5.0, 0), _rec("old", "int", 0, 3.0, 3.5, 0, split=False)]
    rows = {r["spec"]: r for r in report.summarize(recs, "quantize-on-write")}
    h = rows["hqmq:S=96,r=4"]
    assert (h["bits"], h["bits_total"], h["constant_nbytes"], h["bits_split"]) == (4.25, 4.4375, 184320, True)
    o = rows["old"]
    assert (o["bits"], o["bits_total"], o["constant_nbytes"], o["bits_split"]) == (3.5, 3.5, None, False)


def _meta(tokens=512):
    return {"model": {"name": "m"}, "corpus": {"name": "c"},
            "windows": {"n": 2, "tokens": tokens, "placement": "p", "starts": [0, 512]},
            "protocols": ["quantize-on-write"], "dtype": "float32", "hardware": {}, "versions": {}}


def test_report_table_and_plot_show_cache_bits_constants_and_total(tmp_path):
    recs = [_rec("fp16", "fp16", 0, 16.0, 16.0, 0, ppl=9.0),
            _rec("hqmq:S=96,r=4", "hqmq", 0, 4.25, 4.4375, 184320, ppl=10.0)]
    (tmp_path / "results.json").write_text(json.dumps({"meta": _meta(), "results": recs}))
    md = report.write_report(tmp_path).read_text()
    assert "| cache bits measured | model constants (bytes per model) | total bits (512-token windows) |" in md
    assert "| `hqmq:S=96,r=4` | 1 | 4.250 | 184,320 | 4.438 |" in md
    assert "predate" not in md and "before model constants were counted apart" not in md
    # old records: the total stands in, and the report says so
    old = [_rec("int4", "int", 0, 5.0, 5.0, 0, split=False), _rec("fp16", "fp16", 0, 16.0, 16.0, 0, split=False)]
    (tmp_path / "results.json").write_text(json.dumps({"meta": _meta(), "results": old}))
    md = report.write_report(tmp_path).read_text()
    assert "| `int4` | 1 | 5.000* | ?* | 5.000 |" in md
    assert "records made before model constants were counted apart" in md


def test_pareto_plot_axis_says_cache_bits(tmp_path, monkeypatch):
    labels = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_xlabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel", lambda ax, s, *a, **k: (labels.append(s), real(ax, s, *a, **k))[1])
    rows = report.summarize([_rec("int4", "int", 0, 5.0, 5.0, 0), _rec("old", "int", 0, 3.0, 3.5, 0, split=False)],
                            "quantize-on-write")
    report.plot_pareto(rows, "quantize-on-write", _meta(), tmp_path / "p.png")
    assert labels and labels[-1].startswith("cache bits per element") and "model constants apart" in labels[-1]
    assert "total bits for 1 spec(s) whose records predate the split" in labels[-1]


def test_list_shows_cache_bits_and_constant_bytes(capsys):
    assert cli.main(["list", "hqmq", "hadamard-int", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "[1, 8, 64, d]" in out and "model constants" in out
    # 8 kv-heads: HQMQ S=24 stores 8 x 24 x 4 fp16 secondaries; Hadamard 8 x d/8 sign bytes
    assert re.search(r"hqmq:S=24,r=3\s+3\.500 \( 3\.292\) \+\s+1536 B\s+3\.375 \( 3\.167\) \+\s+1536 B", out), out
    assert re.search(r"hadamard-int4\s+4\.500 \( 4\.500\) \+\s+64 B\s+4\.250 \( 4\.250\) \+\s+128 B", out), out


# ---- the size count of a fused cache in a run ---------------------------------------------
def test_med3_size_count_makes_no_segments():
    # generate's size count at the end of a call (`cache_nbytes`) of a fused Med3x layer
    # whose prefill and steps were encoded on the device (a run: its segments are made when
    # read): the run's bytes from its token views and its flags' outlier count
    # (`KernelStore.run_nbytes`), its segments not made (`_run_outliers` gathers the lists:
    # a dozen ops and a host read per store); the same count as the segments' and as the
    # quantizer's own path (every write through `append`)
    from unittest import mock

    from kvqbench.suites.harness.kv_cache import QuantizedLayer

    x = conformance.reference_tensor(32, tokens=76, heads=2, batch=2, outlier_channels=(1, 9), outlier_scale=20.0)
    x = x.unsqueeze(0).expand(2, -1, -1, -1, -1).clone()  # K and V
    x[1] = x[1].flip(-2)
    layers = []
    for device in (True, False):
        layer = QuantizedLayer("hqmq:S=8,r=4,outliers=med3", 1, seed=0)
        layer.fused_wanted, layer.prefill = True, "exact"
        with torch.inference_mode(), (contextlib.nullcontext() if device else  # the quantizer's append
                                      mock.patch.object(QuantizedLayer, "_device_write", lambda self, k, v: False)):
            layer.update(x[0, :, :, :70], x[1, :, :, :70])
            for t in range(70, 76):
                layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
        layers.append(layer)
    fused, old = layers
    assert fused.mode == "fused" and all(s.in_run for s in fused.stores.values())
    assert int(fused.stores["K"].outlier_len.sum()) > 0
    with mock.patch.object(type(fused.stores["K"]), "_run_outliers", side_effect=AssertionError("segments made")):
        fast, elements = fused.cache_nbytes(), fused.numel()  # (generate counts both)
        route = fused.attention_route(4, torch.float32)  # (the protocols' label of their steps)
    assert route in ("cuda", "triton")
    assert fast == sum(p.cache_nbytes for p in fused.packed.values()) == fused.cache_nbytes() == old.cache_nbytes()
    assert elements == sum(p.numel for p in fused.packed.values()) == old.numel() == 2 * x[0].numel()


def test_serving_summary_reads_the_run_and_the_latency_report_beside_it(tmp_path):
    """The report's "serving at a glance": memory per token from the model's shape and the
    cache bits, PPL against fp16, which specs a fused kernel reads (spherical: none, dense
    steps), and the GPU backend and speed only where a latency report at this head dim
    timed the spec (named with its source); none beside the run: the report says so."""
    run = tmp_path / "reports" / "run"
    run.mkdir(parents=True)
    meta = dict(_meta(), model={"name": "m", "n_layers": 2, "n_kv_heads": 2, "head_dim": 64})
    recs = [_rec("fp16", "fp16", 0, 16.0, 16.0, 0, ppl=10.0), _rec("int4", "int", 0, 5.0, 5.0, 0, ppl=11.0),
            dict(_rec("spherical4", "spherical", 0, 4.25, 4.26, 1440, ppl=10.5), decode_attention="dense")]
    (run / "results.json").write_text(json.dumps({"meta": meta, "results": recs}))
    md = report.write_report(run).read_text()
    assert "## Serving at a glance" in md and "no kernel speed: no latency report at this head dim" in md
    # 2 layers x 2 kv heads x 64 dims x K and V = 512 elements per token: int4's 5 bits = 0.31 KiB
    assert "| `int4` | 5.000 | 0.31 | 3.20x smaller | +10.00% | - | fused |" in md
    assert "| `spherical4` | 4.250 | 0.27 | 3.76x smaller | +5.00% | - | none: dense steps; this run: dense |" in md
    lat = {"env": {"gpu": "GPU-X", "time": "2026-12-05 04:40:00"}, "shape": {"Hq": 32, "Hkv": 8, "d": 64},
           "method_specs": {"fused-int4": "int4", "fake-quant": "fp16"},
           "latency": [{"method": "fused-int4-graph", "B": 8, "T": 32768, "backend": "cuda",
                        "speedup_vs_fp16_sdpa": 2.25},
                       {"method": "fused-int4-graph", "B": 1, "T": 32768, "backend": "cuda",
                        "speedup_vs_fp16_sdpa": 9.0},
                       {"method": "fake-quant-graph", "B": 8, "T": 32768, "backend": "sdpa",
                        "speedup_vs_fp16_sdpa": 0.1}]}
    (tmp_path / "reports" / "latency" / "d64").mkdir(parents=True)
    (tmp_path / "reports" / "latency" / "d64" / "latency.json").write_text(json.dumps(lat))
    (tmp_path / "reports" / "latency" / "latency.json").write_text(json.dumps(dict(lat, shape={"d": 128})))
    md = report.write_report(run).read_text()
    assert "latency/d64/latency.json: GPU-X, 2026-12-05 04:40" in md
    assert "| `int4` | 5.000 | 0.31 | 3.20x smaller | +10.00% | - | fused | CUDA, 2.25x |" in md
    assert "| `fp16` | 16.000 | 1.00 | 1.00x smaller | +0.00% | - | fused | - |" in md  # (fake-quant is no route)
