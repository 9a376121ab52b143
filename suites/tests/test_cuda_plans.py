"""The CUDA backends' launch plans (kernels/cuda/decode_attention.py, hqmq_decode.py;
issue 28, "a thin host path"): the plan the auto route's check finds is handed to the same
call's launch (`RoutedPlan`), and a kept plan follows the token count of a growing cache
(`_retarget`) instead of a build per eager decode step; a call without a workspace takes
its partials from a per-stream scratch buffer (`Scratch`) instead of an allocation.

On a CPU the CUDA path is walked (suites/bench/latency/host_time.py `cuda_path_on_cpu`: q
passes for a CUDA tensor, the launch stubbed) or the plan functions are called directly;
the tests that build real plans need a CUDA GPU. No timing here (host_time.py times it).
The front's fast route (a default call on a kept plan skips the route's checks) is here too.

(About 490 lines: why one file: every test here walks the same plan machinery, the plan
cache, the routed slot, the fast route, retargets and the scratch buffer, through the same
walked CUDA path; split by feature, each file would repeat that set-up.)
"""
from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from kvqbench.kernels import decode_attention as front  # noqa: E402
from kvqbench.kernels.decode_attention import decode_attention  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import TOL, in_threads, rel_err  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import small_flats as _flats  # noqa: E402

pytestmark = pytest.mark.kernels

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---- the CUDA backends' routed plan (kernels/cuda/launch.py RoutedPlan) ---------------------
def test_routed_plan_serves_only_the_call_that_found_it():
    """A plan the route's check offers is taken by the same call (same q, k, v objects,
    same options) once; any other call, options or a second take finds nothing; off, the
    slot stays empty; the slot holds no strong reference to the call's tensors."""
    import gc
    import weakref

    from kvqbench.kernels.cuda.launch import RoutedPlan

    k, v = _flats("int4")
    q = torch.randn(1, 4, 1, 64)
    memo, plan = RoutedPlan(enabled=True), object()
    memo.offer(q, k, v, ("opts",), plan)
    assert memo.take(q, k, v, ("opts",)) is plan and memo.take(q, k, v, ("opts",)) is None  # once
    for other in ((q.clone(), k, v, ("opts",)), (q, v, k, ("opts",)), (q, k, v, ("other",))):
        memo.offer(q, k, v, ("opts",), plan)
        assert memo.take(*other) is None and memo.slot is None  # emptied either way
    off = RoutedPlan()
    off.offer(q, k, v, ("opts",), plan)
    assert off.slot is None and off.take(q, k, v, ("opts",)) is None
    q2 = torch.randn(1, 4, 1, 64)
    memo.offer(q2, k, v, ("opts",), plan)
    gone = weakref.ref(q2)
    del q2
    gc.collect()
    assert gone() is None and memo.take(q, k, v, ("opts",)) is None


@pytest.mark.parametrize("backend", ["int4", "hqmq"])
def test_cuda_plan_takes_the_routed_plan_without_a_lookup(backend, monkeypatch):
    """The CUDA backends' `_plan` uses the plan the same call's route offered (with the
    options it looked up) and looks up nothing; with other options it looks up as before."""
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch
    from kvqbench.kernels.cuda.launch import RoutedPlan

    mod, spec = (cd, "int4") if backend == "int4" else (ch, "hqmq:S=96,r=4")
    k, v = _flats(spec)
    q = torch.randn(1, 4, 1, 64)
    monkeypatch.setattr(mod, "ROUTED", RoutedPlan(enabled=True))
    # (plans of this layout at its T: nothing to retarget)
    lookups, sentinel = [], types.SimpleNamespace(kind=0, args=types.SimpleNamespace(T=k.T))  # what a lookup finds
    monkeypatch.setattr(mod, "_lookup", lambda *a: lookups.append(a) or (sentinel, None, ()))
    if backend == "int4":
        default, other = (None, cd.DEFAULT_CTAS_PER_SM, None, None, False), (7, cd.DEFAULT_CTAS_PER_SM, None, None, False)
        call = lambda o: cd._plan(q, k, v, *o[:4], device_count=o[4])  # noqa: E731
    else:
        default, other = (None, None, None, None, False), (7, None, None, None, False)
        call = lambda o: ch._plan(q, k, v, *o[:4], valid_len=None)  # noqa: E731
    routed = types.SimpleNamespace(kind=0, args=types.SimpleNamespace(T=k.T))
    mod.ROUTED.offer(q, k, v, default, routed)
    assert call(default) is routed and not lookups
    mod.ROUTED.offer(q, k, v, default, routed)
    assert call(other) is sentinel and len(lookups) == 1


