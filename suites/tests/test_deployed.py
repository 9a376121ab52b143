"""The `deployed` protocol: the prompt attends to its own K/V at full precision while
storing them quantized (`QuantizedCache(prefill="exact")`); only decode steps read the
quantized cache, and only their predictions are scored."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvqbench.quantizers import get_quantizer
from kvqbench.suites.harness.kv_cache import QuantizedCache, QuantizedLayer, cache_kwargs
from kvqbench.suites.harness.perplexity import ppl_deployed, ppl_prefill_then_decode, twins_unsupported

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
VOCAB = 128


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def ids(n, batch=2, seed=3):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", ["int2", "kivi:bits=2,group=8,residual=8", "hqmq:S=8,r=3"])
def test_exact_prefill_attends_like_the_plain_cache_and_stores_the_quantized_kv(model, spec):
    x = ids(24)
    with torch.inference_mode():
        plain = DynamicCache(config=model.config)
        want = model(input_ids=x, **cache_kwargs(model, plain), use_cache=True).logits
        exact = QuantizedCache(spec, config=model.config, prefill="exact")
        got = model(input_ids=x, **cache_kwargs(model, exact), use_cache=True).logits
        quantized = QuantizedCache(spec, config=model.config)
        harsh = model(input_ids=x, **cache_kwargs(model, quantized), use_cache=True).logits
    assert torch.equal(got, want)  # the prompt's own attention never saw a quantized value
    assert not torch.equal(harsh, want)  # (the default protocol's prefill does)
    # what it stored: the plain model's K/V through the quantizer, layer by layer
    for layer in range(model.config.num_hidden_layers):
        k_plain = plain.layers[layer].keys
        q = get_quantizer(spec, layer=layer, role="K", seed=0)
        stored = exact.layers[layer].read("K")
        assert torch.equal(stored, q.decode(q.encode(k_plain)).to(stored.dtype))


def test_decode_steps_after_an_exact_prefill_read_the_quantized_cache(model):
    x = ids(20)
    with torch.inference_mode():
        plain = DynamicCache(config=model.config)
        model(input_ids=x[:, :16], **cache_kwargs(model, plain), use_cache=True)
        want = model(input_ids=x[:, 16:17], **cache_kwargs(model, plain), use_cache=True).logits
        exact = QuantizedCache("int2", config=model.config, prefill="exact")
        model(input_ids=x[:, :16], **cache_kwargs(model, exact), use_cache=True)
        got = model(input_ids=x[:, 16:17], **cache_kwargs(model, exact), use_cache=True).logits
    assert not torch.allclose(got, want, atol=1e-4)  # the step read 2-bit K/V
    assert exact.get_seq_length() == 17


def test_deployed_scores_the_decode_steps_only(model):
    w = ids(40, batch=3, seed=5)
    plain = ppl_deployed(model, w, None, context=30)
    fp16 = ppl_deployed(model, w, "fp16", context=30)
    int2 = ppl_deployed(model, w, "int2", context=30)
    harsh = ppl_prefill_then_decode(model, w, "int2", context=30)
    for r in (plain, fp16, int2):
        assert r["protocol"] == "deployed" and r["n_predicted"] == 3 * (40 - 1 - 30)
        assert r["decode_steps"] == 9 and r["context"] == 30
    # fp16 storage of fp32 K/V: the decode steps see fp16 rounding only
    assert fp16["ppl"] == pytest.approx(plain["ppl"], rel=1e-3)
    assert int2["ppl"] != pytest.approx(plain["ppl"], rel=1e-3)
    assert harsh["n_predicted"] == 3 * (40 - 30)  # prefill-then-decode also scores the prefill's last logit
    # what the steps read the history with: the model's own cache through SDPA; ours on a CPU
    # by default the decoded history (fused kernels run there only on request)
    assert plain["decode_attention"] == "sdpa"
    assert int2["decode_attention"] in (("cuda", "triton") if torch.cuda.is_available() else ("dense",))
    assert int2["bits_per_element"] == harsh["bits_per_element"]  # same writes, same bytes


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,group=8,residual=8"])
def test_deployed_fused_and_device_steps_equal_dense(model, spec):
    """The engine path (fused kernels under the interpreter, device-position steps) gives
    the dense path's figures under the deployed protocol too. Its exact prefill is written
    through the quantizer (`QuantizedLayer._device_write` off): the device prefill stores
    the same bytes and reads nothing in "exact" mode (test_prefill_steps.py), and under the
    interpreter it costs a kernel program per (token, row, head) per layer and role, more
    than this test's 9 decode steps."""
    w = ids(40, batch=2, seed=5)
    dense = ppl_deployed(model, w, spec, context=30, fused=False)
    with mock.patch.object(QuantizedLayer, "_device_write", lambda self, k, v: False):
        fused = ppl_deployed(model, w, spec, context=30, fused=True, graph=True)
    assert fused["ppl"] == pytest.approx(dense["ppl"], rel=1e-3)
    assert fused["bits_per_element"] == dense["bits_per_element"]
    assert dense["decode_attention"] == "dense" and fused["decode_attention"] in ("cuda", "triton")


