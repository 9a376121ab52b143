"""Decode-step latency of attention over quantized KV caches, one run, same shapes.

Methods, for Llama-3-8B attention shapes (Hq 32, Hkv 8, d 128), T in {4k, 16k,
32k, 128k}, B in {1, 8, 32}:

- `fp16-sdpa`: fp16 K/V, torch SDPA (flash backend, native GQA);
- `fake-quant`: what the public benchmark compared against: decode the whole
  packed HQMQ cache to fp16 with the quantizer's torch decode, then SDPA;
- `fused-hqmq`, `fused-hqmq-med3`, `fused-int4`, `fused-kivi4`, `fused-kivi2`:
  kvqbench.kernels' fused decode attention over the packed bytes.

Every figure is stored with the bytes the method must read at least (packed
K+V cache and lookup tables, or fp16 K+V; plus q and the output), the achieved
GB/s on those bytes, and its fraction of the device-to-device copy bandwidth
measured in the same run (copy GB/s counts bytes read + written). Fake-quant's
bytes are the packed cache it starts from (its real traffic is far larger).
Timing: triton.testing.do_bench (CUDA events, median, L2 flushed before each
call, warm-up first). Packed caches are real encodings (HQMQ through the
kernel encoder) of 4096 tokens of synthetic K/V (Gaussian; keys with three
25x outlier channels) tiled to the target shape (`*Flat.tile`).

Also: HQMQ encode throughput (chunks/s) beside an arithmetic floor, and the
memory figure: stored bytes per token per layer of each quantizer against
fp16, measured from `Packed.nbytes`, with a PROJECTION to Llama-3-70B at 128k
computed from a config.

    python -m kvqbench.suites.bench.bench_latency --out reports/latency   # GPU: everything
    python -m kvqbench.suites.bench.bench_latency --smoke --out /tmp/x    # CPU: plumbing only
    pytest -m bench suites/bench/bench_latency.py      # pytest-benchmark

Writes latency.json, latency.md and latency.png into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

GPU = torch.cuda.is_available()
HQ, HKV, D = 32, 8, 128
T0 = 4096  # tokens really encoded; larger caches tile them
TS = (4096, 16384, 32768, 131072)
BS = (1, 8, 32)
FOCUS = (8, 32768)  # where the targets are checked and the kernels tuned
SPECS = {
    "fused-hqmq": "hqmq:S=96,r=4",
    "fused-hqmq-med3": "hqmq:S=96,r=4,outliers=med3",
    "fused-int4": "int4",
    "fused-kivi4": "kivi:bits=4",
    "fused-kivi2": "kivi:bits=2",
}
FAKE_SPEC = "hqmq:S=96,r=4,outliers=med3"
MEMORY_SPECS = ("fp16", "int4", "int2", "kivi:bits=4", "kivi:bits=2", "hqmq:S=24,r=3", "hqmq:S=96,r=4",
                "hqmq:S=24,r=3,outliers=med3", "hqmq:S=96,r=4,outliers=med3")
PROJECTION = {"model": "Llama-3-70B", "layers": 80, "kv_heads": 8, "head_dim": 128, "tokens": 131072}
OPS_PER_CHUNK_SECONDARY = 32  # FP32-pipe instructions of the search loop body, counted from the source
FAKE_MAX_TOKEN_HEADS = 4 << 20  # torch decode temporaries ~10 KB per token-head
FP16_MAX_BYTES = 80 << 30

pytestmark = [pytest.mark.bench, pytest.mark.skipif(not GPU, reason="latency benchmarks need a CUDA GPU")]


# ---------------------------------------------------------------------------------------
# environment and timing
# ---------------------------------------------------------------------------------------
def _smi(query: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except Exception:  # noqa: BLE001
        return ""


def env_info() -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    if GPU:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_mem_GiB=round(p.total_memory / 2**30, 1),
                    driver=_smi("driver_version"), sm_clock_max_MHz=_smi("clocks.max.sm"),
                    sm_clock_now_MHz=_smi("clocks.sm"), mem_clock_max_MHz=_smi("clocks.max.mem"))
    else:
        info.update(gpu="none (CPU smoke run, Triton interpreter)", sm_count=0)
    return info


def timeit_us(fn, rep_ms: int = 100) -> float:
    """Median time of fn in microseconds (CUDA events, L2 flushed, warmed up)."""
    if GPU:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[1] * 1e6


def copy_bandwidth_GBps(nbytes: int) -> dict:
    dev = "cuda" if GPU else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 256)
    dst = torch.empty_like(src)
    t = timeit_us(lambda: dst.copy_(src), rep_ms=200)
    del src, dst
    return {"bytes_copied": nbytes, "time_us": t, "GBps_read_plus_write": 2 * nbytes / t / 1e3}


# ---------------------------------------------------------------------------------------
# caches
# ---------------------------------------------------------------------------------------
def synthetic_kv(B, H, T, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, d, generator=g)
    for c in (3, d // 2 + 1, d - 2):
        k[..., c] *= 25.0
    v = torch.randn(B, H, T, d, generator=g)
    return k.half().to(device), v.half().to(device)


@dataclasses.dataclass
class Base:
    spec: str
    qk: object
    qv: object
    pk: object
    pv: object
    kf: object
    vf: object


def build_bases(device, hkv, t0, d) -> dict[str, Base]:
    from kvqbench.kernels import layout as L
    from kvqbench.kernels.hqmq_encode import encode_with_kernel
    from kvqbench.quantizers import get_quantizer

    k, v = synthetic_kv(1, hkv, t0, d, device)
    bases = {}
    for name, spec in {**SPECS, "fake-quant": FAKE_SPEC}.items():
        if name == "fake-quant" and SPECS["fused-hqmq-med3"] == FAKE_SPEC:
            bases[name] = bases["fused-hqmq-med3"]
            continue
        qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
        enc = encode_with_kernel if spec.startswith("hqmq") else (lambda q, x: q.encode(x))
        pk, pv = enc(qk, k), enc(qv, v)
        bases[name] = Base(spec, qk, qv, pk, pv, L.flatten(pk, "K"), L.flatten(pv, "V"))
    return bases


def tiled(base: Base, B: int, T: int, t0: int):
    from kvqbench.kernels.layout import KIVIFlat

    if isinstance(base.kf, KIVIFlat):
        tr = base.kf.T_res
        if (T - tr) % base.kf.group:
            raise ValueError(f"T={T} does not fit KIVI groups")
        ng = (T - tr) // base.kf.group
        return base.kf.tile(B, ng), base.vf.tile(B, ng)
    if T % t0:
        raise ValueError(f"T={T} is not a multiple of the encoded {t0} tokens")
    return base.kf.tile(B, T // t0), base.vf.tile(B, T // t0)


def as_segment(flat):
    from kvqbench.quantizers import Segment

    names = ["codes", "radius", "r_max"] + (["flags", "outliers", "outlier_index"] if flat.has_outliers else [])
    return Segment({n: getattr(flat, n) for n in names}, flat.T)


# ---------------------------------------------------------------------------------------
# the methods
# ---------------------------------------------------------------------------------------
def run_sdpa(q, k, v, backend: str):
    import torch.nn.functional as F

    if backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


_SDPA_BACKEND: dict = {}


def sdpa_backend() -> tuple[str, list]:
    """The flash backend with native GQA if it runs here, else torch's default (said so)."""
    if not _SDPA_BACKEND:
        dev = "cuda" if GPU else "cpu"
        q = torch.randn(1, 4, 1, 64, device=dev, dtype=torch.float16)
        k = torch.randn(1, 2, 256, 64, device=dev, dtype=torch.float16)
        errors = []
        for name in (["flash"] if GPU else []) + ["default"]:
            try:
                run_sdpa(q, k, k, name)
                _SDPA_BACKEND.update(name=name, errors=errors)
                break
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        else:
            raise RuntimeError("; ".join(errors))
    return _SDPA_BACKEND["name"], _SDPA_BACKEND["errors"]