@pytest.mark.parametrize("spec,valid_len", [("int4", False), ("int4", True), ("fp8", False), ("kivi:bits=4", False),
                                            ("hqmq:S=96,r=4", False), ("hqmq:S=96,r=4", True),
                                            ("hqmq:S=24,r=3,outliers=med3", False)])
def test_the_auto_route_hands_its_plan_to_the_launch(spec, valid_len, monkeypatch):
    """Through the real front (`decode_attention`, backend auto) on a CPU that walks the
    CUDA path (host_time.py `cuda_path_on_cpu`: q looks like a CUDA tensor, the launch is
    stubbed, the plan a first call would build is kept by hand): the plan the CUDA
    backend's `unsupported` check finds is the one the same call's `_plan` takes from the
    routed slot. The options tuple `offer` stores and the one `take` asks with are written
    in two places; if they disagree the routed plan goes unused (a lookup per call, as with
    the slot off) and this fails (checked by changing either tuple)."""
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch
    from kvqbench.kernels.cuda.launch import RoutedPlan
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor, cuda_path_on_cpu

    mod = ch if spec.startswith("hqmq") else cd
    k, v = _flats(spec)
    q = torch.randn(1, 4, 1, 64).as_subclass(CudaLookingTensor)
    assert q.is_cuda and not torch.Tensor(q).is_cuda
    vl = torch.tensor([k.T], dtype=torch.int32) if valid_len else None
    routed, taken = RoutedPlan(enabled=True), []
    take = routed.take
    monkeypatch.setattr(routed, "take", lambda *a: taken.append(take(*a)) or taken[-1])
    monkeypatch.setattr(mod, "ROUTED", routed)
    monkeypatch.setattr(front, "FAST_ROUTE", False)  # (the route itself: the fast route skips it)
    with cuda_path_on_cpu(spec, q, k, v, valid_len) as launches:
        [(_, plan)] = mod._PLANS.plans.values()
        out = decode_attention(q, k, v, valid_len=vl)
        assert mod._PLANS.builds == 1  # (the hand-kept plan only: nothing was built)
    assert launches == [plan.ptr], "the call did not reach the CUDA launch with the kept plan"
    assert taken == [plan], f"the launch looked the plan up again instead of taking the routed one ({taken})"
    assert out.shape == plan.shape


# ---- decode_attention's fast route (kernels/decode_attention.py `_fast`) ------------------------
FAST_SPECS = ["int4", "fp8", "kivi:bits=4", "hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3"]


def _walked_call(spec, k, v, q, fast: bool, monkeypatch, **kw):
    """(the launch's arguments but the result pointer, out's shape and dtype, whether the
    route's checks ran) of one `decode_attention` call on the CUDA path walked on a CPU."""
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch, launch
    from kvqbench.suites.bench.latency.host_time import cuda_path_on_cpu

    mod = ch if spec.startswith("hqmq") else cd
    checked = []
    real = mod.unsupported
    monkeypatch.setattr(mod, "unsupported", lambda *a: checked.append(1) or real(*a))
    monkeypatch.setattr(front, "FAST_ROUTE", fast)
    with cuda_path_on_cpu(spec, q, k, v) as launches:
        # (set by hand, not by monkeypatch: the walk's exit restores the real launcher, and a
        # monkeypatch undone at teardown would put the walk's stub back for later tests)
        calls = []
        stub = mod.on_current_stream
        mod.on_current_stream = lambda dev, entry, *a: calls.append(a) or stub(dev, entry, *a)
        out = decode_attention(q, k, v, **kw)
        assert mod._PLANS.builds == 1 and launches  # (the hand-kept plan, launched)
    assert mod.on_current_stream is launch.on_current_stream  # (the real launcher back)
    (args,) = calls
    return args[:3], (out.shape, out.dtype), bool(checked)  # (plan, q, valid_len: the partials move)


