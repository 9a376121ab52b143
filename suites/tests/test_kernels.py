"""Triton kernels against their torch references (kvqbench.kernels).

On a machine without CUDA the kernels run under the Triton interpreter
(TRITON_INTERPRET=1, set here before triton is imported): shapes stay tiny and
everything is fp32 there, so the kernels must match the reference to ~1e-6.
On a GPU the dot operands are fp16/bf16 (fp32 accumulation): tolerances follow
the operand precision. The reference is always `Quantizer.decode(packed)` then
plain fp32 softmax attention over ALL keys.

The public kernel benchmark passed causal=True with one query, so it attended to
the first key(s) only; `test_last_token_matters` would have caught that.

(About 530 lines: every Triton decode kernel against one reference, with the store's
capacity contract beside it; split by format it would repeat the helpers in each file.)
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed")

from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.kernels import registry  # noqa: E402
from kvqbench.kernels.cuda import decode_attention as cuda_decode, hqmq_decode as cuda_hqmq  # noqa: E402
from kvqbench.kernels.common import choose_splits, interpreting  # noqa: E402
from kvqbench.kernels.decode_attention import decode_attention, explain_backend, reference_decode_attention  # noqa: E402
from kvqbench.kernels.hqmq_encode import encode_with_kernel, hqmq_search  # noqa: E402
from kvqbench.quantizers import get_quantizer  # noqa: E402
from kvqbench.quantizers.packing import unpack_bits  # noqa: E402
from kvqbench.quantizers.quaternion import hamilton, hurwitz_units  # noqa: E402

pytestmark = pytest.mark.kernels

if not CUDA and not interpreting():
    pytest.skip("no CUDA and TRITON_INTERPRET is off: set TRITON_INTERPRET=1 to run the kernels on CPU",
                allow_module_level=True)

DEV = torch.device("cuda" if CUDA else "cpu")
INTERP = interpreting()


def tol(dtype) -> float:
    if INTERP:
        return 2e-5  # all-fp32 arithmetic, decoded values rounded as the reference rounds them
    return {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_kv(B, H, T, D, kind="random", seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    if kind == "outlier":  # a few large channels, as real keys have (Qwen-style)
        for c in (3, D // 2 + 1, D - 2):
            x[..., c] *= 25.0
    return x.to(dtype).to(DEV)


def make_q(B, Hq, D, seed=1, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, Hq, 1, D, generator=g).to(dtype).to(DEV)


def build(spec, k, v):
    qk, qv = get_quantizer(spec, role="K", seed=3), get_quantizer(spec, role="V", seed=3)
    pk, pv = qk.encode(k), qv.encode(v)
    return (qk, pk), (qv, pv)


def run_kernel(q, pk, pv, table=None, **kw):
    """table: (mode, dtype) of the HQMQ codeword source, else the default (secondaries, fp32)."""
    fl = {"table_mode": table[0], "table_dtype": table[1]} if table else {}
    return decode_attention(q, L.flatten(pk, "K", **fl), L.flatten(pv, "V", **fl), out_dtype=torch.float32, **kw)


def check(q, kq, vq, tolerance=None, **kw):
    (qk, pk), (qv, pv) = kq, vq
    out = run_kernel(q, pk, pv, **kw)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < (tolerance or tol(q.dtype)), f"relative error {err:.3g}"
    return out, ref


SPECS = [
    "hqmq:S=96,r=4",
    "hqmq:S=96,r=4,outliers=med3",
    "int4",
    "kivi:bits=2,residual=16",
    "kivi:bits=4",
    "fp8-e4m3",
    "fp16",
]
CASES = [  # (B, Hq, Hkv, T, D, dtype, data, splits)
    (1, 4, 2, 1, 64, torch.float16, "random", None),
    (2, 4, 1, 37, 128, torch.bfloat16, "outlier", 2),
    (1, 6, 2, 200, 64, torch.float16, "outlier", 3),
]


# ---------------------------------------------------------------------------------------
# HQMQ encode
# ---------------------------------------------------------------------------------------
def _code_scores(u, code, sec, S):
    """<u, P[p] S[s]> in float64 for codes `[B, H, N]`."""
    P = hurwitz_units(torch.float64, device=u.device)
    s = sec.double()
    heads = torch.arange(u.shape[1], device=u.device).view(1, -1, 1)
    cw = hamilton(P[code // S], s[heads, code % S])
    return (u.double() * cw).sum(-1)


def assert_codes_match_up_to_ties(u, got, want, sec, S, max_frac=1e-3):
    diff = got != want
    if diff.any():
        sg, sw = _code_scores(u, got, sec, S), _code_scores(u, want, sec, S)
        gap = (sg - sw).abs()[diff]
        assert float(gap.max()) < 1e-6, f"codes differ beyond ties: score gap {float(gap.max()):.3g}"
        assert diff.float().mean() <= max_frac, f"too many tie flips: {int(diff.sum())}"


@pytest.mark.parametrize("S", [5, 96])
def test_search_matches_torch(S):
    q = get_quantizer(f"hqmq:S={S},r=4", role="K", seed=7)
    B, H, N = 2, 2, 300
    shared = {k: v.to(DEV) for k, v in q.make_shared(H, 8).items()}
    u = torch.randn(B, H, N, 4, generator=torch.Generator().manual_seed(S)).to(DEV)
    u = u / u.norm(dim=-1, keepdim=True)
    u[0, 0, :5] = torch.tensor([1.0, 0, 0, 0], device=DEV)  # zero chunks' direction
    u[1, 1, :3] = torch.tensor([0.5, -0.5, 0.5, 0.5], device=DEV)  # exact 2T elements: ties
    sec = q.secondaries(shared)
    got = hqmq_search(u, sec)
    want = q.search(u, shared)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert int(got.min()) >= 0 and int(got.max()) < 24 * S
    assert_codes_match_up_to_ties(u, got, want, sec, S)


@pytest.mark.parametrize("spec", ["hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3",
                                  "hqmq:S=96,r=4,outliers=med3,radius=log"])
@pytest.mark.parametrize("kind,dtype", [("random", torch.float16), ("outlier", torch.bfloat16)])
def test_encode_fields_match(spec, kind, dtype):
    q = get_quantizer(spec, role="K", seed=11)
    x = make_kv(2, 2, 45, 64, kind, seed=5, dtype=dtype)
    want, got = q.encode(x), encode_with_kernel(q, x)
    assert len(got.segments) == len(want.segments) == 1
    fg, fw = got.segments[0].fields, want.segments[0].fields
    assert fg.keys() == fw.keys()
    for name in fw:
        assert fg[name].dtype == fw[name].dtype and fg[name].shape == fw[name].shape, name
        if name != "codes":
            assert torch.equal(fg[name], fw[name]), name
    if not torch.equal(fg["codes"], fw["codes"]):  # only near-ties may differ
        nc = 16
        cg = unpack_bits(fg["codes"], q.code_bits, nc).flatten(2)
        cw = unpack_bits(fw["codes"], q.code_bits, nc).flatten(2)
        chunks = x.float().reshape(2, 2, -1, 4)
        u = chunks / chunks.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        assert_codes_match_up_to_ties(u, cg, cw, q.secondaries(want.shared), q.config.S)
    if kind == "outlier" and q.med3:
        assert fw["outliers"].shape[0] > 0


# ---------------------------------------------------------------------------------------
# fused decode attention vs reference
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}Hq{c[1]}Hkv{c[2]}T{c[3]}d{c[4]}-{c[6]}")
def test_decode_attention_matches_reference(spec, case):
    B, Hq, Hkv, T, D, dtype, kind, splits = case
    k = make_kv(B, Hkv, T, D, kind, seed=T)
    v = make_kv(B, Hkv, T, D, "random", seed=T + 1)
    q = make_q(B, Hq, D, dtype=dtype)
    (qk, pk), vq = build(spec, k, v)
    if "med3" in spec and kind == "outlier":
        assert pk.segments[0].fields["outliers"].shape[0] > 0
    check(q, (qk, pk), vq, num_splits=splits)


PADDED_SPECS = ["hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3", "hqmq:S=96,r=4,pack=mixed", "int4:group=16",
                "int3:group=16", "kivi:bits=2,group=16,residual=16", "kivi:bits=4,group=16", "fp8-e4m3", "fp16"]


@pytest.mark.parametrize("spec", PADDED_SPECS)
@pytest.mark.parametrize("D,T", [(48, 70), (96, 70), (208, 70), (96, 1)])
def test_head_dims_that_are_not_powers_of_two(spec, D, T):
    """Multiples of 16 such as Phi-3's 96 run padded to the next power of two
    (kernels/triton/common.py `pad_cols`): the padded columns, groups and chunks read no
    byte and write none. 208: 52 HQMQ chunks, so Med3x flag words past 32 bits. 70 tokens
    cross a 64-token outlier block and a KIVI window (and one token alone); two splits. The
    buffers run on past the valid tokens with NaN in their float fields: a padded column
    read past the last token's row would meet the query's zero there and give NaN."""
    B, Hq, Hkv = 1, 4, 2
    k, v = make_kv(B, Hkv, T, D, "outlier", seed=D), make_kv(B, Hkv, T, D, seed=D + 1)
    q = make_q(B, Hq, D)
    (qk, pk), (qv, pv) = build(spec, k, v)
    kf, vf = L.flatten(pk, "K"), L.flatten(pv, "V")
    if not isinstance(kf, L.KIVIFlat):  # (KIVI's capacity: test_capacity_beyond_valid_length)
        kf, vf = _nan_past(_with_capacity(kf, 30), T), _nan_past(_with_capacity(vf, 30, seed=1), T)
    # (on a GPU too: the CUDA kernels take head dims 64, 128 and 256 and say so)
    assert explain_backend(q, kf, vf).backend == "triton"
    why = (cuda_hqmq if isinstance(kf, L.HQMQFlat) else cuda_decode).auto_refusal(kf)
    assert why.startswith("no CUDA") and "not yet run" not in why, why  # not "waits for its GPU tests"
    out = decode_attention(q, kf, vf, out_dtype=torch.float32, num_splits=2)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol(q.dtype), f"relative error {rel_err(out, ref):.3g}"


def test_hqmq_wide_launch_follows_the_table():
    """Past 128 columns HQMQ's Triton default is 64-token tiles of 8 warps only with an fp32
    table (128-token tiles spill there); the engine's fp16 codebook keeps 128 / 4 (timed)."""
    from kvqbench.kernels.formats.hqmq import configure
    from kvqbench.kernels.triton.hqmq import wide_launch
    for D, wide in ((128, False), (208, True), (256, True)):
        (_, pk), _ = build("hqmq:S=24,r=3", make_kv(1, 1, 8, D), make_kv(1, 1, 8, D, seed=1))
        kf = L.flatten(pk, "K")
        assert wide_launch(kf) == wide, D
        assert not wide_launch(configure(kf, ("codebook", torch.float16))), D


