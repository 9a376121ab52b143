"""The quantized KV cache really sits in the model's attention path (tiny random Llama, CPU).

Identity tests use an fp16 model: fp16 storage of fp16 K/V is exact, so the `fp16`
quantizer must reproduce the plain DynamicCache bit for bit. (bf16 values are exact
in fp16 too except below ~2^-14, where fp16 subnormals can drop a mantissa bit; an
fp16 model keeps the identity unconditional.) head_dim is 32 so int groups of 32 fit.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvqbench.quantizers import Segment, get_quantizer
from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs
from kvqbench.suites.harness.perplexity import ppl_prefill_then_decode, ppl_quantize_on_write

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

VOCAB = 128


def tiny_llama(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=256, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@pytest.fixture(scope="module")
def half_model():
    return tiny_llama(torch.float16)


@pytest.fixture(scope="module")
def f32_model():
    return tiny_llama(torch.float32)


def tokens(n, batch=1, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids, cache):
    with torch.inference_mode():
        return model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits


def prefill_and_step(model, ids, cache, n_prefill):
    """Prefill ids[:, :n_prefill], then one decode step per remaining token; all logits."""
    out = [run(model, ids[:, :n_prefill], cache)]
    for t in range(n_prefill, ids.shape[1]):
        out.append(run(model, ids[:, t:t + 1], cache))
    return torch.cat(out, dim=1)


def test_fp16_is_bit_identical_to_plain_cache(half_model):
    # (a) prefill and decode steps: same logits as the model's own cache, bit for bit
    ids = tokens(24)
    plain = prefill_and_step(half_model, ids, DynamicCache(config=half_model.config), 16)
    cache = QuantizedCache("fp16", config=half_model.config)
    quant = prefill_and_step(half_model, ids, cache, 16)
    assert torch.equal(plain, quant)
    assert cache.get_seq_length() == 24


def test_int2_changes_logits(half_model):
    # (b) the quantizer is in the attention path
    ids = tokens(24)
    plain = run(half_model, ids, DynamicCache(config=half_model.config))
    quant = run(half_model, ids, QuantizedCache("int2", config=half_model.config))
    assert torch.isfinite(quant).all()
    assert (plain - quant).abs().max() > 1e-2


def test_decode_step_reads_quantized_history(f32_model):
    # (c) a one-token step appends to the packed store and reads the dequantized history
    ids = tokens(17)
    caches = {s: QuantizedCache(s, config=f32_model.config) for s in ("fp16", "int2", "int2 ")}
    step = {}
    for name, cache in caches.items():
        run(f32_model, ids[:, :16], cache)
        step[name] = run(f32_model, ids[:, 16:], cache)
    assert (step["fp16"] - step["int2"]).abs().max() > 1e-3
    assert torch.equal(step["int2"], step["int2 "])  # deterministic: the same write twice

    c = caches["int2"]
    for layer in c.layers:  # the prefill segment, then the decode step's own segment
        for role in ("K", "V"):
            p = layer.packed[role]
            assert [s.tokens for s in p.segments] == [16, 1]
            assert torch.equal(layer.read(role), layer.quantizers[role].decode(p))

    # Tamper with the stored zero point of token 1 in layer 0's values: the next decode
    # step must see it (it reads the packed store, not a private fp copy).
    a, b = (QuantizedCache("int2", config=f32_model.config) for _ in range(2))
    for cache in (a, b):
        run(f32_model, ids[:, :16], cache)
    p = b.packed(0)["V"]
    seg = p.segments[0]
    fields = {k: v.clone() for k, v in seg.fields.items()}
    fields["zero"][:, :, 1] += 4.0
    b.layers[0].replace_packed("V", dataclasses.replace(p, segments=[Segment(fields, seg.tokens)]))
    assert b.nbytes() == a.nbytes()
    out_a, out_b = run(f32_model, ids[:, 16:], a), run(f32_model, ids[:, 16:], b)
    assert (out_a - out_b).abs().max() > 1e-3


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,group=4,residual=4", "hqmq:S=8,r=4,outliers=med3"])
def test_incremental_read_equals_full_decode(f32_model, spec):
    # The layer reuses the decoded prefix between reads; it must equal a fresh decode,
    # including for KIVI, whose trailing fp16 segment is replaced on every write.
    ids = tokens(30)
    cache = QuantizedCache(spec, config=f32_model.config, seed=3)
    prefill_and_step(f32_model, ids, cache, 10)
    for layer in cache.layers:
        for role in ("K", "V"):
            fresh = layer.quantizers[role].decode(layer.packed[role])
            assert torch.equal(layer.read(role), fresh)
            assert fresh.shape[2] == 30


def test_generate_matches_plain_cache(half_model):
    # (d)
    ids = tokens(12)
    with torch.inference_mode():
        plain = half_model.generate(ids, max_new_tokens=12, do_sample=False)
        cache = QuantizedCache("fp16", config=half_model.config)
        quant = half_model.generate(ids, max_new_tokens=12, do_sample=False, **cache_kwargs(half_model, cache))
    assert torch.equal(plain, quant)
    assert cache.get_seq_length() == 12 + 12 - 1  # the last generated token is never written


def test_bits_per_element_is_measured(f32_model):
    # (e) int4, groups of 32 on head_dim 32: 4 code bits + fp16 scale and zero per 32
    ids = tokens(20)
    cache = QuantizedCache("int4", config=f32_model.config)
    run(f32_model, ids, cache)
    assert cache.bits_per_element() == 5.0
    q = get_quantizer("int4")
    assert q.encode(torch.randn(1, 2, 20, 32)).bits_per_element == 5.0
    assert cache.nbytes() == sum(p.nbytes for i in range(2) for p in cache.packed(i).values())
    assert cache.numel() == 2 * 2 * (1 * 2 * 20 * 32)  # layers x roles x elements
    fp = QuantizedCache("fp16", config=f32_model.config)
    run(f32_model, ids, fp)
    assert fp.bits_per_element() == 16.0


def test_lazy_layers_without_config(f32_model):
    ids = tokens(8)
    ref = run(f32_model, ids, QuantizedCache("int4", config=f32_model.config, seed=5))
    lazy = QuantizedCache("int4", seed=5)
    assert torch.equal(run(f32_model, ids, lazy), ref)
    assert len(lazy.layers) == 2


def test_ppl_protocols(f32_model):
    # (f)
    windows = tokens(24, batch=3, seed=7)
    plain = ppl_quantize_on_write(f32_model, windows, None)
    fp16 = ppl_quantize_on_write(f32_model, windows, "fp16")
    int2 = ppl_quantize_on_write(f32_model, windows, "int2")
    assert plain["n_predicted"] == 3 * 23 and plain["protocol"] == "quantize-on-write"
    for r in (plain, fp16, int2):
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
    assert fp16["ppl"] == pytest.approx(plain["ppl"], rel=1e-3)  # fp16 rounding of f32 K/V
    assert int2["ppl"] != fp16["ppl"]
    assert plain["bits_per_element"] == 32.0 and fp16["bits_per_element"] == 16.0
    assert int2["bits_per_element"] == 3.0  # 2 + 32/32

    seen = []
    pd_plain = ppl_prefill_then_decode(f32_model, windows, None, context=16, batch_size=1,
                                       progress=lambda i, n: seen.append((i, n)))
    pd_fp16 = ppl_prefill_then_decode(f32_model, windows, "fp16", context=16)
    pd_int2 = ppl_prefill_then_decode(f32_model, windows, "int2", context=16)
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert pd_plain["n_predicted"] == 3 * 8 and pd_plain["decode_steps"] == 7
    assert pd_fp16["ppl"] == pytest.approx(pd_plain["ppl"], rel=1e-3)
    assert math.isfinite(pd_int2["ppl"]) and pd_int2["ppl"] != pd_fp16["ppl"]
    assert pd_int2["bits_per_element"] == 3.0

    # Token alignment: with the plain cache, decode-step scoring of tokens 16..23 equals
    # scoring them from one full forward pass (logits 15..22).
    with torch.inference_mode():
        logits = f32_model(input_ids=windows).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, 15:23].reshape(-1, VOCAB), windows[:, 16:24].reshape(-1),
                                            reduction="sum")
    assert pd_plain["nll_sum"] == pytest.approx(nll.item(), rel=1e-5)


def test_refuses_what_it_cannot_do(f32_model):
    with pytest.raises(Exception):
        QuantizedCache("nonsense", config=f32_model.config)
    cache = QuantizedCache("int4", config=f32_model.config)
    run(f32_model, tokens(8), cache)
    with pytest.raises(NotImplementedError):
        cache.crop(-2)
    with pytest.raises(NotImplementedError):
        cache.reorder_cache(torch.tensor([0]))
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    run(f32_model, tokens(8), cache)  # usable again after reset
    assert cache.get_seq_length() == 8
