"""The CUDA HQMQ kernel on mixed-radix code rows (pack=mixed, S=96, head dim 64 / 128 / 256):
its MIX instances copy a tile's rows as they lie and rewrite them in shared memory as 12-bit
rows (kernels/cuda/mixed_codes.cuh) before v3's decode (head dim 256: each warp of a pair its
half of every row, itself a head-dim-128 row).

- CPU (a C++ compiler): mixed_codes.cuh's `to_bits`, built as plain C++, against
  quantizers/packing.py: every row of random and extreme codes, with garbage bytes after
  the row, gives the 12-bit row `pack_bits` makes; a head-dim-256 row is two head-dim-128
  rows (what the kernel's halves rely on);
- CPU: which caches the kernel declines, and why (S other than 96), and the auto switches
  (AUTO_MIXED; AUTO_MIXED_MED3 for Med3x; AUTO_MIXED_HEAD_DIMS);
- GPU: the same codes stored mixed and as 12-bit rows give the same output bit for bit
  (one decode after the rewrite), at T = 1 / 17 / 1000 / 4099, capacities that put the
  (b, h) rows off a 16-byte boundary, splits, a device valid_len, both codebooks, Med3x
  (at head dim 256 within the kernels' tolerance: its mixed instance has 16 warps a CTA).
"""
from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvqbench.kernels import layout as L
from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq
from kvqbench.quantizers.packing import mixed_layout, pack_bits, pack_mixed
from kvqbench.suites.tests.cuda_helpers import CUDA, DEV, TOL, attend, flats, make, query, rel_err, vlen, with_junk

HEADER = Path(cuda_hqmq.SOURCE).parent / "mixed_codes.cuh"
WHY = cuda_hqmq.why_unavailable() if CUDA else "no CUDA device"
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"CUDA HQMQ kernel unavailable: {WHY}")
BITS, MIXED = "hqmq:S=96,r=4", "hqmq:S=96,r=4,pack=mixed"
MED3 = MIXED + ",outliers=med3"

HARNESS = r"""
#include "mixed_codes.cuh"
#include <string.h>
template <int D>
static void rows(const unsigned char* in, int n, int stride, uint32_t* out) {
  using L = mixed::Layout<D>;
  for (int r = 0; r < n; ++r) {
    uint32_t x[L::NX], o[L::NO];
    memcpy(x, in + (long)r * stride, sizeof x);
    mixed::to_bits<D>(x, o);
    memcpy(out + (long)r * L::NO, o, sizeof o);
  }
}
extern "C" void rows64(const unsigned char* in, int n, int stride, uint32_t* out) { rows<64>(in, n, stride, out); }
extern "C" void rows128(const unsigned char* in, int n, int stride, uint32_t* out) { rows<128>(in, n, stride, out); }
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build mixed_codes.cuh's host harness")
    d = tmp_path_factory.mktemp("mixed")
    (d / "h.cpp").write_text(HARNESS)
    so = d / "h.so"
    r = subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{HEADER.parent}", "-o", str(so),
                        str(d / "h.cpp")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return ctypes.CDLL(str(so))


@pytest.mark.parametrize("D", [64, 128])
def test_to_bits_is_packings_12_bit_row(harness, D):
    n_codes = D // 4
    G, W, WL, MB = mixed_layout(2304, n_codes)
    assert WL == 0  # whole groups, as the header assumes
    nx = (MB + 3) // 4  # words holding a row (mixed::Layout<D>::NX)
    g = torch.Generator().manual_seed(D)
    codes = torch.randint(0, 2304, (4000, n_codes), generator=g)
    codes[0], codes[1], codes[2, ::2] = 2303, 0, 2303  # every group at its extremes
    rows = pack_mixed(codes, 2304)
    assert rows.shape[1] == MB
    stride = 4 * nx + 4
    buf = torch.randint(0, 256, (codes.shape[0], stride), generator=g, dtype=torch.uint8)  # garbage after each row
    buf[:, :MB] = rows
    out = torch.zeros(codes.shape[0], 3 * n_codes // 8, dtype=torch.int32)
    fn = harness.rows64 if D == 64 else harness.rows128
    fn(ctypes.c_void_p(buf.data_ptr()), codes.shape[0], stride, ctypes.c_void_p(out.data_ptr()))
    want = pack_bits(codes, 12)
    assert torch.equal(out.view(torch.uint8), want)


def test_a_head_dim_256_row_is_two_head_dim_128_rows():
    """The d 256 MIX instances copy each half of a row (45 bytes at 0 and 45) as a d 128 row:
    packing.py's groups of 4 codes (45 bits) end on byte 45 after 8 groups."""
    assert mixed_layout(2304, 64) == (4, 45, 0, 90) and mixed_layout(2304, 32) == (4, 45, 0, 45)
    g = torch.Generator().manual_seed(256)
    codes = torch.randint(0, 2304, (3000, 64), generator=g)
    codes[0], codes[1], codes[2, ::3] = 2303, 0, 2303
    halves = torch.cat([pack_mixed(codes[:, :32], 2304), pack_mixed(codes[:, 32:], 2304)], dim=1)
    assert torch.equal(pack_mixed(codes, 2304), halves)


