"""Method-specific tests of the baselines (issue 11, item 6): each checks a
property of the published method that a wrong implementation would break.
Small tensors, fixed seeds: seconds on a CPU."""
import math

import pytest
import torch

from kvqbench.quantizers import get_quantizer, registry
from kvqbench.quantizers.lloyd_max import lloyd_max_gaussian, lloyd_max_sphere, sphere_abs_mean
from kvqbench.quantizers.packing import unpack_bits
from kvqbench.quantizers.rotation import fwht, hadamard_block, random_signs, rotate, signs_of, sylvester_hadamard, unrotate
from kvqbench.quantizers import vq
from kvqbench.quantizers.vq import cluster_sums, kmeans

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: extra threads only wait


def gaussian(*shape, seed=0, outlier_channel=None, scale=30.0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if outlier_channel is not None:
        x[..., outlier_channel] *= scale
    return x


def rel_mse(spec, x, role="K", seed=0):
    q = get_quantizer(spec, role=role, seed=seed)
    y = q.decode(q.encode(x))
    return float((y - x).pow(2).sum() / x.pow(2).sum())


# ---- Lloyd-Max levels ------------------------------------------------------------------
def test_lloyd_max_gaussian_known_levels():
    # Max (1960): 1 bit +-sqrt(2/pi); 2 bits +-0.4528, +-1.510; 3 bits 0.2451, 0.7560, 1.344, 2.152
    assert lloyd_max_gaussian(2)[1] == pytest.approx(math.sqrt(2 / math.pi), abs=1e-12)
    assert lloyd_max_gaussian(4)[2:] == pytest.approx((0.4528, 1.5104), abs=2e-4)
    assert lloyd_max_gaussian(8)[4:] == pytest.approx((0.2451, 0.7560, 1.3439, 2.1519), abs=2e-4)


@pytest.mark.parametrize("dim", [3, 8, 64, 128])
def test_lloyd_max_sphere_one_bit_is_mean_abs_coordinate(dim):
    # 1 bit: the two levels are the centroids of the half-lines, +-E|u_1| in closed form
    assert lloyd_max_sphere(2, dim)[1] == pytest.approx(sphere_abs_mean(dim), rel=1e-9)


def test_lloyd_max_sphere_exact_cases():
    # d = 3: a coordinate is uniform on [-1, 1] (Archimedes), whose Lloyd-Max levels are
    # the cell midpoints of equal cells
    assert lloyd_max_sphere(4, 3) == pytest.approx((-0.75, -0.25, 0.25, 0.75), abs=1e-8)
    # large d: sqrt(d) u_1 -> N(0, 1), so the levels approach Max's Gaussian ones (O(1/d))
    lv = [v * math.sqrt(4096) for v in lloyd_max_sphere(4, 4096)]
    assert lv[2:] == pytest.approx(lloyd_max_gaussian(4)[2:], rel=2e-3)
    # and at a head dim they are not the Gaussian ones: the earlier approximation differs
    lv64 = [v * 8 for v in lloyd_max_sphere(16, 64)]
    assert abs(lv64[-1] - lloyd_max_gaussian(16)[-1]) > 1e-2


def test_spherical_uses_beta_levels():
    q = get_quantizer("spherical:bits=3,rotation=hadamard")
    lv, _ = q.levels(64, "cpu")
    want = torch.tensor(lloyd_max_sphere(8, 64), dtype=torch.float64).half().double()
    assert torch.equal(lv, want)


# ---- Hadamard rotation ------------------------------------------------------------------
@pytest.mark.parametrize("d", [8, 64, 96])
def test_hadamard_rotation_is_orthogonal(d):
    b = hadamard_block(d)
    w = sylvester_hadamard(b).double()
    assert torch.equal(w @ w.T, b * torch.eye(b, dtype=torch.float64))
    eye = torch.eye(d, dtype=torch.float64)
    assert torch.allclose(fwht(eye, b), torch.block_diag(*[w] * (d // b)), atol=0)
    signs = signs_of(random_signs([7], d), d, torch.float64)
    r = rotate(eye.view(1, 1, d, d), signs)[0, 0]  # rows: R applied to each basis vector
    torch.testing.assert_close(r @ r.T, eye, rtol=0, atol=1e-12)
    x = gaussian(2, 1, 5, d).double()
    torch.testing.assert_close(unrotate(rotate(x, signs), signs), x, rtol=0, atol=1e-12)


def test_hadamard_int_spreads_a_channel_outlier():
    x = gaussian(1, 2, 64, 64, outlier_channel=3)
    rotated, plain = rel_mse("hadamard-int4", x), rel_mse("int:bits=4,group=64", x)  # both 4.5 bits
    assert rotated < 0.5 * plain, (rotated, plain)


# ---- QJL --------------------------------------------------------------------------------
def test_qjl_inner_products_unbiased():
    """<x, x_hat> over seeds (each its own rotation and sketch S) averages to ||x||^2
    with QJL; the MSE stage alone (x_hat minus the sketch term) is biased low,
    by ||r||^2 each seed, which the same statistic detects."""
    D, N = 64, 300
    x = gaussian(1, 1, 1, D, seed=1)
    exact = float(x.pow(2).sum())
    full, mse_only = [], []
    for seed in range(N):
        q = get_quantizer("spherical:bits=2,rotation=hadamard,qjl=true", role="K", seed=seed)
        p = q.encode(x)
        y = q.decode(p).double()
        sketch = q._qjl_decoded(p.segments[0].fields, p.shared["qjl"], D)
        full.append(float((x.double() * y).sum()) - exact)
        mse_only.append(float((x.double() * (y - sketch)).sum()) - exact)

    def z(v):
        t = torch.tensor(v, dtype=torch.float64)
        return float(t.mean() / (t.std() / math.sqrt(len(v))))

    assert abs(z(full)) < 4, f"QJL estimator biased: z = {z(full):.2f}"
    assert z(mse_only) < -4, f"the test cannot see bias: MSE-only z = {z(mse_only):.2f}"


def test_qjl_bits_counted():
    x = gaussian(1, 2, 64, 64)
    p = get_quantizer("spherical4-qjl", role="K").encode(x)
    by = p.nbytes_by_field()
    assert by["shared:qjl"] == 64 * 64 * 2  # the fp16 sketch matrix
    assert by["qjl_signs"] == 2 * 64 * 64 // 8 and by["qjl_norm"] == 2 * 64 * 2
    assert by["codes"] == 2 * 64 * 64 * 3 // 8  # bits-1 for the MSE stage
    assert "qjl" not in get_quantizer("spherical4-qjl", role="V").encode(x).shared  # keys only


def test_spherical_outlier_channels_split_off():
    """TurboQuant's KV split: the N largest-RMS channels of each head (first write)
    get their own instance with more bits; the mask and both parts are stored."""
    x = gaussian(1, 2, 64, 64)
    x[:, 0, :, [5, 9]] *= 20.0
    x[:, 1, :, [1, 40]] *= 20.0
    q = get_quantizer("spherical:bits=2,outliers=32,rotation=hadamard")
    p = q.encode(x)
    mask = unpack_bits(p.shared["outlier_mask"], 1, 64).bool()[0]  # [B, H, D]: one mask per batch row
    assert mask.sum(-1).tolist() == [32, 32]
    assert mask[0, [5, 9]].all() and mask[1, [1, 40]].all()
    by = p.nbytes_by_field()
    assert by["codes"] == by["codes_o"] * 2 // 3  # 32 channels at 2 bits, 32 at 3
    assert q.formula_bits(64) == (32 * 2 + 32 * 3 + 32) / 64
    split = float((q.decode(p) - x).pow(2).sum() / x.pow(2).sum())
    assert split < rel_mse("spherical:bits=2,rotation=hadamard", x) / 1.5


# ---- k-means and fitted codebooks ------------------------------------------------------
def test_kmeans_objective_non_increasing():
    pts = gaussian(2, 2000, 4, seed=3).double()
    pts[1] *= torch.tensor([10.0, 1, 1, 0.1], dtype=torch.float64)  # an anisotropic group
    hist = []
    kmeans(pts, 32, torch.Generator().manual_seed(0), iters=10, history=hist)
    assert len(hist) == 11
    assert all(b <= a * (1 + 1e-12) for a, b in zip(hist, hist[1:])), hist
    assert hist[-1] < 0.8 * hist[0], hist  # and it does move


def test_cluster_sums_one_hot_blocks_equal_scatter(monkeypatch):
    # The GPU's deterministic one-hot sums, over several blocks of points, give the
    # scatter_add_ sums (to float rounding: another summation order) and the same counts.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1000, 8, generator=g)
    assign = torch.randint(0, 37, (3, 1000), generator=g)
    assign[1] = 5  # one cluster takes a whole group, the others none
    monkeypatch.setattr(vq, "ONE_HOT_BLOCK", 3 * 37 * 64)  # 64 points a block: 16 blocks
    s1, c1 = cluster_sums(x, assign, 37, one_hot=True)
    s0, c0 = cluster_sums(x, assign, 37, one_hot=False)
    assert torch.equal(c1, c0) and int(c1.sum()) == 3000
    assert torch.allclose(s1, s0, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="run-to-run determinism of CUDA reductions")
@pytest.mark.parametrize("spec", ["avq2", "avq3", "flatvq:dim=4,K_bits=8", "flatvq:dim=2,K_bits=8"])
def test_fitted_quantizers_are_deterministic_on_cuda(spec):
    # A seeded fit on the GPU stores the same bytes on every run (CUDA's scatter_add_ did
    # not: the compare's avq / flatvq rows moved up to 11% in PPL between runs).
    x = gaussian(2, 3, 512, 64, seed=4, outlier_channel=7, scale=6.0).cuda()
    digests = {get_quantizer(spec, role=role, seed=1).encode(x).digest() for role in "KK"}
    assert len(digests) == 1
    pts = gaussian(3, 4000, 8, seed=5).cuda()
    a, b = (kmeans(pts, 255, torch.Generator().manual_seed(0)) for _ in range(2))
    assert torch.equal(a, b)


def test_fitted_codebooks_beat_seeded_ones():
    x = gaussian(1, 2, 256, 64, outlier_channel=5, scale=8.0)
    fitted = rel_mse("avq:M=2", x)
    seeded = rel_mse("avq:M=2,codebooks=gaussian,rotation=none", x)
    assert fitted < 0.7 * seeded, (fitted, seeded)


@pytest.mark.parametrize("spec, field, nbytes", [
    ("flatvq:dim=4,K_bits=6,per_head=true", "shared:codebook", 2 * 64 * 4 * 2),
    ("flatvq:dim=4,K_bits=6,per_head=false", "shared:codebook", 64 * 4 * 2),
    ("avq:M=3,K_bits=6,dim=8", "shared:codebooks", 3 * 64 * 8 * 2),
])
def test_codebook_bytes_counted(spec, field, nbytes):
    p = get_quantizer(spec).encode(gaussian(1, 2, 32, 64))
    assert p.nbytes_by_field()[field] == nbytes


def test_codebook_fitted_once_then_reused():
    x = gaussian(1, 2, 40, 64)
    q = get_quantizer("flatvq:dim=4,K_bits=6")
    p = q.encode(x[:, :, :32])
    cb = p.shared["codebook"].clone()
    assert cb.abs().sum() > 0  # fitted, not the placeholder
    p = q.append(p, x[:, :, 32:])
    assert torch.equal(p.shared["codebook"], cb)


# ---- fp8 --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("scale", ["head", "tensor", "unit"])
def test_fp8_equals_torch_float8_cast(fmt, dtype, scale):
    x = gaussian(2, 3, 16, 32) * torch.tensor([1.0, 100.0, 0.01]).view(1, 3, 1, 1)
    q = get_quantizer(f"fp8:format={fmt},scale={scale}")
    p = q.encode(x)
    s = p.shared["scale"].float()
    amax = x.abs().amax(dim=(0, 2, 3))
    fmax = torch.finfo(dtype).max
    if scale == "unit":
        assert torch.equal(s, torch.ones(3))
    else:
        want = (amax if scale == "head" else amax.max().expand(3)) / fmax
        want = want.clamp(min=2.0**-14)  # fp16's smallest normal: the scale never underflows
        torch.testing.assert_close(s, want.half().float(), rtol=0, atol=0)
    ref = (x / s.view(1, 3, 1, 1)).clamp(-fmax, fmax).to(dtype).float() * s.view(1, 3, 1, 1)
    assert torch.equal(q.decode(p), ref)
    # a later write beyond the first write's range saturates at +-max * scale
    p2 = q.append(p, x[:, :, :1] * 1e4)
    assert torch.equal(q.decode(p2)[:, :, -1], (x[:, :, :1] * 1e4 / s.view(1, 3, 1, 1))
                       .clamp(-fmax, fmax).to(dtype).float()[:, :, 0] * s.view(1, 3, 1))


# ---- KIVI -------------------------------------------------------------------------------
def kivi_expected(total, role, window, G=4, R=8, D=8, bits=2):
    """(fp16 window tokens, stored bytes) for B = H = 1 after `total` tokens."""
    if window == "paper" and role == "K":
        quant = total // R * R
    else:
        quant = max(0, total - R) // G * G
    if role == "K":  # per channel over G tokens: G*bits/8 code bytes, fp16 scale + zero
        group_bytes = D * (G * bits // 8 + 4)
    else:  # per token over G channels
        group_bytes = G * (D * bits // 8 + 4 * D // G)
    return total - quant, quant // G * group_bytes + (total - quant) * D * 2


@pytest.mark.parametrize("window", ["paper", "fixed"])
@pytest.mark.parametrize("role", ["K", "V"])
def test_kivi_window_and_bytes_per_step(window, role):
    q = get_quantizer(f"kivi:bits=2,group=4,residual=8,window={window}", role=role)
    x = gaussian(1, 1, 30, 8)
    p, seen = None, []
    for t in range(30):
        p = q.append(p, x[:, :, t : t + 1])
        last = p.segments[-1]
        res = last.tokens if "residual" in last.fields else 0
        want_res, want_bytes = kivi_expected(t + 1, role, window)
        assert (res, p.nbytes) == (want_res, want_bytes), f"step {t + 1}"
        seen.append(res)
    if window == "paper" and role == "K":  # T mod R, flushed every R tokens
        assert seen[:17] == [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    else:  # R..R+G-1 once past R + G
        assert set(seen[12:]) == {8, 9, 10, 11}


@pytest.mark.parametrize("spec", ["kivi:bits=2", "kivi:bits=4,group=8,residual=24", "kivi:bits=3,group=8,residual=8",
                                  "kivi:bits=3,group=4,residual=8", "kivi:bits=4,group=4,residual=8,window=fixed", "kivi:bits=8,group=16,residual=0"])
@pytest.mark.parametrize("role", ["K", "V"])
def test_kivi_long_writes_encode_and_decode_groups_in_one_call(spec, role, monkeypatch):
    # A prefill's groups are encoded in one call and cut into one-group segments, and a
    # run of such segments decodes in one call (a 32k prefill is 1024 groups): the
    # segments, their bytes and the decode equal those of the group-by-group path, for one
    # write and for writes that straddle the window (3-bit keys in groups of 4 end
    # mid-byte: they keep the group-by-group path).
    import dataclasses

    from kvqbench.quantizers import Segment
    from kvqbench.quantizers.base import Quantizer

    x = gaussian(2, 3, 203, 32, seed=9, outlier_channel=5, scale=20.0)
    cuts = [0, 150, 151, 203]

    def written(q):
        p = q.encode(x)
        parts = None
        for a, b in zip(cuts, cuts[1:]):
            parts = q.append(parts, x[:, :, a:b])
        return p, parts

    fast = get_quantizer(spec, role=role)
    one, parts = written(fast)
    decoded = [fast.decode(one), fast.decode(parts)]
    assert one.segments[-1].tokens == parts.segments[-1].tokens
    with monkeypatch.context() as m:
        m.setattr(type(fast), "encode_groups", Quantizer.encode_groups)
        m.setattr(type(fast), "merge_groups", Quantizer.merge_groups)
        slow = get_quantizer(spec, role=role)
        ref_one, ref_parts = written(slow)
        ref = [slow.decode(ref_one), slow.decode(ref_parts)]
    for got, want in ((one, ref_one), (parts, ref_parts)):
        assert [s.tokens for s in got.segments] == [s.tokens for s in want.segments]
        for a, b in zip(got.segments, want.segments):
            assert a.fields.keys() == b.fields.keys()
            assert all(torch.equal(a.fields[k], b.fields[k]) for k in a.fields)
        assert got.nbytes == want.nbytes and got.digest() == want.digest()
    for a, b in zip(decoded, ref):
        assert torch.equal(a, b) and a.is_contiguous()  # SDPA's fused kernels need unit stride
    groups = [Segment(s.fields, s.tokens) for s in one.segments if "residual" not in s.fields]  # undecoded
    assert len(groups) >= 2  # a run of one-group segments
    merged = fast.merge_groups(groups)
    assert (merged is None) == (role == "K" and fast.config.group * fast.config.bits % 8 != 0)
    # the run alone (no fp16 window after it) decodes as one part; keys decode channel-major: copied once
    assert fast.decode(dataclasses.replace(one, segments=groups)).is_contiguous()


def test_kivi_corrupt_segment_in_a_merged_run_is_named():
    from kvqbench.quantizers.base import CorruptPackedError

    q = get_quantizer("kivi:bits=2", role="K")
    p = q.encode(gaussian(1, 2, 600, 64))
    p.segments[3].fields["scale"][0, 0, 0, 0] = float("nan")
    with pytest.raises(CorruptPackedError, match="segment 3 of .*, field 'scale', holds 1 NaN/Inf"):
        q.decode(p)
    from kvqbench.quantizers.checks import deferred_checks, flush

    for s in p.segments:
        s._decoded = None
    with pytest.raises(CorruptPackedError, match="segment 3 of .*, field 'scale', holds 1 NaN/Inf"):
        with deferred_checks():  # the run's one check, queued, raises at the flush
            q.decode(p)
            flush()


# ---- HQMQ fill and stochastic marks --------------------------------------------------------
@pytest.mark.parametrize("S, filled", [(24, 42), (96, 170), (256, 341)])
def test_hqmq_fill_uses_the_code_field(S, filled):
    plain, fill = get_quantizer(f"hqmq:S={S},r=4"), get_quantizer(f"hqmq:S={S},r=4,fill=true")
    assert fill.config.S == filled and fill.code_bits == plain.code_bits
    assert 24 * filled <= 1 << fill.code_bits < 24 * (filled + 1)
    x = gaussian(1, 2, 16, 64)
    a, b = plain.encode(x).nbytes_by_field(), fill.encode(x).nbytes_by_field()
    assert a["codes"] == b["codes"]  # the same code bytes
    assert b["shared:secondaries"] - a["shared:secondaries"] == 2 * (filled - S) * 4 * 2


def test_hqmq_fill_lowers_error_every_seed():
    x = gaussian(1, 2, 128, 64, seed=4)
    for seed in range(3):
        plain, fill = rel_mse("hqmq:S=96,r=4", x, seed=seed), rel_mse("hqmq:S=96,r=4,fill=true", x, seed=seed)
        assert fill < 0.9 * plain, (seed, plain, fill)


def test_stochastic_marks():
    reg = registry()
    for name in ("hqmq", "spherical", "avq", "flatvq"):
        assert getattr(reg[name], "stochastic", False) is True, name
    for name in ("fp8", "hadamard-int", "kivi"):
        assert not getattr(reg[name], "stochastic", False), name
