"""Vector-quantization mechanics shared by flat VQ and additive VQ: k-means
fitting (Lloyd's algorithm), nearest-codeword and residual (greedy or beam)
encoding, residual k-means codebooks and their EM refinement on calibration
data (additive VQ's codebooks=calibrated).

Every fitted codebook keeps codeword 0 at the zero vector: a stage can always
decline to code, so a chunk's residual never grows, which is what gives the
VQ quantizers a sound error bound (||error|| <= ||x||) whatever the data.
"""
from __future__ import annotations

import torch

KMEANS_ITERS = 6  # Lloyd iterations per fit: on real K/V, 10 lowered the MSE only ~2% more, at ~1.5x the time
FIT_POINTS_PER_CODEWORD = 16  # k-means runs on a seeded sample of at most 16 K points per codebook
SCORE_BLOCK = 1 << 24  # elements of the [.., chunks, beam, K] score temporary per block (GPU)
SCORE_BLOCK_CPU = 1 << 20  # smaller on CPU, where a block that fits in cache is faster
# Elements (256 MB float32) of the [G, points, K] distance temporary of a fit: larger ones are
# computed in blocks of points. Unblocked, the fit of flatvq:dim=1,K_bits=14 to a 512-token
# write of 2 heads x 64 dims took 4.3 GB per assignment pass (and would take ~140 GB at 2048
# tokens x 8 heads x 128 dims); blocked, 0.5 GB. Fits under it (every default config) make
# the one call they always made.
ASSIGN_BLOCK = 1 << 26


def kmeans(points: torch.Tensor, k: int, gen: torch.Generator, iters: int = KMEANS_ITERS,
           history: list | None = None) -> torch.Tensor:
    """Lloyd's k-means on `points` [G, N, d] (G independent problems), in their dtype.
    Starts from k points of a seeded random order (repeated if N < k); an empty
    cluster keeps its centroid, so the objective (mean squared distance to the
    nearest centroid) never increases. `history`, if given, receives the
    objective before each assignment step and after the last. Returns [G, k, d]."""
    G, N, d = points.shape
    if N == 0:
        raise ValueError("k-means needs at least one point")
    x = points
    order = torch.randperm(N, generator=gen).to(x.device)
    start = order[torch.arange(k, device=x.device) % N]
    c = x[:, start].clone()  # [G, k, d]
    xx = x.pow(2).sum(-1)
    for it in range(iters + 1):
        dist, assign = _nearest_with_distance(x, c)
        if history is not None:
            history.append(float((dist + xx).clamp(min=0).mean()))
        if it == iters:
            break
        sums, counts = cluster_sums(x, assign, k)
        c = torch.where(counts > 0, sums / counts.clamp(min=1), c)
    return c


ONE_HOT_BLOCK = 1 << 26  # elements of the one-hot temporary per block of points (GPU)


