"""The one-launch eager cache write (kernels/cuda/step_write.py): a layer's one-token K and V
write of naive int, fp8, fp16 (and KIVI's window row, HQMQ) in one CUDA launch stores exactly
the bytes the Triton step encoders store (kernels/step_encode.py, kernels/hqmq_encode.py,
themselves held to the quantizers by test_step_encode.py), raises the same input errors, and
issues no Triton launch.

GPU only, but for the refusals (`why_not`), the switch and the stores' bookkeeping around the
launch (emulated by the Triton encoders), which run everywhere. Ran on an H100 on 2026-12-06
(115 passed, at the commit that added them; the refusal test then corrected for a GPU, where
its int4 case is taken). The KIVI and HQMQ cases ran on an H100 on 2026-12-06 (eighth session:
every HQMQ / Med3x case passed; KIVI's bytes were equal everywhere, and the launch count's
expectation was corrected for the default 128-token window, which does not flush here).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # (the bookkeeping test's Triton encoders run interpreted)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.kernels import store as store_mod  # noqa: E402
from kvqbench.kernels.cuda import library, step_write as sw  # noqa: E402
from kvqbench.quantizers import QuantizerInputError  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedLayer  # noqa: E402

CUDA = torch.cuda.is_available()
WHY = sw.why_unavailable() if CUDA else "no CUDA device"
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"the CUDA write library is unavailable: {WHY}")
DEV = torch.device("cuda" if CUDA else "cpu")
SPECS = ["int4", "int2", "int3", "int8", "int4:group=16", "int4:group=64", "fp8-e4m3", "fp8-e5m2", "fp16"]
# KIVI's window row (not yet in step_write.VERIFIED: these tests put it there); its flushes
# stay Triton launches
KIVI_SPECS = ["kivi:bits=2,group=8,residual=8", "kivi:bits=4,group=4,residual=8,window=fixed", "kivi:bits=4"]
# HQMQ (not yet in VERIFIED either): 5- to 12-bit codes (S=170: the filled field), 2-4 radius bits, Med3x
HQMQ_SPECS = ["hqmq:S=8,r=4", "hqmq:S=96,r=4", "hqmq:S=96,r=3,fill=true", "hqmq:S=1,r=2",
              "hqmq:S=8,r=4,outliers=med3", "hqmq:S=96,r=4,outliers=med3", "hqmq:S=24,r=3,outliers=med3,C=1.5"]


def _data(shape, dtype, seed):
    """Random rows `[2 roles, B, H, T, D]` of mixed scales, with the edge cases of the
    encoders' rounding: a constant group (zero span), a group of fp16-subnormal steps,
    values near the fp16 max, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g).mul(4).add(0.01)
    x[..., 3] *= 8
    x[0, 0, 0, :, :16] = 0.5
    x[1, 0, 0, :, :16] *= 1e-6
    x[0, 1, 1, :, 5] = 6.0e4
    x[1, 1, 0, :, 7] = -0.0
    return x.to(DEV, dtype)


def _run(spec, dtype, D, cuda_write, seed=0, prefill=37, steps=30, B=2, H=3, bad=None):
    """A fused layer's prefill then one-token steps, the write on or off, the same inputs;
    bad: a value put into V (b 1, head 2) at the last step's token."""
    x = _data((2, B, H, prefill + steps, D), dtype, seed)
    if bad is not None:
        x[1, 1, 2, prefill + steps - 1, 9] = bad
    layer = QuantizedLayer(spec, 0, seed=seed)
    layer.fused_wanted = True
    with sw.CUDA_WRITE.set(cuda_write), torch.inference_mode():
        layer.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
        before = se.LAUNCHES[0]
        for t in range(prefill, prefill + steps):
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
        launched = se.LAUNCHES[0] - before
    assert layer.mode == "fused"
    return layer, launched


def _assert_same(a, b):
    assert a.tokens == b.tokens
    for role in ("K", "V"):
        sa, sb = a.stores[role], b.stores[role]
        assert set(sa.buffers) == set(sb.buffers) and sa.tokens == sb.tokens
        for name in sa.buffers:
            assert torch.equal(sa.buffers[name].valid, sb.buffers[name].valid), (role, name)
        if getattr(sa, "outliers", None) is not None:  # HQMQ + Med3x: the lists, their lengths, the block starts
            assert torch.equal(sa.outlier_len, sb.outlier_len)
            assert torch.equal(sa.outlier_index.valid, sb.outlier_index.valid)
            for (bb, hh), n in zip(((i, j) for i in range(sa.B) for j in range(sa.H)), sa.outlier_len.tolist()):
                assert torch.equal(sa.outliers[bb, hh, :n], sb.outliers[bb, hh, :n]), (role, bb, hh)
        assert torch.equal(a.read(role), b.read(role))
    assert torch.equal(a.errors.flags, b.errors.flags)


