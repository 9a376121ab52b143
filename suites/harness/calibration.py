"""Calibration K/V for calibrated quantizers (quantizers/calibrated.py): captured from
the model in fp16 over calibration token windows, per (layer, role).

    cal = capture_kv(model, cal_windows)                   # {(layer, "K"|"V"): [N, H, T, D]}
    fitted = fit_calibration("avq2-cal", cal, seed=0)       # {(layer, role): {"codebooks": ...}}
    cache = QuantizedCache("avq2-cal", config=model.config, calibration=fitted)

`capture_kv` runs the model once per window through an `fp16` QuantizedCache (K/V
stored as fp16, what every quantizer is handed; keys after RoPE) and keeps what
each layer stored, float32 on the CPU. `fit_calibration` calls each (layer, role)'s
quantizer's `calibrate` once: do it once per (spec, seed) and hand the fitted dicts
to every cache (a cache given raw K/V fits on construction, per cache).

`calibration_starts` places calibration windows in the corpus token stream AFTER the
scored windows (in the gaps each scored window leaves before the next, or before the
corpus's end), so they never overlap a scored token: the compare run records where.
"""
from __future__ import annotations

import torch

from ...quantizers import get_quantizer
from ...quantizers.calibrated import needs_calibration

ROLES = ("K", "V")


def spec_needs_calibration(spec: str | None) -> bool:
    """Whether `spec`'s quantizer must be calibrated (False for None, the plain cache)."""
    return spec is not None and needs_calibration(get_quantizer(spec))


def calibration_starts(n_tokens: int, scored_starts: list[int], scored_len: int, length: int,
                       n_windows: int) -> list[int]:
    """Token offsets of `n_windows` calibration windows of `length` tokens, each starting
    at or after the end of a scored window (windows of `scored_len` tokens at
    `scored_starts`) and overlapping none, packed from the first scored window on: the
    gap after scored window i holds as many as fit before scored window i+1 starts (or
    the corpus ends). ValueError when the gaps cannot hold them."""
    if n_windows < 1 or length < 1:
        raise ValueError(f"calibration windows: need n >= 1 windows of >= 1 tokens, got {n_windows} x {length}")
    starts = sorted(scored_starts)
    ends = starts[1:] + [n_tokens]
    out: list[int] = []
    for s, nxt in zip(starts, ends):
        t = s + scored_len
        while t + length <= nxt and len(out) < n_windows:
            out.append(t)
            t += length
        if len(out) == n_windows:
            return out
    raise ValueError(f"calibration windows: the corpus ({n_tokens} tokens) leaves room for only {len(out)} "
                     f"window(s) of {length} tokens after the {len(starts)} scored windows of {scored_len}; "
                     f"asked for {n_windows} (fewer or shorter calibration windows, or fewer scored windows)")


