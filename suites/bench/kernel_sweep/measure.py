"""One GPU call: check the fused decode kernels against the reference, then time
launch-config variants of each at the issue-10 shape beside fp16 SDPA.

    python -m kvqbench.suites.bench.kernel_sweep run --out $OUT [--shapes 8x32768,1x32768]

Checks (before any timing): every method against `reference_decode_attention` over
`Quantizer.decode` at T = 1, an odd T and with only the last key changed. Data,
timer, tiler, graph capture, copy bandwidth and environment record are the
benchmark toolkit's (suites/bench/toolkit.py). Timing: `timeit_us` (triton's
do_bench: CUDA events, median, L2 flushed before each call; 20 ms warm-up, 80 ms);
fp16 SDPA (flash, native GQA) and the device copy bandwidth are measured in the
same run, so the ratios are same-run ratios. B=1 also runs through a CUDA graph
(`graph_replay`) to show the launch overhead. Writes bench_kernels.json under --out
(the entry point, __main__.py, prints a short table last).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..toolkit import (copy_bandwidth, describe_error, encode_kv, env_info, fp16_sdpa, graph_replay, host_overhead,
                       rel_err, synthetic_kv, tile_to, timeit_us)

# name: (spec, flatten kwargs) of every registered format's benchmark specs (kernels/registry.py
# `Format.bench`), filled by `registered_methods()` at the first call (importing this module imports
# no kernels)
METHODS: dict[str, tuple[str, dict]] = {}
FLATTEN_OPTIONS = {"hqmq": {"table_mode": "codebook", "table_dtype": torch.float16}}  # by format: its GPU table


def registered_methods() -> dict[str, tuple[str, dict]]:
    if not METHODS:
        from ....kernels import registry

        for fmt in registry.formats().values():
            for label, spec in fmt.bench.items():
                METHODS.setdefault(label, (spec, FLATTEN_OPTIONS.get(fmt.name, {})))
    return METHODS


VARIANTS = [  # launch configs tried per method; then programs per SM around the best one
    dict(block_t=64, num_warps=4, num_stages=2),
    dict(block_t=64, num_warps=4, num_stages=3),
    dict(block_t=128, num_warps=4, num_stages=2),
    dict(block_t=128, num_warps=8, num_stages=2),
    dict(block_t=64, num_warps=8, num_stages=2),
]
HQMQ_VARIANTS = [dict(block_t=64, num_warps=4, num_stages=1), dict(block_t=128, num_warps=8, num_stages=1),
                 dict(block_t=128, num_warps=4, num_stages=1), dict(block_t=64, num_warps=2, num_stages=1)]
PROGRAMS_PER_SM = (2, 3, 4, 6, 8, 12, 16)  # 8 is the default; waves vs tail effects


def flats(name, pk, pv):
    from ....kernels.layout import flatten
    kw = registered_methods()[name][1]
    return flatten(pk, "K", **kw), flatten(pv, "V", **kw)


def check_all(dev) -> list[dict]:
    """Each method vs the reference at small shapes; the last-key test."""
    from ....kernels.decode_attention import decode_attention, reference_decode_attention
    out = []
    for name, (spec, _) in registered_methods().items():
        for (B, T, dtype) in [(1, 1, torch.float16), (2, 1000 + 17, torch.bfloat16), (1, 4096 + 33, torch.float16)]:
            k, v = synthetic_kv(B, 8, T, 128, dev, seed=T)
            q = torch.randn(B, 32, 1, 128, device=dev).to(dtype)
            (qk, pk), (qv, pv) = encode_kv(spec, k, v)
            kf, vf = flats(name, pk, pv)
            o = decode_attention(q, kf, vf, out_dtype=torch.float32)
            ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
            out.append({"method": name, "B": B, "T": T, "dtype": str(dtype), "rel_err": rel_err(o, ref),
                        "finite": bool(torch.isfinite(o).all())})
        # last key only: aligned with every query of its head, it must take the softmax
        B, T = 1, 2048 + 5
        k, v = synthetic_kv(B, 8, T, 128, dev, seed=7)
        q = torch.randn(B, 32, 1, 128, device=dev).half()
        k2 = k.clone()
        k2[:, :, -1] = q.float().view(B, 8, 4, 128).sum(2).half()
        outs = []
        for kk in (k, k2):
            (qk, pk), (qv, pv) = encode_kv(spec, kk, v)
            kf, vf = flats(name, pk, pv)
            o = decode_attention(q, kf, vf, out_dtype=torch.float32)
            ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
            outs.append((o, rel_err(o, ref)))
        out.append({"method": name, "B": B, "T": T, "dtype": "last-key", "rel_err": max(outs[0][1], outs[1][1]),
                    "changed": rel_err(outs[1][0], outs[0][0]), "finite": True})
    return out


def bench(fn) -> float:
    """The sweep's timing: the toolkit's timer, 20 ms warm-up, 80 ms of calls."""
    return timeit_us(fn, rep_ms=80, warmup_ms=20)


def bench_shape(B, T, dev, base_cache, variants: bool, graphs: bool) -> list[dict]:
    from ....kernels.decode_attention import decode_attention
    from ....kernels.graphs import GraphedDecode
    rows = []
    D, Hq, Hkv = 128, 32, 8
    q, sdpa = fp16_sdpa(B, T, dev, Hq, Hkv, D)
    t_sdpa = bench(sdpa)
    fp16_bytes = 2 * (B * Hkv * T * D) * 2  # K and V, fp16
    rows.append({"B": B, "T": T, "method": "fp16-sdpa", "us": t_sdpa, "bytes": fp16_bytes})
    if graphs:
        rows.append({"B": B, "T": T, "method": "fp16-sdpa-graph", "us": bench(graph_replay(sdpa)),
                     "bytes": fp16_bytes})
    del sdpa  # frees the fp16 K/V
    for name in registered_methods():
        kf, vf = (tile_to(f, B, T) for f in base_cache[name])
        nbytes = kf.read_nbytes + vf.read_nbytes
        best = None
        base = (HQMQ_VARIANTS if name.startswith("hqmq") else VARIANTS)
        tried = [dict(c, programs_per_sm=8) for c in base[: None if variants else 1]]
        if B == 1:  # few rows: more splits (shorter serial chains per program) may pay
            tried = [dict(base[0], block_t=64, programs_per_sm=p) for p in (8, 16, 32)]
        i = 0
        while i < len(tried):
            cfg = tried[i]
            i += 1
            try:
                t = bench(lambda: decode_attention(q, kf, vf, **cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile/fit is recorded, not fatal
                rows.append({"B": B, "T": T, "method": name, "cfg": cfg, "error": describe_error(e, 300)})
                continue
            rows.append({"B": B, "T": T, "method": name, "cfg": cfg, "us": t, "bytes": nbytes})
            if best is None or t < best[0]:
                best = (t, cfg)
            if variants and i == len(base):  # then the split count around the best config
                tried += [dict(best[1], programs_per_sm=p) for p in PROGRAMS_PER_SM if p != 8]
        if graphs and best:
            # every config that ran, as a graph: at B=1 the plain timings rank host overhead
            # (run 9 picked 32 programs/SM from them; its graph was slower than 8/SM's in run 8)
            for cfg in [r["cfg"] for r in rows if r["method"] == name and (r["B"], r["T"]) == (B, T) and "us" in r]:
                step = GraphedDecode(kf, vf, q, **cfg)
                rows.append({"B": B, "T": T, "method": name + "-graph", "cfg": cfg, "bytes": nbytes,
                             "us": bench(_replay(step, q)),
                             "host_us_per_call": host_overhead(lambda: decode_attention(q, kf, vf, **cfg),
                                                               _replay(step, q))})
                del step
        del kf, vf
        torch.cuda.empty_cache()
    return rows


def _replay(step, q):
    return lambda: step(q)


def run_sweep(out, shapes: str = "8x32768,1x32768", variants: bool = True, check: bool = True,
              methods: list[str] | None = None) -> dict:
    """Checks, copy bandwidth, then every method (or `methods`) at every BxT of `shapes`;
    writes bench_kernels.json under `out` after each shape and returns the results."""
    registered_methods()
    if methods:
        for name in set(METHODS) - set(methods):
            del METHODS[name]
    dev = torch.device("cuda")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = env_info()
    res = {"device": env["gpu"], "torch": env["torch"], "triton": env["triton"], "env": env}
    t0 = time.time()
    if check:
        res["checks"] = check_all(dev)
        bad = [c for c in res["checks"] if not c["finite"] or c["rel_err"] > 3e-3 * (7 if "bfloat16" in c["dtype"] else 1)
               or c.get("changed", 1) < 1e-3]
        res["checks_bad"] = bad
        print(f"checks: {len(res['checks'])} run, {len(bad)} bad ({time.time() - t0:.0f}s)", flush=True)
        for c in res["checks"]:
            print(f"  {c['method']:10s} B={c['B']} T={c['T']:6d} {c['dtype']:15s} err={c['rel_err']:.2e}"
                  + (f" changed={c['changed']:.2e}" if "changed" in c else ""), flush=True)
    res["copy_bandwidth"] = copy_bandwidth()
    res["copy_GBps"] = res["copy_bandwidth"]["GBps_read_plus_write"]
    k, v = synthetic_kv(1, 8, 4096, 128, dev)
    base = {}
    for name, (spec, _) in METHODS.items():
        (qk, pk), (qv, pv) = encode_kv(spec, k, v)
        base[name] = flats(name, pk, pv)
    res["rows"] = []
    for shp in shapes.split(","):
        B, T = (int(x) for x in shp.split("x"))
        res["rows"] += bench_shape(B, T, dev, base, variants and B > 1, graphs=B == 1)
        (out / "bench_kernels.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"shape {B}x{T} done ({time.time() - t0:.0f}s)", flush=True)
    return res


