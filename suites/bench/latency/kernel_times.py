"""Where a CUDA decode call's GPU time goes: its split kernel, the gap, its combine (GPU).

A call of the CUDA backends is two kernels, the split kernel (the partials of every split)
and the combine (issue 28: what the byte limit leaves to the rest). This profiles n eager
calls back to back (the host runs ahead of the GPU, so the gaps are the GPU's own) with
torch.profiler and prints, per format and batch, the medians of: the split kernel, the gap
from its end to the combine's start (negative: the combine started early, as a programmatic
dependent), the combine, the whole call (split start to combine end) and the gap to the next
call's split kernel. With --pdl both launch modes of the combine (kernels/cuda/library.py
PDL) in one run.

    python -m kvqbench.suites.bench.latency.kernel_times [--B 8 1] [--T 32768] [--d 128] [--pdl] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from .host_time import SPECS

FIELDS = ("split_us", "gap_us", "combine_us", "call_us", "next_gap_us")


def call_times(kernels: list[dict]) -> list[dict]:
    """Per call, from a trace's kernel events ({"name", "ts", "dur"} in us, any order): the
    kernels up to and including a `combine` kernel are one call (its split kernels, then its
    combine). Kernels after the last combine are left out."""
    calls, cur = [], []
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if "combine" not in e["name"]:
            cur.append(e)
        elif cur:
            calls.append((cur, e))
            cur = []
    out = []
    for i, (splits, comb) in enumerate(calls):
        s0, s1 = splits[0]["ts"], max(e["ts"] + e["dur"] for e in splits)
        row = {"split_us": s1 - s0, "gap_us": comb["ts"] - s1, "combine_us": comb["dur"],
               "call_us": comb["ts"] + comb["dur"] - s0}
        if i + 1 < len(calls):
            row["next_gap_us"] = calls[i + 1][0][0]["ts"] - (comb["ts"] + comb["dur"])
        out.append(row)
    return out


def medians(rows: list[dict]) -> dict:
    return {f: statistics.median(r[f] for r in rows if f in r) for f in FIELDS if any(f in r for r in rows)}


def profile(fn, n: int = 30, warmup: int = 5) -> list[dict]:
    """call_times of n calls of fn, after `warmup` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return call_times([e for e in events if e.get("cat") == "kernel"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.latency.kernel_times",
                                description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, nargs="+", default=[8, 1])
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--formats", nargs="+", default=[f for f in SPECS if f != "fp16"],
                   choices=[f for f in SPECS if f != "fp16"])
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--pdl", action="store_true", help="each row with the combine launched ordinarily, then as a "
                   "programmatic dependent (library.py PDL); default: as KVQBENCH_PDL sets it")
    p.add_argument("--out", type=Path, help="also write the rows here as JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it profiles the CUDA kernels)")
    from ....kernels.cuda import library
    from ....kernels.decode_attention import decode_attention, explain_backend
    from ..toolkit import env_info, kernel_flats

    rows = []
    print(f"us per eager call, medians of {a.n} (T={a.T}, d={a.d}, Hq 32 / Hkv 8): " + ", ".join(FIELDS))
    for B in a.B:
        for f in a.formats:
            spec = SPECS[f]
            kf, vf = kernel_flats(spec, B, a.T, 8, a.d, 288 if spec.startswith("kivi") else 256, "cuda")
            q = torch.randn(B, 32, 1, a.d, device="cuda").half()
            backend = explain_backend(q, kf, vf).backend
            if backend != "cuda":
                print(f"B={B} {f}: runs on {backend}, not the CUDA kernels: skipped", flush=True)
                continue
            for on in (False, True) if a.pdl else (library.PDL.on,):
                with library.PDL.set(on):
                    m = medians(profile(lambda: decode_attention(q, kf, vf), a.n))
                rows.append({"B": B, "format": f, "spec": spec, "pdl": on, **m})
                print(f"B={B} {f:6s} PDL {'on ' if on else 'off'}  " + "  ".join(f"{k} {v:6.1f}" for k, v in m.items()),
                      flush=True)
    if a.out:
        a.out.write_text(json.dumps({"env": env_info(), "T": a.T, "d": a.d, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
