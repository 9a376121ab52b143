"""The CUDA decode kernels (kvqbench.kernels.cuda.decode_attention: int4 g32 and fp8) against the
dequantize-then-attend reference.

On a machine without a CUDA GPU or nvcc every kernel test skips, with the reason
`cuda_decode.why_unavailable()` gives; the dispatch tests at the end run anywhere.
Tolerances as test_kernels.py's GPU ones (fp16 operands, fp32 accumulation).

(About 890 lines: one file per CUDA source, as kernels/cuda/ has them: the GPU tests of one
.cu source's three formats (int4, fp8, KIVI) and head dims, run by name in a GPU call.)
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvqbench.kernels import layout as L
from kvqbench.kernels.cuda import decode_attention as cuda_decode
from kvqbench.kernels.cuda import library
from kvqbench.quantizers import get_quantizer
from kvqbench.suites.tests.cuda_helpers import (CUDA, DEV, TOL, attend, auto_case, build, check_graph_replay,
                                                check_last_token, checked_call, flats, make, rel_err, with_junk)

WHY = cuda_decode.why_unavailable() if CUDA else "no CUDA device"
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"CUDA decode kernels unavailable: {WHY}")


def check(spec, B, Hq, Hkv, T, D, dtype, seed=0, **kw):
    """(out, reference) of backend="cuda" on random K (3 outlier channels) and V."""
    k, v = make(B, Hkv, T, D, seed), make(B, Hkv, T, D, seed + 1, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 2)).to(dtype).to(DEV)
    return checked_call(spec, q, k, v, **kw)[:2]


SPECS = ["int4", "fp8-e4m3"]


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("T", [1, 7, 16, 33, 1000, 4099])
@pytest.mark.parametrize("B,dtype", [(1, torch.float16), (3, torch.bfloat16)])
def test_matches_reference(spec, T, B, dtype):
    check(spec, B, 32, 8, T, 128, dtype, seed=T)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("gqa", [1, 8, 12, 16])  # (12, 16: two CTAs per kv row, launch.head_split)
@pytest.mark.parametrize("T", [33, 4099])
def test_gqa(spec, gqa, T):
    check(spec, 3, 2 * gqa, 2, T, 128, torch.float16, seed=gqa + T)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS + ["fp8-e5m2"])
@pytest.mark.parametrize("gqa,D", [(16, 128), (12, 128), (16, 64), (10, 64)])
@pytest.mark.parametrize("T", [1, 33, 4099])
@pytest.mark.parametrize("fused", [False, True])
def test_joint_variant_matches_the_two_cta_launch(spec, gqa, D, T, fused):
    """Variant 6 (both q-head halves of a group over 8 in one CTA, each K / V fragment
    decoded once for two mma) gives the reference, and the two-CTA launch of variant 2 bit
    for bit at the same split count (each half's arithmetic is variant 2's, in its order),
    with the combine launched after it or fused into it. (Default splits: the reference
    only; the joint launch cuts for half the rows, so its split count differs.)"""
    J = cuda_decode.JOINT_VARIANT
    with library.FUSED_COMBINE.set(fused):
        check(spec, 3, 2 * gqa, 2, T, D, torch.float16, seed=gqa + T, variant=J)
        for ns in (1, 3):
            one = check(spec, 3, 2 * gqa, 2, T, D, torch.float16, seed=gqa + T, variant=J, num_splits=ns)[0]
            two = check(spec, 3, 2 * gqa, 2, T, D, torch.float16, seed=gqa + T, variant=2, num_splits=ns)[0]
            assert torch.equal(one, two), f"{spec} gqa {gqa} d {D} T {T} splits {ns}: {(one - two).abs().max()}"


@needs_cuda
@pytest.mark.parametrize("spec", SPECS + ["fp8-e5m2"])
@pytest.mark.parametrize("D", [64, 128])
def test_head_dims_formats_and_fp32_q(spec, D):
    check(spec, 2, 8, 2, 777, D, torch.float16, seed=D)
    check(spec, 2, 8, 2, 200, D, torch.float32, seed=D + 1)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_splits_and_variants(spec):
    """Every launch variant and split count gives the reference (one split: the whole T
    in one CTA; many: tiny splits)."""
    for variant in range(cuda_decode.NUM_VARIANTS):
        for ns in (1, 3, None, 10_000):
            check(spec, 2, 8, 2, 1500, 128, torch.float16, seed=variant, variant=variant, num_splits=ns)


def _with_capacity(flat, extra, seed=0):
    """The same cache in [B, H, T + extra, ...] buffers, garbage after the valid T rows
    (inf and NaN included: a kernel reading past T produces non-finite output)."""
    g = torch.Generator().manual_seed(seed)
    names = ("codes", "scale", "zero") if isinstance(flat, L.IntFlat) else ("codes",)
    return dataclasses.replace(flat, **{n: with_junk(getattr(flat, n), extra, g) for n in names})


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("view", [False, True])
def test_capacity_beyond_valid_length(spec, view):
    """Store buffers with capacity > T (whole buffers, or [:, :, :n] views with n > T:
    non-contiguous), garbage after T: only the valid tokens count."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv, T, D = 3, 16, 4, 1037, 128
    k, v = make(B, Hkv, T, D, 5), make(B, Hkv, T, D, 6, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(7)).half().to(DEV)
    qk, pk, qv, pv = build(spec, k, v)
    kf, vf = _with_capacity(L.flatten(pk, "K"), 300), _with_capacity(L.flatten(pv, "V"), 300, seed=1)
    if view:
        names = ("codes", "scale", "zero") if isinstance(kf, L.IntFlat) else ("codes",)
        kf = dataclasses.replace(kf, **{n: getattr(kf, n)[:, :, : T + 100] for n in names})
        vf = dataclasses.replace(vf, **{n: getattr(vf, n)[:, :, : T + 100] for n in names})
        assert not kf.codes.is_contiguous()
    out = attend(q, kf, vf)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float16]


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("T", [16, 4099])
def test_last_token_matters(spec, role, T):
    """Change only the last key (aligned with every query of its head: it takes the
    softmax) or value: the output changes, and still matches the reference."""
    check_last_token(lambda q, k, v: checked_call(spec, q, k, v, num_splits=3)[:2], role, T)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_auto_uses_cuda_and_agrees_with_triton(spec):
    """backend="auto" takes the CUDA kernel for the CUDA_VERIFIED formats (same bytes out as
    backend="cuda"), Triton for the others; Triton's launch options select Triton; both
    agree within the tolerance."""
    from kvqbench.kernels.decode_attention import decode_attention

    q, k, v = auto_case(torch.bfloat16)
    kf, vf = flats(spec, k, v)
    auto = decode_attention(q, kf, vf).float()
    cuda = decode_attention(q, kf, vf, backend="cuda").float()
    tri = decode_attention(q, kf, vf, backend="triton").float()
    tri2 = decode_attention(q, kf, vf, block_t=64).float()
    assert torch.equal(auto, cuda if cuda_decode.takes_by_default(kf) else tri)
    assert torch.equal(tri, tri2) or rel_err(tri2, tri) < 1e-2
    assert rel_err(cuda, tri) < TOL[torch.bfloat16]
    assert auto.dtype == torch.float32 and decode_attention(q, kf, vf).dtype == torch.bfloat16


