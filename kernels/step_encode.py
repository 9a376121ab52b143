"""Decode-step writes encoded on the device, straight into a `KernelStore`'s buffers.

The old write path of a fused cache runs the quantizer's torch `append` (tens to
hundreds of small ops and several host reads per (layer, role) and token), then
copies the new segment into the store. Here one Triton launch per (layer, role)
encodes the step's token(s) and writes the stored bytes in place at the current
length, which the host knows: no Python loop over fields or tokens, no host read.
`KernelStore.step` (kernels/store.py) calls these; the stored bytes are exactly
those of the quantizer's `encode_tokens` (suites/tests/test_step_encode.py):

- naive int, per-token groups (`IntFlat`) and KIVI's flushes: `int_rows`, asymmetric
  min/max groups as `quantizers/groups.py` (fp16 zero rounded down, scale up);
- fp8 (`FP8Flat`): `fp8_tokens`, torch's saturating float8 cast of x / scale, by
  integer arithmetic (round to nearest even), the same on the GPU and the interpreter;
- KIVI's fp16 window: `kivi_window` (the flush every G or R steps is `int_rows` on the
  window plus one shift); at a device position (CUDA graphs) the row, the flush and the
  shift (`kivi_shift`) are decided on the device from the token count by the window
  policy (`kivi_policy`), the flush and shift launches doing nothing on other steps; a
  multi-token write (a prefill) is the window kernel over every token (each checked, the
  window's stored) and one `int_rows` launch with `half` quantizing the groups straight
  from x rounded to fp16 (kernels/formats/kivi.py `KIVIStore._step_tokens`);
- HQMQ incl. Med3x (`HQMQFlat`): `hqmq_encode.hqmq_tokens` (beside the search kernel
  whose code it shares), on this module's pieces.

A dense format's kernel (spherical_step.py, vq_step.py) reads a tables object; `TablesStep`
runs it for a decode step and `encode_segment` for a multi-token write, which
`with_kernel_encode` makes a quantizer's encode (a dense layer's prefill). The jit helpers
(`rne`, `fp16_toward`, `pack_row`, `flag`, `token_program`, `nonfinite`, `to_dtype_rne`),
`device_pos` and the counted `launch` are public: a format's own step
encoder (kernels/formats/, an out-of-tree format) builds on them.

Arithmetic follows torch's op by op: IEEE division (`div_rn`), `sqrt_rn`, sums in
torch's order, round-half-even by the 1.5*2^23 trick (libdevice's rint is not in the
interpreter), and no FMA contraction on the GPU (`enable_fp_fusion=False`). The one
known difference is HQMQ's search at exact score ties (as `hqmq_search`, whose
products torch's matmul may order or fuse differently).

Bad input cannot raise from a kernel without a host read, so the kernels raise a
device-side flag instead (`StepErrors`): error bits, the first bad token, the count
of bad values per role. The cache checks it when results are read and polls it
without a sync (suites/harness/kv_cache.py says when) and raises the old path's
QuantizerInputError then, naming layer, role and token.
"""
from __future__ import annotations

import copy

import torch
import triton
import triton.language as tl

from ..quantizers.base import FP16_MAX, QuantizerInputError, Segment
from ..quantizers.checks import require
from .common import interpreting

NONFINITE, FP16_OVERFLOW = 1, 2  # error bits a kernel ORs into its role's flag row
NO_TOKEN = 2**31 - 1

# Launches are counted here (tests and `write_cost` count them: the profiler does not
# see Triton launches); `launch_hook`, when set, replaces the launch (cost counting).
LAUNCHES = [0]
launch_hook = None


def launch(kernel, grid, *args, **const):
    """Launch a step kernel (counted; through `launch_hook` when set; no FMA contraction)."""
    LAUNCHES[0] += 1
    if launch_hook is not None:
        return launch_hook(kernel, grid, *args, **const)
    if not interpreting():
        const["enable_fp_fusion"] = False  # torch rounds each product: no FMA here either
    kernel[grid](*args, **const)


