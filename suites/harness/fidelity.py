"""Generation fidelity: what a user sees first when a cache is quantized, greedy
continuations that leave the unquantized model's.

    ref = reference_continuations(model, prompts, new_tokens=64)       # the model's own cache
    f = fidelity(model, prompts, "int4", ref, seed=0)
    f["first_diff_mean"], f["first_diff_min"], f["never_diverged"], f["match_rate"], f["nll_per_token"]

Both continuations come from `generate.generate` (exact prefill, decode steps through
the cache: the deployed protocol), EOS off, so every row has `new_tokens` tokens. The
compare makes the quantized ones cheaper where it runs the deployed protocol: each
window's greedy twin rides in the perplexity run's own batch and replayed steps
(`perplexity.ppl_deployed(..., continuations=True)`), scored here by
`score_continuations` (`source` says which; a format whose rows cannot share a cache
that way, `perplexity.twins_unsupported`, runs through `fidelity`).
Per prompt: the index of the first generated token that differs from the reference
(`new_tokens` where none does: such rows are counted in `never_diverged` and enter the
mean at that censored value, so the mean is a lower bound when any row never diverged);
the match rate, positions equal to the reference's over all generated positions; and
the NLL per token the unquantized model assigns to the quantized continuation (teacher
forced over prompt + continuation, exact attention), beside the reference's own
(`ref_nll_per_token`): how much less likely the model finds what the quantized cache
made it say.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .calibration import fit_calibration, spec_needs_calibration
from .generate import generate


def _ids(prompts) -> torch.Tensor:
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.dtype != torch.long:
        raise ValueError(f"prompts must be a LongTensor [n, L] (equal lengths), got {getattr(prompts, 'shape', prompts)}")
    if prompts.shape[0] == 0 or prompts.shape[1] == 0:
        raise ValueError("need at least one prompt of at least one token")
    return prompts


def _nll_per_row(model, prompts: torch.Tensor, cont: list[list[int]], batch: int) -> list[float]:
    """Summed NLL of each continuation given its prompt, under the model's own attention."""
    dev = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for i in range(0, prompts.shape[0], batch):
            p = prompts[i:i + batch].to(dev)
            c = torch.tensor(cont[i:i + batch], dtype=torch.long, device=dev)
            x = torch.cat([p, c], 1)
            logits = model(input_ids=x[:, :-1], use_cache=False).logits[:, p.shape[1] - 1:]
            nll = F.cross_entropy(logits.float().transpose(1, 2), c, reduction="none").double().sum(1)
            out += nll.tolist()
    return out


def reference_continuations(model, prompts: torch.Tensor, new_tokens: int, batch: int = 8) -> dict:
    """Greedy continuations through the model's own (unquantized) cache, and their NLL."""
    prompts = _ids(prompts)
    tokens = []
    for i in range(0, prompts.shape[0], batch):
        tokens += generate(model, prompts[i:i + batch], None, max_new_tokens=new_tokens, eos_token_id=[]).tokens
    return {"tokens": tokens, "nll": _nll_per_row(model, prompts, tokens, batch), "new_tokens": new_tokens}


def fidelity(model, prompts: torch.Tensor, spec: str, reference: dict, seed: int = 0, batch: int = 8,
             calibration=None) -> dict:
    """Greedy continuations through a cache quantized by `spec` against `reference`
    (module docstring for the figures). `calibration`: a calibrated spec's (what
    `QuantizedCache(calibration=)` takes: captured K/V of windows other than `prompts`,
    fitted here once for `seed`, or the fitted dicts)."""
    prompts = _ids(prompts)
    if spec_needs_calibration(spec):
        if calibration is None:
            raise ValueError(f"{spec} is a calibrated quantizer (fitted once per model on calibration K/V): "
                             "fidelity(..., calibration=) needs its calibration, K/V of windows other than the "
                             "prompts (suites/harness/calibration.py)")
        calibration = fit_calibration(spec, calibration, seed,  # once for every batch of prompts
                                      device=next(model.parameters()).device)
    n = reference["new_tokens"]
    if len(reference["tokens"]) != prompts.shape[0]:
        raise ValueError(f"{len(reference['tokens'])} reference continuations for {prompts.shape[0]} prompts")
    tokens, modes = [], set()
    for i in range(0, prompts.shape[0], batch):
        g = generate(model, prompts[i:i + batch], spec, max_new_tokens=n, eos_token_id=[], seed=seed,
                     calibration=calibration)
        tokens += g.tokens
        modes.add(g.mode)
    return score_continuations(model, prompts, tokens, reference, spec=spec, seed=seed, batch=batch,
                               decode_mode="+".join(sorted(modes)))


def score_continuations(model, prompts: torch.Tensor, tokens: list[list[int]], reference: dict, *, spec: str,
                        seed: int, batch: int = 8, decode_mode: str, source: str = "generate") -> dict:
    """The figures of the module docstring for greedy continuations `tokens` (one list of
    `reference["new_tokens"]` per prompt) made elsewhere: by `fidelity`'s own
    generation, or by the greedy twins of a deployed perplexity run
    (`ppl_deployed(..., continuations=True)`, `source="deployed twins"`)."""
    prompts = _ids(prompts)
    n = reference["new_tokens"]
    if len(tokens) != prompts.shape[0] or any(len(t) != n for t in tokens):
        raise ValueError(f"need {prompts.shape[0]} continuations of {n} tokens, got {len(tokens)} of "
                         f"{sorted(set(map(len, tokens)))}")
    first, matches = [], 0
    for got, want in zip(tokens, reference["tokens"]):
        diff = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), n)
        first.append(diff)
        matches += sum(a == b for a, b in zip(got, want))
    nll = _nll_per_row(model, prompts, tokens, batch)
    rows = prompts.shape[0]
    return dict(spec=spec, seed=seed, prompts=rows, prompt_len=int(prompts.shape[1]), new_tokens=n,
                first_diff=first, first_diff_mean=sum(first) / rows, first_diff_min=min(first),
                never_diverged=sum(d == n for d in first), match_rate=matches / (rows * n),
                nll_per_token=sum(nll) / (rows * n), ref_nll_per_token=sum(reference["nll"]) / (rows * n),
                ppl_of_continuation=math.exp(sum(nll) / (rows * n)), decode_mode=decode_mode, source=source)


__all__ = ["fidelity", "reference_continuations", "score_continuations"]
