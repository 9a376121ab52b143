"""GPU check of head dims that are not powers of two (Triton, FAST path) and Med3x at d 256 on Triton."""
import torch, sys, time
from kvqbench.suites.bench.toolkit import encode_kv
from kvqbench.kernels.decode_attention import decode_attention, reference_decode_attention, explain_backend
from kvqbench.kernels.layout import flatten
import triton.testing as tt
bad = 0
def rel(a, b):
    a, b = a.double(), b.double(); return float((a - b).norm() / b.norm())
DIMS = [int(x) for x in sys.argv[1].split(",") if x]
SPECS = sys.argv[2].split(";")
for d in DIMS:
    for spec in SPECS:
        for B, T in ((1, 1), (2, 333), (1, 4099)):
            g = torch.Generator().manual_seed(d + T)
            k = torch.randn(B, 2, T, d, generator=g); v = torch.randn(B, 2, T, d, generator=g)
            for c in (3, d // 2 + 1, d - 2): k[..., c] *= 25
            try:
                (qk, pk), (qv, pv) = encode_kv(spec, k.half().cuda(), v.half().cuda())
                kf, vf = flatten(pk, "K"), flatten(pv, "V")
                q = torch.randn(B, 8, 1, d, device="cuda").half()
                out = decode_attention(q, kf, vf, backend="triton")
                ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
                e = rel(out, ref)
                ok = e < 3e-3 and torch.isfinite(out).all()
                bad += not ok
                print(("OK  " if ok else "BAD ") + f"d{d} {spec} B{B} T{T} auto={explain_backend(q, kf, vf).backend} rel {e:.2e}", flush=True)
            except Exception as ex:
                print(f"ERR d{d} {spec} B{B} T{T}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
# cost of the padding: Triton at d 96 against d 128 and d 64, B=8 T=32k (tiled from 512 encoded tokens)
from kvqbench.suites.bench.toolkit import kernel_flats
for spec in ["fp16", "fp8-e4m3", "int4:group=16", "kivi:bits=4,group=16", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"]:
    row = []
    for d in (64, 80, 96, 128, 192, 256):
        try:
            kf, vf = kernel_flats(spec, 8, 32768, 8, d, 512, "cuda")
            q = torch.randn(8, 32, 1, d, device="cuda").half()
            f = lambda: decode_attention(q, kf, vf, backend="triton")
            f(); torch.cuda.synchronize()
            row.append(f"d{d} {1000 * tt.do_bench(f, warmup=50, rep=300):.1f}us")
        except Exception as ex:
            row.append(f"d{d} ERR {type(ex).__name__}: {str(ex)[:120]}")
    print("TIME triton", spec, " | ".join(row), flush=True)
print("bad", bad)
import torch.nn.functional as F
row = []
for d in (64, 80, 96, 128, 192, 256):
    q = torch.randn(8, 32, 1, d, device="cuda").half()
    k = torch.randn(8, 8, 32768, d, device="cuda").half(); v = torch.randn_like(k)
    f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    f(); torch.cuda.synchronize()
    row.append(f"d{d} {1000 * tt.do_bench(f, warmup=50, rep=300):.1f}us")
    del k, v
print("TIME sdpa fp16", " | ".join(row), flush=True)
