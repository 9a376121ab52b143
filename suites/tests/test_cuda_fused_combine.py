"""The fused combine of the CUDA decode kernels (kernels/cuda/library.py `FusedCombine`, OFF by
default): each call's split kernel merges its own partials (the last CTA of each row group,
common.cuh `last_of_group` / `combine_rows`), one launch instead of the split and combine
launches. The fused kernels are another build of each .cu (-DKVQ_FUSED_COMBINE=1).

On a GPU every format and head dim the kernels take (int4, fp8, KIVI-2 / KIVI-4, HQMQ and
HQMQ Med3x at d 64 / 128 / 256) must give the unfused call's output BIT FOR BIT on the same
inputs: T = 1, odd, long, one split and one tile per split, every variant, device valid
lengths down to 0, repeated calls (the counters go back to zero), CUDA graphs captured
and replayed (with and without a workspace), two streams and two threads at once. On a CPU:
the switch, the plumbing of the fused call (the CUDA path walked, host_time.py
`cuda_path_on_cpu`), the counters' scratch and the fused build's flags.
"""
from __future__ import annotations

import os
import threading
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels.cuda import decode_attention as cuda_decode  # noqa: E402
from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq  # noqa: E402
from kvqbench.kernels.cuda import launch, library  # noqa: E402
from kvqbench.suites.tests.cuda_helpers import (CUDA, both_ways, case_flats, cuda_call, cuda_module,  # noqa: E402
                                               in_threads, kivi_views, query, replays_give_the_eager_bits, same_bits,
                                               switch_reads_its_environment, two_stream_case, vlen,
                                               warmed_capture)

pytestmark = pytest.mark.kernels


def _why() -> str | None:
    if not CUDA:
        return "no CUDA device"
    for mod in (cuda_decode, cuda_hqmq):
        why = mod.why_unavailable() or (None if mod._FUSED.load() is not None else mod._FUSED.why)
        if why:
            return why
    return None


WHY = _why()
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"CUDA kernels or their fused build unavailable: {WHY}")

HQMQ, MED3 = "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"
SPECS = ["int4", "fp8-e4m3", "kivi:bits=2", "kivi:bits=4", HQMQ, MED3]
CASES = [(s, D) for s in SPECS for D in (64, 128, 256)] + [("fp8-e5m2", 128)]


fused = library.FUSED_COMBINE.set


module, call = cuda_module, cuda_call


def both(spec, q, kf, vf, **kw):
    """(unfused, fused) outputs of one call on the same inputs."""
    return both_ways(fused, spec, q, kf, vf, **kw)


def counters_at_zero() -> bool:
    torch.cuda.synchronize()
    return all(int(c.count_nonzero()) == 0 for c in launch.SCRATCH.cnts.values())


# ---- GPU: the fused call gives the unfused call's bits -----------------------------------------
@needs_cuda
@pytest.mark.parametrize("spec,D", CASES)
def test_fused_equals_unfused_bit_for_bit(spec, D):
    """T = 1, odd, and a few thousand; GQA groups of 1, 4 and 8 query rows per CTA group;
    one split (no counter), the default splits and one 16-token tile per split (hundreds of
    CTAs a group); q fp16 / bf16, out fp16 / bf16 / fp32."""
    for T in (1, 7, 333, 4099):
        for B, Hq, Hkv in ((1, 8, 2), (2, 16, 2), (3, 3, 3)):
            kf, vf = case_flats(spec, B, Hkv, T, D, seed=T)
            for dtype, out_dtype in ((torch.float16, None), (torch.bfloat16, None), (torch.float16, torch.float32)):
                q = query(B, Hq, D, T + B, dtype)
                for ns in (None, 1, 10_000):
                    a, b = both(spec, q, kf, vf, num_splits=ns, out_dtype=out_dtype)
                    assert same_bits(a, b), (spec, D, T, B, Hq, dtype, out_dtype, ns,
                                             (a.float() - b.float()).abs().max())
    assert counters_at_zero()


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_fused_equals_unfused_on_a_long_cache(spec):
    """T = 32773 at head dim 128 (32 query heads over 8 kv heads): the default splits and
    one tile per split (2049 CTAs in each of the 8 row groups)."""
    kf, vf = case_flats(spec, 1, 8, 32773, 128, seed=5)
    q = query(1, 32, 128, 6)
    for ns in (None, 10_000):
        a, b = both(spec, q, kf, vf, num_splits=ns, out_dtype=torch.float32)
        assert same_bits(a, b), (spec, ns)
    assert counters_at_zero()


