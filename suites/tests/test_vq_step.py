"""The avq / flatvq dense step's device encoder (kernels/vq_step.py) writes what the
quantizer's torch path writes: the same packed codes and fp16 gains in the step's field
rows and the same decoded token in the history, bit for bit, at the device position
(fitted codebooks per batch row or per kv-head, seeded ones, lsq and rms gains, with and
without the Hadamard rotation, greedy and beam search, fp32 / fp16 / bf16 inputs, head
dims 16-128). Non-power-of-two chunks and head dims stay on the torch path.
Bad input is flagged on the device and raised at the next check.

CPU: the Triton interpreter (`DEVICE_ENCODERS = "always"`); GPU: compiled. A code could
differ where two codewords' float64 scores lie within their rounding of each other (the
torch matmul sums a score's products in another order): not met on these data.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels import step_encode as se  # noqa: E402
from kvqbench.kernels import vq_step  # noqa: E402
from kvqbench.kernels.store import TokenBuffer  # noqa: E402
from kvqbench.quantizers import QuantizerInputError, get_quantizer  # noqa: E402
from kvqbench.suites.harness import dense_steps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _data(B, H, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    x[..., :2] *= 6.0  # a few larger channels
    return x.to(DEV, dtype)


def _steps(spec, role, dtype, encoder, monkeypatch, B=2, H=2, D=32, prompt=40, steps=3, seed=0):
    monkeypatch.setattr(dense_steps, "DEVICE_ENCODERS", encoder)
    q = get_quantizer(spec, role=role, layer=2, seed=5)
    x = _data(B, H, prompt + steps, D, dtype, seed)
    packed = q.encode(x[:, :, :prompt])
    dec = TokenBuffer(x, prompt + steps + 2)
    dec.write(0, q.decode(packed).to(dtype))
    ds = dense_steps.DenseSteps(q, packed, dec, prompt + steps + 2, "test")
    for t in range(prompt, prompt + steps):
        ds.step_at(x[:, :, t:t + 1], torch.tensor([t], dtype=torch.int32, device=DEV), packed)
    return ds


SPECS = ["avq2", "avq3", "avq:M=2,K_bits=6,gain=rms", "avq:M=2,K_bits=6,rotation=none,per_head=true",
         "avq:M=3,K_bits=5,codebooks=gaussian", "flatvq:dim=4,K_bits=8", "flatvq:dim=2,K_bits=6,per_head=false"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_writes_the_torch_paths_bytes(spec, dtype, monkeypatch):
    role = "V" if dtype == torch.float16 else "K"
    ref = _steps(spec, role, dtype, "never", monkeypatch)
    launches = se.LAUNCHES[0]
    got = _steps(spec, role, dtype, "always", monkeypatch)
    assert ref.encoder is None and got.encoder is not None
    assert se.LAUNCHES[0] - launches == 3  # one launch a step
    assert set(got.fields) == set(ref.fields)
    for name in ref.fields:
        assert torch.equal(got.fields[name][:3], ref.fields[name][:3]), name
    assert torch.equal(got.decoded.buf[:, :, :43], ref.decoded.buf[:, :, :43])
    got.checks.check()


@pytest.mark.parametrize("D", [16, 64, 128])
def test_head_dims(D, monkeypatch):
    ref = _steps("avq2", "V", torch.float32, "never", monkeypatch, D=D, B=1, H=3)
    got = _steps("avq2", "V", torch.float32, "always", monkeypatch, D=D, B=1, H=3)
    for name in ref.fields:
        assert torch.equal(got.fields[name][:3], ref.fields[name][:3]), name
    assert torch.equal(got.decoded.buf[:, :, :43], ref.decoded.buf[:, :, :43])


@pytest.mark.parametrize("spec,D,why", [("avq:M=2,K_bits=8,beam=16", 64, "exceed"), ("avq2", 48, "powers of two"),
                                        ("flatvq:dim=3,K_bits=4", 48, "powers of two"),
                                        ("avq2", 256, "powers of two up to 128"),
                                        ("flatvq:dim=1,K_bits=14", 32, "exceed")])
def test_what_the_kernel_leaves_to_the_torch_path(spec, D, why):
    assert why in vq_step.unsupported(get_quantizer(spec), D)


def test_beam_search_on_cuda_waits_for_its_gpu_tests(monkeypatch):
    monkeypatch.setattr(vq_step, "BEAM_ON_CUDA", False)
    cuda = torch.device("cuda")
    assert "waits for a GPU run" in vq_step.unsupported(get_quantizer("avq2-cal"), 64, cuda)
    assert vq_step.unsupported(get_quantizer("avq2-cal"), 64, torch.device("cpu")) is None
    assert vq_step.unsupported(get_quantizer("avq2"), 64, cuda) is None


@pytest.mark.parametrize("bad,match", [(float("nan"), "NaN/Inf"), (float("-inf"), "NaN/Inf"),
                                       (1e38, "scale or gain overflows the fp16")])
def test_bad_input_is_raised_at_the_next_check(bad, match, monkeypatch):
    ds = _steps("avq2", "V", torch.float32, "always", monkeypatch, steps=1)
    ds.checks.check()
    x = torch.ones(2, 2, 1, 32, device=DEV)
    x[0, 1, 0, 3] = bad
    ds.step_at(x, torch.tensor([41], dtype=torch.int32, device=DEV), None)
    with pytest.raises(QuantizerInputError, match=match):
        ds.checks.check()


@pytest.mark.parametrize("spec,D", [("avq:M=2,K_bits=6,beam=4", 32), ("avq:M=3,K_bits=5,beam=8,codebooks=gaussian", 32),
                                    ("avq:M=2,K_bits=4,beam=3,gain=rms,rotation=none", 32),
                                    ("avq:M=3,K_bits=8,beam=8,codebooks=gaussian", 64)])  # avq3-cal's tiles
def test_beam_search_writes_the_torch_paths_bytes(spec, D, monkeypatch):
    monkeypatch.setattr(vq_step, "BEAM_ON_CUDA", True)
    ref = _steps(spec, "K", torch.float32, "never", monkeypatch, D=D)
    got = _steps(spec, "K", torch.float32, "always", monkeypatch, D=D)
    assert got.encoder is not None
    for name in ref.fields:
        assert torch.equal(got.fields[name][:3], ref.fields[name][:3]), name
    assert torch.equal(got.decoded.buf[:, :, :43], ref.decoded.buf[:, :, :43])


@pytest.mark.parametrize("spec", ["avq2", "avq3", "avq:M=2,K_bits=6,gain=rms,per_head=true",
                                  "avq:M=2,K_bits=6,beam=4", "flatvq:dim=4,K_bits=8", "flatvq:dim=2,K_bits=6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_multi_token_write_stores_the_torch_paths_fields(spec, dtype, monkeypatch):
    # the prefill's encode (vq_step.encode_tokens over (rows x kv-heads, tokens)), after the
    # quantizer's own fit: what `append` stores, field for field
    monkeypatch.setattr(vq_step, "BEAM_ON_CUDA", True)
    q = get_quantizer(spec, role="K", layer=2, seed=5)
    x = _data(2, 3, 9, 32, dtype, 1)
    ref = q.encode(x)
    got = vq_step.kernel_quantizer(q).encode(x)
    assert type(got) is type(ref) and [s.tokens for s in got.segments] == [9]
    for name, t in ref.segments[0].fields.items():
        assert torch.equal(got.segments[0].fields[name], t), name
    for name, t in ref.shared.items():
        assert torch.equal(got.shared[name], t), name
    assert torch.equal(q.decode(got), q.decode(ref))


def test_the_kernel_quantizer_shares_the_instances_calibration():
    q = get_quantizer("avq2-cal", role="V", layer=0)
    cb = torch.randn(1, 1, 2, 256, 8).half()
    q.load_calibration({"codebooks": cb})
    w = vq_step.kernel_quantizer(q)
    assert type(w).__name__ == "KernelAdditiveVQ" and isinstance(w, type(q))
    assert torch.equal(w.empty(torch.zeros(1, 2, 3, 32)).shared["codebooks"].cpu(), cb)


def test_a_multi_token_write_flags_a_gain_beyond_fp16():
    q = get_quantizer("avq2", role="V")
    x = _data(1, 2, 8, 32, torch.float32, 0)
    shared = q.fitted_shared(x)
    with pytest.raises(QuantizerInputError, match="overflows the fp16"):
        vq_step.encode_tokens(q, x * 1e36, shared)
