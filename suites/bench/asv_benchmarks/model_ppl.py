"""Perplexity of the default embedded model (smollm2-135m) on a short fixed window of
the default corpus (canterbury), K/V quantized by every registered quantizer's
example configs, under `quantize-on-write` (METHOD.md 4). asv assumes lower is
better, which PPL is.

One window of 160 tokens (the first of `token_windows(tok, text, 160, 1)`: the
corpus's first 160 tokens): short enough for a CPU run of every quantizer, long
enough that KIVI (128-token fp16 window) quantizes some tokens. The model loads
once, in setup_cache, which measures every spec; each track_ reads its figure.
"""
from __future__ import annotations

import torch

from .common import SPECS, CachedFigures, cached_figure, quantizer_or_skip

MODEL, CORPUS, WINDOW, N_WINDOWS = "smollm2-135m", "canterbury", 160, 1


class Perplexity(CachedFigures):
    params = [SPECS]
    param_names = ["spec"]
    timeout = 3600  # setup_cache: every spec on the CPU

    def setup_cache(self):
        from kvqbench.suites.harness.corpora import load_corpus, token_windows
        from kvqbench.suites.harness.models import load_model
        from kvqbench.suites.harness.perplexity import ppl_quantize_on_write

        model, tok, _ = load_model(MODEL, device="cpu", dtype=torch.float32)
        text, _ = load_corpus(CORPUS)
        windows = token_windows(tok, text, WINDOW, N_WINDOWS)
        out = {}
        for spec in SPECS:
            try:
                quantizer_or_skip(spec)
            except NotImplementedError:
                continue
            r = ppl_quantize_on_write(model, windows, spec, seed=0)
            out[spec] = {"ppl": r["ppl"], "bits": r["bits_per_element"]}
        return out

    track_ppl = cached_figure("ppl", "PPL")
    track_model_cache_bits = cached_figure("bits", "bits", "Bits per element measured on the model's real "
                                                           "(post-RoPE) K/V.")
