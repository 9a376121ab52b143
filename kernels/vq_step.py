"""A decode step's vector-quantized write in one launch: the dense step's encoder for
additive VQ (`avq`, greedy search) and flat VQ (`flatvq`).

As for spherical (spherical_step.py), a graphed dense step otherwise replays the
quantizer's torch encode and decode op by op: 196 aten ops per layer and step for flat VQ,
540-576 for avq2 / avq3 (reports/kernels/NOTES.md, 2026-12-05). Here one program per
(batch row, kv-head) codes the token with the quantizer's arithmetic:

    avq:    y = fwht(x s) / sqrt(b)                 (float32 butterflies, as rotation.py)
            z = y / fp16(||y||_64 / sqrt(D))        (float32 division)
            per chunk of `dim`, per stage m: code = argmin_k ||c_k||^2 - 2 <r, c_k>
            (float64, first minimum), r -= c_code (float32)
            gain = <y, zhat>_64 / ||zhat||^2_64 (lsq; zhat the float32 sum of the stages'
            codewords in stage order) or the fp16 scale (rms)
            decoded = fwht(zhat * gain16) / sqrt(b) * s
    flatvq: code = the nearest codeword of each chunk; decoded = the codeword

and writes the packed codes (chunk, stage) order, the fp16 gain and the decoded token at
the device position. A butterfly stage is a sum over a [D, D] tile holding each output's
two inputs (with +-1) and zeros elsewhere: adding zeros is exact, so each output is the
one float32 rounding of a + b or a - b the torch stage makes.

The same bytes as the torch path (suites/tests/test_dense_encoders.py) except where two
codewords' float64 scores lie within their rounding of each other (the torch matmul sums
a score's `dim` products in another order): not met on these data.

Beam search (`beam` > 1, the calibrated rows' beam 8) keeps the `beam` best partial sums
per chunk as residual_search does (topk by repeated first-minimum: at exactly equal
scores torch.topk's order is its own, a tie that distinct codewords do not meet). Its
stage and beam loops stay loops: unrolled, avq3-cal's [8 x 8 x 256] float64 tiles took
~30 s per variant to compile for sm_90 (~75 s of a cold compare on an H100).

Not here (the torch path serves them): head dims or chunk lengths that are no power of
two, more than MAX_TILE float64 scores per stage and token (chunks x beams x codewords), a
beam wider than a stage's codewords, head dims above 128 (the butterfly tile's size).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..quantizers.rotation import hadamard_block, signs_of
from .step_encode import device_pos, encode_segment, launch, nonfinite, p2, to_dtype_rne, with_kernel_encode

MAX_TILE = 16384  # chunks x codewords of one stage's float64 scores, held in registers
MAX_D = 128  # the butterfly tile is [D, D]


@triton.jit
def _fwht(y, D: tl.constexpr, LOG2B: tl.constexpr):
    """fwht(y, b) of a float32 row y [D] in blocks of b = 2^LOG2B (rotation.fwht, bit for bit)."""
    i = tl.arange(0, D)[:, None]
    j = tl.arange(0, D)[None, :]
    for s in tl.static_range(LOG2B):
        h = 1 << s
        low = (i & h) == 0
        sel = (j == i) | (j == (i ^ h))
        sgn = tl.where((j == i) & ~low, -1.0, 1.0)
        y = tl.sum(tl.where(sel, y[None, :] * sgn, 0.0), axis=1)
    return y


@triton.jit
def _scores(r, cm, DIM: tl.constexpr, K: tl.constexpr):
    """||c_k||^2 - 2 <r, c_k> in float64 for residuals r [A, B, DIM] (float32) and the
    codebook at cm ([K, DIM] fp16): [A, B, K], summed as residual_search's matmul, then
    + ||c||^2."""
    k = tl.arange(0, K)
    col = tl.arange(0, DIM)[None, None, :]
    score = tl.zeros([r.shape[0], r.shape[1], K], dtype=tl.float64)
    cn = tl.zeros([K], dtype=tl.float64)
    for dd in tl.static_range(DIM):
        c = tl.load(cm + k * DIM + dd).to(tl.float64)
        rd = tl.sum(tl.where(col == dd, r, 0.0), axis=2).to(tl.float64)  # column dd: exact
        score += rd[:, :, None] * (c * -2.0)[None, None, :]
        cn += c * c
    return score + cn[None, None, :]


@triton.jit
def _greedy(r, cb, scm, NC: tl.constexpr, DIM: tl.constexpr, M: tl.constexpr, K: tl.constexpr, MP: tl.constexpr):
    """Codes [NC, MP] of the chunks r [NC, DIM]: each stage's nearest codeword to what the
    earlier stages left (residual_search, beam 1)."""
    d = tl.arange(0, DIM)[None, :]
    mm = tl.arange(0, MP)[None, :]
    codes = tl.zeros([NC, MP], dtype=tl.int32)
    for m in range(M):  # a loop, not unrolled (compile time)
        score = tl.reshape(_scores(r[:, None, :], cb + m * scm, DIM, K), [NC, K])
        score = tl.where(score == score, score, float("inf"))  # NaN input (flagged): any code, no NaN argmin
        idx = tl.argmin(score, axis=1, tie_break_left=True)  # the first minimum, as torch
        r = r - tl.load(cb + m * scm + idx[:, None] * DIM + d).to(tl.float32)
        codes = tl.where(mm == m, idx[:, None], codes)
    return codes


@triton.jit
def _beam(z, cb, scm, NC: tl.constexpr, DIM: tl.constexpr, M: tl.constexpr, K: tl.constexpr, MP: tl.constexpr,
          BEAM: tl.constexpr, BP: tl.constexpr):
    """Codes [NC, MP] by residual_search's beam search: per stage, every kept partial sum
    (beam) extended by every codeword, scored ||residual||^2 = err + ||c||^2 - 2 <r, c>
    (float64), the BEAM best kept in ascending order (ties: the lower beam, then codeword:
    torch.topk's order there is its own); the best beam's codes at the end."""
    d = tl.arange(0, DIM)
    mm = tl.arange(0, MP)
    t = tl.arange(0, BP)
    res = tl.broadcast_to(z[:, None, :], [NC, BP, DIM])  # beam i's residual [NC, BP, DIM]
    err = tl.zeros([NC, BP], dtype=tl.float64)
    for dd in tl.static_range(DIM):  # ||z||^2 as the torch path sums it: the float64 squares, in order
        zd = tl.sum(tl.where(d[None, :] == dd, z, 0.0), axis=1).to(tl.float64)
        err += (zd * zd)[:, None]
    codes = tl.zeros([NC, BP, MP], dtype=tl.int32)
    # loops, not unrolled: unrolled, avq3-cal's [8 x 8 x 256] float64 tiles took ~30 s to compile
    for m in range(M):
        live = tl.where(m == 0, 1, BEAM)  # beams held before the stage (BEAM <= K: unsupported())
        score = _scores(res, cb + m * scm, DIM, K) + err[:, :, None]  # [NC, BP, K]
        score = tl.where((t < live)[None, :, None] & (score == score), score, float("inf"))
        flat = tl.reshape(score, [NC, BP * K])
        col = tl.arange(0, BP * K)[None, :]
        src = tl.zeros([NC, BP], dtype=tl.int32)
        kk = tl.zeros([NC, BP], dtype=tl.int32)
        new_err = tl.zeros([NC, BP], dtype=tl.float64)
        for j in range(BEAM):
            best = tl.argmin(flat, axis=1, tie_break_left=True)
            val = tl.min(flat, axis=1)
            flat = tl.where(col == best[:, None], float("inf"), flat)
            src = tl.where(t[None, :] == j, (best // K)[:, None], src)
            kk = tl.where(t[None, :] == j, (best % K)[:, None], kk)
            new_err = tl.where(t[None, :] == j, val[:, None], new_err)
        # the kept beams' residuals and codes, gathered from their source beams (one term each: exact)
        pick = t[None, None, :] == src[:, :, None]  # [NC, BP(new), BP(source)]
        res = tl.sum(tl.where(pick[:, :, :, None], res[:, None, :, :], 0.0), axis=2)
        res = res - tl.load(cb + m * scm + kk[:, :, None] * DIM + d[None, None, :]).to(tl.float32)
        codes = tl.sum(tl.where(pick[:, :, :, None], codes[:, None, :, :], 0), axis=2)
        codes = tl.where(mm[None, None, :] == m, kk[:, :, None], codes)
        err = new_err
    return tl.sum(tl.where((t == 0)[None, :, None], codes, 0), axis=1)


@triton.jit(do_not_specialize=["t0", "base"])
def _vq_step_kernel(x_ptr, sxb, sxh, pos_ptr, base, H, flag_ptr, dec_ptr, sdb, sdh, sdt, sgn_ptr,
                    cb_ptr, scr, scg, scm, code_ptr, sor, sob, soh, gain_ptr, sgr, sgb, sgh,
                    D: tl.constexpr, DIM: tl.constexpr, NC: tl.constexpr, M: tl.constexpr, K: tl.constexpr,
                    BITS: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, MP: tl.constexpr,
                    ROTATE: tl.constexpr, LOG2B: tl.constexpr, INV_SQRT_B: tl.constexpr,
                    NORMALISE: tl.constexpr, LSQ: tl.constexpr, BEAM: tl.constexpr, BP: tl.constexpr,
                    t0, sxt, DEVPOS: tl.constexpr, DEC: tl.constexpr):
    """Program (b*H+h, t): token x[b, h, t] at position p = t0 + t (DEVPOS: + *pos_ptr, a
    graphed step's device position); field rows p - base (strides row, batch, head), history
    token p (DEC). Codebooks at cb_ptr + b*scr + h*scg + m*scm ([K, DIM] fp16 each; scr /
    scg 0 where one row / group serves all)."""
    t = tl.program_id(1)
    p = t0 + t
    if DEVPOS:
        p += tl.load(pos_ptr)
    row = (p - base).to(tl.int64)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    e = tl.arange(0, D)
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + h * sxh + t.to(tl.int64) * sxt + e).to(tl.float32)
    n_bad = tl.sum(nonfinite(x).to(tl.int32), axis=0)
    if n_bad > 0:
        tl.atomic_add(flag_ptr, n_bad)
    if ROTATE:
        s = tl.load(sgn_ptr + h * D + e)
        y = _fwht(x * s, D, LOG2B) * INV_SQRT_B
    else:
        y = x
    if NORMALISE:
        y64 = y.to(tl.float64)
        sc = tl.sqrt(tl.sum(y64 * y64, axis=0)) / tl.sqrt(tl.full([], D, tl.float64))  # / sqrt(D), as torch
        over = tl.abs(sc) > 65504.0
        s16 = sc.to(tl.float32).to(tl.float16).to(tl.float32)  # torch's double -> half goes through float
        z = tl.math.div_rn(y, tl.where(s16 > 0, s16, 1.0))
    else:
        z = y
    n = tl.arange(0, NC)[:, None]
    d = tl.arange(0, DIM)[None, :]
    mm = tl.arange(0, MP)[None, :]
    cbo = b.to(tl.int64) * scr + h * scg
    if BEAM == 1:
        codes = _greedy(tl.reshape(z, [NC, DIM]), cb_ptr + cbo, scm, NC, DIM, M, K, MP)
    else:
        codes = _beam(tl.reshape(z, [NC, DIM]), cb_ptr + cbo, scm, NC, DIM, M, K, MP, BEAM, BP)
    # zhat as decode sums it: the stages' codewords in stage order, from zero (float32)
    zhat = tl.zeros([NC, DIM], dtype=tl.float32)
    for m in tl.static_range(M):
        cm = tl.sum(tl.where(mm == m, codes, 0), axis=1)
        zhat = zhat + tl.load(cb_ptr + cbo + m * scm + cm[:, None] * DIM + d).to(tl.float32)
    if NORMALISE:
        if LSQ:
            zh = tl.reshape(zhat, [D]).to(tl.float64)
            nz = tl.sum(zh * zh, axis=0)
            g = tl.sum(y64 * zh, axis=0) / tl.where(nz > 0, nz, 1.0)
            over = over | (tl.abs(g) > 65504.0)
            g16 = g.to(tl.float32).to(tl.float16)
        else:
            g16 = s16.to(tl.float16)
        tl.store(gain_ptr + row * sgr + b * sgb + h * sgh, g16)
        out = tl.reshape(zhat * g16.to(tl.float32), [D])
        if over:
            tl.atomic_add(flag_ptr + 1, 1)
    else:
        out = tl.reshape(zhat, [D])
    if DEC:
        if ROTATE:
            out = _fwht(out, D, LOG2B) * INV_SQRT_B * s
        tl.store(dec_ptr + b.to(tl.int64) * sdb + h * sdh + p.to(tl.int64) * sdt + e,
                 to_dtype_rne(out, dec_ptr.dtype.element_ty))
    # codes in (chunk, stage) order: value n*M + m at bits [(n*M + m)*BITS, ...) (packing.py)
    jb = tl.arange(0, NBP)[:, None, None]
    sh = (n * M + mm)[None, :, :] * BITS - 8 * jb
    ov = (sh > -BITS) & (sh < 8) & (mm < M)[None, :, :]
    left = tl.where(ov & (sh > 0), sh, 0)
    right = tl.where(ov & (sh < 0), -sh, 0)
    part = tl.where(ov, ((codes[None, :, :] << left) >> right) & 0xFF, 0)
    byt = tl.sum(tl.sum(part, axis=2), axis=1)  # disjoint bits: the sum is the OR
    j = tl.arange(0, NBP)
    tl.store(code_ptr + row * sor + b * sob + h * soh + j, byt.to(tl.uint8), mask=j < NB)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def unsupported(q, head_dim: int) -> str | None:
    """Why the kernel cannot take q's writes at this head_dim (None: it can). Host only."""
    c = q.config
    K = 1 << c.K_bits
    if head_dim > MAX_D or not _pow2(head_dim) or not _pow2(c.dim) or c.dim > head_dim:
        return f"{q.spec}: head_dim {head_dim} / chunk {c.dim} not powers of two up to {MAX_D}"
    beams = p2(c.beam) if q.name == "avq" else 1
    if q.name == "avq" and c.beam > K:
        return f"{q.spec}: a beam of {c.beam} wider than the {K} codewords of a stage"
    if head_dim // c.dim * beams * K > MAX_TILE:
        return (f"{q.spec}: {head_dim // c.dim} chunks x {beams} beams x {K} codewords exceed the kernel's "
                f"{MAX_TILE} scores")
    return None


class VQTables:
    """What the kernel reads of one (layer, role)'s shared tensors: the codebooks as
    [R, G, M, K, dim] fp16 and the rotation's +-1 signs; the fields a write stores
    (`field_shapes`: name -> (shape after [B, H, T], dtype)) and the kernel's constants,
    both made once. (`batch`: the tables' rows are checked by the kernel's strides.)"""

    overflow = "an RMS scale or gain"  # what the kernel's second flag counts

    def __init__(self, q, shared: dict, head_dim: int, batch: int, device):
        why = unsupported(q, head_dim)
        if why:
            raise ValueError(why)
        c = q.config
        self.q, self.D, avq = q, head_dim, q.name == "avq"
        beam, M = (c.beam, c.M) if avq else (1, 1)
        cb = shared["codebooks"] if avq else shared["codebook"].unsqueeze(2)  # [R, G, M, K, dim]
        self.cb = cb.to(device, torch.float16).contiguous()
        rotate = avq and c.rotation == "hadamard"
        self.signs = signs_of(shared["signs"], head_dim).to(device).contiguous() if rotate else self.cb
        block, K = hadamard_block(head_dim), 1 << c.K_bits
        nb = (head_dim // c.dim * M * c.K_bits + 7) // 8
        self.field_shapes = {"codes": ((nb,), torch.uint8), **({"gain": ((), torch.float16)} if avq else {})}
        self.const = dict(D=head_dim, DIM=c.dim, NC=head_dim // c.dim, M=M, K=K, BITS=c.K_bits, NB=nb, NBP=p2(nb),
                          MP=p2(M), ROTATE=rotate, LOG2B=block.bit_length() - 1, INV_SQRT_B=1 / math.sqrt(block),
                          NORMALISE=avq, LSQ=avq and c.gain == "lsq", BEAM=beam, BP=p2(beam),
                          num_warps=8 if beam > 1 else 4)

    def launch(self, x, t0: int, pos, base: int, flags, fields: dict, dec) -> None:
        """Tokens x `[B, H, T, D]` (last axis contiguous) at positions t0 + t (+ the device
        position `pos`, or None); `fields` (codes, gain: row, batch and head strides first)
        at rows position - base; the decoded tokens into `dec` `[B, H, cap, D]` at their
        positions (None: not written)."""
        B, H, T, D = x.shape
        pos_arg, devpos = device_pos(pos, x)
        codes = fields["codes"]
        gain = fields.get("gain", codes)  # (flat VQ stores no gain: never written)
        cb = self.cb
        dec_arg = codes if dec is None else dec
        sd = (0, 0, 0) if dec is None else (dec.stride(0), dec.stride(1), dec.stride(2))
        launch(_vq_step_kernel, (B * H, T), x, x.stride(0), x.stride(1), pos_arg, base, H, flags,
               dec_arg, *sd, self.signs,
               cb, 0 if cb.shape[0] == 1 else cb.stride(0), 0 if cb.shape[1] == 1 else cb.stride(1), cb.stride(2),
               codes, codes.stride(0), codes.stride(1), codes.stride(2),
               gain, gain.stride(0), gain.stride(1), gain.stride(2), **self.const,
               t0=t0, sxt=x.stride(2), DEVPOS=devpos, DEC=dec is not None)


def encode_tokens(q, x: torch.Tensor, shared: dict):
    """`q.encode_tokens(x, shared)` in one launch: the same fields (step_encode.encode_segment)."""
    return encode_segment(VQTables(q, shared, x.shape[-1], x.shape[0], x.device), x)


def kernel_quantizer(q):
    """Quantizer `q` (avq / flatvq) whose multi-token `encode_tokens` is the kernel (see
    step_encode.with_kernel_encode)."""
    return with_kernel_encode(q, encode_tokens, lambda w, x: unsupported(w, x.shape[-1]))


__all__ = ["MAX_D", "MAX_TILE", "VQTables", "encode_tokens", "kernel_quantizer", "unsupported"]
