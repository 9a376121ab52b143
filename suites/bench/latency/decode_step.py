"""The decode-step latency section: every method at every (B, T) of the config.

Rows per (B, T) (methods.py says what each call is): `fp16-sdpa`; per packed format
`fused-<x>` (what ships: decode_attention, backend="auto", defaults; the row records
the backend that ran and why not CUDA), `fused-<x>-triton` (the Triton kernel, the
tuner's config), `fused-<x>-cuda` where the auto route leaves a CUDA kernel unused
(measured by opt-in, or "not run here" with the reason; never a number from another
path); `fake-quant`; `flashinfer-fp16` / `-fp8` (FlashInfer's batch decode over the fp16
row's K/V, where it is installed; skipped with the reason elsewhere). At B=1 and at the
focus shape every timed call is also timed as a CUDA-graph replay (`<row>-graph`; the fp16
baseline too): at B=1 the eager call tracks host time, and issue 28 judges graphed calls
at the focus (`graphed`). At the focus a left-padded batch too (`fused-<x>-padded`, auto
with row_start, and the other backend's `-padded-triton` / `-padded-cuda`: `_padded_rows`).

Each row carries the bytes the method must read at least (the flats' read_nbytes:
packed K+V cache and lookup tables, or fp16 K+V; plus q and the output), the achieved
GB/s on those bytes and its fraction of the copy bandwidth measured in the same run
(run.py adds the speed-up over the same run's fp16 SDPA). Fake-quant is charged only
the packed bytes it starts from (its real traffic is far larger). At B=1, T=t0 (the
encoded cache itself, untiled) each eager fused row also carries its relative error
against the fp32 reference attention over the quantizer's own decode of that cache.
"""
from __future__ import annotations

import time

import torch

from ....kernels.decode_attention import reference_decode_attention
from ..toolkit import (DEVICE, GPU, HOST_US_CALLS, LAUNCH_ERRORS, describe_error, graph_replay, host_us, stepping,
                       timeit_us)
from .caches import EncodedCache, tiled
from .config import DEFAULT_LAUNCH, LatencyConfig
from .methods import (FLASHINFER_PAGE, FLASHINFER_ROWS, auto_backend, cuda_refusal, fake_quant_callable,
                      flashinfer_callable, flashinfer_refusal, fused_callable, padded_starts, run_sdpa, sdpa_callable,
                      shipped_callable)
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
        self.log(f"B={self.B:3d} T={self.T:7d} {method:28s} {t_us:10.1f} us {gbps:8.1f} GB/s "
                 f"{row['frac_copy_bw']:.2f} of copy  {extra.get('note', '')}")

    def skipped(self, method: str, why: str):
        self.rows.append({"method": method, "B": self.B, "T": self.T, "skipped": why})
        self.log(f"{method} B={self.B} T={self.T}: {why}")

    def failed(self, method: str, e: BaseException):
        self.rows.append({"method": method, "B": self.B, "T": self.T, "error": describe_error(e)})
        self.log(f"{method} B={self.B} T={self.T}: ERROR {describe_error(e, 200)}")


def _step_host_us(fn, kf, vf) -> dict:
    """{"host_us_step": issue time per call when each call has another token count
    (toolkit.stepping)} or {"host_us_step_skipped": why}; the flats put back after."""
    try:
        step = stepping(fn, kf, vf)
    except ValueError as e:
        return {"host_us_step_skipped": str(e)}
    try:
        return {"host_us_step": host_us(step, sync=torch.cuda.synchronize, **HOST_US_CALLS)}
    finally:
        step.restore()


# What a timed call can raise and still leave the run going: a launch at a too-large
# shape or config, and (CUDA kernels, graph capture) a RuntimeError from the launch.
ROW_ERRORS = LAUNCH_ERRORS + (RuntimeError, ValueError)
NO_GRAPH = "not run here: CUDA graphs need a CUDA device"


def _timed(out: _Rows, method: str, fn, nbytes: int, extra: dict, graph: bool, check=None, flats=None):
    """The eager row of fn, then (graph) its CUDA-graph replay row; `check` adds fields
    to the eager row from fn (the correctness check). flats: fn's (K, V) kernel caches,
    for the step host time."""
    try:
        row = dict(extra)
        if check:
            row.update(check(fn))
        # the eager call's issue time (host_time.py), at B=1 where it decides the call's time
        # (at larger shapes the GPU time of 15 x 100 calls would cost seconds per row)
        if GPU and out.B == 1 and method.startswith(("fused-", "flashinfer-")):
            row["host_us"] = host_us(fn, sync=torch.cuda.synchronize, **HOST_US_CALLS)
            if flats is not None:  # and as eager decode calls: another token count each call
                row.update(_step_host_us(fn, *flats))
        out.measured(method, timeit_us(fn), nbytes, **row)
    except ROW_ERRORS as e:
        out.failed(method, e)
        return
    if not graph:
        return
    if not GPU:
        out.skipped(f"{method}-graph", NO_GRAPH)
        return
    try:
        out.measured(f"{method}-graph", timeit_us(graph_replay(fn)), nbytes, **extra)
    except ROW_ERRORS as e:
        out.failed(f"{method}-graph", e)