@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256, 96])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", SPECS + KIVI_SPECS + HQMQ_SPECS)
def test_cuda_write_stores_what_the_triton_steps_store(spec, dtype, D, monkeypatch):
    if D % 64 and "group=64" in spec:
        pytest.skip("group 64 does not divide head_dim 96")
    monkeypatch.setattr(store_mod, "MIN_CAPACITY", 64)  # the steps cross a buffer growth
    monkeypatch.setattr(sw, "VERIFIED", set(sw.KINDS))
    new, launched = _run(spec, dtype, D, True)
    old, old_launched = _run(spec, dtype, D, False)
    _assert_same(new, old)
    if "kivi" in spec:  # the window rows in one launch, each flush a Triton int launch as before
        assert launched < old_launched - 30
        # residual=8 flushes within the 30 steps; the default window (128 tokens) does not
        # (37 + 30 tokens), so there the CUDA write served every step alone
        assert (launched > 0) == ("residual=8" in spec)
    else:
        assert launched == 0 and old_launched == 2 * 30  # no Triton launch: the CUDA write served every step
        assert new.stores["V"].buffers[new.stores["V"].fields[0]].capacity > 64


@needs_cuda
@pytest.mark.parametrize("spec,bad,match", [
    ("int4", float("nan"), "NaN/Inf"), ("int4", 7e4, "overflows the fp16"), ("fp8-e4m3", float("inf"), "NaN/Inf"),
    ("fp8-e5m2", float("nan"), "NaN/Inf"), ("fp16", 7e4, "overflow"), ("fp16", float("-inf"), "NaN/Inf"),
    ("kivi:bits=2,group=8,residual=8", 1e6, "overflows the fp16"), ("kivi:bits=4", float("nan"), "NaN/Inf"),
    ("hqmq:S=8,r=4", float("nan"), "NaN/Inf"), ("hqmq:S=8,r=4", 7e4, "overflow"),
    ("hqmq:S=8,r=4,outliers=med3", 7e4, "overflow"), ("hqmq:S=8,r=4,outliers=med3", float("inf"), "NaN/Inf")])
def test_bad_input_raises_what_the_triton_steps_raise(spec, bad, match, monkeypatch):
    monkeypatch.setattr(sw, "VERIFIED", set(sw.KINDS))
    # (the bad token is the last step's: a later step's poll would raise inside the loop)
    new, _ = _run(spec, torch.float32, 64, True, steps=6, bad=bad)
    old, _ = _run(spec, torch.float32, 64, False, steps=6, bad=bad)
    flags = new.errors.flags.cpu()
    assert flags.tolist() == old.errors.flags.cpu().tolist()
    assert flags[1, 1] == 37 + 5  # V, the token named
    with pytest.raises(QuantizerInputError, match=rf"layer 0 V: .*token 42.*{match}"):
        new.nbytes()


@needs_cuda
def test_two_layers_keep_their_own_plans_and_flags():
    # Two layers of one model written in turn: each launch reads its own pair's plan (the
    # plans are keyed by the stores' buffers), so neither writes into the other.
    a, _ = _run("int4", torch.float16, 128, True, seed=1)
    b, _ = _run("int4", torch.float16, 128, True, seed=2)
    a_old, _ = _run("int4", torch.float16, 128, False, seed=1)
    b_old, _ = _run("int4", torch.float16, 128, False, seed=2)
    _assert_same(a, a_old)
    _assert_same(b, b_old)


# ---- everywhere: the switch, the refusals, the stores' bookkeeping around the launch -------------------
def _triton_launch(k_store, v_store, k, v, errors, rows, tokens, blocks):
    """`step_write._launch` done by the Triton encoders (the interpreter on a CPU): what the
    CUDA launch writes, so the bookkeeping around it is checked where no GPU is."""
    from kvqbench.kernels.formats.kivi import KIVIStore

    for i, (store, x) in enumerate(((k_store, k), (v_store, v))):
        if type(store) is KIVIStore:
            se.kivi_window(x, store.buffers["residual"].buf, rows[i], errors.rows[i], tokens[i])
        else:
            store.format.step(store, x, errors.rows[i], rows[i],
                              **({"index_block": blocks[i]} if blocks[i] is not None else {}))


