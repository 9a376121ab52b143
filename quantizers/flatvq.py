"""Flat learned VQ (VPTQ-style, the seed paper's other contrast to HQMQ): one
k-means codebook over `dim`-element sub-vectors, each sub-vector stored as the
index of its nearest codeword.

Calibration-free per write: the codebook is fitted on the data being written,
with no calibration set. The first write into a cache fits it (fitted.py),
later appends code with it unchanged; under quantize-on-write each window is
one write and gets its own codebook, which it pays for: the fp16 codebook is
a stored, counted field, amortised over the cache (K * dim * 16 bits per
kv-head, or per (layer, role) with per_head=false).

Fit: Lloyd's k-means (vq.py; KMEANS_ITERS = 6 iterations from K-1 seeded
sample points, on a seeded sample of at most 16 points per codeword), K-1
centroids plus codeword 0 fixed at zero. The seeds make it stochastic.

What of VPTQ is not here: VPTQ quantizes weights offline, with second-order
(Hessian-weighted) k-means, residual VQ and outlier codebooks, and many more
iterations; here plain k-means on the write itself, no residual stage, no
per-token normalisation (the k-means sees the raw sub-vectors, key-channel
outliers included).

Stored per token vector: D/dim codes of K_bits bits, bit-packed (`codes`).
Per (layer, role): `codebook`, fp16 [H, K, dim] ([1, K, dim] with per_head=false).
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable, stable_seed
from .fitted import FitsOnFirstWrite
from .packing import pack_bits, unpack_bits
from .vq import fit_codebook_with_zero, residual_search

BOUND_SLACK = 1e-5  # relative: float32 decode of fp16 codewords vs the float64 distances


class FlatVQ(FitsOnFirstWrite, Quantizer):
    name = "flatvq"
    description = "flat VQ (VPTQ-style): one k-means codebook over dim-element sub-vectors, fitted on the write"
    stochastic = True  # seeded k-means start and sample
    # Measured at 512 tokens of a 64-dim head, codebook included: ~2.5 and ~4.25
    # bits. Larger K costs a fit per write that the CPU sweep cannot afford.
    example_specs = ("flatvq:dim=4,K_bits=8", "flatvq:dim=2,K_bits=8")

    @dataclasses.dataclass
    class Config:
        dim: int = 4
        K_bits: int = 8
        per_head: bool = True

    def validate_config(self):
        c = self.config
        if not 1 <= c.dim <= 64:
            raise QuantizerInputError(f"flatvq: dim (sub-vector length) must be in 1..64, got {c.dim}")
        if not 1 <= c.K_bits <= 14:
            raise QuantizerInputError(f"flatvq: K_bits must be in 1..14, got {c.K_bits}")
        self.head_dim_multiple = c.dim  # sub-vectors tile the head vector

    def make_shared(self, heads, head_dim):
        c = self.config
        return {"codebook": torch.zeros(heads if c.per_head else 1, 1 << c.K_bits, c.dim, dtype=torch.float16)}

    def _chunks(self, x):
        B, H, T, D = x.shape
        return x.reshape(B, H, T * (D // self.config.dim), self.config.dim)

    def fit_shared(self, x, shared):
        c = self.config
        pts = self._chunks(x).transpose(0, 1).reshape(x.shape[1], -1, c.dim)  # [H, B*N, dim]
        if not c.per_head:
            pts = pts.reshape(1, -1, c.dim)
        gen = torch.Generator().manual_seed(stable_seed(self.name, self.seed, self.layer, self.role, "fit"))
        cb = fit_codebook_with_zero(pts, 1 << c.K_bits, gen)
        check_fp16_storable("flatvq codeword", cb)
        return {"codebook": cb.half()}

    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        codes, _ = residual_search(self._chunks(x), shared["codebook"].float().unsqueeze(1), 1)
        return Segment({"codes": pack_bits(codes.reshape(B, H, T, -1), self.config.K_bits)}, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        codes = unpack_bits(seg.fields["codes"], self.config.K_bits, D // self.config.dim)
        cb = shared["codebook"].float()
        heads = torch.arange(cb.shape[0], device=codes.device).view(1, -1, 1, 1)
        return cb[heads, codes].reshape(B, H, T, D)

    def formula_bits(self, head_dim):
        return self.config.K_bits / self.config.dim

    def error_bound(self, x):
        """For x coded with `fitted_shared(x)` (fitted.py): each sub-vector's distance to the nearest
        codeword of the fitted fp16 codebook, by brute force over every codeword
        (independent of the encoder's search; the zero codeword keeps it <= the
        sub-vector's norm), summed in quadrature, plus float32 slack."""
        cb = self.fitted_shared(x)["codebook"].double()  # [G, K, dim]
        ch = self._chunks(x.double())  # [B, H, N, dim]
        cb = cb[torch.arange(x.shape[1], device=cb.device) % cb.shape[0]]  # [H, K, dim]
        d2 = torch.stack([  # ||x - c||^2 = ||x||^2 - 2 <x, c> + ||c||^2, one batch row at a time
            (ch[b].pow(2).sum(-1, keepdim=True) - 2 * ch[b] @ cb.transpose(1, 2) + cb.pow(2).sum(-1).unsqueeze(1))
            .amin(-1).clamp(min=0) for b in range(x.shape[0])])  # [B, H, N]
        d2 = d2.reshape(*x.shape[:3], -1).sum(-1)
        return (d2.sqrt() * (1 + BOUND_SLACK) + BOUND_SLACK * x.double().norm(dim=-1)).float()