@pytest.mark.parametrize("spec", ["hqmq:S=24,r=3,outliers=med3", "int4:group=16", "fp16"])
def test_padded_head_dim_with_a_device_valid_length_and_row_starts(spec):
    """A graphed step's call (a device valid length: the grid cut for the capacity) over a
    left-padded batch (per-row key starts) at head dim 48, one call to the reference."""
    D, T, cap = 48, 50, 90
    k, v = make_kv(2, 2, cap, D, "outlier", seed=3), make_kv(2, 2, cap, D, seed=4)
    (qk, pk), (qv, pv) = build(spec, k, v)
    q = make_q(2, 4, D)
    vl = torch.tensor([T], dtype=torch.int32, device=DEV)
    rs = torch.tensor([0, 17], dtype=torch.int32, device=DEV)
    out = decode_attention(q, L.flatten(pk, "K"), L.flatten(pv, "V"), backend="triton", valid_len=vl, row_start=rs,
                           num_splits=3, out_dtype=torch.float32)
    ref = reference_decode_attention(q, qk.decode(pk)[:, :, :T], qv.decode(pv)[:, :, :T], rs)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol(q.dtype), f"relative error {rel_err(out, ref):.3g}"


def _nan_past(flat, T: int):
    """The flat with NaN in every float token field past its T valid tokens."""
    for name in registry.format_of_flat(type(flat)).token_fields:
        t = getattr(flat, name, None)
        if t is not None and t.dtype.is_floating_point:
            t[:, :, T:] = float("nan")
    return flat