def device_pos(pos, x: torch.Tensor):
    """(kernel argument, DEVPOS) for an optional device write position: an int32 tensor on
    x's device whose first element is the position, read by the kernel (not the host: no
    sync, and a CUDA graph replays the launch at the position of the moment). Checked
    without reading it."""
    if pos is None:
        return x, False  # never read
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int32 or pos.numel() < 1 or pos.device != x.device:
        raise ValueError(f"pos must be an int32 tensor on {x.device} (the write position)")
    return pos, True


class TablesStep:
    """The device encoder of one (layer, role)'s one-token writes of a dense format whose
    kernel reads `tables` (spherical_step.SphericalTables, vq_step.VQTables: built once
    from the cache's shared tensors), one launch a step: token x `[B, H, 1, D]` at the
    device position `pos` into the step's field rows `fields` (`[rows, B, H, 1, ...]`, row
    pos - base) and the decoded history `dec` `[B, H, cap, D]` at token pos. `flags` int32
    `[2]`: the counts of non-finite inputs and of values beyond fp16, added to by every step."""

    def __init__(self, tables, heads: int, fields: dict, flags: torch.Tensor):
        self.tables, self.H, self.fields, self.flags = tables, heads, fields, flags

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, base: int, dec: torch.Tensor) -> None:
        B, H, T, D = x.shape
        if T != 1 or H != self.H or D != self.tables.D or x.stride(-1) != 1 or dec.stride(-1) != 1:
            raise ValueError(f"{self.tables.q.spec} step: expected one contiguous token [B, {self.H}, 1, "
                             f"{self.tables.D}], got {tuple(x.shape)}")
        self.tables.launch(x, 0, pos, base, self.flags, self.fields, dec)


def encode_segment(tables, x: torch.Tensor):
    """The quantizer's `encode_tokens` of x (float `[B, H, T, D]`) by the kernel that reads
    `tables`, in one launch: the same fields (`tables.field_shapes`), as a Segment. Values
    beyond fp16 raise through `checks.require` (deferred inside `deferred_checks()`, as the
    torch path's); x's values were checked by `append`."""
    B, H, T, D = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    fields = {name: torch.empty((B, H, T) + tail, dtype=dtype, device=x.device)
              for name, (tail, dtype) in tables.field_shapes.items()}
    flags = torch.zeros(2, dtype=torch.int32, device=x.device)
    rows_first = {k: v.permute(2, 0, 1, *range(3, v.dim())) for k, v in fields.items()}  # (token, batch, head, ...)
    tables.launch(x, 0, None, 0, flags, rows_first, None)
    require(flags[1] > 0, lambda: overflow_error(tables))
    return Segment(fields, T)


def overflow_error(tables) -> QuantizerInputError:
    """The error of a dense kernel's second flag (values beyond the fp16 the cache stores)."""
    return QuantizerInputError(f"{tables.q.spec}: {tables.overflow} overflows the fp16 the cache stores "
                               f"(max {FP16_MAX}); rescale the input")


def with_kernel_encode(q, encode, why_not):
    """Quantizer `q` whose multi-token `encode_tokens(x, shared)` is `encode(self, x,
    shared)` (a device kernel storing the same fields) unless `why_not(self, x)` names a
    reason or the write is one token: a shallow copy of the instance (its calibration and
    seed included) whose class is a subclass of q's made once per (class, encode). Its fit,
    decode and every other method are the quantizer's own."""
    key = (type(q), encode)
    cls = _KERNEL_CLASSES.get(key)
    if cls is None:
        base = type(q)

        def encode_tokens(self, x, shared):
            if x.shape[2] < 2 or why_not(self, x):
                return base.encode_tokens(self, x, shared)
            return encode(self, x, shared)

        cls = _KERNEL_CLASSES[key] = type(f"Kernel{base.__name__}", (base,), {"encode_tokens": encode_tokens})
    w = copy.copy(q)
    w.__class__ = cls
    return w