@pytest.mark.parametrize("spec", FAST_SPECS)
def test_the_fast_route_launches_what_the_route_launches(spec, monkeypatch):
    """With a plan kept for the call's layouts, a default call skips the route's checks (the
    formats' `unsupported` is not asked) and launches the same plan with the same q (and
    no valid_len) as the route does; the result has the route's shape and dtype."""
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor

    k, v = _flats(spec)
    q = torch.randn(1, 4, 1, 64).half().as_subclass(CudaLookingTensor)
    via_route = _walked_call(spec, k, v, q, False, monkeypatch)
    via_fast = _walked_call(spec, k, v, q, True, monkeypatch)
    assert via_route[2] and not via_fast[2]
    assert via_fast[:2] == via_route[:2]


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=4", "hqmq:S=96,r=4"])
def test_the_fast_route_leaves_to_the_route_what_it_must_decide(spec, monkeypatch):
    """With the plan kept, the fast route declines (None: the route decides) when the auto
    switch keeps the format off the CUDA kernel, and for KIVI's K and V of different
    lengths; a call with an option goes through the route (its checks run); a call on
    another T of the same buffers (int4, HQMQ) takes the kept plan, retargeted."""
    import dataclasses

    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor, cuda_path_on_cpu

    k, v = _flats(spec)
    q = torch.randn(1, 4, 1, 64).half().as_subclass(CudaLookingTensor)
    hq = spec.startswith("hqmq")
    with cuda_path_on_cpu(spec, q, k, v) as launches:
        assert front._fast(q, k, v) is not None and len(launches) == 1
        with monkeypatch.context() as m:
            m.setattr(ch, "AUTO", False) if hq else m.setattr(cd, "CUDA_VERIFIED", frozenset())
            assert front._fast(q, k, v) is None
        if spec.startswith("kivi"):  # (K one window row short of V: the route refuses such a pair)
            assert front._fast(q, dataclasses.replace(k, n_res=k.T_res - 1), v) is None
        else:  # (T is out of the plan key: one token fewer on both sides, the same plan)
            k1, v1 = dataclasses.replace(k, T=k.T - 1), dataclasses.replace(v, T=v.T - 1)
            assert front._fast(q, k1, v1) is not None and launches[-1] == launches[0]
            assert (ch if hq else cd)._PLANS.builds == 1
    assert _walked_call(spec, k, v, q, True, monkeypatch, workspace=None)[2]  # an option given: the route


