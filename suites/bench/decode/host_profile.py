"""python -m kvqbench.suites.bench.decode.host_profile: where an eager decode step's host time goes.

An eager step (the model called per token) on a GPU is host-bound when the host takes
longer to issue a step's launches than the GPU takes to run them. Per cache this prints
the step's median wall time (synchronised per step), its host issue time (the call
returning, before the sync) and a cProfile of the issuing code (the functions with the
most own time, per step). cProfile slows Python down, so its per-step figures are
larger than the issue time: read them as shares, not as times.

    python -m kvqbench.suites.bench.decode.host_profile --shape llama3-8b-4l --specs plain int4 hqmq:S=96,r=4

`--prefill`: instead, where one prefill's time goes (torch.profiler: operators by self
device and host time, the device kernels, syncs), after an untimed prefill of the same
shape (compiles). The H100 decode benchmark of 2026-12-06 took 8.7 s (int4) and 48 s
(HQMQ) to prefill 32768 x 8 tokens of the 4-layer shape against 2.0 s for the engine's
fp16 store, 4-5x its 2026-12-04 H200 figures; this says which kernels or syncs hold it.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time

import torch
from transformers import DynamicCache

from ....quantizers.checks import deferred_checks, flush
from ...harness.attention import fused_attention
from ...harness.kv_cache import QuantizedCache, cache_kwargs
from ..toolkit import synchronize
from .measure import SHAPES, build_model, prefill


def profile_spec(model, spec: str, context: int, batch: int, steps: int, top: int, dev) -> str:
    if spec == "plain":  # cuDNN's SDPA plans each new length once: rehearse them (as measure.py does)
        _profile_once(model, spec, context, batch, steps, top, dev)
    return _profile_once(model, spec, context, batch, steps, top, dev)


def _profile_once(model, spec: str, context: int, batch: int, steps: int, top: int, dev) -> str:
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    total = context + 3 * steps + 8
    cache = DynamicCache(config=model.config) if spec == "plain" else \
        QuantizedCache(spec, config=model.config, capacity=total)
    ctx = fused_attention(model) if spec != "plain" else contextlib.nullcontext()
    with torch.inference_mode(), ctx, deferred_checks():
        _, tok = prefill(model, cache, ids.to(dev), dev)
        kw = cache_kwargs(model, cache)

        def step(t):
            return model(input_ids=t, **kw, use_cache=True).logits[:, -1:].argmax(-1)

        for _ in range(3):
            tok = step(tok)
        synchronize(dev)
        wall, issue = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = step(tok)
            t1 = time.perf_counter()
            synchronize(dev)
            wall.append(time.perf_counter() - t0)
            issue.append(t1 - t0)
            flush()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            tok = step(tok)
            synchronize(dev)
            flush()
        prof.disable()
    wall.sort()
    issue.sort()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    head = (f"== {spec}, context {context}, batch {batch}: step {wall[steps // 2] * 1e3:.2f} ms wall, "
            f"{issue[steps // 2] * 1e3:.2f} ms host issue (medians of {steps}); cProfile over {steps} steps "
            f"(divide by {steps} for per step):")
    return head + "\n" + buf.getvalue()


def profile_prefill(model, spec: str, context: int, batch: int, top: int, dev) -> str:
    """One prefill of `context` random tokens per row into a fresh cache of `spec` under
    torch.profiler, after an untimed one (compiles, cuDNN plans): its wall time and tables."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from ..generate.profile import op_table

    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)

    def once():
        cache = DynamicCache(config=model.config) if spec == "plain" else \
            QuantizedCache(spec, config=model.config, capacity=context + 8)
        ctx = fused_attention(model) if spec != "plain" else contextlib.nullcontext()
        with torch.inference_mode(), ctx, deferred_checks():
            return prefill(model, cache, ids, dev)[0]

    cold = once()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        warm = once()
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    head = (f"== {spec}, context {context}, batch {batch}: prefill {warm:.3f} s ({cold:.3f} s the first, "
            f"untimed one; the profiled one under the profiler)")
    return "\n".join([head] + op_table(events, "prefill", rows=top))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.decode.host_profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b-4l", choices=sorted(SHAPES))
    p.add_argument("--specs", nargs="+", default=["plain", "int4", "hqmq:S=96,r=4"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefill", action="store_true", help="profile one prefill per spec instead (module docstring)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    model = build_model(a.shape, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    for spec in a.specs:
        if a.prefill:
            print(profile_prefill(model, spec, a.context, a.batch, a.top, dev), flush=True)
        else:
            print(profile_spec(model, spec, a.context, a.batch, a.steps, a.top, dev), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
