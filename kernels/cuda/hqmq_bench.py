"""Same-run timings of the CUDA HQMQ decode kernel (kernels/cuda_hqmq.py) beside fp16
SDPA and the Triton HQMQ kernels (HQMQ, HQMQ + Med3x), at B=8 and B=1, T=32k.

    python kernels/cuda/hqmq_bench.py [--out DIR] [--shapes 8x32768,1x32768]

Protocol as kernels/cuda/bench.py (its `bench`: do_bench median, L2 flushed, rep 40 ms):
Hq 32 / Hkv 8 / d 128, fp16 q; caches = real encodings of 4096 synthetic tokens (3
outlier key channels) tiled to T; B=1 also as CUDA graph replays.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench import bench, rel_err  # noqa: E402

from kvqbench.kernels import cuda_hqmq  # noqa: E402
from kvqbench.kernels.decode_attention import decode_attention  # noqa: E402
from kvqbench.kernels.layout import flatten  # noqa: E402
from kvqbench.quantizers import get_quantizer  # noqa: E402
from kvqbench.suites.bench.kernel_sweep.measure import graph_decode, synthetic_kv  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/hqmq_bench")
    ap.add_argument("--shapes", default="8x32768,1x32768")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    t0 = time.time()
    dev = torch.device("cuda")
    k, v = synthetic_kv(1, 8, 4096, 128, device=dev)
    base = {}
    for name, spec in (("hqmq", "hqmq:S=96,r=4"), ("hqmq-med3", "hqmq:S=96,r=4,outliers=med3")):
        pk = get_quantizer(spec, role="K", seed=3).encode(k)
        pv = get_quantizer(spec, role="V", seed=3).encode(v)
        base[name] = (flatten(pk, "K"), flatten(pv, "V"))
    rows = []
    regs = {vv: cuda_hqmq.num_regs(vv, 96) for vv in range(cuda_hqmq.NUM_VARIANTS)}
    print("registers per variant:", regs, flush=True)

    def add(B, T, method, us, sd, **extra):
        r = {"B": B, "T": T, "method": method, "us": us, "x_sdpa": sd / us, **extra}
        rows.append(r)
        print(f"| {B} | {T} | {method} | {extra.get('cfg', '')} | {us:.1f} | {sd / us:.2f} | "
              f"{extra.get('err', '')} |", flush=True)

    print("| B | T | method | config | us | x SDPA | err vs triton |\n|---|---|---|---|---:|---:|---|")
    for B, T in shapes:
        q = torch.randn(B, 32, 1, 128, device=dev).half()
        kf16 = torch.randn(B, 8, T, 128, device=dev).half()
        vf16 = torch.randn(B, 8, T, 128, device=dev).half()
        sdpa = lambda: F.scaled_dot_product_attention(q, kf16, vf16, enable_gqa=True)  # noqa: E731
        sd = bench(sdpa)
        add(B, T, "fp16-sdpa", sd, sd)
        sdg = None
        if B == 1:
            sdg = bench(graph_decode(lambda x: sdpa(), q))
            add(B, T, "fp16-sdpa-graph", sdg, sdg)
        del kf16, vf16
        kf, vf = (f.tile(B // f.B, T // f.T) for f in base["hqmq"])
        ref = decode_attention(q, kf, vf, backend="triton", out_dtype=torch.float32)
        got = decode_attention(q, kf, vf, backend="cuda", out_dtype=torch.float32)
        err = f"{rel_err(got, ref):.1e}"
        add(B, T, "hqmq-triton", bench(lambda: decode_attention(q, kf, vf, backend="triton")), sd)
        best = None
        cps = (2, 4) if B > 1 else (1,)
        for vv in range(cuda_hqmq.NUM_VARIANTS):
            for cpsm in (None,) + cps:
                cfg = dict(variant=vv, ctas_per_sm=cpsm)
                try:
                    t = bench(lambda: decode_attention(q, kf, vf, backend="cuda", **cfg))
                except RuntimeError as e:
                    print("FAILED", cfg, str(e)[:200], flush=True)
                    continue
                add(B, T, "hqmq-cuda", t, sd, cfg=cfg, err=err)
                if best is None or t < best[0]:
                    best = (t, cfg)
        print(f"BEST B={B} T={T}: {best[0]:.1f} us {best[1]} = {sd / best[0]:.2f}x SDPA", flush=True)
        if B == 1:
            for tag, kw in (("cuda", dict(backend="cuda", **best[1])), ("triton", dict(backend="triton"))):
                fn = graph_decode(lambda x, kw=kw: decode_attention(x, kf, vf, **kw), q)
                add(B, T, f"hqmq-{tag}-graph", bench(fn), sdg, cfg=kw)
        del kf, vf
        kf3, vf3 = (f.tile(B // f.B, T // f.T) for f in base["hqmq-med3"])
        add(B, T, "hqmq-med3-triton", bench(lambda: decode_attention(q, kf3, vf3, backend="triton")), sd)
        del kf3, vf3
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hqmq_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "regs": regs,
                                                      "rows": rows}, indent=1, default=str))
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