# ---- the CUDA backends' plans follow a growing cache (an eager decode step: T + 1) ------------
@pytest.mark.parametrize("spec", ["int4", "fp8", "hqmq:S=96,r=4"])
def test_a_kept_plan_follows_the_token_count_instead_of_a_build(spec, monkeypatch):
    """T is out of the CUDA plans' keys (int4 / fp8 / HQMQ): a call on the same buffers with
    another T finds the kept plan and `_retarget`s it (T, splits, tiles per split, by the
    function a build uses) instead of building one per decode step. Checked on a CPU
    through the plan functions (the launch struct of a real build needs the GPU:
    test_a_grown_cache_retargets_its_plan_as_a_build_would); K / V of different T and an
    empty cache are refused as a build refuses them. KIVI: the next test."""
    from kvqbench.kernels import common
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch

    hq = spec.startswith("hqmq")
    mod = ch if hq else cd
    monkeypatch.setattr(common, "ASSUMED_SM_COUNT", 132)  # (an H100's / H200's SMs: splits that move with T)
    k, v = _flats(spec, T=256)
    q = torch.randn(1, 4, 1, 64)
    a = ch._PlanArgs() if hq else cd._Args()
    a.variant = ch.DEFAULT_VARIANT if hq else 0

    def splits_at(f):  # what a build at f.T sets: (splits, tiles per split)
        return ch._token_splits(f, q.device, None, None, a.variant, a.qs) if hq else cd.splits(f.B * f.H, f.T, q.device)

    (a.nsplit, per), a.T = splits_at(k), k.T  # (as a build at T = 256 leaves them)
    if hq:
        a.steps_per_split = per
    else:
        a.per = per
    plan = types.SimpleNamespace(args=a, nsplit=a.nsplit, kind=0, splits_asked=(None, None))
    options = (None, None, None, None, False)
    key, ts = mod._lookup(q, k, v, *options)[1:]
    monkeypatch.setattr(mod, "_PLANS", type(mod._PLANS)(8))
    mod._PLANS.put(key, ts, plan)
    seen = set()
    for T in (255, 17, 1, 256):  # (255: the same 16 tiles as 256, the splits kept; then other tile counts)
        k.T = v.T = T  # (the store grows its flat's T in place the same way)
        assert mod._lookup(q, k, v, *options)[1] == key
        assert mod._plan(q, k, v, None, None, None, None, None if hq else False) is plan
        assert mod._PLANS.builds == 1 and a.T == T
        assert (a.nsplit, a.steps_per_split if hq else a.per) == splits_at(k) and plan.nsplit == a.nsplit
        seen.add(a.nsplit)
    assert len(seen) > 1, seen  # (the split count itself followed T)
    for bad_k, bad_v, why in ((256, 255, "differ in shape"), (0, 0, "empty cache")):
        k.T, v.T = bad_k, bad_v
        with pytest.raises(ValueError, match=why):
            mod._retarget(plan, q, k, v)


def test_a_kept_kivi_plan_follows_its_group_and_window_counts(monkeypatch):
    """KIVI: the plan key says which buffers a side's plan points into (groups or not,
    window rows or not), not their counts; a kept plan is retargeted to the call's counts
    by the function a build fills them with (the struct byte-equal to that function's
    fields on a fresh one), and a side that gains its first group is a new plan."""
    from kvqbench.kernels import common
    from kvqbench.kernels.cuda import decode_attention as cd

    monkeypatch.setattr(common, "ASSUMED_SM_COUNT", 132)
    k, v = _flats("kivi:bits=4", T=300, t0=300)
    q = torch.randn(1, 4, 1, 64)
    options = (None, None, None, None, False)

    def fields_of(k, v):  # what a build fills in of the counts, on an empty struct
        a = cd._Args()
        cd._kivi_token_fields(a, k, v, q.device, None, None, False)
        return a

    a = fields_of(k, v)
    plan = types.SimpleNamespace(args=a, nsplit=a.nsplit, kind=1, splits_asked=(None, None), counts=cd._kivi_counts(k, v))
    key, ts = cd._lookup(q, k, v, *options)[1:]
    monkeypatch.setattr(cd, "_PLANS", type(cd._PLANS)(8))
    cd._PLANS.put(key, ts, plan)
    # (here K: 8 groups of 32 and 44 window rows; V: 5 groups and 140 rows; T = 300 each)
    assert (k.n_groups, k.T_res, v.n_groups, v.T_res) == (8, 44, 5, 140)
    cuts = []
    fill = cd._kivi_token_fields
    monkeypatch.setattr(cd, "_kivi_token_fields", lambda *a: cuts.append(1) or fill(*a))
    # T = 299 (n_main and the tail's tiles kept: the lengths only), then 268 twice (n_main, then
    # the tail's tiles moved) and 300: each a new cut
    for (kg, kr, vg, vr), cut in (((8, 43, 5, 139), 0), ((8, 12, 4, 140), 1), ((7, 44, 5, 108), 1),
                                  ((8, 44, 5, 140), 1)):
        k.n_groups, k.n_res, v.n_groups, v.n_res = kg, kr, vg, vr
        n = len(cuts)
        assert cd._lookup(q, k, v, *options)[1] == key
        assert cd._plan(q, k, v, None, None, None, None, False) is plan and cd._PLANS.builds == 1
        assert len(cuts) - n == cut
        assert bytes(plan.args) == bytes(fields_of(k, v)) and not cd._kivi_moved(plan, k, v)
        assert plan.args.T == k.T and plan.nsplit == plan.args.nsplit
    # K and V of different T: the fast route leaves the call to the route, a retarget refuses
    # it as a build does, and the plan stays as it was
    kept = bytes(plan.args)
    k.n_res = 43
    assert cd.fast(q, k, v) is None
    with pytest.raises(ValueError, match="differ in shape"):
        cd._retarget(plan, q, k, v)
    assert bytes(plan.args) == kept and plan.counts == (8, 44, 5, 140)
    k.n_res = 0  # (a side without window rows: another plan, one that points into no window)
    assert cd._lookup(q, k, v, *options)[1] != key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real plan build needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["int4", "fp8", "hqmq:S=96,r=4", "kivi:bits=4"])
