"""A left-padded batch's decode call (row_start) on CUDA against Triton and against the same
call without row_start (B=8 T=32k Hq 32 Hkv 8 d 128, eager do_bench and graphed, us): rows
start at 0, 1k, ..., 7k (pads below). Run on a GPU from the repository root with the package
on PYTHONPATH (suites/bench/gpu_env.sh)."""
import torch
import triton.testing as tt

from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.formats.hqmq import configure, engine_table
from kvqbench.suites.bench.toolkit import graph_replay, kernel_flats

B, T, H, D = 8, 32768, 8, 128
rs = torch.arange(B, dtype=torch.int32, device="cuda") * 1024
for spec in ("int4", "fp8-e4m3", "kivi:bits=2", "kivi:bits=4", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"):
    kf, vf = kernel_flats(spec, B, T, H, D, 512, "cuda")
    if spec.startswith("hqmq"):
        kf, vf = configure(kf, engine_table("cuda")), configure(vf, engine_table("cuda"))
    q = torch.randn(B, 32, 1, D, device="cuda").half()
    row = []
    for name, kw in (("cuda", dict(backend="cuda")), ("cuda+rs", dict(backend="cuda", row_start=rs)),
                     ("triton+rs", dict(backend="triton", row_start=rs))):
        f = lambda: decode_attention(q, kf, vf, **kw)
        f(); torch.cuda.synchronize()
        eager = 1000 * tt.do_bench(f, warmup=25, rep=200)
        g = graph_replay(f)
        graphed = 1000 * tt.do_bench(g, warmup=25, rep=200)
        row.append(f"{name} {eager:.1f} / {graphed:.1f}")
    ref = decode_attention(q, kf, vf, backend="triton", row_start=rs, out_dtype=torch.float32)
    got = decode_attention(q, kf, vf, backend="cuda", row_start=rs, out_dtype=torch.float32)
    err = float((got - ref).norm() / ref.norm())
    print(f"{spec}: " + " | ".join(row) + f" (eager / graphed us; CUDA vs Triton rel {err:.1e})", flush=True)
