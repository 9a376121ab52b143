"""Left-padded batches (issue 29): prompts of different lengths generated as ONE batch.

The kernels' `row_start` (keys before row_start[b] masked for batch row b) against the
fp32 reference per format family, its checks and routing; then `generate`: a batch of
prompts of different lengths gives, row for row, the greedy tokens of each prompt
generated alone (fused device steps, a dense-only format, the kept engine rewound).
Under the Triton interpreter on a CPU (TRITON_INTERPRET=1 before triton is imported).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.kernels import registry  # noqa: E402
from kvqbench.kernels.cuda import decode_attention as cuda_decode, hqmq_decode as cuda_hqmq  # noqa: E402
from kvqbench.kernels.decode_attention import (decode_attention, explain_backend,  # noqa: E402
                                               reference_decode_attention)
from kvqbench.quantizers import get_quantizer  # noqa: E402
from kvqbench.suites.harness import generate as G  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedCache  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import TOL, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---- kernels ------------------------------------------------------------------------------
# (spec, launch options): 16-token tiles in 3 splits over T=48, so row 1 (start 20) has a
# split wholly before its start and row 2 (start T) has every key masked
KERNEL_CASES = [("fp16", {"block_t": 16}), ("int4", {"block_t": 16}), ("fp8-e4m3", {"block_t": 16}),
                ("kivi:bits=4,group=16,residual=16", {"block_t": 16}), ("hqmq:S=24,r=3", {"block_t": 64})]


def _encoded(spec, B=3, H=2, T=48, D=64):
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(B, H, T, D, generator=g).to(DEV) for _ in range(2))
    qk, qv = get_quantizer(spec, role="K", seed=3), get_quantizer(spec, role="V", seed=3)
    pk, pv = qk.encode(k), qv.encode(v)
    return L.flatten(pk, "K"), L.flatten(pv, "V"), qk.decode(pk), qv.decode(pv)


@pytest.mark.parametrize("spec,launch", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_row_start_equals_the_reference_over_each_rows_keys(spec, launch):
    kf, vf, kd, vd = _encoded(spec)
    T = kd.shape[2]
    q = torch.randn(3, 4, 1, 64, generator=torch.Generator().manual_seed(2)).to(DEV)
    rs = torch.tensor([0, 20, T], dtype=torch.int32, device=DEV)
    out = decode_attention(q, kf, vf, backend="triton", row_start=rs, num_splits=3, **launch).float()
    ref = reference_decode_attention(q, kd, vd, rs)
    assert not out.isnan().any() and torch.equal(out[2], torch.zeros_like(out[2]))  # every key masked: 0
    for b in range(2):
        # row b alone over its unmasked keys: the same numbers
        alone = reference_decode_attention(q[b:b + 1], kd[b:b + 1, :, int(rs[b]):], vd[b:b + 1, :, int(rs[b]):])
        assert float((out[b] - alone[0]).abs().max()) < 2e-5, (spec, b)
        assert float((out[b] - ref[b]).abs().max()) < 2e-5, (spec, b)
    unmasked = reference_decode_attention(q, kd, vd)
    assert float((out[1] - unmasked[1]).abs().max()) > 1e-2  # the mask matters here (else no test)


def test_row_start_with_a_device_valid_length():
    # the graphed steps' call: capacity-cut grid, the valid length and the starts on the device
    kf, vf, kd, vd = _encoded("int4", T=64)
    q = torch.randn(3, 4, 1, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    rs = torch.tensor([3, 0, 33], dtype=torch.int32, device=DEV)
    vl = torch.tensor([50], dtype=torch.int32, device=DEV)
    out = decode_attention(q, kf, vf, backend="triton", valid_len=vl, row_start=rs, block_t=16).float()
    ref = reference_decode_attention(q, kd[:, :, :50], vd[:, :, :50], rs)
    assert float((out - ref).abs().max()) < 2e-5


def test_bad_row_start_is_refused_naming_the_problem():
    kf, vf, _, _ = _encoded("int4", T=16)
    q = torch.randn(3, 4, 1, 64, device=DEV)
    bad = [(torch.zeros(3, dtype=torch.int64, device=DEV), "int32"),
           (torch.zeros(2, dtype=torch.int32, device=DEV), r"shape \[B\] = \(3,\)"),
           (torch.zeros(3, 1, dtype=torch.int32, device=DEV), r"shape \[B\]"),
           ([0, 0, 0], "int32 tensor"),
           (torch.zeros(3, dtype=torch.int32, device="meta"), "is on meta")]
    for rs, match in bad:
        with pytest.raises(ValueError, match=match):
            decode_attention(q, kf, vf, backend="triton", row_start=rs)


def test_cuda_kernels_take_row_start_by_name_and_auto_waits_for_their_switch(monkeypatch):
    for name in ("fp16", "naive_int", "fp8", "kivi", "hqmq"):  # the built-in formats' kernels
        for backend, kern in registry.formats()[name].by_backend.items():
            assert kern.row_start, (name, backend)
            assert (kern.row_start_auto is not None) == (backend == "cuda"), (name, backend)
    cuda = registry.formats()["naive_int"].by_backend["cuda"]
    kf, vf, _, _ = _encoded("int4", T=16)
    q = torch.randn(3, 4, 1, 64, device=DEV)
    rs = torch.zeros(3, dtype=torch.int32, device=DEV)
    # what the checks say, past the device test a CPU cannot pass (Kernels on any device)
    blind = registry.Kernel("triton", cuda.fn, title="CUDA int4 kernel")
    assert blind.declines(q, kf, vf, {}, None, rs) == ("the CUDA int4 kernel takes no row_start (per-row key "
                                                       "starts of a left-padded batch)")
    assert blind.declines(q, kf, vf, {}, None) is None
    waits = registry.Kernel("triton", cuda.fn, title="CUDA int4 kernel", row_start=True,
                            row_start_auto=cuda.row_start_auto)
    assert waits.declines(q, kf, vf, {}, None, rs) == cuda_decode.row_start_refusal("int4")
    assert waits.declines(q, kf, vf, {}, None) is None
    # the switches, on since the GPU tests below passed: one per CUDA module
    assert all(cuda_decode.row_start_refusal(n) is None for n in ("int4", "fp8", "kivi"))
    assert (cuda_hqmq.row_start_refusal() is None) == cuda_hqmq.AUTO_ROW_START
    if torch.cuda.is_available():  # auto routes such calls to CUDA, and back to Triton with a switch off
        for spec in ("int4", "fp8-e4m3", "hqmq:S=96,r=4"):
            kc, vc = _encoded(spec, T=16)[:2]
            assert explain_backend(q.cuda().half(), kc, vc, row_start=rs.cuda()).backend == "cuda", spec
    monkeypatch.setattr(cuda_decode, "AUTO_ROW_START", False)
    assert "fp8: backend='cuda' takes it" in cuda_decode.row_start_refusal("fp8")
    assert registry.formats()["fp8"].by_backend["cuda"].row_start_auto() == cuda_decode.row_start_refusal("fp8")
    if not torch.cuda.is_available():
        assert explain_backend(q, kf, vf, row_start=rs).backend == "triton"
        pytest.skip("the routed reason on a CUDA call needs CUDA (here CUDA declines for q's device first)")
    kc, vc = _encoded("int4", T=16)[:2]
    route = explain_backend(q.cuda().half(), kc, vc, row_start=rs.cuda())
    assert route.backend == "triton" and "AUTO_ROW_START is False" in route.declined["cuda"], route


# The CUDA kernels' row_start (GPU only): against the reference and each row alone, every
# family at the head dims they take; odd T over several splits, a row starting mid-tile, one
# with a single key, one with none (zeros), a row at 0 bit for bit the call without row_start;
# both combine paths; a device valid length below the capacity (a graphed step's call).
CUDA_ROW_CASES = [("int4", 128), ("int4", 256), ("fp8-e4m3", 64), ("kivi:bits=2", 128), ("kivi:bits=4", 64),
                  ("hqmq:S=96,r=4", 128), ("hqmq:S=96,r=4", 64), ("hqmq:S=96,r=4,outliers=med3", 128),
                  ("hqmq:S=96,r=4,pack=mixed", 128), ("hqmq:S=96,r=4", 256), ("hqmq:S=96,r=4,pack=mixed", 256)]


@pytest.mark.parametrize("fused", [False, True], ids=["combine", "fused"])
@pytest.mark.parametrize("spec,D", CUDA_ROW_CASES, ids=[f"{s}-d{d}" for s, d in CUDA_ROW_CASES])
def test_cuda_row_start_equals_the_reference(spec, D, fused):
    if not torch.cuda.is_available():
        pytest.skip("the CUDA kernels need a GPU")
    from kvqbench.kernels.cuda.library import FUSED_COMBINE

    B, T = 5, 333
    kf, vf, kd, vd = _encoded(spec, B=B, T=T, D=D)
    q = torch.randn(B, 8, 1, D, generator=torch.Generator().manual_seed(5)).half().cuda()
    rs = torch.tensor([0, 37, T - 1, T, 200], dtype=torch.int32, device="cuda")
    with FUSED_COMBINE.set(fused):
        out = decode_attention(q, kf, vf, backend="cuda", row_start=rs, out_dtype=torch.float32, num_splits=7)
        plain = decode_attention(q, kf, vf, backend="cuda", out_dtype=torch.float32, num_splits=7)
    ref = reference_decode_attention(q.float(), kd, vd, rs)
    assert torch.isfinite(out).all() and torch.equal(out[3], torch.zeros_like(out[3]))  # no key left: 0
    assert torch.equal(out[0], plain[0])  # a row from 0: the call without row_start, bit for bit
    for b in (1, 2, 4):
        alone = reference_decode_attention(q[b:b + 1].float(), kd[b:b + 1, :, int(rs[b]):], vd[b:b + 1, :, int(rs[b]):])
        assert rel_err(out[b], alone[0]) < TOL[torch.float16], (spec, b, rel_err(out[b], alone[0]))
        assert rel_err(out[b], ref[b]) < TOL[torch.float16], (spec, b)
    assert rel_err(out[1], plain[1]) > 1e-2  # the mask matters here (else no test)


@pytest.mark.parametrize("spec", ["int4", "hqmq:S=96,r=4,outliers=med3"])
def test_cuda_row_start_with_a_device_valid_length(spec):
    if not torch.cuda.is_available():
        pytest.skip("the CUDA kernels need a GPU")
    kf, vf, kd, vd = _encoded(spec, B=3, T=300, D=128)
    q = torch.randn(3, 8, 1, 128, generator=torch.Generator().manual_seed(6)).half().cuda()
    rs = torch.tensor([3, 0, 250], dtype=torch.int32, device="cuda")
    vl = torch.tensor([251], dtype=torch.int32, device="cuda")
    out = decode_attention(q, kf, vf, backend="cuda", valid_len=vl, row_start=rs, out_dtype=torch.float32)
    ref = reference_decode_attention(q.float(), kd[:, :, :251], vd[:, :, :251], rs)
    assert rel_err(out, ref) < TOL[torch.float16]


# ---- generate -----------------------------------------------------------------------------
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval().to(DEV)
    m.generation_config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def model():
    return llama()


def rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


# (prompt lengths: HQMQ's prefill encode is the slow part under the interpreter)
@pytest.mark.parametrize("spec,lengths", [("fp16", [7, 3]), ("int4", [8, 3, 5]), ("hqmq:S=24,r=3", [6, 2]),
                                          ("hadamard-int4", [8, 3, 5])])
def test_a_padded_batch_gives_each_prompts_tokens_alone(model, spec, lengths):
    # fused device steps (graph=True on a CPU: the graph's steps uncaptured); hadamard-int4
    # has no fused kernel: dense layers, device steps masked by the cache's handle
    G.release_engines()
    prompts = rows(lengths)
    out = G.generate(model, prompts, spec, max_new_tokens=3, graph=True, fused=True)
    assert out.batches == [list(range(len(lengths)))], out.batches
    assert out.mode == ("graph" if DEV.type == "cuda" else "device"), out.why
    for i, r in enumerate(prompts):
        assert out.tokens[i] == G.generate(model, [r], spec, max_new_tokens=3, graph=True, fused=True).tokens[0], i
    G.release_engines()


def test_eager_dense_steps_of_a_padded_batch(model):
    # graph=False: host-path steps; int4 dense on a CPU (fused=None): SDPA masked by the handle
    prompts = rows([9, 3, 6], seed=1)
    out = G.generate(model, prompts, "int4", max_new_tokens=5, graph=False)
    assert out.batches == [[0, 1, 2]] and out.mode == "eager"
    assert out.tokens == [G.generate(model, [r], "int4", max_new_tokens=5, graph=False).tokens[0] for r in prompts]


def test_kivi_rows_equal_alone_where_pads_keep_its_groups(model):
    # KIVI's groups and fp16 window are counted from the row's first position, pads
    # included: pad counts that are multiples of the group and the window (4 here) keep
    # every group boundary and window where the row alone has them, and the tokens are
    # the row's alone (8 of the row's 13 tokens in quantized groups). (Other pad counts
    # move them: measured on this model at kivi:bits=4,group=8,residual=8, lengths
    # 30/13/21, 4 seeds, 8 new tokens: 6 of 12 rows equal alone's, the 4 unpadded rows
    # among them, the others diverging after 2-7 tokens; not asserted.)
    spec = "kivi:bits=4,group=4,residual=4"
    prompts = rows([10, 2], seed=2)  # pads 0, 8
    out = G.generate(model, prompts, spec, max_new_tokens=3, graph=True, fused=True)
    assert out.batches == [[0, 1]]  # (the unpadded row's equality: the test above, for the other formats)
    assert out.tokens[1] == G.generate(model, prompts[1:], spec, max_new_tokens=3, graph=True, fused=True).tokens[0]
    G.release_engines()


def test_the_kept_engine_takes_new_pads_in_place(model):
    # a second padded call of the same key rewinds the kept cache and writes its row
    # starts into the same buffer (the captured step reads it): a fresh engine's tokens
    G.release_engines()
    first, second = rows([6, 2], seed=3), rows([3, 7], seed=4)
    G.generate(model, first, "fp16", max_new_tokens=3, graph=True, fused=True)
    cache, buf = G._ENGINE[0][2], G._ENGINE[0][2].row_start
    again = G.generate(model, second, "fp16", max_new_tokens=3, graph=True, fused=True)
    assert G._ENGINE[0][2] is cache and cache.row_start is buf and cache.row_start.tolist() == [4, 0]
    G.release_engines()
    assert again.tokens == G.generate(model, second, "fp16", max_new_tokens=3, graph=True, fused=True).tokens
    G.release_engines()


def test_fallback_groups_by_length_and_says_why(model):
    prompts = rows([6, 3, 6], seed=5)
    out = G.generate(model, prompts, None, max_new_tokens=2)
    assert sorted(map(sorted, out.batches)) == [[0, 2], [1]] and "StaticCache" in out.why


def test_cache_row_start_checks_and_rewind(model):
    cache = QuantizedCache("int4", config=model.config, fused=True, prefill="exact")
    for bad, match in [([-1, 0], ">= 0"), ([[0, 1]], "1-D"), (torch.zeros(2), "integer")]:
        with pytest.raises(ValueError, match=match):
            cache.set_row_start(bad)
    cache.set_row_start([2, 0])
    assert cache.position_ids(0, 4).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    k = torch.randn(2, 2, 4, 32, device=DEV)
    for layer in range(2):
        cache.update(k, k, layer)
    stored = cache.layers[0].read("K")
    assert torch.equal(stored[0, :, :2], stored[0, :, 2:3].expand(-1, 2, -1))  # pads: the first token's
    with pytest.raises(ValueError, match="holding 4 tokens"):
        cache.set_row_start([1, 0])
    # (Llama's RoPE is shift-invariant: tokens cannot tell wrong positions; these can)
    assert cache.position_ids(4, 1).tolist() == [[2], [4]]
    cache.reserve(8)
    with cache.device_steps():
        assert cache.device_position_ids().tolist() == [[2], [4]]
    buf = cache.row_start
    assert cache.rewind() and cache.row_start is buf and buf.tolist() == [0, 0]
