"""Same-run timings of the CUDA HQMQ decode kernel (kernels/cuda/hqmq_decode.py) beside fp16
SDPA and the Triton HQMQ kernels (HQMQ, HQMQ + Med3x), at B=8 and B=1, T=32k.

    python -m kvqbench.suites.bench.cuda.hqmq_bench [--out DIR] [--shapes 8x32768,1x32768] [--quick] [--variants 0,3]
                                                    [--med3-variants 0,2,9,10] [--head-dim 64] [--codebook int8]

Protocol as bench.py beside it (its `bench`: the toolkit's do_bench median, L2 flushed, rep 40 ms):
Hq 32 / Hkv 8 / d 128 (--head-dim: 64 or 256, the variants with an instance there), fp16 q;
caches = real encodings of 4096 synthetic tokens (3 outlier key channels) tiled to T. Every
variant with the default (whole-wave) split rule and a few fixed split counts; B=1 also as
CUDA graph replays (every config), the graph with a device-side valid_len (the decode-loop
form), and the host time of an eager call.
--quick: the default variant's configs only. HQMQ + Med3x: the CUDA variants with an
outlier path (cuda_hqmq.MED3_VARIANTS, or --med3-variants) beside the Triton kernel, and a
MED3 line per shape: each one's best config against the best plain HQMQ row of the same
shape (the 1.25x target). The prefetching variants (cuda_hqmq.PREFETCH_VARIANTS) run v2's /
v3's kernel without outliers, so the plain sweep leaves them out unless --variants names them.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ....kernels.cuda import hqmq_decode as cuda_hqmq
from ....kernels.decode_attention import decode_attention
from ....kernels.layout import flatten
from ..toolkit import (copy_bandwidth, encode_kv, env_info, fp16_sdpa, graph_replay, host_us, rel_err, synthetic_kv,
                       tile_to)
from .bench import bench

SPLITS = {8: (None, 12), 1: (None, 33)}  # num_splits (None: the default rule); call 17a also had 9, 33 / 98


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/hqmq_bench")
    ap.add_argument("--shapes", default="8x32768,1x32768")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated HQMQ variants (default: all but the "
                    "prefetching ones, whose plain kernel is v2's / v3's)")
    ap.add_argument("--med3-variants", default="", help="comma-separated Med3x variants (default: "
                    "cuda_hqmq.MED3_VARIANTS)")
    ap.add_argument("--head-dim", type=int, default=128, choices=cuda_hqmq.HEAD_DIMS,
                    help="head dim (d 64: HQMQ reaches 0.85x of its d 128 ratio, Med3x 0.74x, 2026-12-05)")
    ap.add_argument("--codebook", default="exact", choices=("exact", "int8"),
                    help="HQMQ's codebook= (int8: the 4-byte-codeword instances, v3 / Med3x v10)")
    a = ap.parse_args()
    D = a.head_dim
    cw = 4 if a.codebook == "int8" else 8
    extra = ",codebook=int8" if cw == 4 else ""
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    t0 = time.time()
    dev = torch.device("cuda")
    k, v = synthetic_kv(1, 8, 4096, D, dev)
    base = {}
    for name, spec in (("hqmq", "hqmq:S=96,r=4" + extra), ("hqmq-med3", "hqmq:S=96,r=4,outliers=med3" + extra)):
        (_, pk), (_, pv) = encode_kv(spec, k, v)
        base[name] = (flatten(pk, "K"), flatten(pv, "V"))
    rows = []
    variants = [cuda_hqmq.DEFAULT_VARIANT] if a.quick else \
        [vv for vv in range(cuda_hqmq.NUM_VARIANTS) if vv not in cuda_hqmq.PREFETCH_VARIANTS]
    if a.variants:
        variants = [int(x) for x in a.variants.split(",")]
    med3_variants = [int(x) for x in a.med3_variants.split(",")] if a.med3_variants else list(cuda_hqmq.MED3_VARIANTS)
    variants = [vv for vv in variants if vv in cuda_hqmq.variants(D, False, cw)]  # (those with an instance)
    med3_variants = [vv for vv in med3_variants if vv in cuda_hqmq.variants(D, True, cw)]
    regs = {vv: cuda_hqmq.num_regs(vv, 96, head_dim=D, cw=cw) for vv in variants}
    occ = {vv: cuda_hqmq.occupancy(vv, 96, head_dim=D, cw=cw) for vv in variants}
    regs.update({f"med3/{vv}": cuda_hqmq.num_regs(vv, 96, True, head_dim=D, cw=cw) for vv in med3_variants})
    occ.update({f"med3/{vv}": cuda_hqmq.occupancy(vv, 96, True, head_dim=D, cw=cw) for vv in med3_variants})
    env = env_info()
    copy = copy_bandwidth()["GBps_read_plus_write"]
    print(f"head_dim {D}, codebook={a.codebook}; registers per variant:", regs, "CTAs/SM:", occ,
          f"copy {copy:.0f} GB/s, combine {env['cuda_combine']}", flush=True)

    def add(B, T, method, us, sd, **extra):
        r = {"B": B, "T": T, "method": method, "us": us, "x_sdpa": sd / us, **extra}
        rows.append(r)
        print(f"| {B} | {T} | {method} | {extra.get('cfg', '')} | {us:.1f} | {sd / us:.2f} | "
              f"{extra.get('err', '')} |", flush=True)

    print("| B | T | method | config | us | x SDPA | err vs triton |\n|---|---|---|---|---:|---:|---|")
    for B, T in shapes:
        q, sdpa = fp16_sdpa(B, T, dev, d=D)
        sd = bench(sdpa)
        add(B, T, "fp16-sdpa", sd, sd)
        sdg = None
        if B == 1:
            sdg = bench(graph_replay(sdpa))
            add(B, T, "fp16-sdpa-graph", sdg, sdg)
        sdpa = None  # frees the shape's fp16 K/V (the timings are done with them)
        kf, vf = (tile_to(f, B, T) for f in base["hqmq"])
        ref = decode_attention(q, kf, vf, backend="triton", out_dtype=torch.float32)
        add(B, T, "hqmq-triton", bench(lambda: decode_attention(q, kf, vf, backend="triton")), sd)
        best = None
        for vv in variants:
            err = f"{rel_err(cuda_hqmq.decode(q, kf, vf, variant=vv, out_dtype=torch.float32), ref):.1e}"
            for ns in SPLITS.get(B, (None,)):
                cfg = dict(variant=vv, num_splits=ns)
                nsplit = cuda_hqmq.splits(B * 8, T, dev, ns, None, vv, head_dim=D, cw=cw)[0]
                try:
                    fn = lambda cfg=cfg: cuda_hqmq.decode(q, kf, vf, **cfg)  # noqa: E731
                    t = bench(fn)
                    tg = bench(graph_replay(lambda cfg=cfg: cuda_hqmq.decode(q, kf, vf, **cfg))) if B == 1 \
                        else None
                except RuntimeError as e:
                    print("FAILED", cfg, str(e)[:200], flush=True)
                    continue
                add(B, T, "hqmq-cuda", t, sd, cfg=cfg, nsplit=nsplit, err=err)
                if tg is not None:
                    add(B, T, "hqmq-cuda-graph", tg, sdg, cfg=cfg, nsplit=nsplit, err=err)
                key = tg if tg is not None else t
                if best is None or key < best[0]:
                    best = (key, cfg)
        print(f"BEST B={B} T={T}: {best[0]:.1f} us {best[1]} = {(sdg or sd) / best[0]:.2f}x SDPA"
              f"{' (graphs)' if B == 1 else ''}", flush=True)
        if B == 1:
            fn = graph_replay(lambda: decode_attention(q, kf, vf, backend="triton"))
            add(B, T, "hqmq-triton-graph", bench(fn), sdg)
            # the decode-loop form: valid_len on the device, a workspace, one graph for every step
            vl = torch.tensor([T], dtype=torch.int32, device=dev)
            ws = cuda_hqmq.workspace(q, kf)
            fn = graph_replay(lambda: cuda_hqmq.decode(q, kf, vf, workspace=ws, valid_len=vl))
            add(B, T, "hqmq-cuda-graph-valid_len", bench(fn), sdg, cfg="default, valid_len")
            for method, fn in (("cuda_hqmq.decode(workspace, valid_len)",
                                lambda: cuda_hqmq.decode(q, kf, vf, workspace=ws, valid_len=vl)),
                               ("decode_attention(backend=cuda)", lambda: decode_attention(q, kf, vf, backend="cuda"))):
                h = host_us(fn)
                rows.append({"B": B, "T": T, "method": "host-us-per-call", "cfg": method, "us": h})
                print(f"| {B} | {T} | host us per eager call | {method} | {h:.1f} | | |", flush=True)
        kf3, vf3 = (tile_to(f, B, T) for f in base["hqmq-med3"])
        add(B, T, "hqmq-med3-triton", bench(lambda: decode_attention(q, kf3, vf3, backend="triton")), sd,
            outliers_k=kf3.n_outliers, outliers_v=vf3.n_outliers)
        ref3 = decode_attention(q, kf3, vf3, backend="triton", out_dtype=torch.float32)
        med3_best = {}  # variant -> (us, cfg): graphs at B=1, eager at B=8 (as BEST above)
        for vv in med3_variants:
            try:
                err = f"{rel_err(cuda_hqmq.decode(q, kf3, vf3, variant=vv, out_dtype=torch.float32), ref3):.1e}"
            except (RuntimeError, ValueError) as e:
                print("FAILED med3", vv, str(e)[:200], flush=True)
                continue
            for ns in SPLITS.get(B, (None,))[:2]:
                cfg = dict(variant=vv, num_splits=ns)
                nsplit = cuda_hqmq.splits(B * 8, T, dev, ns, None, vv, 96, True, D, cw)[0]
                t = bench(lambda cfg=cfg: cuda_hqmq.decode(q, kf3, vf3, **cfg))
                add(B, T, "hqmq-med3-cuda", t, sd, cfg=cfg, nsplit=nsplit, err=err)
                if B == 1:
                    fn = graph_replay(lambda cfg=cfg: cuda_hqmq.decode(q, kf3, vf3, **cfg))
                    t = bench(fn)
                    add(B, T, "hqmq-med3-cuda-graph", t, sdg, cfg=cfg, nsplit=nsplit, err=err)
                if vv not in med3_best or t < med3_best[vv][0]:
                    med3_best[vv] = (t, cfg)
        for vv, (t, cfg) in med3_best.items():
            print(f"MED3 B={B} T={T}: variant {vv} best {t:.1f} us {cfg} = {t / best[0]:.3f}x the best HQMQ "
                  f"({best[0]:.1f}; target <= 1.25){' (graphs)' if B == 1 else ''}", flush=True)
            rows.append({"B": B, "T": T, "method": "med3-over-hqmq", "cfg": cfg, "us": t, "x_hqmq": t / best[0]})
        if B == 1:  # eager again at the end, with a workspace (the host quiet by now), twice
            for name, (fk_, fv_) in (("hqmq-cuda", (kf, vf)), ("hqmq-med3-cuda", (kf3, vf3))):
                ws = cuda_hqmq.workspace(q, fk_)
                for rep_ in range(2):
                    add(B, T, f"{name}-eager-default",
                        bench(lambda fk_=fk_, fv_=fv_, ws=ws: cuda_hqmq.decode(q, fk_, fv_, workspace=ws)), sd,
                        cfg=f"default, workspace, repeat {rep_}")
        kf3 = vf3 = kf = vf = None  # as above
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hqmq_bench.json").write_text(json.dumps({"device": env["gpu"], "env": env, "head_dim": D, "regs": regs,
                                                      "ctas_per_sm": occ, "copy_GBps": copy, "rows": rows},
                                                     indent=1, default=str))
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
