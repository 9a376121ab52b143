"""Multi-token writes (a prefill, a later chunk) of a fused cache encoded on the device by
the format's step encoder (`Format.multi_step`, `KernelStore.create_empty` / `steps`,
suites/harness/kv_cache.py `QuantizedLayer._device_write`):

- for fp16, per-token int, HQMQ without Med3x and KIVI, a fused cache whose prefill (and
  a later chunk) went through the device path holds the same bytes (Packed digest, every
  store buffer; HQMQ: codes up to exact search ties), the same segments, decodes the
  same, measures the same bits, and greedy decoding gives the same logits as the old
  path (the quantizer's `append`, then `KernelStore.create` / `append`); KIVI with small
  groups and windows (keys' groups and values' tokens quantized, both windows kept, a
  chunk that completes the window's last group and one the window alone flushes) and
  with its default group / window (a 170-token prefill);
- bad input in the prefill raises the old path's error (NaN/Inf, fp16 overflow; KIVI: in
  its window or in a quantized group, and a 1-bit group's step overflow), naming layer,
  role and token: at once when the prefill's attention reads the cache, else when
  results are next read or at the next step;
- HQMQ + Med3x (its median over the write, per-(b, h) outlier lists) likewise, its lists,
  their lengths and 64-token index blocks too (a prefill and a chunk crossing a block,
  lists that grow), the write's segment made when the cache is read;
- fp8 (its scale is fitted on the first write), per-channel int keys, KIVI values whose
  channel groups do not divide the head dim, a dense layer and `step_encode=False` take
  the old path;
- the prefill write costs one launch per (layer, role), KIVI two (the window, checking
  every token, and the groups; one without a group), Med3x two (the median and list
  positions, then the encode) and no host read.

CPU: the kernels run under the Triton interpreter, tiny shapes.
"""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import raised_by_later_steps  # noqa: E402
from kvqbench.kernels import store as store_mod  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedCache, QuantizedLayer, cache_kwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KIVI_SPECS = ["kivi:bits=2,group=8,residual=8", "kivi:bits=4,group=4,residual=2", "kivi:bits=3,group=4,residual=8",
              "kivi:bits=4,group=4,residual=8,window=fixed"]
# fp8: its scale fitted on the write before the device codes it (`Quantizer.empty_for`)
DEVICE_SPECS = ["fp16", "int4", "int2", "int8", "hqmq:S=8,r=4", "hqmq:S=8,r=4,pack=mixed", "fp8-e4m3",
                "fp8-e5m2", "fp8-e4m3-head"] + KIVI_SPECS
MED3 = "hqmq:S=8,r=4,outliers=med3"


def _launches(spec, tokens: int) -> int:
    """Triton launches of a device-encoded first write of `tokens` tokens (K and V): one per
    role; KIVI one per role for its window (every token checked) plus one where the write
    quantizes a group; Med3x three per role (`hqmq_med3_write`: the radii, the list
    positions, the encode; the median between them is torch's)."""
    if not spec.startswith("kivi"):
        return 6 if "outliers=med3" in spec else 2
    return sum(1 + bool(get_quantizer(spec, role=r).quantized_tokens(tokens)) for r in ("K", "V"))


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g).mul(4).add(0.01)
    x[..., 3] *= 8  # a hot channel: wide int groups
    return x.to(DEV, dtype)


def _old_prefill():
    """Every multi-token write through the quantizer (the path before the device one)."""
    return mock.patch.object(QuantizedLayer, "_device_write", lambda self, k, v: False)


def _path(device: bool):
    return contextlib.nullcontext() if device else _old_prefill()


def _run(spec, x, prefill, steps, *, device, mid=0, mode="quantized"):
    """A fused layer: a prefill of `prefill` tokens, then `steps` one-token steps with a
    `mid`-token write halfway; (layer, Triton launches of the prefill, what it returned)."""
    layer = QuantizedLayer(spec, 1, seed=0)
    layer.fused_wanted, layer.prefill = True, mode
    with torch.inference_mode(), _path(device):
        n0 = se.LAUNCHES[0]
        out = layer.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
        launches = se.LAUNCHES[0] - n0
        t = prefill
        for i in range(steps):
            if mid and i == steps // 2:
                layer.update(x[0, :, :, t:t + mid], x[1, :, :, t:t + mid])
                t += mid
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
            t += 1
    return layer, launches, out


