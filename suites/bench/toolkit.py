"""The benchmark toolkit: the one copy of the helpers every benchmark rig under
suites/bench/ uses (latency/, kernel_sweep/, decode/, cuda/, asv_benchmarks/,
bench_latency.py), so that every figure they write rests on the same data and the
same clock:

- where the run happens: `GPU`, `DEVICE`, `env_info()` (GPU, SMs, memory, driver and
  clocks; torch / triton / CUDA / Python versions; time), `sm_clock_mhz`;
- synthetic data: `synthetic_kv` (fp16 K/V, Gaussian, keys with three 25x outlier
  channels), `encode_kv` (a spec's seeded K and V quantizers and their encodings),
  `fp16_sdpa` (a query and the uncompressed baseline the kernel benches time);
- the tiler: `tile_to(flat, B, T)`, a kernel-layout cache of a few encoded tokens
  repeated to B x T (KIVI-aware: its fp16 window stays last);
- the timer: `timeit_us` (the kernel's time); `host_us` (the host's issue time per
  call) and `host_overhead` (what a CUDA graph saves per call); `synchronize(device)`
  for wall-clock timings (the decode benchmark's steps); `rel_err` for the checks
  beside the timings;
- CUDA-graph capture of a call: `graph_replay`;
- the yardstick: `copy_bandwidth` (device-to-device copy, read + write GB/s);
- the failures a launch can really have: `LAUNCH_ERRORS`, `describe_error`.

It imports no kvqbench module at import time (`encode_kv` imports the quantizers
when called; triton's testing module is imported when something is timed), so
importing it sets up no kernels, and the asv benchmarks can load it from the
checkout by its path (asv_benchmarks/common.py).

GPU timing is `triton.testing.do_bench` (CUDA events, median, L2 flushed before
each call, warm-up first). On the CPU (smoke runs through the Triton
interpreter) it is the median of three wall-clock calls after one warm-up: a
plumbing check, not a figure.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"

# What a launch at a too-large shape or config can raise (shared memory or
# registers exceeded, device memory exhausted); anything else is a bug.
LAUNCH_ERRORS = (OutOfResources, torch.OutOfMemoryError)


def describe_error(e: BaseException, limit: int = 400) -> str:
    return f"{type(e).__name__}: {e}"[:limit]


def _smi(query: str) -> str:
    """One nvidia-smi field of GPU 0, or "" where nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else ""


def audit_state() -> tuple[bool, str]:
    """(whether filelock's audit hook is in this process, what an id() call costs against
    object.__hash__). A Python audit hook, once installed, runs on every id(): filelock >=
    4.3 (module filelock._core._fork) and the GPU image's 3.32.5 (filelock._api) install
    one, `_audit_fork_safety`, on Python >= 3.12 at import (so every process that imports
    transformers has it). Host times per call depend on that state (kernels keep id() off
    their per-call paths: quantizers/derived.py `identity`), so runs record it. The flag is
    read from the modules loaded, not from the timing (a condition --resume compares must
    not move with the machine's noise); the reading (ns, best of 3) shows any other hook."""
    import timeit

    hooked = sys.version_info >= (3, 12) and any(  # (found by its function: the module moved)
        hasattr(mod, "_audit_fork_safety") for name, mod in list(sys.modules.items()) if name.startswith("filelock"))
    x, n = object(), 20000
    t_id = min(timeit.repeat(lambda: id(x), number=n, repeat=3)) / n * 1e9
    t_hash = min(timeit.repeat(lambda: object.__hash__(x), number=n, repeat=3)) / n * 1e9
    note = " (filelock's audit hook is in)" if hooked else ""
    # id() raises an audit event and object.__hash__ does not: unhooked, id() costs about half
    # of it (0.5 on this project's CPU machine), a trivial Python hook lifts it to ~2x (1.0:
    # a factor 2 from either). The GPU hosts of 2026-12-07 read 2.8x (H100: id() 234 ns,
    # H200: 664) while this flag read false: it was filelock's hook under filelock._api, the
    # image's 3.32.5 (an H100 that evening: id() 24 ns after `import torch, triton`, 181 after
    # `import filelock`).
    if not hooked and t_id > t_hash:
        note = " (an audit hook is in: id() costs more than object.__hash__)"
    return hooked, f"id() {t_id:.0f} ns, object.__hash__ {t_hash:.0f} ns" + note


