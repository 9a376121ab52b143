"""An eager decode step's cache write in ONE CUDA launch per layer (step_write.cu, this folder):
K and V of naive int (per-token groups), fp8 and the engine's fp16 store (and KIVI's window
row and HQMQ, once `VERIFIED` holds them), through ctypes and a plan kept per
pair of stores, instead of two Triton step-encoder launches.

Why: `model.generate` with our cache runs eager decode steps, and on an H100 one layer's
one-token write cost 73-96 us of host time for int4 / fp8 against DynamicCache's 16 (the
two Triton launches, each binding and specialising ~25 arguments: reports/kernels/NOTES.md,
2026-12-06); thirty layers pay it every token. The bytes and the error flags are those of
kernels/step_encode.py's encoders (built with library.py EXACT_FLAGS; GPU tests:
suites/tests/test_cuda_step_write.py compare them bit for bit). Graphed steps keep the
Triton encoders: a CUDA graph replays a launch without its host cost.

`write_pair(k_store, v_store, k, v, errors)` writes and returns True, or returns False (nothing
done: the stores' own step encoders serve the write) when the switch is off, the library is
unavailable, or the stores are not a pair it takes (`why_not`). THE SWITCH `CUDA_WRITE`: on by
default since its GPU tests passed (H100, 2026-12-06: test_cuda_step_write.py, and the step,
cache, generate and graph suites with it on); `KVQBENCH_CUDA_WRITE=0` turns it off for a process.
Measured there (reports/latency/host_write_h100_2026-12-06b.txt, one layer's write, T = 4096):
int4 69 -> 21 us, fp8 52-56 -> 19, fp16 47-48 -> 19-22, DynamicCache 15-17; eager
`generate` of SmolLM2-135M's shape at batch 1 went from 0.66-0.88x DynamicCache to 0.83-1.05x
(int4, four runs; reports/generate/h100/generate_eager_cuda_write_2026-12-06/).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from ...quantizers import get_quantizer
from ...quantizers.derived import identity
from .. import registry
from ..formats import fp8 as fp8_format, fp16 as fp16_format, hqmq as hqmq_format, kivi as kivi_format
from ..formats import naive_int as int_format
from ..common import PlanCache
from ..formats.kivi import KIVIStore
from ..store import KernelStore
from .launch import on_current_stream
from .library import EXACT_FLAGS, KernelLibrary, Switch

SOURCE = Path(__file__).parent / "step_write.cu"
_XTYPE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_FP8_KIND = {"e4m3": 1, "e5m2": 2}
LL, P = ctypes.c_longlong, ctypes.c_void_p


class _Role(ctypes.Structure):  # WriteRole in the .cu, field by field
    _fields_ = [("c", P), ("s", P), ("z", P), ("hs", P), ("err", P), ("cb", LL), ("ch", LL), ("ct", LL),
                ("sb", LL), ("sh", LL), ("st", LL), ("xb", LL), ("xh", LL),
                ("rad", P), ("rmax", P), ("sec", P), ("rxb", LL), ("rxh", LL), ("rxt", LL),
                ("mxb", LL), ("mxh", LL), ("mxt", LL), ("S", LL), ("cbits", LL), ("rbits", LL),
                ("flags", P), ("outl", P), ("olen", P), ("oidx", P), ("fxb", LL), ("fxh", LL), ("fxt", LL),
                ("oxb", LL), ("oxh", LL), ("ixb", LL), ("ixh", LL), ("med3", LL), ("C", ctypes.c_float),
                ("pad_", ctypes.c_int)]


class _Plan(ctypes.Structure):  # WritePlan in the .cu
    _fields_ = [("kind", LL), ("xtype", LL), ("B", LL), ("H", LL), ("D", LL), ("bits", LL), ("G", LL),
                ("role", _Role * 2)]


def _declare(lib) -> str | None:
    lib.kvq_write_plan_size.restype = ctypes.c_int
    if lib.kvq_write_plan_size() != ctypes.sizeof(_Plan):  # out of step with the .cu: refuse, never misread
        return f"WritePlan is {lib.kvq_write_plan_size()} bytes in the library, _Plan {ctypes.sizeof(_Plan)}"
    lib.kvq_write_max_d.restype = ctypes.c_int
    lib.kvq_write_pair.argtypes = [P, P, P] + [ctypes.c_int] * 6 + [P]
    lib.kvq_write_pair.restype = ctypes.c_int
    return None


_LIB = KernelLibrary(SOURCE, "kvq_step_write", _declare, base=EXACT_FLAGS)
LAUNCHES = [0]  # writes launched (step_encode.LAUNCHES counts the Triton ones; write_cost adds both)
_PLANS = PlanCache(256)  # a pair per layer: 256 holds the largest models' layers


CUDA_WRITE = Switch(os.environ.get("KVQBENCH_CUDA_WRITE", "1").strip() != "0")  # THE SWITCH (module docstring)


def why_unavailable() -> str | None:
    """None when the library is built and loadable here, else the reason (builds it at the first call)."""
    return _LIB.why_unavailable()


# The kinds of store pair the write takes, and (VERIFIED) those it takes by default: a kind
# joins VERIFIED once its GPU tests (suites/tests/test_cuda_step_write.py) passed. KIVI's window
# row is the fp16 kind into the window buffer; its store's bookkeeping (the flush every G
# steps, a Triton int launch) is KIVIStore.end_write's. HQMQ (`_hqmq_kernel` of one token, one
# warp per row: the search per chunk; Med3x its median, flags and list appends; log-spaced
# radius levels and mixed-radix code rows keep the Triton encoder). Both joined on 2026-12-06
# once their GPU tests passed on an H100 (reports/latency/README.md lists the logs).
KINDS = ("int", "fp8", "fp16", "kivi", "hqmq")
VERIFIED = {"int", "fp8", "fp16", "kivi", "hqmq"}


_KIND_OF_FORMAT = {int_format.FORMAT: "int", fp8_format.FORMAT: "fp8", fp16_format.FORMAT: "fp16",
                   kivi_format.FORMAT: "kivi", hqmq_format.FORMAT: "hqmq"}
MAX_S = 256  # HQMQ secondaries the .cu's search holds in shared memory


def _kind(store) -> str | None:
    """The kind of a store this write takes (KINDS), None for any other: a store of one of
    these formats, of the format's own store class (a subclass has its own append rule), with
    a step encoder (none: the old path serves its writes)."""
    fmt = store.format
    if store.stepper is None or type(store) is not (fmt.store or KernelStore):
        return None
    return _KIND_OF_FORMAT.get(fmt)


def _cu_kind(store) -> int:
    """The .cu's format kind: 0 int, 1 / 2 fp8 e4m3 / e5m2, 3 fp16 (values, or a KIVI window), 4 HQMQ."""
    kind = _kind(store)
    return {"int": 0, "fp8": _FP8_KIND.get(getattr(store.flat, "fmt", None), -1), "hqmq": 4}.get(kind, 3)


