"""Decode steps encoded on the device (kernels/step_encode.py, `KernelStore.step`):

- each kernel stores exactly what the quantizer's `encode_tokens` stores (HQMQ: the
  same codes except at exact search ties, which are equally good);
- a fused cache writing its decode steps through them holds the same bytes, decodes
  to the same values and measures the same bits as the old path (`Quantizer.append`
  + `KernelStore.append`), across capacity growth, KIVI flushes and a multi-token
  write in between; greedy decoding gives the same logits;
- bad input raises the old path's error, late but naming layer, role and token;
- the write costs no host read and one launch per (layer, role) (`write_cost`);
- KIVI's steps at a device position (CUDA graphs: the flush decided on the device)
  store what the old path stores, across flushes (test_graph_step.py has the rest of
  the device-position tests).

CPU: the kernels run under the Triton interpreter, tiny shapes.

(About 450 lines, one file: every format's encoder is held to the same old path by the
same harness, `_errors`, `_data`, the store round trip; split per format, each file
would carry a copy of it.)

(About 480 lines: every format's device step encoder against its quantizer's torch path; one
subject, one file.)
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.suites.tests.cuda_helpers import raised_by_later_steps  # noqa: E402
from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.kernels import registry  # noqa: E402
from kvqbench.kernels import store as store_mod  # noqa: E402
from kvqbench.kernels.formats import hqmq as hqmq_format  # noqa: E402
from kvqbench.kernels.formats.kivi import kivi_policy  # noqa: E402
from kvqbench.kernels.hqmq_encode import hqmq_tokens  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.quantizers.groups import quantize_groups  # noqa: E402
from kvqbench.quantizers.packing import unpack_bits  # noqa: E402
from kvqbench.quantizers.quaternion import hamilton, hurwitz_units  # noqa: E402
from kvqbench.suites.bench.decode.measure import write_cost  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedCache, QuantizedLayer, cache_kwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16]
SPECS = ["int4", "int2", "int8", "int3", "fp8-e4m3", "fp8-e5m2", "kivi:bits=2,group=8,residual=8",
         "kivi:bits=4,group=4,residual=8,window=fixed", "hqmq:S=8,r=4", "hqmq:S=24,r=3,radius=log",
         "hqmq:S=8,r=4,outliers=med3", "fp16"]


def _errors():
    e = torch.zeros(3, dtype=torch.int32, device=DEV)
    e[1] = se.NO_TOKEN
    return e


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g).mul(4).add(0.01)
    x[..., 3] *= 8  # a hot channel: Med3x outliers, wide int groups
    return x.to(DEV, dtype)


# ---- the kernels against the quantizers ------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_rows_equal_quantize_groups(bits, dtype):
    for seed in range(3):
        B, H, t, D, G = 2, 3, 3, 64, 16
        x = _data((B, H, t, D), dtype, seed)
        x[0, 0, 0, :G] = 0.5  # a constant group: zero span
        x[0, 0, 1, :G] *= 1e-6  # a subnormal fp16 step
        ref = quantize_groups(x.float(), bits, G, -1)
        cap, t0 = 9, 5
        codes = torch.zeros(B, H, cap, ref["codes"].shape[-1], dtype=torch.uint8, device=DEV)
        scale, zero = (torch.zeros(B, H, cap, D // G, dtype=torch.float16, device=DEV) for _ in range(2))
        err = _errors()
        se.int_rows(x, x.stride() + (0,), t, 1, codes, codes.stride()[:3] + (0,), scale, zero,
                    scale.stride()[:3] + (0,), t0, 0, n=D, group=G, bits=bits, err=err, tok0=t0, token_rows=True)
        for name, buf in (("codes", codes), ("scale", scale), ("zero", zero)):
            assert torch.equal(buf[:, :, t0:t0 + t], ref[name]), (name, seed)
        assert not codes[:, :, :t0].any() and not codes[:, :, t0 + t:].any()  # nothing else written
        assert err[0] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_tokens_equal_torch_cast(fmt, dtype):
    q = get_quantizer(f"fp8-{fmt}")
    for seed in range(3):
        x = _data((2, 3, 4, 32), dtype, seed) * torch.logspace(-7, 3, 32, device=DEV).to(dtype)
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 1e5, -1e5])  # signed zeros, saturation
        shared = {"scale": torch.tensor([0.01, 1.0, 3.0], device=DEV).half()}
        ref = q.encode_tokens(x.float(), shared).fields["codes"]
        codes = torch.zeros(2, 3, 7, 32, dtype=torch.uint8, device=DEV)
        se.fp8_tokens(x, codes, shared["scale"].float(), fmt, 2, _errors())
        assert torch.equal(codes[:, :, 2:6], ref)


def _codeword_distance(q, shared, code, u):
    """||u - codeword|| of codes `[N]` for unit directions `[N, 4]` (one head)."""
    S = q.config.S
    s = q.secondaries(shared)[0]
    cw = hamilton(hurwitz_units(device=u.device)[code // S], s[code % S])
    return (u - cw).norm(dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["hqmq:S=8,r=4", "hqmq:S=96,r=4", "hqmq:S=24,r=3,radius=log",
                                  "hqmq:S=8,r=4,outliers=med3", "hqmq:S=96,r=4,outliers=med3"])
def test_hqmq_tokens_equal_encode_tokens(spec, dtype):
    diff = total = 0
    for seed in range(3):
        q = get_quantizer(spec, role="V", seed=seed)
        B, H, D = 2, 1, 64
        t = 1 if q.med3 else 3
        packed = q.encode(_data((B, H, 70, D), dtype, seed + 10))
        flat = L.flatten(packed, "V")
        x = _data((B, H, t, D), dtype, seed)
        ref = q.encode_tokens(x.float(), packed.shared).fields
        cap, t0 = 80, 70

        def grown(buf):
            out = torch.zeros(buf.shape[:2] + (cap,) + buf.shape[3:], dtype=buf.dtype, device=DEV)
            out[:, :, :t0] = buf
            return out

        flat.codes, flat.radius, flat.r_max = grown(flat.codes), grown(flat.radius), grown(flat.r_max)
        olen = None
        if q.med3:
            flat.flags = grown(flat.flags)
            n0 = unpack_bits(flat.flags[:, :, :t0], 1, D // 4).sum((-1, -2)).flatten()
            olen, ocap = n0.clone(), flat.outliers.shape[2]
            out = torch.zeros(B, H, ocap + D // 8, 4, dtype=torch.float16, device=DEV)
            out[:, :, :ocap] = flat.outliers
            flat.outliers = out
            flat.outlier_index = torch.zeros(B, H, 2, dtype=torch.int32, device=DEV)
        hqmq_tokens(x, flat, q.config.S, flat.rel, t0, _errors(), C=q.config.C, med3=q.med3,
                       outlier_len=olen, index_block=1 if q.med3 else None)
        for name in ("radius", "r_max") + (("flags",) if q.med3 else ()):
            assert torch.equal(getattr(flat, name)[:, :, t0:t0 + t], ref[name]), name
        if q.med3:
            got = torch.cat([flat.outliers[b, 0, n0[b]:olen[b]] for b in range(B)])
            assert torch.equal(got, ref["outliers"])
            assert torch.equal(flat.outlier_index[:, 0, 1], n0.int())  # the block's start
        nc, cb = D // 4, q.code_bits
        mine = unpack_bits(flat.codes[:, :, t0:t0 + t], cb, nc).flatten()
        want = unpack_bits(ref["codes"], cb, nc).flatten()
        bad = (mine != want).nonzero().flatten()
        diff, total = diff + bad.numel(), total + want.numel()
        if bad.numel():  # only exact search ties: equally good codewords
            chunks = x.float().reshape(-1, 4)[bad]
            u = chunks / chunks.norm(dim=-1, keepdim=True)
            da = _codeword_distance(q, packed.shared, mine[bad], u)
            db = _codeword_distance(q, packed.shared, want[bad], u)
            assert torch.allclose(da, db, atol=1e-6), (da, db)
    assert diff <= 0.01 * total


# ---- the cache: fast path == old path -----------------------------------------------------
def _layers(spec, dtype, seed, prefill, steps, mid=None, B=2, H=2, D=32):
    """The same writes through a fused layer with and without step encoding."""
    x = _data((2, B, H, prefill + steps + (mid or 0), D), dtype, seed)
    out = {}
    for fast in (True, False):
        layer = QuantizedLayer(spec, 0, seed=seed)
        layer.fused_wanted, layer.step_encode = True, fast
        with torch.inference_mode():
            layer.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
            t = prefill
            for i in range(steps):
                if mid and i == steps // 2:  # a multi-token write between steps: the old path
                    layer.update(x[0, :, :, t:t + mid], x[1, :, :, t:t + mid])
                    t += mid
                layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
                t += 1
        assert layer.mode == "fused"
        out[fast] = layer
    return out[True], out[False]


def _valid(store, name):
    b = store.buffers[name]
    if store.kind is L.KIVIFlat and name != "residual":
        return b.buf[:, :, : store.flat.n_groups * (1 if store.role == "K" else store.flat.group)]
    return b.valid


def _assert_same_cache(fast, old, tie_ok=False):
    assert fast.tokens == old.tokens and fast.nbytes() == old.nbytes() and fast.numel() == old.numel()
    for role in ("K", "V"):
        sf, so = fast.stores[role], old.stores[role]
        assert sf.stored_nbytes == so.stored_nbytes
        assert set(sf.buffers) == set(so.buffers)
        for name in sf.buffers:
            a, b = _valid(sf, name), _valid(so, name)
            if name == "codes" and tie_ok:
                assert (a != b).float().mean() <= 0.01
            else:
                assert torch.equal(a, b), (role, name)
        if getattr(sf, "outliers", None) is not None:
            assert torch.equal(sf.outlier_len, so.outlier_len)
            nblk = -(-sf.tokens // L.OUTLIER_BLOCK)
            assert torch.equal(sf.outlier_index.buf[:, :, :nblk], so.outlier_index.buf[:, :, :nblk])
            for bh in range(sf.B * sf.H):
                n = int(sf.outlier_len[bh])
                assert torch.equal(sf.outliers.view(sf.B * sf.H, -1, 4)[bh, :n], so.outliers.view(so.B * so.H, -1, 4)[bh, :n])
        pf, po = fast.packed[role], old.packed[role]
        assert pf.nbytes == po.nbytes and pf.nbytes_by_field() == po.nbytes_by_field()
        a, b = fast.read(role), old.read(role)
        assert torch.equal(a, b) if not tie_ok else torch.allclose(a, b, atol=0.2)


# Every step-encoded format once; each family (fp16, int, fp8, KIVI, HQMQ, Med3x) in both
# input dtypes (fp16: a 37-token prefill, bf16: 20), but not every config of a family in
# both: the encoders' dtype handling is per family, and the kernels' own dtype sweeps are
# above (test_int_rows_equal_quantize_groups, test_fp8_tokens_equal_torch_cast,
# test_hqmq_tokens_equal_encode_tokens). Med3x, KIVI-2 and int4 run in fp16 again, across
# buffer growth: test_fast_steps_across_growth_and_a_multi_token_write.
F16, BF16 = torch.float16, torch.bfloat16
FAST_CASES = [("int4", F16), ("int4", BF16), ("int2", F16), ("int8", BF16), ("int3", BF16),
              ("fp8-e4m3", F16), ("fp8-e4m3", BF16), ("fp8-e5m2", F16), ("fp8-e5m2", BF16),
              ("kivi:bits=2,group=8,residual=8", F16), ("kivi:bits=4,group=4,residual=8,window=fixed", BF16),
              ("hqmq:S=8,r=4", BF16), ("hqmq:S=24,r=3,radius=log", F16), ("hqmq:S=8,r=4,outliers=med3", BF16),
              ("fp16", F16), ("fp16", BF16)]
assert {s for s, _ in FAST_CASES} == set(SPECS)


@pytest.mark.parametrize("spec,dtype", FAST_CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in FAST_CASES])
def test_fast_steps_store_what_the_old_path_stores(spec, dtype):
    # (13 steps: the interpreter runs each program's ops one by one in Python, ~0.2-0.5 s
    # a step; KIVI flushes two or three times in them)
    seed, prefill = (0, 37) if dtype == torch.float16 else (1, 20)
    fast, old = _layers(spec, dtype, seed, prefill, steps=13)
    _assert_same_cache(fast, old, tie_ok="hqmq" in spec)
    assert all(s.in_run for s in fast.stores.values())  # the steps really went through the kernels


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,group=4,residual=8", "hqmq:S=8,r=4,outliers=med3"])
def test_fast_steps_across_growth_and_a_multi_token_write(spec, monkeypatch):
    # Buffers that double (MIN_CAPACITY 64), Med3x outlier lists that grow (little
    # slack), a 3-token write between steps folding the run into ordinary segments.
    monkeypatch.setattr(store_mod, "MIN_CAPACITY", 64)
    monkeypatch.setattr(hqmq_format, "OUTLIER_SLACK_STEPS", 1)
    fast, old = _layers(spec, torch.float16, 3, 62, steps=14, mid=3)
    _assert_same_cache(fast, old, tie_ok="hqmq" in spec)
    assert fast.stores["V"].buffers["codes"].capacity > 64  # (V: rows are tokens)


KIVI_DEVICE_SPECS = ["kivi:bits=2,group=4,residual=8", "kivi:bits=4,group=4,residual=8,window=fixed",
                     "kivi:bits=4,group=8,residual=2"]


@pytest.mark.parametrize("spec", KIVI_DEVICE_SPECS)
def test_kivi_device_position_steps_store_what_the_old_path_stores(spec):
    # KIVI's steps at a device position (`KernelStore.step_at`, CUDA graphs): the window
    # write, the flush and the shift decided on the device from the token count, the
    # host's counts set by `advance`. From a prefill of 13 tokens (not a multiple of R),
    # 14 steps cross >= 2 flushes per role (keys of the paper's window: all of it every
    # R (rounded up to G), values and the fixed window: one group every G past R; R=2 <
    # G=8 rounds the keys' period up), one host-position step in between (step 5).
    prefill, steps = 13, 14
    x = _data((2, 2, 2, prefill + steps, 32), torch.float16, 5)
    old = QuantizedLayer(spec, 0, seed=0)
    old.fused_wanted, old.step_encode = True, False
    cache = QuantizedCache(spec, n_layers=1, fused=True)
    flushes = {"K": 0, "V": 0}
    with torch.inference_mode():
        old.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
        cache.update(x[0, :, :, :prefill], x[1, :, :, :prefill], 0)
        assert cache.graph_unsupported() is None
        cache.reserve(prefill + steps)
        layer = cache.layers[0]
        for t in range(prefill, prefill + steps):
            xk, xv = x[0, :, :, t:t + 1], x[1, :, :, t:t + 1]
            old.update(xk, xv)
            before = {r: layer.stores[r].flat.n_groups for r in "KV"}
            if t == prefill + 5:
                cache.update(xk, xv, 0)  # host position: `step` (the counter is re-set after it)
            else:
                with cache.device_steps():
                    cache.update(xk, xv, 0)
                    cache.step_done()
                cache.advance(1)
            for r in "KV":
                flushes[r] += layer.stores[r].flat.n_groups > before[r]
    assert min(flushes.values()) >= 2, flushes
    assert all(s.in_run for s in layer.stores.values())
    _assert_same_cache(layer, old)
    assert cache.bits_per_element() == sum(p.nbytes for p in old.packed.values()) * 8 / old.numel()


def test_kivi_device_steps_refuse_to_pass_the_reserved_room():
    x = _data((2, 1, 2, 12, 32), torch.float16, 0)
    cache = QuantizedCache("kivi:bits=2,group=4,residual=8", n_layers=1, fused=True)
    with torch.inference_mode():
        cache.update(x[0, :, :, :10], x[1, :, :, :10], 0)
        cache.reserve(11)
        store = cache.layers[0].stores["V"]
        assert store.token_capacity >= 11 and store.kivi_policy == (8, 4)
        assert cache.layers[0].stores["K"].kivi_policy == (0, 8)
        with cache.device_steps():
            cache.update(x[0, :, :, 10:11], x[1, :, :, 10:11], 0)
            cache.step_done()
        cache.advance(1)
        with pytest.raises(ValueError, match="no reserved room"):
            with cache.device_steps():
                pass


def test_kivi_policy_matches_quantized_tokens():
    for spec in KIVI_DEVICE_SPECS + ["kivi:bits=2,group=32,residual=128", "kivi:bits=2,group=8,residual=0",
                                     "kivi:bits=2,group=8,residual=12,window=fixed"]:
        for role in ("K", "V"):
            q = get_quantizer(spec, role=role)
            a, p = kivi_policy(q)
            assert all(q.quantized_tokens(t) == max(0, t - a) // p * p for t in range(300)), (spec, role)
    q = get_quantizer("kivi:bits=2,group=8,residual=8", role="V")
    q.quantized_tokens = lambda t: t // 3 * 3  # a policy of another form: refused
    assert kivi_policy(q) is None
    # checked once per format and role, not per store (nor answered for another role)
    calls = []
    cls = type(get_quantizer("kivi:bits=4,group=16,residual=48", role="V"))
    orig = cls.quantized_tokens
    from kvqbench.kernels.formats import kivi as kivi_format

    with mock.patch.object(cls, "quantized_tokens", lambda self, t: calls.append(t) or orig(self, t)), \
            mock.patch.dict(kivi_format.KNOWN_POLICIES, clear=True):  # as in a fresh process
        first = kivi_policy(get_quantizer("kivi:bits=4,group=16,residual=48", role="V"))
        n = len(calls)
        assert n > 0 and kivi_policy(get_quantizer("kivi:bits=4,group=16,residual=48", role="V")) == first
        assert len(calls) == n
        kivi_policy(get_quantizer("kivi:bits=4,group=16,residual=48", role="K"))
        assert len(calls) > n


def test_plugins_and_disabled_step_encoding_take_the_old_path():
    x = _data((1, 2, 9, 32), torch.float16, 0)
    layer = QuantizedLayer("int4", 0)
    layer.fused_wanted, layer.step_encode = True, False
    layer.update(x[:, :, :8], x[:, :, :8])
    layer.update(x[:, :, 8:], x[:, :, 8:])
    assert layer.stores["K"].stepper is None and not layer.stores["K"].in_run
    # a subclass (a plugin) may encode differently: no step encoder for it
    my_int = type("MyInt", (type(get_quantizer("int4")),), {})
    assert not registry.format_of_quantizer(my_int).encodes_steps_of(my_int)


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,group=8,residual=8", "fp8-e4m3", "hqmq:S=8,r=4", "fp16"])
def test_greedy_logits_equal_old_path(tiny, spec):
    from transformers import AutoModelForCausalLM

    from kvqbench.suites.harness.attention import fused_attention

    model = AutoModelForCausalLM.from_pretrained(tiny["model"]).eval().to(DEV)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEV)
    logits = {}
    with torch.inference_mode(), fused_attention(model):
        for fast in (True, False):
            cache = QuantizedCache(spec, config=model.config, fused=True, step_encode=fast)
            kw = cache_kwargs(model, cache)
            out = model(input_ids=ids, **kw, use_cache=True).logits[:, -1:]
            steps = [out]
            for _ in range(6):
                out = model(input_ids=steps[-1].argmax(-1), **kw, use_cache=True).logits[:, -1:]
                steps.append(out)
            logits[fast] = torch.cat(steps, 1)
            assert all(layer.mode == "fused" and layer.fallbacks == 0 for layer in cache.layers)
            assert all(s.in_run == fast for layer in cache.layers for s in layer.stores.values())
            bits = logits.setdefault("bits", cache.bits_per_element())
            assert cache.bits_per_element() == bits
    if "hqmq" in spec:  # exact search ties may pick another, equally good codeword
        assert torch.allclose(logits[True], logits[False], atol=1e-3)
    else:
        assert torch.equal(logits[True], logits[False])


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,bad,match", [
    ("int4", float("nan"), "NaN/Inf"), ("hqmq:S=8,r=4,outliers=med3", float("inf"), "NaN/Inf"),
    ("kivi:bits=2,group=8,residual=8", 1e6, "overflows the fp16"), ("fp8-e4m3", float("nan"), "NaN/Inf"),
    ("int4", 7e4, "overflows the fp16"), ("fp16", 7e4, "overflow"), ("fp16", float("nan"), "NaN/Inf")])
def test_bad_step_input_raises_when_checked(spec, bad, match):
    x = _data((1, 2, 12, 32), torch.float32, 0)
    layer = QuantizedLayer(spec, 3)
    layer.fused_wanted = True
    layer.update(x[:, :, :10], x[:, :, :10])
    assert layer.nbytes() > 0  # clean so far
    v = x[:, :, 10:11].clone()
    v[0, 1, 0, 5] = bad
    layer.update(x[:, :, 10:11], v)  # no host read here: nothing raised yet
    with pytest.raises(QuantizerInputError, match=rf"layer 3 V: .*token 10.*{match}"):
        layer.nbytes()
    # the later steps' polls (the token named: on CUDA a KIVI flush may add a NaN/Inf by then)
    raised_by_later_steps(lambda: layer.update(x[:, :, 11:12], x[:, :, 11:12]), rf"layer 3 V: .*token 10\b")


# ---- what a step costs ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["int4", "int8", "fp8-e4m3", "kivi:bits=2,group=8,residual=8", "hqmq:S=96,r=4",
                                  "hqmq:S=96,r=4,outliers=med3"])
def test_fast_step_has_no_host_read_and_one_launch_per_role(spec):
    # The real write path (QuantizedLayer.update of one token, K and V), 20 steps (KIVI:
    # two flushes). Figures per layer (K + V), head_dim 128, 8 kv heads.
    new = write_cost(spec, steps=20, context=64)
    old = write_cost(spec, steps=4, context=64, step_encode=False)
    assert new["mode"] == old["mode"] == "fused"
    assert new["max_host_reads"] == 0 < old["max_host_reads"]
    if "kivi" in spec:  # a flush: one int launch and a shift (2 torch ops) per role
        assert set(new["launches"]) == {2, 4} and new["max_ops"] <= 4
    else:
        assert set(new["launches"]) == {2} and new["max_ops"] == 0
    assert old["max_ops"] >= 20


# ---- what a first run compiles --------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_step_kernels_receive_16_byte_aligned_pointers(spec):
    """Triton compiles one kernel per specialisation, and a pointer's 16-byte alignment is
    part of it: a role whose buffer is a misaligned view (the V error row of a [2, 3] int32
    flag tensor sat at byte 12) made every step kernel compile twice on a fresh machine.
    Every tensor a step launch receives, over a prefill and a few steps, starts aligned."""
    layer = QuantizedLayer(spec, 0, seed=0)
    layer.fused_wanted, layer.step_encode, layer.capacity_hint = True, True, 80
    x = torch.randn(2, 1, 2, 72, 64).to(torch.bfloat16)
    seen = []

    def record(kernel, grid, *args, **const):
        seen.extend((getattr(kernel, "__name__", str(kernel)), i, a.data_ptr() % 16)
                    for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}), mock.patch.object(se, "launch_hook", record), \
            torch.inference_mode():
        layer.update(x[0, :, :, :64], x[1, :, :, :64])
        for t in range(64, 72):
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
    assert seen, f"{spec}: no step launch seen (mode {layer.mode})"
    bad = sorted({s for s in seen if s[2]})
    assert not bad, f"{spec}: (kernel, argument index, address % 16) of misaligned pointers: {bad}"


def _launch_key(kernel, args) -> tuple:
    """What Triton specialises a launch on, as far as the data could change it: each tensor's
    dtype and 16-byte alignment, each integer as 1 / multiple of 16 / other."""
    def cls(a):
        if isinstance(a, torch.Tensor):
            return (str(a.dtype), a.data_ptr() % 16 == 0)
        if isinstance(a, int) and not isinstance(a, bool):
            return "1" if a == 1 else "d16" if a % 16 == 0 else "int"
        return type(a).__name__
    return (getattr(kernel, "__name__", str(kernel)),) + tuple(cls(a) for a in args)


def test_med3_step_launches_do_not_specialise_on_the_outlier_count():
    """Med3x's step kernel receives the outlier list's stride; the list's capacity followed
    the prefill's outlier count, so its 16-divisibility (and with it the compiled variant)
    changed with the data: seed 1 of a fresh machine's compare recompiled what seed 0 had
    compiled. The same schedule with few and with many outliers must launch the same keys."""
    spec = "hqmq:S=24,r=3,outliers=med3"
    x = torch.randn(2, 1, 2, 72, 64, generator=torch.Generator().manual_seed(0))
    many = x.clone()
    chunks = many.view(2, 1, 2, 72, 16, 4)
    chunks[:, :, 0, :50, 0] = 8.0  # radius 16 against a median near 2: 50 + 51 more outliers
    chunks[:, :, 1, :51, 1] = 8.0
    # the compiled kernels on a GPU (patching TRITON_INTERPRET there does not reach kernels
    # Triton has already set up: they got the CPU tensors), the interpreter elsewhere
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    interp = {} if dev == "cuda" else {"TRITON_INTERPRET": "1"}
    keys = []
    for data in (x.to(dev), many.to(dev)):
        layer = QuantizedLayer(spec, 0, seed=0)
        layer.fused_wanted, layer.step_encode, layer.capacity_hint = True, True, 80
        seen = set()

        def record(kernel, grid, *args, **const):  # the prefill is a launch too: run it
            seen.add(_launch_key(kernel, args))
            kernel[grid](*args, **const)
        with mock.patch.dict(os.environ, interp), mock.patch.object(se, "launch_hook", record), \
                torch.inference_mode():
            layer.update(data[0, :, :, :64].to(torch.bfloat16), data[1, :, :, :64].to(torch.bfloat16))
            for t in range(64, 72):
                layer.update(data[0, :, :, t:t + 1].to(torch.bfloat16), data[1, :, :, t:t + 1].to(torch.bfloat16))
        keys.append(seen)
    n_out = int(layer.stores["K"].outlier_len.sum())
    assert n_out >= 101, f"the data meant to give a long outlier list gave {n_out} outliers"
    assert keys[0], "no step launch seen"
    assert keys[0] == keys[1], (f"launch keys differ with the data (outliers {n_out}): "
                                f"{sorted(keys[0] ^ keys[1], key=str)}")