_KERNEL_CLASSES: dict = {}


def p2(n: int) -> int:
    """The next power of two (plain Python: triton.next_power_of_2 is a slow constexpr function)."""
    return 1 << max(0, n - 1).bit_length()


# ---------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------
@triton.jit
def rne(y):
    """Round half to even of float32 |y| < 2^22 (torch.round)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def fp16_toward(t, UP: tl.constexpr):
    """fp16 of float32 t rounded toward +inf (UP) or -inf, as `groups._fp16_toward`:
    round to nearest, then one fp16 step (nextafter) when that went the wrong way."""
    h = t.to(tl.float16)
    u = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    neg = (u & 0x8000) != 0
    if UP:
        off = h.to(tl.float32) < t
        nxt = tl.where(u == 0x8000, 1, tl.where(neg, u - 1, u + 1))
    else:
        off = h.to(tl.float32) > t
        nxt = tl.where(u == 0, 0x8001, tl.where(neg, u + 1, u - 1))
    u = tl.where(off, nxt, u)
    return u.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def pack_row(v, W: tl.constexpr, NP: tl.constexpr, NBP: tl.constexpr):
    """Bytes `[NBP]` (int32, 0..255) of the W-bit values v `[NP]` (int32 >= 0, zero past
    the row): value i at bits [i*W, (i+1)*W) of a little-endian LSB-first stream, the
    layout of quantizers/packing.py. Byte j gathers the bits of every value overlapping it."""
    j = tl.arange(0, NBP)[:, None]
    i = tl.arange(0, NP)[None, :]
    sh = i * W - 8 * j  # where value i's bit 0 falls relative to byte j's bit 0
    ov = (sh > -W) & (sh < 8)
    left = tl.where(ov & (sh > 0), sh, 0)
    right = tl.where(ov & (sh < 0), -sh, 0)
    part = tl.where(ov, ((v[None, :] << left) >> right) & 0xFF, 0)
    return tl.sum(part, axis=1)  # disjoint bits: the sum is the OR


@triton.jit
def flag(err_ptr, bits, n_bad, token):
    """Raise this write's error bits (0: none) in its role's flag row.

    A branch, not masked atomics: on the H200 (Triton 3.6) the fp16 and HQMQ step kernels
    ran `atomic_min(..., mask=bits != 0)` in every program, clean ones included, so a
    multi-token write recorded token 0 as the first bad one (measured: flags [0, 0, 0]
    after a clean 10-token write; the interpreter and the int kernels were right)."""
    if bits != 0:
        tl.atomic_or(err_ptr, bits)
        tl.atomic_min(err_ptr + 1, token)
        tl.atomic_add(err_ptr + 2, n_bad)


@triton.jit
def to_dtype_rne(v, DT: tl.constexpr):
    """float32 v in dtype DT rounded to nearest even, as torch's cast; bf16 by its bits (the
    interpreter's bf16 cast does not round so; NaN is not expected: callers flag bad input)."""
    if DT == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(DT)


@triton.jit
def token_program(t0, pos_ptr, H, DEVPOS: tl.constexpr):
    """(first token, b*H+h, b, h, token) of a program (b*H+h, t) of a one-token-row kernel;
    DEVPOS: the device position at pos_ptr is added to t0 (a graphed step's write)."""
    if DEVPOS:
        t0 += tl.load(pos_ptr)
    bh = tl.program_id(0)
    return t0, bh, bh // H, bh % H, tl.program_id(1)


@triton.jit
def nonfinite(x):
    return (x != x) | (tl.abs(x) == float("inf"))