def _assert_same(new, old, ties: bool):
    assert new.mode == old.mode == "fused" and new.tokens == old.tokens
    assert new.nbytes() == old.nbytes() and new.numel() == old.numel()
    for role in ("K", "V"):
        pn, po = new.packed[role], old.packed[role]
        assert [s.tokens for s in pn.segments] == [s.tokens for s in po.segments], role
        assert pn.nbytes_by_field() == po.nbytes_by_field()
        sn, so = new.stores[role], old.stores[role]
        assert set(sn.buffers) == set(so.buffers) and sn.stored_nbytes == so.stored_nbytes
        for name in sn.buffers:
            a, b = sn.buffers[name].valid, so.buffers[name].valid
            if ties and name == "codes":  # exact search ties: another, equally good codeword
                q, nc = get_quantizer(new.spec), sn.D // 4
                assert (q.unpack_codes(a, nc) != q.unpack_codes(b, nc)).float().mean() <= 0.01, role
            else:
                assert torch.equal(a, b), (role, name)
        a, b = new.read(role), old.read(role)
        if ties:
            assert torch.allclose(a, b, atol=0.2)
        else:
            assert pn.digest() == po.digest(), role
            assert torch.equal(a, b), role


# Every device-encoded format once; each format family (fp16, int, HQMQ, fp8, KIVI) in
# both input dtypes, but not every config of a family in both: the step encoders' dtype
# handling is one per family (the kernels' own dtype sweeps: test_step_encode.py
# test_int_rows_equal_quantize_groups, test_fp8_tokens_equal_torch_cast,
# test_hqmq_tokens_equal_encode_tokens). The cheap fp16 / fp8 configs keep both dtypes.
F16, BF16 = torch.float16, torch.bfloat16
DEVICE_CASES = [("fp16", F16), ("fp16", BF16), ("int4", F16), ("int4", BF16), ("int2", F16), ("int8", BF16),
                ("hqmq:S=8,r=4", F16), ("hqmq:S=8,r=4,pack=mixed", BF16)] + \
               [(s, d) for s in ("fp8-e4m3", "fp8-e5m2", "fp8-e4m3-head") for d in (F16, BF16)] + \
               [(s, (F16, BF16)[i % 2]) for i, s in enumerate(KIVI_SPECS)]
assert {s for s, _ in DEVICE_CASES} == set(DEVICE_SPECS)


@pytest.mark.parametrize("spec,dtype", DEVICE_CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in DEVICE_CASES])
def test_device_prefill_stores_what_the_old_prefill_stores(spec, dtype):
    x = _data((2, 2, 2, 40, 32), dtype, 0 if dtype == torch.float16 else 1)
    new, launches, out_new = _run(spec, x, 29, 4, device=True, mid=5)
    old, launches_old, out_old = _run(spec, x, 29, 4, device=False, mid=5)
    assert launches == _launches(spec, 29) and launches_old == 0  # the device path was taken
    _assert_same(new, old, ties="hqmq" in spec)
    for a, b in zip(out_new, out_old):  # what the prefill's attention read: the decoded prefill
        assert a.shape == b.shape and (torch.equal(a, b) if "hqmq" not in spec else torch.allclose(a, b, atol=0.2))


def test_kivi_default_groups_and_window():
    # group 32, window 128: a 170-token prefill quantizes 4 key groups (the paper's key
    # window: 128 tokens at a time, T mod 128 kept fp16) and 1 value group (138 fp16); a
    # 40-token chunk then makes the values' window flush a group
    x = _data((2, 1, 2, 213, 32), torch.bfloat16, 5)
    new, launches, out_new = _run("kivi:bits=4", x, 170, 2, device=True, mid=40)
    old, _, out_old = _run("kivi:bits=4", x, 170, 2, device=False, mid=40)
    assert launches == 4 and new.stores["K"].flat.n_groups == 4 and new.stores["V"].flat.n_groups == 2
    _assert_same(new, old, ties=False)
    for a, b in zip(out_new, out_old):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["int4", "hqmq:S=8,r=4", "fp16", "kivi:bits=2,group=8,residual=8"])
def test_exact_prefill_reads_nothing_and_grows(spec, monkeypatch):
    # prefill="exact": attention reads the unquantized K/V (nothing decoded); a prefill
    # past the buffers' capacity, then a chunk that makes them grow (MIN_CAPACITY 64).
    monkeypatch.setattr(store_mod, "MIN_CAPACITY", 64)
    x = _data((2, 1, 2, 150, 32), torch.float16, 2)
    new, launches, out = _run(spec, x, 70, 2, device=True, mid=70, mode="exact")
    old, _, _ = _run(spec, x, 70, 2, device=False, mid=70, mode="exact")
    assert launches == _launches(spec, 70)
    assert out[0] is not None and torch.equal(out[0], x[0, :, :, :70])  # the K it computed
    assert new.stores["K"].token_capacity >= 142
    _assert_same(new, old, ties="hqmq" in spec)


