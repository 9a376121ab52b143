"""One-off (not committed): HQMQ then Med3x, B=8 T=32k, twice each (for ncu: launches 3-4 are the
warm HQMQ / Med3x split kernels when -c counts hqmq_split_kernel launches)."""
import sys
import torch
from kvqbench.suites.bench.latency import host_time as ht
from kvqbench.kernels.decode_attention import decode_attention
d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
pairs = [ht.flats(s, 8, 32768, 8, d, device="cuda") for s in ("hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3")]
q = torch.randn(8, 32, 1, d, device="cuda").half()
for kf, vf in pairs:
    decode_attention(q, kf, vf)
torch.cuda.synchronize()
for kf, vf in pairs:
    decode_attention(q, kf, vf)
torch.cuda.synchronize()
for (kf, vf), name in zip(pairs, ("hqmq", "med3")):
    fl = getattr(kf, "flags", None)
    if fl is not None:
        import numpy as np
        bits = torch.tensor([bin(x).count("1") for x in fl.flatten()[:200000].tolist()], dtype=torch.float32)
        print(name, "K outlier chunks per token", bits.mean().item(), "of", d // 4, flush=True)
    print(name, "bytes K", sum(t.numel() * t.element_size() for t in (kf.codes, kf.radius, kf.r_max) if t is not None), flush=True)
