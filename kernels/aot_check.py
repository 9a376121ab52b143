"""Compile the fused kernels for a GPU target WITHOUT a GPU, and report resources.

    python -m kvqbench.kernels.aot_check            # sm_90 (H100/H200)
    python -m kvqbench.kernels.aot_check --dense-steps   # the dense step kernels (CI runs this)

Runs the real host wrappers on CPU tensors with the launches recorded instead of run
(kernels/triton/common.py's `launch_hook`), then
`triton.compile`s each captured launch for the target and prints registers,
spills and shared memory (from the cubin metadata). Catches compile errors and
register spills before any device time is spent. Needs TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_DT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64", torch.uint8: "u8",
       torch.int32: "i32", torch.int64: "i64", torch.int16: "i16"}


class _Capture:
    """The launches of one kernel (grid, args, keyword args), recorded instead of run."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []


def _signature(fn, args, kw):
    names = fn.arg_names
    sig, const = {}, {}
    vals = dict(zip(names, args))
    opts = {}
    for k, v in kw.items():
        if k in ("num_warps", "num_stages"):
            opts[k] = v
        else:
            vals[k] = v
    for i, name in enumerate(names):
        p = fn.params[i]
        v = vals[name] if name in vals else p.default  # a constexpr left at its default
        if p.is_constexpr:
            sig[name] = "constexpr"
            const[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _DT[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int) and v == 1:  # the JIT specialises ints equal to 1 as constants
            sig[name] = "constexpr"
            const[name] = 1
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(v)}")
    return sig, const, opts


