"""The dense decode-step encoders (kernels/spherical_step.py, kernels/vq_step.py) write
what the quantizers' torch paths write, bit for bit: the packed codes and fp16 gains in a
step's field rows and the decoded token in the history at the device position, and the
fields of a multi-token write (a dense layer's prefill, after the quantizer's own fit).

- spherical (TurboQuant): plain and outlier-split specs (one mask for all rows or one per
  row), Hadamard, structured and dense rotations, lsq and norm gains, QJL keys (without a
  split: with one they stay on the torch path).
- additive VQ (greedy and beam search) and flat VQ: fitted codebooks per batch row or per
  kv-head, seeded ones, lsq and rms gains, with and without the Hadamard rotation, head
  dims 16-128; non-power-of-two chunks and head dims stay on the torch path.
- fp32 / fp16 / bf16 inputs; bad input is flagged on the device and raised at the next
  check, as the torch path's sticky checks.

CPU: the Triton interpreter (`DEVICE_ENCODERS = "always"`); GPU: compiled. The kernels sum a
row's float64 products in another order than torch's matmul, so a code or a gain could
differ where a coordinate lies within ~1e-16 of a level midpoint, two codewords' scores
within their rounding, or a gain at an fp16 rounding boundary: not met on these data.

(About 290 lines: two kernels' byte-for-byte checks on the shared step harness; one subject.)
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import spherical_step, vq_step  # noqa: E402
from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.kernels.store import TokenBuffer  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.suites.harness import dense_steps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _data(B, H, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    # outlier channels, other ones per batch row: each row's fit (spherical's mask) differs
    for b in range(B):
        ch = torch.randperm(D, generator=g)[:3]
        x[b, :, :, ch] *= torch.tensor([20.0, 8.0, 4.0])
    return x.to(DEV, dtype)


def _steps(spec, role, dtype, encoder: str, monkeypatch, B=2, H=2, D=32, prompt=7, steps=3, seed=0):
    """DenseSteps after a `prompt`-token write and `steps` one-token writes at device positions."""
    monkeypatch.setattr(dense_steps, "DEVICE_ENCODERS", encoder)
    q = get_quantizer(spec, role=role, layer=1, seed=3)
    x = _data(B, H, prompt + steps, D, dtype, seed)
    packed = q.encode(x[:, :, :prompt])
    dec = TokenBuffer(x, prompt + steps + 2)
    dec.write(0, q.decode(packed).to(dtype))
    ds = dense_steps.DenseSteps(q, packed, dec, prompt + steps + 2, "test")
    for t in range(prompt, prompt + steps):
        ds.step_at(x[:, :, t:t + 1], torch.tensor([t], dtype=torch.int32, device=DEV), packed)
    return ds


def _same_steps(spec, role, dtype, monkeypatch, **kw):
    """The steps through the kernel against the torch path: same field rows and history."""
    steps, prompt = kw.get("steps", 3), kw.get("prompt", 7)
    ref = _steps(spec, role, dtype, "never", monkeypatch, **kw)
    launches = se.LAUNCHES[0]
    got = _steps(spec, role, dtype, "always", monkeypatch, **kw)
    assert ref.encoder is None and got.encoder is not None
    assert se.LAUNCHES[0] - launches == steps  # one launch a step
    assert set(got.fields) == set(ref.fields)
    for name in ref.fields:
        assert torch.equal(got.fields[name][:steps], ref.fields[name][:steps]), name
    assert torch.equal(got.decoded.buf[:, :, :prompt + steps], ref.decoded.buf[:, :, :prompt + steps])
    got.checks.check()


def _same_write(q, x, kernel_quantizer):
    """A multi-token write through the kernel against `append`'s: same fields and shared tensors."""
    ref = q.encode(x)
    got = kernel_quantizer(q).encode(x)
    assert [s.tokens for s in got.segments] == [x.shape[2]]
    for name, t in ref.segments[0].fields.items():
        assert torch.equal(got.segments[0].fields[name], t), name
    for name, t in ref.shared.items():
        assert torch.equal(got.shared[name], t), name
    assert torch.equal(q.decode(got), q.decode(ref))


