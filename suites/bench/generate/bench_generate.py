"""pytest-benchmark entry of the generation benchmark (GPU only; `pytest -m bench`):
one `generate` call of `batch` prompts of 512 tokens, 128 new tokens, per cache, on
the embedded model's shape (random weights, fp16), beside transformers' DynamicCache
`generate` of the same model. The recorded figure is the call's wall time; tokens/s
and the step mode go into `extra_info`. The full table with transformers'
StaticCache + torch.compile path: `python -m kvqbench.suites.bench.generate`."""
from __future__ import annotations

import pytest
import torch

from kvqbench.suites.bench.generate.__main__ import DEFAULT_SPECS, measure_row

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="generation benchmarks need a CUDA GPU")]
PROMPT, NEW = 512, 128


@pytest.fixture(scope="module")
def model():
    from kvqbench.suites.bench.decode.measure import build_model

    m = build_model("smollm2-135m", dtype=torch.float16, device="cuda", max_positions=PROMPT + NEW + 16)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("row", ["hf-dynamic"] + [f"kvqbench:{s}" for s in DEFAULT_SPECS])
def test_generate_throughput(benchmark, model, row, batch):
    measure_row(model, row, batch, PROMPT, NEW, runs=1)  # warm-up: compiles, graph capture
    result = benchmark.pedantic(lambda: measure_row(model, row, batch, PROMPT, NEW, runs=1), rounds=3, iterations=1)
    benchmark.extra_info.update(tokens_per_s=result["tokens_per_s"], mode=result["mode"], why=result["why"],
                                protocol="generate: exact prefill + decode steps, greedy, EOS off",
                                shape="smollm2-135m random weights fp16", gpu=torch.cuda.get_device_name())
