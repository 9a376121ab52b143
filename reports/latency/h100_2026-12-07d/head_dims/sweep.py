"""Triton launch configs at large / padded head dims (B=8 T=32k, eager do_bench, us)."""
import torch, sys
import triton.testing as tt
from kvqbench.suites.bench.toolkit import kernel_flats
from kvqbench.kernels.decode_attention import decode_attention
for spec, dims in (("hqmq:S=96,r=4", (96, 128, 192, 256)), ("hqmq:S=96,r=4,outliers=med3", (96, 192, 256)),
                   ("int4:group=16", (80, 96, 128, 192, 256)), ("int4", (96, 192, 256)), ("kivi:bits=4,group=16", (96, 192, 256)),
                   ("fp8-e4m3", (192, 256)), ("fp16", (192, 256))):
    for d in dims:
        kf, vf = kernel_flats(spec, 8, 32768, 8, d, 512, "cuda")
        q = torch.randn(8, 32, 1, d, device="cuda").half()
        row = []
        for bt, nw, ns in ((64, 4, 1), (64, 8, 1), (128, 4, 1), (128, 8, 1), (64, 4, 2), (32, 4, 2)):
            if spec.startswith("hqmq") and bt % 64:
                continue
            f = lambda: decode_attention(q, kf, vf, backend="triton", block_t=bt, num_warps=nw, num_stages=ns)
            try:
                f(); torch.cuda.synchronize()
                row.append(f"{bt}/{nw}/{ns} {1000 * tt.do_bench(f, warmup=25, rep=150):.0f}")
            except Exception as ex:
                row.append(f"{bt}/{nw}/{ns} ERR {type(ex).__name__}")
        f = lambda: decode_attention(q, kf, vf, backend="triton")
        row.append(f"default {1000 * tt.do_bench(f, warmup=25, rep=150):.0f}")
        print("SWEEP", spec, f"d{d}", " | ".join(row), flush=True)
        del kf, vf
