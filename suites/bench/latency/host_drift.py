"""Which part of an eager call's host time grows after other work in the same process.

On an H100 (2026-12-07, reports/latency/h100_2026-12-07b/host_probe2.txt) host_time.py read
an HQMQ call at 19.2 us before the latency suite ran in its process and 22.6 us after it. The
suite's own host column agrees with the second figure. Of the call's parts, only the plan-key
lookup grew (`hqmq_decode._lookup`, 2.9 -> 6.3 us); the launch, the allocations and pure
Python did not. This tool times each step of that key and of the call (`parts`), then runs
the latency suite at B=1 in the same process, then times them again, and prints both with
the difference. A run therefore names the step that grows.

What grew was id(): CPython audits each call ("builtins.id"), and filelock >= 4.3 installs
a Python audit hook on CPython >= 3.12 when it is imported, which the suite does
(reproduced on a CPU under Python 3.12: id() 25 -> 445 ns; the GPU image runs 3.12). The
keys now take `quantizers.derived.identity` (object.__hash__, not audited); the row "id()
of the same (audited)" keeps the hook's cost in view, and `state` says whether the hook is in.

    python -m kvqbench.suites.bench.latency.host_drift            # GPU: HQMQ, B=1, T=32k, the suite at B=1
    python -m kvqbench.suites.bench.latency.host_drift --spec int4 --T 4096

On a CPU the CUDA backend's Python is walked with its launch stubbed
(`host_time.cuda_path_on_cpu`), and the suite runs its smoke shapes. That run tests the
plumbing; its figures are not a GPU host's.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
from operator import attrgetter

import torch

# (toolkit and host_time import triton: on a CPU, `main` sets TRITON_INTERPRET before they
# are imported, or the Triton kernels the suite runs would not be the interpreter's)
CALLS = None  # host_us's rounds (None: toolkit.HOST_US_CALLS, as host_time.py)

# the flat fields a CUDA plan key reads besides its tensors (hqmq_decode._lookup)
FLAT_FIELDS = attrgetter("B", "H", "D", "S", "code_bits", "r_bits", "log_radius", "table_mode", "codebook")


def parts(q, kf, vf, n: int | None = None) -> dict:
    """Host us per call of each step of an eager call on (kf, vf) through its CUDA backend's
    fast route, and of the pieces of that route's plan key. HQMQ flats: every step of
    `hqmq_decode._lookup`; other formats: the whole lookup of `cuda.decode_attention`."""
    from ....kernels.cuda import decode_attention as cd
    from ....kernels.cuda import hqmq_decode as hq
    from ....kernels.decode_attention import decode_attention
    from ....quantizers.derived import identity, tensor_version
    from ..toolkit import HOST_US_CALLS, host_us

    sync = "auto" if torch.cuda.is_available() else None

    def us(fn):
        calls = CALLS or HOST_US_CALLS
        return host_us(fn, **{**calls, "n": n or calls["n"]}, sync=sync)

    decode_attention(q, kf, vf)  # (the plan made, as by an eager decode's first call)
    hqmq = type(kf).__name__ == "HQMQFlat"
    out = {"call": us(lambda: decode_attention(q, kf, vf))}
    if hqmq:
        key = hq._lookup(q, kf, vf, None, None, None, None, False)[1]
        out.update({
            "fast route": us(lambda: hq.fast(q, kf, vf)),
            "plan memo (the route's lookup)": us(lambda: hq._find(q, kf, vf, None, None, None, None, False)),
            "plan key lookup (full key)": us(lambda: hq._lookup(q, kf, vf, None, None, None, None, False)),
            "key: tensors read": us(lambda: hq._plan_tensors(kf, vf)),
            "key: tensor identities": us(lambda: tuple(map(identity, hq._plan_tensors(kf, vf)))),
            "id() of the same (audited)": us(lambda: tuple(map(id, hq._plan_tensors(kf, vf)))),
            "key: flat fields": us(lambda: (FLAT_FIELDS(kf), FLAT_FIELDS(vf))),
            "key: codebook versions": us(lambda: (tensor_version(kf.sec), tensor_version(vf.sec))),
            "key: hash": us(lambda: hash(key)),
            "key: dict get": us(lambda: hq._PLANS.plans.get(key)),
        })
    else:
        opts = (None, cd.DEFAULT_CTAS_PER_SM, None, None)
        out["plan memo (the route's lookup)"] = us(lambda: cd._find(q, kf, vf, *opts))
        out["plan key lookup (full key)"] = us(lambda: cd._lookup(q, kf, vf, *opts))
    out.update({
        "q.shape / dtype / device": us(lambda: (q.shape, q.dtype, q.device)),
        "pure python": us(lambda: sum(range(200))),
    })
    return out


def state() -> dict:
    """What of the process the steps could depend on."""
    from ....kernels.cuda import hqmq_decode as hq
    from ..toolkit import audit_state

    return {"hqmq plans kept": len(hq._PLANS.plans), "torch function modes": torch._C._len_torch_function_stack(),
            "python objects": len(gc.get_objects()), "python": sys.version.split()[0], "id()": audit_state()[1]}


def run_suite(T: int, out: str) -> None:
    """The latency suite at B=1 in this process (the work whose aftermath is measured); the
    smoke shapes on a CPU."""
    from .__main__ import main as latency_main

    if torch.cuda.is_available():
        latency_main(["--out", out, "--tokens", str(T), "--batches", "1", "--no-tune", "--skip-encode",
                      "--skip-memory", "--budget-s", "300"])
    else:
        latency_main(["--smoke", "--out", out, "--skip-encode", "--skip-memory"])


def main(argv=None, between=None) -> int:
    """`between(T, out_dir)`: the work run between the two timings (default: `run_suite`)."""
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import host_time as ht

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=ht.SPECS["hqmq"], help="quantizer spec of the flats (default HQMQ S=96 r=4)")
    p.add_argument("--T", type=int, default=32768, help="cached tokens of the timed call and of the suite's rows")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--n", type=int, help="calls per timed round (default: host_time.py's)")
    a = p.parse_args(argv)
    dev = "cuda" if gpu else "cpu"
    kf, vf = ht.flats(a.spec, 1, a.T, 8, a.d, device=dev)
    q = torch.randn(1, 32, 1, a.d, device=dev).half()
    if not gpu:
        q = q.as_subclass(ht.CudaLookingTensor)

    def timed():
        walk = contextlib.nullcontext() if gpu else ht.cuda_path_on_cpu(a.spec, q, kf, vf)
        with walk:
            return parts(q, kf, vf, a.n)

    before, state_before = timed(), state()
    with tempfile.TemporaryDirectory() as tmp:
        (between or run_suite)(a.T, tmp)
    after, state_after = timed(), state()
    where = torch.cuda.get_device_name() if gpu else "CPU (the CUDA path walked, launch stubbed)"
    print(f"\nhost us per call, {a.spec} B=1 T={a.T} d={a.d}, {where}: before / after the work between, and after - before")
    for name in before:
        b, c = before[name], after[name]
        print(f"{name:30s} {b:8.2f} {c:8.2f} {c - b:+8.2f}")
    print("state before:", state_before)
    print("state after: ", state_after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
