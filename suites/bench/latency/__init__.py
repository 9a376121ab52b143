"""Decode-step latency of attention over quantized KV caches, one run, same shapes.

Methods, for Llama-3-8B attention shapes (Hq 32, Hkv 8, d 128), T in {4k, 16k,
32k, 128k}, B in {1, 8, 32}: `fp16-sdpa` (fp16 K/V, torch SDPA, flash backend,
native GQA), `fake-quant` (the whole packed HQMQ cache decoded to fp16 by the
quantizer's torch decode, then SDPA: what the public benchmark compared
against), and per packed format (`hqmq`, `hqmq-med3`, `int4`, `kivi4`, `kivi2`,
`fp8`: the fp8-e4m3 plugin) three rows over the same packed bytes:
`fused-<x>`, what ships (`decode_attention(q, k, v)`, backend="auto": the CUDA C++
kernel where the dispatcher routes the format, with its default config, else
Triton; the row records the backend and why not CUDA), `fused-<x>-triton` (the
Triton kernel, launch config tuned at the focus shape) and, where auto leaves a
CUDA kernel unused (Med3x), `fused-<x>-cuda` by opt-in. At B=1 every call is also
timed as a CUDA-graph replay (`-graph`), the eager call there tracking host time.
Every figure carries the bytes the method must read, the achieved GB/s, its
fraction of the device-to-device copy bandwidth and its speed-up over fp16 SDPA,
both measured in the same run; issue 10's targets are read off the shipped rows;
a roofline plot (bytes read against us, the copy-bandwidth line) beside the
latency plot. Also HQMQ encode throughput beside an arithmetic floor, and the
stored bytes per token per layer of each quantizer with a PROJECTION to
Llama-3-70B at 128k.

    config.py             LatencyConfig (shapes, limits, sections) and the method specs
    caches.py             synthetic K/V, their encodings in the kernel layout, tiling
    methods.py            the timed calls: fp16 SDPA, fused kernels (shipped / Triton / CUDA), fake-quant, graphs
    tuning.py             the launch-config tuner (greedy, at the focus shape)
    decode_step.py        the latency section (every method at every (B, T)); eager fused rows at B=1: host_us
    host_time.py          an eager call's host time; on a CPU with the launch stubbed: issue 28's table
    kernel_times.py       a CUDA call's GPU time split: split kernel, gap, combine (a profiler trace; GPU)
    host_drift.py         which step of an eager call's host time grows after other work in the process
    ab.py                 latency runs side by side (a change against its base, gpu_ab.sh)
    encode_throughput.py  the HQMQ encode section
    memory.py             the memory section
    targets.py            issue 10's targets read off the rows; speed-ups over fp16 SDPA
    head_dims.py          issue 28's rules across head dims, from the newest run at each (no GPU)
    render.py             latency.md, latency.png, latency_roofline.png from the result dict
    run.py                one run: sections in order, latency.json saved after each
    __main__.py           the command line
    ../toolkit.py         (shared by every rig) environment record, the timer, copy bandwidth, launch errors

    python -m kvqbench.suites.bench.latency --out reports/latency   # GPU: everything
    python -m kvqbench.suites.bench.latency --smoke --out /tmp/x    # CPU: plumbing only
    pytest -m bench suites/bench/bench_latency.py                   # pytest-benchmark (GPU)

Nothing is imported here: the command line sets TRITON_INTERPRET (CPU) before
kvqbench.kernels is first imported.
"""
