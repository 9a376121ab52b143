"""The generation engine (suites/harness/generate.py): the same tokens as transformers'
`generate` where the cache is exact, EOS and stop strings per row, prompts of
different lengths, sampling, and the engine's step modes."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvqbench.suites.harness.generate import generate
from kvqbench.suites.harness.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
VOCAB = 128
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the engine's graphs need CUDA


def llama(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval().to(dtype).to(DEV)
    m.generation_config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def model():
    return llama()


def prompts(batch=2, n=20, seed=0):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed)).to(DEV)


def reference(model, ids, new):
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=new, do_sample=False)[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("graph", [False, True])
def test_plain_cache_gives_transformers_greedy_tokens(model, graph):
    ids = prompts()
    out = generate(model, ids, None, max_new_tokens=12, graph=graph)
    assert out.tokens == reference(model, ids, 12)
    want = ("graph" if torch.cuda.is_available() else "device") if graph else "eager"
    assert out.mode == want and out.new_tokens == 24 and out.steps == 11, out.why


def test_fp16_store_of_an_fp16_model_is_exact():
    m = llama(torch.float16)
    ids = prompts()
    assert generate(m, ids, "fp16", max_new_tokens=8, graph=True).tokens == reference(m, ids, 8)


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,group=8,residual=8"])
def test_device_steps_equal_eager_steps(model, spec):
    ids = prompts()
    eager = generate(model, ids, spec, max_new_tokens=10, graph=False)
    device = generate(model, ids, spec, max_new_tokens=10, graph=True, fused=True)
    assert device.mode == ("graph" if torch.cuda.is_available() else "device"), device.why
    assert eager.mode == "eager"
    assert device.tokens == eager.tokens


def test_eos_cuts_each_row_at_its_first_eos(model):
    ids = prompts()
    ref = reference(model, ids, 12)
    eos = ref[0][4]  # row 0 stops at its 5th token (kept); row 1 at its own first occurrence, if any
    out = generate(model, ids, None, max_new_tokens=12, eos_token_id=eos, check_every=1)
    for got, want in zip(out.tokens, ref):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]


def test_stop_strings_and_texts(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny")
    m = LlamaForCausalLM.from_pretrained(folder).eval().to(DEV)
    m.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode("the quick brown fox")], device=DEV)
    full = generate(m, ids, None, max_new_tokens=16, tokenizer=tok)
    text = full.texts[0]
    assert text == tok.decode(full.tokens[0])
    stop = text[5:7]  # a string the continuation contains
    out = generate(m, ids, None, max_new_tokens=16, tokenizer=tok, stop=[stop])
    assert stop in out.texts[0] and out.texts[0].endswith(stop)
    assert full.texts[0].startswith(out.texts[0]) and stop not in out.texts[0][:-1]


def test_prompts_of_different_lengths_run_as_one_padded_batch_and_equal_one_by_one(model):
    ids = prompts(3, 20)
    rows = [ids[0].tolist(), ids[1, :14].tolist(), ids[2].tolist()]  # lists: the engine moves them
    out = generate(model, rows, "int4", max_new_tokens=6)
    assert out.batches == [[0, 1, 2]]  # left-padded (test_padded_batches.py), not grouped by length
    for i, r in enumerate(rows):
        assert out.tokens[i] == generate(model, [r], "int4", max_new_tokens=6).tokens[0]


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    ids = prompts()
    a = generate(model, ids, "int4", max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    b = generate(model, ids, "int4", max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    assert a.tokens == b.tokens
    greedy = generate(model, ids, "int4", max_new_tokens=10)
    assert generate(model, ids, "int4", max_new_tokens=10, temperature=0.7, top_k=1, seed=5).tokens == greedy.tokens
    hot = [generate(model, ids, "int4", max_new_tokens=10, temperature=5.0, seed=s).tokens for s in range(3)]
    assert any(h != greedy.tokens for h in hot)  # at temperature 5 over 128 tokens, 3 seeds all greedy: ~never


def test_bad_input_is_refused(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompts(), "int4", max_new_tokens=0)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        generate(model, prompts(), "int4", stop=["x"])
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        generate(model, prompts(1, 200), "int4", max_new_tokens=100)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1, 2], []], "int4")
    with pytest.raises(ValueError, match="sampling"):
        generate(model, prompts(), "int4", temperature=1.0, top_p=1.5)


# ---- generation fidelity (suites/harness/fidelity.py) -------------------------------------
def test_fidelity_of_an_exact_cache_is_perfect_and_of_int2_is_not(model):
    from kvqbench.suites.harness.fidelity import fidelity, reference_continuations

    ids = prompts(3, 20, seed=4)
    ref = reference_continuations(model, ids, new_tokens=10)
    assert ref["tokens"] == reference(model, ids, 10)
    int2 = fidelity(model, ids, "int2", ref)
    assert int2["prompts"] == 3 and len(int2["first_diff"]) == 3
    assert 0 <= int2["first_diff_min"] <= int2["first_diff_mean"] <= 10
    assert int2["match_rate"] < 1 and int2["never_diverged"] < 3  # 2-bit K/V leave the greedy path
    # (no order between the two NLLs: greedy is not the likeliest continuation, and on the
    # H200 several quantized continuations were likelier than the reference's)
    assert 0 < int2["nll_per_token"] < float("inf") and int2["nll_per_token"] != int2["ref_nll_per_token"]
    with pytest.raises(ValueError, match="reference continuations"):
        fidelity(model, ids[:2], "int2", ref)


def test_fidelity_of_an_fp16_store_on_an_fp16_model_is_perfect():
    from kvqbench.suites.harness.fidelity import fidelity, reference_continuations

    m = llama(torch.float16)
    ids = prompts(2, 16, seed=6)
    f = fidelity(m, ids, "fp16", reference_continuations(m, ids, new_tokens=8))
    assert f["match_rate"] == 1 and f["never_diverged"] == 2 and f["first_diff_mean"] == 8
    assert f["nll_per_token"] == pytest.approx(f["ref_nll_per_token"], rel=1e-6)


def test_compiled_layers_give_the_uncompiled_tokens_and_restore_the_model(model):
    # compile=True runs every decoder layer through torch.compile with the quantized
    # cache's write and the fused attention opaque to it: the same greedy tokens, and
    # afterwards the model's own modules and transformers' attention registry are back.
    from transformers import AttentionInterface

    from kvqbench.suites.harness.attention import ATTN_NAME, kvqbench_attention, register
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    register()
    layers, update = list(model.model.layers), QuantizedCache.update
    ids = prompts()
    want = generate(model, ids, "int4", max_new_tokens=4)
    got = generate(model, ids, "int4", max_new_tokens=4, compile=True)
    assert got.tokens == want.tokens
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    again = generate(model, ids, "int4", max_new_tokens=4, compile=True)  # a second call compiles nothing
    assert again.tokens == want.tokens and counters["stats"]["unique_graphs"] == graphs
    # nor does a new prompt length: the prefill runs the uncompiled layers, the steps' shape is the same
    longer = prompts(n=ids.shape[1] + 3)
    assert generate(model, longer, "int4", max_new_tokens=4, compile=True).tokens == \
        generate(model, longer, "int4", max_new_tokens=4).tokens
    assert counters["stats"]["unique_graphs"] == graphs
    assert list(model.model.layers) == layers and QuantizedCache.update is update
    assert AttentionInterface._global_mapping[ATTN_NAME] is kvqbench_attention


# Med3x is slow-only here (`pytest -m slow`; ~10 s under the Triton interpreter): the kept
# engine's rewind of an HQMQ store runs by default (hqmq:S=8,r=4), and a rewound Med3x
# cache's lists and bytes against a fresh cache's are checked by
# test_a_rewound_med3x_cache_keeps_its_lists_where_they_are_and_stores_a_fresh_caches_bytes.
@pytest.mark.parametrize("spec", ["int4", "hqmq:S=8,r=4", "kivi:bits=2,group=8,residual=8",
                                  pytest.param("hqmq:S=8,r=4,outliers=med3", marks=pytest.mark.slow), "fp8-e4m3"])
def test_the_kept_engine_is_rewound_and_gives_a_fresh_caches_tokens(model, spec):
    # generate keeps the model's last cache and captured step; a next call of the same key
    # rewinds that cache in place (same buffers: the graph replays), and its tokens are a
    # fresh cache's (the base store; HQMQ's; KIVI's groups and window; Med3x's lists).
    from kvqbench.suites.harness import generate as G

    G.release_engines()
    runs = [prompts(n=6, seed=1), prompts(n=9, seed=3)]  # the second: another length, the same room
    kept, got = [], []
    for ids in runs:
        got.append(generate(model, ids, spec, max_new_tokens=4, graph=True, fused=True).tokens)
        kept.append(G._ENGINE[0][2])
    assert kept[0] is kept[1] and all(layer.mode == "fused" for layer in kept[-1].layers)
    G.release_engines(model)
    assert generate(model, runs[-1], spec, max_new_tokens=4, graph=True, fused=True).tokens == got[-1]
    G.release_engines()


def test_rewind_refits_a_fitted_scale_in_place(model):
    # fp8's scale is fitted on the first write: a rewound cache fits it again on the next
    # prompt, into the same tensors (a captured step reads them), and stores what a fresh
    # cache of that prompt stores
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    def filled(cache, k):
        for layer in range(2):
            cache.update(k, k * 0.5, layer)
        return cache

    k = torch.randn(1, 2, 6, 32, device=DEV)
    cache = filled(QuantizedCache("fp8-e4m3", config=model.config, fused=True, prefill="exact"), k)
    assert all(layer.mode == "fused" for layer in cache.layers)
    held = [(s.flat.scale, s.flat.scale.clone()) for layer in cache.layers for s in layer.stores.values()]
    assert cache.rewind() and cache.get_seq_length() == 0
    filled(cache, k[:, :, :4] * 3)
    fresh = filled(QuantizedCache("fp8-e4m3", config=model.config, fused=True, prefill="exact"), k[:, :, :4] * 3)
    stores = [s for layer in cache.layers for s in layer.stores.values()]
    for (t, before), s, f in zip(held, stores, [s for layer in fresh.layers for s in layer.stores.values()]):
        assert s.flat.scale is t and torch.equal(t, f.flat.scale) and not torch.equal(t, before)
        assert torch.equal(s.buffers["codes"].valid, f.buffers["codes"].valid)
    for a, b in zip(cache.layers, fresh.layers):
        for role in ("K", "V"):
            assert a.packed[role].digest() == b.packed[role].digest()


def test_rewind_raises_an_input_error_the_last_use_flagged_and_keeps_nothing_stale(model):
    from kvqbench.quantizers import QuantizerInputError
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    cache = QuantizedCache("int4", config=model.config, fused=True, prefill="exact")
    k = torch.randn(1, 2, 6, 32, device=DEV)
    bad = k.clone()
    bad[0, 1, 4, 3] = float("nan")
    cache.update(k, bad, 0)
    cache.update(k, k, 1)
    with pytest.raises(QuantizerInputError, match="layer 0 V: .*token 4"):
        cache.rewind()
    ok = QuantizedCache("int4", config=model.config, fused=True, prefill="exact")
    for layer in range(2):
        ok.update(k, k, layer)
    held = [s.buffers["codes"].buf.data_ptr() for layer in ok.layers for s in layer.stores.values()]
    assert ok.rewind() and ok.get_seq_length() == 0
    assert all(layer.packed["K"].tokens == 0 and not layer.packed["K"].segments for layer in ok.layers)
    for layer in range(2):
        ok.update(k[:, :, :3] * 2, k[:, :, :3], layer)
    assert [s.buffers["codes"].buf.data_ptr() for layer in ok.layers for s in layer.stores.values()] == held
    fresh = QuantizedCache("int4", config=model.config, fused=True, prefill="exact")
    for layer in range(2):
        fresh.update(k[:, :, :3] * 2, k[:, :, :3], layer)
    for a, b in zip(ok.layers, fresh.layers):
        for role in ("K", "V"):
            assert a.packed[role].digest() == b.packed[role].digest(), role


def test_a_rewound_med3x_cache_keeps_its_lists_where_they_are_and_stores_a_fresh_caches_bytes(model):
    # Med3x's per-(b, h) outlier lists are emptied in place: the same buffers (a captured
    # graph reads them), and the next prompt's bytes (lists included) are a fresh cache's,
    # after an old prompt with many outliers, some one-token steps and a shorter new prompt
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    spec = "hqmq:S=8,r=4,outliers=med3"
    g = torch.Generator().manual_seed(7)
    old, new = torch.randn(2, 1, 2, 12, 32, generator=g), torch.randn(2, 1, 2, 7, 32, generator=g)
    old[..., 5] *= 30  # a hot channel: long lists
    new[..., 9] *= 30

    def write(cache, x, steps=0):  # a prompt (through the cache), then one-token steps (the layers' own)
        P = x.shape[3] - steps
        for layer in range(2):
            cache.update(x[0, :, :, :P].to(DEV), x[1, :, :, :P].to(DEV), layer)
        for t in range(P, x.shape[3]):
            for layer in cache.layers:
                layer.update(x[0, :, :, t:t + 1].to(DEV), x[1, :, :, t:t + 1].to(DEV))

    def held(cache):
        return [b.data_ptr() for layer in cache.layers for s in layer.stores.values()
                for b in (s.outliers, s.outlier_len, s.buffers["flags"].buf)]

    cache = QuantizedCache(spec, config=model.config, fused=True, prefill="exact")
    write(cache, old, steps=3)
    assert cache.get_seq_length() == 12 and all(layer.mode == "fused" for layer in cache.layers)
    assert int(cache.layers[0].stores["K"].outlier_len.sum()) >= 12
    before = held(cache)
    assert cache.rewind() and cache.get_seq_length() == 0
    write(cache, new)
    assert held(cache) == before
    fresh = QuantizedCache(spec, config=model.config, fused=True, prefill="exact")
    write(fresh, new)
    for a, b in zip(cache.layers, fresh.layers):
        for role in ("K", "V"):
            assert int(a.stores[role].outlier_len.sum()) == int(b.stores[role].outlier_len.sum()) > 0
            assert a.packed[role].digest() == b.packed[role].digest(), role


def test_the_kept_engine_does_not_keep_an_earlier_model_alive():
    import gc
    import weakref

    from kvqbench.suites.harness import generate as G

    first = llama()
    generate(first, prompts(), "int4", max_new_tokens=3, graph=True, fused=True)
    assert G._ENGINE and G._ENGINE[0][0]() is first  # kept
    gone = weakref.ref(first)
    del first
    generate(llama(), prompts(), "int4", max_new_tokens=3, graph=True, fused=True)  # another model's replaces it
    gc.collect()
    assert gone() is None
    G.release_engines()
    assert not G._ENGINE


def test_a_kept_step_whose_cache_buffers_moved_is_made_anew(model, monkeypatch):
    # A rewound cache's next prompt may outgrow the kept room (Med3x's lists are cut back
    # after each write) and move its buffers: the kept step's graph would replay into freed
    # memory, so generate makes a new step (and keeps the same cache) instead of raising
    from kvqbench.kernels.graphs import GraphedDecodeStep
    from kvqbench.suites.harness import generate as G

    G.release_engines()
    first = generate(model, prompts(n=6, seed=1), "int4", max_new_tokens=3, graph=True, fused=True)
    cache, step = G._ENGINE[0][2], G._ENGINE[0][3]
    monkeypatch.setattr(GraphedDecodeStep, "moved", lambda self: self is step)
    again = generate(model, prompts(n=6, seed=1), "int4", max_new_tokens=3, graph=True, fused=True)
    assert G._ENGINE[0][2] is cache and G._ENGINE[0][3] is not step
    assert again.tokens == first.tokens
    G.release_engines()
