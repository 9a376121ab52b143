"""Generation at engine speed: prefill once, then one-token decode steps replayed as a
CUDA graph over the quantized cache (fused kernels where the format has them).

    from kvqbench.suites.harness.generate import generate
    out = generate(model, [ids_a, ids_b], "int4", max_new_tokens=128, tokenizer=tok, stop=["\\n\\n"])
    out.tokens, out.texts, out.tokens_per_s, out.mode, out.why

What it does, as a serving engine does (the `deployed` protocol of perplexity.py):
- the prompt is one prefill call whose attention reads its own K/V at full precision
  (`QuantizedCache(prefill="exact")`) and stores them quantized;
- every new token is a decode step reading the quantized cache: the graphed step
  (kernels/graphs.py `GraphedDecodeStep`, mode "graph") where the cache can take
  device-position steps on CUDA, else the model called eagerly ("eager", with `why`);
  on a CPU, "device" runs the graph's kernels uncaptured (tests);
- greedy (default) or sampling (`temperature`, `top_k`, `top_p`, seeded), on the
  device; end of sequence (`eos_token_id`, one id or several) and `stop` strings per
  row. The host looks at the tokens every `check_every` steps (one synchronisation
  each), stops once every row is done and cuts each row at its first EOS / stop string.
- prompts of different lengths: ONE left-padded batch (`out.batches` is one list). Each
  row's prompt is right-aligned after its pad count; the prefill gets a 2-D attention
  mask and per-row position ids (token index minus the pad count), the cache the pad
  counts (`QuantizedCache.set_row_start`), so every later read masks each row's pads (the
  fused kernels' `row_start`, CUDA and Triton, the dense history's SDPA, device steps and graphs
  alike) and every step's positions are the row's own. The pad token id is 0 (any id
  would do: masked). Where padding cannot apply, rows are grouped by prompt length and
  each group runs as its own batch (`out.why` says so): `spec=None` (transformers'
  StaticCache, which keeps no row starts) and models whose attention is not SDPA (the
  cache's masking rides on the "kvqbench" attention, which stands in for SDPA only).

`spec=None` runs the model's own fp16/fp32 cache the fastest way transformers offers
to an engine: a StaticCache, graphed the same way (the plain baseline); "fp16" is
kvqbench's fp16 store.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from typing import Sequence

import torch

from ...kernels.graphs import GraphedDecodeStep
from .attention import fused_attention
from .calibration import fit_calibration, spec_needs_calibration
from .kv_cache import QuantizedCache, cache_kwargs


@dataclasses.dataclass
class Generation:
    """What `generate` returns. `tokens[i]`/`texts[i]`: row i's new tokens (cut at its first
    EOS / stop string, EOS kept); `mode` how the decode steps ran ("graph", "device",
    "eager"; "+"-joined when groups differ) and `why` when not graphed; times in seconds
    (`decode_s`: the decode steps of every group, synchronised), `tokens_per_s`: new
    tokens generated (all rows, up to where each stopped) over prefill + decode time."""
    tokens: list[list[int]]
    texts: list[str] | None
    mode: str
    why: str | None
    prefill_s: float
    decode_s: float
    new_tokens: int
    steps: int
    batches: list[list[int]]
    spec: str | None
    # bytes the quantized caches stored at the end, model constants apart (`QuantizedCache.cache_nbytes`;
    # 0 for spec=None)
    cache_nbytes: int = 0
    cache_elements: int = 0  # K/V elements they held

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps only (batch rows x steps over their time), the engine's rate."""
        return self.steps * sum(map(len, self.batches)) / self.decode_s if self.decode_s > 0 else float("nan")


def _rows(input_ids) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a LongTensor [B, T] or a list of token lists, got "
                             f"{tuple(input_ids.shape)} {input_ids.dtype}")
        return input_ids.tolist()
    rows = [list(map(int, r)) for r in input_ids]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    return rows


def _sampler(temperature: float, top_k: int | None, top_p: float | None, generator):
    if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 1):
        raise ValueError(f"bad sampling settings: temperature={temperature}, top_k={top_k}, top_p={top_p}")

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B, 1]
        if temperature == 0:
            return logits.argmax(-1, keepdim=True)
        x = logits.float() / temperature
        if top_k is not None and top_k < x.shape[-1]:
            kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if top_p is not None and top_p < 1:
            sorted_x, order = torch.sort(x, descending=True, dim=-1)
            cum = sorted_x.softmax(-1).cumsum(-1)
            drop = cum - sorted_x.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
        return torch.multinomial(x.softmax(-1), 1, generator=generator)
    return pick


