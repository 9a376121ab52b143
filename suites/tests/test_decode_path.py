"""The decode engine: the device store, fused attention inside the model, batched windows.

- `KernelStore` appends equal `flatten(Packed)` of the same writes (the store is the
  kernels' layout, filled in place), and hold each stored byte once.
- Greedy `generate` through the fused kernels (the "kvqbench" attention) produces the
  same tokens as the dense (dequantize-then-SDPA) path, and the fused layers keep no
  decoded history; prefill-then-decode PPL agrees within 0.1%.
- Batched windows give the same NLL and bits as one window at a time, for every
  registered quantizer (iterated from the registry, so new plugins are covered).

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before
triton is imported), tiny shapes, all-fp32 arithmetic there.

(About 490 lines: the decode engine end to end (store, fused attention in the model, batched
windows): one subject, one file.)
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.kernels.store import KernelStore  # noqa: E402
from kvqbench.quantizers import get_quantizer, registry  # noqa: E402
from kvqbench.suites.conformance import all_example_specs, head_dim_for  # noqa: E402
from kvqbench.suites.harness.attention import fused_attention  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedCache, QuantizedLayer, cache_kwargs  # noqa: E402
from kvqbench.suites.harness.perplexity import (  # noqa: E402
    ppl_prefill_then_decode,
    ppl_quantize_on_write,
    rows_independent,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

VOCAB = 128
DEV = torch.device("cuda" if CUDA else "cpu")
FUSED_SPECS = ["fp16", "int4", "hqmq:S=8,r=4", "hqmq:S=8,r=4,outliers=med3", "kivi:bits=2,group=8,residual=8", "fp8-e4m3"]
STORE_SPECS = FUSED_SPECS + ["kivi:bits=2,group=4,residual=8,window=fixed", "fp8-e5m2"]


def tiny_llama(head_dim=32, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=256, initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().to(dtype).to(DEV)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def old_prefill():
    """A fused cache's multi-token writes (the prefill) through the quantizer's `append`, as
    before the device prefill (`QuantizedLayer._device_write`). The tests that use it are
    about the decode steps, which still encode their tokens on the device and read the
    store through the fused kernels; that the device prefill stores the same bytes, and
    that greedy decoding from it gives the old path's logits, is test_prefill_steps.py's,
    for every format family that takes it. Under the Triton interpreter the device prefill
    runs a kernel program per (token, row, head) for each layer and role: most of these
    tests' time (a 40-token prefill at batch 2: 640 programs, against 32 for int4's two
    decode steps)."""
    return mock.patch.object(QuantizedLayer, "_device_write", lambda self, k, v: False)


def tokens(n, batch=1, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _new(old, new):
    n = t = 0
    for a, b in zip(old.segments, new.segments):
        if a is not b:
            break
        n, t = n + 1, t + a.tokens
    return new.segments[n:], t


# ---- the store ----------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("spec", STORE_SPECS)
def test_store_appends_equal_flatten(spec, role):
    q = get_quantizer(spec, role=role, seed=1)
    x = torch.randn(2, 2, 150, 32, generator=torch.Generator().manual_seed(0))
    x[..., 3] *= 8  # a hot channel: Med3x finds outliers, more in some rows than others
    packed = q.encode(x[:, :, :37].half())
    store = KernelStore.create(packed, role)
    assert store is not None
    for t in range(37, 150):  # one-token writes across several capacity doublings
        old, packed = packed, q.append(packed, x[:, :, t:t + 1].half())
        store.append(*_new(old, packed))
        if t == 60:
            earlier, earlier_digest = packed, packed.digest()
    assert earlier.digest() == earlier_digest  # later appends leave an earlier Packed's bytes alone
    ref, got = L.flatten(packed, role), store.flat
    if isinstance(ref, L.KIVIFlat):
        rows = ref.n_groups * (1 if role == "K" else ref.group)
        assert (got.n_groups, got.T_res) == (ref.n_groups, ref.T_res)
        for name in ("codes", "scale", "zero"):
            assert torch.equal(getattr(got, name)[:, :, :rows], getattr(ref, name)), name
        assert torch.equal(got.residual[:, :, :ref.T_res], ref.residual[:, :, :ref.T_res])
    else:
        first = getattr(got, store.format.token_fields[0])
        assert got.T == ref.T == 150 and first.shape[2] >= 150  # capacity beyond T
        for name in store.format.token_fields:
            if getattr(ref, name, None) is not None:
                assert torch.equal(getattr(got, name)[:, :, :150], getattr(ref, name)), name
        if isinstance(ref, L.FP8Flat):
            assert torch.equal(got.scale, ref.scale)  # fitted on the first write, then fixed
        if getattr(ref, "flags", None) is not None:
            counts = store.outlier_len.view(2, 2)
            assert counts.min() < counts.max()  # rows differ: the per-(b, h) lists matter
            for b in range(2):
                for h in range(2):
                    n = int(counts[b, h])
                    assert torch.equal(got.outliers[b, h, :n], ref.outliers[b, h, :n])
            nblk = -(-150 // L.OUTLIER_BLOCK)
            assert torch.equal(got.outlier_index[:, :, :nblk], ref.outlier_index[:, :, :nblk])
    # The store holds the quantizer's bytes exactly (no derived state counted) ...
    seg_bytes = sum(t.numel() * t.element_size() for s in packed.segments for t in s.fields.values())
    assert store.stored_nbytes == seg_bytes == packed.nbytes - sum(
        t.numel() * t.element_size() for t in packed.shared.values())
    # ... and the segments it absorbed read their fields from its buffers (held once).
    field = "codes" if "codes" in store.buffers else store.format.token_fields[0]
    buf = store.buffers[field].buf
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert all(lo <= s.fields[field].data_ptr() < hi for s in packed.segments if field in s.fields)
    assert torch.equal(q.decode(dataclasses_copy(packed)), q.decode(packed))


def dataclasses_copy(packed):
    """The same Packed with every field cloned: decoding it must not depend on the store."""
    import dataclasses

    from kvqbench.quantizers import Segment

    segs = [Segment({k: v.clone() for k, v in s.fields.items()}, s.tokens) for s in packed.segments]
    return dataclasses.replace(packed, segments=segs)


def test_store_refuses_formats_without_kernel():
    # 70 tokens: two quantized per-channel groups (fields named codes/scale/zero, as
    # per-token groups name theirs) and a window; the values stay per-token groups.
    x = torch.randn(1, 2, 70, 32)
    assert KernelStore.create(get_quantizer("int4:keys=per-channel", role="K").encode(x), "K") is None
    assert KernelStore.create(get_quantizer("int4:keys=per-channel", role="V").encode(x), "V") is not None


@pytest.mark.parametrize("spec", sorted({s for s in all_example_specs()}))
def test_every_format_fused_or_dense_reads_the_same_history(spec):
    """Whatever a registered format is, a fused=True cache either serves its decode steps
    through a store whose kernel reads it right, or leaves the layer dense: logits equal
    the dense cache's (an int4:keys=per-channel store once read its key groups as
    per-token groups and went NaN on the H200). Prefill 40 tokens (past a 32-token group;
    through the quantizer, `old_prefill`), then 2 decode steps (each fused one encodes its
    token on the device and reads the store)."""
    m = _model_for(spec)
    ids = tokens(42, batch=2, seed=3).to(DEV)
    out, modes = {}, {}
    for fused in (False, True):
        cache = QuantizedCache(spec, config=m.config, fused=fused, seed=1)
        with torch.inference_mode(), fused_attention(m), old_prefill():
            steps = [m(input_ids=ids[:, :40], **cache_kwargs(m, cache), use_cache=True).logits[:, -1:]]
            steps += [m(input_ids=ids[:, t:t + 1], **cache_kwargs(m, cache), use_cache=True).logits
                      for t in range(40, 42)]
        out[fused], modes[fused] = torch.cat(steps, 1), {layer.mode for layer in cache.layers}
    assert modes[False] == {"dense"} and len(modes[True]) == 1
    assert torch.isfinite(out[True]).all()
    # Not bit-equal: fused and dense attention sum in other orders (~1e-6 here under the
    # interpreter's fp32; a GPU's fp16 dots ~1e-3), and a format that stores fp16 (KIVI's
    # 40-token window at R=128) rounds layer 1's slightly different K/V to the other
    # neighbour now and then: one fp16 ulp (5e-4) in a stored value moved logits of
    # magnitude ~5 by 3.5e-4 (measured, kivi:bits=2). A misread store errs by O(1).
    assert torch.allclose(out[True], out[False], atol=5e-2 if CUDA else 1e-2, rtol=0), modes[True]


# ---- fused attention in the model -------------------------------------------------------------
@pytest.mark.parametrize("spec", FUSED_SPECS)
def test_fused_generate_equals_dense(model, spec):
    ids = tokens(40, batch=2).to(DEV)
    with torch.inference_mode():
        dense = QuantizedCache(spec, config=model.config)
        out_dense = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(model, dense))
        with fused_attention(model), old_prefill():
            fused = QuantizedCache(spec, config=model.config, fused=True)  # True: the interpreter on a CPU
            out_fused = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(model, fused))
    assert model.config._attn_implementation == "sdpa"  # restored
    assert all(layer.mode == "dense" for layer in dense.layers)
    assert all(layer.mode == "fused" for layer in fused.layers)
    # The fused layers hold no decoded history: only the stores.
    assert all(layer.decoded == {"K": None, "V": None} and layer.keys is None for layer in fused.layers)
    assert all(layer.fallbacks == 0 for layer in fused.layers)
    # The decode steps were encoded on the device (kernels/step_encode.py), not by `append`.
    assert all(s.in_run for layer in fused.layers for s in layer.stores.values())
    assert torch.equal(out_dense, out_fused)
    assert fused.nbytes() == dense.nbytes() and fused.get_seq_length() == dense.get_seq_length()


@pytest.mark.parametrize("spec", ["hqmq:S=8,r=4,outliers=med3", "int4:group=16", "kivi:bits=2,group=8,residual=8"])
def test_fused_generate_at_a_padded_head_dim(spec):
    """A model whose head dim is not a power of two (48 here; Phi-3's 96) decodes through
    the fused kernels (padded to 64, kernels/triton/common.py `pad_cols`), not step by step
    through the dense fallback they once forced (every step counted in `fallbacks`)."""
    m = tiny_llama(head_dim=48)
    ids = tokens(20, batch=2).to(DEV)
    with torch.inference_mode():
        dense = QuantizedCache(spec, config=m.config)
        out_dense = m.generate(ids, max_new_tokens=4, do_sample=False, **cache_kwargs(m, dense))
        with fused_attention(m), old_prefill():
            fused = QuantizedCache(spec, config=m.config, fused=True)
            out_fused = m.generate(ids, max_new_tokens=4, do_sample=False, **cache_kwargs(m, fused))
    assert all(layer.mode == "fused" and layer.fallbacks == 0 for layer in fused.layers)
    assert torch.equal(out_dense, out_fused)


@pytest.mark.parametrize("spec", ["int4", "hqmq:S=8,r=4,outliers=med3"])
def test_prefill_then_decode_ppl_fused_equals_dense(model, spec):
    windows = tokens(40, batch=2, seed=5)
    dense = ppl_prefill_then_decode(model, windows, spec, context=32, fused=False)
    with old_prefill():
        fused = ppl_prefill_then_decode(model, windows, spec, context=32, fused=True)
    # Issue 9's 0.1%. On a GPU HQMQ's kernel reads an fp16 codebook (within an fp16 ulp
    # per component) with fp16 dots: the H200 measured 1.8e-3 for Med3x on these 16 scored
    # tokens of a random model (PPL ~750); 5e-3 there.
    assert fused["ppl"] == pytest.approx(dense["ppl"], rel=5e-3 if CUDA and "hqmq" in spec else 1e-3)
    assert fused["bits_per_element"] == dense["bits_per_element"]
    # the record says what the steps read the history with: the fused kernel's backend (the
    # interpreter's Triton on a CPU), or the decoded history
    assert dense["decode_attention"] == "dense"
    assert fused["decode_attention"] in (("cuda", "triton") if CUDA else ("triton",)), fused["decode_attention"]


# (Med3x's device steps: test_graph_step.py, against its eager fused steps byte for byte;
# here under the interpreter they cost 36 s of CI for the protocol plumbing int4 covers.)
@pytest.mark.parametrize("spec,mode", [("int4", "device"), ("kivi:bits=2", "device"),
                                       ("int4:keys=per-channel", "eager")])
def test_prefill_then_decode_graph_steps_equal_eager(model, spec, mode):
    """graph=True: the decode steps go through GraphedDecodeStep (on a CPU its uncaptured
    device-position steps, the captured graph's kernels; CUDA replays them): the same NLL
    and bytes as the eager fused steps; per-channel int keys (a windowed append) cannot
    take them and stay eager."""
    windows = tokens(40, batch=2, seed=5)
    with old_prefill():  # the same prefill for both
        eager = ppl_prefill_then_decode(model, windows, spec, context=30, fused=True, graph=False)
        graphed = ppl_prefill_then_decode(model, windows, spec, context=30, fused=True, graph=True)
    assert (eager["decode_mode"], graphed["decode_mode"]) == ("eager", "graph" if CUDA and mode == "device" else mode)
    assert graphed["nll_sum"] == pytest.approx(eager["nll_sum"], rel=1e-6)
    assert graphed["bits_per_element"] == eager["bits_per_element"]
    # the same kernels either way; per-channel keys: no fused kernel reads them (dense steps)
    assert graphed["decode_attention"] == eager["decode_attention"]
    assert eager["decode_attention"] in (("dense",) if mode == "eager" else ("cuda", "triton") if CUDA else ("triton",))


def test_fused_logits_match_dense_step_by_step(model):
    # The fused step really ran (not a silent fallback) and reads the quantized store:
    # its logits match the dense path to fp32 accuracy and differ from the fp16 cache's.
    ids = tokens(36).to(DEV)
    logits = {}
    for name, spec, fused in (("dense", "int2", False), ("fused", "int2", True), ("fp16", "fp16", False)):
        cache = QuantizedCache(spec, config=model.config, fused=fused)
        with torch.inference_mode(), fused_attention(model), old_prefill():
            model(input_ids=ids[:, :32], **cache_kwargs(model, cache), use_cache=True)
            logits[name] = torch.cat([model(input_ids=ids[:, t:t + 1], **cache_kwargs(model, cache),
                                            use_cache=True).logits for t in range(32, 36)], 1)
        assert all(layer.mode == ("fused" if fused else "dense") for layer in cache.layers)
    assert torch.allclose(logits["fused"], logits["dense"], atol=1e-4, rtol=1e-4)
    assert (logits["fused"] - logits["fp16"]).abs().max() > 1e-2


# ---- batched windows over the registry -----------------------------------------------------------
_MODELS: dict[int, LlamaForCausalLM] = {}


def _accepts(spec, d) -> bool:
    q = get_quantizer(spec)
    try:
        q.check_input(torch.zeros(1, 1, 1, d))
    except ValueError:
        return False
    return d % getattr(q.config, "group", 1) == 0


def _model_for(spec):
    d = 32 if _accepts(spec, 32) else head_dim_for(spec)  # the smallest model that fits
    if d not in _MODELS:
        _MODELS[d] = tiny_llama(head_dim=d)
    return _MODELS[d]


@pytest.mark.parametrize("name", sorted(registry()))
def test_batched_windows_equal_one_by_one(name):
    windows = tokens(20, batch=3, seed=11)
    for spec in registry()[name].examples():
        m = _model_for(spec)
        # (the dense path: fused decode steps are compared with it above)
        for fn, kw in ((ppl_quantize_on_write, {}), (ppl_prefill_then_decode, {"context": 14, "fused": False})):
            one = fn(m, windows, spec, seed=2, batch_size=1, **kw)
            many = fn(m, windows, spec, seed=2, batch_size=3, **kw)
            assert many["batch_size"] == (3 if rows_independent(registry()[name]) else 1)
            # Measured (AMD EPYC, 2 threads): batched vs one-by-one differ by ~1e-7 relative,
            # except where a matmul's float rounding moves one element across a rounding
            # boundary: 3.2e-4 for hadamard-int3 prefill-then-decode (one 3-bit flip). Another
            # seed (what mixing rows' statistics would resemble) moves it 2e-4..3.5e-2, median
            # ~1e-2; 1e-3 passes the flip with a 3x margin.
            assert many["nll_sum"] == pytest.approx(one["nll_sum"], rel=1e-3), (spec, fn.__name__)
            assert many["bits_per_element"] == pytest.approx(one["bits_per_element"], rel=1e-12), spec
            assert many["n_predicted"] == one["n_predicted"]


# ---- the embedded model (real weights) ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["int4", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3", "kivi:bits=4", "fp8-e4m3"])
def test_embedded_model_greedy_fused_equals_dense(spec):
    # The embedded SmolLM2-135M (fp32 on CPU: the kernels' exact path under the
    # interpreter), a corpus prompt, a few greedy tokens: fused == dense, every layer fused.
    from kvqbench.suites.harness.corpora import load_corpus
    from kvqbench.suites.harness.models import load_model

    model, tok, _ = load_model("smollm2-135m", device=DEV)
    text, _ = load_corpus()
    ids = tok(text[:400], return_tensors="pt").input_ids[:, :48].to(DEV)
    outs = {}
    with torch.inference_mode(), fused_attention(model):
        for fused in (False, True):
            cache = QuantizedCache(spec, config=model.config, fused=fused)
            outs[fused] = model.generate(ids, max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
            assert all(layer.mode == ("fused" if fused else "dense") for layer in cache.layers)
            assert all(layer.fallbacks == 0 for layer in cache.layers)
    assert torch.equal(outs[True], outs[False])


# ---- the dense path ---------------------------------------------------------------------------------
def test_dense_history_grows_in_place(model, monkeypatch):
    # Each decode step decodes only its own token into a buffer that is preallocated
    # and written in place (no re-decode of the history, no O(T) concatenation).
    q_cls = type(get_quantizer("int4"))
    decoded_tokens = []
    real = q_cls.decode_tokens

    def spy(self, seg, shared, shape):
        decoded_tokens.append(shape[2])
        return real(self, seg, shared, shape)

    monkeypatch.setattr(q_cls, "decode_tokens", spy)
    ids = tokens(30).to(DEV)
    cache = QuantizedCache("int4", config=model.config, fused=False, capacity=30)
    with torch.inference_mode():
        model(input_ids=ids[:, :20], **cache_kwargs(model, cache), use_cache=True)
        ptrs = [layer.decoded["K"].buf.data_ptr() for layer in cache.layers]
        decoded_tokens.clear()
        for t in range(20, 30):
            model(input_ids=ids[:, t:t + 1], **cache_kwargs(model, cache), use_cache=True)
    assert decoded_tokens == [1] * (10 * 2 * 2)  # steps x layers x roles, one token each
    assert [layer.decoded["K"].buf.data_ptr() for layer in cache.layers] == ptrs
    assert all(layer.keys.shape[2] == 30 and layer.decoded["K"].capacity >= 30 for layer in cache.layers)


def test_fused_cache_needs_the_fused_attention(model):
    cache = QuantizedCache("int4", config=model.config, fused=True)
    ids = tokens(10).to(DEV)
    with torch.inference_mode():
        model(input_ids=ids[:, :9], **cache_kwargs(model, cache), use_cache=True)  # prefill: dense SDPA
        with pytest.raises(RuntimeError, match="fused_attention"):
            model(input_ids=ids[:, 9:], **cache_kwargs(model, cache), use_cache=True)


# ---- the benchmark's plumbing --------------------------------------------------------------------
def test_decode_benchmark_plumbing(tmp_path):
    # The end-to-end benchmark on a tiny random model on the CPU: every configuration
    # recorded in both run modes (graph rows of caches a graph cannot take name the
    # reason: the DynamicCache, and KIVI on a CPU, dense there with a windowed append;
    # int4 takes device-position steps: fused and captured on CUDA, dense and uncaptured
    # on a CPU), the report rendered from the JSON (the figures need a GPU).
    import json

    from kvqbench.suites.bench.decode.__main__ import main

    out = tmp_path / "decode"
    assert main(["--shape", "tiny", "--contexts", "40", "--batches", "1", "2", "--steps", "2", "--warmup", "1",
                 "--specs", "plain", "int4", "kivi:bits=2,group=8,residual=8", "--dtype", "float32",
                 "--out", str(out)]) == 0
    run = json.loads((out / "decode_tiny.json").read_text())  # named after its shape: never over the Llama run's
    got = {(r["spec"], r["batch"], r["run"]) for r in run["results"]}
    assert got == {(s, b, m) for s in ("plain", "int4", "kivi:bits=2,group=8,residual=8") for b in (1, 2)
                   for m in ("eager", "graph")}
    for r in run["results"]:
        graphable = r["spec"] == "int4" or (r["spec"] != "plain" and DEV.type == "cuda")
        assert r["start_tokens"] == 40 + (0 if r["run"] == "eager" else 3)
        if r["run"] == "graph" and not graphable:
            assert "not graphable" in r["skipped"] and "ms_per_step" not in r
        else:
            assert r["seq_length"] == r["start_tokens"] + 3 and r["ms_per_step"] > 0
        if r["run"] == "graph" and graphable:
            assert r["graph_mode"] == ("graph" if DEV.type == "cuda" else "device")
            assert (r["graph_why"] is None) == (DEV.type == "cuda")
    assert "- plain: not graphable" in (out / "decode_tiny.md").read_text()
    costs = {(c["spec"], c["step_encode"]) for c in run["write_cost"]}
    assert ("int4", True) in costs and ("int4", False) in costs
    assert all(c["max_ops"] + c["max_launches"] > 0 for c in run["write_cost"])
    md = (out / "decode_tiny.md").read_text()
    assert "| 40 | 2 | int4 | eager |" in md and "## Targets" in md
    assert "- plain: not graphable: DynamicCache" in md
    assert ("- kivi:bits=2,group=8,residual=8: not graphable" in md) == (DEV.type == "cpu")


def test_engine_table_reads_each_graphed_format_against_the_graphed_fp16_engine():
    from kvqbench.suites.bench.decode.render import engine_table

    def row(spec, ms, run="graph", ctx=4096, b=1):
        return dict(spec=spec, context=ctx, batch=b, run=run, ms_per_step=ms, mode=["fused"], kv_live_bytes=1)

    rows = [row("fp16", 4.0), row("fp16", 9.0, run="eager"), row("int4", 2.0), row("int4", 1.0, run="eager"),
            row("plain-compiled", 3.0, run="compiled"), row("plain", 8.0, run="eager"),
            row("fp8-e4m3", 5.0), row("fp16", 10.0, ctx=32768, b=8), row("int4", 4.0, ctx=32768, b=8),
            dict(spec="kivi:bits=4", context=4096, batch=1, run="graph", skipped="not graphable: KIVI")]
    lines = engine_table({"results": rows})
    assert lines[0] == "| | ctx 4096, batch 1 | ctx 32768, batch 8 |"  # cells not measured are left out
    by = {ln.split(" | ")[0].lstrip("| "): ln for ln in lines[2:]}
    assert "| 4.000 | 10.000 |" in by["fp16 engine, graphed (ms/step)"]
    # graph against graph: int4's eager 1.0 ms is not what it is read by
    assert "**2.00x** (2.000)" in by["`int4` graphed: speed-up over fp16 engine (ms/step)"]
    assert "**2.50x** (4.000)" in by["`int4` graphed: speed-up over fp16 engine (ms/step)"]
    assert "**0.80x** (5.000) | not run" in by["`fp8-e4m3` graphed: speed-up over fp16 engine (ms/step)"]
    assert "3.000 (0.75x)" in by["transformers StaticCache + torch.compile (ms/step; fp16 engine speed-up)"]
    assert "8.000 (2.00x)" in by["transformers DynamicCache, eager (ms/step; fp16 engine speed-up)"]
    assert not any("kivi" in k for k in by)  # skipped rows give no figure


def test_decode_benchmark_resume_fills_in_only_what_is_missing(tmp_path, capsys, monkeypatch):
    # A grid cut by its budget is completed by a second call with --resume: the rows there
    # are kept as they are, only the missing (cache, context, batch) are measured; a file
    # from other settings is refused with the reason, and nothing is written over it.
    import json

    from kvqbench.suites.bench.decode.__main__ import main

    base = ["--shape", "tiny", "--steps", "2", "--warmup", "1", "--specs", "plain", "int4", "--dtype", "float32",
            "--modes", "eager", "--no-write-cost", "--out", str(tmp_path)]
    assert main(base + ["--pairs", "40:1"]) == 0
    path = tmp_path / "decode_tiny.json"
    first = json.loads(path.read_text())
    assert main(base + ["--pairs", "40:1", "40:2", "--resume"]) == 0
    run = json.loads(path.read_text())
    assert [r for r in run["results"] if r["batch"] == 1] == first["results"]  # kept, not re-measured
    assert {(r["spec"], r["batch"]) for r in run["results"]} == {(s, b) for s in ("plain", "int4") for b in (1, 2)}
    assert run["resumed_from"] == [first["environment"]["time"]]
    run["notes"] = ["a note on these rows"]
    path.write_text(json.dumps(run))
    assert "resumed: earlier calls started" in (tmp_path / "decode_tiny.md").read_text()
    assert main(base + ["--pairs", "40:2", "--resume", "--remeasure", "int4"]) == 0  # int4 at 40:2 again
    again = json.loads(path.read_text())
    assert len(again["results"]) == len(run["results"]) and again["notes"] == ["a note on these rows"]
    assert [r for r in again["results"] if r["spec"] == "plain"] == [r for r in run["results"] if r["spec"] == "plain"]
    new_int4 = [r for r in again["results"] if r["spec"] == "int4" and r["batch"] == 2]
    assert len(new_int4) == 1 and new_int4 != [r for r in run["results"] if r["spec"] == "int4" and r["batch"] == 2]
    before = path.read_text()
    import kvqbench.suites.bench.decode.measure as measure

    monkeypatch.setattr(measure, "build_model", lambda *a, **k: pytest.fail("model built before the refusal"))
    assert main(base[:3] + ["3"] + base[4:] + ["--pairs", "40:1", "--resume"]) == 2  # other --steps
    assert "measured under other conditions (config steps: 2 there, 3 now)" in capsys.readouterr().err
    assert path.read_text() == before


def test_host_profile_reports_each_cache_with_its_own_code_in_the_profile(capsys):
    # The eager-step profiler (bench/decode/host_profile.py) on the tiny shape: one header
    # per cache, and the quantized cache's profile reaches the cache's own write path.
    from kvqbench.suites.bench.decode.host_profile import main

    assert main(["--shape", "tiny", "--specs", "plain", "int4", "--context", "24", "--steps", "2", "--top", "1000",
                 "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    parts = text.split("== ")[1:]
    assert [p.split(",")[0] for p in parts] == ["plain", "int4"]
    assert "kv_cache.py" in parts[1] and "kv_cache.py" not in parts[0]


def test_host_profile_prefill_tables_each_cache_and_its_extra_work(capsys):
    # `--prefill`: one profiled prefill per cache, its operators tabled; the quantized cache
    # does work the plain one does not (its encode's bit shifts)
    from kvqbench.suites.bench.decode.host_profile import main

    assert main(["--prefill", "--shape", "tiny", "--specs", "plain", "int4", "--context", "24", "--top", "1000",
                 "--device", "cpu"]) == 0
    parts = capsys.readouterr().out.split("== ")[1:]
    assert [p.split(",")[0] for p in parts] == ["plain", "int4"]
    assert all("## prefill:" in p and "by self host time" in p for p in parts)
    assert "aten::__rshift__" in parts[1] and "aten::__rshift__" not in parts[0]


# ---- the prefill's write on the device -------------------------------------------------------
@pytest.mark.parametrize("fused,expect", [(None, "KernelHQMQ"), (False, "HQMQ")])
def test_a_fused_cuda_prefill_writes_through_the_formats_device_encoder(fused, expect):
    # A fused cache on CUDA encodes its prefill with HQMQ's search as a Triton kernel
    # (registry `device_encoder`), storing what `encode_with_kernel` stores; a cache that
    # must stay dense (fused=False) and every CPU write use the quantizer itself.
    from kvqbench.kernels.hqmq_encode import encode_with_kernel
    from kvqbench.suites.harness.kv_cache import QuantizedLayer

    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 2, 70, 64, generator=g).to(DEV, torch.float16) for _ in range(2))
    # With step encoding on, every HQMQ prefill of a fused cache takes the step encoder's
    # device path (`Format.multi_step`, Med3x included); off, it goes through the
    # quantizer, with the device encoder's search
    layer = QuantizedLayer("hqmq:S=96,r=4,outliers=med3", 0, seed=5)
    layer.fused_wanted, layer.step_encode = fused, False
    layer.update(k, v)
    writer = layer._writer("K", k)
    if not CUDA:
        assert writer is layer.quantizers["K"]  # CPU writes: the quantizer's own search
        return
    assert type(writer).__name__ == expect
    want = (encode_with_kernel if expect == "KernelHQMQ" else lambda q, x: q.encode(x))(layer.quantizers["K"], k)
    assert layer.packed["K"].digest() == want.digest()
