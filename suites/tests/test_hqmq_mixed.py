"""HQMQ with mixed-radix codes (`pack=mixed`, issue 27 item 5): G codes of radix 24 S per
group integer (quantizers/packing.py `mixed_layout`), so S=96 stops paying 12 bits for
log2(2304) = 11.17.

- packing: exact round trip at the extremes of every radix, G = 1 is `pack_bits` byte
  for byte;
- the quantizer: decode(pack=mixed) is bit-identical to decode(pack=bits) for the same
  input (Med3x and log radius levels too), only the code field differs, and its rows are
  the bytes the layout says (the measured bits fall);
- the fused path: the Triton kernel reads the mixed rows (the same attention output as
  the bits rows, bit for bit), the device step encoder writes them (the old path's bytes
  up to search ties), and the CUDA kernel's routing of them (its MIX instances read S=96
  rows: test_cuda_mixed_codes.py) with the reasons explain_backend reports.

CPU: the kernels run under the Triton interpreter, tiny shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.quantizers.packing import (bits_for, mixed_layout, pack_bits, pack_mixed, unpack_bits,  # noqa: E402
                                         unpack_mixed)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _data(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g).mul(4).add(0.01)
    x[..., 3] *= 8  # a hot channel: Med3x outliers
    return x.to(DEV, dtype)


# ---- packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("radix", [3, 5, 7, 576, 2304, 4080, 6144, 131064, 2 ** 31 + 11, 2 ** 21 - 1])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 32, 64])
def test_mixed_round_trip(radix, n):
    g = torch.Generator().manual_seed(n)
    v = torch.randint(0, radix, (3, 2, n), generator=g, dtype=torch.int64)
    v[0] = radix - 1  # every group at its largest value
    v[1, 0] = 0
    G, W, WL, nbytes = mixed_layout(radix, n)
    assert W <= 63 and (radix ** G - 1).bit_length() == W and (WL == 0) == (n % G == 0)
    p = pack_mixed(v, radix)
    assert p.dtype == torch.uint8 and p.shape == (3, 2, nbytes)
    assert torch.equal(unpack_mixed(p, radix, n), v)
    whole = (n * bits_for(radix) + 7) // 8
    assert nbytes <= whole
    if G == 1:  # no group saves a byte: the whole-bit layout exactly
        assert W == bits_for(radix) and torch.equal(p, pack_bits(v, W))
    else:
        assert nbytes < whole


def test_mixed_layout_of_the_paper_points():
    """(G, W, W_last, row bytes): S=24 and S=96 at d=64 and d=128."""
    assert mixed_layout(24 * 24, 16) == (2, 19, 0, 19) and mixed_layout(24 * 24, 32) == (4, 37, 0, 37)
    assert mixed_layout(24 * 96, 16) == (2, 23, 0, 23) and mixed_layout(24 * 96, 32) == (4, 45, 0, 45)
    assert mixed_layout(24 * 170, 32)[0] == 1  # filled: 12 bits are log2(4080) already


def test_mixed_refuses_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        pack_mixed(torch.tensor([0, 2304]), 2304)
    with pytest.raises(ValueError, match="not a mixed-radix row"):
        unpack_mixed(torch.zeros(3, 24, dtype=torch.uint8), 2304, 16)
    with pytest.raises(QuantizerInputError, match="pack must be bits or mixed"):
        get_quantizer("hqmq:S=96,r=4,pack=nibbles")


# ---- the quantizer ----------------------------------------------------------------------------
SPECS = ["hqmq:S=24,r=3", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3", "hqmq:S=256,r=5,radius=log",
         "hqmq:S=96,r=4,fill=true"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("D", [64, 128])
def test_decode_is_bit_identical_to_whole_bits(spec, D):
    x = _data((2, 2, 24, D), seed=D)
    a, b = get_quantizer(spec, role="K", seed=1), get_quantizer(spec + ",pack=mixed", role="K", seed=1)
    pa, pb = a.encode(x), b.encode(x)
    pa = a.append(pa, x[:, :, :5])  # an appended write too (Med3x: its own median)
    pb = b.append(pb, x[:, :, :5])
    assert torch.equal(a.decode(pa), b.decode(pb))
    nc = D // 4
    G, W, _, cb = b.code_layout(nc)
    for sa, sb in zip(pa.segments, pb.segments):
        assert set(sa.fields) == set(sb.fields)
        for name in sa.fields:
            if name != "codes":
                assert torch.equal(sa.fields[name], sb.fields[name]), name
        assert sb.fields["codes"].shape[-1] == cb
        assert torch.equal(unpack_bits(sa.fields["codes"], a.code_bits, nc), b.unpack_codes(sb.fields["codes"], nc))
    assert pa.nbytes - pb.nbytes == (a.code_layout(nc)[3] - cb) * 2 * 2 * 29  # B * H * tokens rows
    assert (pb.nbytes < pa.nbytes) == (G > 1)


@pytest.mark.parametrize("S,r,D,bits,mixed", [(24, 3, 64, 20, 19), (24, 3, 128, 40, 37),
                                              (96, 4, 64, 24, 23), (96, 4, 128, 48, 45)])
def test_measured_bits_fall(S, r, D, bits, mixed):
    """Code row bytes per token vector, whole bits vs mixed radix, measured from a cache
    of 512 tokens (the secondaries amortised as before)."""
    x = _data((1, 2, 512, D), seed=S)
    a, b = get_quantizer(f"hqmq:S={S},r={r}"), get_quantizer(f"hqmq:S={S},r={r},pack=mixed")
    pa, pb = a.encode(x), b.encode(x)
    assert pa.segments[0].fields["codes"].shape[-1] == bits and pb.segments[0].fields["codes"].shape[-1] == mixed
    assert pa.nbytes - pb.nbytes == (bits - mixed) * 2 * 512
    assert pb.bits_per_element < pa.bits_per_element


# ---- the fused path -----------------------------------------------------------------------------
def _flats(spec, k, v, seed=3):
    from kvqbench.kernels import layout as L

    qk, qv = get_quantizer(spec, role="K", seed=seed), get_quantizer(spec, role="V", seed=seed)
    return L.flatten(qk.encode(k), "K"), L.flatten(qv.encode(v), "V")


@pytest.mark.parametrize("spec,D", [("hqmq:S=96,r=4", 64), ("hqmq:S=24,r=3,outliers=med3", 128),
                                    ("hqmq:S=96,r=4", 128), ("hqmq:S=24,r=3", 64),  # G = 4 (uint64), 2 (int32)
                                    ("hqmq:S=256,r=5,radius=log", 128)])  # the last: a partial group
def test_triton_reads_mixed_rows(spec, D):
    pytest.importorskip("triton")
    from kvqbench.kernels.decode_attention import decode_attention

    B, Hq, Hkv, T = 1, 4, 2, 70
    k, v = _data((B, Hkv, T, D), 5, torch.float16), _data((B, Hkv, T, D), 6, torch.float16)
    q = _data((B, Hq, 1, D), 7, torch.float16)
    kb, vb = _flats(spec, k, v)
    km, vm = _flats(spec + ",pack=mixed", k, v)
    assert kb.code_pack == "bits" and km.code_pack == "mixed" and km.codes.shape[-1] < kb.codes.shape[-1]
    ob = decode_attention(q, kb, vb, backend="triton", out_dtype=torch.float32, num_splits=2)
    om = decode_attention(q, km, vm, backend="triton", out_dtype=torch.float32, num_splits=2)
    assert torch.isfinite(om).all() and torch.equal(om, ob)  # the same codes decoded the same way


def test_cuda_routing_of_mixed_rows_and_explain_backend_says_why(monkeypatch):
    """The CUDA kernel reads mixed rows at S=96 (test_cuda_mixed_codes.py); auto sends them
    there only with AUTO_MIXED, and a layout it declines keeps Triton with the reason."""
    from kvqbench.kernels import registry
    from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq
    from kvqbench.kernels.decode_attention import explain_backend
    from kvqbench.kernels.formats import hqmq as fmt

    x = _data((1, 2, 8, 128), 1, torch.float16)
    cuda = fmt.FORMAT.by_backend["cuda"]
    monkeypatch.setattr(registry, "on_device", lambda q, device: True)  # as if q were on a CUDA device
    q = _data((1, 4, 1, 128), 2, torch.float16)
    km, vm = _flats("hqmq:S=96,r=4,pack=mixed", x, x)
    monkeypatch.setattr(cuda_hqmq, "AUTO_MIXED", False)
    assert "AUTO_MIXED" in cuda.auto(km)
    route = explain_backend(q, km, vm)
    assert route.backend == "triton" and "AUTO_MIXED" in route.declined["cuda"]
    kl, vl = _flats("hqmq:S=128,r=4,pack=mixed", x, x)  # radix 3072: no CUDA instance
    assert "mixed-radix" in cuda_hqmq._flat_reason(kl) and "S=128" in cuda_hqmq._flat_reason(kl)
    route = explain_backend(q, kl, vl)
    assert route.backend == "triton" and "cuda" in route.declined


@pytest.mark.parametrize("spec", ["hqmq:S=96,r=4,pack=mixed", "hqmq:S=24,r=3,outliers=med3,pack=mixed"])
def test_step_encoder_writes_mixed_rows(spec):
    """A fused layer whose decode steps are encoded on the device holds the old path's
    bytes (codes up to exact search ties) and decodes to the same values."""
    pytest.importorskip("triton")
    from kvqbench.kernels.formats.hqmq import HQMQStore
    from kvqbench.suites.harness.kv_cache import QuantizedLayer

    B, H, D, prefill, steps = 1, 2, 64, 5, 4
    x = _data((2, B, H, prefill + steps, D), 9, torch.float16)
    layers = {}
    for fast in (True, False):
        layer = QuantizedLayer(spec, 0, seed=4)
        layer.fused_wanted, layer.step_encode = True, fast
        with torch.inference_mode():
            layer.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
            for t in range(prefill, prefill + steps):
                layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
        assert layer.mode == "fused"
        layers[fast] = layer
    fast, old = layers[True], layers[False]
    assert fast.nbytes() == old.nbytes()
    for role in ("K", "V"):
        sf, so = fast.stores[role], old.stores[role]
        assert isinstance(sf, HQMQStore) and sf.stepper is not None and sf.flat.code_pack == "mixed"
        for name in sf.buffers:
            a, b = sf.buffers[name].valid, so.buffers[name].valid
            if name == "codes":
                assert a.shape == b.shape and (a != b).float().mean() <= 0.02
            else:
                assert torch.equal(a, b), (role, name)
        q = sf.stepper
        got = q.unpack_codes(sf.buffers["codes"].valid, D // 4)
        want = q.unpack_codes(so.buffers["codes"].valid, D // 4)
        assert (got != want).float().mean() <= 0.02  # search ties only
