"""The Triton wrappers' launch plans (issue 28, "a thin host path"): what a call derives
from the layout is made once per plan (kernels/triton/common.py `PlanCache`,
`SplitPlan`), and a planned call launches exactly what an unplanned one does.

Under the Triton interpreter on a CPU (TRITON_INTERPRET=1 set before triton is
imported). Launches are captured through `launch_hook` (no kernel runs) except where
outputs are compared. No timing here: the host microseconds are measured by
suites/bench/latency/host_time.py.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from kvqbench.kernels import layout as L  # noqa: E402
from kvqbench.kernels.decode_attention import decode_attention, reference_decode_attention  # noqa: E402
from kvqbench.kernels.triton import common as tc  # noqa: E402
from kvqbench.suites.bench.toolkit import encode_kv, synthetic_kv  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import small_flats as _flats  # noqa: E402

pytestmark = pytest.mark.kernels

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPECS = ["int4", "int2", "fp8", "kivi:bits=4", "hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3", "fp16"]


def _norm(x):
    if isinstance(x, torch.Tensor):
        # (the workspace's fresh buffers are 1-D: compared by layout only, as 1-D inputs are)
        return ("tensor", x.data_ptr() if x.dim() > 1 else None, tuple(x.shape), x.stride(), x.dtype)
    return repr(x)


def _launches(fn):
    """What fn launches: (kernel, grid, positional args, keywords) of each launch, tensors
    by (pointer, shape, strides, dtype)."""
    got = []

    def hook(kernel, grid, args, kw):
        got.append((getattr(kernel, "fn", kernel).__name__, tuple(grid),
                    [_norm(a) for a in args],
                    sorted((k, _norm(v)) for k, v in kw.items())))

    old, tc.launch_hook = tc.launch_hook, hook
    try:
        fn()
    finally:
        tc.launch_hook = old
    return got


def _fresh(fn):
    """fn's launches with every plan forgotten first (what an unplanned call launches)."""
    tc.clear_plans()
    return _launches(fn)


@pytest.mark.parametrize("spec", SPECS)
def test_planned_call_launches_what_an_unplanned_one_does(spec):
    kf, vf = _flats(spec, B=2, T=192)
    q = torch.randn(2, 4, 1, 64, device=DEV).half()
    call = lambda: decode_attention(q, kf, vf, backend="triton")  # noqa: E731
    first = _fresh(call)
    assert tc.plan_count() == 1
    assert _launches(call) == first  # from the plan
    assert tc.plan_count() == 1  # no second plan for the same layout


@pytest.mark.parametrize("spec", SPECS)
def test_planned_output_identical(spec):
    """Outputs bit-identical, unplanned vs planned, and right (vs the fp32 reference)."""
    kf, vf = _flats(spec, B=1, T=128)
    q = torch.randn(1, 4, 1, 64, device=DEV)
    tc.clear_plans()
    a = decode_attention(q, kf, vf, backend="triton", num_splits=2)
    b = decode_attention(q, kf, vf, backend="triton", num_splits=2)
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # a fresh output per call, as before
    if not torch.cuda.is_available():
        k, v = synthetic_kv(1, 2, 64, 64, DEV)
        (qk, pk), (qv, pv) = encode_kv(spec, k, v)
        ref = reference_decode_attention(q, qk.decode(pk).repeat(1, 1, 2, 1), qv.decode(pv).repeat(1, 1, 2, 1))
        if "kivi" not in spec:  # (KIVI tiles its groups with the window last: not a plain repeat)
            assert float((a - ref).norm() / ref.norm()) < 1e-4


def _variants(spec, kf, vf, q):
    """(name, call) pairs, each differing from the base call in one thing a plan derives from."""
    d = kf.D

    def restrided(f):  # the same values in buffers with more capacity: other strides
        names = [n for n in ("codes", "scale", "zero", "radius", "r_max", "values")
                 if isinstance(getattr(f, n, None), torch.Tensor) and getattr(f, n).dim() >= 3]
        if isinstance(f, L.KIVIFlat):
            return dataclasses.replace(f, residual=_pad(f.residual, 16), n_res=f.T_res)
        return dataclasses.replace(f, **{n: _pad(getattr(f, n), 64) for n in names})

    rk, rv = restrided(kf), restrided(vf)
    q32, q8 = q.float(), torch.randn(kf.B, 2 * q.shape[1], 1, d, device=DEV).half()
    out = [("restrided", lambda: decode_attention(q, rk, rv, backend="triton")),
           ("q fp32", lambda: decode_attention(q32, kf, vf, backend="triton")),
           ("q group", lambda: decode_attention(q8, kf, vf, backend="triton")),
           ("num_splits", lambda: decode_attention(q, kf, vf, backend="triton", num_splits=1)),
           ("out_dtype", lambda: decode_attention(q, kf, vf, backend="triton", out_dtype=torch.float32))]
    if not isinstance(kf, L.KIVIFlat):
        vl = torch.tensor([kf.T - 3], dtype=torch.int32, device=DEV)
        out.append(("valid_len", lambda: decode_attention(q, kf, vf, backend="triton", valid_len=vl)))
        out.append(("T", lambda: decode_attention(q, dataclasses.replace(kf, T=kf.T - 64),
                                                  dataclasses.replace(vf, T=vf.T - 64), backend="triton")))
    else:
        out.append(("T", lambda: decode_attention(q, dataclasses.replace(kf, n_groups=kf.n_groups - 8),
                                                  dataclasses.replace(vf, n_groups=vf.n_groups - 8),
                                                  backend="triton")))
    return out