@needs_cuda
def test_long_context_int4():
    check("int4", 1, 32, 8, 65536 + 5, 128, torch.bfloat16, seed=4)


@needs_cuda
def test_cuda_graph_replay():
    check_graph_replay("int4")


# ---------------------------------------------------------------------------------------
# device-side valid length (int4 / fp8): the flat's T is the capacity, the count is read
# by the kernel at run time, so one captured graph serves every decode step
# ---------------------------------------------------------------------------------------
def _capacity_flats(spec, T, cap, seed):
    """(q, K / V flats whose T is the capacity `cap` >= T: real tokens [0, T), NaN / inf
    garbage after them, decoded K / V of the real tokens)."""
    B, Hq, Hkv, D = 2, 16, 4, 128
    k, v = make(B, Hkv, T, D, seed), make(B, Hkv, T, D, seed + 1, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 2)).half().to(DEV)
    qk, pk, qv, pv = build(spec, k, v)
    kf, vf = (_with_capacity(L.flatten(p_, r), cap - T, seed=i) for i, (p_, r) in enumerate(((pk, "K"), (pv, "V"))))
    kf, vf = dataclasses.replace(kf, T=cap), dataclasses.replace(vf, T=cap)
    return q, kf, vf, qk.decode(pk), qv.decode(pv)