def test_med3_outliers_past_chunk_32():
    """Head dim 256 (Gemma-3): 64 chunks, 8 flag bytes a token. The Triton kernel once read
    them into a 32-bit word, losing or misplacing the outliers of chunks 32-63 (max error 3.9
    against the reference). make_kv's outlier channels 129 and 254 are chunks 32 and 63."""
    D = 256
    k, v = make_kv(1, 2, 100, D, "outlier", seed=7), make_kv(1, 2, 100, D, seed=8)
    kq, vq = build("hqmq:S=24,r=3,outliers=med3", k, v)
    flags = L.flatten(kq[1], "K").flags
    assert flags[..., 4:].any(), "no outlier past chunk 32: the test would not test it"
    check(make_q(1, 4, D), kq, vq, num_splits=2, backend="triton")


@pytest.mark.parametrize("spec", ["hqmq:S=24,r=3,outliers=med3", "hqmq:S=256,r=5,radius=log"])
def test_hqmq_tables_and_other_widths(spec):
    """Every codeword source: secondaries (default) and the full codebook, fp32
    (exact) and fp16 (within an fp16 ulp per codeword); other code widths (10, 13
    bits) and log radius levels."""
    B, Hq, Hkv, T, D = 1, 4, 2, 100, 64
    k, v = make_kv(B, Hkv, T, D, "outlier", seed=21), make_kv(B, Hkv, T, D, seed=22)
    q = make_q(B, Hq, D)
    kq, vq = build(spec, k, v)
    check(q, kq, vq, num_splits=2)
    check(q, kq, vq, num_splits=2, table=("codebook", torch.float32))
    for mode in ("secondaries", "codebook"):
        check(q, kq, vq, num_splits=2, table=(mode, torch.float16), tolerance=max(2e-3, tol(q.dtype)))


