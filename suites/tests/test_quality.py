"""Quality regression tests on a real model (`pytest -m quality`): perplexity
with the KV cache quantized, on whatever device is present (GPU if any, else
CPU, sized to stay within CI time), against the fp16 baseline measured in the
same run. Protocol: quantize-on-write over fixed windows of the default corpus.

Thresholds are relative to fp16. int8 is near-lossless (1%). int2 per token
must visibly break the model, or the cache hook is not in the path at all.
HQMQ at about 5 bits: the paper's "near-lossless" would mean within ~0.5% of
fp16. On SmolLM2-135M we measure +5.4% (CPU, 2 x 256 tokens) and +10.2% (H200,
16 x 1024 tokens) at 4.9 measured bits, so the claim does not hold here (the
reports say so). The test guards what is measured: no worse than naive int4
per token at 5.0 bits by more than 5% (1.4% and 3.5% today), and within 15%
of fp16.
"""
import os

import pytest
import torch

pytestmark = pytest.mark.quality

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU: 2 windows x 256 tokens keeps the whole file within a few CI minutes.
N_WINDOWS, WINDOW = (16, 1024) if DEVICE == "cuda" else (2, 256)
MODEL = os.environ.get("KVQBENCH_QUALITY_MODEL", "smollm2-135m")


@pytest.fixture(scope="module")
def setup():
    from kvqbench.suites.harness.corpora import load_corpus, token_windows
    from kvqbench.suites.harness.models import load_model

    model, tok, info = load_model(MODEL, device=DEVICE)
    text, _ = load_corpus("canterbury")
    return model, token_windows(tok, text, WINDOW, N_WINDOWS), info


@pytest.fixture(scope="module")
def ppl(setup):
    from kvqbench.suites.harness.perplexity import ppl_quantize_on_write

    model, windows, _ = setup
    memo = {}

    def measure(spec):
        if spec not in memo:
            memo[spec] = ppl_quantize_on_write(model, windows, spec, seed=0)
        return memo[spec]

    return measure


def rel(ppl, spec):
    return ppl(spec)["ppl"] / ppl("fp16")["ppl"] - 1


def test_fp16_cache_matches_the_plain_cache(ppl):
    # fp32 model: fp16 storage rounds K/V, which may move PPL a hair, no more.
    assert abs(ppl("fp16")["ppl"] / ppl(None)["ppl"] - 1) < 1e-3


def test_int8_within_1_percent(ppl):
    assert rel(ppl, "int8") < 0.01, ppl("int8")


def test_hqmq_about_5_bits_does_not_regress(ppl):
    # Measured bits include the fp16 codebooks amortised over the short window.
    r = ppl("hqmq:S=96,r=5")
    assert 4.5 < r["bits_per_element"] < 5.5, r["bits_per_element"]
    assert r["ppl"] < 1.05 * ppl("int4")["ppl"], (r["ppl"], ppl("int4")["ppl"])
    assert rel(ppl, "hqmq:S=96,r=5") < 0.15, (r["ppl"], ppl("fp16")["ppl"])


def test_med3x_does_not_hurt(ppl):
    assert ppl("hqmq:S=96,r=4,outliers=med3")["ppl"] <= ppl("hqmq:S=96,r=4")["ppl"] * 1.01


def test_cache_hook_takes_effect(ppl):
    """If quantization silently stopped reaching attention, int2 would score like fp16."""
    assert rel(ppl, "int2") > 0.5, (ppl("int2")["ppl"], ppl("fp16")["ppl"])
    assert ppl("int2")["bits_per_element"] == 3.0


def test_order_of_bit_widths(ppl):
    assert ppl("int8")["ppl"] < ppl("int4")["ppl"] < ppl("int2")["ppl"]
