import os, sys, torch
CUDA = torch.cuda.is_available()
if not CUDA: os.environ.setdefault("TRITON_INTERPRET", "1")
from kvqbench.kernels import layout as L
from kvqbench.kernels.decode_attention import decode_attention, reference_decode_attention
from kvqbench.quantizers import get_quantizer
dev = "cuda" if CUDA else "cpu"
worst = 0.0
cases = [(1, 4, 2, 100, 64, 2), (2, 4, 1, 37, 128, 2), (1, 8, 2, 200, 64, 3)] if not CUDA else \
        [(1, 4, 2, 100, 64, 2), (2, 4, 1, 37, 128, 2), (1, 8, 2, 200, 64, 3), (2, 32, 8, 4100, 128, None), (1, 32, 8, 777, 128, None)]
for spec in ["hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3", "hqmq:S=24,r=3,outliers=med3", "hqmq:S=256,r=5,radius=log"]:
    for (B, Hq, Hkv, T, D, sp) in cases:
        g = torch.Generator().manual_seed(T)
        k = torch.randn(B, Hkv, T, D, generator=g); k[..., 3] *= 25; k[..., D - 2] *= 25
        v = torch.randn(B, Hkv, T, D, generator=g)
        q = torch.randn(B, Hq, 1, D, generator=g).half().to(dev)
        k, v = k.half().to(dev), v.half().to(dev)
        qk, qv = get_quantizer(spec, role="K", seed=3), get_quantizer(spec, role="V", seed=3)
        pk, pv = qk.encode(k), qv.encode(v)
        ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
        for mode in ("codebook", "secondaries"):
            for bt, nw in ((64, 4), (128, 8)):
                kf = L.flatten(pk, "K", table_mode=mode, table_dtype=torch.float16)
                vf = L.flatten(pv, "V", table_mode=mode, table_dtype=torch.float16)
                out = decode_attention(q, kf, vf, out_dtype=torch.float32, num_splits=sp, smem_table=True,
                                       block_t=bt, num_warps=nw)
                err = float((out.double() - ref.double()).norm() / ref.double().norm())
                worst = max(worst, err)
                if err > 3e-3: print("BAD", spec, B, Hq, Hkv, T, D, mode, bt, err)
print("smem_table worst rel err", worst, "OK" if worst < 3e-3 else "FAIL")
