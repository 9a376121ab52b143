"""The Triton kernels at padded / wide head dims against same-run fp16 SDPA (B=8 T=32k Hq 32
Hkv 8, eager do_bench, us): every format's default launch; HQMQ / Med3x with the engine's
codeword table (fp16 codebook, as the store gives them on a GPU) over block_t x warps."""
import torch
import torch.nn.functional as F
import triton.testing as tt
from kvqbench.suites.bench.toolkit import kernel_flats
from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.formats.hqmq import configure, engine_table
dims = (64, 80, 96, 128, 192, 256)
sd = {}
for d in dims:
    q = torch.randn(8, 32, 1, d, device="cuda").half()
    k = torch.randn(8, 8, 32768, d, device="cuda").half(); v = torch.randn_like(k)
    f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    f(); torch.cuda.synchronize()
    sd[d] = 1000 * tt.do_bench(f, warmup=50, rep=300)
    del k, v
print("SDPA", " | ".join(f"d{d} {sd[d]:.1f}" for d in dims), flush=True)
for spec in ("fp16", "fp8-e4m3", "int4:group=16", "kivi:bits=4,group=16", "kivi:bits=2,group=16,residual=16",
             "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"):
    hq = spec.startswith("hqmq")
    for d in dims:
        kf, vf = kernel_flats(spec, 8, 32768, 8, d, 512, "cuda")
        if hq:
            kf, vf = configure(kf, engine_table("cuda")), configure(vf, engine_table("cuda"))
        q = torch.randn(8, 32, 1, d, device="cuda").half()
        cfgs = [dict()] + ([dict(block_t=64, num_warps=4), dict(block_t=64, num_warps=8), dict(block_t=128, num_warps=4),
                            dict(block_t=128, num_warps=8)] if hq else [])
        row = []
        for c in cfgs:
            f = lambda: decode_attention(q, kf, vf, backend="triton", **c)
            f(); torch.cuda.synchronize()
            t = 1000 * tt.do_bench(f, warmup=25, rep=150)
            row.append(f"{c.get('block_t', 'default')}/{c.get('num_warps', '')} {t:.1f} ({sd[d] / t:.2f}x)")
        print("TRITON", spec, f"d{d}", " | ".join(row), flush=True)
        del kf, vf
