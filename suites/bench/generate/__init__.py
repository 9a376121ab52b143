"""Generation throughput (issue 29): tokens/s of `generate` through each cache, from the
user's side, against transformers' own generation of the same model in the same run.

    python -m kvqbench.suites.bench.generate --out reports/generate          # GPU: the embedded model's shape
    python -m kvqbench.suites.bench.generate --smoke --out /tmp/gen           # CPU: the plumbing, tiny shapes

Rows (each timed `--runs` times; the last run is the figure, earlier ones pay compiles
and graph captures and are kept beside it):
- `hf-dynamic`: `model.generate` with transformers' DynamicCache (its default);
- `hf-static-compile`: `model.generate(cache_implementation="static")`, which transformers
  compiles with torch.compile (its documented fast path);
- `kvqbench:<spec>`: `kvqbench.suites.harness.generate.generate` (exact prefill, then
  graphed decode steps where the cache can take them); `kvqbench:plain` is that engine
  over a StaticCache (no quantizer), `kvqbench:fp16` over kvqbench's fp16 store;
- `kvqbench+compile:<spec>` (`--compile`): the same with the model's norms and MLPs
  compiled by torch.compile around our attention and cache (`generate(compile=True)`).
Prompts are random token ids, weights random (real shapes: speed does not depend on the
weights), EOS off, so every row generates exactly `--new` tokens per prompt.
"""