def _bad_input_raises(spec, bad, match, monkeypatch, prompt):
    ds = _steps(spec, "V", torch.float32, "always", monkeypatch, steps=1, prompt=prompt)
    ds.checks.check()  # clean so far
    x = torch.ones(2, 2, 1, 32, device=DEV)
    x[1, 0, 0, 5] = bad
    ds.step_at(x, torch.tensor([prompt + 1], dtype=torch.int32, device=DEV), None)
    with pytest.raises(QuantizerInputError, match=match):
        ds.checks.check()


# ---- spherical (TurboQuant) -------------------------------------------------------------------------------
SPHERICAL = ["spherical3", "spherical4:gain=norm", "spherical:bits=2,rotation=dense", "spherical2.5",
             "spherical2.25", "spherical:bits=3,rotation=dense,outliers=5,gain=norm"]


@pytest.mark.parametrize("spec", SPHERICAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_spherical_steps_write_the_torch_paths_bytes(spec, dtype, monkeypatch):
    _same_steps(spec, "K" if dtype != torch.float16 else "V", dtype, monkeypatch)


@pytest.mark.parametrize("spec", ["spherical2.25", "spherical:bits=3,rotation=structured"])
def test_spherical_head_dims_that_are_not_powers_of_two(spec, monkeypatch):
    _same_steps(spec, "V", torch.float32, monkeypatch, D=48, B=1, H=3)


QJL = ["spherical4-qjl", "spherical3-qjl", "spherical:bits=3,qjl=true,gain=norm,rotation=dense"]


@pytest.mark.parametrize("spec", QJL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spherical_qjl_key_steps_write_the_torch_paths_bytes(spec, dtype, monkeypatch):
    _same_steps(spec, "K", dtype, monkeypatch)


@pytest.mark.parametrize("spec", QJL[:1] + QJL[2:])
def test_spherical_qjl_key_multi_token_writes_store_the_torch_paths_fields(spec):
    _same_write(get_quantizer(spec, role="K", layer=1, seed=3), _data(2, 3, 9, 32, torch.float16, 2),
                spherical_step.kernel_quantizer)


def test_spherical_qjl_with_a_split_keeps_the_torch_path(monkeypatch):
    split = get_quantizer("spherical:bits=3,qjl=true,outlier_fraction=0.25,rotation=structured", role="K")
    assert "outlier split" in spherical_step.unsupported(split, 32)
    assert spherical_step.unsupported(get_quantizer("spherical4-qjl", role="K"), 32) is None
    assert _steps("spherical:bits=3,qjl=true,outlier_fraction=0.25,rotation=structured", "K", torch.float32,
                  "always", monkeypatch).encoder is None


@pytest.mark.parametrize("spec", ["spherical3", "spherical4:gain=norm", "spherical2.5", "spherical2.25",
                                  "spherical:bits=3,rotation=dense,outliers=5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_spherical_multi_token_writes_store_the_torch_paths_fields(spec, dtype):
    _same_write(get_quantizer(spec, role="V", layer=1, seed=3), _data(2, 3, 9, 32, dtype, 2),
                spherical_step.kernel_quantizer)


@pytest.mark.parametrize("bad,match", [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"),
                                       (1e38, "spherical gain.* overflows the fp16")])
def test_spherical_bad_input_is_raised_at_the_next_check(bad, match, monkeypatch):
    _bad_input_raises("spherical3", bad, match, monkeypatch, prompt=7)


# ---- additive and flat VQ ---------------------------------------------------------------------------------
VQ = ["avq2", "avq3", "avq:M=2,K_bits=6,gain=rms", "avq:M=2,K_bits=6,rotation=none,per_head=true",
      "avq:M=3,K_bits=5,codebooks=gaussian", "flatvq:dim=4,K_bits=8", "flatvq:dim=2,K_bits=6,per_head=false"]


@pytest.mark.parametrize("spec", VQ)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_vq_steps_write_the_torch_paths_bytes(spec, dtype, monkeypatch):
    _same_steps(spec, "V" if dtype == torch.float16 else "K", dtype, monkeypatch, prompt=40)


@pytest.mark.parametrize("D", [16, 64, 128])
def test_vq_head_dims(D, monkeypatch):
    _same_steps("avq2", "V", torch.float32, monkeypatch, D=D, B=1, H=3, prompt=40)


@pytest.mark.parametrize("spec,D", [("avq:M=2,K_bits=6,beam=4", 32), ("avq:M=3,K_bits=5,beam=8,codebooks=gaussian", 32),
                                    ("avq:M=2,K_bits=4,beam=3,gain=rms,rotation=none", 32),
                                    ("avq:M=3,K_bits=8,beam=8,codebooks=gaussian", 64)])  # avq3-cal's tiles
def test_vq_beam_search_writes_the_torch_paths_bytes(spec, D, monkeypatch):
    _same_steps(spec, "K", torch.float32, monkeypatch, D=D, prompt=40)


@pytest.mark.parametrize("spec,D,why", [("avq:M=2,K_bits=8,beam=16", 64, "exceed"), ("avq2", 48, "powers of two"),
                                        ("flatvq:dim=3,K_bits=4", 48, "powers of two"),
                                        ("avq2", 256, "powers of two up to 128"),
                                        ("flatvq:dim=1,K_bits=14", 32, "exceed"),
                                        ("avq:M=2,K_bits=2,beam=8", 32, "wider than the 4 codewords")])
def test_what_the_vq_kernel_leaves_to_the_torch_path(spec, D, why):
    assert why in vq_step.unsupported(get_quantizer(spec), D)


@pytest.mark.parametrize("spec", ["avq2", "avq3", "avq:M=2,K_bits=6,gain=rms,per_head=true",
                                  "avq:M=2,K_bits=6,beam=4", "flatvq:dim=4,K_bits=8", "flatvq:dim=2,K_bits=6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vq_multi_token_writes_store_the_torch_paths_fields(spec, dtype):
    _same_write(get_quantizer(spec, role="K", layer=2, seed=5), _data(2, 3, 9, 32, dtype, 1), vq_step.kernel_quantizer)


def test_the_kernel_quantizer_shares_the_instances_calibration():
    q = get_quantizer("avq2-cal", role="V", layer=0)
    cb = torch.randn(1, 1, 2, 256, 8).half()
    q.load_calibration({"codebooks": cb})
    w = vq_step.kernel_quantizer(q)
    assert type(w).__name__ == "KernelAdditiveVQ" and isinstance(w, type(q))
    assert torch.equal(w.empty(torch.zeros(1, 2, 3, 32)).shared["codebooks"].cpu(), cb)


@pytest.mark.parametrize("bad,match", [(float("nan"), "NaN/Inf"), (float("-inf"), "NaN/Inf"),
                                       (1e38, "scale or gain overflows the fp16")])
def test_vq_bad_input_is_raised_at_the_next_check(bad, match, monkeypatch):
    _bad_input_raises("avq2", bad, match, monkeypatch, prompt=40)


def test_a_vq_multi_token_write_flags_a_gain_beyond_fp16():
    q = get_quantizer("avq2", role="V")
    x = _data(1, 2, 8, 32, torch.float32, 0)
    with pytest.raises(QuantizerInputError, match="overflows the fp16"):
        vq_step.encode_tokens(q, x * 1e36, q.fitted_shared(x))


def test_a_step_kernel_that_does_not_build_gives_way_to_the_torch_path(monkeypatch):
    # a GPU whose Triton cannot build the kernel (registers, an op): the first call (a warm-up,
    # before any capture) falls back, says why, and the steps store what the torch path stores
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(dense_steps, "ENCODER_FALLBACKS", {})
    ref = _steps("spherical3", "V", torch.float32, "never", monkeypatch)

    def refuse(*a, **k):
        raise OutOfResources(300000, 232448, "shared memory")
    monkeypatch.setattr(spherical_step.SphericalTables, "launch", refuse)  # (the kernel's launch)
    with pytest.warns(UserWarning, match="does not build here"):
        got = _steps("spherical3", "V", torch.float32, "always", monkeypatch)
    assert got.encoder is None and (got.q.spec, "V") in dense_steps.ENCODER_FALLBACKS
    for name in ref.fields:
        assert torch.equal(got.fields[name][:3], ref.fields[name][:3]), name