def sdpa_callable(q, k, v):
    backend, errors = sdpa_backend()
    return (lambda: run_sdpa(q, k, v, backend)), backend, errors


def fused_callable(q, kf, vf, cfg: dict):
    """The fused call; cfg may say table="fp16" (HQMQ: fp16 codebook table)."""
    from kvqbench.kernels.decode_attention import decode_attention

    cfg = dict(cfg)
    pps = cfg.pop("programs_per_sm", None)  # -> splits for this shape (default 4 per SM)
    if pps and GPU:
        cfg["num_splits"] = max(1, math.ceil(pps * torch.cuda.get_device_properties(0).multi_processor_count
                                             / (kf.B * kf.H)))
    table = cfg.pop("table", None)
    if table:
        mode, dt = TABLES[table]
        kf, vf = kf.with_table(mode, dt), vf.with_table(mode, dt)
    return lambda: decode_attention(q, kf, vf, **cfg)


# HQMQ codeword sources (layout.HQMQFlat.with_table): secondaries + arithmetic, or the full codebook
TABLES = {"sec32": ("secondaries", torch.float32), "sec16": ("secondaries", torch.float16),
          "cb32": ("codebook", torch.float32), "cb16": ("codebook", torch.float16)}


def fake_quant_callable(q, base: Base, kf, vf):
    shape = (kf.B, kf.H, kf.T, kf.D)
    sk, sv = as_segment(kf), as_segment(vf)
    backend, _ = sdpa_backend()  # the same SDPA as the fp16 baseline

    def fn():
        kh = base.qk.decode_tokens(sk, base.pk.shared, shape).to(torch.float16)
        vh = base.qv.decode_tokens(sv, base.pv.shared, shape).to(torch.float16)
        return run_sdpa(q, kh, vh, backend)

    return fn


