"""Host time of an eager fused decode-attention call: the Python a call runs before its
kernel (issue 28: "a thin host path").

`toolkit.host_us(fn)`: the least mean wall time of `fn()` without a synchronisation,
per call, over rounds of `n` calls. On a GPU that is the issue time of an eager call (what thirty layers pay per
token when the GPU outruns the host); the latency section records it beside each eager
fused row ("host_us"). On a CPU, `stubbed_host_us` replaces the launch itself by a no-op
(kernels/triton/common.py `launch_hook`), so what is timed is exactly the Python a GPU
call pays before its kernel: routing, checks, split choice, workspace, launch arguments.
The CUDA backends' Python is walked on a CPU too (`cuda_path_on_cpu`: q passes for a CUDA
tensor, the ctypes launch is stubbed), so their host path can be worked on without a GPU;
the ctypes launch and CUDA's allocator are then left out.

    python -m kvqbench.suites.bench.latency.host_time            # CPU: the table of issue 28
    python -m kvqbench.suites.bench.latency.host_time --d 64 --B 1 8
    python -m kvqbench.suites.bench.latency.host_time --passes 3   # the table three times, least per cell
    python -m kvqbench.suites.bench.latency.host_time --write   # an eager step's cache write per layer
    python -m kvqbench.suites.bench.latency.host_time --fused-combine   # the CUDA combine launched / fused

Sets TRITON_INTERPRET on a CPU before the kernels are imported (as the command line of
the latency suite does).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

from ..toolkit import HOST_US_CALLS, audit_state, host_cpu, host_us, stepping

# formats of issue 28's table: label -> quantizer spec (every fused format of the latency suite)
SPECS = {"int4": "int4", "fp8": "fp8", "kivi4": "kivi:bits=4", "kivi2": "kivi:bits=2", "hqmq": "hqmq:S=96,r=4",
         "hqmq-int8": "hqmq:S=96,r=4,codebook=int8", "hqmq-mixed": "hqmq:S=96,r=4,pack=mixed",
         "med3": "hqmq:S=96,r=4,outliers=med3", "med3-mixed": "hqmq:S=96,r=4,outliers=med3,pack=mixed", "fp16": "fp16"}


@contextlib.contextmanager
def stubbed_launches():
    """Every Triton launch a no-op while inside (the launch arguments are still built)."""
    from ....kernels.triton import common as tc

    old = tc.launch_hook
    tc.launch_hook = lambda kernel, grid, args, kw: None
    try:
        yield
    finally:
        tc.launch_hook = old


def flats(spec: str, B: int, T: int, hkv: int, d: int, t0: int | None = None, device="cpu"):
    """(K, V) kernel-layout caches of `spec`, B sequences of T tokens (t0 encoded, tiled).
    KIVI from 288 tokens (K: a 32-row fp16 window, V: 128 rows, both kept by the tiling),
    so that both sides have window rows, as between flushes of a decode, and a `stepping`
    call can take one off each; the rest from 256."""
    from ..toolkit import kernel_flats

    return kernel_flats(spec, B, T, hkv, d, t0 or (288 if spec.startswith("kivi") else 256), device)


class CudaLookingTensor(torch.Tensor):
    """A CPU tensor the CUDA backends take for a CUDA one (`is_cuda`): with
    `cuda_path_on_cpu`, a CPU walks the CUDA backends' real route and launch path. No
    __torch_function__ (a subclass's would add Python to every attribute read: timed
    here, it is not the GPU call's)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True


@contextlib.contextmanager
def cuda_path_on_cpu(spec: str, q, kf, vf, valid_len: bool = False):
    """Inside, `decode_attention(q, kf, vf)` (q a `CudaLookingTensor`) on a CPU runs the CUDA
    backend of `spec`'s format up to its launch, which is stubbed: the library reads as
    available, the launch records its plan pointer (yielded list) and returns 0, and the
    plan a first default-options call would build (it reads the device: SM count, a
    ctypes struct of device pointers) is put in the plan cache by hand, its token-count
    fields set by the modules' own functions.
    What it leaves out of a GPU call: the ctypes launch itself and CUDA's allocator (a
    call without a workspace allocates its partials and result on the CPU here)."""
    import types

    from ....kernels.cuda import decode_attention as cd, hqmq_decode as ch

    mod = ch if spec.startswith("hqmq") else cd
    launches = []
    stub = types.SimpleNamespace(lib=types.SimpleNamespace(kvq_run=None, kvq_hqmq_run=None))
    fused_stub = types.SimpleNamespace(entry=lambda name: None)
    patched = {"why_unavailable": lambda: None, "_PLANS": type(mod._PLANS)(64), "_LIB": stub, "_FUSED": fused_stub,
               "on_current_stream": lambda dev, entry, *args: launches.append(args[0]) or 0}
    old = {name: getattr(mod, name) for name in patched}
    for name, value in patched.items():
        setattr(mod, name, value)
    try:
        B, hq, _, d = q.shape
        kivi = hasattr(kf, "T_res")
        # what a default-options build leaves of the fields that follow the token count (set
        # by the modules' own functions: a retarget reads them); pointers stay null
        asked = (None, None if mod is ch else cd.DEFAULT_CTAS_PER_SM)
        args = ch._PlanArgs() if mod is ch else cd._Args()
        if mod is ch:
            args.variant = ch.DEFAULT_VARIANT_MED3 if kf.has_outliers else ch.DEFAULT_VARIANT
            ch._resplit(args, kf, q.device, *asked)
            args.T = kf.T
        elif kivi:
            cd._kivi_token_fields(args, kf, vf, q.device, *asked, False)
        else:
            cd._token_fields(args, kf, q.device, *asked)
        plan = types.SimpleNamespace(ptr=0x5EED, nsplit=args.nsplit, rows_q=B * hq, D=d, shape=(B, hq, 1, d),
                                     out_dtype=q.dtype, kind=int(kivi), args=args, splits_asked=asked,
                                     counts=cd._kivi_counts(kf, vf) if kivi else None)
        if mod is ch:
            key, ts = ch._lookup(q, kf, vf, None, None, None, None, valid_len)[1:]
        else:
            key, ts = cd._lookup(q, kf, vf, None, cd.DEFAULT_CTAS_PER_SM, None, None, False)[1:]
        mod._PLANS.put(key, ts, plan)
        yield launches
    finally:
        for name, value in old.items():
            setattr(mod, name, value)


def cuda_path_host_us(spec: str, B: int, T: int, hq: int = 32, hkv: int = 8, d: int = 128,
                      n: int = HOST_US_CALLS["n"], valid_len: bool = False, step: bool = False) -> float:
    """Host microseconds per `decode_attention(q, k, v)` call (backend auto) through the CUDA
    backend, on a CPU (`cuda_path_on_cpu`: the launch stubbed): the Python of a CUDA call,
    to compare with the Triton path's (`stubbed_host_us`) in the same run. NaN where the
    format has no CUDA kernel or takes no valid_len without a graph view."""
    from ....kernels import registry
    from ....kernels.decode_attention import decode_attention, explain_backend

    kf, vf = flats(spec, B, T, hkv, d)
    if "cuda" not in registry.format_of_flat(type(kf)).by_backend or (valid_len and hasattr(kf, "T_res")):
        return float("nan")
    q = torch.randn(B, hq, 1, d).half().as_subclass(CudaLookingTensor)
    kw = {"valid_len": torch.tensor([T], dtype=torch.int32)} if valid_len else {}
    with cuda_path_on_cpu(spec, q, kf, vf, valid_len) as launches:
        if explain_backend(q, kf, vf, **kw).backend != "cuda":
            return float("nan")
        fn = lambda: decode_attention(q, kf, vf, **kw)  # noqa: E731
        timed = stepping(fn, kf, vf) if step else fn
        us = host_us(timed, **{**HOST_US_CALLS, "n": n}, sync=None)
    assert launches, "the CUDA path did not reach its launch"
    return us


def stubbed_host_us(spec: str, B: int, T: int, hq: int = 32, hkv: int = 8, d: int = 128, n: int = HOST_US_CALLS["n"],
                    valid_len: bool = False, step: bool = False) -> float:
    """Host microseconds per `decode_attention(q, k, v)` call (backend auto): on a CPU with
    the launch stubbed out (the Python-side cost of the call), on a GPU issued for real.
    step: each call on another token count (`stepping`), as eager decode steps are."""
    from ....kernels.decode_attention import decode_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kf, vf = flats(spec, B, T, hkv, d, device=dev)
    q = torch.randn(B, hq, 1, d, device=dev).half()
    kw = {}
    if valid_len:
        if hasattr(kf, "T_res"):
            return float("nan")  # KIVI takes valid_len only with graph views
        kw["valid_len"] = torch.tensor([T], dtype=torch.int32, device=dev)
    # on a GPU the launch is real and unsynchronised: what is timed is the issue time (the
    # kernel runs behind it as long as the queue is not full: n is kept below its depth)
    fn = lambda: decode_attention(q, kf, vf, **kw)  # noqa: E731
    with stubbed_launches() if dev == "cpu" else contextlib.nullcontext():
        return host_us(stepping(fn, kf, vf) if step else fn, **{**HOST_US_CALLS, "n": n},
                       sync=None if dev == "cpu" else "auto")


def write_host_us(spec: str | None, B: int, T: int, hkv: int = 8, d: int = 128, n: int = HOST_US_CALLS["n"]) -> float:
    """Host microseconds of one layer's eager one-token write (K and V) through
    `QuantizedCache.update` after a T-token prompt, the device encoders' Triton launches
    real on a GPU (issued, not synchronised) and stubbed on a CPU (step_encode.launch_hook:
    our Python alone); spec None: transformers' DynamicCache.update (torch.cat), the plain
    cache an eager model.generate grows. What an eager decode step pays per layer for its
    cache besides attention (the generate benchmark's eager rows, SmolLM2-135M shape, B=1,
    512-token prompts, 128 new tokens, H100, 2026-12-06: 23.3 ms per token against
    DynamicCache's 19.5, ~120 us per layer more; reports/generate/h100/generate_eager_2026-12-06.md)."""
    from transformers import DynamicCache

    from ....kernels import step_encode
    from ...harness.kv_cache import QuantizedCache

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and spec is None:
        return float("nan")  # (on a CPU its torch.cat copies the history: data, not host time)
    dtype = torch.float16 if dev == "cuda" else torch.float32
    calls = HOST_US_CALLS["warmup"] + HOST_US_CALLS["rounds"] * n
    g = torch.Generator(device=dev).manual_seed(0)
    k, v = (torch.randn(B, hkv, T + 1, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
    cache = DynamicCache() if spec is None else QuantizedCache(spec, n_layers=1, fused=True, capacity=T + calls + 1)
    k1, v1 = k[:, :, T:].contiguous(), v[:, :, T:].contiguous()
    old = step_encode.launch_hook
    if dev == "cpu":  # (the prompt's write too: its bytes do not matter here)
        step_encode.launch_hook = lambda *a, **kw: None
    try:
        cache.update(k[:, :, :T], v[:, :, :T], 0)
        return host_us(lambda: cache.update(k1, v1, 0), **{**HOST_US_CALLS, "n": n},
                       sync=None if dev == "cpu" else "auto")
    finally:
        step_encode.launch_hook = old


@contextlib.contextmanager
def fast_route(on: bool):
    """decode_attention's fast route (kernels/decode_attention.py `FAST_ROUTE`) on or off inside."""
    from ....kernels import decode_attention as front

    old, front.FAST_ROUTE = front.FAST_ROUTE, on
    try:
        yield
    finally:
        front.FAST_ROUTE = old


@contextlib.contextmanager
def fused_combine(on: bool | None):
    """The CUDA kernels' fused combine (kernels/cuda/library.py `FusedCombine`: the split
    kernel merges its partials, one launch a call) on or off inside (None: as it is); on a
    GPU, on builds and loads the fused libraries first (not inside a timing)."""
    from ....kernels.cuda import decode_attention as cd, hqmq_decode as ch, library

    if on is None:
        yield
        return
    if on and torch.cuda.is_available():
        for mod in (cd, ch):
            if mod.why_unavailable() is None and mod._FUSED.load() is None:
                raise RuntimeError(f"the fused build is unavailable: {mod._FUSED.why}")
    with library.FUSED_COMBINE.set(on):
        yield


def combine_mode() -> str:
    """What the CUDA calls launch now: "split+combine" (two launches) or "fused" (one)."""
    from ....kernels.cuda import library

    return library.FUSED_COMBINE.mode()


def host_breakdown(spec: str, B: int, T: int, hq: int = 32, hkv: int = 8, d: int = 128, n: int = 200,
                   top: int = 14, cuda_on_cpu: bool = False) -> str:
    """Where one eager call's host time goes: the route alone (`explain_backend`: which
    kernel takes the call and its checks, as the call routes it), the chosen kernel's
    function alone (plan lookup, buffers, launch), the whole call, each in host us per
    call; then cProfile of n whole calls (its own overhead inflates the small functions:
    read it for shares, not times). cuda_on_cpu: on a CPU, through the CUDA backend's path
    (`cuda_path_on_cpu`) instead of Triton's."""
    import cProfile
    import io
    import pstats

    from ....kernels import registry
    from ....kernels.decode_attention import decode_attention, explain_backend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kf, vf = flats(spec, B, T, hkv, d, device=dev)
    q = torch.randn(B, hq, 1, d, device=dev).half()
    if dev == "cpu" and cuda_on_cpu:
        q = q.as_subclass(CudaLookingTensor)
        stub = cuda_path_on_cpu(spec, q, kf, vf)
    else:
        stub = stubbed_launches() if dev == "cpu" else contextlib.nullcontext()
    sync = None if dev == "cpu" else "auto"
    with stub:
        kern = registry.format_of_flat(type(kf)).by_backend[explain_backend(q, kf, vf).backend]
        parts = {"route": host_us(lambda: explain_backend(q, kf, vf), **{**HOST_US_CALLS, "n": n}, sync=sync),
                 f"{kern.backend} kernel fn": host_us(lambda: kern.fn(q, kf, vf), **{**HOST_US_CALLS, "n": n}, sync=sync),
                 "whole call": host_us(lambda: decode_attention(q, kf, vf), **{**HOST_US_CALLS, "n": n}, sync=sync)}
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            decode_attention(q, kf, vf)
        prof.disable()
        if dev != "cpu":
            torch.cuda.synchronize()
    stats = pstats.Stats(prof, stream=io.StringIO()).stats  # (file, line, name) -> (cc, ncalls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    walked = " (CUDA path walked on the CPU)" if cuda_on_cpu and dev == "cpu" else ""
    head = (f"{spec} B={B} d={d} T={T}{walked} (combine {combine_mode()}): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in parts.items()))
    lines = [f"  {'self us/call':>12s} {'cum us/call':>11s} {'calls/call':>10s}  function (cProfile)"]
    lines += [f"  {tt / n * 1e6:12.2f} {ct / n * 1e6:11.2f} {nc / n:10.1f}  {Path(f).name}:{ln}({name})"
              for (f, ln, name), (_, nc, tt, ct, _) in rows]
    return head + "\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    # The process state of a real decode: anything that imports transformers imports filelock,
    # which on Python >= 3.12 installs an audit hook at import (every id() then runs Python:
    # toolkit.audit_state). The latency suite's process has it; so has this one, so both
    # time the same state (before 2026-12-07 they differed by 3.4 us per HQMQ call).
    import filelock  # noqa: F401

    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.latency.host_time",
                                description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, nargs="+", default=[1, 8])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--d", type=int, nargs="+", default=[128, 64])
    p.add_argument("--formats", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--n", type=int, default=HOST_US_CALLS["n"])
    p.add_argument("--passes", type=int, default=1,
                   help="time the whole table this many times; then per cell the least over the passes and the "
                   "spread (a noisy host's readings move between passes)")
    p.add_argument("--breakdown", action="store_true",
                   help="per format at the first B and d: route / kernel function / whole call, and a cProfile, "
                   "with decode_attention's fast route off and on (with --fused-combine: the fused combine off "
                   "and on instead, the fast route as set)")
    p.add_argument("--fused-combine", action="store_true",
                   help="each row twice in one run: the CUDA kernels' combine as a second launch (split), then fused "
                   "into the split kernel (fused; kernels/cuda/library.py FusedCombine); the default runs the mode "
                   "KVQBENCH_FUSED_COMBINE sets")
    p.add_argument("--write", action="store_true",
                   help="instead: host us of one layer's eager one-token cache write (K and V) after a T-token "
                   "prompt, per format and DynamicCache (Triton launches stubbed on a CPU)")
    p.add_argument("--cuda-write", action="store_true",
                   help="with --write: each row twice in one run, the Triton step encoders (two launches) then "
                   "the one-launch CUDA write where it takes the format (kernels/cuda/step_write.py)")
    a = p.parse_args(argv)
    if a.passes < 1:
        p.error(f"--passes must be at least 1, got {a.passes}")
    how = "launch stubbed" if not torch.cuda.is_available() else "issued on " + torch.cuda.get_device_name()
    if a.write:
        print(f"host us per one-token cache write of one layer (K and V), {how} (Hkv 8, T={a.T}; "
              f"least of 15 means of {a.n})")
        print(f"{'cache':14s} {'d':>4s} " + " ".join(f"{'B=' + str(b):>9s}" for b in a.B))
        from ....kernels.cuda import step_write

        for d in a.d:
            for f in ["DynamicCache"] + list(a.formats):
                for on in (False, True) if a.cuda_write and f != "DynamicCache" else (None,):
                    if on and not step_write.takes(SPECS[f]):
                        continue  # (a format the CUDA write does not take: its row is the Triton one)
                    with step_write.CUDA_WRITE.set(step_write.CUDA_WRITE.on if on is None else on):
                        us = [write_host_us(None if f == "DynamicCache" else SPECS[f], b, a.T, d=d, n=a.n)
                              for b in a.B]
                    name = f + {None: "", False: " triton", True: " cuda"}[on]
                    print(f"{name:14s} {d:4d} " + " ".join(f"{u:9.1f}" for u in us), flush=True)
        return 0
    if a.breakdown:
        for f in a.formats:
            for on in (False, True):  # the fast route (or the fused combine) off, then on (same run)
                switch = fused_combine(on) if a.fused_combine else fast_route(on)
                with switch:  # (on a CPU: the CUDA backend's path walked, where there is one)
                    walk = not torch.cuda.is_available() and f != "fp16"
                    what = "fused combine" if a.fused_combine else "fast route"
                    print(f"[{what} {'on' if on else 'off'}] "
                          + host_breakdown(SPECS[f], a.B[0], a.T, d=a.d[0], n=a.n, cuda_on_cpu=walk), flush=True)
        return 0
    modes = (False, True) if a.fused_combine else (None,)  # None: as KVQBENCH_FUSED_COMBINE set it
    print(f"host us per decode_attention call, {how} (Hq 32, Hkv 8, T={a.T}; least of 15 means of {a.n})")
    cpu, load = host_cpu()
    print(f"process: Python {sys.version.split()[0]}, {audit_state()[1]}; host {cpu}, load {load}")
    print("combine: " + ("split (two launches) then fused (one), each row twice" if a.fused_combine
                         else combine_mode()))
    print("(vl: with a device valid_len; step: each call on another token count, as eager decode steps)")
    head = f"{'format':14s} {'d':>4s} " + "  ".join(" ".join(f"{'B=' + str(b) + s:>9s}" for b in a.B)
                                                 for s in ("", " vl", " step"))
    print(head)

    def cells(f, d, timer):
        """[(row name, [[us per B] per column])] of one format at one head dim (a row per combine mode)."""
        out = []
        for mode in modes if f != "fp16" else (None,):  # (fp16 runs no CUDA kernel of ours)
            with fused_combine(mode):
                cols = [[timer(SPECS[f], b, a.T, d=d, n=a.n, **kw) for b in a.B]
                        for kw in ({}, {"valid_len": True}, {"step": True})]
            out.append((f if mode is None else f"{f} {'fused' if mode else 'split'}", cols))
        return out

    def line(name, d, cols):
        return f"{name:14s} {d:4d} " + "  ".join(" ".join(f"{u:9.1f}" for u in c) for c in cols)

    def table(timer):
        """Every row, `--passes` times over (a pass: every format once, in order); with more
        than one pass, each pass's rows as measured, then per cell the least over the passes
        and the spread (most - least): a noisy host's reading moves a cell by several us
        between passes minutes apart (an H100 on 2026-12-06: one format 20-35 us), and its
        least is the host path's time; a spread that stays large says the host is busy."""
        runs = []
        for i in range(a.passes):
            if a.passes > 1:
                print(f"pass {i + 1} of {a.passes}", flush=True)
            rows = []
            for d in a.d:
                for f in a.formats:
                    for name, cols in cells(f, d, timer):
                        rows.append((name, d, cols))
                        print(line(name, d, cols), flush=True)
            runs.append(rows)
        if a.passes > 1:
            print(f"least of the {a.passes} passes per cell (spread: most - least)")
            for j, (name, d, _) in enumerate(runs[0]):
                per = [r[j][2] for r in runs]
                least = [[min(p[c][b] for p in per) for b in range(len(a.B))] for c in range(3)]
                spread = [[max(p[c][b] for p in per) - least[c][b] for b in range(len(a.B))] for c in range(3)]
                print(line(name, d, least) + "   spread " + "  ".join(
                    " ".join(f"{u:.1f}" for u in c) for c in spread), flush=True)

    # One untimed pass over every format first: on an H100 (2026-12-06) the first format
    # timed (int4) read 7 us above an earlier run in every column while the others matched
    # it; a process's first seconds (clocks, lazy loading, allocator growth) go here instead.
    # Not enough: the next run (host_time_h100_2026-12-06c.txt) still read its first cell
    # (int4, B=1, fixed T) at 26.8 us against 20.5-21.7 in int4's other columns
    for d in a.d:
        for f in a.formats:
            for mode in modes:  # (the fused build loaded here too: fused_combine(True))
                with fused_combine(mode):
                    stubbed_host_us(SPECS[f], a.B[0], a.T, d=d, n=10)
    table(stubbed_host_us)
    if not torch.cuda.is_available():  # the CUDA backends' Python, walked here (cuda_path_on_cpu)
        print("\nthe same through the CUDA backend's path, walked on this CPU (launch stubbed, the plan kept; "
              "no ctypes launch, CPU allocator; nan: no CUDA kernel takes it)")
        print(head)
        table(cuda_path_host_us)
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