def _vlen(n):
    return torch.tensor([n], dtype=torch.int32, device=DEV)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_valid_len_equal_to_T_is_the_plain_call(spec):
    """valid_len = T: the same grid, the same tokens: the same bits as without it."""
    kf, vf = flats(spec, make(1, 8, 1037, 128, 31), make(1, 8, 1037, 128, 32))
    q = torch.randn(1, 32, 1, 128, generator=torch.Generator().manual_seed(33)).half().to(DEV)
    for ns in (None, 3):
        plain = cuda_decode.decode(q, kf, vf, num_splits=ns, out_dtype=torch.float32)
        assert torch.equal(cuda_decode.decode(q, kf, vf, num_splits=ns, out_dtype=torch.float32,
                                              valid_len=_vlen(1037)), plain)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_valid_len_below_capacity_matches_the_reference(spec):
    """Capacity 1800 (real tokens to 1500, NaN / inf garbage after): valid_len 1, odd,
    a split boundary -1 / 0 / +1 and the last real tokens give the reference over the
    first valid_len tokens: empty splits (all past the count) and splits partly past it
    combine exactly. Register and cp.async variants; one split, 4 splits of 29 tiles
    (boundary at token 464), the default, and one tile per split."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    q, kf, vf, kd, vd = _capacity_flats(spec, 1500, 1800, seed=40)
    assert cuda_decode.splits(kf.B * kf.H, 1800, DEV, 4) == (4, 29)  # 4 splits of 29 tiles: boundary at 464
    for n in (1, 7, 463, 464, 465, 1499, 1500):
        ref = reference_decode_attention(q, kd[:, :, :n], vd[:, :, :n])
        for variant in (0, 2):
            for ns in (1, 4, None, 10_000):
                out = cuda_decode.decode(q, kf, vf, num_splits=ns, variant=variant, valid_len=_vlen(n),
                                         out_dtype=torch.float32)
                assert torch.isfinite(out).all(), (n, variant, ns)
                err = rel_err(out, ref)
                assert err < TOL[torch.float16], f"{spec} n={n} variant={variant} splits={ns}: {err:.3g}"


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_valid_len_graph_replay_follows_the_count(spec):
    """A call captured once in a CUDA graph (valid_len + a fitting workspace: no sync, no
    allocation) gives the reference over the new count after valid_len.fill_ on the
    device, bit-identical to the eager call; an eager call with the workspace allocates
    nothing."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    q, kf, vf, kd, vd = _capacity_flats(spec, 3000, 3500, seed=50)
    vl = _vlen(3000)
    ws = cuda_decode.make_workspace(q, kf, vf, out_dtype=torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # build, load, set the kernels' attributes outside the capture
        cuda_decode.decode(q, kf, vf, workspace=ws, valid_len=vl, out_dtype=torch.float32)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    eager = cuda_decode.decode(q, kf, vf, workspace=ws, valid_len=vl, out_dtype=torch.float32).clone()
    assert torch.cuda.memory_allocated() - before == eager.numel() * 4  # the clone only
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuda_decode.decode(q, kf, vf, workspace=ws, valid_len=vl, out_dtype=torch.float32)
    for n in (3000, 1, 777, 2049, 3000):
        vl.fill_(n)
        g.replay()
        ref = reference_decode_attention(q, kd[:, :, :n], vd[:, :, :n])
        assert rel_err(out, ref) < TOL[torch.float16], (spec, n)
        assert torch.equal(out, cuda_decode.decode(q, kf, vf, valid_len=_vlen(n), out_dtype=torch.float32))
    vl.fill_(3000)
    g.replay()
    assert torch.equal(out, eager)


@needs_cuda
def test_valid_len_arguments_are_checked():
    q, kf, vf, _, _ = _capacity_flats("int4", 100, 120, seed=60)
    with pytest.raises(ValueError, match="int32"):
        cuda_decode.decode(q, kf, vf, valid_len=torch.tensor([50], device=DEV))  # int64
    with pytest.raises(ValueError, match="int32"):
        cuda_decode.decode(q, kf, vf, valid_len=torch.tensor([50], dtype=torch.int32))  # on the host
    ws = cuda_decode.make_workspace(q, kf, vf, num_splits=2)
    with pytest.raises(ValueError, match="workspace"):
        cuda_decode.decode(q, kf, vf, num_splits=3, workspace=ws, valid_len=_vlen(50))
    _, _, (kk, kv) = check_kivi("kivi:bits=2", 1, 8, 2, 100, torch.float16)
    with pytest.raises(ValueError, match="valid_len"):
        cuda_decode.decode(torch.zeros(1, 8, 1, 128, device=DEV).half(), kk, kv, valid_len=_vlen(50))


@needs_cuda
def test_a_cached_plan_follows_the_flat():
    """The per-layout plan (strides, splits, launch arguments) is rebuilt when the flat's T
    or one of its tensors changes: a stale plan would attend over the old tokens."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    q, kf, vf, kd, vd = _capacity_flats("int4", 600, 600, seed=70)
    for n in (600, 333):
        kf.T = vf.T = n  # the same flat objects, mutated
        ref = reference_decode_attention(q, kd[:, :, :n], vd[:, :, :n])
        assert rel_err(cuda_decode.decode(q, kf, vf, out_dtype=torch.float32), ref) < TOL[torch.float16]
    kf.codes = kf.codes.flip(2).contiguous()  # new tensor, same metadata: the new bytes count
    flipped = cuda_decode.decode(q, kf, vf, out_dtype=torch.float32)
    assert rel_err(flipped, reference_decode_attention(q, kd[:, :, :333], vd[:, :, :333])) > 1e-2


# ---------------------------------------------------------------------------------------
# dispatch (any machine)
# ---------------------------------------------------------------------------------------
def test_unsupported_names_a_reason():
    k = torch.randn(1, 2, 40, 64)
    qk = get_quantizer("int8", role="K")
    f8 = L.flatten(qk.encode(k))
    q = torch.randn(1, 4, 1, 64)
    assert "CUDA" in cuda_decode.unsupported(q, f8, f8)  # a CPU q
    if CUDA:
        assert "int8" in cuda_decode.unsupported(q.to(DEV), *(2 * [L.flatten(qk.encode(k.to(DEV)))]))


def test_why_unavailable_is_a_reason_or_none():
    why = cuda_decode.why_unavailable()
    assert why is None or (isinstance(why, str) and why)
    if not CUDA:
        assert why is not None


def test_backend_argument_is_checked():
    from kvqbench.kernels.decode_attention import decode_attention

    k = torch.randn(1, 2, 8, 64)
    qk = get_quantizer("int4", role="K")
    f = L.flatten(qk.encode(k))
    with pytest.raises(ValueError, match="backend"):
        decode_attention(torch.randn(1, 4, 1, 64), f, f, backend="cutlass")
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA"):
            decode_attention(torch.randn(1, 4, 1, 64), f, f, backend="cuda")


@pytest.mark.parametrize("rows,T", [(8, 1), (8, 4099), (8, 32768), (64, 32768), (256, 1000)])
def test_default_splits_cover_every_tile(rows, T):
    """splits(): every split non-empty, all tiles covered; the default keeps ~TILES_PER_SPLIT
    tiles per split, explicit ctas_per_sm / num_splits as asked (capped by the tiles)."""
    dev = torch.device("cpu")  # _sm_count is 1 off the GPU
    tiles = -(-T // 16)
    for kw in ({}, {"ctas_per_sm": 16}, {"num_splits": 3}, {"num_splits": 10_000}):
        n, per = cuda_decode.splits(rows, T, dev, **kw)
        assert n * per >= tiles and (n - 1) * per < tiles and n >= 1
    n, per = cuda_decode.splits(rows, T, dev)
    assert per <= cuda_decode.TILES_PER_SPLIT or n == 1


# ---------------------------------------------------------------------------------------
# KIVI-2 / KIVI-4 (groups of 32, d 128): the quantized part through the KiviQ functor,
# the fp16 windows' tail through the KiviTail launch (reports/kernels/NOTES.md, "KIVI as a
# format of the CUDA template"). backend="cuda" only until "kivi" is in CUDA_VERIFIED.
# ---------------------------------------------------------------------------------------
KIVI_SPECS = ["kivi:bits=2", "kivi:bits=4"]


def check_kivi(kspec, B, Hq, Hkv, T, dtype, seed=0, vspec=None, k=None, v=None, q=None, D=128, **kw):
    """(out, reference, (K flat, V flat)); kspec / vspec: the K and V quantizers (the same
    unless vspec: other windows); k, v, q default to seeded random tensors of head dim D."""
    k = make(B, Hkv, T, D, seed) if k is None else k
    v = make(B, Hkv, T, D, seed + 1, outlier=False) if v is None else v
    if q is None:
        q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 2)).to(dtype).to(DEV)
    return checked_call(kspec, q, k, v, vspec, **kw)


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
@pytest.mark.parametrize("T", [1, 20, 32, 333, 4099])  # window only, T < G, T = G, odd, long
@pytest.mark.parametrize("B,dtype", [(1, torch.float16), (3, torch.bfloat16)])
def test_kivi_matches_reference(spec, T, B, dtype):
    _, _, (kf, vf) = check_kivi(spec, B, 32, 8, T, dtype, seed=T)
    if T == 4099:  # the default windows differ: K holds T mod 128, V 128..159 tokens
        assert kf.T_res != vf.T_res and kf.n_groups and vf.n_groups


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
@pytest.mark.parametrize("gqa", [1, 4, 16])
@pytest.mark.parametrize("T", [97, 4099])
def test_kivi_gqa(spec, gqa, T):
    check_kivi(spec, 3, 2 * gqa, 2, T, torch.float16, seed=gqa + T)


@needs_cuda
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("T", [200, 1111])
def test_kivi_windows_of_k_and_v_differ(bits, T):
    """More quantized V than K (K: a fixed window of 64, V: 8) and the other way round
    (K: no window, V: 40): the tail mixes quantized and window tiles on both sides."""
    _, _, (kf, vf) = check_kivi(f"kivi:bits={bits},residual=64,window=fixed", 2, 8, 2, T, torch.float16, seed=T,
                                vspec=f"kivi:bits={bits},residual=8")
    assert vf.T_quant > kf.T_quant
    _, _, (kf, vf) = check_kivi(f"kivi:bits={bits},residual=0", 2, 8, 2, T, torch.bfloat16, seed=T + 1,
                                vspec=f"kivi:bits={bits},residual=40")
    assert kf.T_quant > vf.T_quant


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
def test_kivi_splits_and_variants(spec):
    """Every offered KIVI variant (group and tile streams, the fused group step 7-9, the
    KIVI-2 lane-byte map 12) and split count (None: the default rule) gives the reference;
    the register variants are refused."""
    failed = []  # every variant and split count runs (one GPU call must show all that fail)
    for variant in cuda_decode.KIVI_VARIANTS:
        for ns in (1, 3, None, 10_000):
            try:
                check_kivi(spec, 2, 8, 2, 1500, torch.float16, seed=variant, variant=variant, num_splits=ns)
            except AssertionError as e:
                failed.append(f"variant {variant} splits {ns}: {str(e).splitlines()[0]}")
    assert not failed, "\n".join(failed)
    q = torch.zeros(1, 8, 1, 128, device=DEV).half()
    _, pk, _, pv = build(spec, make(1, 2, 64, 128, 0), make(1, 2, 64, 128, 1))
    with pytest.raises(ValueError, match="variants"):
        attend(q, L.flatten(pk, "K"), L.flatten(pv, "V"), variant=0)


@needs_cuda
@pytest.mark.parametrize("spec", ["kivi:bits=2", "kivi:bits=4,residual=0"])
@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("T", [16, 4096])
def test_kivi_last_token_matters(spec, role, T):
    """The last key / value (in the window, or quantized: residual=0, T = 4096) changes
    the output, which still matches the reference; attended with the q the last key is
    aligned with."""
    check_last_token(lambda q, k, v: check_kivi(spec, 1, 32, 8, T, torch.float16, k=k, v=v, q=q, num_splits=3)[:2],
                     role, T)


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
def test_kivi_capacity_beyond_valid_length(spec):
    """Store-like buffers: two more groups of garbage capacity (NaN / inf included) and a
    longer window buffer with n_res valid rows."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv, T, D = 3, 16, 4, 1037, 128
    k, v = make(B, Hkv, T, D, 5), make(B, Hkv, T, D, 6, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(7)).half().to(DEV)
    qk, pk, qv, pv = build(spec, k, v)
    g = torch.Generator().manual_seed(0)
    grown = []
    for f in (L.flatten(pk, "K"), L.flatten(pv, "V")):
        per = 1 if f.role == "K" else f.group
        grown.append(dataclasses.replace(f, codes=with_junk(f.codes, 2 * per, g), scale=with_junk(f.scale, 2 * per, g),
                                         zero=with_junk(f.zero, 2 * per, g), residual=with_junk(f.residual, 40, g),
                                         n_res=f.T_res))
    out = attend(q, *grown)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float16]


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
def test_kivi_auto_follows_the_switch_and_agrees_with_triton(spec):
    """backend="auto" takes CUDA for KIVI only when "kivi" is in CUDA_VERIFIED (the lead's
    switch), else Triton; CUDA and Triton agree."""
    from kvqbench.kernels.decode_attention import decode_attention

    q, k, v = auto_case(torch.bfloat16)
    kf, vf = flats(spec, k, v)
    auto = decode_attention(q, kf, vf).float()
    cuda = decode_attention(q, kf, vf, backend="cuda").float()
    tri = decode_attention(q, kf, vf, backend="triton").float()
    assert torch.equal(auto, cuda if "kivi" in cuda_decode.CUDA_VERIFIED else tri)
    assert rel_err(cuda, tri) < TOL[torch.bfloat16]