def tune(q, kf, vf, name, sm_count, log) -> tuple[dict, list]:
    """Greedy search at the focus shape: block/warps, then (HQMQ) codeword source x
    pipelining stages, or stages alone, then the number of splits. Returns the best
    config and every timing."""
    B = kf.B
    results = []
    best = {"time_us": float("inf")}
    best_cfg = dict(block_t=64, num_warps=4)

    def trial(cfg):
        nonlocal best, best_cfg
        try:
            t = timeit_us(fused_callable(q, kf, vf, cfg))
            results.append({**cfg, "time_us": t})
            log(f"  tune {name} {cfg}: {t:.1f} us")
            if t < best["time_us"] * 0.98:
                best, best_cfg = results[-1], dict(cfg)
        except Exception as e:  # noqa: BLE001
            results.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"  tune {name} {cfg}: ERROR {str(e)[:200]}")

    hq = name.startswith("fused-hqmq")
    grid = [dict(block_t=64, num_warps=4), dict(block_t=64, num_warps=8), dict(block_t=128, num_warps=8),
            dict(block_t=128, num_warps=4)]
    grid += [dict(block_t=64, num_warps=16)] if hq else [dict(block_t=32, num_warps=4)]
    for cfg in grid:  # HQMQ: fp16 codebook, no software pipelining (best in run 3)
        trial({**cfg, "table": "cb16", "num_stages": 1} if hq else cfg)
    base = dict(best_cfg)
    if hq:  # other codeword sources, and pipelining
        for table in ("sec32", "sec16", "cb32"):
            trial({**base, "table": table})
        trial({**base, "num_stages": 2})
    else:
        for ns in (1, 3):
            trial({**base, "num_stages": ns})
    if sm_count:
        base = dict(best_cfg)
        for pps in (2, 8, 16):  # splits: programs per SM (default 4), per shape
            trial({**base, "programs_per_sm": pps})
    return best_cfg, results


