"""End-to-end greedy decoding through each cache, issue 9's configuration: a model of the
Llama-3-8B shape (4 of its 32 layers, RANDOM weights: speed and memory do not depend on
them), a prefill of 4096 random tokens, batch 1, then 16 timed decode steps, eager (the
model called per step) and as a replayed CUDA graph of the step (kernels/graphs.py) where
the cache takes one. `plain` is transformers' DynamicCache, `plain-static` its StaticCache;
the others kvqbench's QuantizedCache read by the fused kernels
(kvqbench.suites.bench.decode.measure, which `python -m kvqbench.suites.bench.decode`
runs over the whole grid of contexts and batches).

Tracked per (cache, run): ms per step (median), the KV memory the cache holds after the
steps and the peak memory of the decode, both from torch's allocator (model excluded). The
model is built once, in setup_cache, which measures every pair; a pair the graph cannot take,
or a cache the installed commit does not know, is skipped. GPU only: on a CPU every pair is
skipped (NotImplementedError in setup).
"""
from __future__ import annotations

import torch

SHAPE, CONTEXT, BATCH, STEPS = "llama3-8b-4l", 4096, 1, 16
CACHES = ["plain", "plain-static", "int4", "kivi:bits=4", "fp8-e4m3", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"]
RUNS = ["eager", "graph"]


class DecodeStep:
    params = [CACHES, RUNS]
    param_names = ["cache", "run"]
    timeout = 1800  # setup_cache: 14 prefills and decodes

    def setup_cache(self):
        if not torch.cuda.is_available():
            return {"why": "needs a CUDA GPU"}
        try:
            from kvqbench.suites.bench.decode.measure import build_model, measure_modes
        except ImportError as e:  # a commit before the decode benchmark
            return {"why": f"no decode benchmark at this commit: {e}"}
        model = build_model(SHAPE)
        out = {}
        for cache in CACHES:
            try:
                rows = measure_modes(model, None if cache == "plain" else cache, context=CONTEXT, batch=BATCH,
                                     steps=STEPS, modes=RUNS)
            except (ValueError, KeyError) as e:  # a spec this commit does not know
                out.update({f"{cache} {r}": {"skipped": str(e)} for r in RUNS})
                continue
            for r in rows:
                out[f"{cache} {r['run']}"] = r
        return out

    def setup(self, figures, cache, run):
        r = figures.get(f"{cache} {run}") or {"skipped": figures.get("why", "not measured")}
        if "skipped" in r:
            raise NotImplementedError(r["skipped"])

    def track_ms_per_step(self, figures, cache, run):
        return figures[f"{cache} {run}"]["ms_per_step"]

    track_ms_per_step.unit = "ms"

    def track_kv_bytes(self, figures, cache, run):
        return figures[f"{cache} {run}"]["kv_live_bytes"]

    track_kv_bytes.unit = "bytes"

    def track_decode_peak_bytes(self, figures, cache, run):
        return figures[f"{cache} {run}"]["decode_peak_bytes"]

    track_decode_peak_bytes.unit = "bytes"
