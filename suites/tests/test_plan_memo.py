"""The plan memo on flats (issue 28, host time per eager call): every `*Flat` carries a
`stamp` renewed by any field set but the token counts (kernels/layout.py `Stamped`), and
the CUDA backends' plan caches leave a call's plan on its K flat, served while both flats
keep their stamps and the call's other facts hold (kernels/common.py `PlanCache.memo_get`),
instead of building the full key (an HQMQ call reads 16 tensors and 18 fields for it).
Also here: the fast route of a call with a valid_len (it takes the plan made for one).

On a CPU the CUDA path is walked (host_time.py `cuda_path_on_cpu`: the launch stubbed);
the last test needs a CUDA GPU. No timing here (host_time.py times it)."""
from __future__ import annotations

import copy
import dataclasses
import os
import pickle

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from kvqbench.kernels import decode_attention as front  # noqa: E402
from kvqbench.kernels.common import PlanCache  # noqa: E402
from kvqbench.kernels.decode_attention import decode_attention  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import DEV, cuda_module, kivi_views  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import small_flats as _flats  # noqa: E402

pytestmark = pytest.mark.kernels

SPECS = ["int4", "fp8", "kivi:bits=4", "hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3", "fp16"]


def _count_field(f) -> str:
    return "n_groups" if hasattr(f, "n_groups") else "T"


def _tensor_field(f) -> str:
    return next(x.name for x in dataclasses.fields(f) if isinstance(getattr(f, x.name), torch.Tensor))


@pytest.mark.parametrize("spec", SPECS)
def test_a_field_set_renews_the_stamp_and_a_token_count_does_not(spec):
    """A token count set (the store's per-step growth) keeps the stamp; any other field set
    to another object renews it (to itself: no change, no renewal); replace, copy,
    deepcopy and pickle give stamps of their own and no memo; no two flats share one."""
    k, v = _flats(spec)
    s0 = k.stamp
    count = _count_field(k)
    setattr(k, count, getattr(k, count) - 1)
    assert k.stamp == s0
    name = _tensor_field(k)
    setattr(k, name, getattr(k, name))
    assert k.stamp == s0
    setattr(k, name, getattr(k, name).clone())
    assert k.stamp > s0
    k._plan_memo = ("a memo",)
    copies = [dataclasses.replace(k), copy.copy(k), copy.deepcopy(k), pickle.loads(pickle.dumps(k))]
    stamps = [k.stamp, v.stamp] + [c.stamp for c in copies]
    assert len(set(stamps)) == len(stamps), stamps
    assert all(c._plan_memo is None for c in copies)
    assert all(getattr(c, count) == getattr(k, count) for c in copies)  # (the fields themselves copied)


def test_the_memo_serves_only_the_flats_and_facts_it_was_left_for():
    """memo_get answers the plan memo_put left while k and v are the same objects with their
    stamps, the facts are equal and the cache is the one (not cleared since); a token count
    moved keeps it; each other change voids it."""
    k, v = _flats("hqmq:S=96,r=4")
    cache, plan, facts = PlanCache(4), object(), ("q shape", "options")
    assert cache.memo_get(k, v, facts) is None
    assert cache.memo_put(k, v, facts, plan) is plan
    k.T = v.T = k.T - 5
    assert cache.memo_get(k, v, facts) is plan

    def voided(change):
        cache.memo_put(k, v, facts, plan)
        return cache.memo_get(*change()) is None

    assert voided(lambda: (k, v, ("q shape", "other options")))
    assert voided(lambda: (k, dataclasses.replace(v), facts))
    assert voided(lambda: (v, k, facts))
    assert voided(lambda: setattr(k, "codes", k.codes.clone()) or (k, v, facts))
    assert voided(lambda: setattr(v, "radius", v.radius.clone()) or (k, v, facts))
    assert voided(lambda: cache.clear() or (k, v, facts))
    cache.memo_put(k, v, facts, plan)
    assert PlanCache(4).memo_get(k, v, facts) is None  # (another cache: another module's plans)
    for i in range(5):  # (full at 4: the fifth put clears, as clear() does)
        cache.put(("key", i), (), object())
    assert cache.memo_get(k, v, facts) is None


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=4", "hqmq:S=96,r=4"])
def test_a_field_set_in_place_is_not_served_from_the_memo(spec):
    """Through the walked CUDA path: the fast route serves a repeated call from the memo; a
    tensor field set in place on the same flat object (KIVI's window flush, a Med3x build)
    voids it, and the full key then finds no plan for the new tensor (None: the route
    decides, as it would for any new layout)."""
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor, cuda_path_on_cpu

    k, v = _flats(spec)
    q = torch.randn(1, 4, 1, 64).half().as_subclass(CudaLookingTensor)
    with cuda_path_on_cpu(spec, q, k, v) as launches:
        assert front._fast(q, k, v) is not None and k._plan_memo is not None
        assert front._fast(q, k, v) is not None and launches == [launches[0]] * 2
        name = _tensor_field(k) if not spec.startswith("kivi") else "residual"
        setattr(k, name, getattr(k, name).clone())
        assert front._fast(q, k, v) is None and len(launches) == 2