# ---------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------
def latency_section(args, bases, copy_bw, sm_count, log, t_start) -> tuple[list, dict]:
    from kvqbench.kernels.decode_attention import reference_decode_attention

    dev = "cuda" if GPU else "cpu"
    hq, hkv, d, t0 = args.hq, args.hkv, args.d, args.t0
    combos = [(b, t) for b in args.batches for t in args.tokens]
    focus = (args.focus_b, args.focus_t)
    combos.sort(key=lambda c: (c != focus, c[0], c[1]))
    rows, tuning, cfgs = [], {}, {}
    for B, T in combos:
        if time.time() - t_start > args.budget_s:
            rows.append({"B": B, "T": T, "skipped": "time budget"})
            log(f"B={B} T={T}: skipped (time budget)")
            continue
        q = torch.randn(B, hq, 1, d, device=dev).half()
        qo_bytes = 2 * q.numel() * 2
        kv16 = 2 * B * hkv * T * d * 2

        def record(method, t_us, nbytes, **extra):
            gbps = nbytes / t_us / 1e3
            row = {"method": method, "B": B, "T": T, "Hq": hq, "Hkv": hkv, "d": d, "latency_us": t_us,
                   "bytes": nbytes, "GBps": gbps, "frac_copy_bw": gbps / copy_bw, **extra}
            rows.append(row)
            log(f"B={B:3d} T={T:7d} {method:17s} {t_us:10.1f} us {gbps:8.1f} GB/s "
                f"{row['frac_copy_bw']:.2f} of copy  {extra.get('note', '')}")

        # fp16 SDPA
        if kv16 <= args.fp16_max_bytes:
            try:
                k16 = torch.randn(B, hkv, T, d, device=dev, dtype=torch.float16)
                v16 = torch.randn(B, hkv, T, d, device=dev, dtype=torch.float16)
                fn, backend, errs = sdpa_callable(q, k16, v16)
                record("fp16-sdpa", timeit_us(fn), kv16 + qo_bytes, backend=backend,
                       note=f"backend={backend}" + (f" ({'; '.join(errs)})" if errs else ""))
                del k16, v16, fn
            except Exception as e:  # noqa: BLE001
                rows.append({"method": "fp16-sdpa", "B": B, "T": T, "error": f"{type(e).__name__}: {e}"[:400]})
                log(f"fp16-sdpa B={B} T={T}: ERROR {e}")
            torch.cuda.empty_cache() if GPU else None
        else:
            rows.append({"method": "fp16-sdpa", "B": B, "T": T, "skipped": "fp16 K/V over the memory cap"})

        for name, base in bases.items():
            try:
                kf, vf = tiled(base, B, T, t0)
            except Exception as e:  # noqa: BLE001
                rows.append({"method": name, "B": B, "T": T, "error": str(e)[:300]})
                continue
            nbytes = kf.read_nbytes + vf.read_nbytes + qo_bytes
            if name == "fake-quant":
                if B * hkv * T > args.fake_max_token_heads:
                    rows.append({"method": name, "B": B, "T": T, "skipped": "torch decode temporaries too large"})
                else:
                    try:
                        record(name, timeit_us(fake_quant_callable(q, base, kf, vf), rep_ms=50), nbytes,
                               note=f"{base.spec}; bytes = packed cache it starts from")
                    except Exception as e:  # noqa: BLE001
                        rows.append({"method": name, "B": B, "T": T, "error": f"{type(e).__name__}: {e}"[:400]})
                        log(f"fake-quant B={B} T={T}: ERROR {e}")
            else:
                try:
                    if name not in cfgs:
                        if (B, T) == focus and GPU and not args.no_tune:
                            cfgs[name], tuning[name] = tune(q, kf, vf, name, sm_count, log)
                        else:
                            cfgs[name] = dict(block_t=64, num_warps=4)
                    fn = fused_callable(q, kf, vf, cfgs[name])
                    extra = {"config": cfgs[name], "spec": base.spec,
                             "bits_per_element": 8 * (kf.cache_nbytes + vf.cache_nbytes) / (2 * B * hkv * T * d)}
                    if B == 1 and T == args.tokens[0]:  # a correctness check inside the benchmark
                        ref = reference_decode_attention(q, base.qk.decode(_packed_of(base.pk, kf)),
                                                         base.qv.decode(_packed_of(base.pv, vf)))
                        out = fn().float()
                        extra["rel_err_vs_reference"] = float((out - ref).norm() / ref.norm())
                    record(name, timeit_us(fn), nbytes, **extra)
                except Exception as e:  # noqa: BLE001
                    rows.append({"method": name, "B": B, "T": T, "error": f"{type(e).__name__}: {e}"[:400]})
                    log(f"{name} B={B} T={T}: ERROR {type(e).__name__}: {e}")
            del kf, vf
        if GPU:
            torch.cuda.empty_cache()
    return rows, {"chosen": cfgs, "trials": tuning}