def _cut(row: list[int], eos: set[int], stop: Sequence[str], tokenizer) -> tuple[list[int], bool]:
    """(row up to its first EOS (kept) or the token completing a stop string, whether it stopped)."""
    for i, t in enumerate(row):
        if t in eos:
            return row[:i + 1], True
    if stop and tokenizer is not None:
        text = tokenizer.decode(row)
        if any(s in text for s in stop):
            for i in range(1, len(row) + 1):  # the shortest prefix that holds a stop string
                if any(s in tokenizer.decode(row[:i]) for s in stop):
                    return row[:i], True
    return row, False


def _new_cache(model, spec, batch, capacity, fused, seed, calibration=None):
    if spec is None:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=capacity)
    return QuantizedCache(spec, config=model.config, seed=seed, capacity=capacity, fused=fused, prefill="exact",
                          calibration=calibration)


# The engine kept between calls: the last graphed call's model, quantized cache and the
# decode step captured over it. A next call on the same model with the same spec, batch,
# room and options rewinds that cache in place (`QuantizedCache.rewind`) and replays the
# same CUDA graph, as a serving engine keeps its KV pool and graphs between requests and
# as transformers' compiled StaticCache path keeps its cudagraphs across `generate` calls;
# a new capture costs ~70-130 ms per call on the H200 (SmolLM2 shape, 30 layers), most of a
# 128-token generation's overhead. One engine per process (the step holds its model, so a
# per-model table would keep every model alive): another call's engine replaces it.
_ENGINE: list = []  # [] or [(weakref to the model, key, cache, step)]
ROOM_QUANTUM = 256  # room (prompt + new tokens) is rounded up to this: prompts of nearby lengths share


def release_engines(model=None) -> None:
    """Free the cache and graph `generate` keeps (only if it is `model`'s, when given)."""
    if _ENGINE and (model is None or _ENGINE[0][0]() is model):
        _ENGINE.clear()


def _kept(model, key):
    """The kept (cache, step) for `model` and `key`, rewound for a new prompt; None if there
    is none or it cannot rewind."""
    if _ENGINE and _ENGINE[0][0]() is model and _ENGINE[0][1] == key and _ENGINE[0][2].rewind():
        return _ENGINE[0][2], _ENGINE[0][3]
    return None


PAD_ID = 0  # the id left pads carry (masked out of every read: any valid id would do)