@pytest.mark.parametrize("spec", ["int4:keys=per-channel", "kivi:bits=2,group=24,residual=8"])
def test_formats_that_fit_or_window_take_the_old_path(spec):
    x = _data((2, 1, 2, 20, 32), torch.float16, 3)
    new, launches, _ = _run(spec, x, 16, 2, device=True)
    old, _, _ = _run(spec, x, 16, 2, device=False)
    assert launches == 0  # the quantizer's own write
    assert new.mode == old.mode
    for role in ("K", "V"):
        assert new.packed[role].digest() == old.packed[role].digest()


def test_dense_and_disabled_step_encoding_take_the_old_path():
    x = _data((2, 1, 2, 16, 32), torch.float16, 4)
    for setup in ({"fused_wanted": False}, {"fused_wanted": True, "step_encode": False}):
        layer = QuantizedLayer("int4", 0)
        for k, v in setup.items():
            setattr(layer, k, v)
        n0 = se.LAUNCHES[0]
        layer.update(x[0], x[1])
        assert se.LAUNCHES[0] == n0, setup
        assert layer.mode == ("dense" if not setup["fused_wanted"] else "fused")


@pytest.mark.parametrize("spec,bad,match", [
    ("int4", float("nan"), "NaN/Inf"), ("int4", 7e4, "overflows the fp16"), ("fp16", float("inf"), "NaN/Inf"),
    ("fp16", 7e4, "overflows the fp16"), ("hqmq:S=8,r=4", float("nan"), "NaN/Inf"),
    ("hqmq:S=8,r=4", 1e5, "overflows the fp16"),
    # KIVI: token 7 of V in the fp16 window (group 8, window 8) and in a quantized group (window 2)
    ("kivi:bits=2,group=8,residual=8", float("nan"), "NaN/Inf"), ("kivi:bits=2,group=8,residual=8", 7e4, "overflows the fp16"),
    ("kivi:bits=4,group=4,residual=2", float("-inf"), "NaN/Inf"), ("kivi:bits=4,group=4,residual=2", 1e5, "overflows the fp16"),
    # Med3x: the bad chunk is an outlier (kept in fp16: 1e5 overflows it)
    (MED3, float("nan"), "NaN/Inf"), (MED3, float("-inf"), "NaN/Inf"), (MED3, 1e5, "overflows the fp16")])
def test_bad_prefill_input_raises_the_old_error(spec, bad, match):
    x = _data((2, 1, 2, 12, 32), torch.float32, 0)
    v = x[1, :, :, :10].clone()
    v[0, 1, 7, 5] = bad
    old = QuantizedLayer(spec, 3)
    old.fused_wanted = True
    with _old_prefill(), pytest.raises(QuantizerInputError, match=match):
        old.update(x[0, :, :, :10], v)
    # the prefill's attention reads the cache: raised at once, naming layer, role, token
    layer = QuantizedLayer(spec, 3)
    layer.fused_wanted = True
    with pytest.raises(QuantizerInputError, match=rf"layer 3 V: .*token 7.*{match}"):
        layer.update(x[0, :, :, :10], v)
    # prefill="exact" reads nothing: raised when results are read, and at the next step
    layer = QuantizedLayer(spec, 3)
    layer.fused_wanted, layer.prefill = True, "exact"
    n0 = se.LAUNCHES[0]
    layer.update(x[0, :, :, :10], v)
    assert se.LAUNCHES[0] - n0 == _launches(spec, 10)  # (the device path took it)
    with pytest.raises(QuantizerInputError, match=rf"layer 3 V: .*token 7.*{match}"):
        layer.nbytes()
    # the later steps' polls (the token named: on CUDA a KIVI flush may add a NaN/Inf by then)
    raised_by_later_steps(lambda: layer.update(x[0, :, :, 10:11], x[1, :, :, 10:11]), rf"layer 3 V: .*token 7\b")