@needs_cuda
def test_kivi_long_context():
    check_kivi("kivi:bits=2", 1, 32, 8, 65536 + 5, torch.bfloat16, seed=4)


@needs_cuda
@pytest.mark.parametrize("spec,T", [("int4", 131072), ("fp8-e4m3", 131072), ("kivi:bits=2", 131072),
                                    ("kivi:bits=4", 131072), ("kivi:bits=4", 131071)])
def test_T_131072(spec, T):
    """The issue's longest check: T = 131072 (and odd, 131071) with the default launch."""
    if spec.startswith("kivi"):
        check_kivi(spec, 1, 32, 8, T, torch.float16, seed=6)
    else:
        check(spec, 1, 32, 8, T, 128, torch.float16, seed=6)


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
def test_kivi_variants_at_default_splits_131072(spec):
    """Every offered KIVI variant (cuda_decode.KIVI_VARIANTS: 10 and 11, the folded zero
    point, failed here in GPU call 20a and are refused) at the default split rule -- ~128 tiles per split, 16 groups per warp, as
    at B=8 T=32k -- and at 8 CTAs per SM, T = 131072, against one reference."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv, T, D = 1, 32, 8, 131072, 128
    k, v = make(B, Hkv, T, D, 8), make(B, Hkv, T, D, 9, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(10)).half().to(DEV)
    qk, pk, qv, pv = build(spec, k, v)
    kf, vf = L.flatten(pk, "K"), L.flatten(pv, "V")
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    del k, v
    _, (_, per), _ = cuda_decode.kivi_plan(kf, vf, DEV)
    assert per >= 64  # the default rule's long splits (128 tiles on an H200), not the 2-CTAs/SM floor
    errs = {}
    for variant in cuda_decode.KIVI_VARIANTS:
        for kw in ({}, {"ctas_per_sm": 8}):
            out = attend(q, kf, vf, variant=variant, **kw)
            errs[(variant, kw.get("ctas_per_sm"))] = rel_err(out, ref) if torch.isfinite(out).all() else float("inf")
    bad = {key: e for key, e in errs.items() if not e < TOL[torch.float16]}
    assert not bad, f"{spec}: (variant, ctas_per_sm) -> relative error {bad}; all: {errs}"


def _kivi_flats(spec, T, D=128, B=1, H=2, kspec=None):
    x = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(T))
    return (L.flatten(get_quantizer(kspec or spec, role="K").encode(x), "K"),
            L.flatten(get_quantizer(spec, role="V").encode(x), "V"))


def test_kivi_switch_gates_auto():
    """takes_by_default follows CUDA_VERIFIED."""
    kf, _ = _kivi_flats("kivi:bits=2", 100)
    assert cuda_decode.format_name(kf) == "kivi"
    assert cuda_decode.takes_by_default(kf) == ("kivi" in cuda_decode.CUDA_VERIFIED)


def test_kivi_unsupported_names_a_reason():
    q = torch.randn(1, 4, 1, 128)
    kf, vf = _kivi_flats("kivi:bits=2", 100)
    assert "CUDA" in cuda_decode.unsupported(q, kf, vf)  # a CPU q
    assert cuda_decode._kivi_unsupported(q, kf, vf) is None  # the layout itself is taken
    assert "role" in cuda_decode._kivi_unsupported(q, vf, kf)
    assert "bits" in cuda_decode._kivi_unsupported(q, *_kivi_flats("kivi:bits=3", 100))
    assert "groups" in cuda_decode._kivi_unsupported(q, *_kivi_flats("kivi:bits=2,group=64", 200))
    assert "head_dim" in cuda_decode._kivi_unsupported(torch.randn(1, 4, 1, 96), *_kivi_flats("kivi:bits=2", 100, D=96))
    for D in (64, 256):  # taken since the kernels are templated on the head dim
        assert cuda_decode._kivi_unsupported(torch.randn(1, 4, 1, D), *_kivi_flats("kivi:bits=2", 100, D=D)) is None


@pytest.mark.parametrize("T,kspec", [(1, None), (20, None), (4099, None), (8192 + 7, None),
                                     (1111, "kivi:bits=2,residual=64,window=fixed")])
def test_kivi_plan_covers_every_token(T, kspec):
    """kivi_plan: the quantized part [0, n_main) is whole groups both sides have, its
    splits and the tail's cover every tile once, non-empty (CPU)."""
    kf, vf = _kivi_flats("kivi:bits=2,residual=8" if kspec else "kivi:bits=2", T, kspec=kspec)
    dev = torch.device("cpu")
    for kw in ({}, {"num_splits": 3}, {"ctas_per_sm": 16}):
        n_main, (nm, pm), (nt, pt) = cuda_decode.kivi_plan(kf, vf, dev, **kw)
        assert n_main == min(kf.T_quant, vf.T_quant) and n_main % 32 == 0
        tm, tt = n_main // 16, -(-(T - n_main) // 16)
        assert (nm == 0) == (tm == 0) and (nt == 0) == (tt == 0)
        if tm:
            assert nm * pm >= tm and (nm - 1) * pm < tm
            assert pm % 2 == 0  # whole groups per split: the group stream's stage is a group
        if tt:
            assert nt * pt >= tt and (nt - 1) * pt < tt


