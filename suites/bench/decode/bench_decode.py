"""pytest-benchmark entry of the end-to-end decode benchmark (GPU only; `pytest -m bench`).

Greedy decode steps through each cache at the Llama-3-8B shape (4 layers, RANDOM
weights), context 4096, batch 1: the issue-9 speed targets' configuration. Each
benchmark round is one `measure` call (prefill + warm-up + timed steps); the
per-step time, tokens/s and KV memory go into `extra_info`. `graph`: the steps replay
a CUDA graph of the step (kernels/graphs.py); caches a graph cannot take (the
DynamicCache, KIVI, Med3x) are skipped with the reason. The full grid, with Markdown
and plot: `python -m kvqbench.suites.bench.decode`.
"""
from __future__ import annotations

import pytest
import torch

from kvqbench.suites.bench.decode.__main__ import default_specs

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="decode benchmarks need a CUDA GPU")]

SPECS = default_specs()  # the baselines and every registered format's benchmark specs


@pytest.fixture(scope="module")
def model():
    from kvqbench.suites.bench.decode.measure import build_model

    return build_model("llama3-8b-4l")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("spec", SPECS)
def test_decode_step(benchmark, model, spec, graph):
    from kvqbench.suites.bench.decode.measure import measure

    result = {}

    def run():
        result.update(measure(model, None if spec == "plain" else spec, context=4096, batch=1, steps=16, graph=graph))
        if "skipped" in result:
            pytest.skip(result["skipped"])

    benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info.update({k: v for k, v in result.items() if isinstance(v, (int, float, str))})
    assert result["fallbacks"] == 0 and result["seq_length"] == 4096 + 3 + 16
    assert result.get("graph_mode", "graph") == "graph"  # a graph run that fell back would time the eager path