def capture_kv(model, windows: torch.Tensor, batch_size: int = 1) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, role): float32 CPU [N, H, T, D]} of the K/V the model writes for token
    windows [N, T] (LongTensor), through an fp16 cache (fp16-rounded, keys after RoPE)."""
    from .kv_cache import QuantizedCache, cache_kwargs

    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long \
            or windows.shape[0] < 1 or windows.shape[1] < 1:
        raise ValueError(f"calibration windows must be a LongTensor [n >= 1, T >= 1], got "
                         f"{getattr(windows, 'shape', windows)}")
    dev = next(model.parameters()).device
    parts: dict[tuple[int, str], list[torch.Tensor]] = {}
    with torch.inference_mode():
        for i in range(0, windows.shape[0], batch_size):
            cache = QuantizedCache("fp16", config=model.config, fused=False)
            model(input_ids=windows[i:i + batch_size].to(dev), **cache_kwargs(model, cache), use_cache=True)
            for layer in range(len(cache.layers)):
                for role in ROLES:
                    parts.setdefault((layer, role), []).append(cache.layers[layer].read(role).float().cpu())
            del cache
    return {k: torch.cat(v) for k, v in parts.items()}


def fit_calibration(spec: str, captured: dict, seed: int = 0,
                    device: torch.device | str | None = None) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, role): shared tensors} fitted by the (layer, role) quantizers of `spec` (seed
    `seed`) on captured K/V (`capture_kv`); entries already fitted (dicts) are kept.

    device: where each fit runs (the K/V are moved there one (layer, role) at a time; the
    fitted tensors come back as `calibrate` returns them). The compare passes the model's
    device: fitted on the H200's host CPU, avq2-cal's and avq3-cal's 60 fits each left 26-31 s
    per seed between the deployed compare's rows (its progress bar, 2026-12-05 10:55 UTC; on
    this 2-core VM `fit_s` reads 10 + 16-18 s). A GPU fit differs from a CPU fit in rounding only."""
    if not isinstance(captured, dict) or not captured:
        raise ValueError(f"{spec}: calibration must be a non-empty mapping (layer, role) -> K/V, "
                         f"got {type(captured).__name__}")
    out = {}
    for (layer, role), x in sorted(captured.items()):
        if isinstance(x, dict):
            out[(layer, role)] = x
            continue
        if device is not None and isinstance(x, torch.Tensor):
            x = x.to(device)
        out[(layer, role)] = get_quantizer(spec, layer=layer, role=role, seed=seed).calibrate(x)
    return out


def describe(starts: list[int], length: int, captured: dict | None = None, capture_s: float | None = None) -> dict:
    """What a results file records of a calibration: token ranges, count, capture size."""
    info = {"n": len(starts), "tokens": length, "ranges": [[s, s + length] for s in starts],
            "placement": "corpus tokens after the scored windows (in the gaps they leave), disjoint from "
                         "every scored token; K/V captured from an fp16 cache (keys after RoPE)"}
    if captured:
        x = next(iter(captured.values()))
        if isinstance(x, torch.Tensor):
            info["captured_shape"] = list(x.shape)
    if capture_s is not None:
        info["capture_s"] = round(capture_s, 2)
    return info


def corpus_calibration(model, tokenizer, text: str, n_windows: int, length: int,
                       scored_starts: list[int] | None = None, scored_len: int | None = None) -> tuple[dict, dict]:
    """(captured K/V, what to record of it) for `n_windows` windows of `length` tokens (the
    tokenizer's special prefix included, as `token_windows` cuts them) of corpus `text`:
    after the scored windows (`scored_starts`, each `scored_len` corpus tokens; as
    `calibration_starts`) where there are some, else centred in the corpus token stream
    (away from its start, where prompts and the offline lm-eval tasks read). ValueError
    when the corpus cannot hold them."""
    import time

    from .corpora import special_prefix, tokenize_text

    prefix = special_prefix(tokenizer)
    body = length - len(prefix)
    if body < 1 or n_windows < 1:
        raise ValueError(f"calibration windows: need n >= 1 windows of more than {len(prefix)} tokens, "
                         f"got {n_windows} x {length}")
    ids = tokenize_text(tokenizer, text)
    if scored_starts:
        starts = calibration_starts(len(ids), scored_starts, body if scored_len is None else scored_len, body,
                                    n_windows)
    else:
        if n_windows * body > len(ids):
            raise ValueError(f"calibration windows: the corpus ({len(ids)} tokens) cannot hold {n_windows} "
                             f"window(s) of {body} tokens")
        first = (len(ids) - n_windows * body) // 2
        starts = [first + i * body for i in range(n_windows)]
    t0 = time.perf_counter()
    captured = capture_kv(model, torch.tensor([prefix + ids[s:s + body] for s in starts], dtype=torch.long))
    info = describe(starts, body, captured, time.perf_counter() - t0)
    if not scored_starts:
        info["placement"] = ("contiguous corpus tokens centred in the corpus (no scored windows to keep clear "
                             "of); K/V captured from an fp16 cache (keys after RoPE)")
    return captured, info


__all__ = ["calibration_starts", "capture_kv", "corpus_calibration", "describe", "fit_calibration",
           "spec_needs_calibration"]
