"""Perplexity under a quantized KV cache: the protocols of METHOD.md section 4.

    r = ppl_quantize_on_write(model, windows, "hqmq:S=96,r=4", seed=0)
    r = ppl_prefill_then_decode(model, windows, "int4", seed=0, context=256)
    r = ppl_deployed(model, windows, "int4", seed=0, context=256)   # exact prefill, decode scored
    r["ppl"], r["cache_bits_per_element"], r["constant_nbytes"], r["protocol"]

`windows` is a LongTensor [n, N] of token ids (suites/harness/corpora.py `token_windows`).
`spec` is a quantizer spec; "fp16" is the fp16 baseline (K/V stored as fp16), and
`None` means the model's own plain cache (DynamicCache, no quantizer at all).

Batches: windows are scored `batch_size` at a time (all have the same length, so no
padding), each batch from a fresh cache. Quantizers keep their statistics per (batch
row, kv-head) (a Med3x median, KIVI's key groups), so a row's bytes and decoded values
do not depend on its neighbours; suites/tests/test_decode_path.py checks, for every
registered quantizer, that batched and one-by-one NLLs and bits agree. Quantizers that
fit shared tensors on the first write (codebooks, an outlier-channel mask) fit them per
row (quantizers/fitted.py): row b's from row b alone, as a one-window cache would. A
quantizer whose statistics span rows (`rows_independent`: a fit over all rows,
`fit_per_row = False`, as fp8's scale; or a class that says `rows_independent =
False`) is scored one window at a time.
Batched and one-by-one scoring do the same arithmetic per row, except that a batch's
matrix products may round differently (float noise); a quantizer's rounding steps can
amplify it. Measured on the embedded SmolLM2-135M (CPU, fp32), prefill-then-decode, 2
windows of 64 + 32 tokens, batch 2 vs 1, relative NLL difference: plain cache 4e-8,
fp16 2e-5, int4 3.6e-3 (a few K/V codes flip at rounding boundaries); 4 x 512-token
quantize-on-write windows with int4 gave the same PPL to 4 decimals. At compare's
prefill-then-decode shape (4 windows of 384 + 64 tokens, batch 4 vs 1, same machine) the
PPL moved by 0.5% for int4, 0.8% / 1.3% for avq2 / avq3, 0.0% / 0.2% for flatvq dim 4 /
2, 0.2-0.5% for spherical3/4 and 3.1% for spherical4-qjl: the one-token steps' batched
matmuls round otherwise and flipped codes feed every later layer (the fitted tensors and
codes of a row are byte-identical to a one-window run's given the same K/V:
suites/tests/test_fitted_rows.py); their seed ranges in the CPU report (quantize-on-write,
3 seeds) are 1.8% (avq3, flatvq dim 2, spherical4) to 7% (spherical4-qjl) wide. So record
the batch size with every figure (compare does). The batch is also capped so the logits stay within LOGITS_BUDGET.

Prefill-then-decode runs the decode steps through the fused kernels when the model
uses SDPA, the quantizer has a kernel and the model is on CUDA: the packed store is
read in place, with no dense copy of the history (`fused=False` turns it off,
`fused=True` forces it, under the Triton interpreter on a CPU).

Value checks of the writes (NaN/Inf input, fp16 range, finite decodes) are deferred
(`quantizers.checks`) and read once per batch, beside the loss: a bad value still
fails the run with its own message, without a host synchronisation per layer and step.

PPL = exp(nll_sum / n_predicted). Bits per element are measured from the bytes each
window's cache stores after its last write, pooled over windows (sum of bytes x 8 /
sum of K/V elements). A batch's cache stores the per-(layer, role) tensors shared by
all its rows (a seeded rotation) once; it reports them once per row, and the per-row
fitted ones as stored (one per row already: `fitted.nbytes_as_row_caches`), so the
figure is the same as scoring one window at a time.

Bytes in two parts (quantizers/base.py; METHOD.md 4 "Bits:"). A record holds
- `cache_nbytes`, `cache_bits_per_element`: the caches' own bytes, pooled over windows
  (codes, scales, fitted codebooks; no model constants): the figure methods compare by;
- `constant_nbytes`: the model constants (seeded rotations, sketches, HQMQ's
  secondaries) of one cache, every layer and role: once per MODEL, not per window;
- `total_nbytes`, `bits_per_element`: the TOTAL, as if every window's cache stored
  the constants too (`cache_nbytes + n_windows x constant_nbytes`), kept for
  compatibility with records made before the split (whose `cache_nbytes` was this total).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ...kernels.graphs import GraphedDecodeStep
from ...quantizers import get_quantizer, parse_spec
from ...quantizers.checks import deferred_checks, flush
from ...quantizers.fitted import FitsOnFirstWrite
from .attention import fused_attention
from .calibration import fit_calibration, spec_needs_calibration
from .kv_cache import QuantizedCache, cache_kwargs, plain_cache_stats

Progress = Callable[[int, int], None]  # (windows done, windows total)
DEFAULT_BATCH = 8
LOGITS_BUDGET = 1 << 29  # bytes of fp32 logits one forward pass may produce (512 MiB)


def _device_of(model, device) -> torch.device:
    """Run where the model is; an explicit `device` moves the model there."""
    model_device = next(model.parameters()).device
    if device is None:
        return model_device
    device = torch.device(device)
    if model_device != device:
        model.to(device)
    return device


def _new_cache(model, spec: str | None, seed: int, capacity: int = 0, fused: bool | None = False,
               prefill: str = "quantized", calibration=None):
    if spec is None:
        return DynamicCache(config=model.config)
    return QuantizedCache(spec, config=model.config, seed=seed, capacity=capacity, fused=fused, prefill=prefill,
                          calibration=calibration)


def _fitted_calibration(spec: str | None, seed: int, calibration, device=None):
    """A calibrated spec's calibration fitted once for every batch's cache (captured K/V in,
    suites/harness/calibration.py; fitted on `device`, the scoring's); anything else as given."""
    if calibration is None or not spec_needs_calibration(spec):
        return calibration
    return fit_calibration(spec, calibration, seed, device=device)


class _Bytes:
    """Bytes pooled over the windows of one run (module docstring: total, cache, constant)."""

    def __init__(self):
        self.total = self.cache = self.constant = self.numel = 0

    def add(self, cache, scored: int | None = None, rows: int | None = None) -> None:
        """A batch's cache, as its rows would store them one by one; with `scored` of its
        `rows` rows, those rows' share (the other rows being greedy twins of equal bytes
        per row: `twins_unsupported`), which must divide exactly."""
        if isinstance(cache, QuantizedCache):
            total, own, numel = cache.nbytes_as_row_caches(), cache.cache_nbytes_as_row_caches(), cache.numel()
            # once per model: the same tensors in every window's cache
            self.constant = max(self.constant, cache.constant_nbytes())
        else:
            total, numel = plain_cache_stats(cache)
            own = total
        if scored is not None:
            parts = [total * scored, own * scored, numel * scored]
            if any(x % rows for x in parts):
                raise RuntimeError(f"{getattr(cache, 'spec', 'the cache')}: {rows} rows do not store equal bytes "
                                   f"({total} B, {numel} elements); the scored rows' share is not defined")
            total, own, numel = (x // rows for x in parts)
        self.total, self.cache, self.numel = self.total + total, self.cache + own, self.numel + numel

    def fields(self) -> dict:
        bits = (lambda b: b * 8 / self.numel) if self.numel else (lambda b: float("nan"))
        return dict(bits_per_element=bits(self.total), cache_bits_per_element=bits(self.cache),
                    cache_nbytes=self.cache, constant_nbytes=self.constant, total_nbytes=self.total,
                    cache_elements=self.numel)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL of `targets` [rows, T] under `logits` [rows, T, V], summed per row (window):
    [rows], float32 softmax, float64 sum. Kept on the device (no per-step host sync);
    read once per batch. The per-window sums go on the record as `window_nll` (window
    order), so two quantizers can be compared paired, window by window (compare/verdicts.py)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           reduction="none").double().view(targets.shape[0], -1).sum(1)


def _check_windows(windows: torch.Tensor, min_len: int) -> torch.Tensor:
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long:
        raise ValueError(f"windows must be a LongTensor [n, N], got {getattr(windows, 'shape', windows)}")
    if windows.shape[0] == 0 or windows.shape[1] < min_len:
        raise ValueError(f"need at least one window of >= {min_len} tokens, got shape {tuple(windows.shape)}")
    return windows


def rows_independent(quantizer_cls) -> bool:
    """Whether a row's bytes and decoded values are independent of the other rows of
    its write: the class's `rows_independent` if it says; else, for quantizers that
    fit shared tensors on the first write, whether they fit them per row
    (`fit_per_row`: fp8's one scale over all rows does not); True otherwise
    (statistics per (row, kv-head))."""
    said = getattr(quantizer_cls, "rows_independent", None)
    if said is not None:
        return bool(said)
    return bool(quantizer_cls.fit_per_row) if issubclass(quantizer_cls, FitsOnFirstWrite) else True


def batch_rows(model, spec: str | None, windows: torch.Tensor, batch_size: int, scored_len: int) -> int:
    """Windows per forward pass: `batch_size`, 1 for a quantizer whose statistics span
    rows, and no more than LOGITS_BUDGET allows for `scored_len` logits per row."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if spec is not None and not rows_independent(parse_spec(spec)[0]):
        return 1
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 1
    cap = max(1, LOGITS_BUDGET // max(1, scored_len * vocab * 4))
    return max(1, min(batch_size, cap, windows.shape[0]))


def _fused_setting(model, spec: str | None, fused: bool | None):
    """(context, the cache's `fused`): the "kvqbench" attention for decode steps where it
    changes nothing but speed, a quantized cache on a model that runs SDPA (its dense
    path IS SDPA); elsewhere no context and a dense cache."""
    if fused is not False and spec is not None and getattr(model.config, "_attn_implementation", None) == "sdpa":
        return fused_attention(model), fused
    return contextlib.nullcontext(), False


def _last_logit_only(model) -> dict:
    """Ask the prefill for its last logit only, where the model's forward supports it."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def twins_unsupported(model, spec: str | None) -> str | None:
    """Why a batch of `spec` cannot carry greedy twins of its windows (`ppl_deployed(...,
    continuations=True)`), or None. A twin shares its window's cache, so it must leave
    the window's figures as they are: its rows' statistics must not mix with the
    window's (`rows_independent`), and every row must store the same bytes (no field
    whose length depends on the data, such as Med3x's outlier list), so the windows'
    share of the cache's bytes is exact."""
    if spec is None:
        return None
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return _twins_unsupported(parse_spec(spec)[0], spec, heads, head_dim)


@functools.lru_cache(maxsize=256)
def _twins_unsupported(cls, spec: str, heads: int, head_dim: int) -> str | None:
    """`twins_unsupported` for a format class, spec and shape: a function of the format's
    code alone, so asked once per process (a calibrated spec's probe runs an EM fit)."""
    if not rows_independent(cls):
        return f"{spec}: its statistics span the rows of a write"
    for role in ("K", "V"):
        q = get_quantizer(spec, role=role)
        try:  # a prefill's write and a decode step's, of zeros (a data-dependent list stays empty)
            if getattr(q, "needs_calibration", False):  # any calibration will do: the layout is asked
                q.load_calibration(q.calibrate(torch.randn(1, heads, 16, head_dim,
                                                           generator=torch.Generator().manual_seed(0))))
            packed = q.append(q.append(None, torch.zeros(2, heads, 3, head_dim)), torch.zeros(2, heads, 1, head_dim))
        except (ValueError, RuntimeError) as e:  # e.g. a calibrated spec without its calibration
            return f"{spec} {role}: a probe write failed ({e})"
        uneven = sorted({k for seg in packed.segments for k, t in seg.fields.items() if t.dim() == 0
                         or t.shape[0] != 2})
        if uneven:
            return f"{spec} {role}: its field(s) {', '.join(uneven)} are not one slice per row"
    return None


def _decode_step(model, cache, kw: dict, rows: int, total_tokens: int, graph: bool) -> Callable:
    """ids [rows, 1] -> logits [rows, 1, vocab] of one decode step: a `GraphedDecodeStep`
    where `graph` and the cache can take device-position steps (it reserves room for
    `total_tokens`), else the model called eagerly."""
    if graph and isinstance(cache, QuantizedCache) and cache.graph_unsupported() is None:
        return GraphedDecodeStep(model, cache, batch=rows, max_tokens=total_tokens)

    def eager(ids):
        return model(input_ids=ids, **kw, use_cache=True).logits
    eager.mode = "eager"
    return eager


def _result(protocol, params, spec, seed, windows, nll, n_pred, stored: _Bytes, t0, batch) -> dict:
    return dict(
        protocol=protocol,
        **params,
        spec=spec if spec is not None else "plain",
        seed=seed,
        n_windows=int(windows.shape[0]),
        window=int(windows.shape[1]),
        nll_sum=nll,
        n_predicted=n_pred,
        ppl=math.exp(nll / n_pred),
        **stored.fields(),
        batch_size=batch,
        wall_s=time.perf_counter() - t0,
    )


def ppl_quantize_on_write(model, windows: torch.Tensor, spec: str | None, seed: int = 0, *,
                          device=None, progress: Progress | None = None,
                          batch_size: int = DEFAULT_BATCH, calibration=None) -> dict:
    """`quantize-on-write` (the paper's protocol): one forward pass per window of N tokens
    through a fresh cache, so attention reads quantized K/V at every position, prefill
    included (the whole window is one write). Predicted: tokens 1..N-1 of each window
    (N-1 per window), from logits 0..N-2. `batch_size` windows share a forward pass.

    Caveat (METHOD.md 4): the single write lets per-write statistics (KIVI's per-channel
    key groups, the Med3x median) include tokens later than the query that reads them.
    """
    windows = _check_windows(windows, 2)
    dev = _device_of(model, device)
    calibration = _fitted_calibration(spec, seed, calibration, dev)
    n_win, N = windows.shape
    rows = batch_rows(model, spec, windows, batch_size, N)
    t0 = time.perf_counter()
    nll, n_pred, stored = 0.0, 0, _Bytes()
    per_window: list[float] = []
    # Value checks (NaN/Inf, fp16 range) are read once per batch, with the loss.
    with torch.inference_mode(), deferred_checks():
        for i in range(0, n_win, rows):
            ids = windows[i:i + rows].to(dev)
            cache = _new_cache(model, spec, seed, calibration=calibration)
            logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
            batch_nll = _nll(logits[:, :-1], ids[:, 1:])
            flush()
            per_window += batch_nll.tolist()
            nll += sum(per_window[i:])  # this batch's windows, summed as a batch
            n_pred += ids.shape[0] * (N - 1)
            stored.add(cache)
            del cache, logits
            if progress:
                progress(i + ids.shape[0], n_win)
    return _result("quantize-on-write", {"window_nll": per_window},
                   spec, seed, windows, nll, n_pred, stored, t0, rows)


def ppl_prefill_then_decode(model, windows: torch.Tensor, spec: str | None, seed: int = 0, *,
                            context: int, device=None, progress: Progress | None = None,
                            batch_size: int = DEFAULT_BATCH, fused: bool | None = None,
                            graph: bool | None = None, calibration=None) -> dict:
    """`prefill-then-decode`: tokens 0..L-1 (L = `context`) of each window are written in
    one prefill call; then tokens L..N-2 are fed one decode step at a time (each step
    writes its one token to the cache and attends to the quantized history).

    Predicted: tokens L..N-1 (N-L per window). Token L is predicted by the prefill's last
    logit (position L-1, which read the quantized prefill); token t+1 by the decode step
    that feeds token t, for t = L..N-2. Token N-1 is never written. Every statistic a
    quantizer computes over the prefill write is fixed before any scored decode write.
    `batch_size` windows share each call; `fused` lets decode steps read the packed
    store through the fused kernels: None (default) on CUDA, True also under the Triton
    interpreter on a CPU (slow; tests), False never (module docstring). `graph`: replay
    the decode steps as a CUDA graph (kernels/graphs.py `GraphedDecodeStep`) where the
    cache can take device-position steps: None (default) on CUDA, True also on a CPU
    (device-position steps, uncaptured, under the Triton interpreter: tests), False never. The
    graph runs the same kernels on the same buffers as the eager fused step (bit-equal
    logits: suites/tests/test_graph_step.py); it removes the host time of ~30 layers x
    (write + attention) per step, which dominated this protocol on a GPU. The result
    records the step mode (`decode_mode`: graph, eager, or both across batches).
    """
    return _prefill_decode("prefill-then-decode", model, windows, spec, seed, context, device, progress,
                           batch_size, fused, graph, calibration)


def ppl_deployed(model, windows: torch.Tensor, spec: str | None, seed: int = 0, *,
                 context: int, device=None, progress: Progress | None = None,
                 batch_size: int = DEFAULT_BATCH, fused: bool | None = None,
                 graph: bool | None = None, calibration=None, continuations: bool = False) -> dict:
    """`deployed`: what a serving engine does. Tokens 0..L-1 are one prefill call whose
    attention reads its own K/V at full precision (`QuantizedCache(prefill="exact")`)
    while they are stored quantized; tokens L..N-2 are then fed one decode step at a
    time, each reading the quantized cache (fused and graphed where it can be, as in
    `prefill-then-decode`). Scored are the decode steps' predictions only: tokens
    L+1..N-1 (N-1-L per window); token L's logit comes from the exact prefill and would
    not depend on the quantizer. Arguments as `ppl_prefill_then_decode`.

    `continuations=True`: each batch also carries a greedy twin of each window, a row with
    the same prompt (tokens 0..L-1) that then feeds itself its own argmax, as greedy
    generation does, in the same cache and the same replayed steps (a fidelity figure at
    the cost of a wider batch, not of a second capture: suites/harness/fidelity.py).
    The result then holds `continuations`, each window's N-L greedy tokens (the exact
    prefill's argmax, then one per step). The scored figures are the windows' rows
    alone, bytes included; `spec` must take twins (`twins_unsupported`). The batch is
    twice as wide, so its matrix products may round otherwise than without twins
    (module docstring: batch size): `continuation_rows` records it."""
    if continuations:
        why = twins_unsupported(model, spec)
        if why:
            raise ValueError(f"continuations=True: {why}")
    return _prefill_decode("deployed", model, windows, spec, seed, context, device, progress,
                           batch_size, fused, graph, calibration, continuations)


def _attention_route(model, cache) -> str:
    """What a batch's decode steps read the history with: the quantized cache's route
    (QuantizedCache.attention_route: cuda / triton / dense), "sdpa" for the model's own cache."""
    route = getattr(cache, "attention_route", None)
    if route is None:
        return "sdpa"
    return route(model.config.get_text_config().num_attention_heads, next(model.parameters()).dtype)


def _prefill_decode(protocol, model, windows, spec, seed, context, device, progress, batch_size, fused, graph,
                    calibration=None, twins: bool = False):
    windows = _check_windows(windows, 2 if protocol == "prefill-then-decode" else 3)
    calibration = _fitted_calibration(spec, seed, calibration, _device_of(model, device))
    n_win, N = windows.shape
    last = N - 1 if protocol == "prefill-then-decode" else N - 2  # deployed: one decode step at least
    if not 1 <= context <= last:
        raise ValueError(f"context must be in 1..{last} for windows of {N} tokens under {protocol}, got {context}")
    exact = protocol == "deployed"
    dev = _device_of(model, device)
    rows = batch_rows(model, spec, windows, batch_size, 1)
    t0 = time.perf_counter()
    nll, n_pred, stored = 0.0, 0, _Bytes()
    context_manager, fused = _fused_setting(model, spec, fused)
    graph = fused is not False and (graph if graph is not None else dev.type == "cuda")
    modes: set[str] = set()
    routes: set[str] = set()  # what the decode steps read the history with (cuda, triton, dense, sdpa)
    per_window: list[float] = []
    continued: list[list[int]] = []  # the greedy twins' tokens, per window
    # Value checks (NaN/Inf, fp16 range) of every write are read once per batch, with
    # the loss: no host synchronisation inside the decode loop from them.
    with torch.inference_mode(), context_manager, deferred_checks():
        for i in range(0, n_win, rows):
            ids = windows[i:i + rows].to(dev)
            r = ids.shape[0]
            fed = torch.cat([ids, ids]) if twins else ids  # rows r.. are the twins
            cache = _new_cache(model, spec, seed, capacity=N, fused=fused, prefill="exact" if exact else "quantized",
                               calibration=calibration)
            kw = cache_kwargs(model, cache)
            logits = model(input_ids=fed[:, :context], **kw, use_cache=True, **_last_logit_only(model)).logits[:, -1:]
            w_nll = torch.zeros(r, dtype=torch.float64, device=dev) if exact else \
                _nll(logits[:r], ids[:, context:context + 1])
            greedy = [logits[r:, -1].argmax(-1, keepdim=True)] if twins else []  # argmax on device: no sync
            step = _decode_step(model, cache, kw, fed.shape[0], N, graph)
            for t in range(context, N - 1):
                out = step(torch.cat([ids[:, t:t + 1], greedy[-1]]) if twins else ids[:, t:t + 1])[:, -1:]
                w_nll += _nll(out[:r], ids[:, t + 1:t + 2])
                if twins:
                    greedy.append(out[r:, -1].argmax(-1, keepdim=True))
            flush()
            modes.add(getattr(step, "mode", "eager"))
            routes.add(_attention_route(model, cache))
            per_window += w_nll.tolist()
            if twins:
                continued += torch.cat(greedy, 1).tolist()
            nll += sum(per_window[i:])  # this batch's windows, summed as a batch
            n_pred += r * (N - context - (1 if exact else 0))
            stored.add(cache, *((r, fed.shape[0]) if twins else ()))
            del cache, logits
            if progress:
                progress(i + ids.shape[0], n_win)
    extra = {"continuations": continued, "continuation_rows": rows} if twins else {}
    return _result(protocol, {"context": context, "decode_steps": N - 1 - context,
                              "decode_mode": "+".join(sorted(modes)), "decode_attention": "+".join(sorted(routes)),
                              "window_nll": per_window, **extra},
                   spec, seed, windows, nll, n_pred, stored, t0, rows)


__all__ = ["DEFAULT_BATCH", "batch_rows", "rows_independent", "ppl_quantize_on_write", "ppl_prefill_then_decode",
           "ppl_deployed", "twins_unsupported"]
