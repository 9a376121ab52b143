"""Same-run timings of the CUDA C++ decode kernels (kvqbench.kernels.cuda: decode_attention,
hqmq_decode) beside fp16 SDPA and the Triton kernels, and the shell scripts of one GPU
call that build, test and time them (gpu_run.sh, hqmq_gpu_run.sh; the environment in
../gpu_env.sh).

    python -m kvqbench.suites.bench.cuda.bench [--out DIR] [--shapes 8x32768,1x32768] ...
    python -m kvqbench.suites.bench.cuda.hqmq_bench [--out DIR] [--quick] ...
    bash suites/bench/cuda/gpu_run.sh        # GPU: CUDA kernel tests + bench.py
    bash suites/bench/cuda/hqmq_gpu_run.sh   # GPU: the same for HQMQ + hqmq_bench.py
"""
