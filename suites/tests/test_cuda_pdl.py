"""Programmatic dependent launch of the CUDA decode kernels' combine (kernels/cuda/library.py
`PDL`, OFF by default; common.cuh `pdl_trigger` / `pdl_wait`): the combine is launched as the
split kernel's programmatic dependent, so its CTAs start while the split kernel's last wave
finishes and wait on the device for the partials.

On a GPU (sm_90+: below it the switch is a no-op and the tests skip) every format and head
dim the kernels take must give the output of the ordinary launch BIT FOR BIT: T = 1, odd,
long, one split and one tile per split, every variant, device valid lengths down to 0, CUDA
graphs captured with PDL on and replayed, two streams at once. A wrong wait (the combine
reading partials before the split grid wrote them) shows as other bits. On a CPU: the switch,
its environment variable and how it reaches the loaded libraries.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels.cuda import decode_attention as cuda_decode  # noqa: E402
from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq  # noqa: E402
from kvqbench.kernels.cuda import library  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import (CUDA, both_ways, case_flats, cuda_call, kivi_views, query,  # noqa: E402
                                               replays_give_the_eager_bits, same_bits, switch_reads_its_environment,
                                               two_stream_case, vlen, warmed_capture)

pytestmark = pytest.mark.kernels


def _why() -> str | None:
    if not CUDA:
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}: PDL needs sm_90+"
    return cuda_decode.why_unavailable() or cuda_hqmq.why_unavailable()


WHY = _why()
needs_pdl = pytest.mark.skipif(WHY is not None, reason=f"PDL not testable here: {WHY}")

HQMQ, MED3 = "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"
SPECS = ["int4", "fp8-e4m3", "kivi:bits=2", "kivi:bits=4", HQMQ, MED3]
CASES = [(s, D) for s in SPECS for D in (64, 128, 256)]

pdl = library.PDL.set
call = cuda_call


def both(spec, q, kf, vf, **kw):
    """(ordinary, PDL) outputs of one call on the same inputs."""
    return both_ways(pdl, spec, q, kf, vf, **kw)


# ---- GPU: the PDL launch gives the ordinary launch's bits --------------------------------------
@needs_pdl
@pytest.mark.parametrize("spec,D", CASES)
def test_pdl_equals_the_ordinary_launch_bit_for_bit(spec, D):
    """T = 1, odd and a few thousand; GQA groups of 1 and 4; one split, the default splits
    and one 16-token tile per split; q fp16 / bf16, out fp16 / fp32."""
    for T in (1, 333, 4099):
        for B, Hq, Hkv in ((1, 8, 2), (3, 3, 3)):
            kf, vf = case_flats(spec, B, Hkv, T, D, seed=T)
            for dtype, out_dtype in ((torch.float16, None), (torch.bfloat16, None), (torch.float16, torch.float32)):
                q = query(B, Hq, D, T + B, dtype)
                for ns in (None, 1, 10_000):
                    a, b = both(spec, q, kf, vf, num_splits=ns, out_dtype=out_dtype)
                    assert same_bits(a, b), (spec, D, T, B, Hq, dtype, out_dtype, ns)


@needs_pdl
@pytest.mark.parametrize("spec", SPECS)
def test_pdl_equals_the_ordinary_launch_on_a_long_cache_and_in_every_variant(spec):
    """T = 32773 at head dim 128 (32 query heads over 8 kv heads, several waves of split CTAs
    before the combine may start), default splits and one tile per split; then every launch
    variant at T = 1500."""
    kf, vf = case_flats(spec, 1, 8, 32773, 128, seed=5)
    q = query(1, 32, 128, 6)
    for ns in (None, 10_000):
        a, b = both(spec, q, kf, vf, num_splits=ns, out_dtype=torch.float32)
        assert same_bits(a, b), (spec, ns)
    kf, vf = case_flats(spec, 2, 2, 1500, 128, seed=9)
    q = query(2, 8, 128, 10)
    if spec.startswith("hqmq"):
        med3 = "med3" in spec
        vs = [v for v in cuda_hqmq.variants(128, med3) if cuda_hqmq.occupancy(v, kf.S, med3, 128) > 0]
    else:
        vs = cuda_decode.variants(kf)
    assert vs
    for variant in vs:
        a, b = both(spec, q, kf, vf, variant=variant, num_splits=7, out_dtype=torch.float32)
        assert same_bits(a, b), (spec, variant)


@needs_pdl
@pytest.mark.parametrize("spec,D", CASES)
def test_pdl_equals_the_ordinary_launch_with_a_device_valid_length(spec, D):
    """valid_len on the device from 0 to the whole cache; KIVI through graph views (its main
    and tail split kernels, then the combine)."""
    if spec.startswith("kivi"):
        for i, T in enumerate((1, 300, 1500)):
            q, (kg, vg) = kivi_views(spec, T, 1600, D, seed=10 * i + D)
            for n in (T, 0):
                for ns in (None, 7):
                    a, b = both(spec, q, kg, vg, num_splits=ns, valid_len=vlen(n), out_dtype=torch.float32)
                    assert same_bits(a, b), (spec, D, T, n, ns)
        return
    kf, vf = case_flats(spec, 2, 2, 2000, D, seed=20)
    q = query(2, 8, D, 21)
    for n in (0, 1, 999, 2000):
        for ns in (None, 7):
            a, b = both(spec, q, kf, vf, num_splits=ns, valid_len=vlen(n), out_dtype=torch.float32)
            assert same_bits(a, b), (spec, D, n, ns)


@needs_pdl
@pytest.mark.parametrize("spec", SPECS)
def test_pdl_graph_replays_give_the_ordinary_bits(spec):
    """Captured with PDL on (the graph keeps the programmatic edge between the split kernel
    and the combine), with a workspace and a device valid length as the graphed decode step
    calls, and without either: each replay after q and the count change equals the ordinary
    eager call."""
    D = 128
    if spec.startswith("kivi"):
        q, (kf, vf) = kivi_views(spec, 1500, 1600, D, seed=50)
        ws = cuda_decode.make_workspace(q, kf, vf, out_dtype=torch.float32, valid_len=True)
        counts = (1500, 0, 1500)
    else:
        kf, vf = case_flats(spec, 2, 2, 3000, D, seed=50)
        q = query(2, 8, D, 51)
        ws = (cuda_hqmq.workspace(q, kf, out_dtype=torch.float32) if spec.startswith("hqmq")
              else cuda_decode.make_workspace(q, kf, vf, out_dtype=torch.float32, valid_len=True))
        counts = (3000, 1, 777, 0, 3000)
    qs = [query(2, 8, D, 60 + i) for i in range(len(counts))]
    vl = vlen(counts[0])
    with pdl(True):
        call(spec, q, kf, vf, valid_len=vl, out_dtype=torch.float32)  # (the plan, outside the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(spec, q, kf, vf, workspace=ws, valid_len=vl, out_dtype=torch.float32)
    replays_give_the_eager_bits(pdl, spec, graph, out, q, kf, vf, vl, counts, qs, (spec,))
    if spec.startswith("kivi"):
        return  # (a KIVI graph view takes a device count only)
    with pdl(True):
        graph, out = warmed_capture(lambda: call(spec, q, kf, vf, out_dtype=torch.float32))
    for qn in qs[:3]:
        q.copy_(qn)
        graph.replay()
        assert same_bits(out, both(spec, q, kf, vf, out_dtype=torch.float32)[0]), spec


@needs_pdl
@pytest.mark.parametrize("spec", SPECS)
def test_pdl_calls_on_two_streams_at_once(spec):
    """PDL calls without a workspace on two streams at once, twenty each, interleaved: every
    output equals the serial ordinary one (a combine waits for its own stream's split grid)."""
    kf, vf, qs, want, streams = two_stream_case(spec, both)
    outs = [[], []]
    with pdl(True):
        for _ in range(20):
            for i, (q, s) in enumerate(zip(qs, streams)):
                with torch.cuda.stream(s):
                    outs[i].append(call(spec, q, kf, vf))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(same_bits(o, want[i]) for o in outs[i]), (spec, i)


# ---- CPU: the switch and how it reaches the libraries ------------------------------------------
def test_the_switch_is_off_by_default_and_the_environment_turns_it_on():
    switch_reads_its_environment("KVQBENCH_PDL", "l.PDL.on")


def test_a_loaded_library_is_told_the_state_now_and_at_every_change(monkeypatch):
    """`attach` tells a library's setter the state at once and at every change of `on`
    (inside `set` and after it); a library on a device below sm_90 is always told 0."""
    sw = library.LaunchOverlap(False)
    told = {"hopper": [], "ampere": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, cap in (("hopper", (9, 0)), ("ampere", (8, 0))):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cap=cap: cap)
        sw.attach(told[name].append)
    with sw.set(True):
        assert sw.on
    sw.on = True
    assert told == {"hopper": [0, 1, 0, 1], "ampere": [0, 0, 0, 0]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (a CPU-only torch: never on)
    cpu = []
    sw.attach(cpu.append)
    assert cpu == [0]