@needs_cuda
@pytest.mark.parametrize("spec,D", CASES)
def test_fused_equals_unfused_in_every_variant(spec, D):
    """Every launch variant with an instance at the head dim (each a kernel of its own in the
    fused build), default splits and 7 splits."""
    kf, vf = case_flats(spec, 2, 2, 1500, D, seed=9)
    q = query(2, 8, D, 10)
    if spec.startswith("hqmq"):
        med3 = "med3" in spec
        vs = [v for v in cuda_hqmq.variants(D, med3) if cuda_hqmq.occupancy(v, kf.S, med3, D) > 0]
    else:
        vs = cuda_decode.variants(kf)
    assert vs
    for variant in vs:
        for ns in (None, 7):
            a, b = both(spec, q, kf, vf, variant=variant, num_splits=ns, out_dtype=torch.float32)
            assert same_bits(a, b), (spec, D, variant, ns)


@needs_cuda
@pytest.mark.parametrize("spec,D", CASES)
def test_fused_equals_unfused_with_a_device_valid_length(spec, D):
    """valid_len read on the device, from 0 (every split empty: NaN for int4 / fp8 / KIVI,
    zeros for HQMQ, the same bits either way) to the whole cache; KIVI through graph views
    (the window policies split the count), int4 / fp8 / HQMQ below their T."""
    if spec.startswith("kivi"):
        for i, T in enumerate((1, 161, 300, 1500)):
            q, (kg, vg) = kivi_views(spec, T, 1600, D, seed=10 * i + D)
            for n in (T, 0):
                for ns in (None, 1, 7):
                    a, b = both(spec, q, kg, vg, num_splits=ns, valid_len=vlen(n), out_dtype=torch.float32)
                    assert same_bits(a, b), (spec, D, T, n, ns)
        return
    kf, vf = case_flats(spec, 2, 2, 2000, D, seed=20)
    q = query(2, 8, D, 21)
    for n in (0, 1, 7, 999, 2000):
        for ns in (None, 1, 7):
            a, b = both(spec, q, kf, vf, num_splits=ns, valid_len=vlen(n), out_dtype=torch.float32)
            assert same_bits(a, b), (spec, D, n, ns)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_repeated_fused_calls_leave_their_counters_at_zero(spec):
    """Thirty fused calls in a row on one stream, two inputs and two batch sizes
    interleaved (the scratch counters grown between them), each equal to its unfused call;
    the kept counters and a workspace's are zero after them."""
    cases = []
    for B in (1, 3):
        kf, vf = case_flats(spec, B, 2, 3000, 128, seed=30 + B)
        cases += [(query(B, 8, 128, 40 + B + i), kf, vf) for i in range(2)]
    want = [both(spec, *c)[0] for c in cases]
    with fused(True):
        got = [call(spec, *cases[i % 4]) for i in range(30)]
        q, kf, vf = cases[0]
        ws = (cuda_hqmq.workspace(q, kf) if spec.startswith("hqmq") else cuda_decode.make_workspace(q, kf, vf))
        with_ws = [call(spec, q, kf, vf, workspace=ws).clone() for _ in range(5)]
    assert all(same_bits(g, want[i % 4]) for i, g in enumerate(got))
    assert all(same_bits(w, want[0]) for w in with_ws)
    assert counters_at_zero() and int(ws._kvq_counters.count_nonzero()) == 0


@needs_cuda
@pytest.mark.parametrize("spec,D", CASES)
def test_fused_graph_replays_give_the_unfused_bits(spec, D):
    """Captured with a workspace and a device valid length (the graphed decode step's call),
    replayed after the count and q change: each replay equals the unfused eager call; also
    with a workspace made while the switch was off (its counters made in the capture: a
    memset node replayed before the kernel), and without a workspace (the capture's own
    fresh partials and counters, zeroed by a memset node of the graph)."""
    kivi = spec.startswith("kivi")
    if kivi:
        q, (kf, vf) = kivi_views(spec, 1500, 1600, D, seed=50)
        counts = (1500, 1500, 0, 1500)
    else:
        kf, vf = case_flats(spec, 2, 2, 3000, D, seed=50)
        q = query(2, 8, D, 51)
        counts = (3000, 1, 777, 0, 2049, 3000)
    qs = [query(2, 8, D, 60 + i) for i in range(len(counts))]

    def workspace():
        if spec.startswith("hqmq"):
            return cuda_hqmq.workspace(q, kf, out_dtype=torch.float32)
        return cuda_decode.make_workspace(q, kf, vf, out_dtype=torch.float32, valid_len=True)

    vl = vlen(counts[0])
    with fused(True):  # (the plan and the fused kernel's first launch outside the captures)
        call(spec, q, kf, vf, valid_len=vl, out_dtype=torch.float32)
    torch.cuda.synchronize()
    for made_on in (True, False):
        with fused(made_on):
            ws = workspace()
        assert hasattr(ws, "_kvq_counters") == made_on
        vl.fill_(counts[0])
        graph = torch.cuda.CUDAGraph()
        with fused(True), torch.cuda.graph(graph):
            out = call(spec, q, kf, vf, workspace=ws, valid_len=vl, out_dtype=torch.float32)
        replays_give_the_eager_bits(fused, spec, graph, out, q, kf, vf, vl, counts, qs, (spec, D, made_on))
        assert int(ws._kvq_counters.count_nonzero()) == 0
    if kivi:
        return  # (a KIVI graph view takes a device count only: done above)
    with fused(True):
        graph, out = warmed_capture(lambda: call(spec, q, kf, vf, out_dtype=torch.float32))
    for qn in qs[:3]:
        q.copy_(qn)
        graph.replay()
        assert same_bits(out, both(spec, q, kf, vf, out_dtype=torch.float32)[0]), (spec, D)


