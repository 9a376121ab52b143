"""Lloyd-Max scalar quantizers (minimum-MSE levels for a known density), computed
on first use and cached, float64 on CPU, deterministic; never from data.

- `lloyd_max_gaussian(L)`: the L levels of N(0, 1).
- `lloyd_max_sphere(L, d)`: the L levels of ONE coordinate of a point drawn
  uniformly on the unit sphere S^{d-1}, the exact law TurboQuant codes after its
  random rotation: density proportional to (1 - t^2)^((d-3)/2) on [-1, 1], i.e.
  (1 + t)/2 ~ Beta((d-1)/2, (d-1)/2). For large d it tends to N(0, 1/d).

Lloyd's iteration: cell edges at the midpoints between levels, each level
moved to its cell's centroid E[X | a < X < b], until the levels move < 1e-13.
"""
from __future__ import annotations

import functools
import math

import torch

LLOYD_MAX_ITERS = 5000  # upper limit; stops once the levels move < 1e-13
SPHERE_GRID = 1 << 18  # quadrature intervals over the angle, for the sphere's cell masses


def _iterate(q: torch.Tensor, lo: float, hi: float, centroids) -> tuple[float, ...]:
    bounds = torch.tensor([lo], dtype=torch.float64), torch.tensor([hi], dtype=torch.float64)
    for _ in range(LLOYD_MAX_ITERS):
        edges = torch.cat([bounds[0], (q[1:] + q[:-1]) / 2, bounds[1]])
        new = centroids(edges)
        done = float((new - q).abs().max()) < 1e-13
        q = new
        if done:
            break
    return tuple(((q - q.flip(0)) / 2).tolist())  # exactly symmetric


@functools.lru_cache(maxsize=None)
def lloyd_max_gaussian(levels: int) -> tuple[float, ...]:
    """The `levels` Lloyd-Max levels of N(0, 1), ascending, exactly symmetric. The
    centroid of a Gaussian cell is closed-form: (phi(a) - phi(b)) / (Phi(b) - Phi(a))."""
    if levels < 2:
        raise ValueError(f"a quantizer needs >= 2 levels, got {levels}")
    q = torch.special.ndtri((torch.arange(levels, dtype=torch.float64) + 0.5) / levels)

    def centroids(edges):
        pdf = torch.exp(-edges**2 / 2) / math.sqrt(2 * math.pi)  # 0 at +-inf
        return (pdf[:-1] - pdf[1:]) / (torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1]))

    return _iterate(q, -math.inf, math.inf, centroids)


@functools.lru_cache(maxsize=None)
def lloyd_max_sphere(levels: int, dim: int) -> tuple[float, ...]:
    """The `levels` Lloyd-Max levels of one coordinate of a uniform point on
    S^{dim-1}, ascending, exactly symmetric, in [-1, 1].

    With t = sin(theta) the density becomes cos(theta)^(dim-2) on
    [-pi/2, pi/2], smooth for every dim >= 2. A cell [a, b]'s mass is the
    integral of that weight (cumulative trapezoid on SPHERE_GRID intervals,
    interpolated), its first moment is exact: the integral of
    sin cos^k is -cos^(k+1)/(k+1)."""
    if levels < 2:
        raise ValueError(f"a quantizer needs >= 2 levels, got {levels}")
    if dim < 2:
        raise ValueError(f"the sphere's coordinate law needs dim >= 2, got {dim}")
    k = dim - 2
    theta = torch.linspace(-math.pi / 2, math.pi / 2, SPHERE_GRID + 1, dtype=torch.float64)
    w = torch.cos(theta).clamp(min=0) ** k
    mass = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((w[1:] + w[:-1]) / 2, 0)])
    mass = mass * (theta[1] - theta[0])
    step = float(theta[1] - theta[0])

    def mass_at(t):
        pos = (torch.asin(t.clamp(-1, 1)) + math.pi / 2) / step
        i = pos.floor().clamp(0, SPHERE_GRID - 1).long()
        f = pos - i
        return mass[i] * (1 - f) + mass[i + 1] * f

    def first_moment_at(t):  # -cos(theta)^(k+1)/(k+1) at theta = asin(t)
        return -((1 - t.clamp(-1, 1) ** 2).clamp(min=0).sqrt() ** (k + 1)) / (k + 1)

    def centroids(edges):
        return (first_moment_at(edges[1:]) - first_moment_at(edges[:-1])) / (mass_at(edges[1:]) - mass_at(edges[:-1]))

    start = torch.tensor(lloyd_max_gaussian(levels), dtype=torch.float64) / math.sqrt(dim)
    return _iterate(start.clamp(-0.999, 0.999), -1.0, 1.0, centroids)


def sphere_abs_mean(dim: int) -> float:
    """E|t| for one coordinate of a uniform point on S^{dim-1}: the 1-bit level,
    Gamma(dim/2) / (sqrt(pi) Gamma((dim+1)/2)) (tests check against it)."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


__all__ = ["lloyd_max_gaussian", "lloyd_max_sphere", "sphere_abs_mean"]