@pytest.mark.parametrize("spec", ["int4", "fp8-e4m3", "fp16", "kivi:bits=2,group=4,residual=8",
                                  "kivi:bits=4,group=4,residual=8,window=fixed", "hqmq:S=8,r=4",
                                  "hqmq:S=8,r=4,outliers=med3"])
def test_write_pair_bookkeeping_equals_the_step_path(spec, monkeypatch):
    # write_pair's begin_write / launch / end_write of both stores (KIVI: the window row, then
    # a flush when it fills) against each store's own step, the launch emulated on the CPU
    if CUDA:
        pytest.skip("the GPU tests run the real launch")
    monkeypatch.setattr(store_mod, "MIN_CAPACITY", 64)
    monkeypatch.setattr(sw, "VERIFIED", set(sw.KINDS))
    monkeypatch.setattr(sw, "_launch", _triton_launch)
    monkeypatch.setattr(sw, "why_not", lambda *a: None)
    monkeypatch.setattr(sw._LIB, "load", lambda: True)
    # (Med3x past token 64: a step that opens an outlier-index block, its block number handed
    # through write_pair to the launch; and a buffer growth, 64 -> 128 tokens)
    steps = 55 if "med3" in spec else 14
    new, launched = _run(spec, torch.float16, 32, True, prefill=13, steps=steps, H=2)
    old, _ = _run(spec, torch.float16, 32, False, prefill=13, steps=steps, H=2)
    _assert_same(new, old)
    assert all(s.in_run for s in new.stores.values())
    if "med3" in spec:
        assert new.stores["K"].buffers["codes"].capacity > 64 and new.stores["K"].outlier_index.length == 2


# ---- everywhere: the switch and the refusals ---------------------------------------------------------
def test_the_switch_is_on_unless_the_environment_turns_it_off():
    import subprocess
    import sys

    code = "from kvqbench.kernels.cuda import step_write as s; print(s.CUDA_WRITE.on)"
    for env, want in ((None, "True"), ("0", "False"), ("1", "True"), (" 0 ", "False")):
        e = {k: v for k, v in os.environ.items() if k != "KVQBENCH_CUDA_WRITE"}
        if env is not None:
            e["KVQBENCH_CUDA_WRITE"] = env
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want
    with sw.CUDA_WRITE.set(False):
        assert sw.CUDA_WRITE.on is False
    assert sw.CUDA_WRITE.on is (os.environ.get("KVQBENCH_CUDA_WRITE", "1").strip() != "0")


@pytest.mark.parametrize("spec,why", [("kivi:bits=2,group=8,residual=8", "not verified"),
                                      ("hqmq:S=8,r=4", "not verified"), ("int4", None)])
def test_why_not_names_the_refusal(spec, why, monkeypatch):
    # (every kind is verified today: the refusal a kind gets before its GPU tests pass is
    # checked with KIVI and HQMQ taken back out)
    monkeypatch.setattr(sw, "VERIFIED", {"int", "fp8", "fp16"})
    x = torch.randn(1, 2, 12, 64, dtype=torch.float16, device=DEV)
    layer = QuantizedLayer(spec, 0)
    layer.fused_wanted = True
    layer.update(x[:, :, :10], x[:, :, :10])
    assert layer.mode == "fused"
    k = x[:, :, 10:11]
    got = sw.why_not(layer.stores["K"], layer.stores["V"], k, k)
    if why is None:  # int4: taken on a GPU, refused for the device on a CPU
        assert got == (None if CUDA else "not on a CUDA device")
        if CUDA:
            return
    else:
        assert why in got
    with sw.CUDA_WRITE.set(True):  # refused: nothing written
        assert not sw.write_pair(layer.stores["K"], layer.stores["V"], k, k, layer.errors)
    assert layer.stores["K"].tokens == 10


def test_the_hqmq_write_takes_uniform_radius_whole_bit_rows(monkeypatch):
    # log-spaced radius levels and mixed-radix rows keep the Triton encoder though HQMQ is
    # verified; a kind out of VERIFIED is taken in no config
    monkeypatch.setattr(sw, "VERIFIED", set(sw.KINDS) - {"hqmq"})
    assert not sw.takes("hqmq:S=96,r=4")
    monkeypatch.setattr(sw, "VERIFIED", set(sw.KINDS))
    for spec in ("hqmq:S=96,r=4", "hqmq:S=96,fill=true", "hqmq:S=8,r=3", "hqmq:S=96,r=4,outliers=med3"):
        assert sw.takes(spec), spec
    for spec in ("hqmq:S=96,r=4,radius=log", "hqmq:S=96,pack=mixed"):
        assert not sw.takes(spec), spec
    assert "S=300" in sw._hqmq_reason(300, False, "bits")