def _one_batch(model, prompts, spec, max_new, pick, eos, stop, tokenizer, graph, graph_off, fused, seed,
               check_every, calibration=None, compile=False, padded=False):
    """One batch: `prompts` of one length, or (`padded`) of any lengths, left-padded."""
    dev = next(model.parameters()).device
    P = max(map(len, prompts))
    starts = [P - len(r) for r in prompts]
    ids = torch.tensor([[PAD_ID] * s + list(r) for s, r in zip(starts, prompts)], dtype=torch.long, device=dev)
    B = ids.shape[0]
    room = -(-(P + max_new) // ROOM_QUANTUM) * ROOM_QUANTUM
    # Row starts only where a row is padded: an equal-length batch reads none and keeps
    # the kernels that take none (the CUDA ones decline row starts). The key says which:
    # a step captured with row starts reads their buffer, one captured without does not.
    pads = padded and max(starts) > 0
    key = (spec, B, room, fused, seed, graph, compile, pads)
    kept = _kept(model, key) if spec is not None and calibration is None else None
    if kept is not None:
        cache, step = kept
    else:
        release_engines()  # its buffers first: the new cache may need the memory
        cache, step = _new_cache(model, spec, B, room, fused, seed, calibration), None
    kw = cache_kwargs(model, cache)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    extra = {}
    if spec is None:  # a StaticCache needs the positions of the prompt spelled out
        extra["cache_position"] = torch.arange(P, device=dev)
    if pads:  # (a kept cache: rewound, its starts' buffer rewritten in place)
        cache.set_row_start(starts, device=dev)  # (host ints: no device read)
        # the prompt's pads: the model's own 2-D mask, each row's positions
        extra["attention_mask"] = (torch.arange(P, device=dev)[None, :] >= cache.row_start[:, None]).long()
        extra["position_ids"] = cache.position_ids(0, P)
    # (compile=True: the prefill runs the model's own modules, `_uncompiled`)
    with torch.profiler.record_function("kvqbench.generate.prefill"), \
            (_uncompiled(model) if compile else contextlib.nullcontext()):  # (record_function: a no-op unless profiled)
        logits = model(input_ids=ids, **kw, use_cache=True, **extra).logits[:, -1]
    out = torch.empty(B, max_new, dtype=torch.long, device=dev)
    out[:, :1] = pick(logits)
    sync()
    t1 = time.perf_counter()
    steps, why = 0, None
    if step is not None and step.moved():  # the prompt outgrew the kept room (Med3x lists): capture anew
        step = None
    if max_new > 1:
        if step is None and graph:
            step = GraphedDecodeStep(model, cache, batch=B, max_tokens=room)
            if step.mode in ("graph", "device") and spec is not None and calibration is None:
                _ENGINE[:] = [(weakref.ref(model), key, cache, step)]
        elif step is None:
            step = _Eager(model, cache, kw, graph_off, pads)
        mode, why = step.mode, step.why
        for t in range(1, max_new):
            out[:, t:t + 1] = pick(step(out[:, t - 1:t])[:, -1])
            steps += 1
            if (t + 1) % check_every == 0 or t + 1 == max_new:
                done = [_cut(r, eos, stop, tokenizer)[1] for r in out[:, :t + 1].tolist()]  # one sync
                if all(done):
                    break
    else:
        mode = "prefill only"
    sync()
    t2 = time.perf_counter()
    rows = [_cut(r, eos, stop, tokenizer)[0] for r in out[:, :steps + 1].tolist()]
    size = (cache.cache_nbytes(), cache.numel()) if isinstance(cache, QuantizedCache) else (0, 0)
    del cache
    return rows, mode, why, t1 - t0, t2 - t1, steps, size


class _Eager:
    mode = "eager"

    def __init__(self, model, cache, kw, why, padded=False):
        self.model, self.cache, self.kw, self.why, self.padded = model, cache, kw, why, padded

    def __call__(self, ids):
        extra = {"position_ids": self.cache.position_ids(self.cache.get_seq_length(), 1)} if self.padded else {}
        return self.model(input_ids=ids, **self.kw, use_cache=True, **extra).logits


# module -> its torch.compile wrapper, kept across calls (compiles once per shape); weak keys:
# an id() key could hand a freed module's wrapper to a new module at the same address
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _opaque_to_dynamo():
    """Within the block the quantized cache's write and the fused attention are opaque to
    torch.compile (graph breaks at them: their host-side Python and Triton/CUDA launches
    stay ours), and ints on modules (a layer's index) are not specialised, so the 30
    layers of a model share one compiled graph instead of recompiling per index."""
    import torch._dynamo

    from .attention import ATTN_NAME, kvqbench_attention
    from transformers import AttentionInterface

    update = QuantizedCache.update
    QuantizedCache.update = torch._dynamo.disable(update)
    AttentionInterface.register(ATTN_NAME, torch._dynamo.disable(kvqbench_attention))
    try:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True,
                                        recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
            yield
    finally:
        QuantizedCache.update = update
        AttentionInterface.register(ATTN_NAME, kvqbench_attention)


def _compiled(mod):
    wrapped = _COMPILED.get(mod)
    if wrapped is None:
        wrapped = _COMPILED[mod] = torch.compile(mod, dynamic=None)
    return wrapped


@contextlib.contextmanager
def _swapped(model, wrap):
    """Within the block every decoder layer, the final norm and the rotary embedding are
    `wrap(module)`; the model's own modules are put back after."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"compile=True: {type(model).__name__} has no .model.layers to compile")
    before = list(layers)
    named = [(n, getattr(inner, n)) for n in ("norm", "rotary_emb") if isinstance(getattr(inner, n, None), torch.nn.Module)]
    try:
        for i, layer in enumerate(before):
            layers[i] = wrap(layer)
        for n, mod in named:
            setattr(inner, n, wrap(mod))
        yield model
    finally:
        for i, layer in enumerate(before):
            layers[i] = layer
        for n, mod in named:
            setattr(inner, n, mod)


@contextlib.contextmanager
def compiled_parts(model):
    """Within the block every decoder layer runs as its torch.compile wrapper, whole
    (projections, rotary, norms, MLP, residual adds fused as transformers' compiled
    generation fuses them), with the quantized cache's write and the fused attention
    left opaque (`_opaque_to_dynamo`: they stay kvqbench's kernels and graphed steps);
    the final norm and the rotary embedding too. Restored after."""
    with _swapped(model, _compiled), _opaque_to_dynamo():
        yield model


def _uncompiled(model):
    """Inside `compiled_parts`: the model's own modules back for the block. The prefill runs
    them: one pass over the prompt, its host cost paid once per call, where the compiled
    layers' graph breaks and guards cost more host time than their fusions save (H100,
    SmolLM2 shape, batch 8 x 512: the compiled prefill 56 ms against 29 ms eager for HQMQ,
    108 against 47 for Med3x; reports/generate), and each new prompt length would be a
    new shape to compile; the decode steps, the same shape every call, keep the compiled
    layers."""
    return _swapped(model, lambda mod: getattr(mod, "_orig_mod", mod))


def generate(model, input_ids, spec: str | None, *, max_new_tokens: int = 128, tokenizer=None,
             eos_token_id: int | Sequence[int] | None = None, stop: Sequence[str] = (),
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, graph: bool | None = None, fused: bool | None = None,
             check_every: int = 16, compile: bool = False, calibration=None) -> Generation:
    """Generate `max_new_tokens` per prompt through a cache quantized by `spec` (module
    docstring). `input_ids`: a LongTensor [B, T] or a list of token lists; `tokenizer`
    (optional) gives texts and stop strings; `eos_token_id` defaults to the tokenizer's /
    the model's generation config's; `temperature` 0 is greedy. `graph`: None = graphed on
    CUDA where the cache can be, False never; `fused`: the cache's (None: the fused
    kernels on CUDA where the format has one). `seed` seeds both the quantizer's
    codebooks and the sampler. `compile`: run the model's decoder layers through
    torch.compile (`compiled_parts`), fusing the work around attention that a graph
    replay alone still launches kernel by kernel; the cache's write and the fused
    attention stay ours (the first call of a new batch or room pays the compile); the
    prefill runs the uncompiled layers (`_uncompiled`: cheaper on the host, and no
    compile per prompt length). Prompts of
    different lengths run as one left-padded batch (module docstring). `calibration`: what
    `QuantizedCache(calibration=)` takes, needed by a calibrated spec (e.g. avq2-cal;
    suites/harness/calibration.py): captured K/V are fitted once here (for `seed`) and
    shared by every group's cache; fitted dicts are used as given."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be a positive int, got {check_every!r}")
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    rows = _rows(input_ids)
    dev = next(model.parameters()).device
    if spec is not None and spec_needs_calibration(spec):
        if calibration is None:
            raise ValueError(f"{spec} is a calibrated quantizer (fitted once per model on calibration K/V): "
                             "generate(..., calibration=) needs its calibration, K/V of windows that are not "
                             "generated from (suites/harness/calibration.py capture_kv / corpus_calibration)")
        calibration = fit_calibration(spec, calibration, seed, device=dev)  # once, not per group's cache
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and max(map(len, rows)) + max_new_tokens > limit:
        raise ValueError(f"prompt ({max(map(len, rows))} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {limit} positions")
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    graph_off = "graph=False" if graph is False else "no CUDA device: eager steps (graph=True runs the graph's steps uncaptured)"
    graph = (dev.type == "cuda") if graph is None else bool(graph)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pick = _sampler(float(temperature), top_k, top_p, gen)
    sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
    # One left-padded batch where the cache masks the pads (module docstring), else groups
    # of equal length.
    padded = spec is not None and sdpa
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(0 if padded else len(r), []).append(i)
    result: list[list[int] | None] = [None] * len(rows)
    modes, whys, pre, dec, steps, nbytes, numel = [], [], 0.0, 0.0, 0, 0, 0
    if len(groups) > 1:
        whys.append("prompts of different lengths run in groups of equal length ("
                    + ("spec=None: transformers' StaticCache keeps no row starts" if spec is None else
                       f"the model's attention is {getattr(model.config, '_attn_implementation', None)!r}, not "
                       "SDPA: no left padding") + ")")
    # The fused kernels replace SDPA only (perplexity.py does the same): other attentions stay dense.
    if not padded:
        fused = False
    # A padded batch runs the "kvqbench" attention whatever `fused` (the cache's) is: its
    # handle masks the pads of dense layers too.
    ctx = fused_attention(model) if padded or fused is not False else contextlib.nullcontext()
    with torch.inference_mode(), ctx, (compiled_parts(model) if compile else contextlib.nullcontext()):
        for length, idx in groups.items():
            out, mode, why, p_s, d_s, n, (b, e) = _one_batch(model, [rows[i] for i in idx], spec, max_new_tokens, pick,
                                                     eos, stop, tokenizer, graph, graph_off, fused, seed,
                                                     check_every, calibration, compile, padded)
            for i, r in zip(idx, out):
                result[i] = r
            modes.append(mode)
            if why:
                whys.append(why)
            pre, dec, steps, nbytes, numel = pre + p_s, dec + d_s, max(steps, n), nbytes + b, numel + e
    texts = [tokenizer.decode(r) for r in result] if tokenizer is not None else None
    return Generation(tokens=result, texts=texts, mode="+".join(sorted(set(modes))),
                      why="; ".join(sorted(set(whys))) or None, prefill_s=pre, decode_s=dec,
                      new_tokens=sum(map(len, result)), steps=steps, batches=list(groups.values()), spec=spec,
                      cache_nbytes=nbytes, cache_elements=numel)


__all__ = ["Generation", "compiled_parts", "generate", "release_engines"]