@pytest.mark.parametrize("spec", [None, "int2", "kivi:bits=2,group=8,residual=8", "spherical3"])
def test_greedy_twins_continue_greedily_and_leave_the_windows_figures(model, spec):
    """`continuations=True`: each window's twin is greedy generation from its prompt. Fed
    back as windows (prompt + the twins' tokens), the teacher-forced rows walk the twins'
    own path beside new twins in the same batch shape, so the new twins must make the
    same tokens, and every step's teacher logit must pick them (checked through the NLL:
    the greedy path is the argmax path). The windows' bytes are those of a run without
    twins (every row stores alike), and so are the counts."""
    w = ids(40, batch=3, seed=7)
    alone = ppl_deployed(model, w, spec, context=30)
    both = ppl_deployed(model, w, spec, context=30, continuations=True)
    cont = both["continuations"]
    assert len(cont) == 3 and all(len(c) == 40 - 30 for c in cont) and both["continuation_rows"] == 3
    for key in ("n_predicted", "decode_steps", "bits_per_element", "cache_bits_per_element", "cache_nbytes",
                "cache_elements", "constant_nbytes"):
        assert both[key] == alone[key], key
    # the windows' loss with twins beside them: the same per-row arithmetic, up to a wider
    # batch's rounding. Measured here (2-core x86 VM, 1 thread): 1e-7-5e-7 relative for all
    # four specs; a code flipped by that rounding moved int4 3.6e-3 on SmolLM2 (module
    # docstring of perplexity.py), so the bound is 5x that. Twins leaking into the windows'
    # loss move it by their whole NLL, far past it.
    assert both["ppl"] == pytest.approx(alone["ppl"], rel=2e-2)
    again = ppl_deployed(model, torch.cat([w[:, :30], torch.tensor(cont)], 1), spec, context=30,
                         continuations=True)
    assert again["continuations"] == cont
    greedy = torch.tensor(cont)
    assert greedy.unique().numel() > 1  # a real continuation, not one repeated token


def test_twins_only_where_rows_store_alike(model):
    assert twins_unsupported(model, "int4") is None and twins_unsupported(model, None) is None
    assert "span the rows" in twins_unsupported(model, "fp8-e4m3")  # one scale fitted over every row
    why = twins_unsupported(model, "hqmq:S=8,r=3,outliers=med3")  # a data-dependent outlier list
    assert "outliers" in why and "one slice per row" in why
    with pytest.raises(ValueError, match="continuations=True: fp8-e4m3: its statistics span the rows"):
        ppl_deployed(model, ids(40), "fp8-e4m3", context=30, continuations=True)


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match="context must be in 1..38"):
        ppl_deployed(model, ids(40), "int4", context=39)
    with pytest.raises(ValueError, match="prefill must be one of"):
        QuantizedCache("int4", config=model.config, prefill="fp32")


def test_a_route_that_cannot_be_told_does_not_end_the_row(model, monkeypatch):
    """`decode_attention` is a label of the row: a routing question that fails (a library
    that cannot load, say) records "unknown (...)" and keeps the measurement."""
    from kvqbench.kernels import decode_attention as front

    def broken(*a, **k):
        raise RuntimeError("no library")

    monkeypatch.setattr(front, "explain_backend", broken)
    w = ids(40, batch=2, seed=5)
    with mock.patch.object(QuantizedLayer, "_device_write", lambda self, k, v: False):
        r = ppl_deployed(model, w, "int4", context=30, fused=True, graph=False)
    assert r["decode_attention"] == "unknown (RuntimeError)" and r["ppl"] > 0
