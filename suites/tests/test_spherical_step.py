"""The spherical (TurboQuant) dense step's device encoder (kernels/spherical_step.py)
writes what the quantizer's torch path writes: the same packed codes and fp16 gains in
the step's field rows, and the same decoded token in the history, bit for bit, at the
device position; for plain and outlier-split specs (one mask for all rows or one per
row), Hadamard, structured and dense rotations, lsq and norm gains, fp16 / bf16 / fp32
inputs. QJL keys stay on the torch path (their values take the kernel). Bad input is
flagged on the device and raised at the next check, as the torch path's sticky checks.

On the CPU the kernel runs under the Triton interpreter (`DEVICE_ENCODERS = "always"`);
on a GPU compiled. The torch path and the kernel sum the row's float64 products in
another order, so a code or a gain could differ where a coordinate lies within ~1e-16
of a level midpoint or a gain of an fp16 rounding boundary: not met on these data.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import spherical_step  # noqa: E402
from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.kernels.store import TokenBuffer  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.suites.harness import dense_steps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _data(B, H, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    # outlier channels, other ones per batch row: each row's mask (fitted per row) differs
    for b in range(B):
        ch = torch.randperm(D, generator=g)[:3]
        x[b, :, :, ch] *= torch.tensor([20.0, 8.0, 4.0])
    return x.to(DEV, dtype)


def _steps(spec, role, dtype, encoder: str, monkeypatch, B=2, H=2, D=32, prompt=7, steps=3, seed=0):
    """(DenseSteps after `steps` one-token writes at device positions, the tokens written)."""
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


SPECS = ["spherical3", "spherical4:gain=norm", "spherical:bits=2,rotation=dense", "spherical2.5",
         "spherical2.25", "spherical:bits=3,rotation=dense,outliers=5,gain=norm"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_writes_the_torch_paths_bytes(spec, dtype, monkeypatch):
    role = "K" if dtype != torch.float16 else "V"
    ref = _steps(spec, role, dtype, "never", monkeypatch)
    launches = se.LAUNCHES[0]
    got = _steps(spec, role, dtype, "always", monkeypatch)
    assert ref.encoder is None and got.encoder is not None
    assert se.LAUNCHES[0] - launches == 3  # one launch a step
    assert set(got.fields) == set(ref.fields)
    for name in ref.fields:
        assert torch.equal(got.fields[name][:3], ref.fields[name][:3]), name
    assert torch.equal(got.decoded.buf[:, :, :10], ref.decoded.buf[:, :, :10])
    got.checks.check()


@pytest.mark.parametrize("spec", ["spherical2.25", "spherical:bits=3,rotation=structured"])
def test_head_dims_that_are_not_powers_of_two(spec, monkeypatch):
    ref = _steps(spec, "V", torch.float32, "never", monkeypatch, D=48, B=1, H=3)
    got = _steps(spec, "V", torch.float32, "always", monkeypatch, D=48, B=1, H=3)
    for name in ref.fields:
        assert torch.equal(got.fields[name][:3], ref.fields[name][:3]), name
    assert torch.equal(got.decoded.buf[:, :, :10], ref.decoded.buf[:, :, :10])


def test_qjl_keys_keep_the_torch_path_and_their_values_take_the_kernel(monkeypatch):
    assert _steps("spherical4-qjl", "K", torch.float32, "always", monkeypatch).encoder is None
    assert _steps("spherical4-qjl", "V", torch.float32, "always", monkeypatch).encoder is not None


@pytest.mark.parametrize("bad,match", [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"),
                                       (1e38, "gain overflows the fp16")])
def test_bad_input_is_raised_at_the_next_check(bad, match, monkeypatch):
    ds = _steps("spherical3", "V", torch.float32, "always", monkeypatch, steps=1)
    ds.checks.check()  # clean so far
    x = torch.ones(2, 2, 1, 32, device=DEV)
    x[1, 0, 0, 5] = bad
    packed = ds.q.encode(_data(2, 2, 7, 32, torch.float32, 0))
    ds.step_at(x, torch.tensor([8], dtype=torch.int32, device=DEV), packed)
    with pytest.raises(QuantizerInputError, match=match):
        ds.checks.check()


@pytest.mark.parametrize("spec", ["spherical3", "spherical4:gain=norm", "spherical2.5", "spherical2.25",
                                  "spherical:bits=3,rotation=dense,outliers=5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_multi_token_write_stores_the_torch_paths_fields(spec, dtype):
    # a dense layer's prefill through the kernel (spherical_step.encode_tokens over (rows x
    # kv-heads, tokens)) after the quantizer's own fit of the outlier mask: what `append` stores
    q = get_quantizer(spec, role="V", layer=1, seed=3)
    x = _data(2, 3, 9, 32, dtype, 2)
    ref = q.encode(x)
    got = spherical_step.kernel_quantizer(q).encode(x)
    assert [s.tokens for s in got.segments] == [9]
    for name, t in ref.segments[0].fields.items():
        assert torch.equal(got.segments[0].fields[name], t), name
    for name, t in ref.shared.items():
        assert torch.equal(got.shared[name], t), name
    assert torch.equal(q.decode(got), q.decode(ref))


def test_qjl_keys_multi_token_writes_keep_the_torch_path():
    q = get_quantizer("spherical4-qjl", role="K", layer=1)
    x = _data(1, 2, 5, 32, torch.float32, 0)
    got = spherical_step.kernel_quantizer(q).encode(x)
    assert torch.equal(got.segments[0].fields["qjl_signs"], q.encode(x).segments[0].fields["qjl_signs"])
