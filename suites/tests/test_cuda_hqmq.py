"""The CUDA HQMQ decode kernel (kvqbench.kernels.cuda.hqmq_decode) against the
dequantize-then-attend reference. Kernel tests skip without a CUDA GPU / nvcc (the
reason is `cuda_hqmq.why_unavailable()`); the dispatch tests at the end run anywhere.
Tolerances as test_kernels.py's fp16-codebook HQMQ checks (fp16 operands, fp32 sums).
Encodings are cached per worker (`encoded`): one GPU call runs the whole file, and the
encode plus the dequantized reference cost more than the kernel.

(About 900 lines: one kernel's GPU tests (plain HQMQ, Med3x, head dims, the planned host path), in one
file so that a GPU call runs them by name.)
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq
from kvqbench.kernels import layout as L
from kvqbench.quantizers import get_quantizer
from kvqbench.suites.tests.cuda_helpers import (CUDA, DEV, TOL, attend, auto_case, build, check_graph_replay,
                                                check_last_token, checked_call, flats, make, rel_err, warmed_capture,
                                                with_junk)

WHY = cuda_hqmq.why_unavailable() if CUDA else "no CUDA device"
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"CUDA HQMQ kernel unavailable: {WHY}")
SPEC = "hqmq:S=96,r=4"
MED3 = SPEC + ",outliers=med3"


@functools.lru_cache(maxsize=24)
def encoded(B, Hkv, T, seed, spec=SPEC, D=128):
    """(K flat, V flat, decoded K, decoded V) of make()'s synthetic cache (cached). With
    Med3x both K and V get the 3 large channels, so both sides have outliers."""
    k, v = make(B, Hkv, T, D, seed), make(B, Hkv, T, D, seed + 1, outlier="med3" in spec)
    qk, pk, qv, pv = build(spec, k, v)
    return L.flatten(pk, "K"), L.flatten(pv, "V"), qk.decode(pk), qv.decode(pv)


def query(B, Hq, seed, dtype=torch.float16, D=128):
    return torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def check(B, Hq, Hkv, T, dtype=torch.float16, seed=0, spec=SPEC, flat_kw=None, D=128, **kw):
    from kvqbench.kernels.decode_attention import reference_decode_attention

    fk, fv, kd, vd = encoded(B, Hkv, T, seed, spec, D)
    if "med3" in spec and T >= 16:  # the outlier path runs on both sides
        assert fk.n_outliers > 0 and fv.n_outliers > 0
    if flat_kw:
        fk, fv = fk.with_table(**flat_kw), fv.with_table(**flat_kw)
    q = query(B, Hq, seed + 2, dtype, D)
    out = attend(q, fk, fv, **kw)
    ref = reference_decode_attention(q, kd, vd)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{spec} D={D} B={B} T={T} {dtype} {kw}: relative error {err:.3g}"
    return out, ref


@needs_cuda
@pytest.mark.parametrize("T", [1, 7, 16, 33, 1000, 4099])
@pytest.mark.parametrize("B,dtype", [(1, torch.float16), (3, torch.bfloat16), (2, torch.float32)])
def test_matches_reference(T, B, dtype):
    check(B, 32, 8, T, dtype, seed=T)


@needs_cuda
@pytest.mark.parametrize("gqa", [1, 3, 8, 10, 16])  # (10, 16: two CTAs per kv row, launch.head_split)
def test_gqa(gqa):
    check(2, 2 * gqa, 2, 777, seed=gqa)


@needs_cuda
@pytest.mark.parametrize("spec", [SPEC, "hqmq:S=96,r=4,codebook=int8", MED3, MED3 + ",codebook=int8",
                                  SPEC + ",pack=mixed", MED3 + ",pack=mixed"])
@pytest.mark.parametrize("gqa", [10, 12, 16])
@pytest.mark.parametrize("T", [1, 33, 4099])
@pytest.mark.parametrize("fused", [False, True])
def test_joint_variant_matches_the_two_cta_launch(spec, gqa, T, fused):
    """Variant 12 (JOINT_VARIANT: both q-head halves of a group over 8 in one CTA, every
    codeword gathered once for both) gives the reference, and the two-CTA launch of v3 (Med3x:
    v10, whose outlier path its Med3x instance runs per half) bit for bit at the same split
    count (each half's arithmetic in its order), with the combine launched after it or fused
    into it. (Default splits: the reference only; the joint launch cuts for half the rows.)
    A call without variant= launches it (`default_variant`)."""
    from kvqbench.kernels.cuda import library

    J = cuda_hqmq.JOINT_VARIANT
    pair = cuda_hqmq.DEFAULT_VARIANT_MED3 if "med3" in spec else cuda_hqmq.DEFAULT_VARIANT
    with library.FUSED_COMBINE.set(fused):
        joint = check(3, 2 * gqa, 2, T, seed=gqa + T, spec=spec, variant=J)[0]
        default = check(3, 2 * gqa, 2, T, seed=gqa + T, spec=spec)[0]
        assert torch.equal(joint, default), f"{spec} gqa {gqa} T {T}: the default is not variant {J}"
        for ns in (1, 3):
            one = check(3, 2 * gqa, 2, T, seed=gqa + T, spec=spec, variant=J, num_splits=ns)[0]
            two = check(3, 2 * gqa, 2, T, seed=gqa + T, spec=spec, variant=pair, num_splits=ns)[0]
            assert torch.equal(one, two), f"{spec} gqa {gqa} T {T} splits {ns}: {(one - two).abs().max()}"


def test_joint_variant_refuses_what_it_does_not_run():
    """Any machine: variant 12 names what it needs (a group of 10..16, head dim 128; Med3x or
    not, 12-bit or mixed rows), is the default exactly there, and cuts its splits for one CTA
    per kv row."""
    from kvqbench.kernels import common

    J, plain, med3 = cuda_hqmq.JOINT_VARIANT, cuda_hqmq.DEFAULT_VARIANT, cuda_hqmq.DEFAULT_VARIANT_MED3
    cuda_hqmq.joint_refusal(2, 128)  # (takes it: Med3x or not, 12-bit or mixed rows)
    for med in (False, True):  # (and the calls it takes launch it)
        assert cuda_hqmq.default_variant(2, 128, med) == J, med
    for args, want in (((1, 128, False), plain), ((2, 64, False), plain), ((2, 256, True), med3),
                       ((1, 128, True), med3), ((0, 128, False), plain)):
        assert cuda_hqmq.default_variant(*args) == want, args
    for args, word in (((1, 128), "GQA group"), ((2, 64), "head_dim 128"), ((2, 256), "head_dim 128")):
        with pytest.raises(ValueError, match=word):
            cuda_hqmq.joint_refusal(*args)
    fk = encoded(1, 2, 4096, 0)[0]
    old = common.ASSUMED_SM_COUNT
    try:
        common.ASSUMED_SM_COUNT = 132
        cpu = torch.device("cpu")
        J = cuda_hqmq.JOINT_VARIANT
        assert cuda_hqmq._token_splits(fk, cpu, None, 1, J, 2) == cuda_hqmq._token_splits(fk, cpu, None, 1, 3, 1)
        assert cuda_hqmq._token_splits(fk, cpu, None, 1, 3, 2) != cuda_hqmq._token_splits(fk, cpu, None, 1, 3, 1)
    finally:
        common.ASSUMED_SM_COUNT = old


@needs_cuda
def test_variants_and_splits():
    for variant in cuda_hqmq.variants(128):
        for ns in (1, 3, None, 10_000):
            check(2, 8, 2, 1500, seed=1, variant=variant, num_splits=ns)  # one encoding (cached)


@needs_cuda
def test_fill_S170_and_codebook_tables():
    """S=170 (fill: the large-table instance), and a flat that already carries the fp16
    codebook (used as is) or the fp32 codebook (rebuilt in fp16)."""
    check(1, 8, 2, 999, spec="hqmq:S=96,r=4,fill=true", seed=5)
    check(1, 8, 2, 999, seed=6, flat_kw={"mode": "codebook", "dtype": torch.float16})
    check(1, 8, 2, 999, seed=6, flat_kw={"mode": "codebook", "dtype": torch.float32})


def med3_variants():
    """The Med3x tests' variants: the default one (None), the direct path (v0) and the
    prefetching ones (cuda_hqmq.PREFETCH_VARIANTS), each once."""
    others = (0,) + tuple(cuda_hqmq.PREFETCH_VARIANTS)
    return (None,) + tuple(v for v in others if v != cuda_hqmq.DEFAULT_VARIANT_MED3)


def _with_capacity(flat, extra, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = dataclasses.replace(flat, **{n: with_junk(getattr(flat, n), extra, g) for n in ("codes", "radius", "r_max")})
    if flat.has_outliers:  # garbage flags past T (they must not count), a longer list and index
        out.flags = with_junk(flat.flags, extra, g)
        out.outliers = with_junk(flat.outliers, extra, g)
        nblk = -(-out.codes.shape[2] // L.OUTLIER_BLOCK)
        idx = flat.outlier_index
        out.outlier_index = torch.cat([idx, idx[:, :, -1:].expand(-1, -1, nblk - idx.shape[2])], 2).contiguous()
    return out


@needs_cuda
@pytest.mark.parametrize("T", [77, 1037])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_capacity_beyond_valid_length(T, view, spec):
    """Garbage (NaN, inf) after T in every buffer, whole buffers or [:, :, :n] views: only
    the valid tokens count (r_max is read through a 16-byte window that may cover some)."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv = 3, 16, 4
    fk, fv, kd, vd = encoded(B, Hkv, T, 5, spec)
    q = query(B, Hq, 7)
    kf, vf = _with_capacity(fk, 300), _with_capacity(fv, 300, seed=1)
    if view:
        names = ("codes", "radius", "r_max") + (("flags",) if kf.has_outliers else ())
        kf = dataclasses.replace(kf, **{n: getattr(kf, n)[:, :, : T + 101] for n in names})
        vf = dataclasses.replace(vf, **{n: getattr(vf, n)[:, :, : T + 101] for n in names})
        assert not kf.codes.is_contiguous()
    ref = reference_decode_attention(q, kd, vd)
    for variant in med3_variants() if spec == MED3 else (None,):
        for ns in (None, 3):
            out = attend(q, kf, vf, num_splits=ns, variant=variant)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < TOL[torch.float16], f"variant {variant} splits {ns}"


@needs_cuda
@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("T", [16, 4099])
def test_last_token_matters(role, T):
    check_last_token(lambda q, k, v: checked_call(SPEC, q, k, v, num_splits=3)[:2], role, T)


@needs_cuda
def test_agrees_with_triton_and_auto_routing():
    """CUDA and Triton agree; backend="auto" takes CUDA only if cuda_hqmq.AUTO (and the
    call is supported), Med3x stays on Triton."""
    from kvqbench.kernels.decode_attention import decode_attention

    # fp16 q, as hqmq_bench.py: the same Triton specialisations (compiled once per GPU call)
    q, k, v = auto_case(torch.float16)
    kf, vf = flats(SPEC, k, v)
    cuda = decode_attention(q, kf, vf, backend="cuda").float()
    tri = decode_attention(q, kf, vf, backend="triton").float()
    auto = decode_attention(q, kf, vf).float()
    # two approximations of the reference (fp16 codebook here, fp32 secondaries in Triton),
    # each within 3e-3 of it: run 16 measured 1.8e-3 / 2.0e-3 between them at the bench shapes
    assert rel_err(cuda, tri) < 5e-3
    assert torch.equal(auto, cuda if cuda_hqmq.AUTO else tri)
    kf3, vf3 = flats(MED3, k, v)
    assert cuda_hqmq.unsupported(q, kf3, vf3) is None
    cuda3 = decode_attention(q, kf3, vf3, backend="cuda").float()
    tri3 = decode_attention(q, kf3, vf3, backend="triton").float()
    assert rel_err(cuda3, tri3) < 5e-3
    auto3 = decode_attention(q, kf3, vf3).float()
    assert torch.equal(auto3, cuda3 if cuda_hqmq.AUTO and cuda_hqmq.AUTO_MED3 else tri3)


@needs_cuda
def test_long_context():
    """T = 131072 (4096 encoded tokens tiled 32 times) and an odd valid length below it
    (131069: the last tile partial, the capacity beyond it real data)."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    fk, fv, kd, vd = encoded(1, 8, 4096, 31)
    kf, vf = fk.tile(1, 32), fv.tile(1, 32)
    kd, vd = kd.repeat(1, 1, 32, 1), vd.repeat(1, 1, 32, 1)
    q = query(1, 32, 4, torch.bfloat16)
    for T in (131072, 131069):
        out = attend(q, dataclasses.replace(kf, T=T), dataclasses.replace(vf, T=T))
        err = rel_err(out, reference_decode_attention(q, kd[:, :, :T], vd[:, :, :T]))
        assert err < TOL[torch.bfloat16], f"T={T}: relative error {err:.3g}"


@needs_cuda
def test_cuda_graph_replay():
    check_graph_replay(SPEC, backend="cuda")


# ---------------------------------------------------------------------------------------
# Med3x: outlier chunks stored aside (flags, per-(b, h) lists, 64-token block starts)
# ---------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("T", [1, 33, 1000, 4099])
@pytest.mark.parametrize("B,dtype", [(1, torch.float16), (3, torch.bfloat16)])
def test_med3_matches_reference(T, B, dtype):
    for variant in med3_variants():  # one encoding (cached)
        check(B, 32, 8, T, dtype, seed=T, spec=MED3, variant=variant)


@needs_cuda
def test_med3_fp32_q():
    for variant in med3_variants():
        check(2, 32, 8, 100, torch.float32, seed=100, spec=MED3, variant=variant)


@needs_cuda
def test_med3_variants_splits_gqa():
    """Every variant with an outlier path x split counts (a split starts on a 64-token
    block: 3 and 10000 splits round up), GQA 1 and 8; the others refuse a Med3x cache."""
    for variant in cuda_hqmq.MED3_VARIANTS:
        for ns in (1, 3, None, 10_000):
            check(2, 8, 2, 1500, seed=2, spec=MED3, variant=variant, num_splits=ns)
    for gqa in (1, 8):
        for variant in med3_variants():
            check(2, 2 * gqa, 2, 777, seed=3, spec=MED3, variant=variant)
    fk, fv, _, _ = encoded(2, 2, 1500, 2, MED3)
    bad = next(v for v in range(cuda_hqmq.NUM_VARIANTS) if v not in cuda_hqmq.MED3_VARIANTS)
    with pytest.raises(ValueError, match="Med3x"):
        cuda_hqmq.decode(query(2, 8, 1), fk, fv, variant=bad)


@needs_cuda
def test_med3_long_context():
    """T = 131072 (4096 tokens tiled 32 times: the index follows) and 131069."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    fk, fv, kd, vd = encoded(1, 8, 4096, 33, MED3)
    kf, vf = fk.tile(1, 32), fv.tile(1, 32)
    kd, vd = kd.repeat(1, 1, 32, 1), vd.repeat(1, 1, 32, 1)
    q = query(1, 32, 34)
    for T in (131072, 131069):
        ref = reference_decode_attention(q, kd[:, :, :T], vd[:, :, :T])
        for variant in med3_variants():
            out = attend(q, dataclasses.replace(kf, T=T), dataclasses.replace(vf, T=T), variant=variant)
            err = rel_err(out, ref)
            assert err < TOL[torch.float16], f"T={T} variant {variant}: relative error {err:.3g}"


@needs_cuda
@pytest.mark.parametrize("role", ["K", "V"])
def test_med3_last_token_matters(role):
    """The last token made an outlier everywhere (x 40): the output follows the reference."""
    for variant in med3_variants():
        def run(q, k, v, variant=variant):
            return checked_call(MED3, q, k, v, num_splits=3, variant=variant)[:2]

        check_last_token(run, role, 4099, v_outlier=True, v_gain=-40.0)


def _dense_outliers(B, Hkv, T, seed, lo, hi, D=128):
    """make()'s cache with up to 9 more large channels (x 25, one per 4-dim chunk 2, 5, ..,
    26; at D = 64 chunks 2 .. 14) on tokens lo .. hi-1 only: there a 16-token tile holds >
    128 outlier chunks of K and V together (the prefetch buffer's OCAP: those tiles read
    their outliers from global memory), elsewhere ~80 (from the buffer), and tiles
    straddling lo / hi mix both."""
    x = make(B, Hkv, T, D, seed).float()
    for c in range(min(9, D // 12)):
        x[:, :, lo:hi, 4 * (3 * c + 2) + 1] *= 25.0
    return x.half()


def _outliers_per_tile(f, T):
    """Outlier chunks per whole 16-token tile of a Med3x flat: [B, H, T // 16]."""
    fl = f.flags[:, :, : T // 16 * 16].long()
    n = sum(((fl >> b) & 1).sum(-1) for b in range(8))  # 4 flag bytes per token
    return n.reshape(n.shape[0], n.shape[1], -1, 16).sum(-1)


@needs_cuda
def test_med3_prefetch_overflow_and_agreement():
    """Dense outliers on part of the cache (tiles over and under the prefetch buffer's
    capacity, in K and V): every Med3x variant follows the reference, at several split
    counts and a partial last tile; the prefetching variants give what the direct path
    does on the same split (v9 has v2's shape: same splits, same tile order)."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv, T = 2, 16, 4, 1237
    k, v = _dense_outliers(B, Hkv, T, 51, 200, 700), _dense_outliers(B, Hkv, T, 52, 450, 1000)
    qk, pk, qv, pv = build(MED3, k, v)
    fk, fv = L.flatten(pk, "K"), L.flatten(pv, "V")
    both = _outliers_per_tile(fk, T) + _outliers_per_tile(fv, T)
    assert (both > 128).any() and (both <= 128).any()  # the data has both kinds of tile
    q = query(B, Hq, 53)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    for variant in cuda_hqmq.MED3_VARIANTS:
        for ns in (1, 3, None):
            out = attend(q, fk, fv, num_splits=ns, variant=variant)
            assert torch.isfinite(out).all()
            err = rel_err(out, ref)
            assert err < TOL[torch.float16], f"variant {variant} splits {ns}: relative error {err:.3g}"
    for ns in (1, 3):
        direct = attend(q, fk, fv, num_splits=ns, variant=2)
        assert rel_err(attend(q, fk, fv, num_splits=ns, variant=9), direct) < 1e-5, f"splits {ns}"


# ---------------------------------------------------------------------------------------
# device-side valid length (valid_len): one captured graph serves every decode step
# ---------------------------------------------------------------------------------------
def _vl(n):
    return torch.tensor([n], dtype=torch.int32, device=DEV)


def _valid_len_sweep(q, fk, fv, kd, vd, ns, variant, lens):
    """One valid_len sweep (test_valid_len_below_capacity, test_head_dims_valid_len_below_capacity):
    for each n of lens, decode with valid_len=n against the reference over the first n tokens
    (finite, relative error under TOL); then n = 0 gives zeros."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    for n in lens:
        out = cuda_hqmq.decode(q, fk, fv, num_splits=ns, out_dtype=torch.float32, valid_len=_vl(n),
                               variant=variant)
        ref = reference_decode_attention(q, kd[:, :, :n], vd[:, :, :n])
        assert torch.isfinite(out).all(), f"n={n} variant {variant}"
        err = rel_err(out, ref)
        assert err < TOL[torch.float16], f"n={n} splits={ns} variant {variant}: relative error {err:.3g}"
    out = cuda_hqmq.decode(q, fk, fv, num_splits=ns, out_dtype=torch.float32, valid_len=_vl(0), variant=variant)
    assert torch.equal(out, torch.zeros_like(out))


@needs_cuda
def test_valid_len_equal_to_T_is_the_plain_call():
    fk, fv, _, _ = encoded(2, 8, 1999, 41)
    q = query(2, 32, 42)
    for ns in (None, 7):
        plain = cuda_hqmq.decode(q, fk, fv, num_splits=ns, out_dtype=torch.float32)
        assert torch.equal(cuda_hqmq.decode(q, fk, fv, num_splits=ns, out_dtype=torch.float32, valid_len=_vl(1999)),
                           plain)
        # above the capacity: clamped to it
        assert torch.equal(cuda_hqmq.decode(q, fk, fv, num_splits=ns, out_dtype=torch.float32, valid_len=_vl(5000)),
                           plain)


@needs_cuda
@pytest.mark.parametrize("ns", [None, 1, 12])
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_valid_len_below_capacity(ns, spec):
    """Only the first n tokens count (the rest of the capacity is real data that would
    change the result); with 12 splits most CTAs are empty for small n (rows partly
    empty: their m = -inf partials weigh 0); n = 0 empties every split (zeros)."""
    cap = 2077
    fk, fv, kd, vd = encoded(2, 8, cap, 43, spec)
    q = query(2, 32, 44)
    for variant in med3_variants() if spec == MED3 else (None,):
        _valid_len_sweep(q, fk, fv, kd, vd, ns, variant, (1, 15, 16, 17, 200, 1000, cap - 1))


@needs_cuda
def test_valid_len_graph_replay():
    """Captured once with valid_len and a workspace (no allocation, no sync inside), then
    replayed after device-side changes of the valid length and of q: each replay equals
    the eager call and the reference over the first n tokens."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    cap = 3000
    fk, fv, kd, vd = encoded(1, 8, cap, 45)
    q = query(1, 32, 46)
    vl = _vl(1000)
    ws = cuda_hqmq.workspace(q, fk, out_dtype=torch.float32)
    graph, out = warmed_capture(lambda: cuda_hqmq.decode(q, fk, fv, workspace=ws, out_dtype=torch.float32,
                                                         valid_len=vl))
    assert out.data_ptr() == ws.out.data_ptr()
    for step, n in enumerate((1000, 2999, 17, cap)):
        vl.fill_(n)  # on the device: the graph reads it at replay
        q.copy_(query(1, 32, 100 + step))
        graph.replay()
        eager = cuda_hqmq.decode(q, fk, fv, out_dtype=torch.float32, valid_len=_vl(n))
        assert torch.equal(out, eager), f"n={n}"
        err = rel_err(out, reference_decode_attention(q, kd[:, :, :n], vd[:, :, :n]))
        assert err < TOL[torch.float16], f"n={n}: relative error {err:.3g}"


@needs_cuda
def test_valid_len_argument_checks():
    fk, fv, _, _ = encoded(1, 8, 64, 47)
    q = query(1, 32, 48)
    for bad in (torch.tensor([5], device=DEV), torch.tensor([5, 6], dtype=torch.int32, device=DEV),
                torch.tensor([5], dtype=torch.int32)):
        with pytest.raises(ValueError, match="valid_len"):
            cuda_hqmq.decode(q, fk, fv, valid_len=bad)


# ---------------------------------------------------------------------------------------
# dispatch (any machine)
# ---------------------------------------------------------------------------------------
def test_unsupported_names_a_reason():
    k = torch.randn(1, 2, 40, 96)
    f = L.flatten(get_quantizer(SPEC, role="K").encode(k))
    q = torch.randn(1, 4, 1, 96)
    assert "CUDA" in cuda_hqmq.unsupported(q, f, f)  # a CPU q
    assert "head_dim 96" in cuda_hqmq._flat_reason(f)
    if CUDA:
        fd = L.flatten(get_quantizer(SPEC, role="K").encode(k.to(DEV)))
        assert "head_dim" in cuda_hqmq.unsupported(q.to(DEV), fd, fd)


def test_why_unavailable_is_a_reason_or_none():
    why = cuda_hqmq.why_unavailable()
    assert why is None or (isinstance(why, str) and why)
    if not CUDA:
        assert why is not None


def test_default_splits_fill_whole_waves(monkeypatch):
    """The default split rule: the fewest whole waves of occupancy x SMs CTAs filled to at
    least FILL; every split non-empty; the old rule when the occupancy is unknown."""
    monkeypatch.setattr(cuda_hqmq, "sm_count", lambda device: 132)
    monkeypatch.setattr(cuda_hqmq, "occupancy", lambda variant=0, S=96, med3=False, head_dim=128, cw=8, mix=False: 3)
    dev = torch.device("cuda")
    assert cuda_hqmq.splits(64, 32768, dev) == (6, 342)  # B=8: 384 of 396 slots
    assert cuda_hqmq.splits(8, 32768, dev) == (49, 42)  # B=1: 392 of 396
    assert cuda_hqmq.splits(256, 32768, dev)[0] == 3  # 768 of 2 waves' 792 (1 split: 65% of one)
    assert cuda_hqmq.splits(512, 32768, dev)[0] == 3  # 1536 of 4 waves' 1584
    assert cuda_hqmq.splits(8, 20, dev) == (2, 1)  # no more splits than tiles
    assert cuda_hqmq.splits(64, 32768, dev, num_splits=9) == (9, 228)
    for rows in (1, 7, 64, 300, 5000):
        for T in (1, 17, 4099, 131072):
            ns, per = cuda_hqmq.splits(rows, T, dev)
            tiles = -(-T // 16)
            assert ns * per >= tiles and (ns - 1) * per < tiles
    assert cuda_hqmq.splits(64, 32768, dev, med3=True) == (6, 344)  # Med3x: whole 64-token blocks
    assert cuda_hqmq.splits(8, 20, dev, med3=True) == (1, 4)
    for ns in (1, 3, 7, 10_000):
        n, per = cuda_hqmq.splits(8, 4099, dev, num_splits=ns, med3=True)
        assert per % 4 == 0 and n * per >= 257 and (n - 1) * per < 257
    monkeypatch.setattr(cuda_hqmq, "occupancy", lambda variant=0, S=96, med3=False, head_dim=128, cw=8, mix=False: -1)
    assert cuda_hqmq.splits(64, 32768, dev) == (32, 64)  # max(2048 / 64 tiles, 2 x 132 / 64)


def test_codebook_cache_takes_inference_tensors():
    """Secondaries made under inference_mode (a store filled there) have no version
    counter: the fp16 codebook is still built once and cached, and follows an in-place
    change of ordinary secondaries."""
    k = torch.randn(1, 2, 8, 128)
    with torch.inference_mode():
        f = L.flatten(get_quantizer(SPEC, role="K").encode(k))
    assert f.sec.is_inference()
    t = cuda_hqmq.codebook16(f)
    assert t.dtype == torch.float16 and t.shape == (2, 24 * 96, 4)
    assert cuda_hqmq.codebook16(f) is t
    g = dataclasses.replace(f, sec=f.sec.clone())  # an ordinary tensor
    t2 = cuda_hqmq.codebook16(g)
    g.sec.mul_(-1)
    t3 = cuda_hqmq.codebook16(g)
    assert t3 is not t2 and torch.equal(t3, -t2)


def test_cpu_dispatch_stays_on_triton():
    """Off the GPU, HQMQ with backend auto is the Triton kernel; backend cuda refuses."""
    if CUDA:
        pytest.skip("CPU-only check")
    from kvqbench.kernels.decode_attention import decode_attention

    k = torch.randn(1, 2, 8, 64)
    f = L.flatten(get_quantizer(SPEC, role="K").encode(k))
    with pytest.raises(ValueError, match="CUDA"):
        decode_attention(torch.randn(1, 4, 1, 64), f, f, backend="cuda")


# ---------------------------------------------------------------------------------------
# head dims 64 and 256 (issue 28), with and without Med3x (at 64 / 256 through the
# prefetching variants): T = 1, odd, larger and 131072, the last key / value, GQA 1, 2, 8,
# every variant the head dim has, capacity garbage, valid_len, dense outliers. backend="cuda"
# (the auto route waits for AUTO_HEAD_DIMS).
# ---------------------------------------------------------------------------------------
NEW_DIMS = [64, 256]


def head_variants(D, spec):
    """The Med3x tests' variants at head dim D (None: the default) or the plain ones."""
    return (None,) + tuple(cuda_hqmq.variants(D, "med3" in spec))


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
@pytest.mark.parametrize("T", [1, 333, 4099])
@pytest.mark.parametrize("B,dtype", [(1, torch.float16), (3, torch.bfloat16), (2, torch.float32)])
def test_head_dims_match_reference(D, spec, T, B, dtype):
    for variant in (None,) + (tuple(cuda_hqmq.PREFETCH_VARIANTS) if spec == MED3 else ()):
        check(B, 32, 8, T, dtype, seed=T, spec=spec, D=D, variant=variant)


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
@pytest.mark.parametrize("gqa", [1, 2, 8, 16])
def test_head_dims_gqa(D, spec, gqa):
    check(2, 2 * gqa, 2, 777, seed=gqa, spec=spec, D=D)


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("T", [16, 4099])
def test_head_dims_last_token_matters(D, spec, role, T):
    med3 = spec == MED3

    def run(q, k, v):
        return checked_call(spec, q, k, v, num_splits=3)[:2]

    check_last_token(run, role, T, v_outlier=med3, v_gain=-40.0 if med3 else -8.0, D=D)


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_head_dims_variants_and_splits(D, spec):
    """Every variant with an instance at D (cuda_hqmq.variants: at 256 warp pairs, 2 to 8 per
    CTA) x split counts; the others are refused with the reason; S=170 (the large tables)."""
    failed = []
    for variant in cuda_hqmq.variants(D, spec == MED3):
        for ns in (1, 3, None, 10_000):
            try:
                check(2, 8, 2, 1500, seed=1, spec=spec, D=D, variant=variant, num_splits=ns)
            except AssertionError as e:
                failed.append(f"variant {variant} splits {ns}: {str(e).splitlines()[0]}")
    assert not failed, "\n".join(failed)
    fk, fv, _, _ = encoded(2, 2, 1500, 1, spec, D)
    for bad in (v for v in range(cuda_hqmq.NUM_VARIANTS) if v not in cuda_hqmq.variants(D, spec == MED3)):
        with pytest.raises(ValueError, match="instance"):
            cuda_hqmq.decode(query(2, 8, 1, D=D), fk, fv, variant=bad)
    check(1, 8, 2, 999, spec=spec.replace("S=96", "S=96,fill=true") if spec == SPEC else spec, seed=5, D=D)


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_head_dims_capacity_beyond_valid_length(D, view, spec):
    """Garbage (NaN, inf) after T in every buffer (flags included), whole or [:, :, :n] views."""
    B, Hq, Hkv, T = 3, 16, 4, 1037
    fk, fv, kd, vd = encoded(B, Hkv, T, 5, spec, D)
    q = query(B, Hq, 7, D=D)
    for extra in (300, 301):  # odd and even capacities (at D = 64 a Med3x row then starts 2 bytes off)
        kf, vf = _with_capacity(fk, extra), _with_capacity(fv, extra, seed=1)
        if view:
            names = ("codes", "radius", "r_max") + (("flags",) if kf.has_outliers else ())
            kf = dataclasses.replace(kf, **{n: getattr(kf, n)[:, :, : T + 101] for n in names})
            vf = dataclasses.replace(vf, **{n: getattr(vf, n)[:, :, : T + 101] for n in names})
        _attend_all(q, kf, vf, kd, vd, D, spec)


def _attend_all(q, kf, vf, kd, vd, D, spec):
    from kvqbench.kernels.decode_attention import reference_decode_attention

    ref = reference_decode_attention(q, kd, vd)
    for variant in head_variants(D, spec):
        for ns in (None, 3):
            out = attend(q, kf, vf, num_splits=ns, variant=variant)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < TOL[torch.float16], f"variant {variant} splits {ns}"


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_head_dims_valid_len_below_capacity(D, spec):
    """A device valid count n below the capacity (real data after it): the reference over n;
    n = 0 gives zeros."""
    cap = 2077
    fk, fv, kd, vd = encoded(2, 8, cap, 43, spec, D)
    q = query(2, 32, 44, D=D)
    for variant in head_variants(D, spec):
        for ns in (None, 12):
            _valid_len_sweep(q, fk, fv, kd, vd, ns, variant, (1, 15, 16, 17, 1000, cap - 1))


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_head_dims_long_context(D, spec):
    """T = 131072 (4096 encoded tokens tiled 32 times) and 131069."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    fk, fv, kd, vd = encoded(1, 8, 4096, 31, spec, D)
    kf, vf = fk.tile(1, 32), fv.tile(1, 32)
    kd, vd = kd.repeat(1, 1, 32, 1), vd.repeat(1, 1, 32, 1)
    q = query(1, 32, 4, torch.bfloat16, D)
    for T in (131072, 131069):
        ref = reference_decode_attention(q, kd[:, :, :T], vd[:, :, :T])
        out = attend(q, dataclasses.replace(kf, T=T), dataclasses.replace(vf, T=T))
        err = rel_err(out, ref)
        assert err < TOL[torch.bfloat16], f"D={D} T={T}: relative error {err:.3g}"


@needs_cuda
@pytest.mark.parametrize("D", NEW_DIMS)
def test_head_dims_med3_prefetch_overflow(D):
    """Dense outliers on part of the cache: tiles over and under the prefetch buffer's
    capacity (items read from global memory / from the buffer) follow the reference."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    B, Hq, Hkv, T = 2, 16, 4, 1237
    k, v = _dense_outliers(B, Hkv, T, 51, 200, 700, D), _dense_outliers(B, Hkv, T, 52, 450, 1000, D)
    qk, pk, qv, pv = build(MED3, k, v)
    fk, fv = L.flatten(pk, "K"), L.flatten(pv, "V")
    both = _outliers_per_tile(fk, T) + _outliers_per_tile(fv, T)
    assert (both > 128).any() and (both <= 128).any()
    q = query(B, Hq, 53, D=D)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    for variant in cuda_hqmq.variants(D, True):
        for ns in (1, 3, None):
            out = attend(q, fk, fv, num_splits=ns, variant=variant)
            assert torch.isfinite(out).all()
            err = rel_err(out, ref)
            assert err < TOL[torch.float16], f"D={D} variant {variant} splits {ns}: relative error {err:.3g}"


def test_head_dims_taken_and_auto_gated():
    """Any machine: 64 / 128 / 256 are taken by the flat rule, others named; Med3x at 64 /
    256 has the prefetching variants only; auto waits for AUTO_HEAD_DIMS; the softmax scale
    follows the head dim."""
    import math

    for D in (64, 256):
        f = L.flatten(get_quantizer(SPEC, role="K").encode(torch.randn(1, 2, 40, D)))
        assert cuda_hqmq.head_dim_reason(D) is None
        why = cuda_hqmq._flat_reason(f)
        assert why is None or "head_dim" not in why, why  # (CPU buffers: "not on a CUDA device")
        assert (cuda_hqmq.auto_refusal(f) is None) == (D in cuda_hqmq.AUTO_HEAD_DIMS and cuda_hqmq.AUTO)
        assert cuda_hqmq.variants(D, True) == cuda_hqmq.PREFETCH_VARIANTS
    assert cuda_hqmq.variants(256) == cuda_hqmq.variants(64) == tuple(range(cuda_hqmq.NUM_VARIANTS))
    assert cuda_hqmq.variants(128, True) == cuda_hqmq.MED3_VARIANTS
    for D in (64, 128, 256):
        assert cuda_hqmq.qk_scale(D) == pytest.approx(1 / (math.sqrt(D) * math.log(2)))


# ---------------------------------------------------------------------------------------
# the planned host path (cuda_hqmq.PLANNED, issue 28 "thin host path"): a plan per call
# layout, one ctypes call per decode. The GPU tests hold it to the per-call path bit for bit
# (the same kernels with the same arguments: any difference is a misplaced field); the CPU
# tests check the plan cache's keying and invalidation with the build stubbed.
# ---------------------------------------------------------------------------------------
def _both(monkeypatch, q, k, v, **kw):
    """(the per-call path's result, the planned path's result) of one call, cloned."""
    monkeypatch.setattr(cuda_hqmq, "PLANNED", False)
    old = cuda_hqmq.decode(q, k, v, **kw).clone()
    monkeypatch.setattr(cuda_hqmq, "PLANNED", True)
    new = cuda_hqmq.decode(q, k, v, **kw).clone()
    return old, new


@needs_cuda
@pytest.mark.parametrize("D", cuda_hqmq.HEAD_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
@pytest.mark.parametrize("B", [1, 8])
def test_planned_path_is_the_per_call_path(monkeypatch, D, spec, B):
    """Every head dim, with and without Med3x, B 1 and 8, GQA groups 1 / 2 / 8, valid_len
    absent, below T and at T; each planned call twice (made, then kept)."""
    T = 333
    fk, fv, _, _ = encoded(B, 2, T, 60 + D, spec, D)
    for gqa in (1, 2, 8):
        q = query(B, 2 * gqa, 61 + gqa, D=D)
        for vl in (None, _vl(T - 100), _vl(T)):
            for _ in range(2):
                old, new = _both(monkeypatch, q, fk, fv, valid_len=vl)
                assert torch.isfinite(old).all()
                assert torch.equal(old, new), f"D={D} {spec} B={B} gqa={gqa} valid_len={vl}"


@needs_cuda
@pytest.mark.parametrize("D", cuda_hqmq.HEAD_DIMS)
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_planned_path_variants_splits_dtypes_workspace(monkeypatch, D, spec):
    """Every variant the head dim has (Med3x: its Med3x ones), default and 3 splits, q and
    out dtypes: bit-identical; a fitting workspace's out buffer is the result on both paths,
    a workspace that does not fit is replaced by fresh buffers on both."""
    fk, fv, _, _ = encoded(2, 2, 1037, 62, spec, D)
    q = query(2, 8, 63, D=D)
    for variant in head_variants(D, spec):
        if variant is not None and cuda_hqmq.occupancy(variant, fk.S, fk.has_outliers, D) <= 0:
            continue
        for ns in (None, 3):
            for dt in (None, torch.float32):
                old, new = _both(monkeypatch, q, fk, fv, variant=variant, num_splits=ns, out_dtype=dt)
                assert torch.equal(old, new), f"D={D} {spec} variant {variant} splits {ns} out {dt}"
    qb = query(2, 8, 64, torch.bfloat16, D=D)
    old, new = _both(monkeypatch, qb, fk, fv)
    assert torch.equal(old, new)
    ws = cuda_hqmq.workspace(q, fk, out_dtype=torch.float32)
    for planned in (False, True):
        monkeypatch.setattr(cuda_hqmq, "PLANNED", planned)
        out = cuda_hqmq.decode(q, fk, fv, workspace=ws, out_dtype=torch.float32)
        assert out.data_ptr() == ws.out.data_ptr() and out.shape == (2, 8, 1, D)
        other = cuda_hqmq.decode(q, fk, fv, workspace=ws, num_splits=1, out_dtype=torch.float32)  # does not fit
        assert other.data_ptr() != ws.out.data_ptr()
    old, new = _both(monkeypatch, q, fk, fv, workspace=ws, out_dtype=torch.float32)
    assert torch.equal(old, new)


@needs_cuda
@pytest.mark.parametrize("spec", [SPEC, MED3])
def test_planned_path_reuses_plans_and_follows_the_cache(monkeypatch, spec):
    """A decode step's new flat objects over the same buffers, another q of the same shape,
    another valid_len tensor, the valid length growing (T: the kept plan is retargeted): the
    plan is reused (no build). The cache grown into new buffers, the secondaries written in
    place: a new plan, and the result is the per-call path's on the new state."""
    plans = cuda_hqmq._PLANS
    plans.clear()
    fk, fv, _, _ = encoded(1, 8, 1500, 66, spec)
    q = query(1, 32, 67)
    b0 = plans.builds
    for T in (1000, 1000, 1001, 1001):  # the store's flats of two steps, twice each
        old, new = _both(monkeypatch, q, dataclasses.replace(fk, T=T), dataclasses.replace(fv, T=T))
        assert torch.equal(old, new), f"T={T}"
    assert plans.builds - b0 == 1  # T moved: retargeted, not rebuilt
    k, v = dataclasses.replace(fk, T=1001), dataclasses.replace(fv, T=1001)
    old, new = _both(monkeypatch, query(1, 32, 68), k, v)
    assert torch.equal(old, new) and plans.builds - b0 == 1
    for n in (5, 700, 5):
        old, new = _both(monkeypatch, q, k, v, valid_len=_vl(n))
        assert torch.equal(old, new), f"valid_len {n}"
    assert plans.builds - b0 == 2  # one plan for the calls with a device valid length
    kg, vg = _with_capacity(k, 300), _with_capacity(v, 300, seed=1)  # grown into new buffers
    old, new = _both(monkeypatch, q, kg, vg)
    assert torch.equal(old, new) and plans.builds - b0 == 3
    ks = dataclasses.replace(k, sec=k.sec.clone())
    before = _both(monkeypatch, q, ks, v)[1]
    ks.sec.mul_(-1)  # the codebook follows the secondaries: the plan must not keep the old one
    old, new = _both(monkeypatch, q, ks, v)
    assert torch.equal(old, new) and not torch.equal(new, before)
    assert plans.builds - b0 == 5


@needs_cuda
def test_planned_path_graph_replay(monkeypatch):
    """Captured once through the planned path with valid_len and a workspace, replayed after
    device-side changes: each replay equals the per-call path's eager call bit for bit."""
    cap = 3000
    fk, fv, _, _ = encoded(1, 8, cap, 45, MED3)
    q = query(1, 32, 46)
    vl = _vl(1000)
    ws = cuda_hqmq.workspace(q, fk, out_dtype=torch.float32)
    monkeypatch.setattr(cuda_hqmq, "PLANNED", True)
    graph, out = warmed_capture(lambda: cuda_hqmq.decode(q, fk, fv, workspace=ws, out_dtype=torch.float32,
                                                         valid_len=vl))
    assert out.data_ptr() == ws.out.data_ptr()
    monkeypatch.setattr(cuda_hqmq, "PLANNED", False)
    for step, n in enumerate((1000, 2999, 17, cap)):
        vl.fill_(n)
        q.copy_(query(1, 32, 100 + step))
        graph.replay()
        eager = cuda_hqmq.decode(q, fk, fv, out_dtype=torch.float32, valid_len=_vl(n))
        assert torch.equal(out, eager), f"n={n}"


@needs_cuda
def test_planned_path_errors_are_the_per_call_paths(monkeypatch):
    """Bad input raises the same exception with the same message on both paths, whether
    the call makes a plan or (valid_len) finds one."""
    fk, fv, _, _ = encoded(1, 8, 64, 47)
    mk, mv, _, _ = encoded(1, 8, 64, 47, MED3)
    q = query(1, 32, 48)
    cases = [((q, fk, fv), {"valid_len": torch.tensor([5], device=DEV)}),
             ((q, fk, fv), {"valid_len": torch.tensor([5], dtype=torch.int32)}),
             ((q, fk, fv), {"variant": cuda_hqmq.NUM_VARIANTS}),
             ((q, mk, mv), {"variant": 3}),
             ((q, fk, fv), {"out_dtype": torch.int32}),
             ((q.cpu(), fk, fv), {}),
             ((query(1, 12, 48), fk, fv), {}),
             ((q[:, :, :, :64].contiguous(), fk, fv), {}),
             ((q, fk, dataclasses.replace(fv, T=50)), {}),
             ((q, dataclasses.replace(fk, T=0), dataclasses.replace(fv, T=0)), {}),
             ((q, mk, fv), {}),
             ((q, fk, dataclasses.replace(fv, sec=None)), {})]
    for args, kw in cases:
        seen = []
        for planned in (False, True, True):
            monkeypatch.setattr(cuda_hqmq, "PLANNED", planned)
            with pytest.raises(ValueError) as e:
                cuda_hqmq.decode(*args, **kw)
            seen.append(str(e.value))
        assert seen[0] == seen[1] == seen[2], (kw, seen)
    _both(monkeypatch, q, fk, fv, valid_len=_vl(9))  # a kept plan for valid_len calls
    for bad in (torch.tensor([5], device=DEV), torch.tensor([5, 6], dtype=torch.int32, device=DEV)):
        with pytest.raises(ValueError, match="valid_len must be an int32 tensor of one element on q's device"):
            cuda_hqmq.decode(q, fk, fv, valid_len=bad)


def test_plan_struct_mirrors_the_cu():
    """Any machine: the ctypes mirror of HqmqPlan has the size and offsets the .cu pins by
    static_assert (the library check compares sizes at load)."""
    import re

    src = cuda_hqmq.SOURCE.read_text()
    a = cuda_hqmq._PlanArgs
    assert int(re.search(r"sizeof\(HqmqPlan\) == (\d+)", src).group(1)) == __import__("ctypes").sizeof(a)
    for field, off in re.findall(r"offsetof\(HqmqPlan, (\w+)\) == (\d+)", src):
        assert getattr(a, field).offset == int(off), field
    c_fields = re.search(r"struct HqmqPlan \{(.*?)\n\};", src, re.S).group(1)
    c_names = re.findall(r"\b(\w+)\s*[;,]", re.sub(r"//[^\n]*", "", c_fields))
    assert c_names == [n for n, _ in a._fields_]


def test_plan_cache_keeps_plans_while_their_tensors_live():
    """Any machine: a plan serves while the tensors whose ids its key holds are alive; freeing
    one drops the entry before its id can name another tensor (so a reused id finds nothing);
    None fields are allowed; full caches clear."""
    from kvqbench.kernels.common import PlanCache

    c = PlanCache(limit=3)
    t, u = torch.zeros(3), torch.zeros(3)
    key = lambda *ts: tuple(map(id, ts))  # noqa: E731 (as the callers key: the tensors' ids)
    p = c.put(key(t, None), (t, None), object())
    q = c.put(key(u), (u,), object())
    assert c.get(key(t, None)) is p and c.get(key(u)) is q and c.builds == 2
    old = id(t)
    del t
    # its entry gone (so a tensor later given its id finds nothing), the other kept
    assert c.get((old, id(None))) is None and old not in {k[0] for k in c.plans} and c.get(key(u)) is q
    c.plans.clear()  # (a cleared entry's weak references, and their callbacks, go with it)
    c.put(key(u), (u,), object())
    del u
    assert len(c.plans) == 0  # the new entry, dropped by its own callback
    w = torch.zeros(3)
    for i in range(4):
        c.put(("x", i, id(w)), (w,), object())
    assert len(c.plans) == 1 and c.builds == 7  # cleared when full (3), then the new one kept


def test_plan_keying_and_invalidation(monkeypatch):
    """Any machine, the build stubbed: which changes of a call make a new plan (every input
    the per-call path's checks and arguments derive from, but the token count) and which
    reuse the kept one (another T: retargeted, see test_cuda_plans.py)."""
    from types import SimpleNamespace

    from kvqbench.kernels.common import PlanCache

    built = []
    monkeypatch.setattr(cuda_hqmq, "_PLANS", PlanCache())
    def build(*a):  # (what a retarget reads of a plan: the struct's T and variant, the split options)
        args = cuda_hqmq._PlanArgs()
        args.variant, args.T = cuda_hqmq.DEFAULT_VARIANT, a[1].T
        built.append(a)
        return SimpleNamespace(n=len(built), args=args, splits_asked=a[3:5], nsplit=0)

    monkeypatch.setattr(cuda_hqmq, "_build_plan", build)
    x = torch.randn(2, 2, 40, 128)
    fk = L.flatten(get_quantizer(SPEC, role="K").encode(x), "K")
    fv = L.flatten(get_quantizer(SPEC, role="V").encode(x), "V")
    q = torch.randn(2, 4, 1, 128)

    def plan(q=q, k=fk, v=fv, ns=None, cps=None, variant=None, out_dtype=None, valid_len=None):
        return cuda_hqmq._plan(q, k, v, ns, cps, variant, out_dtype, valid_len)

    p = plan()
    same = [plan(), plan(k=dataclasses.replace(fk), v=dataclasses.replace(fv)), plan(q=torch.randn(2, 4, 1, 128)),
            plan(q=q.clone())]
    assert all(s is p for s in same) and len(built) == 1
    # another token count of the same buffers (an eager decode step): the kept plan, retargeted
    assert plan(k=dataclasses.replace(fk, T=39), v=dataclasses.replace(fv, T=39)) is p and p.args.T == 39
    assert plan() is p and p.args.T == 40 and len(built) == 1
    vl = torch.tensor([3], dtype=torch.int32)
    pv = plan(valid_len=vl)
    assert pv is not p and plan(valid_len=torch.tensor([9], dtype=torch.int32)) is pv
    new = [plan(q=q.half()), plan(q=torch.randn(2, 8, 1, 128)), plan(ns=3), plan(cps=4), plan(variant=0),
           plan(out_dtype=torch.float32), plan(k=dataclasses.replace(fk, codes=fk.codes.clone())),
           plan(v=dataclasses.replace(fv, r_max=fv.r_max.clone())),
           plan(k=dataclasses.replace(fk, table_mode="codebook"))]
    assert len({id(n) for n in new + [p, pv]}) == len(new) + 2 and len(built) == 2 + len(new)
    g = dataclasses.replace(fk, sec=fk.sec.clone())
    pg = plan(k=g)
    assert plan(k=g) is pg
    g.sec.mul_(1.0)  # written in place: the fp16 codebook is rebuilt, so is the plan
    assert plan(k=g) is not pg
    n = len(built)
    assert plan() is p and len(built) == n  # the first layout still kept


def test_planned_call_passes_only_the_per_call_arguments(monkeypatch):
    """Any machine, the plan and the ctypes call stubbed: a planned call passes the plan's
    pointer, q's (contiguous) data, the valid_len and row_start pointers (checked on every
    call, with the per-call path's messages) and the partial / out buffers (a fitting workspace's, else one
    fresh buffer laid out po | pm | pl), and raises on a launch error."""
    from types import SimpleNamespace

    from kvqbench.kernels.common import Workspace

    plan = SimpleNamespace(ptr=1234, nsplit=3, rows_q=8, D=128, shape=(2, 4, 1, 128), out_dtype=torch.float32)
    calls, err = [], [0]
    monkeypatch.setattr(cuda_hqmq, "_plan", lambda *a: plan)
    monkeypatch.setattr(cuda_hqmq, "on_current_stream", lambda dev, entry, *args: calls.append((entry, args)) or err[0])
    monkeypatch.setattr(cuda_hqmq._LIB, "lib", SimpleNamespace(kvq_hqmq_run="run"))
    x = torch.randn(2, 2, 40, 128)
    fk = L.flatten(get_quantizer(SPEC, role="K").encode(x), "K")
    fv = L.flatten(get_quantizer(SPEC, role="V").encode(x), "V")
    q = torch.randn(2, 4, 1, 128)

    def call(q=q, workspace=None, valid_len=None):
        return cuda_hqmq._decode_planned(q, fk, fv, None, None, None, workspace, None, valid_len)

    out = call()
    entry, (ptr, qp, vl, rs, po, pm, pl, optr) = calls[-1]
    assert (entry, ptr, qp, vl, rs) == ("run", 1234, q.data_ptr(), None, None)
    assert out.shape == plan.shape and out.dtype == torch.float32 and optr == out.data_ptr()
    assert (pm - po, pl - pm) == (4 * 8 * 3 * 128, 4 * 8 * 3)
    ws = Workspace(8, 3, 128, q.device, torch.float32)
    out = call(workspace=ws)
    assert calls[-1][1][4:] == (ws.po.data_ptr(), ws.pm.data_ptr(), ws.pl.data_ptr(), ws.out.data_ptr())
    assert out.data_ptr() == ws.out.data_ptr() and out.shape == plan.shape
    call(workspace=Workspace(8, 2, 128, q.device, torch.float32))  # does not fit: fresh buffers
    assert calls[-1][1][4] != ws.po.data_ptr()
    vlen = torch.tensor([7], dtype=torch.int32)
    call(valid_len=vlen)
    assert calls[-1][1][2] == vlen.data_ptr()
    n = len(calls)
    with pytest.raises(ValueError, match="valid_len must be an int32 tensor of one element on q's device"):
        call(valid_len=torch.tensor([7]))
    assert len(calls) == n
    rs = torch.tensor([0, 5], dtype=torch.int32)  # a left-padded batch: the starts' pointer, read on the device
    cuda_hqmq.decode(q, fk, fv, row_start=rs)
    assert calls[-1][1][3] == rs.data_ptr()
    with pytest.raises(ValueError, match="row_start must be int32"):
        cuda_hqmq.decode(q, fk, fv, row_start=rs.long())
    with pytest.raises(ValueError, match=r"row_start must have shape \[B\]"):
        cuda_hqmq.decode(q, fk, fv, row_start=rs[:1])
    assert len(calls) == n + 1
    qt = torch.randn(2, 4, 1, 256)[..., ::2]
    assert not qt.is_contiguous()
    call(q=qt)
    assert calls[-1][1][1] != qt.data_ptr()  # a contiguous copy's
    err[0] = 700
    with pytest.raises(RuntimeError, match="error 700"):
        call()
