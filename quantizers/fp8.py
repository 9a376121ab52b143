"""fp8 KV cache: the deployed format (vLLM, TensorRT-LLM, SGLang `kv_cache_dtype=fp8`).

Each element is stored as one fp8 number, e4m3 (`float8_e4m3fn`: 3 mantissa
bits, max 448, no inf) or e5m2 (2 mantissa bits, max 57344), of x / scale:

    code = (x / scale).clamp(-max, max).to(float8)     decode = code.float() * scale

exactly torch's own float8 cast (round to nearest even) of the clamped value;
values beyond the scale's range saturate to +-max (never NaN: vLLM's CUDA cast
saturates too, `__NV_SATFINITE`).

Scale (`scale`), calibration-free, fitted on the first write (the prefill) and
reused by every later append:
- "layer" (default): vLLM's `calculate_kv_scales` convention. One scale per
  (layer, role) over the whole first write (every kv-head and batch row), with
  headroom: scale = amax / 200 for K and amax / 100 for V. vLLM's
  `Attention.calc_kv_scales` (vllm/attention/layer.py; in newer releases
  vllm/model_executor/layers/attention/attention.py) computes
  `k_scale = |key|.max() / k_range`, `v_scale = |value|.max() / v_range` once, on
  the first forward, with k_range = envs.K_SCALE_CONSTANT = 200 and v_range =
  envs.V_SCALE_CONSTANT = 100 (vllm/envs.py), the same for e4m3 and e5m2. With
  e4m3 (max 448) a later K value up to 2.24x, a V value up to 4.48x, the
  prefill's amax is still coded; beyond, it saturates to +-448 scale. Stored as
  ONE fp16 scale, `[1]`; the fused kernels, which read a scale per kv-head, get
  it broadcast to `[H]` (kernels/formats/fp8.py `flatten_fp8`).
- "head": one scale per kv-head, amax / max over that head's values in the first
  write (all batch rows), no headroom (the earlier default); `[H]`.
- "tensor": one amax over the whole first write, / max (no headroom), stored
  per kv-head, all equal; `[H]`.
- "unit": 1.0, vLLM's default when a checkpoint ships no scales and scales are
  not calculated; `[H]`.
Measured, SmolLM2-135M, canterbury, quantize-on-write, 2 x 512 tokens: PPL fp16 39.13,
fp8-e4m3 (layer, vLLM's) 40.04, fp8-e4m3-head 39.70 (one seed-free run, 2 windows): a
scale set by the layer's largest value, with 2.24x / 4.48x headroom, pushes more of the
smaller kv-heads' values into fp8's subnormal range than a per-head amax / 448 scale.
A later token larger than the first write's range saturates (fitted.py). The
fit is NOT per row: one fit over all batch rows of the first write
(`fit_per_row = False`), because the fused decode kernels and the device step
encoder (kernels/) read the scale as `[H]`; a per-row scale would be `[B, H]`.
A batch harness therefore scores fp8 one window at a time
(suites/harness/perplexity.py `rows_independent`), where the scale is each
window's own, as a deployed per-sequence cache would fit it. The scale is
stored fp16, clamped to at least 2^-14 (fp16's smallest normal) so it never
underflows; tiny inputs then code into fp8 subnormals, which the error bound
covers.

Stored format (the fused kernel reads exactly this):
- per segment, `codes`: uint8 `[B, H, T, D]`, the fp8 bit patterns
  (`codes.view(torch.float8_e4m3fn)` or `float8_e5m2` gives the numbers);
- per (layer, role), `scale`: fp16 `[1]` (scale=layer) or `[H]` (head, tensor,
  unit). Decode: `codes.view(fp8).float() * scale[h or 0]`.
Bits per element: 8 plus 16 (or 16 H) bits per cache, amortised.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable
from .fitted import FitsOnFirstWrite

FORMATS = {
    # dtype, mantissa bits, smallest normal exponent
    "e4m3": (torch.float8_e4m3fn, 3, -6),
    "e5m2": (torch.float8_e5m2, 2, -14),
}
MIN_SCALE = 2.0**-14  # fp16's smallest normal: a stored scale never underflows
FLOAT32_SLACK = 1e-6  # relative: the float32 divide and multiply around the cast
# vLLM's headroom (envs.K_SCALE_CONSTANT, V_SCALE_CONSTANT): scale = amax / range, per role
VLLM_RANGE = {"K": 200.0, "V": 100.0}
SCALES = ("layer", "head", "tensor", "unit")


class FP8(FitsOnFirstWrite, Quantizer):
    name = "fp8"
    description = ("fp8 KV (e4m3 / e5m2, torch's saturating float8 casts), vLLM's per-layer scale (amax/200 K, "
                   "amax/100 V) or a per-kv-head scale, from the first write")
    aliases = {"fp8-e4m3": {"format": "e4m3"}, "fp8-e5m2": {"format": "e5m2"},
               "fp8-e4m3-head": {"format": "e4m3", "scale": "head"}}
    example_specs = ("fp8-e4m3", "fp8-e5m2")
    fit_per_row = False  # the kernels read scale [H] (module docstring): one fit over all rows

    @dataclasses.dataclass
    class Config:
        format: str = "e4m3"  # or "e5m2"
        scale: str = "layer"  # or "head", "tensor", "unit"

    def validate_config(self):
        c = self.config
        if c.format not in FORMATS:
            raise QuantizerInputError(f"fp8: format must be one of {sorted(FORMATS)}, got {c.format!r}")
        if c.scale not in SCALES:
            raise QuantizerInputError(f"fp8: scale must be one of {', '.join(SCALES)}, got {c.scale!r}")

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.config.format][0]

    @property
    def max_value(self) -> float:
        return float(torch.finfo(self.dtype).max)

    # ---- the scale ------------------------------------------------------------------
    def make_shared(self, heads, head_dim):
        n = 1 if self.config.scale == "layer" else heads
        return {"scale": torch.ones(n, dtype=torch.float16)}  # replaced at the first write

    def fit_shared(self, x, shared):
        H = x.shape[1]
        if self.config.scale == "unit":
            return {"scale": torch.ones(H, dtype=torch.float16, device=x.device)}
        if self.config.scale == "layer":  # vLLM: |x|.max() / range over the whole first write
            s = (x.abs().amax().reshape(1) / VLLM_RANGE[self.role]).clamp(min=MIN_SCALE)
            check_fp16_storable("fp8 scale", s)
            return {"scale": s.half().contiguous()}
        amax = x.abs().transpose(0, 1).reshape(H, -1).amax(-1)  # [H]
        if self.config.scale == "tensor":
            amax = amax.amax().expand(H)
        s = (amax / self.max_value).clamp(min=MIN_SCALE)
        check_fp16_storable("fp8 scale", s)
        return {"scale": s.half().contiguous()}

    # ---- encode / decode --------------------------------------------------------------
    def _scaled(self, x, scale):
        return x / scale.float().view(1, -1, 1, 1)

    def encode_tokens(self, x, shared):
        m = self.max_value
        codes = self._scaled(x, shared["scale"]).clamp(-m, m).to(self.dtype)
        return Segment({"codes": codes.view(torch.uint8)}, x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        return seg.fields["codes"].view(self.dtype).float() * shared["scale"].float().view(1, -1, 1, 1)

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        return 8.0

    def error_bound(self, x):
        """Per element, in units of the scale: the clipping |v| - max beyond the
        range, plus fp8 rounding: half an ulp, at most |v| 2^-(m+1) for normals
        and 2^(e_min - m - 1) in the subnormal range (m mantissa bits); times the
        scale, plus float32 slack. x coded with the scale of `fitted_shared(x)`."""
        _, mant, e_min = FORMATS[self.config.format]
        s = self.fitted_shared(x)["scale"].float().view(1, -1, 1, 1)
        v = self._scaled(x.float(), s[0, :, 0, 0]).abs()
        clip = (v - self.max_value).clamp(min=0)
        rounding = torch.maximum(v.clamp(max=self.max_value) * 2.0 ** -(mant + 1),
                                 torch.full_like(v, 2.0 ** (e_min - mant - 1)))
        per_elem = (clip + rounding) * s + FLOAT32_SLACK * x.float().abs()
        return per_elem.pow(2).sum(-1).sqrt()
