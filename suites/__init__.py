"""What is measured and how, one room each:

- `harness/`: fetch + cache, models, corpora, the quantized transformers cache,
  perplexity protocols;
- `compare/`: the main job (`kvqbench compare`), its report and the command line;
- `lm_eval/`: the lm-eval model and offline tasks;
- `bench/`: latency and quantizer benchmarks, asv;
- `tests/`: the pytest suites (conformance, properties, quality, kernels, ...);
- `conformance.py`: the contract every quantizer meets, as plain check functions
  (used by the tests, the benchmarks and `kvqbench list`).
"""