def test_a_grown_cache_retargets_its_plan_as_a_build_would(spec):
    """On the GPU: the kept plan, retargeted to another token count, holds the very launch
    struct a fresh build at that count makes (byte for byte), and the CUDA result equals
    Triton's."""
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch

    hq, kivi = spec.startswith("hqmq"), spec.startswith("kivi")
    mod = ch if hq else cd
    k, v = _flats(spec, T=300, t0=300) if kivi else _flats(spec, T=256)
    q = torch.randn(1, 4, 1, 64, device=DEV, dtype=torch.float16)
    mod._PLANS.clear()
    decode_attention(q, k, v, backend="cuda")
    # KIVI (K: 8 groups and 44 window rows, V: 5 and 140): the counts of the CPU test above
    steps = ([(8, 43, 5, 139), (8, 12, 4, 140), (7, 44, 5, 108), (8, 44, 5, 140)] if kivi else [255, 129, 17, 1])
    assert not kivi or (k.n_groups, k.T_res, v.n_groups, v.T_res) == (8, 44, 5, 140)
    for T in steps:
        if kivi:
            k.n_groups, k.n_res, v.n_groups, v.n_res = T
        else:
            k.T = v.T = T
        builds = mod._PLANS.builds
        got = decode_attention(q, k, v, backend="cuda")
        assert mod._PLANS.builds == builds, "a build per token count"
        [(_, plan)] = mod._PLANS.plans.values()
        fresh = (ch._build_plan(q, k, v, None, None, None, None, None) if hq
                 else cd._build_plan(q, k, v, None, cd.DEFAULT_CTAS_PER_SM, None, None, False))
        assert bytes(plan.args) == bytes(fresh.args) and plan.nsplit == fresh.nsplit
        mod._PLANS.clear()  # the same call through a plan built at this count: the same bits
        assert torch.equal(got, decode_attention(q, k, v, backend="cuda")), f"T={T}"
        mod._PLANS.clear()
        decode_attention(q, k, v, backend="cuda")  # (back to one kept plan for the next step)
        want = decode_attention(q, k, v, backend="triton")
        # the CUDA tests' tolerances between the two backends (test_cuda_hqmq: 5e-3 for HQMQ,
        # fp16 codebook against Triton's fp32 secondaries; test_cuda_decode: TOL for the rest)
        assert rel_err(got, want) < (5e-3 if hq else TOL[torch.bfloat16]), f"T={T}"