# ---------------------------------------------------------------------------------------
# KIVI graph views with a device count (valid_len): the kernel derives each side's
# quantized tokens and window rows from the count by the window policies, on a grid cut
# for the capacity (a graphed decode step's call; before 2026-12-05 those ran on Triton)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("policies", [((0, 128), (128, 32)), ((128, 32), (128, 32)), ((0, 64), (20, 32))])
@pytest.mark.parametrize("capacity", [1, 40, 161, 1000])
def test_kivi_device_count_plan_covers_every_count(policies, capacity):
    """kivi_plan(device_count=True): at every count up to the capacity, the main part
    [0, n_main(T)) and the tail [n_main(T), T) fit the splits cut for the capacity (CPU)."""
    z = torch.zeros(1)
    kf, vf = (L.KIVIGraphFlat(B=2, H=3, D=64, bits=2, group=32, role=r, n_groups=0, codes=z, scale=z, zero=z,
                              residual=z, policy=p, capacity=capacity) for r, p in zip("KV", policies))
    for kw in ({}, {"num_splits": 3}):
        n_cap, (nm, pm), (nt, pt) = cuda_decode.kivi_plan(kf, vf, torch.device("cpu"), device_count=True, **kw)
        assert n_cap % 32 == 0 and (nm == 0) == (n_cap == 0) and pm % 2 == 0
        for T in range(1, capacity + 1):
            n_main = min(max(0, T - a) // p * p for a, p in policies)
            assert n_main <= n_cap and n_main // 16 <= nm * pm
            assert -(-(T - n_main) // 16) <= nt * pt, (T, n_main, nt, pt)


def _kivi_cache_views(spec, T, cap, D, seed):
    """(q, host-count K / V flats, graph views at capacity cap, reference K / V) of a
    QuantizedCache of spec holding T tokens (a prefill leaves the window policy's state),
    NaN / inf garbage past every buffer's valid rows."""
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    B, Hkv, Hq = 2, 2, 8
    k, v = make(B, Hkv, T, D, seed), make(B, Hkv, T, D, seed + 1, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 2)).half().to(DEV)
    cache = QuantizedCache(spec, n_layers=1, fused=True, seed=3)
    cache.update(k, v, 0)
    cache.reserve(cap)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(seed + 3)
    for role in ("K", "V"):
        st = layer.stores[role]
        per = 1 if role == "K" else st.flat.group
        for name, b in st.buffers.items():
            n = st.flat.n_res if name == "residual" else st.flat.n_groups * per
            rest = b.buf[:, :, n:]
            b.buf[:, :, n:] = with_junk(rest[:, :, :0], rest.shape[2], g)
    host = tuple(layer.stores[r].kernel_view() for r in ("K", "V"))
    views = tuple(layer.stores[r].graph_view(cap) for r in ("K", "V"))
    return q, host, views, (layer.read("K"), layer.read("V"))


@needs_cuda
@pytest.mark.parametrize("spec", ["kivi:bits=2", "kivi:bits=4,window=fixed"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_kivi_valid_len_matches_the_host_counts_call_and_the_reference(spec, D, monkeypatch):
    """Counts across both sides' flushes (keys: the paper's window (0, 128), values (128,
    32); the fixed window (128, 32) both), a window-only cache and T = 1: the device-count
    call equals the host-count call of the same cache up to the summation order of other
    splits (2e-4: 4x the largest difference of the first H200 run, 5.1e-5) and the
    reference within TOL, with garbage past the valid rows and splits past the count.
    backend="auto" takes it once the switch is on."""
    from kvqbench.kernels.decode_attention import explain_backend, reference_decode_attention

    for i, T in enumerate((1, 100, 159, 160, 161, 255, 256, 300, 1500)):
        q, (kh, vh), (kg, vg), (kd, vd) = _kivi_cache_views(spec, T, 1600, D, seed=10 * i + D)
        ref = reference_decode_attention(q, kd, vd)
        host = cuda_decode.decode(q, kh, vh, out_dtype=torch.float32)
        vl = torch.tensor([T], dtype=torch.int32, device=DEV)
        for ns in (None, 1, 7):
            out = cuda_decode.decode(q, kg, vg, num_splits=ns, valid_len=vl, out_dtype=torch.float32)
            assert torch.isfinite(out).all(), (spec, D, T, ns)
            assert rel_err(out, host) < 2e-4, (spec, D, T, ns, rel_err(out, host))
            assert rel_err(out, ref) < TOL[torch.float16], (spec, D, T, ns, rel_err(out, ref))
    monkeypatch.setattr(cuda_decode, "KIVI_VALID_LEN_AUTO", False)
    assert explain_backend(q, kg, vg, valid_len=vl).backend == "triton"
    monkeypatch.setattr(cuda_decode, "KIVI_VALID_LEN_AUTO", True)
    assert explain_backend(q, kg, vg, valid_len=vl).backend == "cuda"
    with pytest.raises(ValueError, match="needs valid_len"):
        cuda_decode.decode(q, kg, vg)


@needs_cuda
@pytest.mark.parametrize("spec", ["kivi:bits=2", "kivi:bits=4"])
def test_kivi_graphed_steps_on_cuda_match_the_triton_ones(spec, monkeypatch):
    """A model's graphed decode steps (head dim 64, 2 layers) from a 240-token prompt over
    50 steps (both sides flush at 256 and 288 tokens) through the CUDA kernel with device
    counts give the logits of the same steps through the Triton kernel (bf16 model, logits
    within 0.05), and the replays equal uncaptured device steps. The steps are fed fixed
    tokens: greedy paths of a random model part on near-ties (the first H200 run: the
    kernels' greedy tokens parted at a step with no flush, logits 5e-3 apart)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvqbench.kernels.graphs import GraphedDecodeStep
    from kvqbench.suites.harness.attention import fused_attention
    from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 240 + 50), generator=torch.Generator().manual_seed(1)).to(DEV)

    def run(on_cuda: bool, capture: bool = True):
        monkeypatch.setattr(cuda_decode, "KIVI_VALID_LEN_AUTO", on_cuda)
        if not capture:
            monkeypatch.setattr(GraphedDecodeStep, "_capture", lambda self: self._device_step())
        with torch.inference_mode(), fused_attention(model):
            cache = QuantizedCache(spec, config=model.config, fused=True, seed=1)
            kw = cache_kwargs(model, cache)
            model(input_ids=ids[:, :240], **kw, use_cache=True)
            step = GraphedDecodeStep(model, cache, 2, max_tokens=240 + 54)
            out = [step(ids[:, 240 + i : 241 + i]).clone() for i in range(50)]
        monkeypatch.undo()
        assert (step.graph is not None) == capture, step.why
        return torch.cat(out, 1)

    cuda, triton = run(True), run(False)
    assert torch.allclose(cuda.float(), triton.float(), atol=0.05), (cuda.float() - triton.float()).abs().max()
    assert torch.equal(cuda, run(True, capture=False))


FAKE_NVCC = """#!/bin/sh
[ "$1" = "--version" ] && { echo "fake nvcc 0.1"; exit 0; }
echo build >> "$KVQ_NVCC_CALLS"
sleep 3
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out=$2; shift; done
echo library > "$out"
"""

WORKER = """
import os, sys, time
from pathlib import Path
from kvqbench.kernels.cuda import decode_attention, library
ready = Path(sys.argv[1])
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < int(sys.argv[2]):  # start the builds together
    time.sleep(0.05)
print(library.compile_library(decode_attention.SOURCE, "kvq_decode", (9, 0)))
"""


def test_processes_starting_together_build_the_library_once(tmp_path):
    """pytest-xdist workers and torchrun ranks load the CUDA library at the same moment on
    a fresh machine: one runs nvcc, the others wait for its library (each running its own
    nvcc made a fresh H200 host's test run crawl). A fake nvcc counts its builds."""
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    ready, calls, n = tmp_path / "ready", tmp_path / "calls", 4
    ready.mkdir()
    env = dict(os.environ, CUDA_HOME=str(tmp_path / "cuda"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               KVQ_NVCC_CALLS=str(calls))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(ready), str(n)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1 and Path(paths.pop()).read_text() == "library\n"
    assert calls.read_text().count("build") == 1, f"{calls.read_text().count('build')} nvcc builds for {n} processes"


@pytest.mark.skipif(library.nvcc() is None, reason="no nvcc: nothing to build")
def test_both_sources_build_and_load_without_a_gpu(tmp_path, monkeypatch):
    """The sources, their shared header and the loader's build path compile for sm_90a and
    load (a compile error or a missing export shows here, on any machine with nvcc).
    (step_write.cu is built and checked by test_cuda_step_write.py's host-arithmetic test.)"""
    import ctypes

    from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq

    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = ((cuda_decode.SOURCE, "kvq_decode", "kvq_run"), (cuda_hqmq.SOURCE, "kvq_hqmq", "kvq_hqmq_decode"))
    # The two nvcc builds (one process each, ~20 s apiece) side by side: separate stems,
    # separate locks and outputs; each library is then loaded and checked as before.
    with ThreadPoolExecutor(len(builds)) as pool:
        paths = list(pool.map(lambda b: library.compile_library(b[0], b[1], (9, 0)), builds))
    for (source, stem, symbol), path in zip(builds, paths):
        lib = ctypes.CDLL(str(path))
        assert hasattr(lib, symbol)
        if symbol == "kvq_run":  # the launch-argument struct the loader fills has the .cu's layout
            assert lib.kvq_args_size() == ctypes.sizeof(cuda_decode._Args)


# ---------------------------------------------------------------------------------------
# head dims 64 and 256 (issue 28): int4 / fp8 at 256, KIVI-2 / KIVI-4 at 64 and 256, each
# against the dequantize-then-attend reference at T = 1, odd, larger and long, the last
# key / value, GQA groups 1, 2, 8 and every variant the head dim has. backend="cuda" (the
# auto route waits for VERIFIED_HEAD_DIMS).
# ---------------------------------------------------------------------------------------
NEW_HEADS = [("int4", 256), ("fp8-e4m3", 256), ("fp8-e5m2", 256), ("kivi:bits=2", 64), ("kivi:bits=4", 64),
             ("kivi:bits=2", 256), ("kivi:bits=4", 256)]


def check_head(spec, B, Hq, Hkv, T, D, dtype=torch.float16, seed=0, **kw):
    """(out, reference, flats) of backend="cuda" at head dim D, int4 / fp8 or KIVI."""
    if spec.startswith("kivi"):
        return check_kivi(spec, B, Hq, Hkv, T, dtype, seed=seed, D=D, **kw)
    k, v = make(B, Hkv, T, D, seed), make(B, Hkv, T, D, seed + 1, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 2)).to(dtype).to(DEV)
    return checked_call(spec, q, k, v, **kw)


@needs_cuda
@pytest.mark.parametrize("spec,D", NEW_HEADS)
@pytest.mark.parametrize("T", [1, 333, 4099])
@pytest.mark.parametrize("B,dtype", [(1, torch.float16), (3, torch.bfloat16)])
def test_head_dims_match_reference(spec, D, T, B, dtype):
    _, _, (kf, _) = check_head(spec, B, 32, 8, T, D, dtype, seed=T + D)
    assert kf.D == D


@needs_cuda
@pytest.mark.parametrize("spec,D", NEW_HEADS)
def test_head_dims_fp32_q_and_long(spec, D):
    check_head(spec, 2, 8, 2, 200, D, torch.float32, seed=D + 1)
    check_head(spec, 1, 32, 8, 65536 + 5, D, torch.bfloat16, seed=D + 2)


@needs_cuda
@pytest.mark.parametrize("spec,D", NEW_HEADS)
@pytest.mark.parametrize("gqa", [1, 2, 8, 14])
def test_head_dims_gqa(spec, D, gqa):
    check_head(spec, 3, 2 * gqa, 2, 777, D, seed=gqa + D)


@needs_cuda
@pytest.mark.parametrize("spec,D", NEW_HEADS)
@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("T", [16, 4099])
def test_head_dims_last_token_matters(spec, D, role, T):
    if spec.startswith("kivi"):
        def run(q, k, v):
            return check_kivi(spec, 1, 32, 8, T, torch.float16, k=k, v=v, q=q, D=D, num_splits=3)[:2]
    else:
        def run(q, k, v):
            return checked_call(spec, q, k, v, num_splits=3)[:2]
    check_last_token(run, role, T, D=D)


@needs_cuda
@pytest.mark.parametrize("spec,D", NEW_HEADS)
def test_head_dims_variants_and_splits(spec, D):
    """Every variant the head dim has (cuda_decode.variants) at several split counts; the
    others are refused with the reason."""
    failed = []
    _, _, (kf, vf) = check_head(spec, 2, 8, 2, 1500, D, seed=3)
    offered = cuda_decode.variants(kf)
    for variant in offered:
        for ns in (1, 3, None, 10_000):
            try:
                check_head(spec, 2, 8, 2, 1500, D, seed=3, variant=variant, num_splits=ns)
            except AssertionError as e:
                failed.append(f"variant {variant} splits {ns}: {str(e).splitlines()[0]}")
    assert not failed, "\n".join(failed)
    q = torch.zeros(2, 8, 1, D, device=DEV).half()
    for bad in (v for v in range(13) if v not in offered):
        with pytest.raises(ValueError, match="variant"):
            attend(q, kf, vf, variant=bad)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("view", [False, True])
def test_head_256_capacity_beyond_valid_length(spec, view):
    """int4 / fp8 at 256: garbage (NaN, inf) after T in whole buffers or [:, :, :n] views;
    and a device valid_len below the capacity (empty and partial splits)."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv, T, D = 3, 16, 4, 1037, 256
    k, v = make(B, Hkv, T, D, 5), make(B, Hkv, T, D, 6, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(7)).half().to(DEV)
    qk, pk, qv, pv = build(spec, k, v)
    kf, vf = _with_capacity(L.flatten(pk, "K"), 300), _with_capacity(L.flatten(pv, "V"), 300, seed=1)
    names = ("codes", "scale", "zero") if isinstance(kf, L.IntFlat) else ("codes",)
    if view:
        kf = dataclasses.replace(kf, **{n: getattr(kf, n)[:, :, : T + 100] for n in names})
        vf = dataclasses.replace(vf, **{n: getattr(vf, n)[:, :, : T + 100] for n in names})
    kd, vd = qk.decode(pk), qv.decode(pv)
    out = attend(q, kf, vf)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference_decode_attention(q, kd, vd)) < TOL[torch.float16]
    kc, vc = dataclasses.replace(kf, T=T + 100), dataclasses.replace(vf, T=T + 100)  # T: the capacity bound
    for n in (1, 17, 500, T):
        for ns in (None, 4):
            out = cuda_decode.decode(q, kc, vc, num_splits=ns, valid_len=_vlen(n), out_dtype=torch.float32)
            assert torch.isfinite(out).all(), (n, ns)
            err = rel_err(out, reference_decode_attention(q, kd[:, :, :n], vd[:, :, :n]))
            assert err < TOL[torch.float16], f"{spec} n={n} splits={ns}: {err:.3g}"


@needs_cuda
@pytest.mark.parametrize("spec", KIVI_SPECS)
@pytest.mark.parametrize("D", [64, 256])
def test_kivi_head_dims_windows_differ(spec, D):
    """The tail path at 64 / 256: more quantized V than K and the other way round."""
    bits = spec[-1]
    check_kivi(f"kivi:bits={bits},residual=64,window=fixed", 2, 8, 2, 1111, torch.float16, seed=D,
               vspec=f"kivi:bits={bits},residual=8", D=D)
    check_kivi(f"kivi:bits={bits},residual=0", 2, 8, 2, 1111, torch.bfloat16, seed=D + 1,
               vspec=f"kivi:bits={bits},residual=40", D=D)


def test_head_dims_taken_and_auto_gated():
    """Any machine: the accept rules take 64 / 128 / 256 and name the reason otherwise; auto
    routes a head dim only once it is in VERIFIED_HEAD_DIMS; head dim 256 offers the
    shared-memory variants, KIVI off d 128 its group-stream ones."""
    assert cuda_decode.head_dim_reason(96) and "head_dim 96" in cuda_decode.head_dim_reason(96)
    assert all(cuda_decode.head_dim_reason(D) is None for D in (64, 128, 256))
    x = torch.randn(1, 2, 40, 256)
    f = L.flatten(get_quantizer("int4", role="K").encode(x))
    assert cuda_decode.variants(f) == cuda_decode.SMEM_VARIANTS
    why = cuda_decode.auto_refusal(f)
    assert (why is None) == (256 in cuda_decode.VERIFIED_HEAD_DIMS["int4"])
    if why:
        assert "VERIFIED_HEAD_DIMS" in why
    kf, _ = _kivi_flats("kivi:bits=2", 100, D=64)
    assert 5 not in cuda_decode.variants(kf) and cuda_decode.DEFAULT_VARIANT["kivi"] in cuda_decode.variants(kf)
    assert (cuda_decode.auto_refusal(kf) is None) == (64 in cuda_decode.VERIFIED_HEAD_DIMS["kivi"])
    x96 = torch.randn(1, 2, 40, 96)
    f96 = L.flatten(get_quantizer("int4", role="K").encode(x96))
    if CUDA:
        assert "head_dim 96" in cuda_decode.unsupported(torch.randn(1, 4, 1, 96, device=DEV),
                                                        *(2 * [L.flatten(get_quantizer("int4", role="K").encode(
                                                            x96.to(DEV)))]))
    else:
        assert "CUDA" in cuda_decode.unsupported(torch.randn(1, 4, 1, 96), f96, f96)


@pytest.mark.parametrize("spec", ["int4", "fp8", "kivi:bits=2"])
def test_an_instance_this_gpu_cannot_hold_is_declined_by_name(spec, monkeypatch):
    """kernels/registry.py `Kernel.fits` for int4 / fp8 / KIVI (as for HQMQ in
    test_cuda_mixed_codes.py): where the default instance's occupancy query reads 0 or an
    error (head dim 256's stages past an Ada GPU's 99 KB opt-in), auto declines the CUDA
    kernel naming the format, head dim and GPU, and backend="cuda" refuses with the same
    reason; where it reads >= 1 the CUDA kernel takes the call. The library and device are
    stood in for, so this runs on a CPU; on a GPU the real query must read >= 1 for every
    default instance at 64 / 128 / 256 (the H100 / H200 hold them all)."""
    import types

    from kvqbench.kernels import registry
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor

    def k_flat(D):
        if spec.startswith("kivi"):
            return _kivi_flats(spec, 300, D=D)[0]
        return L.flatten(get_quantizer(spec, role="K").encode(torch.randn(1, 2, 40, D)))

    kf = k_flat(256)
    kern = registry.format_of_flat(type(kf)).by_backend["cuda"]
    if CUDA:
        for D in (64, 128, 256):
            assert cuda_decode.occupancy(k_flat(D)) >= 1, (spec, D)
    q = torch.randn(1, 4, 1, 256).as_subclass(CudaLookingTensor)
    asked = []
    monkeypatch.setattr(cuda_decode, "_LIB", types.SimpleNamespace(lib=object()))
    monkeypatch.setattr(cuda_decode, "why_unavailable", lambda: None)
    monkeypatch.setattr(cuda_decode, "unsupported", lambda q, k, v: None)  # (the layout checks: tested above)
    monkeypatch.setattr(cuda_decode, "auto_refusal", lambda k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU-S")
    monkeypatch.setattr(cuda_decode, "occupancy", lambda k: asked.append(k) or 0)
    why = kern.declines(q, kf, kf, {}, None)
    name = cuda_decode.format_name(kf)
    assert why and f"default {name} instance at head_dim 256" in why and "GPU-S" in why, why
    assert asked[-1] is kf
    assert kern.refusal(q, kf, kf) == why  # (backend="cuda" by name: the same reason)
    monkeypatch.setattr(cuda_decode, "occupancy", lambda k: 2)
    assert kern.declines(q, kf, kf, {}, None) is None


def test_gqa_groups_over_8_run_as_ctas_of_equal_groups():
    """Any machine: an even GQA group of 10..16 q heads runs as 2 CTAs per kv row, half the
    heads each (launch.head_split; a CTA's mma holds 8 heads); odd groups over 8 and groups
    over 16 are refused by name (Triton takes them), as is a q that is no whole group. A plan
    for a group of 16 (decode_attention's launch struct, built on a CPU by the plan's own
    fields) holds 8 heads a CTA, 2 CTAs per kv row, and splits cut for twice the rows."""
    from kvqbench.kernels import common
    from kvqbench.kernels.cuda.launch import gqa_refusal, head_split

    assert [head_split(g) for g in range(0, 18)] == [0] + [1] * 8 + [0, 2, 0, 2, 0, 2, 0, 2, 0]
    for Hq, H in ((18, 2), (22, 2), (34, 2), (5, 2)):
        why = gqa_refusal(torch.randn(1, Hq, 1, 64), H)
        assert why and "GQA group" in why and f"over {H} kv heads" in why
    assert gqa_refusal(torch.randn(1, 32, 1, 64), 2) is None
    k = L.flatten(get_quantizer("int4", role="K").encode(torch.randn(1, 2, 4096, 64)))
    a = cuda_decode._Args()
    assert (a.qs, a.qsh) == (1, 0)  # (a fresh struct: one CTA per kv row)
    a.qs = head_split(16)
    old = common.ASSUMED_SM_COUNT
    try:
        common.ASSUMED_SM_COUNT = 132
        ns16 = cuda_decode._token_fields(a, k, torch.device("cpu"), None, None)
        assert (a.qs, a.qsh, ns16) == (2, 1, cuda_decode.splits(k.B * k.H * 2, k.T, torch.device("cpu"))[0])
    finally:
        common.ASSUMED_SM_COUNT = old


def test_joint_variant_takes_groups_over_8_in_one_cta_per_kv_row():
    """Any machine: variant 6 (JOINT_VARIANT: both halves of a GQA group of 10..16 in one CTA,
    K and V decoded once) is refused by name for a group of 8 or less, an odd group, or head
    dim 256, and is cut into splits for one CTA per kv row (B * Hkv rows), where the two-CTA
    launch of the same group cuts for twice the rows."""
    from kvqbench.kernels import common

    k = L.flatten(get_quantizer("int4", role="K").encode(torch.randn(1, 2, 4096, 64)))
    k256 = L.flatten(get_quantizer("int4", role="K").encode(torch.randn(1, 2, 64, 256)))
    J = cuda_decode.JOINT_VARIANT
    assert cuda_decode._row_variant(J, 0, k, 16) == J and cuda_decode._row_variant(None, 0, k, 16) != J
    for group, kk in ((4, k), (8, k), (9, k), (16, k256)):
        with pytest.raises(ValueError, match=f"variant {J} .*a group of {group} at head_dim {kk.D}"):
            cuda_decode._row_variant(J, 0, kk, group)
    old = common.ASSUMED_SM_COUNT
    try:
        common.ASSUMED_SM_COUNT = 132
        cut = {}
        for variant in (2, J):
            a = cuda_decode._Args()
            a.qs, a.variant = 2, variant
            cut[variant] = cuda_decode._token_fields(a, k, torch.device("cpu"), None, None)
        cpu = torch.device("cpu")
        assert cut == {2: cuda_decode.splits(k.B * k.H * 2, k.T, cpu)[0], J: cuda_decode.splits(k.B * k.H, k.T, cpu)[0]}
    finally:
        common.ASSUMED_SM_COUNT = old
