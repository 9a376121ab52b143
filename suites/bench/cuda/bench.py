"""Same-run timings of the CUDA decode kernels (kernels/cuda/decode_attention.py) beside torch
SDPA on the fp16 cache and the Triton kernels, at the issue-10 shapes.

    python -m kvqbench.suites.bench.cuda.bench [--out DIR] [--shapes 8x32768,1x32768]
        [--methods kivi2,kivi4] [--kivi-variants 4,8,12] [--kivi-ctas default,8] [--head-dim 64]

Protocol: Hq 32 / Hkv 8 / d 128 (--head-dim: 64, 256), one query token, fp16 q; caches are
real encodings of 4096 synthetic tokens (3 outlier key channels) tiled to T (the benchmark toolkit's
helpers, suites/bench/toolkit.py, as in the kernel sweep); every time is the toolkit's
`timeit_us`, i.e. `triton.testing.do_bench` (CUDA events, median, 256 MB L2 flush
before each call), warm-up 10 ms, rep 40 ms => well over 30 timed calls; B=1 is also
timed as a CUDA graph replay (launch overhead removed). Prints a table and writes cuda_bench.json under --out.
--kivi-variants / --kivi-ctas replace the KIVI configs at every shape (B=1 too) by the
listed variants x split rules ("default": the default rule, ~128 tiles per split; a
number: that many CTAs per SM); each KIVI config's output is also compared with
Triton's (err_vs_triton per row).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ....kernels.cuda import decode_attention as cuda_decode
from ....kernels.decode_attention import decode_attention
from ....kernels.layout import flatten
from ..toolkit import (copy_bandwidth, encode_kv, env_info, fp16_sdpa, graph_replay, host_us, rel_err, synthetic_kv,
                       tile_to, timeit_us)

METHODS = {"int4": 0, "fp8": 1, "kivi2": "kivi2", "kivi4": "kivi4"}  # name in the kernel sweep: CUDA format id
SPECS = {"int4": "int4", "fp8": "fp8-e4m3", "kivi2": "kivi:bits=2", "kivi4": "kivi:bits=4"}


def regs(name, variant, D=128):
    if name.startswith("kivi"):
        if variant not in cuda_decode.KIVI_VARIANTS:
            return None
        return cuda_decode.num_regs_kivi(int(name[-1]), False, variant, D)
    return cuda_decode.num_regs(METHODS[name], D, variant)


def bench(fn) -> float:
    """This bench's timing (hqmq_bench.py's too): the toolkit's timer, 10 ms warm-up, 40 ms of calls."""
    return timeit_us(fn, rep_ms=40, warmup_ms=10)


def kivi_cfgs(variants, ctas) -> list[dict]:
    """decode_attention options of each (variant, split rule): ctas "default" (or None) is the
    default rule, else CTAs per SM."""
    return [dict(variant=v) if c in (None, "default") else dict(variant=v, ctas_per_sm=int(c))
            for v in variants for c in ctas]