@pytest.mark.parametrize("spec", ["int4", "fp8", "hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3"])
def test_the_fast_route_takes_a_valid_len_call_as_the_route_does(spec, monkeypatch):
    """A call with a valid_len (on a plan kept for valid_len calls) skips the route's checks
    and launches the plan the route launches, with the same q and valid_len; a valid_len of
    the wrong dtype is refused by the fast route as by the route; a host-count KIVI flat
    takes no valid_len on the fast route either (the route refuses it)."""
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor, cuda_path_on_cpu

    mod = cuda_module(spec)
    k, v = _flats(spec)
    q = torch.randn(1, 4, 1, 64).half().as_subclass(CudaLookingTensor)
    vl = torch.tensor([k.T - 3], dtype=torch.int32)
    runs, real = {}, mod.unsupported
    for fast in (False, True):
        checked, calls = [], []
        monkeypatch.setattr(mod, "unsupported", lambda *a: checked.append(1) or real(*a))
        monkeypatch.setattr(front, "FAST_ROUTE", fast)
        with cuda_path_on_cpu(spec, q, k, v, valid_len=True):
            stub = mod.on_current_stream  # (by hand: the walk's exit restores the real launcher)
            mod.on_current_stream = lambda dev, entry, *a: calls.append(a[:3]) or stub(dev, entry, *a)
            out = decode_attention(q, k, v, valid_len=vl)
            with pytest.raises(ValueError, match="valid_len"):
                decode_attention(q, k, v, valid_len=vl.long())
        runs[fast] = (calls, bool(checked), out.shape)
    (route_calls, route_checked, shape), (fast_calls, fast_checked, fast_shape) = runs[False], runs[True]
    assert route_checked and not fast_checked and shape == fast_shape
    assert fast_calls == route_calls and fast_calls[0][2] == vl.data_ptr()

    kk, kv = _flats("kivi:bits=4")
    with cuda_path_on_cpu("kivi:bits=4", q, kk, kv):
        assert front._fast(q, kk, kv) is not None
        assert front._fast(q, kk, kv, torch.tensor([kk.T], dtype=torch.int32)) is None
        with pytest.raises(ValueError, match="valid_len"):
            decode_attention(q, kk, kv, valid_len=torch.tensor([kk.T], dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a CUDA GPU")
@pytest.mark.parametrize("spec", ["int4", "fp8", "hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3"])
def test_memoised_and_valid_len_fast_calls_give_a_fresh_plans_bits_on_the_gpu(spec):
    """On the GPU, backend auto, as an eager decode's token count moves within one set of
    buffers: calls through the fast route (the memo, or the full key then the memo; with a
    valid_len equal to T or without) give bit for bit what a plan built afresh gives (valid_len
    = T is the plain call's grid and tokens: test_cuda_*'s valid_len_equal_to_T tests)."""
    mod = cuda_module(spec)
    k, v = _flats(spec, T=320)
    q = torch.randn(1, 4, 1, 64, device=DEV, dtype=torch.float16)
    vl = torch.tensor([320], dtype=torch.int32, device=DEV)
    if front.explain_backend(q, k, v).backend != "cuda":
        pytest.skip("auto does not route this format to CUDA here")
    mod._PLANS.clear()
    decode_attention(q, k, v), decode_attention(q, k, v, valid_len=vl)  # (both plans made, by the route)
    for n in (299, 171, 17, 1):
        k.T = v.T = n
        vl.fill_(n)
        plain = [decode_attention(q, k, v) for _ in range(2)]  # (the full key, then the memo)
        with_vl = [decode_attention(q, k, v, valid_len=vl) for _ in range(2)]
        for out in plain[1:] + with_vl:
            assert torch.equal(out, plain[0]), f"T={n}"
        mod._PLANS.clear()
        assert torch.equal(decode_attention(q, k, v), plain[0]), f"T={n}: a fresh plan's bits differ"
        decode_attention(q, k, v, valid_len=vl)  # (the valid_len plan again, for the next n's fast route)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a CUDA GPU")
def test_a_kivi_graph_view_takes_the_fast_route_with_its_valid_len_on_the_gpu(monkeypatch):
    """On the GPU: KIVI graph views (the device-position steps' flats, KernelStore.graph_view)
    with a valid_len take the fast route once their plan is made (the route's checks are not
    asked again), and its result equals the routed call's bit for bit as the device count
    moves across a flush."""
    from kvqbench.kernels.cuda import decode_attention as cd

    q, (kg, vg) = kivi_views("kivi:bits=4", 300, 400, 64, seed=5)
    vl = torch.tensor([300], dtype=torch.int32, device=DEV)
    if front.explain_backend(q, kg, vg, valid_len=vl).backend != "cuda":
        pytest.skip("auto does not route KIVI graph views to CUDA here")
    decode_attention(q, kg, vg, valid_len=vl)  # (the route: the plan made)
    checked, real = [], cd.unsupported
    monkeypatch.setattr(cd, "unsupported", lambda *a: checked.append(1) or real(*a))
    for n in (300, 288, 257, 256, 100, 1):
        vl.fill_(n)
        fast = decode_attention(q, kg, vg, valid_len=vl)
        assert not checked, f"n={n}: the route's checks ran"
        with monkeypatch.context() as m:
            m.setattr(front, "FAST_ROUTE", False)
            assert torch.equal(fast, decode_attention(q, kg, vg, valid_len=vl)), f"n={n}"
        checked.clear()


_AUDIT_PROBE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.suites.bench.latency.host_time import CudaLookingTensor, cuda_path_on_cpu
from kvqbench.suites.bench.toolkit import kernel_flats, stepping

events = []
sys.addaudithook(lambda event, args: events.append(event) if event == "builtins.id" else None)
for spec in sys.argv[1:]:
    kivi = spec.startswith("kivi")  # (KIVI: 300 tokens, 44 of them in the window, which stepping moves)
    k, v = kernel_flats(spec, 1, 300 if kivi else 128, 2, 64, 300 if kivi else 64, "cpu")
    q = torch.randn(1, 4, 1, 64).half().as_subclass(CudaLookingTensor)
    with cuda_path_on_cpu(spec, q, k, v) as launches:
        step = stepping(lambda: decode_attention(q, k, v), k, v)
        step()  # (the memo left on the flats by the first call)
        del events[:]
        for _ in range(20):
            step()
        assert len(launches) == 21, (spec, len(launches))
        print(spec, len(events))
"""


def test_an_eager_step_calls_no_audited_id():
    """An eager step's decode call (the CUDA path walked: memo, retarget, launch) calls no
    id(): each call is audited, and once a library has installed a Python audit hook
    (filelock >= 4.3 on CPython >= 3.12, at its import) each costs a Python call (an
    HQMQ plan key's 16 ids: ~3 us on an H100 host). In a subprocess: a hook cannot be removed."""
    import subprocess
    import sys

    specs = ["int4", "fp8", "kivi:bits=4", "hqmq:S=96,r=4", "hqmq:S=24,r=3,outliers=med3"]
    r = subprocess.run([sys.executable, "-c", _AUDIT_PROBE, *specs], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = dict(line.rsplit(" ", 1) for line in r.stdout.strip().splitlines())
    assert set(counts) == set(specs) and all(n == "0" for n in counts.values()), counts
