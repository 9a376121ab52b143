"""A decode step's spherical (TurboQuant) write in one launch: the dense step's encoder.

A dense layer's graphed decode step (suites/harness/dense_steps.py) runs the
quantizer's own torch `encode_tokens` and `decode` on the new token. For spherical that
is 170 aten ops per layer and step (330 with an outlier split), most of them tiny
kernels, which a 30-layer model's CUDA graph replays one after another: 42-46% of the
spherical rows' time in the deployed compare (reports/kernels/NOTES.md, 2026-12-05).
Here one program per (batch row, kv-head) does a part's whole write (both parts of an
outlier split, one after the other), with the quantizer's float64 arithmetic:

    y = x_part @ A^-1, u = y / ||y||, code = bucketize(u, level midpoints),
    w = (levels[code] @ M) c, gain = <x_part, w> / ||w||^2 (lsq) or ||y|| (norm),

and writes the packed codes and the fp16 gain into the step's field rows, and the
decoded token (levels[code] @ M) (gain16 c), placed at the part's channels and rounded
float64 -> float32 -> the history's dtype as the torch path rounds it, into the decoded
history at the device position.

The same bytes as the torch path (suites/tests/test_dense_encoders.py): `levels @ M` is
exact in float64 (the quantizer's `_unscaled`), so the decoded token follows from the
codes and the fp16 gain; those hang on sums taken in another order (the y of a row and
the gain's two sums), which differ by ~1e-16 relative, so a code or a gain differs only
where u lies that close to a midpoint or the gain to an fp16 rounding boundary. The
double -> half cast goes through float32, as torch's does.

QJL keys (TurboQuant_prod) without an outlier split: the MSE stage's decode in float64 (exact:
the same values as decode's), the residual's norm and the signs of its sketch S r (a
sign differs only where (S r)_i is within rounding of 0), and the decoded token adds the
sketch's estimate (z @ S exact). QJL with a split stays on the torch path. Bad values are counted on the device (`flags`:
non-finite inputs, gains or residual norms beyond fp16) and raised by the step's sticky
checks when the Packed is next read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantizers.spherical import QJL_SCALE
from .step_encode import device_pos, encode_segment, launch, nonfinite, p2, pack_row, to_dtype_rne, with_kernel_encode

TILE = 16  # channels per tile of a matrix pass: a [part size, TILE] float64 tile in registers


@triton.jit
def _part(x_ptr, xo, idx_ptr, io, ainv_ptr, m_ptr, mo, c_ptr, lv_ptr, ed_ptr,
          code_ptr, co, gain_ptr, go, dec_ptr, do, flag_ptr,
          D: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr,
          NBP: tl.constexpr, NE: tl.constexpr, NEP: tl.constexpr, LSQ: tl.constexpr, TILE: tl.constexpr,
          DEC: tl.constexpr):
    """One part (D channels, at idx_ptr + io when SPLIT, else 0..D-1) of one token row."""
    k = tl.arange(0, DP)
    km = k < D
    # y = x_part @ A^-1, accumulated over tiles of input channels j
    y = tl.zeros([DP], dtype=tl.float64)
    for j0 in range(0, DP, TILE):
        j = j0 + tl.arange(0, TILE)
        jm = j < D
        ch = tl.load(idx_ptr + io + j, mask=jm, other=0) if SPLIT else j
        xj = tl.load(x_ptr + xo + ch, mask=jm, other=0.0).to(tl.float32).to(tl.float64)
        a = tl.load(ainv_ptr + mo + j[:, None] * D + k[None, :], mask=jm[:, None] & km[None, :], other=0.0)
        y += tl.sum(xj[:, None] * a, axis=0)
    n = tl.sqrt(tl.sum(y * y, axis=0))
    u = y / tl.where(n > 0, n, 1.0)
    # bucketize (right=False): the number of midpoints strictly below u
    e = tl.arange(0, NEP)
    edges = tl.load(ed_ptr + e, mask=e < NE, other=float("inf"))
    code = tl.sum((edges[None, :] < u[:, None]).to(tl.int32), axis=1)
    code = tl.where(km, code, 0)
    v = tl.load(lv_ptr + code, mask=km, other=0.0)
    c = tl.load(c_ptr)
    # w = (v @ M) c over tiles of output channels j: <x, w> and ||w||^2 first, the gain, then
    # the decoded part in a second pass (recomputed: exact, so the same values)
    xw = tl.zeros([TILE], dtype=tl.float64)
    ww = tl.zeros([TILE], dtype=tl.float64)
    for j0 in range(0, DP, TILE):
        j = j0 + tl.arange(0, TILE)
        jm = j < D
        mt = tl.load(m_ptr + mo + k[:, None] * D + j[None, :], mask=km[:, None] & jm[None, :], other=0.0)
        w = tl.sum(v[:, None] * mt, axis=0) * c
        ch = tl.load(idx_ptr + io + j, mask=jm, other=0) if SPLIT else j
        xj = tl.load(x_ptr + xo + ch, mask=jm, other=0.0).to(tl.float32).to(tl.float64)
        xw += xj * w
        ww += w * w
    if LSQ:
        g = tl.sum(xw, axis=0) / tl.sum(ww, axis=0)
    else:
        g = n
    over = tl.abs(g) > 65504.0
    g16 = g.to(tl.float32).to(tl.float16)  # torch's double -> half goes through float
    scale = g16.to(tl.float64) * c
    if not LSQ:
        scale = scale / tl.sqrt(tl.sum(v * v, axis=0))
    if DEC:
        for j0 in range(0, DP, TILE):
            j = j0 + tl.arange(0, TILE)
            jm = j < D
            mt = tl.load(m_ptr + mo + k[:, None] * D + j[None, :], mask=km[:, None] & jm[None, :], other=0.0)
            dec = tl.sum(v[:, None] * mt, axis=0) * scale
            ch = tl.load(idx_ptr + io + j, mask=jm, other=0) if SPLIT else j
            tl.store(dec_ptr + do + ch, to_dtype_rne(dec.to(tl.float32), dec_ptr.dtype.element_ty), mask=jm)
    byt = pack_row(code, BITS, DP, NBP)
    b = tl.arange(0, NBP)
    tl.store(code_ptr + co + b, byt.to(tl.uint8), mask=b < NB)
    tl.store(gain_ptr + go, g16)
    if over:
        tl.atomic_add(flag_ptr + 1, 1)
    return v, scale


@triton.jit(do_not_specialize=["t0", "base"])
def _spherical_step_kernel(x_ptr, sxb, sxh, pos_ptr, base, H, flag_ptr, dec_ptr, sdb, sdh, sdt,
                           idx_ptr, sib, sih, ainv_ptr, m_ptr, c_ptr, lv_ptr, ed_ptr,
                           code_ptr, scr, scb, sch, gain_ptr, sgr, sgb, sgh,
                           idx2_ptr, sib2, sih2, ainv2_ptr, m2_ptr, c2_ptr, lv2_ptr, ed2_ptr,
                           code2_ptr, scr2, scb2, sch2, gain2_ptr,
                           D: tl.constexpr, DP: tl.constexpr, LSQ: tl.constexpr, SPLIT: tl.constexpr,
                           D1: tl.constexpr, DP1: tl.constexpr, BITS1: tl.constexpr, NB1: tl.constexpr,
                           NBP1: tl.constexpr, NE1: tl.constexpr, NEP1: tl.constexpr,
                           D2: tl.constexpr, DP2: tl.constexpr, BITS2: tl.constexpr, NB2: tl.constexpr,
                           NBP2: tl.constexpr, NE2: tl.constexpr, NEP2: tl.constexpr, TILE: tl.constexpr,
                           t0, sxt, DEVPOS: tl.constexpr, DEC: tl.constexpr,
                           sk_ptr, qs_ptr, qsig_ptr, sqr, sqb, sqh, qn_ptr, snr, snb, snh,
                           QJL: tl.constexpr = False, NBQ: tl.constexpr = 1, NBPQ: tl.constexpr = 1):
    """Program (b*H+h, t): the token x[b, h, t] at position p = t0 + t (DEVPOS: + *pos_ptr, a
    graphed step's device position); field rows p - base (their strides: row, batch, head; a
    part's codes contiguous), history token p (DEC).
    SPLIT: part 1 is the regular channels (idx_ptr), part 2 the outlier ones (idx2_ptr),
    each with its matrices, levels and fields; an index's batch stride is 0 where one mask
    row serves every batch row. The gains of both parts share their strides.
    QJL (keys, no split): the MSE stage's decode in float64, the residual r = x - it, its norm
    (qn_ptr, fp16) and the signs of S r (qsig_ptr, 1 bit per sketch row; S at sk_ptr, fp16
    [D, D]); the decoded token adds sqrt(pi/2)/m ||r||_fp16 S^T z (*qs_ptr = sqrt(pi/2)/m)."""
    t = tl.program_id(1)
    p = t0 + t
    if DEVPOS:
        p += tl.load(pos_ptr)
    row = p - base
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    xo = b.to(tl.int64) * sxb + h * sxh + t.to(tl.int64) * sxt
    d = tl.arange(0, DP)
    x = tl.load(x_ptr + xo + d, mask=d < D, other=0.0).to(tl.float32)
    n_bad = tl.sum((nonfinite(x) & (d < D)).to(tl.int32), axis=0)
    if n_bad > 0:
        tl.atomic_add(flag_ptr, n_bad)
    do = b.to(tl.int64) * sdb + h * sdh + p.to(tl.int64) * sdt
    fo = row.to(tl.int64)
    v1, scale1 = _part(x_ptr, xo, idx_ptr, b * sib + h * sih, ainv_ptr, m_ptr, h * D1 * D1, c_ptr, lv_ptr, ed_ptr,
                       code_ptr, fo * scr + b * scb + h * sch, gain_ptr, fo * sgr + b * sgb + h * sgh, dec_ptr, do,
                       flag_ptr, D1, DP1, SPLIT, BITS1, NB1, NBP1, NE1, NEP1, LSQ, TILE, DEC and not QJL)
    if QJL:  # (no split: `unsupported`)
        dm = d < D
        tile = dm[:, None] & dm[None, :]
        mt = tl.load(m_ptr + h * D * D + d[:, None] * D + d[None, :], mask=tile, other=0.0)
        mse = tl.sum(v1[:, None] * mt, axis=0) * scale1  # exact products: the MSE stage as decode builds it
        r = tl.where(dm, x.to(tl.float64) - mse, 0.0)
        rn = tl.sqrt(tl.sum(r * r, axis=0))
        sk = tl.load(sk_ptr + d[:, None] * D + d[None, :], mask=tile, other=0.0).to(tl.float64)  # S[i, j]
        proj = tl.sum(sk * r[None, :], axis=1)  # (S r)[i]
        sign = tl.where(dm & (proj < 0), 1, 0)
        qb = tl.arange(0, NBPQ)
        tl.store(qsig_ptr + fo * sqr + b * sqb + h * sqh + qb, pack_row(sign, 1, DP, NBPQ).to(tl.uint8), mask=qb < NBQ)
        rn16 = rn.to(tl.float32).to(tl.float16)
        tl.store(qn_ptr + fo * snr + b * snb + h * snh, rn16)
        if rn > 65504.0:
            tl.atomic_add(flag_ptr + 1, 1)
        if DEC:
            z = 1.0 - 2.0 * sign.to(tl.float64)
            zs = tl.sum(z[:, None] * sk, axis=0)  # z @ S: +-1 times fp16 values, exact
            out = mse + zs * (rn16.to(tl.float64) * tl.load(qs_ptr))
            tl.store(dec_ptr + do + d, to_dtype_rne(out.to(tl.float32), dec_ptr.dtype.element_ty), mask=dm)
    if SPLIT:
        _part(x_ptr, xo, idx2_ptr, b * sib2 + h * sih2, ainv2_ptr, m2_ptr, h * D2 * D2, c2_ptr, lv2_ptr, ed2_ptr,
              code2_ptr, fo * scr2 + b * scb2 + h * sch2, gain2_ptr, fo * sgr + b * sgb + h * sgh, dec_ptr, do, flag_ptr,
              D2, DP2, SPLIT, BITS2, NB2, NBP2, NE2, NEP2, LSQ, TILE, DEC)


def unsupported(q, head_dim: int) -> str | None:
    """Why the kernel cannot take q's writes at this head_dim (None: it can; any head_dim
    the quantizer takes). Host only."""
    if q.use_qjl and q.has_outliers:
        return f"{q.spec} {q.role}: QJL keys with an outlier split are coded by the torch path"
    return None


_QJL_ARGS = ("sk_ptr", "qs_ptr", "qsig_ptr", "sqr", "sqb", "sqh", "qn_ptr", "snr", "snb", "snh")


class SphericalTables:
    """What the kernel reads of one (layer, role)'s shared tensors, per part: the channel
    index, the float64 matrices (M, c, A^-1) and the levels with their midpoints; the
    fields a write stores (`field_shapes`: name -> (shape after [B, H, T], dtype)) and the
    kernel's constants, both made once."""

    overflow = "a spherical gain or QJL residual norm"  # what the kernel's second flag counts

    def __init__(self, q, shared: dict, head_dim: int, batch: int, device):
        why = unsupported(q, head_dim)
        if why:
            raise ValueError(why)
        self.q, self.D = q, head_dim
        self.qjl = q.use_qjl
        if self.qjl:  # the sketch S (fp16 [D, D]) and sqrt(pi/2)/m in float64 (a constexpr would be fp32)
            self.sketch = shared["qjl"].to(device).contiguous()
            self.qjl_scale = torch.tensor([QJL_SCALE / self.sketch.shape[0]], dtype=torch.float64, device=device)
        self.parts = []
        for (part, d, bits), ix in zip(q.parts(head_dim), q.channel_index(shared, head_dim, device)):
            m, c, inv = q.matrices(shared, d, device, part)
            lv, edges = q.levels(d, device, bits)
            self.parts.append(dict(
                part=part, d=d, bits=bits, idx=None if ix is None else ix.to(torch.int32).contiguous(),
                ainv=inv.contiguous(), m=m.contiguous(), c=torch.tensor([c], dtype=torch.float64, device=device),
                lv=lv.contiguous(), edges=edges.contiguous()))
        self.split = len(self.parts) == 2
        if self.split and self.parts[0]["idx"].shape[0] not in (1, batch):
            raise ValueError(f"{q.spec}: a channel index of {self.parts[0]['idx'].shape[0]} rows "
                             f"for a batch of {batch}")
        self.field_shapes, self.const = {}, dict(D=head_dim, DP=p2(head_dim), LSQ=q.config.gain == "lsq",
                                                 SPLIT=self.split, TILE=TILE)
        for n, p in zip("12", self.parts + self.parts[:1] * (not self.split)):  # (part 2 never read without a split)
            nb, ne = (p["d"] * p["bits"] + 7) // 8, p["edges"].numel()
            self.field_shapes["codes" + p["part"]] = ((nb,), torch.uint8)
            self.field_shapes["gain" + p["part"]] = ((), torch.float16)
            self.const.update({f"D{n}": p["d"], f"DP{n}": p2(p["d"]), f"BITS{n}": p["bits"], f"NB{n}": nb,
                               f"NBP{n}": p2(nb), f"NE{n}": ne, f"NEP{n}": p2(max(ne, 1))})
        if self.qjl:
            nbq = (head_dim + 7) // 8
            self.field_shapes.update(qjl_signs=((nbq,), torch.uint8), qjl_norm=((), torch.float16))
            self.const.update(QJL=True, NBQ=nbq, NBPQ=p2(nbq))

    def launch(self, x, t0: int, pos, base: int, flags, fields: dict, dec) -> None:
        """Tokens x `[B, H, T, D]` (last axis contiguous) at positions t0 + t (+ the device
        position `pos`, or None); `fields` (codes / gain of each part: row, batch and head
        strides first) at rows position - base; the decoded tokens into `dec` `[B, H, cap,
        D]` at their positions (None: not written)."""
        B, H, T, D = x.shape
        pos_arg, devpos = device_pos(pos, x)
        p1 = self.parts[0]
        p2_ = self.parts[1] if self.split else p1
        f1c, f1g = fields["codes" + p1["part"]], fields["gain" + p1["part"]]
        f2c, f2g = (fields["codes_o"], fields["gain_o"]) if self.split else (f1c, f1g)
        idx = [(p["idx"], 0 if p["idx"].shape[0] == 1 else p["idx"].stride(0), p["idx"].stride(1))
               if self.split else (f1c, 0, 0) for p in (p1, p2_)]  # (never read without a split)
        dec_arg = f1c if dec is None else dec
        sd = (0, 0, 0) if dec is None else (dec.stride(0), dec.stride(1), dec.stride(2))
        if self.qjl:
            qs, qn = fields["qjl_signs"], fields["qjl_norm"]
            qjl = (self.sketch, self.qjl_scale, qs, qs.stride(0), qs.stride(1), qs.stride(2),
                   qn, qn.stride(0), qn.stride(1), qn.stride(2))
        else:
            qjl = (f1c, f1c, f1c, 0, 0, 0, f1g, 0, 0, 0)  # never read
        launch(_spherical_step_kernel, (B * H, T), x, x.stride(0), x.stride(1), pos_arg, base, H, flags,
               dec_arg, *sd,
               *idx[0], p1["ainv"], p1["m"], p1["c"], p1["lv"], p1["edges"],
               f1c, f1c.stride(0), f1c.stride(1), f1c.stride(2), f1g, f1g.stride(0), f1g.stride(1), f1g.stride(2),
               *idx[1], p2_["ainv"], p2_["m"], p2_["c"], p2_["lv"], p2_["edges"],
               f2c, f2c.stride(0), f2c.stride(1), f2c.stride(2), f2g,
               **self.const, t0=t0, sxt=x.stride(2), DEVPOS=devpos, DEC=dec is not None, **dict(zip(_QJL_ARGS, qjl)))


def encode_tokens(q, x: torch.Tensor, shared: dict):
    """`q.encode_tokens(x, shared)` in one launch: the same fields (step_encode.encode_segment)."""
    return encode_segment(SphericalTables(q, shared, x.shape[-1], x.shape[0], x.device), x)


def kernel_quantizer(q):
    """Quantizer `q` (spherical) whose multi-token `encode_tokens` is the kernel where
    `unsupported` allows (see step_encode.with_kernel_encode)."""
    return with_kernel_encode(q, encode_tokens, lambda w, x: unsupported(w, x.shape[-1]))


__all__ = ["SphericalTables", "encode_tokens", "kernel_quantizer", "unsupported"]
