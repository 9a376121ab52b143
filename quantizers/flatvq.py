"""Flat learned VQ (VPTQ-style, the seed paper's other contrast to HQMQ): one
k-means codebook over `dim`-element sub-vectors, each sub-vector stored as the
index of its nearest codeword.

Calibration-free per write: the codebook is fitted on the data being written,
with no calibration set. The first write into a cache fits it (fitted.py),
later appends code with it unchanged; under quantize-on-write each window is
one write and gets its own codebook, which it pays for: the fp16 codebook is
a stored, counted field, amortised over the cache (K * dim * 16 bits per
kv-head, or per (layer, role) with per_head=false).

The fit is per row (per sequence): a cache of B batch rows stores B codebooks,
row b's fitted on row b's tokens alone and coding row b only, so a batch of
windows stores, byte for byte, what B one-window caches store (fitted.py).

Fit: Lloyd's k-means (vq.py; KMEANS_ITERS = 6 iterations from K-1 seeded
sample points, on a seeded sample of at most 16 points per codeword), K-1
centroids plus codeword 0 fixed at zero. The seeds make it stochastic.

What of VPTQ is not here: VPTQ quantizes weights offline, with second-order
(Hessian-weighted) k-means, residual VQ and outlier codebooks, and many more
iterations; here plain k-means on the write itself, no residual stage, no
per-token normalisation (the k-means sees the raw sub-vectors, key-channel
outliers included).

Stored per token vector: D/dim codes of K_bits bits, bit-packed (`codes`).
Per (layer, role) and batch row: `codebook`, fp16 [B, H, K, dim] ([B, 1, K, dim]
with per_head=false).
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable, stable_seed
from .fitted import FitsOnFirstWrite, fold_rows, row_index
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

    def make_shared(self, heads, head_dim):  # one row; a cache of B rows holds B (fitted.py)
        c = self.config
        return {"codebook": torch.zeros(1, heads if c.per_head else 1, 1 << c.K_bits, c.dim, dtype=torch.float16)}

    def per_row_shared(self):
        return ("codebook",)

    def _chunks(self, x):
        B, H, T, D = x.shape
        return x.reshape(B, H, T * (D // self.config.dim), self.config.dim)

    def fit_shared(self, x, shared):  # x: one row [1, H, T, D]
        return self.fit_shared_rows(x, shared)

    def fit_shared_rows(self, x, shared):
        """Each row's codebook(s) fitted on its own chunks: the rows' point sets are groups of
        one k-means (fitted.py fit_shared_rows), each drawing what a one-row fit draws (one
        generator per (layer, role), the same permutation for every group)."""
        c = self.config
        B, H = x.shape[:2]
        pts = self._chunks(x).reshape(B, H, -1, c.dim)  # [B, H, N, dim]
        if not c.per_head:
            pts = pts.reshape(B, 1, -1, c.dim)
        gen = torch.Generator().manual_seed(stable_seed(self.name, self.seed, self.layer, self.role, "fit"))
        cb = fit_codebook_with_zero(pts.flatten(0, 1), 1 << c.K_bits, gen)
        check_fp16_storable("flatvq codeword", cb)
        return {"codebook": cb.half().view(B, pts.shape[1], *cb.shape[1:])}

    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        # Row b's chunks meet row b's codebook (fold_rows): the same float64 scores as a
        # one-row write of row b.
        r, cb = fold_rows(self._chunks(x), shared["codebook"].float().unsqueeze(2))  # M = 1 stage
        codes, _ = residual_search(r, cb, 1)
        return Segment({"codes": pack_bits(codes.reshape(B, H, T, -1), self.config.K_bits)}, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        codes = unpack_bits(seg.fields["codes"], self.config.K_bits, D // self.config.dim)
        cb = shared["codebook"].float()  # [1 or B, H or 1, K, dim]
        heads = torch.arange(cb.shape[1], device=codes.device).view(1, -1, 1, 1)
        return cb[row_index(cb, 4), heads, codes].reshape(B, H, T, D)

    def formula_bits(self, head_dim):
        return self.config.K_bits / self.config.dim

    def error_bound(self, x):
        """For x coded with `fitted_shared(x)` (fitted.py): each sub-vector's distance to the nearest
        codeword of the fitted fp16 codebook, by brute force over every codeword
        (independent of the encoder's search; the zero codeword keeps it <= the
        sub-vector's norm), summed in quadrature, plus float32 slack."""
        B, H = x.shape[:2]
        cb = self.fitted_shared(x)["codebook"].double()  # [1 or B, H or 1, K, dim]
        cb = cb.expand(B, H, *cb.shape[2:])  # row b's codebook of each kv-head
        ch = self._chunks(x.double())  # [B, H, N, dim]
        d2 = torch.stack([  # ||x - c||^2 = ||x||^2 - 2 <x, c> + ||c||^2, one batch row at a time
            (ch[b].pow(2).sum(-1, keepdim=True) - 2 * ch[b] @ cb[b].transpose(1, 2) + cb[b].pow(2).sum(-1).unsqueeze(1))
            .amin(-1).clamp(min=0) for b in range(B)])  # [B, H, N]
        d2 = d2.reshape(*x.shape[:3], -1).sum(-1)
        return (d2.sqrt() * (1 + BOUND_SLACK) + BOUND_SLACK * x.double().norm(dim=-1)).float()
