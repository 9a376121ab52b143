"""What test_cuda_decode.py and test_cuda_hqmq.py share: the synthetic caches, the
backend="cuda" call checked against the dequantize-then-attend reference, garbage
capacity rows, and the last-token and graph-replay checks both kernels go through; and
what the bit-for-bit tests of two launch paths share (test_cuda_fused_combine.py,
test_cuda_pdl.py).
Tolerances as test_kernels.py's GPU ones (fp16 operands, fp32 accumulation)."""
from __future__ import annotations

import functools
import threading

import torch

from kvqbench.kernels import layout as L
from kvqbench.quantizers import get_quantizer

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 3e-3}


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make(B, Hkv, T, D, seed, dtype=torch.float16, outlier=True):
    """A random [B, Hkv, T, D] cache on DEV; outlier: three channels x 25."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, Hkv, T, D, generator=g)
    if outlier:
        for c in (3, D // 2 + 1, D - 2):
            x[..., c] *= 25.0
    return x.to(dtype).to(DEV)


def build(spec, k, v, vspec=None):
    """(K quantizer, K encoding, V quantizer, V encoding); vspec: another V quantizer."""
    qk, qv = get_quantizer(spec, role="K", seed=3), get_quantizer(vspec or spec, role="V", seed=3)
    return qk, qk.encode(k), qv, qv.encode(v)


def flats(spec, k, v):
    """The K and V flats of spec's encodings of k, v."""
    _, pk, _, pv = build(spec, k, v)
    return L.flatten(pk, "K"), L.flatten(pv, "V")


def attend(q, k, v, **kw):
    from kvqbench.kernels.decode_attention import decode_attention

    return decode_attention(q, k, v, backend="cuda", out_dtype=torch.float32, **kw)


def checked_call(spec, q, k, v, vspec=None, **kw):
    """(out, reference, (K flat, V flat)) of backend="cuda" on spec's encodings of k, v;
    asserts a finite output within TOL[q.dtype] of the reference."""
    from kvqbench.kernels.decode_attention import reference_decode_attention

    qk, pk, qv, pv = build(spec, k, v, vspec)
    kf, vf = L.flatten(pk, "K"), L.flatten(pv, "V")
    out = attend(q, kf, vf, **kw)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[q.dtype], (f"{spec}/{vspec or spec} B={k.shape[0]} T={k.shape[2]} {q.dtype} {kw}: "
                                f"relative error {err:.3g}")
    return out, ref, (kf, vf)


def with_junk(t, n, g):
    """t with n more rows (dim 2) of garbage from generator g, inf and NaN included: a
    kernel that reads past the valid rows produces non-finite output."""
    pad = t.shape[:2] + (n,) + t.shape[3:]
    if t.dtype.is_floating_point:
        junk = (torch.randn(pad, generator=g) * 1e4).to(t.dtype)
        junk.view(-1)[::7] = float("nan")
        junk.view(-1)[::11] = float("inf")
    else:
        junk = torch.randint(0, 256, pad, generator=g).to(t.dtype)
    return torch.cat([t, junk.to(t.device)], dim=2)


def check_last_token(run, role, T, v_outlier=False, v_gain=-8.0, D=128):
    """Change only the last key (aligned with every query of its head: it takes the
    softmax) or value (x v_gain) of a [1, 8, T, D] cache; run(q, k, v) -> (out, ref) for
    32 query heads, on the cache and on the changed one: the kernel's change must follow
    the reference's."""
    B, Hq, Hkv = 1, 32, 8
    k, v = make(B, Hkv, T, D, 1), make(B, Hkv, T, D, 2, outlier=v_outlier)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(3)).half().to(DEV)
    k2, v2 = k.clone(), v.clone()
    if role == "K":
        k2[:, :, -1] = (q.float().view(B, Hkv, Hq // Hkv, D).sum(2) * 0.5).half()
    else:
        v2[:, :, -1] = (v_gain * v[:, :, -1].float()).half()
    (o1, r1), (o2, r2) = (run(q, kk, vv) for kk, vv in ((k, v), (k2, v2)))
    # (a fixed floor on the change alone failed for KIVI-2 keys at T = 4096 in H200 run 16:
    # one key of 4096 moves little)
    assert rel_err(r2, r1) > 1e-4, "the modification does not reach the reference output"
    assert rel_err(o2 - o1, r2 - r1) < 0.5, "the kernel does not follow the last token's change"


def auto_case(q_dtype):
    """(q, k, v) of the backend="auto" / Triton agreement tests: B=2, 32 query heads over
    8 kv heads, T = 2049, d 128."""
    B, Hq, Hkv, T, D = 2, 32, 8, 2049, 128
    k, v = make(B, Hkv, T, D, 11), make(B, Hkv, T, D, 12, outlier=False)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(13)).to(q_dtype).to(DEV)
    return q, k, v


def warmed_capture(fn):
    """(graph, fn's output inside it): fn run once on a side stream first (builds, plans and
    cached tables made outside the capture), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_graph_replay(spec, **kw):
    """GraphedDecode (captured once) gives decode_attention's bytes for each new q."""
    from kvqbench.kernels.decode_attention import decode_attention
    from kvqbench.kernels.graphs import GraphedDecode

    B, Hq, Hkv, T, D = 1, 32, 8, 3000, 128
    kf, vf = flats(spec, make(B, Hkv, T, D, 21), make(B, Hkv, T, D, 22))
    q0 = torch.randn(B, Hq, 1, D, device=DEV).half()
    step = GraphedDecode(kf, vf, q0, out_dtype=torch.float32, **kw)
    for s in range(2):
        q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(s)).half().to(DEV)
        assert torch.equal(step(q), decode_attention(q, kf, vf, out_dtype=torch.float32, **kw))