def _cpu_flats(spec, D, T=40):
    k, v = make(1, 2, T, D, 1).cpu(), make(1, 2, T, D, 2).cpu()
    return flats(spec, k, v)


@pytest.mark.parametrize("spec,D,why", [
    ("hqmq:S=128,r=4,pack=mixed", 128, "S=128"),
    ("hqmq:S=128,r=4,pack=mixed,outliers=med3", 128, "S=128"),
    ("hqmq:S=128,r=4,pack=mixed", 256, "S=128"),
])
def test_declined_layouts_name_the_reason(spec, D, why):
    kf, _ = _cpu_flats(spec, D)
    reason = cuda_hqmq._flat_reason(kf)
    assert reason and "mixed-radix" in reason and why in reason and "Triton reads them" in reason


@pytest.mark.parametrize("spec,switch", [(MIXED, "AUTO_MIXED"), (MED3, "AUTO_MIXED_MED3")])
def test_taken_layouts_get_past_the_code_checks(spec, switch):
    for D in cuda_hqmq.MIXED_HEAD_DIMS:
        kf, _ = _cpu_flats(spec, D)
        assert cuda_hqmq.mixed_rows(kf) and cuda_hqmq._flat_reason(kf) == "cache buffers not on a CUDA device"
        assert cuda_hqmq.variants(D, kf.has_outliers, mix=True) == (
            (cuda_hqmq.DEFAULT_VARIANT_MED3,) if kf.has_outliers else (cuda_hqmq.DEFAULT_VARIANT,))
        switched = cuda_hqmq.AUTO_MIXED and (switch == "AUTO_MIXED" or cuda_hqmq.AUTO_MIXED_MED3)
        on = switched and D in cuda_hqmq.AUTO_MIXED_HEAD_DIMS
        why = cuda_hqmq.auto_refusal(kf)
        assert (why is None) == on, (D, why)
        assert on or (switch if not switched else "AUTO_MIXED_HEAD_DIMS") in why, (D, why)


def _pair(D, T, seed, junk=0, codebook=None, med3=False):
    """(bits K, V flats; mixed K, V flats) of one cache: the same codes; junk: capacity rows
    of garbage after T (the mixed (b, h) rows then start off 16-byte boundaries, as they do
    whenever T 45 or T 23 is not a multiple of 16); med3: Med3x on both sides."""
    k, v = make(2, 2, T, D, seed), make(2, 2, T, D, seed + 1, outlier=med3)
    extra = (f",codebook={codebook}" if codebook else "") + (",outliers=med3" if med3 else "")
    out = []
    for spec in (BITS + extra, MIXED + extra):
        kf, vf = flats(spec, k, v)
        if junk:
            g = torch.Generator().manual_seed(seed)
            kf, vf = (dataclasses.replace(f, **{n: with_junk(getattr(f, n), junk, g)
                                                for n in ("codes", "radius", "r_max")}) for f in (kf, vf))
        out.append((kf, vf))
    assert out[1][0].code_pack == "mixed" and out[1][0].codes.shape[-1] < out[0][0].codes.shape[-1]
    return out


@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("T,junk", [(1, 0), (17, 0), (1000, 5), (4099, 37)])
def test_mixed_rows_decode_as_the_12_bit_rows(D, T, junk):
    (kb, vb), (km, vm) = _pair(D, T, T, junk)
    if junk and D != 256:  # (256: a warp's half rows start 45 bytes into the rows, off any boundary)
        assert (km.codes.stride(1) * km.codes.element_size()) % 16  # rows off the 16-byte boundary
    q = query(2, 8, D, T + 1)
    for ns in (None, 1, 3):
        a, b = attend(q, kb, vb, num_splits=ns), attend(q, km, vm, num_splits=ns)
        assert torch.isfinite(b).all() and torch.equal(a, b), f"D={D} T={T} splits={ns}"