def graphed(cfg: LatencyConfig, B: int, T: int) -> bool:
    """Whether a shape's rows are also timed as CUDA-graph replays: B=1 (where an eager
    call's host time is comparable to its kernel) and the focus (issue 28's targets are
    graphed calls at B=8, T=32k)."""
    return B == 1 or (B, T) == cfg.focus


def _fp16_sdpa(cfg: LatencyConfig, q, out: _Rows, qo_bytes: int):
    """fp16-sdpa, then FlashInfer's rows over the same K/V (`_flashinfer`)."""
    B, T = out.B, out.T
    kv16 = 2 * B * cfg.hkv * T * cfg.d * 2
    if kv16 > cfg.fp16_max_bytes:
        for method in ("fp16-sdpa", *FLASHINFER_ROWS):
            out.skipped(method, "fp16 K/V over the memory cap")
        return
    try:
        k16 = torch.randn(B, cfg.hkv, T, cfg.d, device=DEVICE, dtype=torch.float16)
        v16 = torch.randn(B, cfg.hkv, T, cfg.d, device=DEVICE, dtype=torch.float16)
        fn, backend, errs = sdpa_callable(q, k16, v16)
        _timed(out, "fp16-sdpa", fn, kv16 + qo_bytes, graph=graphed(cfg, B, T),
               extra={"backend": backend, "note": f"backend={backend}" + (f" ({'; '.join(errs)})" if errs else "")})
        _flashinfer(cfg, q, k16, v16, out, kv16, qo_bytes)
    except LAUNCH_ERRORS as e:  # the fp16 K/V themselves
        out.failed("fp16-sdpa", e)
    finally:
        if GPU:
            torch.cuda.empty_cache()


def _flashinfer(cfg: LatencyConfig, q, k16, v16, out: _Rows, kv16: int, qo_bytes: int):
    """FlashInfer's decode over the fp16 row's K/V, as fp16 and as fp8 (methods.py), each
    checked against SDPA over the same values (`rel_err_vs_sdpa`)."""
    why = flashinfer_refusal(out.B, out.T)
    for method, (kv_dtype, tensor_cores) in FLASHINFER_ROWS.items():
        if why:
            out.skipped(method, why)
            continue
        try:
            fn = flashinfer_callable(q, k16, v16, kv_dtype, tensor_cores)
        except ROW_ERRORS as e:  # its JIT build, its plan
            out.failed(method, e)
            continue
        nbytes = kv16 * kv_dtype.itemsize // 2 + qo_bytes

        def check(fn, kv_dtype=kv_dtype):
            ref = run_sdpa(q, k16.to(kv_dtype).half(), v16.to(kv_dtype).half(), "default").float()
            return {"rel_err_vs_sdpa": float((fn().float() - ref).norm() / ref.norm())}
        note = (f"FlashInfer batch decode ({'tensor' if tensor_cores else 'CUDA'}-core kernel), paged {kv_dtype} K/V, "
                f"{FLASHINFER_PAGE}-token pages")
        _timed(out, method, fn, nbytes, {"backend": "flashinfer", "note": note}, graphed(cfg, out.B, out.T), check)


def _reference_error(q, cache: EncodedCache, fn) -> float:
    """Relative error of the fused output against fp32 attention over the quantizer's decode."""
    ref = reference_decode_attention(q, cache.qk.decode(cache.pk), cache.qv.decode(cache.pv))
    got = fn().float()
    return float((got - ref).norm() / ref.norm())


def _same_output(q, kf, vf, backend: str):
    """On a GPU: whether the auto call's output is bit-identical to backend=`backend`'s
    (each kernel is deterministic), so the row's backend is observed, not only inferred."""
    if not GPU:
        return {}
    a, b = shipped_callable(q, kf, vf)().clone(), shipped_callable(q, kf, vf, backend)()
    return {"same_output_as_backend": bool(torch.equal(a, b))}