# ---------------------------------------------------------------------------------------
# int groups: IntFlat tokens and KIVI flushes
# ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["row0", "blk0", "tok0"])  # per-step values: no variant per value class
def _int_rows_kernel(x_ptr, sxb, sxh, sxr, sxe, sxk,
                     c_ptr, scb, sch, scr, sck, s_ptr, z_ptr, ssb, ssh, ssr, ssk,
                     row0, blk0, H, err_ptr, tok0, pos_ptr, TOKROWS: tl.constexpr, DEVPOS: tl.constexpr,
                     N: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, NP: tl.constexpr,
                     NGP: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                     WA: tl.constexpr = 0, WP: tl.constexpr = 0, WG: tl.constexpr = 1,
                     ROWMUL: tl.constexpr = 0, BLKMUL: tl.constexpr = 0,
                     HALF: tl.constexpr = False, TOKBLK: tl.constexpr = 0):
    """One row of N elements (program (b*H+h, row, block)) in groups of G along the row:
    `quantize_groups` of that row, written at output row row0+row of block blk0+block
    (DEVPOS: plus the device position p at pos_ptr, also added to tok0).
    KIVI's flush at a device position (DEVPOS and WP > 0, the window policy `kivi_policy`
    (WA, WP), groups of WG tokens): the program does nothing unless the step writing
    token p fills the window (q(p + 1) > q(p), q(t) = max(0, t - WA) // WP * WP); then
    the n = q(p) / WG groups held before it offset the output by n * ROWMUL rows and
    n * BLKMUL blocks, and the flag names token p (what the host-position flush does).
    HALF (KIVI's multi-token write, `KIVIStore._quantize`): x is rounded to fp16 first (what
    the old path quantizes, `x.half()`) and its values were flagged by the window kernel,
    which sees every token of the write: only a group whose step overflows fp16 with finite
    values (1-bit codes) is flagged here, as token tok0 + row * TOKROWS + block * TOKBLK."""
    if DEVPOS:
        p = tl.load(pos_ptr)
        if WP > 0:
            q0 = tl.maximum(p - WA, 0) // WP
            q1 = tl.maximum(p + 1 - WA, 0) // WP
            if q1 == q0:  # the window is not full: nothing to flush
                return
            ng = q0 * (WP // WG)
            row0 += ng * ROWMUL
            blk0 += ng * BLKMUL
        else:
            row0 += p
        tok0 += p
    bh = tl.program_id(0)
    r = tl.program_id(1)
    k = tl.program_id(2)
    b = bh // H
    h = bh % H
    e = tl.arange(0, NP)
    em = e < N
    xo = b.to(tl.int64) * sxb + h * sxh + r * sxr + k * sxk
    x = tl.load(x_ptr + xo + e * sxe, mask=em, other=0.0).to(tl.float32)
    if HALF:
        x = x.to(tl.float16).to(tl.float32)
    bad = nonfinite(x) & em
    # group statistics: a [groups, elements] tile (no gather from registers in Triton)
    g = tl.arange(0, NGP)[:, None]
    mine = (e[None, :] // G == g) & em[None, :]
    lo = tl.min(tl.where(mine, x[None, :], float("inf")), axis=1)
    hi = tl.max(tl.where(mine, x[None, :], float("-inf")), axis=1)
    gm = tl.arange(0, NGP) < N // G
    over = gm & ((tl.abs(lo) > 65504.0) | (tl.abs(hi) > 65504.0))
    zero = fp16_toward(lo, False)
    span = tl.math.div_rn(hi - zero.to(tl.float32), ((1 << BITS) - 1) * 1.0)
    wide = gm & (span > 65504.0)
    over = over | wide
    scale = fp16_toward(span, True)
    so = b.to(tl.int64) * ssb + h * ssh + (row0 + r) * ssr + (blk0 + k) * ssk
    gi = tl.arange(0, NGP)
    tl.store(s_ptr + so + gi, scale, mask=gm)
    tl.store(z_ptr + so + gi, zero, mask=gm)
    # each element's group parameters, back from the tile
    z = tl.sum(tl.where(mine, zero.to(tl.float32)[:, None], 0.0), axis=0)
    s = tl.sum(tl.where(mine, scale.to(tl.float32)[:, None], 0.0), axis=0)
    pos = s > 0
    q = rne(tl.math.div_rn(x - z, tl.where(pos, s, 1.0)))
    q = tl.where(pos, q, 0.0)
    q = tl.minimum(tl.maximum(q, 0.0), ((1 << BITS) - 1) * 1.0)
    q = tl.where(em, q, 0.0).to(tl.int32)
    byt = pack_row(q, BITS, NP, NBP)
    co = b.to(tl.int64) * scb + h * sch + (row0 + r) * scr + (blk0 + k) * sck
    j = tl.arange(0, NBP)
    tl.store(c_ptr + co + j, byt.to(tl.uint8), mask=j < NB)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if HALF:
        bits = tl.where((n_bad == 0) & (tl.max(wide.to(tl.int32), axis=0) > 0), 2, 0)
        flag(err_ptr, bits, 0, tok0 + r * TOKROWS + k * TOKBLK)
    else:
        bits = tl.where(n_bad > 0, 1, 0) | tl.where(tl.max(over.to(tl.int32), axis=0) > 0, 2, 0)
        flag(err_ptr, bits, n_bad, tok0 + r * TOKROWS)


def int_rows(x, x_strides, rows: int, blocks: int, codes, c_strides, scale, zero, s_strides,
             row0: int, blk0: int, *, n: int, group: int, bits: int, err, tok0: int, token_rows: bool, pos=None,
             flush=None, half: bool = False, tok_blocks: int = 0):
    """`quantize_groups` of `rows` x `blocks` rows of n elements of x, each written at
    output row row0 + row, block blk0 + block. Strides in elements: x (b, h, row,
    element, block); codes and scale/zero (b, h, row, block), the row's bytes / groups
    contiguous. `token_rows`: rows are tokens tok0 + row (for the error flag).
    `pos`: None, or a device int32 tensor whose first element is added to row0 and tok0
    when the kernel runs (a CUDA graph's write position; see `device_pos`).
    `flush` (with `pos`): KIVI's flush decided on the device, ((A, P), G, rows_per_group,
    blocks_per_group): the launch writes only when the step writing token pos fills the
    window of policy (A, P) (`kivi_policy`), after the groups of G tokens held then
    (see `_int_rows_kernel`).
    `half` (KIVI's multi-token write): x rounded to fp16 first, its values flagged by the
    window kernel (`kivi_window`), here only a group's step overflow, as token tok0 + row
    (`token_rows`) + block * `tok_blocks`."""
    B, H = x.shape[0], x.shape[1]
    nb = (n * bits + 7) // 8
    pos_arg, devpos = device_pos(pos, x)
    win = {}
    if flush is not None:
        if not devpos:
            raise ValueError("a device-decided flush needs the device position pos")
        (wa, wp), wg, rowmul, blkmul = flush
        win = dict(WA=wa, WP=wp, WG=wg, ROWMUL=rowmul, BLKMUL=blkmul)
    if half:
        win.update(HALF=True, TOKBLK=tok_blocks)
    launch(_int_rows_kernel, (B * H, rows, blocks), x, *x_strides, codes, *c_strides, scale, zero, *s_strides,
            row0, blk0, H, err, tok0, pos_arg, TOKROWS=int(token_rows), DEVPOS=devpos, N=n, G=group, BITS=bits, NP=p2(n),
            NGP=p2(n // group), NB=nb, NBP=p2(nb), **win)


# ---------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["t0"])
def _fp8_kernel(x_ptr, sxb, sxh, sxt, c_ptr, scb, sch, sct, scale_ptr, t0, H, err_ptr, pos_ptr,
                DEVPOS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr,
                MAXV: tl.constexpr):
    """`(x / scale[h]).clamp(-max, max).to(float8)` bit patterns of one token row, by
    integer arithmetic: M mantissa bits, EMIN the smallest normal exponent. DEVPOS: the
    device position at pos_ptr is added to t0."""
    t0, bh, b, h, t = token_program(t0, pos_ptr, H, DEVPOS)
    d = tl.arange(0, DP)
    dm = d < D
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + h * sxh + t * sxt + d, mask=dm, other=0.0).to(tl.float32)
    bad = nonfinite(x) & dm
    y = tl.math.div_rn(x, tl.load(scale_ptr + h))
    y = tl.minimum(tl.maximum(y, -MAXV), MAXV)
    ybits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    ex = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)  # binade, normal or not
    q = rne(a * ((127 + M - ex) << 23).to(tl.float32, bitcast=True))  # a / 2^(ex - M), exact scaling
    code = q.to(tl.int32) + ((ex - EMIN) << M)  # q = 2^(M+1) carries into the exponent
    code = code | ((ybits >> 24) & 0x80)  # the sign, -0 included
    tl.store(c_ptr + b.to(tl.int64) * scb + h * sch + (t0 + t) * sct + d, code.to(tl.uint8), mask=dm)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    flag(err_ptr, tl.where(n_bad > 0, 1, 0), n_bad, t0 + t)


FP8_FORMATS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}  # mantissa bits, min exponent, max


def fp8_tokens(x, codes, scale, fmt: str, t0: int, err, pos=None):
    """fp8 codes of x `[B, H, t, D]` into codes `[B, H, Tcap, D]` at token t0 (plus the
    device position `pos`, see `int_rows`); scale `[H]` fp32."""
    B, H, t, D = x.shape
    m, emin, mx = FP8_FORMATS[fmt]
    pos_arg, devpos = device_pos(pos, x)
    launch(_fp8_kernel, (B * H, t), x, x.stride(0), x.stride(1), x.stride(2), codes, codes.stride(0),
            codes.stride(1), codes.stride(2), scale, t0, H, err, pos_arg, DEVPOS=devpos, D=D, DP=p2(D), M=m,
            EMIN=emin, MAXV=mx)


# ---------------------------------------------------------------------------------------
# the fp16 store (the engine's unquantized baseline)
# ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["t0"])
def _fp16_kernel(x_ptr, sxb, sxh, sxt, v_ptr, svb, svh, svt, t0, H, err_ptr, pos_ptr,
                 DEVPOS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """x's token row as fp16 (`FP16.encode_tokens`: x.half()), flags as KIVI's window:
    1 non-finite, 2 beyond the fp16 range."""
    t0, bh, b, h, t = token_program(t0, pos_ptr, H, DEVPOS)
    d = tl.arange(0, DP)
    dm = d < D
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + h * sxh + t * sxt + d, mask=dm, other=0.0).to(tl.float32)
    bad = nonfinite(x) & dm
    over = (tl.abs(x) > 65504.0) & dm & ~bad
    tl.store(v_ptr + b.to(tl.int64) * svb + h * svh + (t0 + t) * svt + d, x.to(tl.float16), mask=dm)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    bits = tl.where(n_bad > 0, 1, 0) | tl.where(tl.sum(over.to(tl.int32), axis=0) > 0, 2, 0)
    flag(err_ptr, bits, n_bad, t0 + t)


def fp16_tokens(x, values, t0: int, err, pos=None):
    """x `[B, H, t, D]` as fp16 into values `[B, H, Tcap, D]` at token t0 (plus the device
    position `pos`, see `int_rows`)."""
    B, H, t, D = x.shape
    pos_arg, devpos = device_pos(pos, x)
    launch(_fp16_kernel, (B * H, t), x, x.stride(0), x.stride(1), x.stride(2), values, values.stride(0),
           values.stride(1), values.stride(2), t0, H, err, pos_arg, DEVPOS=devpos, D=D, DP=p2(D))


# ---------------------------------------------------------------------------------------
# KIVI's fp16 window
# ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["row", "skip", "tok"])
def _window_kernel(x_ptr, sxb, sxh, sxt, r_ptr, srb, srh, row, skip, H, err_ptr, tok, pos_ptr,
                   D: tl.constexpr, DP: tl.constexpr, DEVPOS: tl.constexpr = False,
                   WA: tl.constexpr = 0, WP: tl.constexpr = 1):
    """x's token t (program (b*H+h, t)) as fp16 into window row row + t - skip, flagged as
    token tok + t; a token t < skip is only flagged (a multi-token write quantizes it
    straight from x: `int_rows` with `half`). DEVPOS: one token p at pos_ptr, into row
    p - q(p), the window's length under the policy (WA, WP) (`kivi_policy`)."""
    if DEVPOS:
        p = tl.load(pos_ptr)
        row = p - tl.maximum(p - WA, 0) // WP * WP
        tok = p
    bh = tl.program_id(0)
    t = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, DP)
    dm = d < D
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + h * sxh + t.to(tl.int64) * sxt + d, mask=dm,
                other=0.0).to(tl.float32)
    bad = nonfinite(x) & dm
    over = (tl.abs(x) > 65504.0) & dm & ~bad
    if t >= skip:
        tl.store(r_ptr + b.to(tl.int64) * srb + h * srh + (row + t - skip) * D + d, x.to(tl.float16), mask=dm)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    bits = tl.where(n_bad > 0, 1, 0) | tl.where(tl.sum(over.to(tl.int32), axis=0) > 0, 2, 0)
    flag(err_ptr, bits, n_bad, tok + t)


