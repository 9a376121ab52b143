"""Perplexity under a quantized KV cache: the two protocols of METHOD.md section 4.

    r = ppl_quantize_on_write(model, windows, "hqmq:S=96,r=4", seed=0)
    r = ppl_prefill_then_decode(model, windows, "int4", seed=0, context=256)
    r["ppl"], r["bits_per_element"], r["protocol"]

`windows` is a LongTensor [n, N] of token ids (suites/harness/corpora.py `token_windows`).
`spec` is a quantizer spec; "fp16" is the fp16 baseline (K/V stored as fp16), and
`None` means the model's own plain cache (DynamicCache, no quantizer at all).

Each window runs alone (batch 1) from a fresh cache: quantizers with per-write
statistics (a Med3x median, per-channel key groups) must not mix windows.

PPL = exp(nll_sum / n_predicted). Bits per element are measured from the bytes each
window's cache stores after its last write, pooled over windows (sum of bytes x 8 /
sum of K/V elements, i.e. averaged weighting by elements).
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .kv_cache import QuantizedCache, cache_kwargs, plain_cache_stats

Progress = Callable[[int, int], None]  # (windows done, windows total)


def _device_of(model, device) -> torch.device:
    """Run where the model is; an explicit `device` moves the model there."""
    model_device = next(model.parameters()).device
    if device is None:
        return model_device
    device = torch.device(device)
    if model_device != device:
        model.to(device)
    return device


def _new_cache(model, spec: str | None, seed: int):
    if spec is None:
        return DynamicCache(config=model.config)
    return QuantizedCache(spec, config=model.config, seed=seed)


def _cache_stats(cache) -> tuple[int, int]:
    if isinstance(cache, QuantizedCache):
        return cache.nbytes(), cache.numel()
    return plain_cache_stats(cache)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed NLL of `targets` [T] under `logits` [T, V]: float32 softmax, float64 sum.
    Kept on the device (no per-step host sync); `.item()` once per window."""
    return F.cross_entropy(logits.float(), targets, reduction="sum").double()


def _check_windows(windows: torch.Tensor, min_len: int) -> torch.Tensor:
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long:
        raise ValueError(f"windows must be a LongTensor [n, N], got {getattr(windows, 'shape', windows)}")
    if windows.shape[0] == 0 or windows.shape[1] < min_len:
        raise ValueError(f"need at least one window of >= {min_len} tokens, got shape {tuple(windows.shape)}")
    return windows


def _result(protocol, params, spec, seed, windows, nll, n_pred, nbytes, numel, t0) -> dict:
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
        bits_per_element=nbytes * 8 / numel if numel else float("nan"),
        cache_nbytes=nbytes,
        cache_elements=numel,
        wall_s=time.perf_counter() - t0,
    )


def ppl_quantize_on_write(model, windows: torch.Tensor, spec: str | None, seed: int = 0, *,
                          device=None, progress: Progress | None = None) -> dict:
    """`quantize-on-write` (the paper's protocol): one forward pass per window of N tokens
    through a fresh cache, so attention reads quantized K/V at every position, prefill
    included (the whole window is one write). Predicted: tokens 1..N-1 of each window
    (N-1 per window), from logits 0..N-2.

    Caveat (METHOD.md 4): the single write lets per-write statistics (KIVI's per-channel
    key groups, the Med3x median) include tokens later than the query that reads them.
    """
    windows = _check_windows(windows, 2)
    dev = _device_of(model, device)
    t0 = time.perf_counter()
    nll, n_pred, nbytes, numel = 0.0, 0, 0, 0
    with torch.inference_mode():
        for i, w in enumerate(windows):
            ids = w.to(dev).unsqueeze(0)
            cache = _new_cache(model, spec, seed)
            logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits[0]
            nll += _nll(logits[:-1], ids[0, 1:]).item()
            n_pred += ids.shape[1] - 1
            b, n = _cache_stats(cache)
            nbytes, numel = nbytes + b, numel + n
            del cache, logits
            if progress:
                progress(i + 1, len(windows))
    return _result("quantize-on-write", {}, spec, seed, windows, nll, n_pred, nbytes, numel, t0)


def ppl_prefill_then_decode(model, windows: torch.Tensor, spec: str | None, seed: int = 0, *,
                            context: int, device=None, progress: Progress | None = None) -> dict:
    """`prefill-then-decode`: tokens 0..L-1 (L = `context`) of each window are written in
    one prefill call; then tokens L..N-2 are fed one decode step at a time (each step
    writes its one token to the cache and attends to the quantized history).

    Predicted: tokens L..N-1 (N-L per window). Token L is predicted by the prefill's last
    logit (position L-1, which read the quantized prefill); token t+1 by the decode step
    that feeds token t, for t = L..N-2. Token N-1 is never written. Every statistic a
    quantizer computes over the prefill write is fixed before any scored decode write.
    """
    windows = _check_windows(windows, 2)
    N = windows.shape[1]
    if not 1 <= context < N:
        raise ValueError(f"context must be in 1..{N - 1} for windows of {N} tokens, got {context}")
    dev = _device_of(model, device)
    t0 = time.perf_counter()
    nll, n_pred, nbytes, numel = 0.0, 0, 0, 0
    with torch.inference_mode():
        for i, w in enumerate(windows):
            ids = w.to(dev).unsqueeze(0)
            cache = _new_cache(model, spec, seed)
            kw = cache_kwargs(model, cache)
            logits = model(input_ids=ids[:, :context], **kw, use_cache=True).logits[0, -1:]
            w_nll = _nll(logits, ids[0, context:context + 1])
            for t in range(context, N - 1):
                logits = model(input_ids=ids[:, t:t + 1], **kw, use_cache=True).logits[0, -1:]
                w_nll += _nll(logits, ids[0, t + 1:t + 2])
            nll += w_nll.item()
            n_pred += N - context
            b, n = _cache_stats(cache)
            nbytes, numel = nbytes + b, numel + n
            del cache, logits
            if progress:
                progress(i + 1, len(windows))
    return _result("prefill-then-decode", {"context": context, "decode_steps": N - 1 - context},
                   spec, seed, windows, nll, n_pred, nbytes, numel, t0)


__all__ = ["ppl_quantize_on_write", "ppl_prefill_then_decode"]