def _fused_rows(cfg: LatencyConfig, out: _Rows, q, method: str, cache: EncodedCache, kf, vf, nbytes: int,
                tuning: dict, sm_count: int, log):
    """fused-<x> (shipped), fused-<x>-triton (tuned Triton), fused-<x>-cuda (opt-in)."""
    B, T = out.B, out.T
    base = {"spec": cache.spec,
            "bits_per_element": 8 * (kf.cache_nbytes + vf.cache_nbytes) / (2 * B * cfg.hkv * T * cfg.d)}
    graph = graphed(cfg, B, T)
    check = (lambda fn: {"rel_err_vs_reference": _reference_error(q, cache, fn)}) if (B, T) == (1, cfg.t0) else None
    try:
        backend, why = auto_backend(q, kf, vf)
        ship = {**base, "backend": backend, "config": "defaults (backend=auto)",
                **({"why_not_cuda": why} if why else {}), **_same_output(q, kf, vf, backend)}
    except ROW_ERRORS as e:
        out.failed(method, e)
        return
    _timed(out, method, shipped_callable(q, kf, vf), nbytes, ship, graph, check, flats=(kf, vf))
    if (B, T) == cfg.focus:
        _padded_rows(out, q, method, kf, vf, nbytes, base)

    tri = f"{method}-triton"
    chosen, trials = tuning["chosen"], tuning["trials"]
    if tri not in chosen:
        if (B, T) == cfg.focus and GPU and cfg.tune:
            stages = launch_stages(hqmq=hasattr(kf, "with_table"), has_sms=bool(sm_count))
            try:
                chosen[tri], trials[tri] = greedy_tune(lambda c: timeit_us(fused_callable(q, kf, vf, c)),
                                                       stages, log, tri)
            except ROW_ERRORS as e:
                out.failed(tri, e)
                return
        else:
            chosen[tri] = dict(DEFAULT_LAUNCH)
    _timed(out, tri, fused_callable(q, kf, vf, chosen[tri]), nbytes,
           {**base, "backend": "triton", "config": chosen[tri]}, graph, check)

    if backend == "cuda":  # the shipped row is the CUDA kernel already
        return
    why_cuda = cuda_refusal(q, kf, vf)
    if why_cuda:
        out.skipped(f"{method}-cuda", f"not run here: {why_cuda}")
        return
    _timed(out, f"{method}-cuda", shipped_callable(q, kf, vf, "cuda"), nbytes,
           {**base, "backend": "cuda", "config": "defaults (backend=cuda)",
            "note": f"opt-in, not what auto runs: {why}"}, graph, check, flats=(kf, vf))


def _padded_rows(out: _Rows, q, method: str, kf, vf, nbytes: int, base: dict):
    """At the focus shape, a left-padded batch (`padded_starts`: what prompts of different
    lengths give): fused-<x>-padded, the shipped call with row_start (the backend auto takes
    and why not CUDA), then the other backend's call with the same starts
    (`-padded-triton`, or `-padded-cuda` by opt-in), eager and graphed. bytes: the whole cache
    (the kernels skip the tiles wholly below a row's first key, so they read fewer)."""
    rs = padded_starts(out.B, out.T, q.device)
    pads = int(rs.sum())
    extra = {**base, "pad_fraction": pads / (out.B * out.T),
             "note": f"left-padded batch: row b's keys from b T / 32 on; {pads} pad tokens"}
    try:
        backend, why = auto_backend(q, kf, vf, rs)
    except ROW_ERRORS as e:
        out.failed(f"{method}-padded", e)
        return
    ship = {**extra, "backend": backend, "config": "defaults (backend=auto), row_start",
            **({"why_not_cuda": why} if why else {})}
    _timed(out, f"{method}-padded", shipped_callable(q, kf, vf, row_start=rs), nbytes, ship, True)
    other = "triton" if backend == "cuda" else "cuda"
    refusal = cuda_refusal(q, kf, vf) if other == "cuda" else None
    if refusal:
        out.skipped(f"{method}-padded-cuda", f"not run here: {refusal}")
        return
    _timed(out, f"{method}-padded-{other}", shipped_callable(q, kf, vf, other, row_start=rs), nbytes,
           {**extra, "backend": other, "config": f"defaults (backend={other}), row_start"}, True)


def latency_section(cfg: LatencyConfig, caches: dict[str, EncodedCache], copy_GBps: float, sm_count: int,
                    log, t_start: float) -> tuple[list, dict]:
    """(rows, tuning record {"chosen": {row: config}, "trials": {row: [...]}}) of the Triton rows."""
    rows, tuning = [], {"chosen": {}, "trials": {}}
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
                kf, vf = tiled(cache, B, T)
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
            _fused_rows(cfg, out, q, method, cache, kf, vf, nbytes, tuning, sm_count, log)
            del kf, vf
        if GPU:
            torch.cuda.empty_cache()
    return rows, tuning