def kivi_window(x, residual, row: int, err, tok: int, pos=None, policy: tuple[int, int] | None = None,
                skip: int = 0):
    """x `[B, H, t, D]` as fp16 into the window buffer `[B, H, Rcap, D]`: token i (flagged
    as token tok + i) into row row + i - skip, the first `skip` tokens only checked (a
    multi-token write quantizes them from x; a decode step: t = 1, skip 0). `pos` (a
    device position, see `device_pos`) with the window `policy` (A, P) of `kivi_policy`:
    one token, pos, into row pos - q(pos), read on the device (row and tok are ignored)."""
    B, H, t, D = x.shape
    assert x.stride(3) == 1 and residual.stride(3) == 1 and residual.stride(2) == D
    pos_arg, devpos = device_pos(pos, x)
    win = {}
    if devpos:
        if policy is None:
            raise ValueError("a window write at a device position needs the window policy (A, P)")
        if t != 1 or skip:
            raise ValueError("a window write at a device position takes one token")
        win = dict(DEVPOS=True, WA=policy[0], WP=policy[1])
    launch(_window_kernel, (B * H, t), x, x.stride(0), x.stride(1), x.stride(2), residual, residual.stride(0),
           residual.stride(1), row, skip, H, err, tok, pos_arg, D=D, DP=p2(D), **win)