def compile_captured(cap: _Capture, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = []
    for grid, args, kw in cap.calls:
        sig, const, opts = _signature(cap.fn, args, kw)
        # what the JIT's specialisation assumes at a real launch: 16-byte aligned
        # pointers and the ints that are multiples of 16 (vectorisation depends on it)
        vals = dict(zip(cap.fn.arg_names, args))
        vals.update(kw)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(cap.fn.arg_names)
                 if sig[n] != "constexpr" and (sig[n].startswith("*") or
                                                (isinstance(vals[n], int) and not isinstance(vals[n], bool)
                                                 and vals[n] % 16 == 0))}
        src = ASTSource(cap.fn, sig, const, attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        md = k.metadata
        n_regs = getattr(k, "n_regs", None)
        n_spills = getattr(k, "n_spills", None)
        if n_regs is None:  # registers come from the cubin; parse ptxas-free via cuobjdump-less route
            try:
                k._init_handles()
                n_regs, n_spills = k.n_regs, k.n_spills
            except Exception:  # noqa: BLE001 - no driver here
                pass
        out.append({"kernel": cap.fn.__name__, "grid": grid, "opts": opts,
                    "shared": getattr(md, "shared", None), "regs": n_regs, "spills": n_spills,
                    "asm": k.asm})
    return out


def cuobjdump() -> str:
    """The cuobjdump that ships inside Triton's package (no CUDA toolkit needed);
    FileNotFoundError naming the path where the package has none."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise FileNotFoundError(f"no cuobjdump in Triton's package ({tool})")
    return tool


def cubin_resources(cubin: bytes) -> str:
    """Registers, spills (stack/local) and shared memory, read from the cubin with
    the cuobjdump that ships inside Triton's package."""
    import subprocess
    import tempfile

    tool = cuobjdump()
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        open(f, "wb").write(cubin)
        r = subprocess.run([tool, "-res-usage", f], capture_output=True, text=True)
        return " ".join(ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "REG" in ln)


def dense_step_captures(head_dims=(64, 128), dtypes=(torch.float16, torch.bfloat16)) -> dict:
    """The dense step kernels' launches (kernels/spherical_step.py, vq_step.py) for every
    default spec they serve (suites/compare/run.py default_specs: a new plugin's examples
    too), at each head dim, as a cache makes them: a multi-token write (a prefill) and a
    one-token step at a device position into the decoded history, fp16 and bf16 tokens.
    Keyed by (spec, role, head_dim, dtype, kernel). Recorded, not run (no GPU needed)."""
    from ..quantizers import get_quantizer
    from ..suites.compare.run import default_specs
    from ..suites.harness import dense_steps
    from . import step_encode

    caps: dict = {}
    key = [None]

    def record(kernel, grid, *args, **kw):
        caps.setdefault(key[0] + (kernel.__name__,), _Capture(kernel)).calls.append((grid, args, kw))

    step_encode.launch_hook = record
    try:
        for spec in default_specs():
            for role in ("K", "V"):
                q = get_quantizer(spec, role=role, layer=1, seed=3)
                if q.name not in dense_steps.KERNELS:
                    continue
                module, tables_cls = dense_steps.KERNELS[q.name]
                for d in head_dims:
                    if module.unsupported(q, d) is not None:
                        continue
                    g = torch.Generator().manual_seed(0)
                    if getattr(q, "needs_calibration", False):
                        q.load_calibration(q.calibrate(torch.randn(2, 2, 64, d, generator=g)))
                    for dtype in dtypes:
                        key[0] = (spec, role, d, str(dtype).split(".")[-1])
                        x = torch.randn(2, 2, 16, d, generator=g).to(dtype)
                        shared = q.fitted_shared(x)
                        module.encode_tokens(q, x, shared)  # the prefill's write
                        tables = tables_cls(q, shared, d, 2, x.device)  # a graphed step's write
                        fields = {n: torch.empty((20, 2, 2, 1) + tail, dtype=dt)
                                  for n, (tail, dt) in tables.field_shapes.items()}
                        step_encode.TablesStep(tables, 2, fields, torch.zeros(2, dtype=torch.int32))(
                            x[:, :, :1], torch.zeros(1, dtype=torch.int32), 0, torch.empty(2, 2, 20, d, dtype=dtype))
    finally:
        step_encode.launch_hook = None
    return caps


def check_dense_steps(arch: int, head_dims=(64, 128), dtypes=(torch.float16, torch.bfloat16)) -> int:
    """Compile every distinct dense step kernel variant for sm_<arch>; print one line each;
    the number that failed. A construct the interpreter takes and the compiler does not (a
    loop-carried int as a static_range bound cost a GPU session) fails here, on a CPU."""
    failures, seen = 0, set()
    for (spec, role, d, dtype, name), cap in dense_step_captures(head_dims, dtypes).items():
        for grid, args, kw in cap.calls:
            sig, const, opts = _signature(cap.fn, args, kw)
            variant = (name, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in const.items())))
            if variant in seen:
                continue
            seen.add(variant)
            one = _Capture(cap.fn)
            one.calls = [(grid, args, kw)]
            where = f"{name} {spec} {role} d={d} {dtype} DEVPOS={const.get('DEVPOS')}"
            try:
                res = compile_captured(one, arch)[0]
                print(f"OK   {where} | {cubin_resources(res['asm']['cubin'])}", flush=True)
            except Exception as e:  # noqa: BLE001 - reported, counted
                failures += 1
                cause = e
                while cause.__cause__ is not None:  # the innermost: where in the jitted helper
                    cause = cause.__cause__
                print(f"FAIL {where}: {type(e).__name__}: {str(cause)[-1500:]}", flush=True)
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sass", default="", help="write the cubin of the first kernel matching --sass-kernel here")
    ap.add_argument("--sass-kernel", default="_hqmq_split_kernel")
    ap.add_argument("--extra", nargs="*", default=[], help="more BT:warps configs")
    ap.add_argument("--only", default="", help="specs containing this")
    ap.add_argument("--extra-only", action="store_true")
    ap.add_argument("--T", type=int, default=256, help="cache length of the captured launches")
    ap.add_argument("--dense-steps", action="store_true",
                    help="compile the dense step kernels (spherical, additive / flat VQ) of every default spec instead")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="with --dense-steps")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], help="with --dense-steps")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter does not compile")
    if a.dense_steps:
        sys.exit(1 if check_dense_steps(a.arch, a.head_dims, [getattr(torch, t) for t in a.dtypes]) else 0)
    from ..quantizers import get_quantizer
    from . import common
    from .decode_attention import decode_attention
    from .hqmq_encode import hqmq_search
    from .layout import flatten
    from .triton import common as triton_common

    caps: dict[str, _Capture] = {}

    def record(kernel, grid, args, kw):  # the Triton launches' public hook: recorded, not run
        caps.setdefault(kernel.__name__, _Capture(kernel)).calls.append((grid, args, kw))

    triton_common.launch_hook = record
    common.ASSUMED_SM_COUNT = 132  # an H100/H200's split plan, without one
    B, Hq, Hkv, T, d = 1, 32, 8, a.T, a.d
    x = torch.randn(B, Hkv, T, d)
    x[..., 3] *= 25
    q = torch.randn(B, Hq, 1, d).half()
    cfgs = ([] if a.extra_only else [dict(block_t=64, num_warps=4), dict(block_t=128, num_warps=8)]) + \
        [dict(block_t=int(c.split(":")[0]), num_warps=int(c.split(":")[1]),
              **dict(kv.split("=") for kv in c.split(":")[2:])) for c in a.extra]
    for c in cfgs:  # extra keywords as BT:warps:key=value (ints or booleans)
        for key, val in list(c.items()):
            if isinstance(val, str):
                c[key] = {"True": True, "False": False}.get(val, int(val) if val.isdigit() else val)
    for spec in [s for s in ("hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3", "int4", "kivi:bits=4", "kivi:bits=2",
                             "fp8-e4m3") if a.only in s]:
        qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
        kw = {"table_mode": "codebook", "table_dtype": torch.float16} if spec.startswith("hqmq") else {}
        kf, vf = flatten(qk.encode(x.half()), "K", **kw), flatten(qv.encode(x.half()), "V", **kw)
        for cfg in cfgs:
            try:
                decode_attention(q, kf, vf, backend="triton", **cfg)
            except Exception:  # noqa: BLE001 - the view of a never-written output
                pass
    hqmq_search(torch.randn(1, Hkv, 64, 4), torch.randn(Hkv, 96, 4))
    triton_common.launch_hook, common.ASSUMED_SM_COUNT = None, None
    failures = 0
    for n, cap in caps.items():
        seen = set()
        for grid, args, kw in cap.calls:
            sig, const, opts = _signature(cap.fn, args, kw)
            key = (tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in const.items())),
                   tuple(sorted(opts.items())))
            if key in seen:
                continue
            seen.add(key)
            one = _Capture(cap.fn)
            one.calls = [(grid, args, kw)]
            brief = {k: v for k, v in const.items() if k in ("BT", "W", "K_OUT", "K_CW", "G", "D", "BLOCK_N")}
            try:
                res = compile_captured(one, a.arch)[0]
                print(f"OK   {n} {brief} {opts} dyn_shared={res['shared']} | {cubin_resources(res['asm']['cubin'])}", flush=True)
                if a.sass and n == a.sass_kernel and "cubin" in res["asm"]:
                    open(a.sass, "wb").write(res["asm"]["cubin"])
                    a.sass = ""
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"FAIL {n} {brief} {opts}: {type(e).__name__}: {str(e)[:2000]}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
