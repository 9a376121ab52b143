"""Branch cuda-gqa16: a GQA group of 16 (Qwen3-235B: 64 q heads over 4 kv heads) on the CUDA
kernels, which run it as 2 CTAs per kv row, against Triton (which took every such call
before) and the same run's fp16 SDPA. Graphed calls, B=8 and B=1, T=32k, d 128; the CUDA
output against Triton's (relative max error); int4, fp8 and HQMQ also as their JOINT_VARIANT
(both halves in one CTA; HQMQ's and Med3x's default for such calls since 2026-12-08, read
against v3's / v10's two CTAs). GPU only; package on PYTHONPATH (gpu_env.sh)."""
import torch
import triton.testing as tt

from kvqbench.kernels.cuda import decode_attention as cd, hqmq_decode as ch
from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.formats.hqmq import configure, engine_table
from kvqbench.suites.bench.toolkit import fp16_sdpa, graph_replay, kernel_flats

HQ, HKV, D, T = 64, 4, 128, 32768
SPECS = ("int4", "fp8", "kivi:bits=2", "kivi:bits=4", "hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3",
         "hqmq:S=96,r=4,pack=mixed")
JOINT = {"int4": cd.JOINT_VARIANT, "fp8": cd.JOINT_VARIANT, "hqmq:S=96,r=4": ch.JOINT_VARIANT,
         "hqmq:S=96,r=4,outliers=med3": ch.JOINT_VARIANT, "hqmq:S=96,r=4,pack=mixed": ch.JOINT_VARIANT}
# the two-CTA launch to read the joint one against: the default (None), or plain HQMQ's v3 since
# the joint variant became their default for these calls (2026-12-08)
TWO_CTA = {"hqmq:S=96,r=4": ch.DEFAULT_VARIANT, "hqmq:S=96,r=4,outliers=med3": ch.DEFAULT_VARIANT_MED3,
           "hqmq:S=96,r=4,pack=mixed": ch.DEFAULT_VARIANT}


def graphed_us(f):
    f(); torch.cuda.synchronize()
    return 1000 * tt.do_bench(graph_replay(f), warmup=25, rep=100)


for B in (8, 1):
    sdpa = graphed_us(fp16_sdpa(B, T, "cuda", hq=HQ, hkv=HKV, d=D)[1])
    print(f"B={B} T={T} Hq {HQ} Hkv {HKV} d {D}: graphed fp16 SDPA {sdpa:.1f} us", flush=True)
    q = torch.randn(B, HQ, 1, D, device="cuda").half()
    for spec in SPECS:
        kf, vf = kernel_flats(spec, B, T, HKV, D, 512, "cuda")
        if spec.startswith("hqmq"):
            kf, vf = configure(kf, engine_table("cuda")), configure(vf, engine_table("cuda"))
        oc = decode_attention(q, kf, vf, backend="cuda").float()
        ot = decode_attention(q, kf, vf, backend="triton").float()
        err = ((oc - ot).abs().max() / ot.abs().max()).item()
        cu = graphed_us(lambda: decode_attention(q, kf, vf, backend="cuda"))
        tr = graphed_us(lambda: decode_attention(q, kf, vf, backend="triton"))
        print(f"  {spec:30s} CUDA {cu:7.1f} us ({sdpa / cu:.2f}x)  Triton {tr:7.1f} us ({sdpa / tr:.2f}x)  "
              f"rel err vs Triton {err:.1e}", flush=True)
        jv = JOINT.get(spec)
        if jv is not None:  # both halves in one CTA (JOINT_VARIANT), against two CTAs per kv row
            oj = decode_attention(q, kf, vf, backend="cuda", variant=jv).float()
            errj = ((oj - ot).abs().max() / ot.abs().max()).item()
            cj = graphed_us(lambda: decode_attention(q, kf, vf, backend="cuda", variant=jv))
            tv = TWO_CTA.get(spec)
            two = cu if tv is None else graphed_us(lambda: decode_attention(q, kf, vf, backend="cuda", variant=tv))
            print(f"  {spec + f' joint (variant {jv})':30s} CUDA {cj:7.1f} us ({sdpa / cj:.2f}x)  "
                  f"{two / cj:.2f}x the two-CTA launch ({two:.1f} us{'' if tv is None else f', variant {tv}'})  "
                  f"rel err vs Triton {errj:.1e}", flush=True)