@triton.jit
def _shift_kernel(r_ptr, srb, srh, pos_ptr, H, D: tl.constexpr, DP: tl.constexpr, WA: tl.constexpr,
                  WP: tl.constexpr, CH: tl.constexpr):
    """After a flush decided on the device (the step writing token p filled the window):
    window rows WP .. WA+WP-1 move down to 0 .. WA-1; nothing otherwise. One program per
    (b, h), in chunks of CH <= WP rows in increasing order, each loaded by every thread
    before any stores (barriers), so no row is overwritten before it was read."""
    p = tl.load(pos_ptr)
    if tl.maximum(p + 1 - WA, 0) // WP == tl.maximum(p - WA, 0) // WP:
        return
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    base = r_ptr + b.to(tl.int64) * srb + h * srh
    r = tl.arange(0, CH)
    d = tl.arange(0, DP)
    for r0 in tl.static_range(0, WA, CH):
        m = ((r0 + r) < WA)[:, None] & (d < D)[None, :]
        x = tl.load(base + (WP + r0 + r)[:, None] * D + d[None, :], mask=m)
        tl.debug_barrier()
        tl.store(base + (r0 + r)[:, None] * D + d[None, :], x, mask=m)
        tl.debug_barrier()


def kivi_shift(residual, pos, policy: tuple[int, int]) -> None:
    """The window shift after a flush decided on the device (`_shift_kernel`); no launch
    when the policy keeps nothing (A == 0: the paper's keys empty the window)."""
    a, p = policy
    if not a:
        return
    B, H, _, D = residual.shape
    assert residual.stride(3) == 1 and residual.stride(2) == D
    pos_arg, _ = device_pos(pos, residual)
    ch = min(1 << (p.bit_length() - 1), p2(a))  # a power of two <= P
    launch(_shift_kernel, (B * H,), residual, residual.stride(0), residual.stride(1), pos_arg, H,
            D=D, DP=p2(D), WA=a, WP=p, CH=ch)