def host_cpu() -> tuple[str, float | None]:
    """(the host CPU's model, its 1-minute load average or None): an eager call's host time
    is this CPU's Python, so runs record both (on 2026-12-07 three H100 hosts read the same
    code's per-call host time 14-20, 16-29 and 20-32 us)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return model or platform.processor() or "unknown CPU", load


def env_info() -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    from ..compare.provenance import kvqbench_version

    info["kvqbench"] = kvqbench_version()  # the commit measured (KVQBENCH_COMMIT names it on a copy)
    from ...kernels.cuda import library as cuda_library

    # how the CUDA calls launch their combine (library.py's switches: an A/B of either is two runs)
    info["cuda_combine"] = cuda_library.FUSED_COMBINE.mode() + (", PDL" if cuda_library.PDL.on else "")
    info["filelock_audit_hook"], info["id_call"] = audit_state()  # (the state, compared by --resume; the reading)
    info["host_cpu"], info["host_load_1min"] = host_cpu()  # (readings: --resume lets them differ)
    if GPU:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_mem_GiB=round(p.total_memory / 2**30, 1),
                    driver=_smi("driver_version"), sm_clock_max_MHz=_smi("clocks.max.sm"),
                    sm_clock_now_MHz=_smi("clocks.sm"), mem_clock_max_MHz=_smi("clocks.max.mem"))
    else:
        info.update(gpu="none (CPU smoke run, Triton interpreter)", sm_count=0)
    return info


def sm_clock_mhz(env: dict) -> float:
    """The maximum SM clock nvidia-smi reported, 0 where it reported none."""
    try:
        return float(env.get("sm_clock_max_MHz") or 0)
    except ValueError:  # e.g. "[N/A]"
        return 0.0


def timeit_us(fn, rep_ms: int = 100, warmup_ms: int = 25) -> float:
    """Median time of fn in microseconds (GPU: CUDA events, L2 flushed before each call,
    `warmup_ms` of warm-up calls, then calls for about `rep_ms`)."""
    if GPU:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[1] * 1e6


def synchronize(device) -> None:
    """Wait for the device's queued work where it is a CUDA device (a CPU has none)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# How the latency suite's eager rows and host_time.py both time a call's host cost, so the
# two tools give one figure (with 5 rounds of 20 calls the suite read 37-73 us where
# host_time read 25-45 for the same calls on the H200, 2026-12-05)
HOST_US_CALLS = dict(n=100, warmup=20, rounds=15)


def host_us(fn, n: int = 200, warmup: int = 1, rounds: int = 1, sync="auto") -> float:
    """Host time per call: n calls enqueued back to back (no sync between them; keep n
    well under the launch queue's depth, ~1000 launches, so the host is timed, not the
    GPU), on the host clock; the least over `rounds` of the per-call mean (a loaded
    machine only adds). `warmup` untimed calls first (plans built, kernels compiled).
    `sync` runs before each round and after the last: "auto" is torch.cuda.synchronize
    where CUDA is available, else nothing (CPU: launches stubbed, the Python side alone).
    At B=1 an eager call costs max(this, its GPU time) once the queue runs dry (GPU)."""
    if sync == "auto":
        sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    for _ in range(warmup):
        fn()
    means = []
    for _ in range(rounds):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - t0) / n * 1e6)
    if sync is not None:
        sync()
    return min(means)


def host_overhead(plain, replay, n: int = 200) -> float:
    """Wall time per call of `plain` minus that of `replay` (a CUDA graph of the same
    work), back to back without L2 flushes: the host cost a graph removes (GPU)."""
    out = []
    for fn in (plain, replay):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return out[0] - out[1]


def rel_err(a, b) -> float:
    """||a - b|| / ||b||, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


# The copy-bandwidth yardstick. Two copies existed: this one (the latency suite's) and the
# kernel sweep's (2 GiB of uninitialised fp16, do_bench with rep 50 ms, a bare float). They
# measured the same thing, a device-to-device copy's read + write bytes over its median
# time, so one is kept: this one, because it goes through the same timer as the kernels
# (so it also runs in a CPU smoke run), times longer (rep 200 ms: a steadier median), and
# returns the bytes and the time beside the GB/s, so the yardstick in a result file can be
# checked. Its default size is the sweep's 2 GiB, far beyond any L2; the latency suite
# passes its config's `copy_bytes`.
COPY_BYTES = 2 << 30


def copy_bandwidth(nbytes: int = COPY_BYTES) -> dict:
    """Device-to-device copy of nbytes: the yardstick every GB/s figure is divided by."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 256)
    dst = torch.empty_like(src)
    t = timeit_us(lambda: dst.copy_(src), rep_ms=200)
    del src, dst
    return {"bytes_copied": nbytes, "time_us": t, "GBps_read_plus_write": 2 * nbytes / t / 1e3}


OUTLIER_CHANNELS_SCALE = 25.0


