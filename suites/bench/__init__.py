"""Benchmarks, one concern each, on one toolkit:

- `toolkit.py`: the helpers every rig below uses, one copy each: synthetic K/V, the
  KIVI-aware tiler, the timer, CUDA-graph capture, the copy-bandwidth yardstick, the
  environment record;
- `latency/`: decode-step attention latency of the fused kernels against fp16 SDPA
  and fake-quant (config, measurement, rendering; `python -m kvqbench.suites.bench.latency`);
- `bench_latency.py`: its pytest-benchmark entry points (GPU);
- `decode/`: end-to-end greedy decoding through the quantized cache (tokens/s, memory;
  `python -m kvqbench.suites.bench.decode`);
- `bench_quantizers.py`: CPU encode/decode time of every registered quantizer
  (pytest-benchmark);
- `asv_benchmarks/`: the asv suite that tracks figures across commits.
- `scaling/`: `kvqbench compare` throughput at 1..N torchrun ranks on one grid, with
  the figures checked equal across rank counts (`python -m kvqbench.suites.bench.scaling`);
- `kernel_sweep/`: one GPU call that checks every fused kernel and times launch-config
  variants beside fp16 SDPA (`python -m kvqbench.suites.bench.kernel_sweep run|render`);
- `cuda/`: same-run timings of the CUDA C++ kernels' variants (`python -m
  kvqbench.suites.bench.cuda.bench`, `.hqmq_bench`) and the GPU calls that build, test
  and time them (`bash suites/bench/cuda/gpu_run.sh`, `hqmq_gpu_run.sh`);
- `gpu_env.sh`: the environment of one GPU call, sourced by every GPU script here
  (cuda/*.sh, decode/gpu_decode.sh, gpu_compare.sh); `gpu_pack_out.sh`, a call's last
  step: $OUT packed into the 8 files, 2 folders deep, that a call returns (run it once).
"""