@pytest.mark.parametrize("role", ["K", "V"])
def test_kivi_group_step_overflow_in_the_prefill_raises(role):
    # 1-bit codes: finite values -6e4 and 6e4 in one group need a step beyond fp16 (the old
    # path's `group_params` error); the device path's group launch flags it, naming the
    # group's first token (keys: channel 5 over tokens 4..7) or the token (values: token 7)
    spec, tok = "kivi:bits=1,group=4,residual=2", 4 if role == "K" else 7
    x = _data((2, 1, 2, 10, 32), torch.float32, 0)
    if role == "K":
        x[0, 0, 1, 6, 5], x[0, 0, 1, 7, 5] = -6e4, 6e4
    else:
        x[1, 0, 1, 7, 4], x[1, 0, 1, 7, 5] = -6e4, 6e4
    old = QuantizedLayer(spec, 3)
    old.fused_wanted = True
    with _old_prefill(), pytest.raises(QuantizerInputError, match="the fp16 the cache stores"):
        old.update(x[0], x[1])
    layer = QuantizedLayer(spec, 3)
    layer.fused_wanted = True
    with pytest.raises(QuantizerInputError, match=rf"layer 3 {role}: .*token {tok}\b.*the fp16 the cache stores"):
        layer.update(x[0], x[1])


@pytest.mark.parametrize("spec", ["int4", "hqmq:S=8,r=4", "fp16", "kivi:bits=2,group=8,residual=8", MED3])
def test_greedy_logits_equal_old_prefill(tiny, spec):
    from transformers import AutoModelForCausalLM

    from kvqbench.suites.harness.attention import fused_attention

    model = AutoModelForCausalLM.from_pretrained(tiny["model"]).eval().to(DEV)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEV)
    for mode in ("quantized", "exact"):
        logits, bits = {}, {}
        for device in (True, False):
            with torch.inference_mode(), fused_attention(model), _path(device):
                cache = QuantizedCache(spec, config=model.config, fused=True, prefill=mode)
                kw = cache_kwargs(model, cache)
                n0 = se.LAUNCHES[0]
                out = model(input_ids=ids, **kw, use_cache=True).logits[:, -1:]
                assert se.LAUNCHES[0] - n0 == (_launches(spec, ids.shape[1]) * len(cache.layers) if device else 0)
                steps = [out]
                for _ in range(5):
                    out = model(input_ids=steps[-1].argmax(-1), **kw, use_cache=True).logits[:, -1:]
                    steps.append(out)
                logits[device] = torch.cat(steps, 1)
                assert all(layer.mode == "fused" and layer.fallbacks == 0 for layer in cache.layers)
                bits[device] = (cache.bits_per_element(), cache.cache_bits_per_element())
        assert bits[True] == bits[False], mode
        if "hqmq" in spec:  # exact search ties may pick another, equally good codeword
            assert torch.allclose(logits[True], logits[False], atol=1e-3), mode
        else:
            assert torch.equal(logits[True], logits[False]), mode


