"""B=1 T=32k: do the formats that miss issue 28's B=1 rule (>= 1.5x the graphed fp16 SDPA)
reach it with another split count? Graphed calls, Hq 32 Hkv 8, head dims 128 / 64 / 256:
per format the default (whole-wave) split and fixed counts, in us and x the same run's
graphed SDPA. GPU only; package on PYTHONPATH (suites/bench/gpu_env.sh)."""
import torch
import triton.testing as tt

from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.formats.hqmq import configure, engine_table
from kvqbench.suites.bench.toolkit import fp16_sdpa, graph_replay, kernel_flats

SPECS = {"hqmq": "hqmq:S=96,r=4", "med3": "hqmq:S=96,r=4,outliers=med3", "mixed": "hqmq:S=96,r=4,pack=mixed",
         "med3-mixed": "hqmq:S=96,r=4,outliers=med3,pack=mixed", "kivi4": "kivi:bits=4"}
SPLITS = (None, 16, 33, 49, 66, 99, 132, 198, 264)


def graphed_us(f):
    f(); torch.cuda.synchronize()
    return 1000 * tt.do_bench(graph_replay(f), warmup=25, rep=100)


for D in (128, 64, 256):
    sdpa = graphed_us(fp16_sdpa(1, 32768, "cuda", d=D)[1])
    print(f"d {D} B=1 T=32768: graphed SDPA {sdpa:.1f} us", flush=True)
    q = torch.randn(1, 32, 1, D, device="cuda").half()
    for label, spec in SPECS.items():
        kf, vf = kernel_flats(spec, 1, 32768, 8, D, 512, "cuda")
        if spec.startswith("hqmq"):
            kf, vf = configure(kf, engine_table("cuda")), configure(vf, engine_table("cuda"))
        cells = []
        for n in SPLITS:
            try:
                us = graphed_us(lambda: decode_attention(q, kf, vf, backend="cuda", num_splits=n))
                cells.append(f"{'auto' if n is None else n}: {us:.1f} ({sdpa / us:.2f}x)")
            except Exception as e:  # noqa: BLE001 - a split the kernel refuses is reported, not fatal
                cells.append(f"{n}: {type(e).__name__}")
        print(f"  {label:11s} " + " | ".join(cells), flush=True)
