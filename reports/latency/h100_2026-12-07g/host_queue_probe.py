"""Why the latency suite's host column reads Med3x with pack=mixed at 31-35 us per eager call
where Med3x on 12-bit rows reads ~20 (reports/latency/h100_2026-12-07f/d128, h100_2026-12-07g/d256).
Per spec at B=1 T=32k: the eager call's host us (toolkit.host_us, least of 15 means of n calls
issued back to back) for n = 10 / 30 / 100 / 300, the kernel's own time (do_bench, us), and the
call's host us when each call is followed by a synchronize (host + GPU + sync: the serial cost).
If the issue time grows with n only for the specs whose kernel is slowest, the host is waiting
on a full launch queue, not running Python. GPU only; package on PYTHONPATH (gpu_env.sh)."""
import sys

import filelock  # noqa: F401  (the process state of a real decode: toolkit.audit_state)
import torch
import triton.testing as tt

from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.formats.hqmq import configure, engine_table
from kvqbench.suites.bench.toolkit import host_us, kernel_flats

D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
B, T, H = 1, 32768, 8
q = torch.randn(B, 32, 1, D, device="cuda").half()
print(f"B={B} T={T} Hq 32 Hkv 8 d {D}; {torch.cuda.get_device_name()}")
print(f"{'spec':42s} {'kernel us':>9s} " + " ".join(f"{'n=' + str(n):>7s}" for n in (10, 30, 100, 300)))
for spec in ("int4", "hqmq:S=96,r=4", "hqmq:S=96,r=4,pack=mixed", "hqmq:S=96,r=4,outliers=med3",
             "hqmq:S=96,r=4,outliers=med3,pack=mixed"):
    kf, vf = kernel_flats(spec, B, T, H, D, 512, "cuda")
    if spec.startswith("hqmq"):
        kf, vf = configure(kf, engine_table("cuda")), configure(vf, engine_table("cuda"))
    fn = lambda: decode_attention(q, kf, vf)  # noqa: E731
    fn(); torch.cuda.synchronize()
    kern = 1000 * tt.do_bench(fn, warmup=25, rep=100)
    hosts = [host_us(fn, n=n, warmup=20, rounds=15) for n in (10, 30, 100, 300)]
    print(f"{spec:42s} {kern:9.1f} " + " ".join(f"{h:7.1f}" for h in hosts), flush=True)
