"""Generation throughput (issue 29): tokens/s of `generate` through each cache, from the
user's side, against transformers' own generation of the same model in the same run.

    python -m kvqbench.suites.bench.generate --out reports/generate          # GPU: the embedded model's shape
    python -m kvqbench.suites.bench.generate --smoke --out /tmp/gen           # CPU: the plumbing, tiny shapes
    python -m kvqbench.suites.bench.generate --smoke --ragged 3 --out /tmp/gen   # + a ragged batch of 3 prompts

Rows (each timed `--runs` times, 3 by default; the figure is the fastest run after the
first, which pays compiles and graph captures; every run's seconds are kept beside it):
- `hf-dynamic`: `model.generate` with transformers' DynamicCache (its default);
- `hf-static-compile`: `model.generate(cache_implementation="static")`, which transformers
  compiles with torch.compile (its documented fast path);
- `kvqbench:<spec>`: `kvqbench.suites.harness.generate.generate` (exact prefill, then
  graphed decode steps where the cache can take them); `kvqbench:plain` is that engine
  over a StaticCache (no quantizer), `kvqbench:fp16` over kvqbench's fp16 store;
- `kvqbench+compile:<spec>` (`--compile`): the same with the model's norms and MLPs
  compiled by torch.compile around our attention and cache (`generate(compile=True)`).
`--ragged N` (off by default) adds a table "ragged batch of N prompts, lengths a..b": N
prompts of lengths prompt, prompt-s, ..., s ~ prompt/(4N), per row above timed as ONE
left-padded call (`generate` pads them itself; hf-* get the padded ids with an
attention_mask, pad id 0) and as N separate batch-1 calls (`(N separate calls)`: their seconds
summed, what a user without padding support runs); "x separate calls" is the padded call's
tokens/s over the separate calls'. `kvqbench:plain` (transformers' StaticCache) cannot pad:
it runs groups of equal length, and its `why` says so.
Prompts are random token ids, weights random (real shapes: speed does not depend on the
weights), EOS off, so every row generates exactly `--new` tokens per prompt.
"""