@pytest.mark.parametrize("spec", SPECS + ["kivi:bits=4,residual=0"])
@pytest.mark.parametrize("role", ["K", "V"])
def test_last_token_matters(spec, role):
    """Change ONLY the last key (or value): the output must change, and match."""
    B, Hq, Hkv, T, D = 1, 4, 2, 128, 64
    k = make_kv(B, Hkv, T, D, seed=1)
    v = make_kv(B, Hkv, T, D, seed=2)
    q = make_q(B, Hq, D, dtype=torch.float16)
    k2, v2 = k.clone(), v.clone()
    if role == "K":  # the last key aligned with every query of its head: it takes the softmax
        k2[:, :, -1] = (q.float().view(B, Hkv, Hq // Hkv, D).sum(2) * 0.5).to(k.dtype)
    else:
        v2[:, :, -1] = (-8.0 * v[:, :, -1].float()).to(v.dtype)
    out1, _ = check(q, *build(spec, k, v), num_splits=2)
    out2, _ = check(q, *build(spec, k2, v2), num_splits=2)
    assert rel_err(out2, out1) > 1e-3, "output ignores the last token"


def test_first_token_matters():
    B, Hq, Hkv, T, D = 1, 4, 2, 100, 64
    k, v = make_kv(B, Hkv, T, D, seed=1), make_kv(B, Hkv, T, D, seed=2)
    v2 = v.clone()
    v2[:, :, 0] *= -8
    q = make_q(B, Hq, D)
    out1, _ = check(q, *build("hqmq:S=96,r=4", k, v))
    out2, _ = check(q, *build("hqmq:S=96,r=4", k, v2))
    assert rel_err(out2, out1) > 1e-3


def test_hqmq_appended_segments():
    """Prefill, then one-token and odd-length writes (Med3x median per write): the
    layout concatenates segments and rebuilds the outlier index."""
    B, Hq, Hkv, D = 1, 4, 2, 64
    k = make_kv(B, Hkv, 150, D, "outlier", seed=4)
    v = make_kv(B, Hkv, 150, D, "outlier", seed=5)
    q = make_q(B, Hq, D, dtype=torch.bfloat16)
    qk = get_quantizer("hqmq:S=96,r=4,outliers=med3", role="K", seed=1)
    qv = get_quantizer("hqmq:S=96,r=4,outliers=med3", role="V", seed=1)
    pk, pv = qk.encode(k[:, :, :70]), qv.encode(v[:, :, :70])
    for a, b in [(70, 71), (71, 72), (72, 133), (133, 134), (134, 150)]:
        pk, pv = qk.append(pk, k[:, :, a:b]), qv.append(pv, v[:, :, a:b])
    assert len(pk.segments) == 6
    flat = L.flatten(pk)
    assert flat.n_outliers == sum(s.fields["outliers"].shape[0] for s in pk.segments) > 0
    assert "outlier_index" not in pk.segments[0].fields  # derived kernel-side, not stored (issue 13)
    check(q, (qk, pk), (qv, pv), num_splits=2)


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=2,residual=8"])
def test_appended_int_and_kivi(spec):
    B, Hq, Hkv, D = 1, 4, 2, 64
    k, v = make_kv(B, Hkv, 100, D, seed=6), make_kv(B, Hkv, 100, D, seed=7)
    q = make_q(B, Hq, D)
    qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
    pk, pv = qk.encode(k[:, :, :60]), qv.encode(v[:, :, :60])
    for t in range(60, 100, 13):
        pk, pv = qk.append(pk, k[:, :, t:t + 13]), qv.append(pv, v[:, :, t:t + 13])
    check(q, (qk, pk), (qv, pv), num_splits=3)


def test_tile_equals_encoding_the_repeat():
    """HQMQFlat.tile (used by the benchmark) builds what encoding repeated data stores."""
    q = get_quantizer("hqmq:S=24,r=3,outliers=med3", role="K", seed=2)
    x = make_kv(1, 2, 64, 64, "outlier", seed=8)
    big = q.encode(x.repeat(2, 1, 3, 1))  # same multiset per head: same median
    tiled = L.flatten(q.encode(x)).tile(2, 3)
    ref = L.flatten(big)
    for name in ("codes", "radius", "r_max", "flags", "outliers", "outlier_index"):
        assert torch.equal(getattr(tiled, name), getattr(ref, name)), name


def test_tile_int_and_kivi():
    x = make_kv(1, 2, 96, 64, seed=14)
    qi = get_quantizer("int4", role="V")
    ti, ri = L.flatten(qi.encode(x)).tile(2, 3), L.flatten(qi.encode(x.repeat(2, 1, 3, 1)))
    for name in ("codes", "scale", "zero"):
        assert torch.equal(getattr(ti, name), getattr(ri, name)), name
    for role in ("K", "V"):
        qk = get_quantizer("kivi:bits=2,residual=32,window=fixed", role=role)
        xq, xr = x[:, :, :64], x[:, :, 64:]  # two groups of 32, then the window
        tk = L.flatten(qk.encode(x), role).tile(2, 5)
        rk = L.flatten(qk.encode(torch.cat([xq, xq, xq[:, :, :32], xr], 2).repeat(2, 1, 1, 1)), role)
        assert tk.n_groups == rk.n_groups == 5 and tk.T == rk.T
        for name in ("codes", "scale", "zero", "residual"):
            assert torch.equal(getattr(tk, name), getattr(rk, name)), (role, name)


@pytest.mark.parametrize("spec", ["hqmq:S=96,r=4,outliers=med3", "int4", "kivi:bits=2"])
def test_long_context(spec):
    """T = 131072 on a GPU; under the interpreter the longest T that stays quick."""
    T = 131072 if CUDA else 1024
    B, Hq, Hkv, D = 1, 8, 2 if CUDA else 1, 128
    k = make_kv(B, Hkv, T, D, "outlier", seed=9)
    v = make_kv(B, Hkv, T, D, seed=10)
    q = make_q(B, Hq, D, dtype=torch.bfloat16 if CUDA else torch.float16)
    check(q, *build(spec, k, v))


@pytest.mark.skipif(not CUDA, reason="llama-shaped batch needs a GPU")
@pytest.mark.parametrize("spec", SPECS)
def test_llama_shapes_gpu(spec):
    B, Hq, Hkv, T, D = 2, 32, 8, 4096 + 17, 128
    k = make_kv(B, Hkv, T, D, "outlier", seed=12)
    v = make_kv(B, Hkv, T, D, seed=13)
    for dtype in (torch.float16, torch.bfloat16):
        check(make_q(B, Hq, D, dtype=dtype), *build(spec, k, v))


def test_choose_splits():
    for rows, ntiles, n in [(1, 1, None), (64, 512, None), (8, 3, 50), (4, 100, 7), (1, 0, None)]:
        ns, per = choose_splits(rows, ntiles, DEV, n)
        assert ns >= 1
        if ntiles:
            assert (ns - 1) * per < ntiles <= ns * per  # every split non-empty, all tiles covered


def test_refuses_bad_input():
    k = make_kv(1, 2, 8, 64)
    (qk, pk), (qv, pv) = build("int4", k, k)
    with pytest.raises(ValueError, match="one decode token"):
        decode_attention(make_q(1, 4, 64).expand(1, 4, 2, 64), L.flatten(pk), L.flatten(pv))
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(make_q(1, 3, 64), L.flatten(pk), L.flatten(pv))
    pc = get_quantizer("int4:keys=per-channel", role="K").encode(k)
    with pytest.raises(ValueError, match="per-token"):
        L.flatten(pc)
    for D in (40, 272):  # not a multiple of 16; past 256 and not a power of two
        x = make_kv(1, 2, 8, D)
        (_, px), _ = build("fp16", x, x)
        with pytest.raises(ValueError, match=f"head_dim must be a multiple of 16 .* got {D}"):
            decode_attention(make_q(1, 4, D), L.flatten(px, "K"), L.flatten(px, "V"))


# ---------------------------------------------------------------------------------------
# the store <-> kernel contract
# ---------------------------------------------------------------------------------------
def _with_capacity(flat, extra: int, seed: int = 0):
    """The same cache in buffers with `extra` rows of garbage capacity per token-axis
    buffer (what kernels/store.py hands the kernels); the valid length is unchanged."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)

    def grow(t, n=extra):
        if t is None:
            return None
        pad_shape = t.shape[:2] + (n,) + t.shape[3:]
        if t.dtype.is_floating_point:
            junk = (torch.randn(pad_shape, generator=g) * 1e4).to(t.dtype)
        else:
            junk = torch.randint(0, 255, pad_shape, generator=g).to(t.dtype)
        return torch.cat([t, junk.to(t.device)], dim=2).contiguous()

    if isinstance(flat, L.KIVIFlat):
        per = 1 if flat.role == "K" else flat.group
        return dataclasses.replace(flat, codes=grow(flat.codes, 2 * per), scale=grow(flat.scale, 2 * per),
                                   zero=grow(flat.zero, 2 * per), residual=grow(flat.residual),
                                   n_res=flat.T_res)
    names = registry.format_of_flat(type(flat)).token_fields
    out = dataclasses.replace(flat, **{n: grow(getattr(flat, n)) for n in names if getattr(flat, n) is not None})
    if isinstance(flat, L.HQMQFlat) and flat.has_outliers:
        out.outliers = grow(flat.outliers, 5)
        tcap = out.codes.shape[2]
        nblk = -(-tcap // L.OUTLIER_BLOCK)
        idx = flat.outlier_index
        out.outlier_index = torch.cat([idx, idx[:, :, -1:].expand(-1, -1, nblk - idx.shape[2])], 2).contiguous()
    return out


@pytest.mark.parametrize("spec", SPECS + ["kivi:bits=4,window=fixed"])
def test_capacity_beyond_valid_length(spec):
    """Buffers longer than the valid length (garbage after it) give the same output:
    kernels read only valid tokens, through the buffers' real strides."""
    B, Hq, Hkv, T, D = 2, 4, 2, 77, 64
    k, v = make_kv(B, Hkv, T, D, "outlier", seed=31), make_kv(B, Hkv, T, D, seed=32)
    q = make_q(B, Hq, D)
    (qk, pk), (qv, pv) = build(spec, k, v)
    kf, vf = _with_capacity(L.flatten(pk, "K"), 70), _with_capacity(L.flatten(pv, "V"), 70, seed=1)
    out = decode_attention(q, kf, vf, out_dtype=torch.float32, num_splits=2)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol(q.dtype), f"relative error {rel_err(out, ref):.3g}"


def test_layout_found_through_the_quantizer_class():
    """flatten dispatches on the quantizer CLASS (its format, or a kernel_layout method):
    a subclass under another name inherits its parent's layout; a quantizer without a
    fused kernel gets a clear error."""
    from kvqbench.kernels import registry
    from kvqbench.kernels.formats.hqmq import flatten_hqmq
    from kvqbench.quantizers.hqmq import HQMQ

    assert registry.format_of_quantizer(HQMQ).flatten is flatten_hqmq

    class Renamed(HQMQ):
        name = "renamed-hqmq-test"

    assert registry.format_of_quantizer(Renamed).flatten is flatten_hqmq
    x = make_kv(1, 2, 8, 64)
    with pytest.raises(ValueError, match="no fused kernel"):
        L.flatten(get_quantizer("spherical4", role="K").encode(x))


def test_explain_backend_says_which_backend_and_why():
    """The front routes by the registry's table and says so: off a GPU every format's
    call goes to Triton, CUDA declining because q is not on a CUDA device; a backend
    asked for by name is refused where it cannot run, with the reason."""
    from kvqbench.kernels.decode_attention import explain_backend

    x = make_kv(1, 2, 8, 64)
    for spec, name in (("int4", "naive_int"), ("fp8-e4m3", "fp8"), ("kivi:bits=2", "kivi"), ("hqmq:S=8,r=4", "hqmq")):
        kf, vf = (L.flatten(get_quantizer(spec, role=r).encode(x), r) for r in "KV")
        route = explain_backend(make_q(1, 4, 64), kf, vf)
        assert route.format == name and route.backend == ("triton" if not CUDA else route.backend), route
        if not CUDA:
            assert route.declined == {"cuda": "q is not on a CUDA device"} and "cuda declines" in route.reason
            with pytest.raises(ValueError, match="no CUDA kernel"):
                explain_backend(make_q(1, 4, 64), kf, vf, backend="cuda")
        assert explain_backend(make_q(1, 4, 64), kf, vf, backend="triton").reason == "asked for (backend='triton')"
    with pytest.raises(ValueError, match="backend must be auto or one of cuda, triton"):
        explain_backend(make_q(1, 4, 64), kf, vf, backend="cutlass")


@pytest.mark.parametrize("spec", ["fp8-e5m2", "kivi:bits=2,residual=40", "int8"])
def test_more_formats(spec):
    """fp8 e5m2, a KIVI window that is not a whole number of groups, 8-bit ints."""
    B, Hq, Hkv, T, D = 1, 8, 2, 150, 64
    k, v = make_kv(B, Hkv, T, D, "outlier", seed=41), make_kv(B, Hkv, T, D, seed=42)
    check(make_q(B, Hq, D), *build(spec, k, v), num_splits=3)


def test_graphed_decode_replays_the_call():
    """GraphedDecode (CUDA graph on a GPU, the plain call elsewhere) gives the plain
    call's output for each new query, and refuses a query of another shape."""
    from kvqbench.kernels.graphs import GraphedDecode

    B, Hq, Hkv, T, D = 1, 4, 2, 96, 64
    k, v = make_kv(B, Hkv, T, D, seed=51), make_kv(B, Hkv, T, D, seed=52)
    (qk, pk), (qv, pv) = build("int4", k, v)
    kf, vf = L.flatten(pk, "K"), L.flatten(pv, "V")
    step = GraphedDecode(kf, vf, make_q(B, Hq, D), num_splits=2, out_dtype=torch.float32)
    for seed in (2, 3):
        q = make_q(B, Hq, D, seed=seed)
        want = decode_attention(q, kf, vf, num_splits=2, out_dtype=torch.float32)
        assert torch.equal(step(q), want)
    with pytest.raises(ValueError, match="differs from the captured"):
        step(make_q(B, Hq + 4, D))
