"""Quaternion algebra, once: Hamilton product, conjugate, the binary
tetrahedral group 2T (the 24 unit Hurwitz quaternions) and its O(1) nearest
element search. A quaternion is the last axis of a tensor, (w, x, y, z)."""
from __future__ import annotations

import torch


def hamilton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamilton product a*b, broadcasting over leading axes."""
    a0, a1, a2, a3 = a.unbind(-1)
    b0, b1, b2, b3 = b.unbind(-1)
    return torch.stack(
        (
            a0 * b0 - a1 * b1 - a2 * b2 - a3 * b3,
            a0 * b1 + a1 * b0 + a2 * b3 - a3 * b2,
            a0 * b2 - a1 * b3 + a2 * b0 + a3 * b1,
            a0 * b3 + a1 * b2 - a2 * b1 + a3 * b0,
        ),
        dim=-1,
    )


def conj(q: torch.Tensor) -> torch.Tensor:
    return q * q.new_tensor([1.0, -1.0, -1.0, -1.0])


def right_mul_matrix(q: torch.Tensor) -> torch.Tensor:
    """Matrices M with (u * q) = u @ M for row vectors u: `[..., 4] -> [..., 4, 4]`.
    Lets the HQMQ search rotate every chunk by all S secondaries in one matmul."""
    eye = torch.eye(4, dtype=q.dtype, device=q.device)
    return hamilton(eye.expand(*q.shape[:-1], 4, 4), q.unsqueeze(-2))


def hurwitz_units(dtype=torch.float32, device=None) -> torch.Tensor:
    """The 24 unit Hurwitz quaternions, in the index order `nearest_hurwitz` uses:
    0..7 are +-1, +-i, +-j, +-k as (axis a, sign) -> 2a + (sign < 0);
    8..23 are (+-1 +-i +-j +-k)/2 with bit k of (index-8) set when component k is negative."""
    rows = []
    for axis in range(4):
        for sign in (1.0, -1.0):
            r = [0.0] * 4
            r[axis] = sign
            rows.append(r)
    for mask in range(16):
        rows.append([(-0.5 if (mask >> k) & 1 else 0.5) for k in range(4)])
    return torch.tensor(rows, dtype=dtype, device=device)


def nearest_hurwitz(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index in `hurwitz_units()` of the element maximising <v, p>, and that inner
    product, in O(1) per vector: the best axis element scores max_i |v_i|, the best
    half element scores sum_i |v_i| / 2 (signs taken from v). Ties go to the axis
    element, and among axes to the lowest axis; zero components count as positive."""
    a = v.abs()
    axis_score, axis = a.max(dim=-1)
    axis_sign = torch.gather(v, -1, axis.unsqueeze(-1)).squeeze(-1) < 0
    axis_idx = 2 * axis + axis_sign.long()
    half_score = a.sum(-1) * 0.5
    weights = 1 << torch.arange(4, device=v.device)  # on the device: no host copy (a hidden sync)
    half_idx = 8 + ((v < 0).long() * weights).sum(-1)
    use_half = half_score > axis_score
    return torch.where(use_half, half_idx, axis_idx), torch.where(use_half, half_score, axis_score)


def random_unit_quaternions(n: int, generator: torch.Generator) -> torch.Tensor:
    """n Haar-uniform unit quaternions (normalised Gaussians), float32 on CPU."""
    g = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return (g / g.norm(dim=-1, keepdim=True)).float()


def group_closure_table() -> torch.Tensor:
    """`table[i, j]` = index of hurwitz[i] * hurwitz[j]; -1 if the product left the set."""
    p = hurwitz_units(torch.float64)
    prod = hamilton(p[:, None, :], p[None, :, :])  # [24, 24, 4]
    dist = (prod[:, :, None, :] - p[None, None, :, :]).abs().amax(-1)  # [24, 24, 24]
    best = dist.min(-1)
    return torch.where(best.values < 1e-12, best.indices, torch.full_like(best.indices, -1))


__all__ = [
    "hamilton",
    "conj",
    "right_mul_matrix",
    "hurwitz_units",
    "nearest_hurwitz",
    "random_unit_quaternions",
    "group_closure_table",
]
