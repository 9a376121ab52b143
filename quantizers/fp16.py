"""fp16: the identity baseline (16 bits); what an unquantized cache stores."""
from __future__ import annotations

import dataclasses

from .base import Quantizer, Segment, check_fp16_storable, fp16_rounding_bound


class FP16(Quantizer):
    name = "fp16"
    description = "identity: K/V stored as fp16 (the unquantized baseline)"

    @dataclasses.dataclass
    class Config:
        pass

    def encode_tokens(self, x, shared):
        check_fp16_storable("input", x)
        return Segment({"values": x.half()}, x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        return seg.fields["values"].float()

    def formula_bits(self, head_dim):
        return 16.0

    def error_bound(self, x):
        return fp16_rounding_bound(x).norm(dim=-1)  # half an ulp, subnormals included
