"""airspeed velocity (asv) benchmarks: `benchmark_dir` of /asv.conf.json.

asv imports these files from the working tree and runs them against kvqbench as
INSTALLED in its own virtualenv at each benchmarked commit, so they import only
`kvqbench.*` (never the source folders, but for common.py's two readings of the
checkout: the quantizer list and the benchmark toolkit, ../toolkit.py) and skip
cleanly (NotImplementedError in set-up) what an older commit lacks. Not part of the
kvqbench package.

    quantizer_figures.py  track_ measured bits and round-trip error, time_ encode and
                          decode, peakmem_ of a packed cache: every registered
                          quantizer's example configs
    model_ppl.py          track_ perplexity of the default embedded model on a short
                          fixed window (model loaded once, in setup_cache)
    fused_decode.py       time_ of the fused decode attention kernel at one shape (GPU
                          only) beside fp16 SDPA
    decode_step.py        track_ ms per greedy decode step and KV / peak memory of a
                          Llama-3-8B-shaped model through each cache, eager and graphed
                          (GPU only)
"""