@pytest.mark.parametrize("spec", ["int4", "fp8", "hqmq:S=96,r=4", "kivi:bits=4"])
def test_eager_decode_steps_keep_one_cuda_plan_key(spec):
    """What the kept plans rest on: an eager decode step through the quantized cache calls
    the kernels on the store's own buffers with one token more (the store grows its flat's
    T in place), so the CUDA plan key stays the same step after step within the reserved
    capacity (int4 / fp8 / HQMQ: one key; KIVI: a new key only where a side's window
    empties or fills at a flush). With the token count in the key (before 2026-12-06)
    every step was a new key, hence a plan build per layer per token."""
    from kvqbench.kernels.cuda import decode_attention as cd
    from kvqbench.kernels.cuda import hqmq_decode as ch
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    mod = ch if spec.startswith("hqmq") else cd
    B, H, D, T0, steps = 1, 2, 64, 40, 12
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, B, H, T0 + steps, D, generator=g).to(DEV)
    q = torch.randn(B, 4, 1, D, device=DEV)
    keys, stamps = [], []
    with torch.inference_mode():
        cache = QuantizedCache(spec, n_layers=1, fused=True)
        cache.update(x[0, :, :, :T0], x[1, :, :, :T0], 0)
        cache.reserve(T0 + steps)
        layer = cache.layers[0]
        for t in range(T0, T0 + steps):
            cache.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1], 0)
            k, v = layer.stores["K"].kernel_view(), layer.stores["V"].kernel_view()
            assert k.T == v.T == t + 1
            options = (None, None, None, None, False) if mod is ch else (None, cd.DEFAULT_CTAS_PER_SM, None, None, False)
            keys.append(mod._lookup(q, k, v, *options)[1])
            stamps.append((k.stamp, v.stamp))
    bound = 1 + 2 * steps // 32 if spec.startswith("kivi") else 1
    distinct = len(set(keys))
    assert distinct <= bound, f"{distinct} plan keys in {steps} steps"
    # (the memo in front of the key: PlanCache.memo_get serves while both stamps hold)
    assert len(set(stamps)) <= bound, f"{len(set(stamps))} flat stamps in {steps} steps"


def test_scratch_partials_are_kept_per_stream_and_never_while_capturing(monkeypatch):
    """Calls without a workspace take their partials from one buffer per (device, stream,
    thread), grown when a call needs more; another stream, device or thread gets its own;
    while a stream is captured into a CUDA graph, for a device that is not the current one
    (the capture query reads the current device's stream) or on a CPU, each call gets a
    fresh one; `limit` held: the cache starts over. The result tensor is fresh every call."""
    import threading

    from kvqbench.kernels.cuda import launch

    made = []
    scratch = launch.Scratch(limit=4, alloc=lambda size, device: made.append(size) or torch.empty(size))
    streams, current, capturing = {0: 7, 1: 70}, [0], [False]
    monkeypatch.setattr(launch, "_raw_stream", lambda index: streams[index])
    monkeypatch.setattr(launch, "_cur_device", lambda: current[0])
    monkeypatch.setattr(launch, "_capturing", lambda: capturing[0])
    gpu0, gpu1 = types.SimpleNamespace(type="cuda", index=0), types.SimpleNamespace(type="cuda", index=1)
    a = scratch.take(100, gpu0)
    assert scratch.take(100, gpu0) is a and scratch.take(60, gpu0) is a and made == [100]
    b = scratch.take(101, gpu0)  # grown: a new buffer, kept for the later calls
    assert b is not a and scratch.take(80, gpu0) is b and made == [100, 101]
    assert scratch.take(80, gpu1) is not scratch.take(80, gpu1) and len(scratch.bufs) == 1  # not the current device
    current[0] = 1
    d1 = scratch.take(80, gpu1)  # current: kept, its own
    assert d1 is not b and scratch.take(80, gpu1) is d1
    current[0] = 0
    streams[0] = 8
    c = scratch.take(80, gpu0)  # another stream of the same device
    assert c is not b and scratch.take(80, gpu0) is c and len(scratch.bufs) == 3
    other = []
    t = threading.Thread(target=lambda: other.append(scratch.take(80, gpu0)))
    t.start()
    t.join()
    assert other[0] is not c and len(scratch.bufs) == 4  # another thread on the same stream
    capturing[0] = True
    assert all(scratch.take(10, gpu0) is not x for x in (b, c)) and len(scratch.bufs) == 4  # fresh, not kept
    capturing[0] = False
    assert scratch.take(10, torch.device("cpu")) is not c  # (a CPU call: fresh)
    assert scratch.held_bytes() == 4 * (101 + 80 + 80 + 80)
    streams[0] = 9
    scratch.take(10, gpu0)  # one more key: the cache starts over at the limit
    assert len(scratch.bufs) == 1
    cpu = torch.device("cpu")
    (buf, cnt), out, po, pm, pl, optr, cptr = launch.fresh_partials(4, 3, 8, torch.Size((1, 4, 1, 8)),
                                                                     torch.float16, cpu)
    assert cnt is None and cptr is None  # (no counters for a call that is not fused)
    assert out.shape == (1, 4, 1, 8) and out.dtype == torch.float16 and optr == out.data_ptr()
    assert (po, pm, pl) == (buf.data_ptr(), po + 4 * 12 * 8, po + 4 * 12 * 9) and buf.numel() >= 12 * 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and graphs need a CUDA GPU")
