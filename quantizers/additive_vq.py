"""Additive (residual) VQ, CommVQ-style, calibration-free: the `additive VQ`
baseline of METHOD.md section 2.

Each K/V token vector x (one kv-head, length D) is divided by its RMS
s = ||x||/sqrt(D) (stored fp16; encode divides by the stored value), and the
normalised vector z is cut into D/dim chunks of `dim` elements. Each chunk is
coded as a sum of M codewords, one from each of M codebooks of K = 2^K_bits
codewords, by greedy residual coding (stage m picks the codeword nearest to
what stages 1..m-1 left over) or, with beam > 1, a beam search over the stages
keeping the `beam` best partial sums.

Codebooks: seeded Gaussian, one set of M per (layer, role, kv-head) (or one
set shared by every kv-head of the (layer, role) with per_head=false).
Codeword 0 of every codebook is the zero vector, so a stage can always
decline to code: the residual norm never grows, which is what makes the error
bound sound. Stage m's codewords are N(0, gain_m^2 I); the gains are fixed
once, as a function of (M, K_bits, dim) only, by greedily coding SYNTHETIC
seeded N(0, I) chunks (the law of z's chunks when x is isotropic) and picking,
per stage, the gain on a grid that leaves the least residual energy. No real
data and no calibration is ever used. The stored fp16 codebooks are what
encode and decode use.

Gain (`gain`): "lsq" (default) replaces the stored RMS, after coding, by the
least-squares scale <x, zhat>/||zhat||^2 of the decoded vector: the best scale
for those codes, at the same 16 bits. "rms" keeps s.

Stored per token vector: (D/dim)*M codes of K_bits bits, bit-packed, in
(chunk, stage) order (`codes`), and the fp16 gain (`gain`). Per (layer, role):
the codebooks, fp16 [H, M, K, dim] ([1, M, K, dim] with per_head=false),
amortised over the cache.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable, stable_seed
from .packing import pack_bits, unpack_bits

SCORE_BLOCK = 1 << 24  # elements of the [.., chunks, beam, K] score temporary per block (GPU)
SCORE_BLOCK_CPU = 1 << 20  # smaller on CPU, where a block that fits in cache is faster
GAIN_SAMPLES = 4096  # synthetic chunks used to fix the stage gains
GAIN_GRID = torch.linspace(0.2, 1.4, 13, dtype=torch.float64)  # x sqrt(residual energy per element)


def gaussian_codebooks(M: int, K: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """[M, K, dim] standard Gaussian codewords, codeword 0 of each stage zero."""
    cb = torch.randn(M, K, dim, generator=gen, dtype=torch.float64)
    cb[:, 0] = 0
    return cb


def residual_search(r: torch.Tensor, cb: torch.Tensor, beam: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Code chunks r `[B, G, N, dim]` with codebooks cb `[G or 1, M, K, dim]`.
    Returns codes `[B, G, N, M]` and the final residual `[B, G, N, dim]`.
    Scores ||r - c||^2 - ||r||^2 = ||c||^2 - 2 <r, c> with one matmul per stage,
    over blocks of chunks so the score temporary stays under a fixed size."""
    B, G, N, dim = r.shape
    _, M, K, _ = cb.shape
    # Scores in float64: the codes must not hang on the order a matmul of this
    # batch shape sums in (a token written alone stores what it stores inside a
    # long write); residuals stay in r's dtype, updated elementwise.
    cnorm = cb.double().pow(2).sum(-1).unsqueeze(-2)  # [G, M, 1, K]
    cb_t = cb.double().transpose(-1, -2) * -2  # [G, M, dim, K]
    heads = torch.arange(cb.shape[0], device=r.device).view(1, -1, 1, 1)
    limit = SCORE_BLOCK if r.is_cuda else SCORE_BLOCK_CPU
    block = max(1, limit // max(1, B * G * beam * K))
    codes_out, res_out = [], []
    for start in range(0, N, block):
        res = r[:, :, start : start + block]
        n = res.shape[2]
        if beam == 1:  # greedy: the nearest codeword of each stage
            codes = []
            for m in range(M):
                idx = torch.matmul(res.double(), cb_t[:, m]).add_(cnorm[:, m]).argmin(-1)  # first minimum on ties
                res = res - cb[:, m][heads[..., 0], idx]  # idx is [B, G, n]
                codes.append(idx)
            codes_out.append(torch.stack(codes, -1))
            res_out.append(res)
            continue
        # beam search: keep the `beam` best partial sums, ranked by ||residual||^2
        res = res.unsqueeze(3)  # [B, G, n, b, dim], b = 1 at first
        err = res.double().pow(2).sum(-1)  # [B, G, n, b]
        codes = res.new_zeros(B, G, n, 1, 0, dtype=torch.long)
        for m in range(M):
            b = res.shape[3]
            score = torch.matmul(res.flatten(2, 3).double(), cb_t[:, m]).add_(cnorm[:, m]).view(B, G, n, b, K)
            err, flat = score.add_(err.unsqueeze(-1)).flatten(3).topk(min(beam, b * K), dim=-1, largest=False)
            src, idx = flat // K, flat % K  # which beam it extends, with which codeword
            res = res.gather(3, src.unsqueeze(-1).expand(*src.shape, dim)) - cb[:, m][heads, idx]
            codes = torch.cat([codes.gather(3, src.unsqueeze(-1).expand(*src.shape, m)), idx.unsqueeze(-1)], -1)
        codes_out.append(codes[:, :, :, 0])  # the best beam: topk sorts ascending
        res_out.append(res[:, :, :, 0])
    return torch.cat(codes_out, 2), torch.cat(res_out, 2)


@functools.lru_cache(maxsize=None)
def stage_gains(M: int, K_bits: int, dim: int) -> tuple[float, ...]:
    """Codeword std of each stage, fixed on synthetic seeded N(0, I) chunks by
    greedy residual coding (also used for beam > 1): per stage, the grid gain
    leaving the least residual energy. float64 on CPU: deterministic."""
    gen = torch.Generator().manual_seed(stable_seed("avq-gains", M, K_bits, dim))
    data = torch.randn(1, 1, GAIN_SAMPLES, dim, generator=gen, dtype=torch.float64)
    unit = gaussian_codebooks(M, 1 << K_bits, dim, gen)
    gains = []
    for m in range(M):
        scale = math.sqrt(float(data.pow(2).mean()))  # residual energy per element so far
        best = None
        for a in (GAIN_GRID * scale).tolist():
            _, res = residual_search(data, unit[None, m : m + 1] * a, 1)
            e = float(res.pow(2).mean())
            if best is None or e < best[0]:
                best = (e, a, res)
        gains.append(best[1])
        data = best[2]
    return tuple(gains)


class AdditiveVQ(Quantizer):
    name = "avq"
    description = "additive VQ (CommVQ-style): RMS gain, chunks of dim coded as sums of M seeded Gaussian codewords"
    # The aliases share one codebook set across kv-heads: seeded codebooks adapt to
    # nothing, so per-head sets buy only seed diversity, at H times the amortised
    # bytes (per head, M=4 costs 1 bit per element at 1024 tokens of 8 heads).
    aliases = {f"avq{m}": {"M": m, "per_head": False} for m in (2, 3, 4)}
    # beam=8 costs ~13x the greedy encode and cuts the MSE by ~40% at 4 bits
    example_specs = ("avq3", "avq4")  # near HQMQ's bits; beam=8 is ~10x slower to encode: an option

    @dataclasses.dataclass
    class Config:
        M: int = 2
        K_bits: int = 8
        dim: int = 8
        beam: int = 1
        gain: str = "lsq"  # or "rms"
        per_head: bool = True

    def validate_config(self):
        c = self.config
        if not 1 <= c.M <= 16:
            raise QuantizerInputError(f"avq: M (codebooks) must be in 1..16, got {c.M}")
        if not 1 <= c.K_bits <= 16:
            raise QuantizerInputError(f"avq: K_bits must be in 1..16, got {c.K_bits}")
        if not 1 <= c.dim <= 256:
            raise QuantizerInputError(f"avq: dim (chunk length) must be in 1..256, got {c.dim}")
        if not 1 <= c.beam <= 64:
            raise QuantizerInputError(f"avq: beam must be in 1..64, got {c.beam}")
        if c.gain not in ("lsq", "rms"):
            raise QuantizerInputError(f"avq: gain must be lsq or rms, got {c.gain!r}")
        self.head_dim_multiple = c.dim  # chunks must tile the head vector

    # ---- codebooks ---------------------------------------------------------------
    def make_shared(self, heads, head_dim):
        c = self.config
        g = torch.tensor(stage_gains(c.M, c.K_bits, c.dim), dtype=torch.float64).view(-1, 1, 1)
        if c.per_head:
            seeds = [self.head_seed(h) for h in range(heads)]
        else:
            seeds = [stable_seed(self.name, self.seed, self.layer, "all-heads", self.role)]
        cbs = [gaussian_codebooks(c.M, 1 << c.K_bits, c.dim, torch.Generator().manual_seed(s)) * g for s in seeds]
        return {"codebooks": torch.stack(cbs).half()}  # [H or 1, M, K, dim]

    # ---- encode / decode --------------------------------------------------------------
    def _normalise(self, x):
        s = x.double().norm(dim=-1) / math.sqrt(x.shape[-1])  # float64: see residual_search
        check_fp16_storable("avq RMS scale", s)
        s16 = s.half().float()
        return x / torch.where(s16 > 0, s16, torch.ones_like(s16)).unsqueeze(-1), s16

    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        c = self.config
        z, s = self._normalise(x)
        cb = shared["codebooks"].float()
        codes, res = residual_search(z.reshape(B, H, T * (D // c.dim), c.dim), cb, c.beam)
        if c.gain == "lsq":
            zhat = self._decoded(codes, shared, (B, H, T, D)).double()  # exactly what decode sums
            nz = zhat.pow(2).sum(-1)
            s = (x.double() * zhat).sum(-1) / torch.where(nz > 0, nz, torch.ones_like(nz))  # zhat = 0 -> 0
            check_fp16_storable("avq gain", s)
        codes = codes.reshape(B, H, T, -1)  # (chunk, stage) order
        return Segment({"codes": pack_bits(codes, c.K_bits), "gain": s.half()}, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        c = self.config
        codes = unpack_bits(seg.fields["codes"], c.K_bits, D // c.dim * c.M)
        return self._decoded(codes, shared, shape) * seg.fields["gain"].float().unsqueeze(-1)

    def _decoded(self, codes, shared, shape):
        """The normalised vector zhat, float32, from codes `[B, H, T, nc*M]` or `[B, H, T*nc, M]`."""
        B, H, T, D = shape
        c = self.config
        nc = D // c.dim
        codes = codes.reshape(B, H, T, nc, c.M)
        cb = shared["codebooks"].float()
        heads = torch.arange(cb.shape[0], device=codes.device).view(1, -1, 1, 1)
        out = torch.zeros(B, H, T, nc, c.dim, device=codes.device)
        for m in range(c.M):  # one stage at a time: no [.., M, dim] temporary
            out += cb[:, m][heads, codes[..., m]]
        return out.reshape(B, H, T, D)

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        c = self.config
        return c.M * c.K_bits / c.dim + 16 / head_dim

    def error_bound(self, x):
        """The zero codeword keeps every chunk's residual no longer than the chunk,
        so ||z - zhat|| <= ||z|| and the RMS gain errs by at most ||x|| (decode is
        0 if the RMS rounds to fp16 zero: an error of ||x|| again). lsq is the
        best scale for zhat, so no worse, plus its fp16 rounding: relative 2^-11
        of |<x, zhat>|/||zhat|| <= ||x||, and an absolute 2^-25 times ||zhat|| <=
        2||z|| <= 3 sqrt(D) (||z|| is at most 1.5 sqrt(D) even when the RMS is
        an fp16 subnormal). The slack covers float32 arithmetic. A tighter bound
        would need the covering radius of random codebooks, which no formula gives."""
        n = x.double().norm(dim=-1)
        if self.config.gain == "lsq":
            n = n * (1 + 2.0**-11) + 2.0**-25 * 3 * math.sqrt(x.shape[-1])
        return (n * (1 + 1e-5) + 1e-30).float()