def synthetic_kv(B: int, H: int, T: int, d: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 K and V `[B, H, T, d]`, Gaussian; three key channels scaled 25x (outliers)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, d, generator=g)
    for c in (3, d // 2 + 1, d - 2):
        k[..., c] *= OUTLIER_CHANNELS_SCALE
    v = torch.randn(B, H, T, d, generator=g)
    return k.half().to(device), v.half().to(device)


def encode_kv(spec: str, k: torch.Tensor, v: torch.Tensor, seed: int = 3):
    """((qk, pk), (qv, pv)): `spec`'s K and V quantizers (seeded) and their encodings of
    k and v (the Packed caches; kernels.layout.flatten puts them in the kernel layout)."""
    from kvqbench.quantizers import get_quantizer  # absolute: also when loaded by path (asv)

    qk, qv = get_quantizer(spec, role="K", seed=seed), get_quantizer(spec, role="V", seed=seed)
    return (qk, qk.encode(k)), (qv, qv.encode(v))


def fp16_sdpa(B: int, T: int, device, hq: int = 32, hkv: int = 8, d: int = 128):
    """(q, call): a random fp16 query `[B, hq, 1, d]` and one decode step of torch SDPA
    (native GQA, torch's default backend) over random fp16 K/V `[B, hkv, T, d]`, the
    baseline the kernel benches time beside the fused kernels (drawn in that order from
    torch's global generator). The K/V live as long as the call does."""
    q = torch.randn(B, hq, 1, d, device=device).half()
    k = torch.randn(B, hkv, T, d, device=device).half()
    v = torch.randn(B, hkv, T, d, device=device).half()
    return q, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def tile_to(flat, B: int, T: int):
    """A kernel-layout cache (a kernels.layout `*Flat` of the encoded tokens) tiled to B
    sequences of T tokens (`*Flat.tile`: its valid tokens repeated along batch and
    tokens). KIVI: the quantized groups repeat, the fp16 window (its own length for K
    and V) stays last. ValueError where B or T does not fit (not a multiple of the
    encoded sequences or tokens, or of KIVI's groups)."""
    if B % flat.B:
        raise ValueError(f"B={B} is not a multiple of the encoded {flat.B} sequences")
    if hasattr(flat, "T_res"):  # a KIVIFlat, told by its fp16 window (the toolkit imports no kernels)
        if (T - flat.T_res) % flat.group:
            raise ValueError(f"T={T} does not fit KIVI {flat.role} groups of {flat.group} after a "
                             f"{flat.T_res}-token fp16 window")
        return flat.tile(B // flat.B, (T - flat.T_res) // flat.group)
    if T % flat.T:
        raise ValueError(f"T={T} is not a multiple of the encoded {flat.T} tokens")
    return flat.tile(B // flat.B, T // flat.T)


def kernel_flats(spec: str, B: int, T: int, H: int, d: int, t0: int, device="cpu"):
    """(K, V) kernel-layout caches (kernels.layout `*Flat`s) of `spec`: t0 synthetic tokens
    of one sequence encoded, flattened and tiled to B sequences of T tokens (`tile_to`).
    Imports the kernels' layout when called."""
    from kvqbench.kernels.layout import flatten  # absolute: also when loaded by path (asv)

    k, v = synthetic_kv(1, H, t0, d, device)
    (_, pk), (_, pv) = encode_kv(spec, k, v)
    return tile_to(flatten(pk, "K"), B, T), tile_to(flatten(pv, "V"), B, T)


def stepping(fn, kf, vf):
    """fn() on a token count one less every other call (the flats' T; KIVI: one window row
    fewer on each side), as eager decode steps call the kernels on one more token each
    time: what a launch plan keyed by the token count would make anew on every call (the
    latency suite's `host_us_step`, host_time.py's step column). The flats change in
    place, as the decode store's do; `.restore()` puts them back. ValueError for a KIVI
    layout with a side without window rows (no row to take off)."""
    if hasattr(kf, "T_res"):  # a KIVIFlat (told by its window, as tile_to tells it)
        base = [(f, f.n_res, f.T_res) for f in (kf, vf)]  # (n_res None: all the window's rows)
        if min(rows for *_, rows in base) < 1:
            raise ValueError("stepping a KIVI layout takes a window row off each side: one has none")

        def shift(s):
            for f, n_res, rows in base:
                f.n_res = rows - s if s else n_res
    else:
        T = kf.T

        def shift(s):
            kf.T = vf.T = T - s
    state = [0]

    def call():
        state[0] ^= 1
        shift(state[0])
        return fn()

    call.restore = lambda: shift(0)
    return call


def graph_replay(fn):
    """fn() captured once in a CUDA graph (warmed up on a side stream first, so that
    kernels compile and plans/workspaces are built outside the capture); returns the
    replay. The graph's output buffers come from its own memory pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