@needs_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_fused_calls_on_two_streams_and_two_threads_at_once(spec):
    """Fused calls without a workspace on two streams at once (the scratch partials and
    counters of each stream), from two threads on one stream (each thread's), and with a
    workspace each on two streams: every output equals the serial unfused one."""
    kf, vf, qs, want, streams = two_stream_case(spec, both)
    with fused(True):
        wss = [cuda_hqmq.workspace(q, kf) if spec.startswith("hqmq") else cuda_decode.make_workspace(q, kf, vf)
               for q in qs]
        outs, ws_outs = [[], []], [[], []]
        for _ in range(20):
            for i, (q, s) in enumerate(zip(qs, streams)):
                with torch.cuda.stream(s):
                    outs[i].append(call(spec, q, kf, vf))
                    ws_outs[i].append(call(spec, q, kf, vf, workspace=wss[i]).clone())
        torch.cuda.synchronize()
        assert {s.cuda_stream for s in streams} <= {key[1] for key in launch.SCRATCH.cnts}  # counters per stream
        threaded = [[], []]

        def loop(i):
            for _ in range(30):
                threaded[i].append(call(spec, qs[i], kf, vf))

        in_threads(loop)
    torch.cuda.synchronize()
    for i in range(2):
        assert all(same_bits(o, want[i]) for o in outs[i] + ws_outs[i] + threaded[i]), (spec, i)
    assert counters_at_zero()


# ---- CPU: the switch, the fused call's plumbing, the counters' scratch, the build's flags --------
def test_the_switch_is_off_by_default_and_the_environment_turns_it_on():
    switch_reads_its_environment("KVQBENCH_FUSED_COMBINE", "l.FUSED_COMBINE.on")
    for on, mode in ((False, "split+combine"), (True, "fused")):
        with fused(on):
            assert library.FUSED_COMBINE.mode() == mode


@pytest.mark.parametrize("spec", ["int4", "kivi:bits=4", HQMQ])
def test_the_walked_cuda_path_takes_the_fused_entry_when_on(spec):
    """Through the front (backend auto) on a CPU that walks the CUDA path: off, the launch is
    the default library's entry with its 8 pointers; on, the fused build's entry with the
    counters after them (zeros: a fresh buffer here, or the workspace's own, made once)."""
    from kvqbench.kernels.common import Workspace
    from kvqbench.kernels.decode_attention import decode_attention
    from kvqbench.suites.bench.latency.host_time import CudaLookingTensor, cuda_path_on_cpu
    from kvqbench.suites.bench.toolkit import kernel_flats

    mod = module(spec)
    k, v = kernel_flats(spec, 1, 288 if spec.startswith("kivi") else 128, 2, 64, 288 if "kivi" in spec else 64)
    q = torch.randn(1, 4, 1, 64).as_subclass(CudaLookingTensor)
    plain, fused_entry = ("kvq_hqmq_run", "kvq_hqmq_run_fused") if mod is cuda_hqmq else ("kvq_run", "kvq_run_fused")
    calls = []
    with cuda_path_on_cpu(spec, q, k, v):
        mod._LIB = types.SimpleNamespace(lib=types.SimpleNamespace(**{plain: plain}))
        mod._FUSED = types.SimpleNamespace(entry=lambda name: name)
        mod.on_current_stream = lambda dev, entry, *args: calls.append((entry, args)) or 0
        with fused(False):
            decode_attention(q, k, v)
        with fused(True):
            decode_attention(q, k, v)
            [(_, plan)] = mod._PLANS.plans.values()
            ws = Workspace(plan.rows_q, plan.nsplit, plan.D, "cpu", q.dtype)
            mod.decode(q, k, v, workspace=ws)
            mod.decode(q, k, v, workspace=ws)
    assert [c[0] for c in calls] == [plain, fused_entry, fused_entry, fused_entry]
    assert len(calls[0][1]) == 8 and all(len(c[1]) == 9 for c in calls[1:])
    assert all(c[1][3] is None for c in calls)  # (no row_start)
    cnt = ws._kvq_counters
    assert cnt.dtype == torch.int32 and cnt.numel() >= plan.rows_q and not cnt.any()
    assert calls[2][1][8] == calls[3][1][8] == cnt.data_ptr()  # (made once, with the workspace)


