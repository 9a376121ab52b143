"""Where one generate call's time goes, from torch.profiler: `--profile` of the generate
benchmark runs one more call per kvqbench row under the profiler (after the timed runs, so
their figures are untouched) and writes a text file per row: the operators of the prefill
(those that start inside generate's `kvqbench.generate.prefill` range) and of the whole
call, by self device time and by self host time, and the host-device synchronisations
counted (a sync inside the prefill serialises the host's launches with the device's work),
then the Python by function (cProfile) of one more call."""
from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

PREFILL = "kvqbench.generate.prefill"  # the record_function range suites/harness/generate.py opens
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "aten::item",
         "aten::_local_scalar_dense")


def _self_device_us(e) -> float:
    # (torch >= 2.4 names it self_device_time_total; the older name warns where both exist)
    return e.self_device_time_total if hasattr(e, "self_device_time_total") else e.self_cuda_time_total


def op_table(events, title: str, rows: int = 25) -> list[str]:
    agg: dict[str, list[float]] = {}
    for e in events:
        a = agg.setdefault(e.name, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += e.self_cpu_time_total
        a[2] += _self_device_us(e)
    out = [f"## {title}: {len(events)} events, self host {sum(a[1] for a in agg.values()) / 1e3:.2f} ms, "
           f"self device {sum(a[2] for a in agg.values()) / 1e3:.2f} ms",
           f"syncs and copies: " + (", ".join(f"{n} x{agg[n][0]}" for n in SYNCS if n in agg) or "none")]
    for key, label in ((2, "self device"), (1, "self host")):
        out += ["", f"by {label} time (us): count, self host, self device, name"]
        for name, (n, cpu, dev) in sorted(agg.items(), key=lambda kv: -kv[1][key])[:rows]:
            out.append(f"{n:6d} {cpu:10.0f} {dev:10.0f}  {name[:110]}")
    kern: dict[str, list[float]] = {}
    for e in events:
        for k in getattr(e, "kernels", []):  # the device kernels this host event launched
            a = kern.setdefault(k.name, [0, 0.0])
            a[0] += 1
            a[1] += k.duration
    out += ["", "device kernels launched (us): count, total, name"]
    for name, (n, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:rows]:
        out.append(f"{n:6d} {us:10.0f}  {name[:110]}")
    return out + [""]


def profile_call(fn, path: Path, header: str) -> None:
    """Run fn() once under torch.profiler (CPU, and CUDA where there is one) and write the
    prefill's and the whole call's tables to `path`."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]  # (kernels: through their launches)
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == PREFILL]
    inside = [e for e in events if e.name != PREFILL and any(s <= e.time_range.start < t for s, t in ranges)]
    lines = [f"# {header}", ""] + op_table(inside, f"prefill ({len(ranges)} range(s))") + op_table(
        [e for e in events if e.name != PREFILL], "whole call")
    # the host's Python by function (torch.profiler names operators, not the Python between
    # them): one more call under cProfile
    stats = io.StringIO()
    prof_py = cProfile.Profile()
    prof_py.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof_py.disable()
    pstats.Stats(prof_py, stream=stats).sort_stats("tottime").print_stats(30)
    lines += ["## Python by function (cProfile, another call; its overhead inflates every figure)", "",
              stats.getvalue().strip()]
    path.write_text("\n".join(lines))


__all__ = ["op_table", "profile_call", "PREFILL"]
