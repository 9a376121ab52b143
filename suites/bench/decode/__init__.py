"""End-to-end decode benchmark (issue 9): tokens/s and GPU memory of greedy decoding
through a quantized KV cache (fused kernels inside the model) against the plain
DynamicCache, at several contexts and batch sizes.

    python -m kvqbench.suites.bench.decode --shape llama3-8b-4l --out reports/decode   # -> decode.{json,md,png}
    python -m kvqbench.suites.bench.decode --shape smollm2-135m --out reports/decode   # -> decode_smollm2-135m.*
    python -m kvqbench.suites.bench.decode --render reports/decode/decode.json   # Markdown + plot only
    pytest -m bench suites/bench/decode/bench_decode.py                          # pytest-benchmark (GPU)

`measure.py` runs one configuration, `render.py` writes the Markdown and the plot,
`__main__.py` is the command line. Models have real shapes and RANDOM weights.
"""