@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
def test_mixed_rows_with_int8_codebook_and_valid_len(D):
    (kb, vb), (km, vm) = _pair(D, 777, 5, junk=23, codebook="int8")
    q = query(2, 8, D, 9, torch.bfloat16)
    n = vlen(500)
    a, b = attend(q, kb, vb, valid_len=n), attend(q, km, vm, valid_len=n)
    assert torch.isfinite(b).all() and torch.equal(a, b)
    # the planned launch and the per-call one read the same rows
    assert torch.equal(b, cuda_hqmq._decode_per_call(q, km, vm, None, None, None, None, torch.float32, n))


@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("T", [1, 333, 4099])
def test_med3_mixed_rows_decode_as_the_12_bit_rows(D, T):
    (kb, vb), (km, vm) = _pair(D, T, T + 2, med3=True)
    if T > 16:
        assert km.n_outliers > 0 and vm.n_outliers > 0
    q = query(2, 8, D, T)
    # At 256 Med3x's mixed instance is one CTA of 16 warps (hqmq_decode.cu WIDE_MIX) against
    # the 12-bit rows' two of 8: its warps take other tiles, so the softmax's running maxima
    # and the fp32 sums run in another order. Same codes, so within the kernels' bound against
    # the reference (TOL), not bit for bit.
    same = torch.equal if D != 256 else (lambda a, b: rel_err(a, b) < TOL[torch.float32])
    for ns in (None, 3):
        a, b = attend(q, kb, vb, num_splits=ns), attend(q, km, vm, num_splits=ns)
        assert torch.isfinite(b).all() and same(a, b), f"D={D} T={T} splits={ns} rel {rel_err(a, b):.1e}"
    n = vlen(max(1, T // 2))
    assert same(attend(q, kb, vb, valid_len=n), attend(q, km, vm, valid_len=n))
    # the planned launch and the per-call one read the same rows
    assert torch.equal(attend(q, km, vm, valid_len=n),
                       cuda_hqmq._decode_per_call(q, km, vm, None, None, None, None, torch.float32, n))


@needs_cuda
def test_mixed_rows_refuse_other_variants():
    (_, _), (km, vm) = _pair(128, 100, 3)
    q = query(2, 8, 128, 4)
    with pytest.raises(ValueError, match="pack=mixed instance"):
        attend(q, km, vm, variant=0)


@needs_cuda
def test_auto_routes_mixed_rows_by_its_switch():
    from kvqbench.kernels.decode_attention import decode_attention, explain_backend

    (_, _), (km, vm) = _pair(128, 300, 8)
    q = query(2, 8, 128, 9)
    route = explain_backend(q, km, vm)
    assert route.backend == ("cuda" if cuda_hqmq.AUTO_MIXED else "triton"), route.reason
    if cuda_hqmq.AUTO_MIXED:
        assert torch.equal(decode_attention(q, km, vm, out_dtype=torch.float32), attend(q, km, vm))


def test_an_instance_this_gpu_cannot_hold_is_declined_by_name(monkeypatch):
    """kernels/registry.py `Kernel.fits`, asked last: where the occupancy query of the default
    instance reads 0 or an error (its shared memory past the GPU's limit: Med3x mixed at 256
    takes 200 KB a CTA, an A100 allows 163 KB), auto declines the CUDA kernel naming it, so
    Triton takes the call; where it reads >= 1, the CUDA kernel does. The library and the
    device are stood in for (q looks like a CUDA tensor: host_time.py's CPU walk; the layout
    checks pass), so this runs on a CPU."""
    import types

    from kvqbench.kernels import registry
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor

    kern = registry.format_of_flat(L.HQMQFlat).by_backend["cuda"]
    (_, _), (km, vm) = _pair(256, 40, 2, med3=True)
    q = query(1, 8, 256, 3).cpu().as_subclass(CudaLookingTensor)
    asked = []
    monkeypatch.setattr(cuda_hqmq, "_LIB", types.SimpleNamespace(lib=object()))
    monkeypatch.setattr(cuda_hqmq, "why_unavailable", lambda: None)
    monkeypatch.setattr(cuda_hqmq, "unsupported", lambda q, k, v: None)  # (the layout checks: tested above)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU-S")
    monkeypatch.setattr(cuda_hqmq, "occupancy", lambda *a: asked.append(a) or -1)
    why = kern.declines(q, km, vm, {}, None)
    assert why and "variant 10" in why and "Med3x, pack=mixed" in why and "GPU-S" in why, why
    assert asked[-1] == (cuda_hqmq.DEFAULT_VARIANT_MED3, 96, True, 256, 8, True)
    assert kern.refusal(q, km, vm) == why  # (backend="cuda" by name: the same reason)
    monkeypatch.setattr(cuda_hqmq, "occupancy", lambda *a: 1)
    assert kern.declines(q, km, vm, {}, None) is None
