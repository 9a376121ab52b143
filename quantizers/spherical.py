"""Spherical random quantizer (TurboQuant-style), calibration-free: the
`spherical random` baseline of METHOD.md section 2.

Each K/V token vector x (one kv-head, length D) is rotated by a seeded random
orthogonal matrix O of its (layer, role, kv-head): y = O x. After a random
rotation every coordinate of the unit vector u = y/||y|| is close to N(0, 1/D)
whatever x was, so one fixed scalar codebook serves every coordinate: the
Lloyd-Max quantizer of N(0, 1/D) with 2^bits levels, computed at init by
Lloyd's iterations on the Gaussian density (closed-form cell centroids), never
from data. It is a deterministic function of (bits, D) and is not stored, like
HQMQ's 2T.

Gain (`gain`): "lsq" (default) stores g = <y, v>/||v||^2, the least-squares
scale of the chosen code vector v, and decodes g O^T v: the best scale for
those codes, so never worse than the norm, at the same 16 bits. "norm" stores
||x|| and decodes ||x|| O^T v/||v||: renormalising v matters there, since the
Lloyd-Max codes shrink the vector (E||v||^2 = 1 - mse) and the true norm would
otherwise be applied to a short vector.

Rotation (`rotation`): "dense" (default) is a Haar rotation, the Q of a QR of
a seeded Gaussian with its signs fixed by diag(R) > 0, stored fp16 [H, D, D]
(amortised over the cache: D*D*16 bits per kv-head, which is 2 bits per
element at 1024 tokens and only fades at long context). The rotation used by
encode and decode is one Newton-Schulz step, in float64, on exactly the stored
fp16 values: fp16 storage leaves the matrix ~1e-3 from orthogonal, one step
brings that to ~1e-6, so decode's O^T undoes encode's O. "hadamard" is the
cheap randomised Hadamard O = W diag(s)/sqrt(D) (W Sylvester's, s seeded
signs stored as 1 bit each; D a power of two).

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

    def rotation(self, shared, head_dim: int, device) -> torch.Tensor:
        """float32 [H, D, D] O used by encode (y = O x) and decode (x = O^T y),
        computed only from the stored bytes."""
        if self.config.rotation == "hadamard":
            signs = unpack_bits(shared["signs"].cpu(), 1, head_dim).double()  # [H, D]
            w = sylvester_hadamard(head_dim).double() / math.sqrt(head_dim)
            return (w * (1 - 2 * signs).unsqueeze(1)).float().to(device)  # W diag(s), per head
        q = shared["rotation"].to(device).double()
        eye = torch.eye(head_dim, dtype=torch.float64, device=device)
        q = q @ (1.5 * eye - 0.5 * q.transpose(-1, -2) @ q)  # one Newton-Schulz step to orthogonal
        return q.float()

    # ---- the scalar codebook ---------------------------------------------------------
    def levels(self, head_dim: int, device):
        """Levels of N(0, 1/D) and the midpoints between them (cell edges)."""
        lv = torch.tensor(lloyd_max_gaussian(1 << self.config.bits), dtype=torch.float64) / math.sqrt(head_dim)
        return lv.float().to(device), ((lv[1:] + lv[:-1]) / 2).float().to(device)

    def _rotate(self, x, shared):
        """y = O x of every token vector, its norm and unit direction u."""
        o = self.rotation(shared, x.shape[-1], x.device)
        y = torch.matmul(x, o.transpose(-1, -2))  # rows: y = x O^T
        n = y.norm(dim=-1, keepdim=True)
        return y, n, y / torch.where(n > 0, n, torch.ones_like(n))  # x = 0 -> u = 0, gain 0

    # ---- encode / decode --------------------------------------------------------------
    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        y, n, u = self._rotate(x, shared)
        lv, edges = self.levels(D, x.device)
        codes = torch.bucketize(u, edges)  # nearest level: cells are split at the midpoints
        if self.config.gain == "lsq":
            v = lv[codes]
            g = (y * v).sum(-1) / v.pow(2).sum(-1)  # v != 0: no level is 0 (2^bits levels, symmetric)
        else:
            g = x.norm(dim=-1)
        check_fp16_storable("spherical gain", g)
        return Segment({"codes": pack_bits(codes, self.config.bits), "gain": g.half()}, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        lv, _ = self.levels(D, seg.fields["gain"].device)
        v = lv[unpack_bits(seg.fields["codes"], self.config.bits, D)]
        if self.config.gain == "norm":
            v = v / v.norm(dim=-1, keepdim=True)
        o = self.rotation(shared, D, v.device)
        return torch.matmul(v * seg.fields["gain"].float().unsqueeze(-1), o)  # rows: x = y O

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        return self.config.bits + 16 / head_dim

    def error_bound(self, x):
        """Per coordinate of u: at most the largest distance from the level of
        its cell to that cell's edges (for an outer cell, to u itself: the
        clipping error). Their L2 sum eps bounds ||u - v||, so the angle between
        u and v is at most asin(eps) and ||u - v/||v|||| <= 2 sin(asin(eps)/2)
        (2 when eps >= 1). Either gain then errs by at most ||x|| times that
        (lsq is the best scale for v, so no worse than ||x||/||v||), plus the
        fp16 rounding of the gain; the slack covers float32 arithmetic and the
        rotation's ~1e-6 distance from orthogonal."""
        D = x.shape[-1]
        _, n, u = self._rotate(x, self.empty(x).shared)
        lv, edges = self.levels(D, x.device)
        k = torch.bucketize(u, edges)
        c = lv[k]
        lo = torch.cat([edges.new_tensor([-math.inf]), edges])[k]
        hi = torch.cat([edges, edges.new_tensor([math.inf])])[k]
        lo = torch.where(torch.isinf(lo), torch.minimum(u, c), lo)
        hi = torch.where(torch.isinf(hi), torch.maximum(u, c), hi)
        per_coord = torch.maximum(c - lo, hi - c) + 1e-6
        eps = per_coord.pow(2).sum(-1).sqrt()
        angle = 2 * torch.sin(torch.asin(eps.clamp(max=1.0)) / 2)
        f = torch.where(eps < 1, angle, torch.full_like(eps, 2.0))
        n = n.squeeze(-1)
        v_max = math.sqrt(D) * float(lv.abs().max())
        return n * (f + 2.0**-11) * (1 + 1e-4) + 2.0**-24 * max(1.0, v_max)
