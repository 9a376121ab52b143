"""One end-to-end decode measurement: a model, a cache, a prefill, then timed decode steps.

    r = measure(model, "hqmq:S=96,r=4", context=4096, batch=1, steps=32)
    r["ms_per_step"], r["tokens_per_s"], r["kv_live_bytes"]
    eager, graph = measure_modes(model, "int4", context=4096, batch=1)   # one prefill, both modes

The model is built from a shape (`SHAPES`) with RANDOM weights (real shapes, no
checkpoint: speed and memory do not depend on the weights; say so with every
figure). A decode step is what greedy `generate` runs per token: one forward pass of
one new token per row through the cache, the argmax fed back; timed over `steps`
steps after `warmup` steps, synchronised after every step; `ms_per_step` is the
median step (robust to host stalls), `ms_per_step_mean` and `_min` beside it (the
quantizers' own encode synchronises anyway, see kernels/store.py).

Caches: `spec=None` is transformers' plain DynamicCache (the model's own, SDPA; it
grows by `torch.cat`, a fresh allocation per step and layer). Its K/V length changes
every step, and torch's cuDNN SDPA backend (chosen for bf16 on Hopper) builds an
execution plan per new shape: on the H200 (torch 2.11) a first pass over new lengths
cost 37.7 ms/step against 3.07 ms/step for a second pass over the same lengths (plans
cached). A long-running server has seen its lengths before, so the plain cache is
timed on a second pass (a rehearsal over the same lengths first) and the first pass is
kept as `ms_per_step_cold`. "plain-static" is its
StaticCache (fp16/bf16 preallocated for the whole run, written in place; its attention
reads the whole masked capacity); "plain-compiled" is transformers' fastest fp16 path as
its docs recommend it: the StaticCache with the model's forward under
`torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs of its own), timed
after its compile (`compile_s`), its row's run "compiled".
A spec is our QuantizedCache under the "kvqbench" attention, so quantizers with a
fused kernel decode through it (`mode` and `fallbacks` say what really ran); "fp16" is
the engine's own fp16 store and split-K kernel over the valid tokens (kernels/formats/
fp16.py): the baseline a quantized format's graphed step is read against.

Run modes (`measure_modes`, the row's `run`): "eager" calls the model per step (its
Python, the launches and the host-side cache code every step); "graph" replays the
step captured by `kernels.graphs.GraphedDecodeStep` (a QuantizedCache keeps its length
on the device for it; a StaticCache does by itself), so the step costs GPU time and one
graph launch. Both modes share one prefill: the graph rows start `warmup + steps`
tokens later (`start_tokens`).

Memory (bytes, from torch's allocator, relative to the model alone):
- `kv_live_bytes`: held after the last step (the cache: store buffers at capacity,
  segment leftovers, shared tables), what the cache costs while decoding;
- `decode_peak_bytes`: the peak during the timed steps (cache + one step's temporaries);
- `peak_bytes`: the peak over prefill and decode (the prefill's activations dominate).
`packed_nbytes` is the cache's measured stored bytes (`QuantizedCache.nbytes`: the total,
model constants included, as `bits_per_element`); `cache_nbytes` / `cache_bits_per_element`
leave out the model constants (seeded rotations, secondaries: `constant_nbytes`, once per
model; quantizers/base.py). A KernelStore holds token-axis segment bytes only
(`stored_nbytes`), no shared tensors, so it needs no such split.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from ....quantizers.checks import deferred_checks, flush
from ...harness.attention import fused_attention
from ...harness.kv_cache import QuantizedCache, QuantizedLayer, cache_kwargs, plain_cache_stats
from ..toolkit import synchronize

SHAPES = {
    # Llama-3-8B attention and MLP shapes, 4 of its 32 layers (as issue 9's table)
    "llama3-8b-4l": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
    # the embedded model's shapes (SmolLM2-135M), all 30 layers
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0),
    # CPU plumbing checks only
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def build_model(shape: str, dtype=torch.bfloat16, device="cuda", max_positions: int = 1 << 16):
    """A causal LM of `shape` with random weights (seeded), in eval mode, SDPA attention."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def _mem(device) -> int:
    return torch.cuda.memory_allocated() if torch.device(device).type == "cuda" else 0


def prefill(model, cache, ids, dev):
    """(prefill s, the first greedy token)."""
    t0 = time.perf_counter()
    logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
    tok = logits[:, -1:].argmax(-1)
    synchronize(dev)
    return time.perf_counter() - t0, tok