def takes(spec: str) -> bool:
    """Whether the write takes caches of this quantizer spec by default (one-token writes on
    a CUDA device, head_dim <= 256, as `why_not` checks per write)."""
    q = get_quantizer(spec)
    fmt = registry.format_of_quantizer(type(q))
    if fmt is None or fmt.quantizer is not type(q):
        return False
    kind = _KIND_OF_FORMAT.get(fmt)
    if kind == "hqmq":
        return kind in VERIFIED and _hqmq_reason(q.config.S, q.config.radius == "log", q.config.pack) is None
    return kind in VERIFIED and not (kind == "int" and q.per_channel)


def _hqmq_reason(S: int, log_radius: bool, pack: str) -> str | None:
    """Why the HQMQ write does not take a config (None: it does)."""
    if log_radius:
        return "HQMQ with log-spaced radius levels"
    if pack == "mixed":
        return "HQMQ with mixed-radix code rows"
    if S > MAX_S:
        return f"HQMQ with S={S} > {MAX_S} secondaries"
    return None


def why_not(k_store, v_store, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why `write_pair` does not take this write (None: it does, the switch and library aside)."""
    kind = _kind(k_store)
    if kind is None or _kind(v_store) != kind:
        return "not a pair of naive int (per-token groups), fp8, fp16, KIVI or HQMQ stores"
    if kind not in VERIFIED:
        return f"the {kind} write is not verified on a GPU yet (step_write.VERIFIED)"
    if k.device.type != "cuda" or v.device != k.device:
        return "not on a CUDA device"
    if k.shape[2] != 1 or v.shape != k.shape:
        return "not a one-token write of K and V of one shape"
    if k.dtype not in _XTYPE or v.dtype != k.dtype:
        return f"input dtype {k.dtype}/{v.dtype}"
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        return "the head dim is not contiguous"
    if k.shape[3] > 256:
        return f"head_dim {k.shape[3]} > 256"
    if kind == "int" and (k_store.flat.group != v_store.flat.group or k_store.flat.bits != v_store.flat.bits
                          or k.shape[3] % k_store.flat.group):
        return "K and V int groups differ or do not divide the head dim"
    if kind == "fp8" and _cu_kind(k_store) != _cu_kind(v_store):
        return "K and V fp8 formats differ"
    if kind == "hqmq":
        if k_store.stepper.med3 != v_store.stepper.med3:
            return "Med3x on one side only"
        for store in (k_store, v_store):
            f = store.flat
            why = _hqmq_reason(f.S, f.log_radius, f.code_pack)
            if why:
                return why
            if store.stepper.med3 and (f.outliers is None or f.outliers.stride()[-2:] != (4, 1)):
                return "HQMQ + Med3x outlier lists not made yet, or their entries not contiguous"
            if k.shape[3] % 4 or f.code_layout[0] != 1 or f.code_bits > 16 or f.r_bits > 8:
                return f"HQMQ code rows of {f.code_bits} bits / radius {f.r_bits} bits at head_dim {k.shape[3]}"
            sec = f.sec
            if sec is None or sec.dtype != torch.float32 or not sec.is_contiguous() or sec.data_ptr() % 16:
                return "HQMQ secondaries not a contiguous, 16-byte aligned fp32 [H, S, 4] tensor"
    return None


def _tensors(store) -> tuple:
    """The tensors a store's plan points into: its token buffers (KIVI: the window; HQMQ: its
    code, radius and r_max rows and its secondaries)."""
    if type(store) is KIVIStore:
        return (store.buffers["residual"].buf,)
    f = store.flat
    if _kind(store) == "hqmq":  # (+ Med3x: its flag rows, lists, their lengths and block starts)
        med3 = (f.flags, f.outliers, store.outlier_len, f.outlier_index) if store.stepper.med3 else ()
        return (f.codes, f.radius, f.r_max, f.sec) + med3
    return tuple(getattr(f, n) for n in ("values", "codes", "scale", "zero") if hasattr(f, n))


def _role(store, x: torch.Tensor, err: torch.Tensor) -> _Role:
    f, r, kind = store.flat, _Role(), _kind(store)
    c = _tensors(store)[0]  # fp16 values, a KIVI window or codes
    r.c, (r.cb, r.ch, r.ct) = c.data_ptr(), c.stride()[:3]
    if kind == "int":
        r.s, r.z, (r.sb, r.sh, r.st) = f.scale.data_ptr(), f.zero.data_ptr(), f.scale.stride()[:3]
    elif kind == "fp8":
        r.hs = f.scale.data_ptr()  # fp32 [H], as the Triton encoder reads it
    elif kind == "hqmq":
        r.rad, (r.rxb, r.rxh, r.rxt) = f.radius.data_ptr(), f.radius.stride()[:3]
        r.rmax, (r.mxb, r.mxh, r.mxt) = f.r_max.data_ptr(), f.r_max.stride()[:3]
        r.sec, r.S, r.cbits, r.rbits = f.sec.data_ptr(), f.S, f.code_bits, f.r_bits
        if store.stepper.med3:
            r.med3, r.C = 1, store.stepper.config.C
            r.flags, (r.fxb, r.fxh, r.fxt) = f.flags.data_ptr(), f.flags.stride()[:3]
            r.outl, (r.oxb, r.oxh) = f.outliers.data_ptr(), f.outliers.stride()[:2]
            r.olen = store.outlier_len.data_ptr()
            r.oidx, (r.ixb, r.ixh) = f.outlier_index.data_ptr(), f.outlier_index.stride()[:2]
    r.err, (r.xb, r.xh) = err.data_ptr(), x.stride()[:2]
    return r


def _plan(k_store, v_store, k, v, errors) -> _Plan:
    ts = _tensors(k_store) + _tensors(v_store) + (errors.flags,)
    key = (tuple(map(identity, ts)), k.dtype, k.shape, k.stride(), v.stride())
    plan = _PLANS.get(key)
    if plan is None:
        f = k_store.flat
        int_kind = _kind(k_store) == "int"
        plan = _Plan(kind=_cu_kind(k_store), xtype=_XTYPE[k.dtype], B=k.shape[0], H=k.shape[1], D=k.shape[3],
                     bits=f.bits if int_kind else 0, G=f.group if int_kind else 1)
        plan.role[0], plan.role[1] = _role(k_store, k, errors.rows[0]), _role(v_store, v, errors.rows[1])
        _PLANS.put(key, ts, plan)
    return plan


def _launch(k_store, v_store, k, v, errors, rows: tuple[int, int], tokens: tuple[int, int],
            blocks: tuple[int | None, int | None]) -> None:
    """The one launch: k, v into rows `rows` of the stores' token axes (KIVI: window rows),
    flagged as `tokens`; `blocks`: HQMQ + Med3x's outlier-index block each token opens (None:
    none). (A CPU test replaces it by the Triton encoders to check the stores' bookkeeping
    around it: suites/tests/test_cuda_step_write.py.)"""
    plan = _plan(k_store, v_store, k, v, errors)  # (after begin_write: a buffer that grew is a new plan)
    err = on_current_stream(k.get_device(), _LIB.lib.kvq_write_pair, ctypes.addressof(plan), k.data_ptr(),
                            v.data_ptr(), *rows, *tokens, *(-1 if b is None else b for b in blocks))
    if err:
        raise RuntimeError(f"CUDA cache write launch failed: error {err}")


def write_pair(k_store, v_store, k: torch.Tensor, v: torch.Tensor, errors) -> bool:
    """The one-token write k, v `[B, H, 1, D]` into the stores in one launch (`errors`: the
    layer's `StepErrors`, whose rows take their input errors as the step encoders' do);
    False (nothing done) when the switch is off, the library unavailable or `why_not` gives
    a reason. Each store's `begin_write` makes the room (the row written: KIVI's in its
    window) before the launch, its `end_write` the bookkeeping after (KIVI's flush)."""
    if not CUDA_WRITE.on or why_not(k_store, v_store, k, v) is not None or _LIB.load() is None:
        return False
    rk, kw_k = k_store.begin_write(1)
    rv, kw_v = v_store.begin_write(1)
    tk, tv = k_store.tokens, v_store.tokens
    _launch(k_store, v_store, k, v, errors, (rk, rv), (tk, tv), (kw_k.get("index_block"), kw_v.get("index_block")))
    LAUNCHES[0] += 1
    k_store.end_write(tk + 1, errors.rows[0])
    v_store.end_write(tv + 1, errors.rows[1])
    return True


__all__ = ["CUDA_WRITE", "KINDS", "VERIFIED", "SOURCE", "takes", "why_not", "why_unavailable", "write_pair"]