# ---- where nvcc is: the HQMQ write's arithmetic, run on the host, against the Triton encoder -------------
@pytest.mark.skipif(CUDA or library.nvcc() is None,
                    reason="no nvcc to build the host entry (a GPU runs the kernel itself above)")
@pytest.mark.parametrize("spec", ["hqmq:S=8,r=4", "hqmq:S=96,r=3,fill=true", "hqmq:S=8,r=4,outliers=med3",
                                  "hqmq:S=24,r=2,outliers=med3,C=1.5"])
def test_the_hqmq_writes_arithmetic_equals_the_triton_encoders(spec):
    # step_write.cu's per-chunk functions (radius, direction search, radius code, Med3x's median)
    # compiled for the host (`kvq_hqmq_rows_host`, the kernel's row in one thread) give the codes,
    # radius codes, r_max and outlier flags the Triton step encoder stored for the same one-token
    # steps (interpreted here: its fp32 ops one by one, as the GPU runs them without FMA)
    import ctypes

    import numpy as np

    from kvqbench.quantizers.packing import unpack_bits

    lib = ctypes.CDLL(str(library.compile_library(sw.SOURCE, "kvq_step_write", (9, 0), base=tuple(library.EXACT_FLAGS))))
    assert sw._declare(lib) is None  # (the source builds, and the loader's WritePlan has its size)
    B, H, D, prefill, steps = 2, 2, 64, 9, 6
    x = _data((2, B, H, prefill + steps, D), torch.float32, 0)
    layer = QuantizedLayer(spec, 0, seed=0)
    layer.fused_wanted = True
    with torch.inference_mode():
        layer.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
        # the steps search secondaries in pairs: exact twins (a tie: the first must win) and
        # twins one ulp apart (near-ties, where only the same fp32 operations in the same order
        # pick the same one)
        for store in layer.stores.values():
            sec = store.flat.sec
            sec[:, 1::2] = sec[:, 0::2][:, :sec[:, 1::2].shape[1]]
            sec[:, 3::4, 0] = torch.nextafter(sec[:, 3::4, 0], torch.tensor(2.0))
        for t in range(prefill, prefill + steps):
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
    nc, n_outliers = D // 4, 0
    for role, xr in zip(("K", "V"), x):
        f = layer.stores[role].flat
        med3 = layer.stores[role].stepper.med3
        toks = slice(prefill, prefill + steps)
        codes = unpack_bits(f.codes[:, :, toks].reshape(-1, f.codes.shape[-1]), f.code_bits, nc).reshape(B, H, steps, nc)
        rq = unpack_bits(f.radius[:, :, toks].reshape(-1, f.radius.shape[-1]), f.r_bits, nc).reshape(B, H, steps, nc)
        for b, h in ((b, h) for b in range(B) for h in range(H)):
            rows = np.ascontiguousarray(xr[b, h, toks].numpy(), dtype=np.float32)
            sec = np.ascontiguousarray(f.sec[h].float().numpy())
            out = [np.zeros((steps, nc), np.int32) for _ in range(3)]
            rmax = np.zeros(steps, np.uint16)
            ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
            assert lib.kvq_hqmq_rows_host(ptr(rows), steps, nc, ptr(sec), f.S, f.r_bits, int(med3),
                                          ctypes.c_float(layer.stores[role].stepper.config.C),
                                          ptr(out[0]), ptr(out[1]), ptr(rmax), ptr(out[2])) == 0
            assert np.array_equal(out[0], codes[b, h].numpy()), (role, b, h)
            assert np.array_equal(out[1], rq[b, h].numpy()), (role, b, h)
            assert np.array_equal(rmax, f.r_max[b, h, toks].view(torch.int16).numpy().view(np.uint16)), (role, b, h)
            if med3:
                flags = unpack_bits(f.flags[b, h, toks], 1, nc)
                assert np.array_equal(out[2], flags.numpy()), (role, b, h)
                n_outliers += int(out[2].sum())
    assert n_outliers > 0 or "med3" not in spec  # (Med3x: the data has outliers to find)