def _decode(step, tok, warmup: int, steps: int, dev, base: int = 0):
    """`warmup` untimed steps, then `steps` timed greedy steps of `step(tok) -> logits`:
    (peak bytes over what ran before the timed steps, sorted per-step s, total s, last token)."""
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        tok = step(tok)[:, -1:].argmax(-1)
    synchronize(dev)
    peak_all = torch.cuda.max_memory_allocated() - base if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    per_step = []
    for _ in range(steps):  # synchronised per step: the median shrugs off host stalls
        t1 = time.perf_counter()
        tok = step(tok)[:, -1:].argmax(-1)
        synchronize(dev)
        per_step.append(time.perf_counter() - t1)
        flush()
    return peak_all, sorted(per_step), time.perf_counter() - t0, tok


def _run(model, cache, ids, warmup: int, steps: int, dev, base: int = 0):
    """Prefill `ids` into `cache`, `warmup` untimed steps, then `steps` timed greedy steps:
    (prefill s, peak bytes over prefill + warm-up, sorted per-step s, total s, last tokens)."""
    prefill_s, tok = prefill(model, cache, ids, dev)
    kw = cache_kwargs(model, cache)
    peak_all, per_step, dt, tok = _decode(lambda t: model(input_ids=t, **kw, use_cache=True).logits, tok,
                                          warmup, steps, dev, base)
    return prefill_s, peak_all, per_step, dt, tok


PLAIN_SPECS = (None, "plain-static", "plain-compiled")  # transformers' own caches (None: DynamicCache)


def compiled_step(model, cache, start: int):
    """transformers' compiled decode step over a StaticCache: the forward compiled with
    mode="reduce-overhead" (its docs' recipe), the position on the device (advanced in
    place after each call, as `generate` passes `cache_position`)."""
    dev = next(model.parameters()).device
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    pos = torch.tensor([start], device=dev)
    kw = cache_kwargs(model, cache)

    def step(t):
        out = fwd(input_ids=t, **kw, cache_position=pos, use_cache=True).logits
        pos.add_(1)
        return out
    return step


def measure(model, spec: str | None, *, context: int, batch: int, steps: int = 32, warmup: int = 3,
            seed: int = 0, graph: bool = False) -> dict:
    """Prefill `context` random tokens per row, then time `steps` greedy decode steps
    (`graph`: through `GraphedDecodeStep`, see `measure_modes`)."""
    return measure_modes(model, spec, context=context, batch=batch, steps=steps, warmup=warmup, seed=seed,
                         modes=("graph",) if graph else ("eager",))[0]


