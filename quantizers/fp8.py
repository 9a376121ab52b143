"""fp8 KV cache: the deployed format (vLLM, TensorRT-LLM, SGLang `kv_cache_dtype=fp8`).

Each element is stored as one fp8 number, e4m3 (`float8_e4m3fn`: 3 mantissa
bits, max 448, no inf) or e5m2 (2 mantissa bits, max 57344), of x / scale:

    code = (x / scale).clamp(-max, max).to(float8)     decode = code.float() * scale

exactly torch's own float8 cast (round to nearest even) of the clamped value;
values beyond the scale's range saturate to +-max.

Scale (`scale`), calibration-free: "head" (default): one scale per kv-head,
amax / max over that head's values in the first write (all batch rows);
"tensor": one amax over the whole first write, the same for every head;
"unit": 1.0, vLLM's default when a checkpoint ships no scales. Fitted scales
are fixed at the first write and reused by every later append, like vLLM's
`calculate_kv_scales` (see fitted.py); a later token larger than the first
write's amax saturates. The fit is NOT per row: one scale per kv-head over all
batch rows of the first write (`fit_per_row = False`), because the fused decode
kernels and the device step encoder (kernels/) read the scale as `[H]`; a
per-row scale would be `[B, H]`. A batch harness therefore scores fp8 one
window at a time (suites/harness/perplexity.py `rows_independent`), where the
scale is each window's own, as a deployed per-sequence cache would fit it. The scale is stored fp16, clamped to at least 2^-14
(fp16's smallest normal) so it never underflows; tiny inputs then code into
fp8 subnormals, which the error bound covers.

Stored format (the fused kernel reads exactly this):
- per segment, `codes`: uint8 `[B, H, T, D]`, the fp8 bit patterns
  (`codes.view(torch.float8_e4m3fn)` or `float8_e5m2` gives the numbers);
- per (layer, role), `scale`: fp16 `[H]`, one per kv-head (all equal with
  scale=tensor or unit). Decode: `codes.view(fp8).float() * scale[h]`.
Bits per element: 8 plus 16 H bits per cache, amortised.
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


class FP8(FitsOnFirstWrite, Quantizer):
    name = "fp8"
    description = "fp8 KV (e4m3 / e5m2, torch's float8 casts), per-kv-head or per-tensor scale from the first write"
    aliases = {"fp8-e4m3": {"format": "e4m3"}, "fp8-e5m2": {"format": "e5m2"}}
    example_specs = ("fp8-e4m3", "fp8-e5m2")
    fit_per_row = False  # the kernels read scale [H] (module docstring): one fit over all rows

    @dataclasses.dataclass
    class Config:
        format: str = "e4m3"  # or "e5m2"
        scale: str = "head"  # or "tensor", "unit"

    def validate_config(self):
        c = self.config
        if c.format not in FORMATS:
            raise QuantizerInputError(f"fp8: format must be one of {sorted(FORMATS)}, got {c.format!r}")
        if c.scale not in ("head", "tensor", "unit"):
            raise QuantizerInputError(f"fp8: scale must be head, tensor or unit, got {c.scale!r}")

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.config.format][0]

    @property
    def max_value(self) -> float:
        return float(torch.finfo(self.dtype).max)

    # ---- the scale ------------------------------------------------------------------
    def make_shared(self, heads, head_dim):
        return {"scale": torch.ones(heads, dtype=torch.float16)}  # replaced at the first write

    def fit_shared(self, x, shared):
        H = x.shape[1]
        if self.config.scale == "unit":
            return {"scale": torch.ones(H, dtype=torch.float16, device=x.device)}
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
