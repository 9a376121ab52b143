"""HQMQ with an int8 codebook (`codebook=int8`, quantizers/hqmq.py): decoded codewords
rounded to k / 127 per component, the codes and bytes those of `codebook=exact`.

- the quantizer: the same bytes as exact, decode = exact's codewords rounded, every
  component on the grid, the error bound holds with the rounding term, bad values refused;
- the flat: its codebook carried, the kernel table the rounded codebook whatever mode is
  asked for;
- the fused path: the Triton kernel reads it (CPU: the interpreter) within the fp16-table
  tolerance of the dequantize-then-attend reference, and not within it of exact's output;
- the CUDA kernel (GPU only): its 4-byte-codeword instances against the same reference at
  every head dim, Med3x, valid_len, graphs; auto keeps such caches on Triton until
  AUTO_INT8 (CPU: the refusal says so), and the table it gathers is the biased int8 one.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.quantizers.hqmq import INT8_SCALE, int8_codewords  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
EXACT, INT8 = "hqmq:S=96,r=4", "hqmq:S=96,r=4,codebook=int8"


def _data(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 25  # a hot channel: Med3x outliers
    return x.to(DEV, dtype)


@pytest.mark.parametrize("extra", ["", ",outliers=med3", ",pack=mixed"])
def test_int8_codebook_stores_exacts_bytes_and_decodes_them_rounded(extra):
    x = _data((2, 2, 37, 64), 1)
    qe, qi = get_quantizer(EXACT + extra, role="K", seed=2), get_quantizer(INT8 + extra, role="K", seed=2)
    pe, pi = qe.encode(x), qi.encode(x)
    assert pe.nbytes == pi.nbytes
    for se, si in zip(pe.segments, pi.segments):
        assert se.fields.keys() == si.fields.keys()
        assert all(torch.equal(se.fields[n], si.fields[n]) for n in se.fields)
    de, di = qe.decode(pe), qi.decode(pi)
    assert not torch.equal(de, di)  # the rounding reaches the decoded values
    # each coded chunk r^ c (c a unit codeword) decodes to r^ int8(c); Med3x outliers (fp16 in both) alike
    ce, ci = de.view(*de.shape[:-1], -1, 4), di.view(*di.shape[:-1], -1, 4)
    r = ce.norm(dim=-1, keepdim=True)
    rounded = (r.squeeze(-1) > 0) & ~(ce == ci).all(-1)
    assert rounded.float().mean() > 0.5
    c, ki = ce[rounded] / r[rounded], ci[rounded] / r[rounded] * INT8_SCALE  # (r: exact's radius r^)
    # on the grid, and the nearest grid point (up to float error at a half-way point)
    assert torch.allclose(ki, ki.round(), atol=2e-3) and ki.abs().max() <= INT8_SCALE + 1e-3
    assert ((ki - c * INT8_SCALE).abs() <= 0.5 + 2e-3).all()
    assert (ki.round() == (c * INT8_SCALE).round()).float().mean() > 0.999


def test_int8_codebook_error_bound_and_bad_values():
    x = _data((1, 2, 50, 128), 3)
    for spec in (INT8, INT8 + ",outliers=med3"):
        q = get_quantizer(spec, role="V", seed=1)
        err = (q.decode(q.encode(x)) - x).norm(dim=-1)
        assert (err <= q.error_bound(x) * (1 + 1e-5) + 1e-6).all(), spec
    with pytest.raises(QuantizerInputError, match="codebook must be one of exact, int8"):
        get_quantizer("hqmq:codebook=int4")


def test_flat_carries_the_codebook_and_its_table_is_rounded():
    x = _data((1, 2, 20, 64), 4)
    q = get_quantizer(INT8, role="K", seed=5)
    f = L.flatten(q.encode(x), "K")
    assert f.codebook == "int8"
    want = int8_codewords(L.codebook_from_secondaries(f.sec))
    for mode, dtype in (("secondaries", torch.float32), ("codebook", torch.float16)):
        g = f.with_table(mode, dtype)
        assert g.table_mode == "codebook" and torch.equal(g.table, want.to(dtype))
    fe = L.flatten(get_quantizer(EXACT, role="K", seed=5).encode(x), "K")
    assert fe.codebook == "exact" and fe.with_table("secondaries").table_mode == "secondaries"


@pytest.mark.parametrize("D,extra", [(64, ""), (128, ",outliers=med3")])
def test_triton_reads_int8_codebook_caches(D, extra):
    pytest.importorskip("triton")
    from kvqbench.kernels.decode_attention import decode_attention, reference_decode_attention

    B, Hq, Hkv, T = 1, 4, 2, 70
    k, v = _data((B, Hkv, T, D), 5, torch.float16), _data((B, Hkv, T, D), 6, torch.float16)
    q = _data((B, Hq, 1, D), 7, torch.float16)
    outs = {}
    for spec in (EXACT + extra, INT8 + extra):
        qk, qv = get_quantizer(spec, role="K", seed=3), get_quantizer(spec, role="V", seed=3)
        pk, pv = qk.encode(k), qv.encode(v)
        kf, vf = L.flatten(pk, "K"), L.flatten(pv, "V")
        out = decode_attention(q, kf, vf, backend="triton", out_dtype=torch.float32, num_splits=2)
        ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
        outs[spec] = (out, ref)
        # (the interpreter's arithmetic: ~1e-6 here; a GPU's fp16 operands: test_cuda_hqmq's tolerance)
        assert torch.isfinite(out).all() and ((out - ref).norm() / ref.norm()) < (3e-3 if CUDA else 1e-4), spec
    (oe, re_), (oi, ri) = outs.values()
    assert ((oi - re_).norm() / re_.norm()) > ((oi - ri).norm() / ri.norm())  # it decodes the rounded codebook


def test_cuda_int8_instances_refusals_and_table():
    from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq

    x = _data((1, 2, 40, 128), 8)
    f = L.flatten(get_quantizer(INT8, role="K", seed=1).encode(x), "K")
    fe = L.flatten(get_quantizer(EXACT, role="K", seed=1).encode(x), "K")
    assert cuda_hqmq.codeword_bytes(f) == 4 and cuda_hqmq.codeword_bytes(fe) == 8
    assert cuda_hqmq.variants(128, False, 4) == (cuda_hqmq.DEFAULT_VARIANT,)
    assert cuda_hqmq.variants(64, True, 4) == (cuda_hqmq.DEFAULT_VARIANT_MED3,)
    why = cuda_hqmq.auto_refusal(f)
    assert (why is None) == cuda_hqmq.AUTO_INT8 and (cuda_hqmq.AUTO_INT8 or "AUTO_INT8" in why)
    tab = cuda_hqmq.codebook8(f)
    assert tab.dtype == torch.uint8 and tab.shape == (2, 24 * 96, 4)
    want = int8_codewords(L.codebook_from_secondaries(f.sec.float()))
    assert torch.equal((tab.float() - 128) / INT8_SCALE, want.float())
    if f.codes.is_cuda:
        q = torch.randn(1, 4, 1, 128, device=DEV)
        assert "codebook" in cuda_hqmq.unsupported(q, f, fe)


needs_cuda = pytest.mark.skipif(not CUDA, reason="the CUDA kernel needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("med3", [False, True])
@pytest.mark.parametrize("T", [1, 333, 4099])
def test_cuda_int8_matches_reference(D, med3, T):
    from kvqbench.suites.tests.cuda_helpers import checked_call, make

    spec = INT8 + (",outliers=med3" if med3 else "")
    k, v = make(2, 2, T, D, 11), make(2, 2, T, D, 12, outlier=False)
    q = torch.randn(2, 8, 1, D, generator=torch.Generator().manual_seed(13)).half().to(DEV)
    for ns in (None, 3):  # (within cuda_helpers.TOL of the dequantize-then-attend reference)
        checked_call(spec, q, k, v, num_splits=ns)


@needs_cuda
def test_cuda_int8_valid_len_graph_and_planned_equals_per_call(monkeypatch):
    from kvqbench.suites.tests.cuda_helpers import attend, flats, make, warmed_capture

    from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq

    k, v = make(1, 8, 2000, 128, 1), make(1, 8, 2000, 128, 2, outlier=False)
    q = torch.randn(1, 32, 1, 128, generator=torch.Generator().manual_seed(3)).half().to(DEV)
    kf, vf = flats(INT8 + ",outliers=med3", k, v)
    planned = attend(q, kf, vf)
    monkeypatch.setattr(cuda_hqmq, "PLANNED", False)
    assert torch.equal(attend(q, kf, vf), planned)
    monkeypatch.setattr(cuda_hqmq, "PLANNED", True)
    vl = torch.tensor([1500], dtype=torch.int32, device=DEV)
    ws = cuda_hqmq.workspace(q, kf, out_dtype=torch.float32)
    graph, out = warmed_capture(lambda: cuda_hqmq.decode(q, kf, vf, workspace=ws, valid_len=vl,
                                                         out_dtype=torch.float32))
    graph.replay()
    torch.cuda.synchronize()
    want = attend(q, *(dataclasses.replace(f, T=1500) for f in (kf, vf)))  # (the first 1500 tokens)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-4)  # (other splits: the combine's rounding)