def _pad(t, n):
    """t in a buffer with n more rows along the token axis (a `[:, :, :cap]` view of it)."""
    buf = torch.zeros(t.shape[:2] + (t.shape[2] + n,) + t.shape[3:], dtype=t.dtype, device=t.device)
    buf[:, :, : t.shape[2]] = t
    return buf[:, :, : t.shape[2]]


@pytest.mark.parametrize("spec", SPECS)
def test_plan_follows_every_change(spec):
    """After a plan exists, a call that differs in strides, q's dtype or shape, splits,
    out dtype, valid_len or T launches what an unplanned call of it launches (a stale
    plan would launch the base call's strides, constexprs or grid)."""
    kf, vf = _flats(spec, B=2, T=256)
    q = torch.randn(2, 4, 1, 64, device=DEV).half()
    base = lambda: decode_attention(q, kf, vf, backend="triton")  # noqa: E731
    want_base = _fresh(base)
    for name, call in _variants(spec, kf, vf, q):
        want = _fresh(call)
        assert want != want_base, f"{name}: the variant launches the same as the base call (no test)"
        _fresh(base)  # a plan of the base layout exists
        assert _launches(call) == want, f"{spec}: {name} launched from a stale plan"
        assert _launches(base) == want_base, f"{spec}: base call after {name}"


def test_plan_dies_with_its_tensors():
    """A plan made for tensors that are gone is not used for new tensors that may reuse
    their ids (weak references)."""
    q = torch.randn(1, 4, 1, 64, device=DEV).half()
    tc.clear_plans()
    for T in (128, 192, 128, 256):  # new flats each time; freed ones may hand their ids on
        kf, vf = _flats("int4", T=T)
        kf = dataclasses.replace(kf, codes=_pad(kf.codes, T))  # strides follow T
        vf = dataclasses.replace(vf, codes=_pad(vf.codes, T))
        got = _launches(lambda: decode_attention(q, kf, vf, backend="triton"))
        assert got == _fresh(lambda: decode_attention(q, kf, vf, backend="triton"))
        del kf, vf


@pytest.mark.parametrize("spec", ["int4", "fp8", "hqmq:S=96,r=4", "fp16", "kivi:bits=4"])
def test_errors_unchanged_with_a_plan(spec):
    """Bad input raises the same error whether or not a plan of the good call exists."""
    kf, vf = _flats(spec, B=2, T=128)
    q = torch.randn(2, 4, 1, 64, device=DEV).half()
    bad = [lambda: decode_attention(q[:1], kf, vf, backend="triton"),  # q batch
           lambda: decode_attention(q[..., :32], kf, vf, backend="triton"),  # q head dim
           lambda: decode_attention(q.to(torch.int32), kf, vf, backend="triton"),  # q dtype
           lambda: decode_attention(q, kf, vf, backend="triton", valid_len=torch.tensor([5])),  # int64
           lambda: decode_attention(q, kf, vf, backend="triton", valid_len=torch.tensor([5, 6], dtype=torch.int32))]
    if isinstance(kf, L.KIVIFlat):
        bad.append(lambda: decode_attention(q, kf, dataclasses.replace(vf, n_groups=vf.n_groups - 1),
                                            backend="triton"))
        bad.append(lambda: decode_attention(q, vf, kf, backend="triton"))  # roles swapped
    else:
        bad.append(lambda: decode_attention(q, kf, dataclasses.replace(vf, T=vf.T - 1), backend="triton"))

    def errors():
        out = []
        for call in bad:
            with pytest.raises((ValueError, TypeError)) as e:
                _launches(call)
            out.append((type(e.value), str(e.value)))
        return out

    tc.clear_plans()
    unplanned = errors()
    _launches(lambda: decode_attention(q, kf, vf, backend="triton"))  # the good call's plan
    assert errors() == unplanned


def test_the_inline_tile_counts_are_token_tiles():
    """follow_tokens and KIVI's cut count tiles with shifts (they run on every eager step);
    both must stay the 16-token tiles of kernels/common.py `token_tiles`: a kept plan is
    resplit exactly when the step moves its tile count, and the cut's tail is its tiles."""
    import types

    from kvqbench.kernels.common import token_tiles
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda.launch import follow_tokens

    for t0 in range(1, 70):
        for T in range(1, 70):
            resplits = []
            plan = types.SimpleNamespace(args=types.SimpleNamespace(T=t0), nsplit=-1)
            follow_tokens(plan, T, T, lambda: resplits.append(T) or 7)
            assert plan.args.T == T and bool(resplits) == (token_tiles(T) != token_tiles(t0)), (t0, T)
            assert plan.nsplit == (7 if resplits else -1)
    for T in range(1, 300):
        for n_main in range(0, T + 1, 7):
            assert cd._kivi_cut(n_main, T) == (n_main, token_tiles(T - n_main) if T > n_main else 0), (n_main, T)
