"""fp8's default scale is vLLM's `calculate_kv_scales` convention (quantizers/fp8.py): one
scale per (layer, role) from the first write, amax / 200 for K and amax / 100 for V;
later tokens beyond the range saturate (finite); the per-kv-head amax / 448 variant
stays as scale=head; the fused format's flatten broadcasts the one scale to [H]."""
from __future__ import annotations

import pytest
import torch

from kvqbench.kernels.formats.fp8 import flatten_fp8
from kvqbench.quantizers import get_quantizer

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _prefill(seed=0, B=2, H=3, T=24, D=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g) * torch.tensor([1.0, 7.0, 0.05]).view(1, H, 1, 1)


def test_default_is_vllms_per_layer_scale():
    assert get_quantizer("fp8").config.scale == "layer"
    assert get_quantizer("fp8-e4m3").config.scale == "layer"
    assert get_quantizer("fp8-e4m3-head").config.scale == "head"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("role, headroom", [("K", 200.0), ("V", 100.0)])
def test_layer_scale_is_amax_over_the_prefill_with_headroom(fmt, role, headroom):
    x = _prefill()
    q = get_quantizer(f"fp8:format={fmt}", role=role, layer=4)
    p = q.encode(x)
    s = p.shared["scale"]
    assert s.shape == (1,) and s.dtype == torch.float16  # ONE scale per (layer, role)
    assert float(s) == float(torch.tensor(float(x.abs().amax()) / headroom).half())
    # in-range data: torch's float8 cast of x / s, every element within half an fp8 ulp
    dtype = q.dtype
    want = (x / s.float()).to(dtype).float() * s.float()
    y = q.decode(p)
    assert torch.equal(y, want)
    mant = 3 if fmt == "e4m3" else 2
    v = (x / s.float()).abs()
    normal = v >= 2.0 ** (-6 if fmt == "e4m3" else -14)
    rel = ((y - x).abs() / x.abs().clamp_min(1e-30))[normal]
    assert rel.max() <= 2.0 ** -(mant + 1) * (1 + 1e-5)
    assert float((y - x).norm(dim=-1).sub(q.error_bound(x)).max()) <= 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("role", ["K", "V"])
def test_later_tokens_beyond_the_prefill_range_saturate_finite(fmt, role):
    x = _prefill(1)
    q = get_quantizer(f"fp8:format={fmt}", role=role)
    p = q.encode(x)
    s = float(p.shared["scale"])
    amax = float(x.abs().amax())
    step = torch.zeros(2, 3, 1, 32)
    step[..., 0], step[..., 1] = 1e4 * amax, -1e4 * amax  # far past +-max * scale
    step[..., 2] = 1.5 * amax  # past the prefill's amax, still inside the headroom
    p2 = q.append(p, step)
    assert torch.equal(p2.shared["scale"], p.shared["scale"])  # fixed by the first write
    out = q.decode(p2)[:, :, -1]
    assert torch.isfinite(out).all()
    clamp = FMAX[fmt] * s
    assert torch.equal(out[..., 0], torch.full_like(out[..., 0], clamp))
    assert torch.equal(out[..., 1], torch.full_like(out[..., 1], -clamp))
    # 1.5 amax is within the headroom (200 or 100 codes of 448 / 57344): coded, not clipped
    assert abs(float(out[0, 0, 2]) - 1.5 * amax) <= 1.5 * amax * 2.0 ** -(3 if fmt == "e4m3" else 2)


def test_head_variant_keeps_per_head_amax_over_max():
    x = _prefill()
    p = get_quantizer("fp8:scale=head").encode(x)
    want = (x.abs().amax(dim=(0, 2, 3)) / 448.0).clamp(min=2.0**-14).half()
    assert torch.equal(p.shared["scale"], want)


def test_fused_format_reads_the_layer_scale_broadcast_per_head():
    x = _prefill()
    q = get_quantizer("fp8-e4m3", role="V")
    p = q.encode(x)
    flat = flatten_fp8(p, "V")
    assert flat.scale.shape == (3,) and flat.scale.dtype == torch.float32
    assert torch.equal(flat.scale, p.shared["scale"].float().expand(3))
    # the kernels' decode, codes x scale[h], is the quantizer's
    codes = flat.codes[:, :, :flat.T].view(torch.float8_e4m3fn).float() * flat.scale.view(1, 3, 1, 1)
    assert torch.equal(codes, q.decode(p))


def test_bad_scale_is_named():
    with pytest.raises(ValueError, match="scale must be one of layer, head, tensor, unit"):
        get_quantizer("fp8:scale=channel")
