"""Decode steps at a device position, the part of a decode step a CUDA graph replays
(kernels/graphs.py `GraphedDecodeStep`, `QuantizedCache.device_steps`):

- the step encoders write at a position read from a device tensor exactly the bytes
  they write at the same host position;
- the fused attention with a device valid length (`valid_len`, the flat's T then the
  capacity bound of the grid) equals the call with that host length, whatever the
  buffers hold past it, and the fp32 reference;
- a model's decode steps through `GraphedDecodeStep` give the same logits, tokens,
  stored bytes and measured bits as the ordinary fused steps (KIVI across its window
  flushes, decided on the device; Med3x's outlier lists and index blocks too); a format
  a graph cannot take (per-channel int keys) runs eagerly
  with the reason named; bad use raises.

CPU: no graph can be captured, so `GraphedDecodeStep` runs its device-position steps
uncaptured ("device" mode), through the same kernels under the Triton interpreter.
GPU (skipped without CUDA): the captured graph against the uncaptured device steps
(bit-equal) and the host-position fused steps (same tokens, close logits).
(One file for the whole device-step path, encoders to model, as one GPU call runs it:
hence its length.)

(About 510 lines: the device-position step of every format and of dense layers, graphed and not;
one subject, one file.)
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.kernels.decode_attention import decode_attention, reference_decode_attention  # noqa: E402
from kvqbench.kernels.graphs import GraphedDecodeStep  # noqa: E402
from kvqbench.kernels.hqmq_encode import hqmq_tokens  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.suites.harness.attention import fused_attention, kvqbench_mask  # noqa: E402
from kvqbench.suites.conformance import all_example_specs  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def _errors():
    e = torch.zeros(3, dtype=torch.int32, device=DEV)
    e[1] = se.NO_TOKEN
    return e


def _data(shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(DEV, dtype)


def _pos(t):
    return torch.tensor([t, t + 1], dtype=torch.int32, device=DEV)


# ---- step encoders: device position == host position, byte for byte ---------------------------
def test_int_rows_at_a_device_position_write_the_host_position_bytes():
    B, H, D, G, cap, t0 = 2, 3, 64, 16, 12, 7
    x = _data((B, H, 1, D), seed=1)
    x[1, 2, 0, 5] = float("nan")  # the error flag names the same token too
    out = {}
    for dev in (False, True):
        codes = torch.zeros(B, H, cap, D // 2, dtype=torch.uint8, device=DEV)
        scale, zero = (torch.zeros(B, H, cap, D // G, dtype=torch.float16, device=DEV) for _ in range(2))
        err = _errors()
        se.int_rows(x, x.stride()[:4] + (0,), 1, 1, codes, codes.stride()[:3] + (0,), scale, zero,
                    scale.stride()[:3] + (0,), 0 if dev else t0, 0, n=D, group=G, bits=4, err=err,
                    tok0=0 if dev else t0, token_rows=True, pos=_pos(t0) if dev else None)
        out[dev] = (codes, scale, zero, err)
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)
    assert out[True][0][:, :, t0].any() and not out[True][0][:, :, :t0].any()  # written at t0 only
    assert out[True][3].tolist() == [se.NONFINITE, t0, 1]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_tokens_at_a_device_position_write_the_host_position_bytes(fmt):
    B, H, D, cap, t0 = 2, 2, 32, 9, 5
    x = _data((B, H, 1, D), seed=2)
    scale = torch.tensor([0.5, 2.0], device=DEV)
    out = {}
    for dev in (False, True):
        codes = torch.zeros(B, H, cap, D, dtype=torch.uint8, device=DEV)
        se.fp8_tokens(x, codes, scale, fmt, 0 if dev else t0, _errors(), pos=_pos(t0) if dev else None)
        out[dev] = codes
    assert torch.equal(out[False], out[True]) and out[True][:, :, t0].any()


@pytest.mark.parametrize("spec", ["hqmq:S=8,r=4", "hqmq:S=24,r=3,radius=log"])
def test_hqmq_tokens_at_a_device_position_write_the_host_position_bytes(spec):
    q = get_quantizer(spec, role="K", seed=0)
    B, H, D, cap, t0 = 2, 2, 64, 12, 9
    packed = q.encode(_data((B, H, 4, D), seed=3))
    x = _data((B, H, 1, D), seed=4)
    out = {}
    for dev in (False, True):
        flat = L.flatten(packed, "K")
        for name in ("codes", "radius", "r_max"):
            buf = getattr(flat, name)
            setattr(flat, name, torch.zeros(buf.shape[:2] + (cap,) + buf.shape[3:], dtype=buf.dtype, device=DEV))
        hqmq_tokens(x, flat, q.config.S, flat.rel, 0 if dev else t0, _errors(), C=q.config.C,
                       pos=_pos(t0) if dev else None)
        out[dev] = flat
    for name in ("codes", "radius", "r_max"):
        assert torch.equal(getattr(out[False], name), getattr(out[True], name)), name
    assert out[True].codes[:, :, t0].any() and not out[True].codes[:, :, :t0].any()


def test_med3x_steps_at_a_device_position_cross_an_index_block_as_host_steps_do():
    # Med3x at a device position: outliers appended at the device list ends and the index
    # block start written by the kernel when the token opens a 64-token block (tokens
    # 60..79 cross 64), against the host-position steps, byte for byte.
    from kvqbench.kernels.store import KernelStore

    q = get_quantizer("hqmq:S=8,r=4,outliers=med3", role="K", seed=1)
    x = _data((2, 2, 80, 32), dtype=torch.float32, seed=6)
    x[..., 5] *= 8  # a hot channel: outliers in every token, rows differ
    host, dev = (KernelStore.create(q.encode(x[:, :, :60]), "K") for _ in range(2))
    dev.reserve(80)
    pos = _pos(60)
    for t in range(60, 80):
        host.step(x[:, :, t:t + 1], _errors())
        dev.step_at(x[:, :, t:t + 1], _errors(), pos)
        pos += 1
    dev.advance(20)
    assert host.tokens == dev.tokens == 80
    assert torch.equal(host.outlier_len, dev.outlier_len) and int(host.outlier_len.min()) > 0
    for name in ("codes", "radius", "r_max", "flags"):
        assert torch.equal(host.buffers[name].buf[:, :, :80], dev.buffers[name].buf[:, :, :80]), name
    assert host.outlier_index.length == dev.outlier_index.length == 2
    assert torch.equal(host.outlier_index.buf[:, :, :2], dev.outlier_index.buf[:, :, :2])
    for b in range(2):
        for h in range(2):
            n = int(host.outlier_len.view(2, 2)[b, h])
            assert torch.equal(host.outliers[b, h, :n], dev.outliers[b, h, :n])
    ours, theirs = dev.run_segments([])[0], host.run_segments([])[0]
    assert {k: torch.equal(v, theirs.fields[k]) for k, v in ours.fields.items()} == dict.fromkeys(theirs.fields, True)


def test_device_positions_are_checked_without_a_host_read():
    x = _data((1, 1, 1, 32))
    codes = torch.zeros(1, 1, 4, 32, dtype=torch.uint8, device=DEV)
    for bad in (torch.tensor([1], dtype=torch.int64, device=DEV), 3):
        with pytest.raises(ValueError, match="int32 tensor"):
            se.fp8_tokens(x, codes, torch.ones(1, device=DEV), "e4m3", 0, _errors(), pos=bad)
    q = get_quantizer("hqmq:S=8,r=4,outliers=med3", role="K")
    flat = L.flatten(q.encode(_data((1, 1, 4, 32))), "K")
    with pytest.raises(ValueError, match="finds its outlier index block on the device"):
        hqmq_tokens(x, flat, 8, flat.rel, 0, _errors(), med3=True, pos=_pos(4), index_block=0)


# ---- attention over a device valid length ------------------------------------------------------------
def _flats(spec, B, H, T, D, seed, extra=40):
    """(k, v) flats holding T + extra tokens (the tail: what a valid length of T must
    hide) and the dequantized first T tokens of K and V."""
    out = []
    for role in ("K", "V"):
        q = get_quantizer(spec, role=role, seed=seed)
        p = q.encode(_data((B, H, T + extra, D), seed=seed + (role == "V")))
        out.append((L.flatten(p, role), q.decode(p)[:, :, :T]))
    return out


@pytest.mark.parametrize("spec", ["int4", "fp8-e4m3", "hqmq:S=8,r=4", "fp16"])
def test_valid_len_attention_equals_the_host_length_call_and_the_reference(spec):
    B, H, Hq, D, T = 2, 2, 4, 32, 70
    (kc, kd), (vc, vd) = _flats(spec, B, H, T, D, seed=5)
    q = _data((B, Hq, 1, D), torch.float32, seed=6)
    cap = T + 40
    assert kc.T == cap
    kf, vf = (dataclasses.replace(f, T=T) for f in (kc, vc))
    host = decode_attention(q, kf, vf, backend="triton", num_splits=3, out_dtype=torch.float32).clone()
    vl = torch.tensor([T], dtype=torch.int32, device=DEV)
    # 5 splits cut for the capacity: the last ones hold no valid token (empty partials)
    dev = decode_attention(q, kc, vc, backend="triton", num_splits=5, out_dtype=torch.float32, valid_len=vl)
    ref = reference_decode_attention(q, kd, vd)
    assert torch.allclose(dev, host, atol=1e-5, rtol=1e-5)
    assert torch.allclose(dev, ref, atol=1e-4, rtol=1e-4)
    junk = decode_attention(q, kc, vc, backend="triton", num_splits=5, out_dtype=torch.float32).clone()
    assert not torch.allclose(junk, ref, atol=1e-3)  # without the valid length the tail counts
    vl.fill_(cap + 100)  # clamped to T: the capacity bound
    assert torch.equal(decode_attention(q, kc, vc, backend="triton", num_splits=5, out_dtype=torch.float32,
                                        valid_len=vl), junk)


def test_valid_len_is_checked():
    (kf, _), (vf, _) = _flats("int4", 1, 1, 16, 32, seed=0, extra=0)
    q = _data((1, 1, 1, 32), torch.float32)
    for bad in (torch.tensor([16], device=DEV), torch.tensor([16, 1], dtype=torch.int32, device=DEV), 16):
        with pytest.raises(ValueError, match="valid_len"):
            decode_attention(q, kf, vf, backend="triton", valid_len=bad)
    kv = [L.flatten(get_quantizer("kivi:bits=2,group=8,residual=8", role=r).encode(_data((1, 1, 16, 32))), r)
          for r in ("K", "V")]
    vl = torch.tensor([16], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="KIVI kernel takes valid_len only with KIVIGraphFlat"):
        decode_attention(q, *kv, backend="triton", valid_len=vl)  # no window policy: no counts
    # the CUDA kernel takes a device count through graph views only (on a machine without
    # CUDA the backend itself refuses a CPU q)
    why = "KIVI takes a device count only with KIVIGraphFlat" if q.is_cuda else "q not on a CUDA device"
    with pytest.raises(ValueError, match=why):
        decode_attention(q, *kv, backend="cuda", valid_len=vl)


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=8,residual=16", "kivi:bits=4,group=8,residual=8,window=fixed"])
def test_kivi_valid_len_attention_equals_the_host_counts_call_and_the_reference(spec):
    # KIVI's counts (groups, window rows per side) from the device length by the window
    # policy; the grid cut for the capacity (empty splits), junk past the valid rows.
    B, H, Hq, D, T, cap = 2, 2, 4, 32, 157, 400
    x = _data((2, B, H, T, D), seed=7)
    q = _data((B, Hq, 1, D), torch.float32, seed=8)
    with torch.inference_mode():
        cache = QuantizedCache(spec, n_layers=1, fused=True)
        cache.update(x[0], x[1], 0)
        cache.reserve(cap)
        layer = cache.layers[0]
        g = torch.Generator().manual_seed(9)
        for role in ("K", "V"):
            st = layer.stores[role]
            per = 1 if role == "K" else st.flat.group
            for name, b in st.buffers.items():
                n = st.flat.n_res if name == "residual" else st.flat.n_groups * per
                junk = torch.randint(0, 255, b.buf[:, :, n:].shape, generator=g).to(DEV)
                b.buf[:, :, n:] = junk if b.buf.dtype == torch.uint8 else junk.to(b.buf.dtype) / 64
        host = decode_attention(q, layer.stores["K"].kernel_view(), layer.stores["V"].kernel_view(),
                                backend="triton", num_splits=2, out_dtype=torch.float32).clone()
        ref = reference_decode_attention(q, layer.read("K"), layer.read("V"))
        kg, vg = layer.stores["K"].graph_view(cap), layer.stores["V"].graph_view(cap)
        fixed = "fixed" in spec
        assert kg.capacity == vg.capacity == cap
        assert (kg.policy, vg.policy) == (((8, 8), (8, 8)) if fixed else ((0, 16), (16, 8)))
        vl = torch.tensor([T], dtype=torch.int32, device=DEV)
        for splits in (1, 2, 5):  # 5: the last main splits hold no valid tile
            dev = decode_attention(q, kg, vg, num_splits=splits, out_dtype=torch.float32, valid_len=vl)
            assert torch.allclose(dev, host, atol=1e-5, rtol=1e-5)
            assert torch.allclose(dev, ref, atol=1e-4, rtol=1e-4)


# ---- the mask function --------------------------------------------------------------------------------
def test_mask_is_none_for_a_one_token_step_even_while_capturing(monkeypatch):
    import transformers.masking_utils as mu

    # What a CUDA graph capture looks like to SDPA's mask in transformers 5.17 (5.24 refuses
    # the skip only when exporting): it then builds a [B, 1, 1, kv_length] mask, kv_length
    # the host's count, which a graph would bake in.
    monkeypatch.setattr(mu, "is_tracing", lambda *a: True)
    if hasattr(mu, "is_torchdynamo_exporting"):
        monkeypatch.setattr(mu, "is_torchdynamo_exporting", lambda *a: True)
    assert mu.sdpa_mask(batch_size=2, q_length=1, kv_length=9) is not None
    assert kvqbench_mask(batch_size=2, q_length=1, kv_length=9) is None
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, 0] = False
    for kw in (dict(q_length=3, kv_length=9), dict(q_length=1, kv_length=9, attention_mask=pad),
               dict(q_length=1, kv_length=9, allow_is_causal_skip=False)):
        assert torch.equal(kvqbench_mask(batch_size=2, **kw), mu.sdpa_mask(batch_size=2, **kw))


# ---- a model's decode steps ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from kvqbench.suites.bench.decode.measure import build_model

    return build_model("tiny", torch.float32 if DEV.type == "cpu" else torch.bfloat16, DEV)


def _decode(model, spec, steps, *, graphed: bool, between: int | None = None, prompt=20, batch=2, chunk=None):
    """Prefill then `steps` greedy steps: (logits [B, steps, V], cache, step object).
    `between`: one step at that index through the ordinary (host-path) call instead;
    `chunk` (index, n): before that step, an ordinary n-token write of the last token
    repeated (folds the device steps' run into segments)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.inference_mode(), fused_attention(model):
        cache = QuantizedCache(spec, config=model.config, fused=True, seed=1)
        kw = cache_kwargs(model, cache)
        tok = model(input_ids=ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
        step = GraphedDecodeStep(model, cache, batch, max_tokens=prompt + steps + 4) if graphed else None
        out = []
        for i in range(steps):
            if chunk and i == chunk[0]:
                model(input_ids=tok.repeat(1, chunk[1]), **kw, use_cache=True)
            if step is not None and i != between:
                logits = step(tok).clone()
            else:
                logits = model(input_ids=tok, **kw, use_cache=True).logits
            out.append(logits)
            tok = logits[:, -1:].argmax(-1)
        return torch.cat(out, 1), cache, step


def _assert_same_bytes(a: QuantizedCache, b: QuantizedCache, exact_layers: int | None = None):
    """The same stored fields, segment for segment, and decoded history. `exact_layers`:
    only the first n layers bit for bit, the later ones the same layout and a decoded
    history that agrees up to float rounding: for runs whose attention sums in another
    order (dense device steps attend over the masked capacity), so a later layer's input,
    and with it what it stores, may differ in the last bit. Whether it does depends on
    the CPU's SDPA kernels (bit-identical on an AVX-512 machine, not on an AVX2 one); a
    quantizer then may round a value the other way, so up to 2% of the decoded elements
    may differ by more (a write one token off changes a whole token row in each step:
    about 8% of this model's elements)."""
    assert a.get_seq_length() == b.get_seq_length()
    assert a.nbytes() == b.nbytes() and a.numel() == b.numel() and a.bits_per_element() == b.bits_per_element()
    for la, lb in zip(a.layers, b.layers):
        exact = exact_layers is None or la.layer_idx < exact_layers
        for role in ("K", "V"):
            pa, pb = la.packed[role], lb.packed[role]
            assert [s.tokens for s in pa.segments] == [s.tokens for s in pb.segments]
            assert pa.nbytes_by_field() == pb.nbytes_by_field()
            da, db = la.read(role), lb.read(role)
            if exact:
                for sa, sb in zip(pa.segments, pb.segments):
                    for name in sa.fields:
                        assert torch.equal(sa.fields[name], sb.fields[name]), (la.layer_idx, role, name)
                assert torch.equal(da, db)
            else:
                off = ~torch.isclose(da.float(), db.float(), rtol=1e-3, atol=1e-3)
                assert off.float().mean() <= 0.02, (la.layer_idx, role, int(off.sum()), off.numel())


@pytest.mark.parametrize("spec", ["int4", "fp8-e4m3", "hqmq:S=8,r=4", "hqmq:S=8,r=4,outliers=med3", "fp16"])
def test_device_steps_equal_fused_steps(model, spec):
    eager, ce, _ = _decode(model, spec, 4, graphed=False)
    dev, cd, step = _decode(model, spec, 4, graphed=True, between=2)  # one host-path step in between
    assert step.mode == ("graph" if DEV.type == "cuda" else "device") and step.steps == 3
    assert all(s.in_run for layer in cd.layers for s in layer.stores.values())
    if DEV.type == "cpu":  # the interpreter: same grid (one split), exact fp32
        assert torch.equal(dev, eager)
        _assert_same_bytes(cd, ce)
    else:  # the graph's grid is cut for the capacity: another split, fp rounding
        assert torch.equal(dev.argmax(-1), eager.argmax(-1))
        assert torch.allclose(dev.float(), eager.float(), atol=0.05)
    # after the graphed steps the cache goes on through the host path, from where they left it
    assert cd.get_seq_length() == 20 + 4 and cd.reserved == 20 + 4 + 4


def test_device_steps_around_a_multi_token_write(model):
    # device steps, then an ordinary 3-token write (the device steps' run folded into
    # segments, the quantizer appending after them), then device steps again
    eager, ce, _ = _decode(model, "int4", 4, graphed=False, chunk=(2, 3))
    dev, cd, step = _decode(model, "int4", 4, graphed=True, chunk=(2, 3))
    assert step.steps == 4 and cd.get_seq_length() == 20 + 4 + 3
    if DEV.type == "cpu":
        assert torch.equal(dev, eager)
        _assert_same_bytes(cd, ce)
    else:
        assert torch.equal(dev.argmax(-1), eager.argmax(-1))


def test_buffer_signature_follows_the_buffers(model):
    _, cache, step = _decode(model, "int4", 2, graphed=True)
    sig = cache.buffer_signature()
    with torch.inference_mode(), fused_attention(model):
        step(torch.zeros(2, 1, dtype=torch.long, device=DEV))
        assert cache.buffer_signature() == sig  # steps move nothing
        layer = cache.layers[1]
        layer.replace_packed("V", layer.packed["V"])  # a new store: new buffers
    assert cache.buffer_signature() != sig


# KIVI-4 in the test below is slow-only (`pytest -m slow`; ~20 s under the interpreter): the same window
# policy and flushes as KIVI-2 through the same model steps; its 4-bit device-position steps
# are covered by test_step_encode.py test_kivi_device_position_steps_store_what_the_old_path_stores
# (both windows) and its valid-length attention by
# test_kivi_valid_len_attention_equals_the_host_counts_call_and_the_reference above.
KIVI_MODEL_SPECS = ["kivi:bits=2,group=8,residual=8", "kivi:bits=4,group=8,residual=8"]


@pytest.mark.parametrize("spec", [KIVI_MODEL_SPECS[0], pytest.param(KIVI_MODEL_SPECS[1], marks=pytest.mark.slow)])
def test_kivi_device_steps_equal_fused_steps(model, spec):
    # KIVI-2 / KIVI-4 (the paper's windows): from a 21-token prefill (not a multiple of
    # R), 12 steps cross two flushes per role (keys at 24 and 32 tokens, values at 24
    # and 32: R + G, then every G), one of them a host-position step (step 3).
    eager, ce, _ = _decode(model, spec, 12, graphed=False, prompt=21)
    dev, cd, step = _decode(model, spec, 12, graphed=True, between=3, prompt=21)
    assert step.mode == ("graph" if DEV.type == "cuda" else "device") and step.steps == 11
    assert all(s.in_run for layer in cd.layers for s in layer.stores.values())
    # 21 tokens: K 2 groups, V 1 (21 - R = 13: one whole group); 33 tokens: K 4, V 3
    for layer in cd.layers:
        assert {r: layer.stores[r].flat.n_groups for r in ("K", "V")} == {"K": 4, "V": 3}
        assert {r: layer.stores[r].buffers["residual"].length for r in ("K", "V")} == {"K": 1, "V": 9}
    if DEV.type == "cpu":
        assert torch.equal(dev, eager)
        _assert_same_bytes(cd, ce)
    else:
        assert torch.equal(dev.argmax(-1), eager.argmax(-1))
        assert torch.allclose(dev.float(), eager.float(), atol=0.05)


# ---- dense layers (no fused kernel reads the format): the quantizer's own code at the position --------
DENSE_SPECS = ["spherical4", "spherical4-qjl", "avq2", "flatvq:dim=4,K_bits=8", "hadamard-int3"]


@pytest.mark.parametrize("spec", DENSE_SPECS)
def test_dense_device_steps_equal_dense_steps(model, spec):
    # dense_steps.py: encode + decode of the token at the device position, attention over
    # the reserved rows under the device valid length; one host-path step in between.
    eager, ce, _ = _decode(model, spec, 4, graphed=False)
    dev, cd, step = _decode(model, spec, 4, graphed=True, between=2)
    assert all(layer.mode == "dense" for layer in cd.layers)
    assert step.mode == ("graph" if DEV.type == "cuda" else "device") and step.steps == 3, step.why
    assert all(s.in_run for layer in cd.layers for s in layer.dense_steps.values())
    # attention over the masked capacity sums in another order than over the valid rows: layer 0's
    # bytes are exact (its input is not attention's), the later layers' up to rounding
    _assert_same_bytes(cd, ce, exact_layers=1)
    tol = dict(atol=1e-5, rtol=1e-5) if DEV.type == "cpu" else dict(atol=0.05, rtol=0)
    assert torch.allclose(dev.float(), eager.float(), **tol)
    assert cd.get_seq_length() == 20 + 4 and cd.reserved == 20 + 4 + 4


@pytest.mark.parametrize("spec", ["spherical3", "spherical2.5", "spherical4-qjl", "avq2", "flatvq:dim=4,K_bits=8"])
def test_dense_device_steps_through_a_device_encoder(model, spec, monkeypatch):
    # kernels/spherical_step.py, vq_step.py: one launch a step instead of the torch path (on a
    # GPU by default; forced here, under the interpreter on a CPU); the same bytes and logits
    # (avq / flat VQ: their prefill's encode too, `dense_steps.segment_writer`)
    from kvqbench.suites.harness import dense_steps

    eager, ce, _ = _decode(model, spec, 4, graphed=False)  # the torch path throughout (CPU defaults)
    monkeypatch.setattr(dense_steps, "DEVICE_ENCODERS", "always")
    monkeypatch.setattr(dense_steps, "SEGMENT_ENCODERS", "always")
    dev, cd, step = _decode(model, spec, 4, graphed=True, between=2)
    assert step.mode == ("graph" if DEV.type == "cuda" else "device") and step.steps == 3, step.why
    assert all(s.encoder is not None for layer in cd.layers for s in layer.dense_steps.values())
    _assert_same_bytes(cd, ce, exact_layers=1)
    tol = dict(atol=1e-5, rtol=1e-5) if DEV.type == "cpu" else dict(atol=0.05, rtol=0)
    assert torch.allclose(dev.float(), eager.float(), **tol)


def _kernel_reads(spec: str) -> bool:
    from kvqbench.kernels.store import KernelStore

    return KernelStore.create(get_quantizer(spec, role="V").encode(torch.randn(1, 2, 40, 32)), "V") is not None


@pytest.mark.parametrize("spec", all_example_specs())
def test_every_format_takes_device_steps_or_names_why(model, spec):
    """Every registered format (plugins included): graphed decode steps store what the
    ordinary steps store and give their logits, or run eagerly with the reason named.
    On a CPU the formats a fused kernel reads are left to the tests above (the Triton
    interpreter takes 3-18 s per HQMQ format here); a GPU runs them all."""
    if DEV.type == "cpu" and _kernel_reads(spec):
        pytest.skip("a fused format: under the interpreter, see test_device_steps_equal_fused_steps")
    eager, ce, _ = _decode(model, spec, 3, graphed=False)
    dev, cd, step = _decode(model, spec, 3, graphed=True)
    assert step.mode != "eager" or step.why
    if step.mode == "eager":
        assert torch.equal(dev, eager)
    tol = dict(atol=1e-4, rtol=1e-4) if DEV.type == "cpu" else dict(atol=0.05, rtol=0)
    assert torch.allclose(dev.float(), eager.float(), **tol), (step.mode, step.why)
    if step.mode == "eager":
        _assert_same_bytes(cd, ce)
    elif DEV.type == "cpu" or all(layer.mode == "dense" for layer in cd.layers):
        _assert_same_bytes(cd, ce, exact_layers=1)  # dense device steps: see _assert_same_bytes


def test_dense_device_steps_around_a_multi_token_write(model):
    eager, ce, _ = _decode(model, "spherical4", 4, graphed=False, chunk=(2, 3))
    dev, cd, step = _decode(model, "spherical4", 4, graphed=True, chunk=(2, 3))
    assert step.steps == 4 and step.mode != "eager" and cd.get_seq_length() == 20 + 4 + 3
    _assert_same_bytes(cd, ce, exact_layers=1)
    assert torch.equal(dev.argmax(-1), eager.argmax(-1))


def test_a_dense_device_step_flags_bad_input_when_the_cache_is_next_read(model):
    _, cache, _ = _decode(model, "spherical4", 2, graphed=True)
    layer = cache.layers[0]
    p = layer.packed["K"]
    x = torch.full((2, p.heads, 1, p.head_dim), float("nan"), dtype=p.dtype, device=DEV)
    with torch.inference_mode():
        with cache.device_steps():
            layer.update(x, torch.zeros_like(x))  # no sync, no error yet: the verdict waits on the device
        cache.step_done()
        cache.advance(1)
        with pytest.raises(QuantizerInputError, match=r"layer 0 K: a device-position decode step .* NaN/Inf"):
            cache.bits_per_element()


@pytest.mark.parametrize("spec,why", [("int4:keys=per-channel", "keeps state across writes")])
def test_formats_a_graph_cannot_take_run_eagerly_with_the_reason(model, spec, why):
    eager, ce, _ = _decode(model, spec, 3, graphed=False)
    got, cg, step = _decode(model, spec, 3, graphed=True)
    assert step.mode == "eager" and why in step.why
    assert torch.equal(got, eager)
    _assert_same_bytes(cg, ce)


def test_bad_use_raises(model):
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.inference_mode(), fused_attention(model):
        cache = QuantizedCache("int4", config=model.config, fused=True)
        with pytest.raises(ValueError, match="empty: prefill first"):
            cache.reserve(16)
        tok = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        with pytest.raises(ValueError, match="max_tokens"):
            GraphedDecodeStep(model, cache, 1)  # no room asked for (capacity 0)
        step = GraphedDecodeStep(model, cache, 1, max_tokens=10)
        with pytest.raises(ValueError, match=r"input_ids must be \[1, 1\]"):
            step(ids[:, :2])
        step(tok)
        step(tok)
        with pytest.raises(RuntimeError, match="reserved are used up"):
            step(tok)
        assert cache.get_seq_length() == 10  # the refused step wrote nothing


@cuda_only
@pytest.mark.parametrize("spec", ["int4", "fp8-e4m3", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3", "kivi2",
                                  "kivi4"] + KIVI_MODEL_SPECS
                         + DENSE_SPECS + ["avq3", "spherical3", "hadamard-int4", "flatvq:dim=2,K_bits=8"])
def test_graph_replays_equal_uncaptured_device_steps(model, spec, monkeypatch):
    # Same kernels, same grid: the replayed graph must match bit for bit, bytes included.
    # KIVI: 20 steps from a 21-token prompt, the small windows flushing in the replays.
    steps, prompt = (20, 21) if "kivi" in spec else (6, 20)
    graph, cg, step = _decode(model, spec, steps, graphed=True, prompt=prompt)
    assert step.mode == "graph" and step.graph is not None, step.why
    monkeypatch.setattr(GraphedDecodeStep, "_capture", lambda self: self._device_step())
    plain, cp, step2 = _decode(model, spec, steps, graphed=True, prompt=prompt)
    assert step2.graph is None
    assert torch.equal(graph, plain)
    _assert_same_bytes(cg, cp)


@cuda_only
def test_a_replay_refuses_moved_buffers(model):
    _, cache, step = _decode(model, "int4", 4, graphed=True)
    assert step.graph is not None
    with torch.inference_mode():
        layer = cache.layers[0]
        layer.replace_packed("K", layer.packed["K"])
    with pytest.raises(RuntimeError, match="buffers moved"), fused_attention(model):
        step(torch.zeros(2, 1, dtype=torch.long, device=DEV))


def test_dense_probe_runs_once_per_format_role_and_shape(monkeypatch):
    """The CUDA probe of a dense layer's one-token write (a host sync would break the
    capture) answers for the code path, so a process asks it once per format, role and
    write shape, not at every layer of every row's new cache. Checked with the CUDA
    calls stubbed: the cache logic, not the probe itself (which the GPU tests run)."""
    import types
    from unittest import mock

    from kvqbench.suites.harness import dense_steps

    calls = []
    monkeypatch.setattr(dense_steps, "code_one_token", lambda q, x, p: calls.append((q.spec, q.role)))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    decoded = types.SimpleNamespace(buf=types.SimpleNamespace(device=torch.device("cuda")),
                                    valid=torch.zeros(2, 3, 5, 16))
    with mock.patch.dict(dense_steps.PROBED, clear=True):  # as in a fresh process
        for layer in range(3):
            for role in ("K", "V"):
                q = get_quantizer("spherical3", layer=layer, role=role, seed=layer)
                packed = q.encode(torch.randn(2, 3, 5, 16))
                assert dense_steps.probe(q, packed, decoded) is None
        assert [role for _, role in calls] == ["K", "V"] and len({spec for spec, _ in calls}) == 1
        q = get_quantizer("spherical3", role="K")
        dense_steps.probe(q, q.encode(torch.randn(1, 3, 5, 16)), decoded)  # another batch: probed
        assert len(calls) == 3