def _packed_of(base_packed, flat):
    """A Packed of the tiled flat (for the reference decode), one segment per role."""
    from kvqbench.kernels.layout import HQMQFlat, IntFlat, KIVIFlat
    from kvqbench.quantizers import Segment

    if isinstance(flat, HQMQFlat):
        segs = [as_segment(flat)]
    elif isinstance(flat, IntFlat):
        segs = [Segment({"codes": flat.codes, "scale": flat.scale, "zero": flat.zero}, flat.T)]
    elif isinstance(flat, KIVIFlat):
        segs = []
        for g in range(flat.n_groups):
            if flat.role == "K":
                f = {"codes": flat.codes[:, :, g], "scale": flat.scale[:, :, g, :, None],
                     "zero": flat.zero[:, :, g, :, None]}
            else:
                sl = slice(g * flat.group, (g + 1) * flat.group)
                f = {"codes": flat.codes[:, :, sl], "scale": flat.scale[:, :, sl], "zero": flat.zero[:, :, sl]}
            segs.append(Segment(f, flat.group))
        if flat.T_res:
            segs.append(Segment({"residual": flat.residual}, flat.T_res))
    else:
        raise TypeError(type(flat))
    return dataclasses.replace(base_packed, batch=flat.B, segments=segs)


def encode_section(args, sm_count, clock_mhz, log) -> dict:
    from kvqbench.kernels.hqmq_encode import encode_with_kernel, hqmq_search
    from kvqbench.quantizers import get_quantizer

    dev = "cuda" if GPU else "cpu"
    B, H, T, d = 1, args.hkv, args.encode_t, args.d
    x, _ = synthetic_kv(B, H, T, d, dev, seed=5)
    out = {"shape": [B, H, T, d], "chunks": B * H * T * d // 4}
    for spec in ("hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3"):
        q = get_quantizer(spec, role="K")
        shared = {k: v.to(dev) for k, v in q.make_shared(H, d).items()}
        chunks = x.float().reshape(B, H, -1, 4)
        r = chunks.norm(dim=-1, keepdim=True)
        u = torch.where(r > 0, chunks / torch.where(r > 0, r, torch.ones_like(r)), chunks.new_tensor([1.0, 0, 0, 0]))
        sec = q.secondaries(shared)
        n = out["chunks"]
        S = q.config.S
        res = {"spec": spec}
        t = timeit_us(lambda: hqmq_search(u, sec), rep_ms=200)
        res["kernel_search_us"], res["kernel_search_chunks_per_s"] = t, n / t * 1e6
        t = timeit_us(lambda: encode_with_kernel(q, x), rep_ms=200)
        res["full_encode_us"], res["full_encode_chunks_per_s"] = t, n / t * 1e6
        n_small = min(u.shape[2], 1 << 18)
        t = timeit_us(lambda: q.search(u[:, :, :n_small], shared), rep_ms=200)
        res["torch_search_chunks_per_s"] = B * H * n_small / t * 1e6
        if sm_count and clock_mhz:
            lanes = sm_count * 128 * clock_mhz * 1e6
            res["arith_floor_chunks_per_s"] = lanes / (OPS_PER_CHUNK_SECONDARY * S)
            res["floor_note"] = (f"{sm_count} SMs x 128 FP32 lanes x {clock_mhz} MHz / "
                                 f"({OPS_PER_CHUNK_SECONDARY} instructions per (chunk, secondary) x S={S})")
            res["kernel_frac_of_floor"] = res["kernel_search_chunks_per_s"] / res["arith_floor_chunks_per_s"]
        log(f"encode {spec}: kernel search {res['kernel_search_chunks_per_s']:.3g} chunks/s, full encode "
            f"{res['full_encode_chunks_per_s']:.3g}, torch search {res['torch_search_chunks_per_s']:.3g}"
            + (f", floor {res['arith_floor_chunks_per_s']:.3g}" if "arith_floor_chunks_per_s" in res else ""))
        out[spec] = res
    return out


def memory_section(args, log) -> dict:
    from kvqbench.quantizers import get_quantizer

    dev = "cuda" if GPU else "cpu"
    H, d = args.hkv, args.d
    t1, t2 = args.mem_t // 2, args.mem_t
    k, v = synthetic_kv(1, H, t2, d, dev, seed=9)
    rows = []
    fp16_per_token = 2 * H * d * 2
    for spec in MEMORY_SPECS:
        nb = {}
        for t in (t1, t2):
            qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
            nb[t] = qk.encode(k[:, :, :t]).nbytes + qv.encode(v[:, :, :t]).nbytes
        slope = (nb[t2] - nb[t1]) / (t2 - t1)
        fixed = nb[t2] - slope * t2
        L, T = PROJECTION["layers"], PROJECTION["tokens"]
        proj = L * (slope * T + fixed) * (PROJECTION["kv_heads"] / H) * (PROJECTION["head_dim"] / d)
        row = {"spec": spec, "measured_at_tokens": t2, "bytes_per_token_per_layer": nb[t2] / t2,
               "per_token_slope_bytes": slope, "fixed_bytes_per_layer": fixed,
               "ratio_vs_fp16": fp16_per_token / (nb[t2] / t2),
               "bits_per_element": nb[t2] * 8 / (2 * H * t2 * d),
               "projection_GB": proj / 1e9}
        rows.append(row)
        log(f"memory {spec:30s} {row['bytes_per_token_per_layer']:8.1f} B/token/layer "
            f"({row['bits_per_element']:.3f} bits, {row['ratio_vs_fp16']:.2f}x); projection {row['projection_GB']:.2f} GB")
    return {"kv_heads": H, "head_dim": d, "fp16_bytes_per_token_per_layer": fp16_per_token, "rows": rows,
            "projection": {**PROJECTION, "label": "PROJECTION (computed from a config, not measured on the model)",
                           "paper_claim": "43 GB fp16 -> 8.5 GB (S=24, r=3)"},
            "data": "synthetic K/V: Gaussian, keys with three 25x outlier channels (Med3x outlier counts are data-dependent)"}


def targets(rows, focus=FOCUS) -> dict:
    ok = [r for r in rows if "latency_us" in r]

    def lat(m, B, T):
        for r in ok:
            if r["method"] == m and r["B"] == B and r["T"] == T:
                return r
        return None

    out = {}
    for m in ("fused-hqmq", "fused-hqmq-med3"):
        f, s = lat(m, *focus), lat("fp16-sdpa", *focus)
        t = {}
        if f and s:
            t["speedup_vs_fp16_sdpa_at_focus"] = s["latency_us"] / f["latency_us"]
            t["target_2x_vs_fp16_met"] = t["speedup_vs_fp16_sdpa_at_focus"] >= 2
        if f:
            t["focus_B_T"] = list(focus)
            t["frac_copy_bw_at_focus"] = f["frac_copy_bw"]
            t["target_50pct_copy_bw_met"] = f["frac_copy_bw"] >= 0.5
        sp = []
        for r in ok:
            if r["method"] == "fake-quant" and r["T"] >= 32768:
                g = lat(m, r["B"], r["T"])
                if g:
                    sp.append({"B": r["B"], "T": r["T"], "speedup": r["latency_us"] / g["latency_us"]})
        t["speedup_vs_fake_quant_T_ge_32k"] = sp
        if sp:
            t["target_10x_vs_fake_met"] = all(x["speedup"] >= 10 for x in sp)
        out[m] = t
    grows = {}
    for m in sorted({r["method"] for r in ok}):
        for B in sorted({r["B"] for r in ok}):
            seq = sorted((r["T"], r["latency_us"]) for r in ok if r["method"] == m and r["B"] == B)
            if len(seq) > 1:
                grows[f"{m} B={B}"] = all(b[1] > a[1] for a, b in zip(seq, seq[1:]))
    out["latency_grows_with_T"] = grows
    return out


# ---------------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------------
def write_markdown(path: Path, res: dict):
    env, rows = res["env"], [r for r in res["latency"] if "latency_us" in r]
    L = [f"# Decode-step attention latency ({env.get('gpu')})", "",
         f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, driver {env.get('driver', '')}; "
         f"{env.get('time')}. Shapes: Hq {res['shape']['Hq']}, Hkv {res['shape']['Hkv']}, d {res['shape']['d']}, "
         f"fp16 queries. Device-to-device copy bandwidth measured in this run: "
         f"**{res['copy_bandwidth']['GBps_read_plus_write']:.0f} GB/s** (read + write).", "",
         "Latency = median of triton.testing.do_bench (CUDA events, L2 flushed before each call). GB/s = bytes "
         "the method must read (packed or fp16 K+V, lookup tables, q, output) / latency; fake-quant is charged "
         "only the packed bytes it starts from.", "",
         "| B | T | method | latency (us) | GB/s | of copy BW | bytes (MB) | note |",
         "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["B"], r["T"], r["method"])):
        note = r.get("note", "") or (f"{r.get('config', '')}" if r.get("config") else "")
        L.append(f"| {r['B']} | {r['T']} | {r['method']} | {r['latency_us']:.1f} | {r['GBps']:.0f} | "
                 f"{r['frac_copy_bw']:.2f} | {r['bytes'] / 1e6:.1f} | {note} |")
    skipped = [r for r in res["latency"] if "latency_us" not in r]
    if skipped:
        L += ["", "Not measured:", ""] + [f"- B={r['B']} T={r['T']} {r.get('method', '')}: "
                                          f"{r.get('skipped') or r.get('error')}" for r in skipped]
    L += ["", "## Targets (reported, not asserted)", "", "```", json.dumps(res["targets"], indent=1), "```"]
    enc = res.get("encode")
    if enc:
        L += ["", "## HQMQ encode throughput", "", f"Shape {enc['shape']} ({enc['chunks']} chunks).", "",
              "| spec | kernel search (chunks/s) | full encode (chunks/s) | torch search (chunks/s) | "
              "arithmetic floor (chunks/s) | kernel / floor |", "|---|---:|---:|---:|---:|---:|"]
        for k, v in enc.items():
            if isinstance(v, dict):
                L.append(f"| {k} | {v['kernel_search_chunks_per_s']:.3g} | {v['full_encode_chunks_per_s']:.3g} | "
                         f"{v['torch_search_chunks_per_s']:.3g} | {v.get('arith_floor_chunks_per_s', float('nan')):.3g} | "
                         f"{v.get('kernel_frac_of_floor', float('nan')):.2f} |")
        note = next((v.get("floor_note") for v in enc.values() if isinstance(v, dict) and v.get("floor_note")), "")
        L += ["", f"Floor: {note}. Full encode = torch radii/median/u + kernel search + torch radius codes and "
              "bit packing."]
    mem = res.get("memory")
    if mem:
        pj = mem["projection"]
        L += ["", "## Memory: stored bytes per token per layer (measured from Packed.nbytes)", "",
              f"{mem['kv_heads']} KV heads x d {mem['head_dim']}, K+V; fp16 = {mem['fp16_bytes_per_token_per_layer']} "
              f"B. Data: {mem['data']}.", "",
              f"| spec | bytes/token/layer | bits/element | vs fp16 | {pj['label'].split(' (')[0]}: "
              f"{pj['model']} at {pj['tokens']} tokens ({pj['layers']} layers) GB |", "|---|---:|---:|---:|---:|"]
        for r in mem["rows"]:
            L.append(f"| {r['spec']} | {r['bytes_per_token_per_layer']:.1f} | {r['bits_per_element']:.3f} | "
                     f"{r['ratio_vs_fp16']:.2f}x | {r['projection_GB']:.2f} |")
        L += ["", f"The last column is a {pj['label']}; paper's claim: {pj['paper_claim']}."]
    if res.get("tuning"):
        L += ["", "## Launch configs tried at the focus shape", "", "```", json.dumps(res["tuning"], indent=1), "```"]
    path.write_text("\n".join(L) + "\n")


def write_plot(path: Path, res: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["latency"] if "latency_us" in r]
    Bs = sorted({r["B"] for r in rows})
    if not Bs:
        return
    fig, axes = plt.subplots(1, len(Bs), figsize=(5.5 * len(Bs), 4.5), squeeze=False)
    for ax, B in zip(axes[0], Bs):
        for m in sorted({r["method"] for r in rows}):
            pts = sorted((r["T"], r["latency_us"]) for r in rows if r["method"] == m and r["B"] == B)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cached tokens T")
        ax.set_ylabel("decode-step attention latency (us)")
        ax.set_title(f"B={B}, Hq {res['shape']['Hq']}, Hkv {res['shape']['Hkv']}, d {res['shape']['d']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['env'].get('gpu')} - one query per sequence, all T keys (non-causal)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/latency")
    ap.add_argument("--budget-s", type=float, default=400, help="stop starting new shapes after this")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter) to test the plumbing")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        if not GPU:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        a.hq, a.hkv, a.d, a.t0 = 4, 2, 64, 256
        a.tokens, a.batches, a.focus_b, a.focus_t = [256, 512], [1, 2], 2, 512
        a.encode_t, a.mem_t, copy_n = 256, 256, 1 << 20
    else:
        if not GPU:
            raise SystemExit("the latency benchmark needs a CUDA GPU (use --smoke to test the plumbing)")
        a.hq, a.hkv, a.d, a.t0 = HQ, HKV, D, T0
        a.tokens, a.batches, (a.focus_b, a.focus_t) = list(TS), list(BS), FOCUS
        a.encode_t, a.mem_t, copy_n = 32768, 4096, 4 << 30
    a.fp16_max_bytes, a.fake_max_token_heads = FP16_MAX_BYTES, FAKE_MAX_TOKEN_HEADS
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    env = env_info()
    log(json.dumps(env))
    res = {"env": env, "shape": {"Hq": a.hq, "Hkv": a.hkv, "d": a.d, "encoded_tokens": a.t0},
           "method_specs": {**SPECS, "fake-quant": FAKE_SPEC}}
    res["copy_bandwidth"] = copy_bandwidth_GBps(copy_n)
    copy_bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    log(f"copy bandwidth {copy_bw:.0f} GB/s (read+write)")
    torch.manual_seed(0)
    bases = build_bases("cuda" if GPU else "cpu", a.hkv, a.t0, a.d)
    log(f"bases built in {time.time() - t_start:.1f} s")
    sm = env.get("sm_count") or 0
    try:
        clock = float(env.get("sm_clock_max_MHz") or 0)
    except ValueError:
        clock = 0.0

    def save():
        res["elapsed_s"] = time.time() - t_start
        (out / "latency.json").write_text(json.dumps(res, indent=1, default=str))
        try:
            write_markdown(out / "latency.md", res)
        except Exception as e:  # noqa: BLE001
            log(f"markdown failed: {e}")
        try:
            write_plot(out / "latency.png", res)
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {e}")

    res["latency"], res["tuning"] = latency_section(a, bases, copy_bw, sm, log, t_start)
    res["targets"] = targets(res["latency"], (a.focus_b, a.focus_t))
    save()
    if not a.skip_encode:
        try:
            res["encode"] = encode_section(a, sm, clock, log)
        except Exception as e:  # noqa: BLE001
            res["encode_error"] = f"{type(e).__name__}: {e}"
            log(f"encode section failed: {e}")
    if not a.skip_memory:
        try:
            res["memory"] = memory_section(a, log)
        except Exception as e:  # noqa: BLE001
            res["memory_error"] = f"{type(e).__name__}: {e}"
            log(f"memory section failed: {e}")
    save()
    log(json.dumps(res["targets"], indent=1))
    log(f"done in {time.time() - t_start:.0f} s -> {out}")
    return res


# ---------------------------------------------------------------------------------------
# pytest-benchmark entry points (GPU only; `pytest -m bench`)
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def focus_setup():
    bases = build_bases("cuda", HKV, T0, D)
    q = torch.randn(FOCUS[0], HQ, 1, D, device="cuda").half()
    return bases, q


@pytest.mark.parametrize("method", list(SPECS))
def test_fused_decode_latency(benchmark, focus_setup, method):
    bases, q = focus_setup
    kf, vf = tiled(bases[method], *FOCUS, T0)
    fn = fused_callable(q, kf, vf, dict(block_t=64, num_warps=4))
    fn()
    torch.cuda.synchronize()
    benchmark(lambda: (fn(), torch.cuda.synchronize()))


def test_fp16_sdpa_latency(benchmark):
    B, T = FOCUS
    q = torch.randn(B, HQ, 1, D, device="cuda").half()
    k = torch.randn(B, HKV, T, D, device="cuda").half()
    fn, _, _ = sdpa_callable(q, k, torch.randn_like(k))
    benchmark(lambda: (fn(), torch.cuda.synchronize()))


def test_latency_report(tmp_path):
    """The whole report (what the script writes), into $KVQBENCH_LATENCY_OUT or a temp dir."""
    res = main(["--out", os.environ.get("KVQBENCH_LATENCY_OUT", str(tmp_path))])
    assert any("latency_us" in r for r in res["latency"])


if __name__ == "__main__":
    main(sys.argv[1:])