# ---------------------------------------------------------------------------------------
# deferred input errors
# ---------------------------------------------------------------------------------------
class StepErrors:
    """The error flags the step kernels of one layer raise: int32 `[2 roles, 4]` on the
    device, per role (error bits, first bad token, bad values, unused). `poll()` looks without a
    host sync (a CPU tensor is read in place; on CUDA every POLL_EVERY-th call an
    asynchronous copy to pinned memory, read by a later poll once its event has
    completed); `check()` reads it now (a sync)."""

    POLL_EVERY = 16

    def __init__(self, device: torch.device):
        # rows of 4 (the 4th unused): each role's row starts 16-byte aligned, as Triton
        # specialises pointers by alignment; with rows of 3 the V row (offset 12 B) made
        # every step kernel compile twice, once per role
        self.flags = torch.zeros(2, 4, dtype=torch.int32, device=device)
        self.flags[:, 1].fill_(NO_TOKEN)  # (an indexed assignment of a Python int reads a scalar tensor)
        self.rows = (self.flags[0], self.flags[1])
        self.cuda = self.flags.is_cuda
        self.host = torch.zeros(2, 4, dtype=torch.int32, pin_memory=True) if self.cuda else self.flags
        self.host_np = self.host.numpy()  # a view: reading it is no torch op and no sync
        self.event = None
        self.calls = 0

    def reset(self) -> None:
        """No error raised, in place (the buffers a captured graph holds stay where they are)."""
        self.flags.zero_()
        self.flags[:, 1].fill_(NO_TOKEN)
        if self.cuda:
            self.host.zero_()
        self.event, self.calls = None, 0

    def poll(self) -> bool:
        """True when an error is known on the host (no sync; CUDA: as of an earlier poll)."""
        if self.cuda:
            self.calls += 1
            if self.calls % self.POLL_EVERY or (self.event is not None and not self.event.query()):
                return False
            bad = bool(self.host_np[:, 0].any())
            self.host.copy_(self.flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            return bad
        return bool(self.host_np[:, 0].any())

    def check(self, layer: int) -> None:
        """Raise the input error a step kernel found (a host sync on CUDA)."""
        for role, (bits, tok, n_bad, _) in zip(("K", "V"), self.flags.tolist()):
            if not bits:
                continue
            where = (f"layer {layer} {role}: a write encoded on the device (token {tok}; "
                     "reported when the cache was next checked, see kvqbench.suites.harness.kv_cache)")
            if bits & NONFINITE:
                raise QuantizerInputError(f"{where}: input has {n_bad} NaN/Inf values; a cache cannot store them")
            raise QuantizerInputError(f"{where}: a value overflows the fp16 the cache stores (max {FP16_MAX}); "
                                      "rescale the input")


__all__ = ["StepErrors", "device_pos", "fp8_tokens", "int_rows", "launch", "p2", "rne", "fp16_toward", "pack_row",
           "flag", "token_program", "nonfinite", "to_dtype_rne", "kivi_shift", "kivi_window", "LAUNCHES", "FP8_FORMATS",
           "TablesStep", "encode_segment", "overflow_error", "with_kernel_encode"]