def _prefill_cost(spec, device: bool, context=512, heads=8, head_dim=128) -> dict:
    """Torch ops / Triton launches / host reads of one layer's prefill write (K and V) of
    `context` tokens, counted as `write_cost` counts a step (launches stubbed on a CPU),
    after a warm-up write (layouts are learnt once per process)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 1, heads, context, head_dim, generator=torch.Generator().manual_seed(0)).to(DEV, torch.bfloat16)
    hook = (lambda *a, **k: None) if DEV.type == "cpu" else se.launch_hook
    with _path(device), \
            mock.patch.object(se, "launch_hook", hook), torch.inference_mode():
        for _ in range(2):
            layer = QuantizedLayer(spec, 0, seed=0)
            layer.fused_wanted, layer.prefill = True, "exact"
            n0 = se.LAUNCHES[0]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                layer.update(x[0], x[1])
            events = list(prof.events())
    return {"mode": layer.mode, "launches": se.LAUNCHES[0] - n0,
            "ops": sum(e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
                       for e in events),
            "host_reads": sum(e.name == "aten::_local_scalar_dense" for e in events)}


@pytest.mark.parametrize("spec", ["fp16", "int4", "hqmq:S=96,r=4", "kivi:bits=4", "kivi:bits=2",
                                  "hqmq:S=96,r=4,outliers=med3"])
def test_device_prefill_has_few_launches_per_role_and_no_host_read(spec):
    # 512 tokens, 8 heads of 128: one launch per role; KIVI two (its window, checking every
    # token, and its groups, 16 of the keys and 12 of the values: 384 tokens); Med3x three
    # (the radii, the list positions per (b, h) after torch's median, the encode per token)
    new, old = _prefill_cost(spec, True), _prefill_cost(spec, False)
    assert new["mode"] == old["mode"] == "fused"
    assert new["launches"] == _launches(spec, 512) == (6 if "med3" in spec else 4 if "kivi" in spec else 2)
    assert new["host_reads"] == 0 < old["host_reads"]
    assert new["ops"] < old["ops"]
    if "kivi" in spec:  # (measured: 44 against the old path's 472; the group Segments are views made
        assert new["ops"] <= 50  # one op per field for them all, not one per group)
    if "med3" in spec:  # (measured on a CPU: 73 against the old path's 4478 and 16 host reads;
        assert new["ops"] <= 80  # allocations: the store's buffers and lists, two scratch tensors)


# ---- HQMQ + Med3x: the median over the write, per-(b, h) outlier lists ---------------------
def _assert_same_med3(new, old):
    """`_assert_same` (codes up to exact search ties) plus Med3x's own: every segment field
    but the codes (flags, fp16 outliers, r_max, radius) equal, and the store's per-(b, h)
    lists, their lengths and the 64-token index blocks; the lists are not empty and reach
    past the first block."""
    _assert_same(new, old, ties=True)
    for role in ("K", "V"):
        for sn, so in zip(new.packed[role].segments, old.packed[role].segments):
            assert set(sn.fields) == set(so.fields)
            for name in so.fields:
                if name != "codes":
                    assert torch.equal(sn.fields[name], so.fields[name]), (role, name)
        sn, so = new.stores[role], old.stores[role]
        assert torch.equal(sn.outlier_len, so.outlier_len), role
        assert sn.outlier_index.length == so.outlier_index.length == -(-sn.tokens // 64)
        assert torch.equal(sn.outlier_index.valid, so.outlier_index.valid), role
        assert (sn.outlier_index.valid[:, :, 1:] > 0).all()  # outliers before token 64 in every list
        BH = sn.B * sn.H
        for bh in range(BH):
            n = int(so.outlier_len[bh])
            assert torch.equal(sn.outliers.view(BH, -1, 4)[bh, :n], so.outliers.view(BH, -1, 4)[bh, :n]), role


# Both dtypes, each once (as DEVICE_CASES): plain codes in fp16, mixed packing in bf16.
@pytest.mark.parametrize("spec,dtype", [(MED3, torch.float16), (MED3 + ",pack=mixed", torch.bfloat16)])
def test_med3_device_prefill_stores_what_the_old_prefill_stores(spec, dtype):
    # a 70-token prefill (its lists cross the 64-token index block), 4 steps with a 5-token
    # chunk halfway (a second device write, its own median)
    x = _data((2, 1, 2, 79, 32), dtype, 0 if dtype == torch.float16 else 1)
    new, launches, out_new = _run(spec, x, 70, 4, device=True, mid=5)
    old, launches_old, out_old = _run(spec, x, 70, 4, device=False, mid=5)
    assert launches == _launches(spec, 70) == 6 and launches_old == 0  # the device path was taken
    _assert_same_med3(new, old)
    for a, b in zip(out_new, out_old):  # what the prefill's attention read
        assert a.shape == b.shape and torch.allclose(a, b, atol=0.2)


def test_med3_exact_prefill_then_a_chunk_that_grows_the_lists(monkeypatch):
    # prefill="exact": nothing read, so the prefill's segment waits in the run (made when
    # read, no host read at the write); a 70-token chunk after 2 steps whose index block
    # (token 128) opens mid-write, buffers that double (MIN_CAPACITY 64) and lists that
    # grow (one step of slack)
    from kvqbench.kernels.formats import hqmq as hqmq_format

    monkeypatch.setattr(store_mod, "MIN_CAPACITY", 64)
    monkeypatch.setattr(hqmq_format, "OUTLIER_SLACK_STEPS", 1)
    x = _data((2, 1, 2, 144, 32), torch.float16, 2)
    layer = QuantizedLayer(MED3, 1, seed=0)
    layer.fused_wanted, layer.prefill = True, "exact"
    with torch.inference_mode():
        layer.update(x[0, :, :, :70], x[1, :, :, :70])
    assert all(s.in_run and s.segment_on_read for s in layer.stores.values())
    assert layer.packed["K"].tokens == 70 and [s.tokens for s in layer.packed["V"].segments] == [70]
    grew, resized = [], hqmq_format.resized  # (the lists grow, then the step after each write cuts them)
    monkeypatch.setattr(hqmq_format, "resized",
                        lambda o, cap, keep: grew.append(cap > o.shape[2]) or resized(o, cap, keep))
    new, launches, out = _run(MED3, x, 70, 4, device=True, mid=70, mode="exact")
    assert any(grew)
    old, _, _ = _run(MED3, x, 70, 4, device=False, mid=70, mode="exact")
    assert launches == 6 and out[0] is not None and torch.equal(out[0], x[0, :, :, :70])
    assert new.stores["K"].token_capacity >= 144
    assert [s.tokens for s in new.packed["K"].segments] == [70, 2, 70, 2]
    _assert_same_med3(new, old)


@pytest.mark.parametrize("case", ["mixed", "half", "zero", "ties"])
def test_med3_write_kernels_equal_encode_tokens(case):
    # `hqmq_med3_write` against `HQMQ.encode_tokens` of the same write at token 50 of a
    # cache (its index block 1 opens at the write's token 14): heavy-tailed data; half the
    # chunks C times past the median (the worst case the room is made for); most chunks
    # zero (median 0: every nonzero chunk an outlier); every radius equal (no outlier).
    # (Exact radii: signed axis directions, random.)
    from kvqbench.kernels import layout
    from kvqbench.kernels.hqmq_encode import hqmq_med3_write
    from kvqbench.quantizers.hqmq import outlier_block_starts
    from kvqbench.quantizers.packing import unpack_bits

    B, H, D, t0, t = 2, 1, 32, 50, 25
    nc = D // 4
    q = get_quantizer(MED3, role="V", seed=1)
    prev = q.encode(_data((B, H, t0, D), torch.float16, 3))
    x = _data((B, H, t, D), torch.float16, 4)
    if case in ("half", "ties"):
        g = torch.Generator().manual_seed(5)
        axes = torch.nn.functional.one_hot(torch.randint(0, 4, (B, H, t * nc), generator=g), 4).float()
        axes *= torch.randint(0, 2, (B, H, t * nc, 1), generator=g).float() * 2 - 1
        if case == "half":
            axes[:, :, 1::2] *= 100
        x = axes.view(B, H, t, D).to(DEV, torch.float16)
    elif case == "zero":
        x.view(B, H, t * nc, 4)[:, :, : t * nc * 2 // 3] = 0
    ref = q.encode_tokens(x.float(), prev.shared).fields
    flat = layout.flatten(prev, "V")
    cap, ocap = 128, flat.outliers.shape[2]
    for name in ("codes", "radius", "r_max", "flags"):
        buf = getattr(flat, name)
        grown = buf.new_zeros(buf.shape[:2] + (cap,) + buf.shape[3:])
        grown[:, :, :t0] = buf
        setattr(flat, name, grown)
    n0 = unpack_bits(flat.flags[:, :, :t0], 1, nc).sum((-1, -2)).flatten()
    olen = n0.clone()
    room = flat.outliers.new_zeros(B, H, ocap + t * D // 8, 4)
    room[:, :, :ocap] = flat.outliers
    flat.outliers = room
    flat.outlier_index = torch.full((B, H, 2), -1, dtype=torch.int32, device=DEV)
    errors = torch.tensor([0, se.NO_TOKEN, 0], dtype=torch.int32, device=DEV)
    hqmq_med3_write(x, flat, q.config.S, flat.rel, t0, errors, C=q.config.C, outlier_len=olen)
    assert errors.tolist() == [0, se.NO_TOKEN, 0]
    for name in ("radius", "r_max", "flags"):
        assert torch.equal(getattr(flat, name)[:, :, t0:t0 + t], ref[name]), name
    got, want = (q.unpack_codes(c, nc) for c in (flat.codes[:, :, t0:t0 + t], ref["codes"]))
    assert (got != want).float().mean() <= 0.01  # exact search ties
    per_tok = unpack_bits(ref["flags"], 1, nc).sum(-1)
    n = {"half": t * nc // 2, "ties": 0}.get(case)
    assert n is None or (per_tok.sum(-1) == n).all()
    assert torch.equal(olen, n0 + per_tok.sum(-1).flatten())
    lists = flat.outliers.view(B * H, -1, 4)
    assert torch.equal(torch.cat([lists[bh, n0[bh]:olen[bh]] for bh in range(B * H)]), ref["outliers"])
    starts = outlier_block_starts(unpack_bits(flat.flags[:, :, :t0 + t], 1, nc).sum(-1))
    assert torch.equal(flat.outlier_index[:, :, 1], starts[:, :, 1])  # the block the write opened
    assert (flat.outlier_index[:, :, 0] == -1).all()  # (one it did not open: untouched)
