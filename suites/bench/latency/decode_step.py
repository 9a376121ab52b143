"""The decode-step latency section: every method at every (B, T) of the config.

Each row carries the bytes the method must read at least (packed K+V cache and
lookup tables, or fp16 K+V; plus q and the output), the achieved GB/s on those
bytes and its fraction of the copy bandwidth measured in the same run.
Fake-quant is charged only the packed bytes it starts from (its real traffic is
far larger). At B=1, T=t0 (the encoded cache itself, untiled) each fused row
also carries its relative error against the fp32 reference attention over the
quantizer's own decode of that cache.
"""
from __future__ import annotations

import time

import torch

from ....kernels.decode_attention import reference_decode_attention
from .caches import EncodedCache, tiled
from .config import DEFAULT_LAUNCH, LatencyConfig
from .methods import fake_quant_callable, fused_callable, sdpa_callable
from .timing import DEVICE, GPU, LAUNCH_ERRORS, describe_error, timeit_us
from .tuning import greedy_tune, launch_stages


class _Rows:
    """The rows of one (B, T): measured, skipped or failed, each logged once."""

    def __init__(self, cfg: LatencyConfig, B: int, T: int, copy_GBps: float, rows: list, log):
        self.cfg, self.B, self.T, self.copy_GBps, self.rows, self.log = cfg, B, T, copy_GBps, rows, log

    def measured(self, method: str, t_us: float, nbytes: int, **extra):
        c, gbps = self.cfg, nbytes / t_us / 1e3
        row = {"method": method, "B": self.B, "T": self.T, "Hq": c.hq, "Hkv": c.hkv, "d": c.d, "latency_us": t_us,
               "bytes": nbytes, "GBps": gbps, "frac_copy_bw": gbps / self.copy_GBps, **extra}
        self.rows.append(row)
        self.log(f"B={self.B:3d} T={self.T:7d} {method:17s} {t_us:10.1f} us {gbps:8.1f} GB/s "
                 f"{row['frac_copy_bw']:.2f} of copy  {extra.get('note', '')}")

    def skipped(self, method: str, why: str):
        self.rows.append({"method": method, "B": self.B, "T": self.T, "skipped": why})

    def failed(self, method: str, e: BaseException):
        self.rows.append({"method": method, "B": self.B, "T": self.T, "error": describe_error(e)})
        self.log(f"{method} B={self.B} T={self.T}: ERROR {describe_error(e, 200)}")


def _fp16_sdpa(cfg: LatencyConfig, q, out: _Rows, qo_bytes: int):
    B, T = out.B, out.T
    kv16 = 2 * B * cfg.hkv * T * cfg.d * 2
    if kv16 > cfg.fp16_max_bytes:
        out.skipped("fp16-sdpa", "fp16 K/V over the memory cap")
        return
    try:
        k16 = torch.randn(B, cfg.hkv, T, cfg.d, device=DEVICE, dtype=torch.float16)
        v16 = torch.randn(B, cfg.hkv, T, cfg.d, device=DEVICE, dtype=torch.float16)
        fn, backend, errs = sdpa_callable(q, k16, v16)
        out.measured("fp16-sdpa", timeit_us(fn), kv16 + qo_bytes, backend=backend,
                     note=f"backend={backend}" + (f" ({'; '.join(errs)})" if errs else ""))
    except LAUNCH_ERRORS as e:
        out.failed("fp16-sdpa", e)
    finally:
        if GPU:
            torch.cuda.empty_cache()


def _reference_error(q, cache: EncodedCache, fn) -> float:
    """Relative error of the fused output against fp32 attention over the quantizer's decode."""
    ref = reference_decode_attention(q, cache.qk.decode(cache.pk), cache.qv.decode(cache.pv))
    got = fn().float()
    return float((got - ref).norm() / ref.norm())


def latency_section(cfg: LatencyConfig, caches: dict[str, EncodedCache], copy_GBps: float, sm_count: int,
                    log, t_start: float) -> tuple[list, dict]:
    """(rows, tuning record {"chosen": {method: config}, "trials": {method: [...]}})."""
    rows, trials, chosen = [], {}, {}
    for B, T in cfg.combos():
        if time.time() - t_start > cfg.budget_s:
            rows.append({"B": B, "T": T, "skipped": "time budget"})
            log(f"B={B} T={T}: skipped (time budget)")
            continue
        out = _Rows(cfg, B, T, copy_GBps, rows, log)
        q = torch.randn(B, cfg.hq, 1, cfg.d, device=DEVICE).half()
        qo_bytes = 2 * q.numel() * 2
        _fp16_sdpa(cfg, q, out, qo_bytes)
        for method, cache in caches.items():
            try:
                kf, vf = tiled(cache, B, T, cfg.t0)
            except ValueError as e:  # this T does not fit the method's tiling
                rows.append({"method": method, "B": B, "T": T, "error": str(e)[:300]})
                continue
            nbytes = kf.read_nbytes + vf.read_nbytes + qo_bytes
            if method == "fake-quant":
                if B * cfg.hkv * T > cfg.fake_max_token_heads:
                    out.skipped(method, "torch decode temporaries too large")
                    continue
                try:
                    out.measured(method, timeit_us(fake_quant_callable(q, cache, kf, vf), rep_ms=50), nbytes,
                                 note=f"{cache.spec}; bytes = packed cache it starts from")
                except LAUNCH_ERRORS as e:
                    out.failed(method, e)
                continue
            try:
                if method not in chosen:
                    if (B, T) == cfg.focus and GPU and cfg.tune:
                        stages = launch_stages(hqmq=hasattr(kf, "with_table"), has_sms=bool(sm_count))
                        chosen[method], trials[method] = greedy_tune(
                            lambda c: timeit_us(fused_callable(q, kf, vf, c)), stages, log, method)
                    else:
                        chosen[method] = dict(DEFAULT_LAUNCH)
                fn = fused_callable(q, kf, vf, chosen[method])
                extra = {"config": chosen[method], "spec": cache.spec,
                         "bits_per_element": 8 * (kf.cache_nbytes + vf.cache_nbytes) / (2 * B * cfg.hkv * T * cfg.d)}
                if (B, T) == (1, cfg.t0):  # a correctness check inside the benchmark
                    extra["rel_err_vs_reference"] = _reference_error(q, cache, fn)
                out.measured(method, timeit_us(fn), nbytes, **extra)
            except LAUNCH_ERRORS as e:
                out.failed(method, e)
            del kf, vf
        if GPU:
            torch.cuda.empty_cache()
    return rows, {"chosen": chosen, "trials": trials}