def raised_by_later_steps(step, match: str) -> int:
    """A deferred input error must be raised by the polls of the steps that follow: on a
    CPU the very next step (the flags are read in place); on CUDA a poll every
    `StepErrors.POLL_EVERY` steps reads the copy the previous poll started, so within
    2 x POLL_EVERY steps. `step()` runs one clean step; returns how many it took."""
    import pytest

    from kvqbench.kernels.step_encode import StepErrors
    from kvqbench.quantizers import QuantizerInputError

    limit = 2 * StepErrors.POLL_EVERY if CUDA else 1
    with pytest.raises(QuantizerInputError, match=match):
        for n in range(1, limit + 1):
            step()
    return n


def in_threads(fn, n: int = 2) -> None:
    """fn(0) ... fn(n - 1) in n threads at once, joined (calls racing on one stream)."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- bit-for-bit comparisons of two launch paths (the fused combine, PDL) -----------------
def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included: a valid length of 0 gives NaN for int4 / fp8 / KIVI)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def small_flats(spec, B=1, T=128, H=2, d=64, t0=None):
    """(K flat, V flat) of spec on DEV: the benchmarks' encoding of t0 synthetic tokens (KIVI
    256, else 64) tiled to T (toolkit.kernel_flats; T a multiple of t0)."""
    from kvqbench.suites.bench.toolkit import kernel_flats

    return kernel_flats(spec, B, T, H, d, t0 or (256 if spec.startswith("kivi") else 64), DEV)


@functools.lru_cache(maxsize=32)
def case_flats(spec, B, Hkv, T, D, seed=0):
    """(K flat, V flat) of spec's encodings of make()'s random caches (cached)."""
    return flats(spec, make(B, Hkv, T, D, seed), make(B, Hkv, T, D, seed + 1, outlier="med3" in spec))


def query(B, Hq, D, seed, dtype=torch.float16):
    return torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def vlen(n):
    return torch.tensor([n], dtype=torch.int32, device=DEV)


def kivi_views(spec, T, cap, D, seed):
    """(q, K / V graph views at capacity cap) of a QuantizedCache of spec holding T tokens
    (as test_cuda_decode.py's KIVI device-count tests make them)."""
    from kvqbench.suites.harness.kv_cache import QuantizedCache

    cache = QuantizedCache(spec, n_layers=1, fused=True, seed=3)
    cache.update(make(2, 2, T, D, seed), make(2, 2, T, D, seed + 1, outlier=False), 0)
    cache.reserve(cap)
    layer = cache.layers[0]
    return query(2, 8, D, seed + 2), tuple(layer.stores[r].graph_view(cap) for r in ("K", "V"))


def cuda_module(spec):
    """The CUDA kernel module of a spec: HQMQ's, or the int4 / fp8 / KIVI one."""
    from kvqbench.kernels.cuda import decode_attention, hqmq_decode

    return hqmq_decode if spec.startswith("hqmq") else decode_attention


def cuda_call(spec, q, kf, vf, **kw):
    """That module's decode of spec's flats."""
    return cuda_module(spec).decode(q, kf, vf, **kw)


def both_ways(switch, spec, q, kf, vf, **kw):
    """(off, on) outputs of one call with a library.py switch (`switch`: its `set`) off, then
    on, on the same inputs (cloned: a workspace's output is reused)."""
    with switch(False):
        a = cuda_call(spec, q, kf, vf, **kw).clone()
    with switch(True):
        b = cuda_call(spec, q, kf, vf, **kw).clone()
    return a, b


def switch_reads_its_environment(var: str, expr: str) -> None:
    """In fresh interpreters: `expr` (of `l`, kernels/cuda/library.py) prints False unset and
    at "0", True at "1" of the environment variable `var`."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != var}
    code = f"from kvqbench.kernels.cuda import library as l; print({expr})"
    for value, want in ((None, "False"), ("1", "True"), ("0", "False")):
        run_env = env if value is None else {**env, var: value}
        r = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.split()[0] == want, (var, value, r.stdout, r.stderr[-500:])


def replays_give_the_eager_bits(switch, spec, graph, out, q, kf, vf, vl, counts, qs, tag=()) -> None:
    """Each replay of `graph` (a call into `out` with the device count `vl`, captured with the
    switch on), after the count and q change to each of counts / qs, equals bit for bit the
    eager call with the switch off."""
    for n, qn in zip(counts, qs):
        vl.fill_(n)
        q.copy_(qn)
        graph.replay()
        with switch(False):
            want = cuda_call(spec, q, kf, vf, valid_len=vlen(n), out_dtype=out.dtype)
        assert same_bits(out, want), (*tag, n)


def two_stream_case(spec, both):
    """(kf, vf, two queries, each one's output with the switch off (`both`'s first), two side
    streams after the current one's work): what the two-stream tests of a switch start from."""
    kf, vf = case_flats(spec, 1, 8, 8192, 128, seed=70)
    qs = [query(1, 32, 128, 71 + i) for i in range(2)]
    want = [both(spec, q, kf, vf)[0] for q in qs]
    streams = [torch.cuda.Stream() for _ in qs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    return kf, vf, qs, want, streams
