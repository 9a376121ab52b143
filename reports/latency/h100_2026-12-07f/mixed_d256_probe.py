"""HQMQ's mixed-radix rows (pack=mixed) at head dim 256 on the CUDA kernel against Triton
and against the same codes as 12-bit rows (B=8 T=32k Hq 32 Hkv 8 d 256, graphed calls, us),
beside the same run's graphed fp16 SDPA. Run on a GPU from the repository root with the
package on PYTHONPATH (suites/bench/gpu_env.sh)."""
import torch
import triton.testing as tt

from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.formats.hqmq import configure, engine_table
from kvqbench.suites.bench.toolkit import fp16_sdpa, graph_replay, kernel_flats

B, T, H, D = 8, 32768, 8, 256


def graphed_us(f):
    f(); torch.cuda.synchronize()
    return 1000 * tt.do_bench(graph_replay(f), warmup=25, rep=200)


sdpa = graphed_us(fp16_sdpa(B, T, "cuda", d=D)[1])
print(f"fp16 SDPA (graphed): {sdpa:.1f} us", flush=True)
q = torch.randn(B, 32, 1, D, device="cuda").half()
for spec in ("hqmq:S=96,r=4", "hqmq:S=96,r=4,pack=mixed", "hqmq:S=96,r=4,outliers=med3",
             "hqmq:S=96,r=4,outliers=med3,pack=mixed"):
    kf, vf = kernel_flats(spec, B, T, H, D, 512, "cuda")
    kf, vf = configure(kf, engine_table("cuda")), configure(vf, engine_table("cuda"))
    row = []
    for backend in ("cuda", "triton"):
        us = graphed_us(lambda: decode_attention(q, kf, vf, backend=backend))
        row.append(f"{backend} {us:.1f} us ({sdpa / us:.2f}x)")
    ref = decode_attention(q, kf, vf, backend="triton", out_dtype=torch.float32)
    got = decode_attention(q, kf, vf, backend="cuda", out_dtype=torch.float32)
    err = float((got - ref).norm() / ref.norm())
    print(f"{spec}: " + " | ".join(row) + f" (CUDA vs Triton rel {err:.1e})", flush=True)