@pytest.mark.parametrize("spec", ["int4", "hqmq:S=96,r=4", "kivi:bits=4"])
def test_scratch_partials_across_streams_threads_and_a_graph(spec):
    """On the GPU, calls without a workspace (partials from launch.py's Scratch): on two
    streams at once (a buffer each), and from two threads on one stream (a buffer each),
    give the serial results bit for bit, many times over; a graph captured on a stream the
    scratch serves takes none of its buffers, and replays the eager result after eager
    calls with other inputs ran on that stream in between."""
    import threading

    from kvqbench.kernels.cuda.launch import SCRATCH

    kivi = spec.startswith("kivi")

    def flats(B):  # (long enough for many splits: kernels that overlap the next launch)
        return _flats(spec, B=B, T=300, t0=300) if kivi else _flats(spec, B=B, T=8192, H=8, d=128)

    k, v = flats(1)
    D, H = k.D, k.H
    qs = [torch.randn(1, 4 * H, 1, D, device=DEV, dtype=torch.float16) for _ in range(2)]
    want = [decode_attention(q, k, v, backend="cuda") for q in qs]
    streams = [torch.cuda.Stream() for _ in qs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(20):
        for i, (q, s) in enumerate(zip(qs, streams)):
            with torch.cuda.stream(s):
                outs[i].append(decode_attention(q, k, v, backend="cuda"))
    torch.cuda.synchronize()
    assert all(torch.equal(o, want[i]) for i in range(2) for o in outs[i])
    kept = {key[1] for key in SCRATCH.bufs}
    assert {s.cuda_stream for s in streams} <= kept  # a buffer per stream
    outs = [[], []]

    def loop(i):
        for _ in range(50):
            outs[i].append(decode_attention(qs[i], k, v, backend="cuda"))

    in_threads(loop)
    torch.cuda.synchronize()
    assert all(torch.equal(o, want[i]) for i in range(2) for o in outs[i])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(qs[0], k, v, backend="cuda")  # (warm: the plan built, side's scratch kept)
    side.synchronize()
    before = dict(SCRATCH.bufs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        captured = decode_attention(qs[0], k, v, backend="cuda")
    assert SCRATCH.bufs.keys() == before.keys() and all(SCRATCH.bufs[x] is b for x, b in before.items())  # none taken
    with torch.cuda.stream(side):  # eager calls on the capture's stream: its scratch, grown
        decode_attention(torch.randn(2, 4 * H, 1, D, device=DEV, dtype=torch.float16), *flats(2), backend="cuda")
        decode_attention(qs[1], k, v, backend="cuda")
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want[0])