def measure_modes(model, spec: str | None, *, context: int, batch: int, steps: int = 32, warmup: int = 3,
                  seed: int = 0, modes=("eager", "graph")) -> list[dict]:
    """One prefill of `context` random tokens per row, then per mode in `modes` `warmup`
    untimed and `steps` timed greedy decode steps on the same cache (the second mode
    continues where the first stopped: its context is longer by warmup + steps): "eager"
    calls the model per step; "graph" replays the step captured by
    `kernels.graphs.GraphedDecodeStep` (its first warm-up steps run uncaptured, see
    there). A cache the graph cannot take (DynamicCache; KIVI, Med3x) gives a row with
    `skipped` (the reason) instead of timings: never the eager figures under another name."""
    from ....kernels.cuda.launch import SCRATCH
    from ....kernels.graphs import GraphedDecodeStep

    for m in modes:
        if m not in ("eager", "graph"):
            raise ValueError(f"mode must be eager or graph, got {m!r}")
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    # An earlier configuration's compiled graphs (reduce-overhead's memory) are freed here,
    # not inside this row's span: freed there, they made plain-compiled's kv_live_bytes
    # negative (H100, 2026-12-06: -0.06 GiB at B=1, T=4096); each configuration then
    # compiles its own shapes, not on top of the last one's
    torch._dynamo.reset()
    gc.collect()
    if cuda:  # (the CUDA calls' kept partials are no cache bytes: dropped here, left out below)
        SCRATCH.clear()
        torch.cuda.empty_cache()
    base = _mem(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(dev)
    total = context + len(modes) * (warmup + steps)

    def new_cache():
        if spec is None:
            return DynamicCache(config=model.config)
        if spec in ("plain-static", "plain-compiled"):
            return StaticCache(config=model.config, max_cache_len=total)
        return QuantizedCache(spec, config=model.config, seed=seed, capacity=total)

    ctx = contextlib.nullcontext() if spec in PLAIN_SPECS else fused_attention(model)
    cold = None
    rows = []
    # Value checks of the writes are read after each synchronised step (quantizers/checks.py).
    with torch.inference_mode(), ctx, deferred_checks():
        if spec is None and "eager" in modes:  # the rehearsal: cuDNN SDPA plans for every length (docstring)
            cold = _run(model, new_cache(), ids, warmup, steps, dev)[2]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        cache = new_cache()
        prefill_s, tok = prefill(model, cache, ids, dev)
        kw = cache_kwargs(model, cache)
        for mode in modes:
            t_start = int(cache.get_seq_length())
            out = dict(spec=spec or "plain", context=context, batch=batch, steps=steps, warmup=warmup,
                       run=mode, start_tokens=t_start, prefill_s=prefill_s)
            if spec == "plain-compiled":
                if mode != modes[0]:  # reduce-overhead captures its own graphs: one row, run "compiled"
                    continue
                out["run"] = "compiled"
                step = compiled_step(model, cache, t_start)
                t_c = time.perf_counter()
                tok = step(tok)[:, -1:].argmax(-1)  # the first call compiles
                synchronize(dev)
                out["compile_s"] = time.perf_counter() - t_c
            elif mode == "graph":
                step = GraphedDecodeStep(model, cache, batch, max_tokens=total)
                out.update(graph_mode=step.mode, graph_why=step.why)
                if step.mode == "eager":
                    out["skipped"] = f"not graphable: {step.why}"
                    rows.append(out)
                    continue
            else:
                def step(t):
                    return model(input_ids=t, **kw, use_cache=True).logits
            peak_all, per_step, dt, tok = _decode(step, tok, warmup, steps, dev, base)
            if mode == "graph":  # (a capture can fail at its first replay: the mode says what ran)
                out.update(graph_mode=step.mode, graph_why=step.why)
            med = per_step[len(per_step) // 2]
            out.update(ms_per_step=med * 1e3, ms_per_step_mean=dt / steps * 1e3, ms_per_step_min=per_step[0] * 1e3,
                       tokens_per_s=batch / med, kv_live_bytes=_mem(dev) - base - SCRATCH.held_bytes(),
                       decode_peak_bytes=(torch.cuda.max_memory_allocated() - base) if cuda else 0,
                       seq_length=int(cache.get_seq_length()))
            out["peak_bytes"] = max(peak_all, out["decode_peak_bytes"])
            if cold is not None and mode == "eager":
                out["ms_per_step_cold"] = cold[len(cold) // 2] * 1e3
            if isinstance(cache, QuantizedCache):
                out.update(packed_nbytes=cache.nbytes(), bits_per_element=cache.bits_per_element(),
                           cache_nbytes=cache.cache_nbytes(), cache_bits_per_element=cache.cache_bits_per_element(),
                           constant_nbytes=cache.constant_nbytes(),
                           mode=sorted({layer.mode for layer in cache.layers}),
                           fallbacks=sum(layer.fallbacks for layer in cache.layers),
                           store_allocated_bytes=sum(s.allocated_nbytes for layer in cache.layers
                                                     for s in layer.stores.values() if s is not None))
            else:
                nbytes = plain_cache_stats(cache)[0]
                out.update(packed_nbytes=nbytes, bits_per_element=16.0, cache_nbytes=nbytes,
                           cache_bits_per_element=16.0, constant_nbytes=0, mode=["plain"],
                           fallbacks=0)
            rows.append(out)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
    del cache, tok
    return rows


def compare_paths(model, spec: str, *, context: int, batch: int, steps: int = 8, seed: int = 0,
                  graph: bool = True) -> dict:
    """The same greedy decode through the fused kernels and through the dense path
    (dequantize + SDPA), the fused path's tokens fed to both so they stay comparable:
    how many greedy tokens agree and how far the logits are apart. `graph`: a third
    cache decodes the same tokens through `GraphedDecodeStep` (captured on a GPU), and
    its logits are compared with the fused (eager) path's: `graph_agree`,
    `graph_max_abs_logit_diff`, `graph_mode` (what ran: "graph", or why not)."""
    from ....kernels.graphs import GraphedDecodeStep

    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(dev)
    names = ("fused", "dense") + (("graph",) if graph else ())
    caches = {name: QuantizedCache(spec, config=model.config, seed=seed, fused=name != "dense",
                                   capacity=context + steps + 1) for name in names}
    agree, diff, scale, g_agree, g_diff = 0, 0.0, 0.0, 0, 0.0
    step = None
    with torch.inference_mode(), fused_attention(model):
        tok = None
        for i in range(steps + 1):
            inp = ids if i == 0 else tok
            out = {}
            for n, c in caches.items():
                if n == "graph" and i:
                    if step is None:
                        step = GraphedDecodeStep(model, c, batch, max_tokens=context + steps + 1)
                    out[n] = step(inp)[:, -1]
                else:
                    out[n] = model(input_ids=inp, **cache_kwargs(model, c), use_cache=True, logits_to_keep=1).logits[:, -1]
            if i:  # decode steps only (the prefill is dense in both)
                agree += int((out["fused"].argmax(-1) == out["dense"].argmax(-1)).sum())
                diff = max(diff, float((out["fused"].float() - out["dense"].float()).abs().max()))
                scale = max(scale, float(out["dense"].float().abs().max()))
                if graph:
                    g_agree += int((out["fused"].argmax(-1) == out["graph"].argmax(-1)).sum())
                    g_diff = max(g_diff, float((out["fused"].float() - out["graph"].float()).abs().max()))
            tok = out["fused"].argmax(-1, keepdim=True)
    modes = {n: sorted({layer.mode for layer in c.layers}) for n, c in caches.items()}
    res = dict(spec=spec, context=context, batch=batch, steps=steps, greedy_agree=agree, greedy_total=steps * batch,
               max_abs_logit_diff=diff, max_abs_logit=scale, modes=modes,
               fallbacks=sum(layer.fallbacks for layer in caches["fused"].layers))
    if graph:
        res.update(graph_agree=g_agree, graph_max_abs_logit_diff=g_diff,
                   graph_mode=step.mode if step.mode != "eager" else f"eager: {step.why}",
                   graph_same_bits=caches["graph"].bits_per_element() == caches["fused"].bits_per_element(),
                   graph_same_nbytes=caches["graph"].nbytes() == caches["fused"].nbytes())
    return res


def write_cost(spec: str, *, heads: int = 8, head_dim: int = 128, batch: int = 1, context: int = 256,
               steps: int = 8, step_encode: bool = True, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """What the REAL fused write path costs per decode step: `QuantizedLayer.update` of
    one token (K and V of one layer, attention excluded) after a prefill of `context`
    tokens, `steps` steps. Counted with torch's profiler, per step (lists) and their
    maxima: `ops`, the top-level torch ops (each a kernel launch on a GPU, a few are
    views); `launches`, the device encoders' launches (Triton, and on a GPU the one-launch
    CUDA write of kernels/cuda/step_write.py); `host_reads`, the reads of a device value
    by the host (`aten::_local_scalar_dense`: `.item()`, `bool()`; a sync on a GPU).
    Per (layer, role) is half of each. `host_us`: host wall time per update, timed over
    the same number of steps without the profiler. On a CPU the Triton kernels are
    counted but not run (the interpreter would add torch ops of its own and its run
    time), so `host_us` there is the Python side of the write alone.
    `step_encode=False` measures the old path (quantizer `append` + store `append`)."""
    import time
    from unittest import mock

    from torch.profiler import ProfilerActivity, profile

    from ....kernels import step_encode as se
    from ....kernels.cuda import step_write

    dev = torch.device(device)
    layer = QuantizedLayer(spec, 0, seed=seed)
    layer.fused_wanted, layer.step_encode, layer.capacity_hint = True, step_encode, context + 2 * steps + 1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, batch, heads, context + 2 * steps, head_dim, generator=g).to(dev, dtype)
    stub = dev.type == "cpu"
    env = {"TRITON_INTERPRET": "1"} if stub else {}
    hook = (lambda *a, **k: None) if stub else se.launch_hook
    out = {"spec": spec, "heads": heads, "head_dim": head_dim, "batch": batch, "context": context,
           "step_encode": step_encode, "ops": [], "launches": [], "host_reads": []}
    with mock.patch.dict(os.environ, env), mock.patch.object(se, "launch_hook", hook), torch.inference_mode():
        layer.update(x[0, :, :, :context], x[1, :, :, :context])
        out["mode"] = layer.mode
        for t in range(context, context + steps):
            n0, k, v = se.LAUNCHES[0] + step_write.LAUNCHES[0], x[0, :, :, t : t + 1], x[1, :, :, t : t + 1]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                layer.update(k, v)
            events = list(prof.events())
            out["ops"].append(sum(e.name.startswith("aten::") and (
                e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")) for e in events))
            out["host_reads"].append(sum(e.name == "aten::_local_scalar_dense" for e in events))
            out["launches"].append(se.LAUNCHES[0] + step_write.LAUNCHES[0] - n0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        kv = [(x[0, :, :, t : t + 1], x[1, :, :, t : t + 1]) for t in range(context + steps, context + 2 * steps)]
        t0 = time.perf_counter()
        for k, v in kv:
            layer.update(k, v)
        out["host_us"] = (time.perf_counter() - t0) / steps * 1e6
        if dev.type == "cuda":
            torch.cuda.synchronize()
    out.update(max_ops=max(out["ops"]), max_launches=max(out["launches"]), max_host_reads=max(out["host_reads"]))
    return out


__all__ = ["SHAPES", "build_model", "compare_paths", "measure", "measure_modes", "prefill", "write_cost"]
