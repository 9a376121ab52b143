"""The Triton kernels' default launch at padded / wide head dims against same-run fp16 SDPA
(B=8 T=32k Hq 32 Hkv 8, eager do_bench, us; after the wide_or_padded defaults)."""
import torch
import torch.nn.functional as F
import triton.testing as tt
from kvqbench.suites.bench.toolkit import kernel_flats
from kvqbench.kernels.decode_attention import decode_attention
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
    row = []
    for d in dims:
        kf, vf = kernel_flats(spec, 8, 32768, 8, d, 512, "cuda")
        q = torch.randn(8, 32, 1, d, device="cuda").half()
        f = lambda: decode_attention(q, kf, vf, backend="triton")
        f(); torch.cuda.synchronize()
        t = 1000 * tt.do_bench(f, warmup=25, rep=200)
        row.append(f"d{d} {t:.1f} ({sd[d] / t:.2f}x)")
        del kf, vf
    print("TRITON", spec, " | ".join(row), flush=True)