def cluster_sums(x: torch.Tensor, assign: torch.Tensor, k: int,
                 one_hot: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums [G, k, d] and counts [G, k, 1] of points x [G, N, d] assigned to
    clusters `assign` [G, N]. On a GPU by one-hot matmuls over fixed blocks of points:
    CUDA's scatter_add_ adds in the order its atomics land, which made the seeded fits of
    avq / flatvq differ from run to run (PPL up to 11% apart for one seed on the H200).
    On the CPU scatter_add_ is sequential, deterministic and faster. `one_hot` forces
    either way (tests)."""
    G, N, d = x.shape
    if not (x.is_cuda if one_hot is None else one_hot):
        sums = x.new_zeros(G, k, d).scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, d), x)
        counts = x.new_zeros(G, k, 1).scatter_add_(1, assign.unsqueeze(-1), x.new_ones(G, N, 1))
        return sums, counts
    sums, counts = x.new_zeros(G, k, d), x.new_zeros(G, k, 1)
    step = max(1, ONE_HOT_BLOCK // max(1, G * k))
    clusters = torch.arange(k, device=x.device)
    for lo in range(0, N, step):
        member = (assign[:, lo : lo + step].unsqueeze(-1) == clusters).to(x.dtype)  # [G, n, k] one-hot
        sums += torch.bmm(member.transpose(1, 2), x[:, lo : lo + step])
        counts += member.sum(1).unsqueeze(-1)
    return sums, counts


def _nearest_with_distance(points: torch.Tensor, cb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """min over codewords of ||x - c||^2 - ||x||^2 = ||c||^2 - 2 <x, c> (one fused pass) and
    its first index, for points [G, N, d] and cb [G, K, d]; in blocks of points when the
    [G, N, K] temporary would pass ASSIGN_BLOCK elements."""
    G, N, _ = points.shape
    cn, cbt = cb.pow(2).sum(-1).unsqueeze(1), cb.transpose(1, 2)
    step = max(1, ASSIGN_BLOCK // max(1, G * cb.shape[1]))
    if N <= step:
        return torch.baddbmm(cn, points, cbt, alpha=-2).min(-1)
    dist, index = points.new_empty(G, N), torch.empty(G, N, dtype=torch.long, device=points.device)
    for i in range(0, N, step):  # into outputs made once (see residual_search's `keep`)
        dist[:, i : i + step], index[:, i : i + step] = torch.baddbmm(cn, points[:, i : i + step], cbt, alpha=-2).min(-1)
    return dist, index


def nearest(points: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codeword of cb [G, K, d] for points [G, N, d], in their
    dtype (for fitting; stored codes come from `residual_search`, in float64)."""
    return _nearest_with_distance(points, cb)[1]


def sample_points(points: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """A seeded sample of at most FIT_POINTS_PER_CODEWORD * k (16 k) of the N points
    [G, N, d]: the fit's cost stays fixed however long the write."""
    n = points.shape[1]
    cap = FIT_POINTS_PER_CODEWORD * k
    if n <= cap:
        return points
    idx = torch.randperm(n, generator=gen)[:cap].to(points.device)
    return points[:, idx]


def fit_codebook_with_zero(points: torch.Tensor, K: int, gen: torch.Generator) -> torch.Tensor:
    """[G, K, d] codebook: codeword 0 the zero vector, the other K-1 k-means
    centroids of a seeded sample of `points` [G, N, d], fitted in float32 (the
    fit need not be bit-stable across batch shapes: it runs once per cache)."""
    pts = sample_points(points.float(), K - 1, gen)
    c = kmeans(pts, K - 1, gen) if K > 1 else pts.new_zeros(pts.shape[0], 0, pts.shape[2])
    return torch.cat([torch.zeros_like(c[:, :1]), c], 1)


def residual_search(r: torch.Tensor, cb: torch.Tensor, beam: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Code chunks r `[B, G, N, dim]` with codebooks cb `[G or 1, M, K, dim]`.
    Returns codes `[B, G, N, M]` and the final residual `[B, G, N, dim]`.
    Scores ||r - c||^2 - ||r||^2 = ||c||^2 - 2 <r, c> with one matmul per stage,
    over blocks of chunks so the score temporary stays under a fixed size.
    M = 1 is nearest-codeword (flat) VQ."""
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
    # Each block's codes and residual go straight into outputs made once: kept per block
    # (then concatenated), they pinned the heap above each freed score temporary, and glibc
    # grew it by one temporary per block (flatvq:dim=1,K_bits=14, 32768 chunks: 7 GB RSS
    # for 2 MB of codes).
    out: list[torch.Tensor] = []

    def keep(start: int, codes: torch.Tensor, res: torch.Tensor) -> None:
        if not out:
            out.extend([codes.new_empty(B, G, N, M), res.new_empty(B, G, N, dim)])
        out[0][:, :, start : start + codes.shape[2]] = codes
        out[1][:, :, start : start + codes.shape[2]] = res
    for start in range(0, N, block):
        res = r[:, :, start : start + block]
        n = res.shape[2]
        if beam == 1:  # greedy: the nearest codeword of each stage
            codes = []
            for m in range(M):
                idx = torch.matmul(res.double(), cb_t[:, m]).add_(cnorm[:, m]).argmin(-1)  # first minimum on ties
                res = res - cb[:, m][heads[..., 0], idx]  # idx is [B, G, n]
                codes.append(idx)
            keep(start, torch.stack(codes, -1), res)
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
        keep(start, codes[:, :, :, 0], res[:, :, :, 0])  # the best beam: topk sorts ascending
    return out[0], out[1]


def fit_residual_codebooks(z: torch.Tensor, M: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Residual k-means: chunks z [G, N, dim] -> fp16-valued codebooks [G, M, K, dim].
    Stage m is fitted to the residual the stored (fp16) stages 1..m-1 leave."""
    res, stages = z.float(), []
    for m in range(M):
        cb = fit_codebook_with_zero(res, K, gen).half().float()  # [G, K, dim], as stored
        stages.append(cb)
        if m + 1 < M:
            res = res - cb.gather(1, nearest(res, cb).unsqueeze(-1).expand_as(res))
    return torch.stack(stages, 1)


# codebooks=calibrated: EM rounds after the residual k-means start (calibration cost, once per
# model and (layer, role)); the calibration chunks an EM sees per codebook group, at most
# CAL_POINTS_PER_CODEWORD * K (a seeded sample); the least beam its E-step and encode use;
# the ridge that keeps a codeword no calibration chunk chose where it was.
EM_ITERS = 3
CAL_POINTS_PER_CODEWORD = 32
CAL_BEAM = 4
EM_RIDGE = 1e-3
MAX_JOINT = 4096  # M * K codewords solved for jointly (a [M K, M K] float64 system per group)


def normal_equations(z: torch.Tensor, codes: torch.Tensor, K: int,
                     one_hot: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-hot design's normal equations for chunks z [N, dim] coded `codes` [N, M]:
    A [M K, M K] (how often codewords i and j code one chunk together; float64 counts, exact)
    and rhs [M K, dim] (the sum of the chunks each codeword codes), float64. On a GPU by
    one-hot matmuls over blocks of chunks (as `cluster_sums`, whose reason holds here: CUDA's index_add_ adds
    rhs in the order its atomics land, so a calibration would differ from run to run);
    on the CPU by index_add_, sequential and cheaper. `one_hot` forces either way (tests)."""
    N, dim = z.shape
    M = codes.shape[1]
    MK = M * K
    if not (z.is_cuda if one_hot is None else one_hot):
        idx = codes + torch.arange(M, device=z.device) * K  # [N, M] into the M*K stacked codewords
        A = torch.zeros(MK * MK, dtype=torch.float64, device=z.device)
        A.index_add_(0, (idx.unsqueeze(2) * MK + idx.unsqueeze(1)).flatten(),
                     torch.ones(N * M * M, dtype=torch.float64, device=z.device))
        rhs = torch.zeros(MK, dim, dtype=torch.float64, device=z.device)
        rhs.index_add_(0, idx.flatten(), z.double().repeat_interleave(M, dim=0))
        return A.view(MK, MK), rhs
    A = z.new_zeros(MK, MK, dtype=torch.float64)
    rhs = z.new_zeros(MK, dim, dtype=torch.float64)
    step = max(1, ONE_HOT_BLOCK // MK)  # the one-hot temporary [n, M K] stays under ONE_HOT_BLOCK elements
    for lo in range(0, N, step):
        member = (codes[lo:lo + step].unsqueeze(-1) == torch.arange(K, device=z.device)).double().flatten(1)
        A += member.T @ member
        rhs += member.T @ z[lo:lo + step].double()
    return A, rhs


def joint_codewords(z: torch.Tensor, codes: torch.Tensor, cb: torch.Tensor, one_hot: bool | None = None) -> torch.Tensor:
    """The M-step: codebooks [G, M, K, dim] minimising sum ||z - sum_m cb[m, codes[m]]||^2 over
    chunks z [G, N, dim] with codes [G, N, M], all stages at once (normal equations of the
    one-hot design, float64), codeword 0 of each stage held at zero, a codeword no chunk
    chose held at its value in `cb` (the ridge EM_RIDGE pulls every codeword toward it)."""
    G, N, dim = z.shape
    _, M, K, _ = cb.shape
    MK = M * K
    out = cb.double().clone()
    free = torch.ones(M, K, dtype=torch.bool)
    free[:, 0] = False
    free = free.flatten().to(z.device)
    for g in range(G):
        A, rhs = normal_equations(z[g], codes[g], K, one_hot=one_hot)
        prev = cb[g].double().reshape(MK, dim)
        lam = EM_RIDGE * max(1.0, float(A.diagonal().mean()))
        Af = A[free][:, free] + lam * torch.eye(MK - M, dtype=torch.float64, device=z.device)  # (free: all but codeword 0s)
        sol = torch.linalg.solve(Af, rhs[free] + lam * prev[free])
        flat = out[g].reshape(MK, dim)
        flat[free] = sol
        out[g] = flat.view(M, K, dim)
    return out.float()


def em_codebooks(z: torch.Tensor, M: int, K: int, beam: int, gen: torch.Generator, iters: int | None = None,
                 history: list | None = None) -> torch.Tensor:
    """EM for additive codebooks on calibration chunks z [G, N, dim] -> fp16-valued [G, M, K, dim]:
    residual k-means to start, then `iters` rounds of (E) beam-search codes, (M) joint least
    squares (`joint_codewords`), each round's codebooks rounded to fp16 as stored. Returns the
    codebooks of the lowest mean squared residual seen (E-step residuals; beam search is not
    exact, so a round may not improve). `history` receives that error after each E-step."""
    z = z.float()
    iters = EM_ITERS if iters is None else iters
    cb = fit_residual_codebooks(z, M, K, gen)
    best = None
    for it in range(iters + 1):
        codes, res = residual_search(z.unsqueeze(0), cb, beam)
        err = float(res.double().pow(2).sum(-1).mean())
        if history is not None:
            history.append(err)
        if best is None or err < best[0]:
            best = (err, cb)
        if it == iters:
            break
        cb = joint_codewords(z, codes[0], cb).half().float()
    return best[1]


__all__ = ["CAL_BEAM", "CAL_POINTS_PER_CODEWORD", "EM_ITERS", "KMEANS_ITERS", "MAX_JOINT", "em_codebooks", "fit_codebook_with_zero",
           "fit_residual_codebooks", "joint_codewords", "kmeans", "nearest", "normal_equations", "residual_search",
           "sample_points"]