def run(shapes, out: Path, methods=tuple(METHODS), kivi_variants=None, kivi_ctas=("default", 8), D=128) -> dict:
    dev = torch.device("cuda")
    env = env_info()
    res = {"device": env["gpu"], "torch": env["torch"], "triton": env["triton"], "env": env,
           "head_dim": D,
           "regs": {f"{m}/v{v}": regs(m, v, D) for m in METHODS for v in range(max(cuda_decode.KIVI_VARIANTS) + 1)},
           "rows": []}
    res["regs"].update({f"kivi{b}/tail": cuda_decode.num_regs_kivi(b, True, head_dim=D) for b in (2, 4)})
    res["copy_bandwidth"] = copy_bandwidth()
    res["copy_GBps"] = res["copy_bandwidth"]["GBps_read_plus_write"]
    k, v = synthetic_kv(1, 8, 4096, D, dev)
    base = {}
    for name in methods:
        (_, pk), (_, pv) = encode_kv(SPECS[name], k, v)  # seed 3, as the kernel sweep
        base[name] = (flatten(pk, "K"), flatten(pv, "V"))
    best_variant = {}
    for B, T in shapes:
        rows = res["rows"]
        q, sdpa = fp16_sdpa(B, T, dev, d=D)
        t_sdpa = bench(sdpa)
        rows.append({"B": B, "T": T, "method": "fp16-sdpa", "us": t_sdpa})
        if B == 1:
            rows.append({"B": B, "T": T, "method": "fp16-sdpa-graph", "us": bench(graph_replay(sdpa))})
            rows[-2]["host_us"] = host_us(sdpa)
        sdpa = None  # frees the fp16 K/V
        for name in methods:
            kf, vf = (tile_to(f, B, T) for f in base[name])
            assert kf.T == vf.T == T
            nbytes = kf.read_nbytes + vf.read_nbytes
            ref = decode_attention(q, kf, vf, backend="triton", out_dtype=torch.float32)
            t_tri = bench(lambda: decode_attention(q, kf, vf, backend="triton"))
            rows.append({"B": B, "T": T, "method": f"{name}-triton", "us": t_tri, "bytes": nbytes})
            try:  # a first CUDA call that fails (unverified KIVI) must not stop the other methods
                got = decode_attention(q, kf, vf, backend="cuda", out_dtype=torch.float32)
                err = rel_err(got, ref)
            except (RuntimeError, ValueError) as e:
                rows.append({"B": B, "T": T, "method": f"{name}-cuda", "us": float("nan"), "error": str(e)[:200]})
                print("FAILED", name, B, T, str(e)[:200], flush=True)
                continue
            kivi = name.startswith("kivi")
            variants = cuda_decode.variants(kf)  # the instances at this head dim (256: the smem ones)
            if kivi and kivi_variants:  # the listed variants x split rules, at every B
                cfgs = kivi_cfgs(kivi_variants, kivi_ctas)
            elif B > 1:
                cfgs = [dict(variant=vv, ctas_per_sm=c) for vv in variants for c in (4, 8, 16)]
                cfgs.append(dict())  # the defaults (variant 2, ~64 tiles per split)
            else:  # few rows: fewer, longer splits (the shared-memory pipeline keeps bytes in flight)
                vs = sorted(({best_variant.get(name, 2)} | (set(variants) if kivi
                                                            else {0, *cuda_decode.SMEM_VARIANTS})) & set(variants))
                cfgs = [dict(variant=vv, ctas_per_sm=c) for vv in vs for c in (2, 4, 8)]
            best = None
            for cfg in cfgs:
                try:
                    cerr = err  # KIVI: each config's own output against Triton's (variants differ in numerics)
                    if kivi:
                        cerr = rel_err(decode_attention(q, kf, vf, backend="cuda", out_dtype=torch.float32, **cfg), ref)
                    t = bench(lambda: decode_attention(q, kf, vf, backend="cuda", **cfg))
                except RuntimeError as e:  # a launch error is not sticky: record it, go on
                    rows.append({"B": B, "T": T, "method": f"{name}-cuda", "cfg": cfg, "us": float("nan"),
                                 "error": str(e)[:200]})
                    print("FAILED", name, B, T, cfg, str(e)[:200], flush=True)
                    continue
                rows.append({"B": B, "T": T, "method": f"{name}-cuda", "cfg": cfg, "us": t, "bytes": nbytes,
                             "err_vs_triton": cerr})
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best is None:
                continue
            if B > 1:
                best_variant[name] = best[1].get("variant", 2)
            if B == 1:
                for r in rows:  # host time per eager call of the best CUDA config and of Triton
                    if (r["B"], r["T"]) == (B, T) and ((r["method"] == f"{name}-cuda" and r.get("cfg") == best[1])
                                                       or r["method"] == f"{name}-triton"):
                        kw = dict(backend="cuda", **best[1]) if r["method"].endswith("cuda") else dict(backend="triton")
                        r["host_us"] = host_us(lambda kw=kw: decode_attention(q, kf, vf, **kw))
                for tag, kw in (("cuda", dict(backend="cuda", **best[1])), ("triton", dict(backend="triton"))):
                    fn = graph_replay(lambda kw=kw: decode_attention(q, kf, vf, **kw))
                    rows.append({"B": B, "T": T, "method": f"{name}-{tag}-graph", "us": bench(fn), "bytes": nbytes,
                                 "cfg": kw})
            kf = vf = None
            torch.cuda.empty_cache()
        out.mkdir(parents=True, exist_ok=True)
        (out / "cuda_bench.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def table(res: dict, best_only: bool = False) -> str:
    lines = [f"{res['device']}  torch {res['torch']}  triton {res['triton']}  copy {res['copy_GBps']:.0f} GB/s  "
             f"head dim {res.get('head_dim', 128)}  combine {res['env'].get('cuda_combine', '?')}",
             f"registers per thread: {res['regs']}",
             "| B | T | method | config | us | x faster than SDPA | GB/s | err vs triton | host us/call |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    sd = {}
    for r in res["rows"]:
        if r["method"].startswith("fp16-sdpa"):
            sd[(r["B"], r["T"], r["method"].endswith("graph"))] = r["us"]
    rows = res["rows"]
    if best_only:  # the fastest CUDA config per (B, T, method), everything else as is
        best = {}
        for r in rows:
            if r["method"].endswith("-cuda"):
                key = (r["B"], r["T"], r["method"])
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        rows = [r for r in rows if not r["method"].endswith("-cuda") or best[(r["B"], r["T"], r["method"])] is r]
    for r in rows:
        ref = sd.get((r["B"], r["T"], r["method"].endswith("graph")), sd.get((r["B"], r["T"], False)))
        gbps = f"{r['bytes'] / r['us'] / 1e3:.0f}" if "bytes" in r else ""
        err = f"{r['err_vs_triton']:.1e}" if "err_vs_triton" in r else ""
        cfg = r.get("cfg", "")
        if isinstance(cfg, dict):
            cfg = ",".join(f"{k}={v}" for k, v in cfg.items() if k != "backend")
        host = f"{r['host_us']:.1f}" if "host_us" in r else ""
        lines.append(f"| {r['B']} | {r['T']} | {r['method']} | {cfg} | {r['us']:.1f} | {ref / r['us']:.2f} | {gbps} | {err} "
                     f"| {host} |")
    return "\n".join(lines)


def once(shapes, methods) -> None:
    """One CUDA call per method and shape, nothing timed: the target of a profiler
    (`ncu -k regex:KiviQ python -m kvqbench.suites.bench.cuda.bench --once --methods kivi2 --shapes 8x32768`)."""
    dev = torch.device("cuda")
    k, v = synthetic_kv(1, 8, 4096, 128, dev)
    for B, T in shapes:
        q = torch.randn(B, 32, 1, 128, device=dev).half()
        for name in methods:
            (_, pk), (_, pv) = encode_kv(SPECS[name], k, v)
            kf, vf = (tile_to(f, B, T) for f in (flatten(pk, "K"), flatten(pv, "V")))
            decode_attention(q, kf, vf, backend="cuda")
            torch.cuda.synchronize()
            print("once", name, B, T, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/cuda_bench")
    ap.add_argument("--shapes", default="8x32768,1x32768")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {','.join(METHODS)}")
    ap.add_argument("--best-only", action="store_true", help="print only SDPA, Triton and the best CUDA row per shape")
    ap.add_argument("--once", action="store_true", help="one CUDA call per method and shape, for a profiler")
    ap.add_argument("--kivi-variants", default="", help="comma-separated KIVI variants to time (at every shape) "
                    f"instead of the default sweep, of {','.join(map(str, cuda_decode.KIVI_VARIANTS))}")
    ap.add_argument("--kivi-ctas", default="default,8", help="with --kivi-variants: the split rules, comma-separated: "
                    "'default' (the default rule) or CTAs per SM")
    ap.add_argument("--head-dim", type=int, default=128, choices=cuda_decode.HEAD_DIMS)
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.once:
        return once(shapes, a.methods.split(","))
    t0 = time.time()
    kv = [int(x) for x in a.kivi_variants.split(",") if x]
    bad = [x for x in kv if x not in cuda_decode.KIVI_VARIANTS]
    if bad:
        ap.error(f"--kivi-variants {bad}: not in {cuda_decode.KIVI_VARIANTS}")
    kc = [x if x == "default" else int(x) for x in a.kivi_ctas.split(",") if x]
    res = run(shapes, Path(a.out), tuple(a.methods.split(",")), kivi_variants=kv, kivi_ctas=kc, D=a.head_dim)
    txt = table(res, best_only=a.best_only)
    Path(a.out, "cuda_bench.md").write_text(txt + "\n")
    print(txt)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