def test_scratch_keeps_fused_counters_beside_its_partials(monkeypatch):
    """`counters`: int32 counters at zero under `take`'s key (per
    device, stream and thread), the counters made again (zeroed) only when a call needs
    more; fresh ones while capturing, for another device or on a CPU; held_bytes and clear
    count them; the unfused take is unchanged."""
    made, zeroed = [], []
    scratch = launch.Scratch(limit=4, alloc=lambda size, device: made.append(size) or torch.empty(size),
                              zeros=lambda n, device: zeroed.append(n) or torch.zeros(n, dtype=torch.int32))
    streams, current, capturing = {0: 7}, [0], [False]
    monkeypatch.setattr(launch, "_raw_stream", lambda index: streams[index])
    monkeypatch.setattr(launch, "_cur_device", lambda: current[0])
    monkeypatch.setattr(launch, "_capturing", lambda: capturing[0])
    gpu0, gpu1 = types.SimpleNamespace(type="cuda", index=0), types.SimpleNamespace(type="cuda", index=1)

    def take_fused(size, n, device):  # what a fused call takes: its partials, then its counters
        return scratch.take(size, device), scratch.counters(n, device)

    buf, cnt = take_fused(100, 8, gpu0)
    assert scratch.take(50, gpu0) is buf and all(x is y for x, y in zip(take_fused(60, 8, gpu0), (buf, cnt)))
    assert take_fused(60, 4, gpu0)[1] is cnt and zeroed == [8] and made == [100]
    cnt2 = take_fused(60, 16, gpu0)[1]  # more row groups: new zeroed counters, kept
    assert cnt2 is not cnt and zeroed == [8, 16] and take_fused(60, 16, gpu0)[1] is cnt2
    streams[0] = 8
    assert take_fused(60, 16, gpu0)[1] is not cnt2 and len(scratch.cnts) == 2  # another stream
    other = []
    t = threading.Thread(target=lambda: other.append(take_fused(60, 16, gpu0)[1]))
    t.start()
    t.join()
    assert other[0] is not cnt2 and len(scratch.cnts) == 3  # another thread
    n = len(zeroed)
    capturing[0] = True
    assert take_fused(60, 16, gpu0)[1] is not cnt2 and len(zeroed) == n + 1 and len(scratch.cnts) == 3
    capturing[0] = False
    assert all(take_fused(60, 16, gpu1)[1] is not c for c in scratch.cnts.values())  # not the current device
    assert take_fused(60, 16, torch.device("cpu"))[1].sum() == 0  # (a CPU call: fresh zeros)
    assert scratch.held_bytes() == sum(b.numel() * 4 for b in scratch.bufs.values()) + 4 * 16 * 3
    scratch.clear()
    assert not scratch.bufs and not scratch.cnts
    part, out, po, pm, pl, optr, cptr = launch.fresh_partials(4, 3, 8, torch.Size((1, 4, 1, 8)), torch.float16,
                                                              torch.device("cpu"), counters=True)
    buf, cnt = part
    assert (po, pm, pl, optr) == (buf.data_ptr(), po + 4 * 12 * 8, po + 4 * 12 * 9, out.data_ptr())
    assert cptr == cnt.data_ptr() and cnt.dtype == torch.int32 and cnt.numel() >= 4 and not cnt.any()


FAKE_NVCC = """#!/bin/sh
[ "$1" = "--version" ] && { echo "fake nvcc 0.1"; exit 0; }
echo "$@" >> "$KVQ_NVCC_CALLS"
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out=$2; shift; done
echo library > "$out"
"""


def test_the_fused_build_is_another_library_of_the_same_source(tmp_path, monkeypatch):
    """The fused kernels come from the same .cu with FUSED_DEFINE added (a fake nvcc records
    its arguments): another file, the default build's flags and file name unchanged."""
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("KVQ_NVCC_CALLS", str(tmp_path / "calls"))
    for mod in (cuda_decode, cuda_hqmq):
        plain = library.compile_library(mod.SOURCE, mod._LIB.stem, (9, 0), mod._LIB.extra)
        fused_lib = library.compile_library(mod.SOURCE, mod._FUSED.stem, (9, 0), mod._FUSED.extra)
        assert plain != fused_lib and mod._LIB.extra == () and mod._FUSED.extra == library.FUSED_DEFINE
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 4 and ["-DKVQ_FUSED_COMBINE=1" in c for c in calls] == [False, True, False, True]
    assert all(c.split()[:len(library.FLAGS)] == library.FLAGS for c in calls)
