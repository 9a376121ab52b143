"""HQMQ encode with the O(S) search in a Triton kernel; torch reference beside it.

What runs where (the stored fields are exactly those of `quantizers/hqmq.py`):

- torch, before the kernel: chunk radii, the Med3x median and outlier mask,
  r_max, the unit directions u (all through `HQMQ.encode_tokens` itself);
- the kernel (`hqmq_search`): for every chunk u and every secondary s of its
  kv head, v = u * conj(s), score = max(max_i |v_i|, sum_i |v_i| / 2); best s =
  first argmax over s (ties to the lower index, like torch.argmax); then p =
  nearest_hurwitz(v) for the best s (ties to the axis element, lowest axis);
  code = p * S + s;
- torch, after it: radius codes, the zeroing of codes of chunks that decode to
  zero, the bit packing (`pack_bits`), flags and outliers.

`encode_with_kernel(q, x)` is `q.encode(x)` with `HQMQ.search` replaced by the
kernel, so everything but the search is the reference code path. The torch
reference of the kernel is `HQMQ.search`.

Bit identity and ties: the kernel computes v_j = sum_i u_i M[i, j] in the
order i = 0..3 (M the right-multiplication matrix of conj(s), as torch's
matmul sees it) and sums |v_i| left to right; torch's matmul/sum may order or
fuse (FMA) these differently. The two agree bit for bit except where two
secondaries (or the axis and half candidates) score within a few ulps of each
other: such near-ties can resolve differently. suites/tests/test_kernels.py checks
that every differing code is such a tie (scores equal to 1e-6).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting
from .triton.common import hamilton, launch


@triton.jit
def best_codes(u0, u1, u2, u3, sec_ptr, h, S, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    """Code p*S + s of unit chunks (u0..u3: [BLOCK_N] fp32 each) against kv head h's
    normalised secondaries (`sec_ptr`: [H, S, 4] fp32): the search of `HQMQ.search`
    (shared by the search kernel and the decode-step encoder, kernels/step_encode.py)."""
    w0 = u0[:, None]
    w1 = u1[:, None]
    w2 = u2[:, None]
    w3 = u3[:, None]
    best = tl.full([BLOCK_N], -1.0, tl.float32)
    best_i = tl.zeros([BLOCK_N], tl.int32)
    sl = tl.arange(0, SB)
    for s0 in range(0, S, SB):
        sidx = s0 + sl
        sm = sidx < S
        sp = sec_ptr + (h * S + sidx) * 4
        c0 = tl.load(sp + 0, mask=sm, other=0.0)[None, :]  # conj(s) = (s0, -s1, -s2, -s3)
        c1 = -tl.load(sp + 1, mask=sm, other=0.0)[None, :]
        c2 = -tl.load(sp + 2, mask=sm, other=0.0)[None, :]
        c3 = -tl.load(sp + 3, mask=sm, other=0.0)[None, :]
        # v = u * c (Hamilton; the same products and order as u @ right_mul_matrix(c))
        v0, v1, v2, v3 = hamilton(w0, w1, w2, w3, c0, c1, c2, c3)
        a0 = tl.abs(v0)
        a1 = tl.abs(v1)
        a2 = tl.abs(v2)
        a3 = tl.abs(v3)
        score = tl.maximum(tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)), (a0 + a1 + a2 + a3) * 0.5)
        score = tl.where(sm[None, :], score, -1.0)
        bs, bi = tl.max(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
        upd = bs > best
        best = tl.where(upd, bs, best)
        best_i = tl.where(upd, bi + s0, best_i)
    # the best secondary's v, then its nearest element of 2T
    sp = sec_ptr + (h * S + best_i) * 4
    c0 = tl.load(sp + 0)
    c1 = -tl.load(sp + 1)
    c2 = -tl.load(sp + 2)
    c3 = -tl.load(sp + 3)
    v0, v1, v2, v3 = hamilton(u0, u1, u2, u3, c0, c1, c2, c3)
    a0 = tl.abs(v0)
    a1 = tl.abs(v1)
    a2 = tl.abs(v2)
    a3 = tl.abs(v3)
    # nearest_hurwitz: axis candidate (first max), half candidate, half wins only if strictly better
    ax_s = a0
    ax = tl.zeros([BLOCK_N], tl.int32)
    ax_v = v0
    ax = tl.where(a1 > ax_s, 1, ax)
    ax_v = tl.where(a1 > ax_s, v1, ax_v)
    ax_s = tl.maximum(ax_s, a1)
    ax = tl.where(a2 > ax_s, 2, ax)
    ax_v = tl.where(a2 > ax_s, v2, ax_v)
    ax_s = tl.maximum(ax_s, a2)
    ax = tl.where(a3 > ax_s, 3, ax)
    ax_v = tl.where(a3 > ax_s, v3, ax_v)
    ax_s = tl.maximum(ax_s, a3)
    axis_idx = 2 * ax + (ax_v < 0).to(tl.int32)
    half_s = (a0 + a1 + a2 + a3) * 0.5
    half_idx = 8 + (v0 < 0).to(tl.int32) + 2 * (v1 < 0).to(tl.int32) + 4 * (v2 < 0).to(tl.int32) \
        + 8 * (v3 < 0).to(tl.int32)
    p = tl.where(half_s > ax_s, half_idx, axis_idx)
    return p * S + best_i


@triton.jit
def _hqmq_search_kernel(u_ptr, sec_ptr, code_ptr, N, H, S,
                        BLOCK_N: tl.constexpr, SB: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    h = pid_bh % H
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    base = (pid_bh.to(tl.int64) * N + n) * 4
    u0 = tl.load(u_ptr + base + 0, mask=nm, other=1.0)
    u1 = tl.load(u_ptr + base + 1, mask=nm, other=0.0)
    u2 = tl.load(u_ptr + base + 2, mask=nm, other=0.0)
    u3 = tl.load(u_ptr + base + 3, mask=nm, other=0.0)
    code = best_codes(u0, u1, u2, u3, sec_ptr, h, S, BLOCK_N, SB)
    tl.store(code_ptr + pid_bh.to(tl.int64) * N + n, code, mask=nm)


def hqmq_search(u: torch.Tensor, secondaries: torch.Tensor, *, block_n: int | None = None,
                s_block: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Best code p*S + s for unit chunks u `[B, H, N, 4]` (float32) against the
    normalised secondaries `[H, S, 4]` (float32): the kernel twin of `HQMQ.search`."""
    if u.dim() != 4 or u.shape[-1] != 4:
        raise ValueError(f"u must be [B, H, N, 4], got {tuple(u.shape)}")
    B, H, N, _ = u.shape
    S = secondaries.shape[1]
    if secondaries.shape != (H, S, 4):
        raise ValueError(f"secondaries {tuple(secondaries.shape)} do not fit {H} heads")
    u = u.float().contiguous()
    sec = secondaries.float().contiguous().to(u.device)
    code = torch.empty(B, H, N, dtype=torch.int32, device=u.device)
    if N == 0:
        return code.long()
    if block_n is None:  # the interpreter pays per program, the GPU wants many programs
        block_n = 1024 if interpreting() else 64
    extra = {} if interpreting() else {"num_warps": num_warps}
    grid = (B * H, triton.cdiv(N, block_n))
    launch(_hqmq_search_kernel, grid, u, sec, code, N, H, S, BLOCK_N=block_n, SB=s_block, **extra)
    return code.long()


def kernel_quantizer(q):
    """A copy of HQMQ quantizer `q` (same config, layer, role, seed) whose search is the kernel."""
    base = type(q)
    if not hasattr(base, "search"):
        raise TypeError(f"{base.__name__} is not an HQMQ quantizer")

    class KernelHQMQ(base):
        def search(self, u, shared):
            return hqmq_search(u, self.secondaries(shared).to(u.device))

    KernelHQMQ.__name__ = f"Kernel{base.__name__}"
    return KernelHQMQ(q.config, layer=q.layer, role=q.role, seed=q.seed)


def encode_with_kernel(q, x: torch.Tensor):
    """`q.encode(x)` with the search in the Triton kernel: same Packed fields."""
    return kernel_quantizer(q).encode(x)


__all__ = ["best_codes", "hqmq_search", "kernel_quantizer", "encode_with_kernel"]
