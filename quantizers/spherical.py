"""Spherical random quantizer (TurboQuant-style), calibration-free: the
`spherical random` baseline of METHOD.md section 2.

Each K/V token vector x (one kv-head, length D) is rotated by a seeded random
orthogonal matrix O of its (layer, role, kv-head): y = O x. After a random
rotation every coordinate of the unit vector u = y/||y|| is close to N(0, 1/D)
whatever x was, so one fixed scalar codebook serves every coordinate: the
Lloyd-Max quantizer of N(0, 1/D) with 2^bits levels, computed at init by
Lloyd's iterations on the Gaussian density (closed-form cell centroids), never
from data, then rounded to fp16 values. It is a deterministic function of
(bits, D) and is not stored, like HQMQ's 2T. Each coordinate of u gets the
nearest level: v.

Gain (`gain`): "lsq" (default) stores the least-squares scale g of the decoded
direction w = O^T v, g = <x, w>/||w||^2, and decodes g w: the best scale for
those codes, so never worse than the norm, at the same 16 bits. "norm" stores
||y|| and decodes ||y|| O^T v/||v||: renormalising v matters there, since the
Lloyd-Max codes shrink the vector (E||v||^2 = 1 - mse) and the true norm would
otherwise be applied to a short vector.

Rotation (`rotation`): "dense" (default) is a Haar rotation, the Q of a QR of
a seeded Gaussian with its signs fixed by diag(R) > 0, stored fp16 [H, D, D]
(amortised over the cache: D*D*16 bits per kv-head, 2 bits per element at
1024 tokens, fading only at long context). "hadamard" is the randomised
Hadamard O = W diag(s)/sqrt(D) (W Sylvester's, s seeded signs stored as 1 bit
each; D a power of two): D bits per kv-head. Decode applies exactly the stored
values (O^T from the fp16 matrix, or from the signs); encode applies the exact
inverse of that matrix (not its transpose: fp16 leaves it ~1e-3 from
orthogonal), so the coordinates coded are exactly those decode reads and the
fp16 storage costs no error beyond a condition number of 1 + ~1e-3.

Stored per token vector: D codes of `bits` bits, bit-packed (`codes`), and the
fp16 gain (`gain`). Per (layer, role): the `rotation` of each kv-head (fp16
[H, D, D]), or its `signs` (uint8 [H, D/8]) with rotation=hadamard.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable
from .packing import pack_bits, unpack_bits

LLOYD_MAX_ITERS = 1000  # upper limit; stops once the levels move < 1e-13


@functools.lru_cache(maxsize=None)
def lloyd_max_gaussian(levels: int) -> tuple[float, ...]:
    """The `levels` Lloyd-Max reconstruction levels of N(0, 1), ascending,
    exactly symmetric. Lloyd's iteration with the closed-form centroid of a
    Gaussian cell, E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a)),
    from the quantile midpoints; float64 on CPU, so deterministic."""
    q = torch.special.ndtri((torch.arange(levels, dtype=torch.float64) + 0.5) / levels)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(LLOYD_MAX_ITERS):
        edges = torch.cat([-inf, (q[1:] + q[:-1]) / 2, inf])
        pdf = torch.exp(-edges**2 / 2) / math.sqrt(2 * math.pi)  # 0 at +-inf
        new = (pdf[:-1] - pdf[1:]) / (torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1]))
        done = float((new - q).abs().max()) < 1e-13
        q = new
        if done:
            break
    return tuple(((q - q.flip(0)) / 2).tolist())


def sylvester_hadamard(d: int) -> torch.Tensor:
    w = torch.ones(1, 1)
    while w.shape[0] < d:
        w = torch.cat([torch.cat([w, w], 1), torch.cat([w, -w], 1)], 0)
    return w


class Spherical(Quantizer):
    name = "spherical"
    description = "TurboQuant-style: seeded random rotation, Lloyd-Max N(0,1/D) scalar codes per coordinate, fp16 gain"
    # The aliases use the randomised Hadamard rotation: its D bits per kv-head keep
    # the measured bits at the formula's, where a dense fp16 rotation adds 2 bits
    # per element at 1024 tokens for no better coding.
    aliases = {f"spherical{b}": {"bits": b, "rotation": "hadamard"} for b in (2, 3, 4)}
    example_specs = ("spherical3", "spherical4")

    @dataclasses.dataclass
    class Config:
        bits: int = 4
        gain: str = "lsq"  # or "norm"
        rotation: str = "dense"  # or "hadamard"

    def validate_config(self):
        c = self.config
        if not 1 <= c.bits <= 8:
            raise QuantizerInputError(f"spherical: bits must be in 1..8, got {c.bits}")
        if c.gain not in ("lsq", "norm"):
            raise QuantizerInputError(f"spherical: gain must be lsq or norm, got {c.gain!r}")
        if c.rotation not in ("dense", "hadamard"):
            raise QuantizerInputError(f"spherical: rotation must be dense or hadamard, got {c.rotation!r}")

    # ---- the rotation -----------------------------------------------------------------
    def make_shared(self, heads, head_dim):
        if self.config.rotation == "hadamard":
            if head_dim & (head_dim - 1):
                raise QuantizerInputError(f"spherical: rotation=hadamard needs a power-of-two head_dim, got {head_dim}")
            signs = []
            for h in range(heads):
                g = torch.Generator().manual_seed(self.head_seed(h))
                signs.append(torch.randint(0, 2, (head_dim,), generator=g))
            return {"signs": pack_bits(torch.stack(signs), 1)}  # [H, D/8]; bit 1 = negative
        rots = []
        for h in range(heads):
            g = torch.Generator().manual_seed(self.head_seed(h))
            q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
            rots.append(q * torch.sign(torch.diagonal(r)))  # sign fix: the unique QR with diag(R) > 0
        return {"rotation": torch.stack(rots).half()}  # [H, D, D]

    def matrices(self, shared, head_dim: int, device):
        """Decode is x = c * (y @ M) for rows y (x = O^T y in columns), with M
        exactly the stored values: the fp16 rotation (c = 1), or W diag(s) with
        entries +-1 (c = 1/sqrt(D)). Returns float64 (M, c, A_inv), A_inv the
        inverse of A = c M, which encode uses: y = x @ A_inv are then exactly the
        coordinates decode reads, so fp16 storage of O costs the coding nothing.
        A_inv comes from Newton-Schulz steps X <- X (2I - A X) from X = A^T, which
        square the ~1e-3 error of the fp16 rotation each step (exact for
        hadamard): deterministic, no solver."""
        if self.config.rotation == "hadamard":
            s = 1 - 2 * unpack_bits(shared["signs"].to(device), 1, head_dim).double()  # [H, D]
            m = sylvester_hadamard(head_dim).double().to(device) * s.unsqueeze(-2)  # W diag(s)
            c = 1 / math.sqrt(head_dim)
        else:
            m, c = shared["rotation"].to(device).double(), 1.0
        a = m * c
        eye = torch.eye(head_dim, dtype=torch.float64, device=device)
        inv = a.transpose(-1, -2)
        for _ in range(3):
            inv = inv @ (2 * eye - a @ inv)
        return m, c, inv

    # ---- the scalar codebook ---------------------------------------------------------
    def levels(self, head_dim: int, device):
        """float64 levels of N(0, 1/D), rounded to fp16 values (see `_unscaled`),
        and the midpoints between them (cell edges)."""
        lv = torch.tensor(lloyd_max_gaussian(1 << self.config.bits), dtype=torch.float64) / math.sqrt(head_dim)
        lv = lv.half().double().to(device)
        return lv, (lv[1:] + lv[:-1]) / 2

    # Everything below runs in float64 so the stored codes and gains do not hang on
    # the order a matmul of a given batch shape sums in: one token written alone
    # stores what it stores inside a long write (append_matches_single_write).
    def _coords(self, x, mats):
        """y = x A^-1 of every token vector, its norm and unit direction u."""
        y = torch.matmul(x.double(), mats[2])
        n = y.norm(dim=-1, keepdim=True)
        return y, n, y / torch.where(n > 0, n, torch.ones_like(n))  # x = 0 -> u = 0, gain 0

    @staticmethod
    def _unscaled(v, mats):
        """v @ M in float64: EXACT, hence the same for any batch shape or summation
        order. v is on the fp16 grid and M is fp16 or +-1, so every product fits
        in 22 significant bits at a multiple of 2^-48, and every partial sum is
        below 2^3 (|v| <= sqrt(D) max|level| < 4, M's columns near unit length;
        or <= sqrt(D)*4 with +-1 entries): within float64's 53 bits."""
        return torch.matmul(v, mats[0])

    # ---- encode / decode --------------------------------------------------------------
    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        mats = self.matrices(shared, D, x.device)
        y, n, u = self._coords(x, mats)
        lv, edges = self.levels(D, x.device)
        codes = torch.bucketize(u, edges)  # nearest level: cells are split at the midpoints
        if self.config.gain == "lsq":
            w = self._unscaled(lv[codes], mats) * mats[1]  # what decode returns for gain 1; != 0
            g = (x.double() * w).sum(-1) / w.pow(2).sum(-1)  # (no level is 0, A is invertible)
        else:
            g = n.squeeze(-1)
        check_fp16_storable("spherical gain", g)
        return Segment({"codes": pack_bits(codes, self.config.bits), "gain": g.half()}, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        g = seg.fields["gain"].double()
        mats = self.matrices(shared, D, g.device)
        lv, _ = self.levels(D, g.device)
        v = lv[unpack_bits(seg.fields["codes"], self.config.bits, D)]
        scale = g * mats[1]
        if self.config.gain == "norm":
            scale = scale / v.pow(2).sum(-1).sqrt()  # exact sum too: fp16-grid squares
        return (self._unscaled(v, mats) * scale.unsqueeze(-1)).float()

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        return self.config.bits + 16 / head_dim

    def error_bound(self, x):
        """Per coordinate of u: at most the largest distance from the level of
        its cell to that cell's edges (for an outer cell, to u itself: the
        clipping error). Their L2 sum eps bounds ||u - v||, so the angle between
        u and v is at most asin(eps) and ||u - v/||v|||| <= f = 2 sin(asin(eps)/2)
        (2 when eps >= 1). Decoding ||y|| v/||v|| then errs by at most
        sigma_max(A) ||y|| f <= kappa(A) ||x|| f, and the lsq gain is the best
        scale for v, so no worse. Add the fp16 rounding of the gain (relative
        2^-11, times kappa; absolute 2^-25 times ||v @ A|| <= sigma_max sqrt(D)
        max|level|) and slack for the float32 output."""
        D = x.shape[-1]
        mats = self.matrices(self.empty(x).shared, D, x.device)
        _, n, u = self._coords(x, mats)
        lv, edges = self.levels(D, x.device)
        k = torch.bucketize(u, edges)
        c = lv[k]
        inf = edges.new_tensor([math.inf])
        lo, hi = torch.cat([-inf, edges])[k], torch.cat([edges, inf])[k]
        lo = torch.where(torch.isinf(lo), torch.minimum(u, c), lo)
        hi = torch.where(torch.isinf(hi), torch.maximum(u, c), hi)
        eps = (torch.maximum(c - lo, hi - c) + 1e-12).pow(2).sum(-1).sqrt()
        f = torch.where(eps < 1, 2 * torch.sin(torch.asin(eps.clamp(max=1.0)) / 2), torch.full_like(eps, 2.0))
        sv = torch.linalg.svdvals(mats[0].cpu() * mats[1]).to(x.device)  # [H, D], descending
        smax, kappa = sv[:, 0].view(-1, 1), (sv[:, 0] / sv[:, -1]).view(-1, 1)  # per kv-head
        v_max = math.sqrt(D) * float(lv.abs().max())
        nx = x.double().norm(dim=-1)
        bound = nx * kappa * (f + 2.0**-11) + 2.0**-25 * smax * max(1.0, v_max)
        return (bound * (1 + 1e-6) + 1e-6 * nx).float()
