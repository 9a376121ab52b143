"""HQMQ: Hurwitz quaternion multiplicative quantization (arXiv 2605.27646),
as specified in METHOD.md section 1. (About 460 lines: one quantizer file, as the plugin
contract asks; each option below -- Med3x and its medians, fill, mixed-radix codes, the
int8 codebook -- is explained beside the code it changes.)

Each 4-element chunk of a K/V vector is a quaternion r*u. The direction u is
coded as the product p*s of one of the 24 unit Hurwitz quaternions (the group
2T) and one of S seeded Haar-random unit quaternions, chosen to maximise
<u, p*s>; the radius r gets `r` bits, uniform (or log-spaced) on
[0, r_max], r_max being the largest coded chunk radius of that token vector,
stored once in fp16. No calibration data is used.

Search: <u, p*s> = <u*conj(s), p>, and the best p for a vector is O(1)
(`nearest_hurwitz`), so coding is O(S) per chunk: one matmul rotates every
chunk by all S conjugated secondaries.

Med3x (`outliers=med3`): per write and per (batch row, kv-head) of that
(layer, role), r_med is the median chunk radius over "the chunks being
written", and chunks with r > C*r_med are kept exactly in fp16 behind a
1-bit-per-chunk flag bitmap; r_max is taken over the remaining chunks only
(the public code included outliers, which wastes the radius levels). Because
the median depends on the write, appended writes differ from one big write
when Med3x is on. Which chunks the median is taken over (`median=`):

- `median=write` (the default): the chunks of the write alone. At prefill
  every chunk of every token of the write; at a one-token decode step the
  head_dim/4 chunks of that token (16 at d=64): a median of a small sample,
  so a decode token whose chunks are all large against the prompt (a token
  of 10x the typical radius) flags few or none of them.
- `median=prefill`: the first write of the (layer, role) (the prefill) takes
  its median as above and KEEPS it per (b, h); every later write (decode
  steps, later chunks) uses the threshold C * max(r_med_prefill, r_med_write),
  r_med_write its own median as above. So a later chunk is an outlier only
  if it is large against both the prompt's typical radius and its own write.
  Why the max and not r_med_prefill alone: it keeps the bound that at most
  half of a write's chunks are outliers (C > 1, and at most half exceed the
  write's own median), which the fused store's outlier-list room and the
  CUDA-graph reservation rely on (kernels/formats/hqmq.py `_step_room`,
  `_write_room`, `_reserve_more`). The kept median is stored bytes of the
  cache: shared tensor `r_med`, fp16 `[B, H]` per (layer, role), 16 bits per
  (b, h), fitted on the first write like fitted.py's per-row tensors (so
  counted in the measured bits, once per batch row). It is rounded toward
  zero to fp16, so the prefill's own threshold C * max(fp16(m), m) is
  exactly today's C * m and the prefill's bytes equal `median=write`'s; later
  writes use the stored fp16 value. The fused store's device encoders do not
  implement it: the store declines device steps for it (kernels/formats/hqmq.py
  `device_refusal`) and the cache's writes take this reference encoder.

Fill (`fill=true`): codes take whole bits, so S=96 pays 12 bits for 2304 of
4096 code values. With fill, S is raised to floor(2^b / 24) for the b code
bits the given S already pays for (96 -> 170 at 12 bits, 24 -> 42 at 10,
256 -> 341 at 13): the same code bytes, and only the added secondaries as
extra stored bytes (measured, like everything else).

Mixed-radix codes (`pack=mixed`): the other answer to that waste, S kept. The codes of
a token vector's chunks are combined G at a time into one integer sum_k c_k (24 S)^k,
stored in bits_for((24 S)^G) bits (quantizers/packing.py `mixed_layout`: G gives the
fewest row bytes among groups < 2^63, so a kernel unpacks a group with 64-bit integer
arithmetic, G - 1 divisions by the constant 24 S). S=96: 23 bits per 2 codes at d=64,
45 bits per 4 at d=128 (11.5 / 11.25 bits per code against 12 whole and log2 2304 =
11.17). The radius codes stay `pack_bits` at r bits: their radix 2^r is a power of two,
so folding them into the groups saves no bit (ceil(G (log2 24S + r)) = G r +
ceil(G log2 24S)) and only shrinks the G that fits 63 bits. Med3x uses the same code
field (outliers store code 0), so it combines with either packing. Decoding is bit
identical to `pack=bits` for the same input: only the code field's bytes differ.

Codebook precision (`codebook=int8`): decode with every codeword component rounded to the
int8 grid, c = round(127 u) / 127 (`int8_codewords`), instead of the exact product p*s. The
codes and bytes are `codebook=exact`'s (the search is unchanged); only the decoded
direction moves, by at most 1/254 per component (<= 1/127 in norm). Why offer it: a fused
kernel then gathers 4-byte codewords instead of 8-byte fp16 ones, and HQMQ's kernels are
bound by those gathers' shared-memory wavefronts (an H100 experiment,
reports/latency/cb8_experiment_h100_2026-12-06/: -14 to -15% kernel time at B=8 T=32k), for
about +0.1% of a Gaussian cache's squared error. `codebook=exact` is the method as specified.

Stored per token vector: packed codes (ceil(log2(24 S)) bits per chunk; mixed: above),
packed radius codes (r bits per chunk), r_max (fp16); with Med3x also the flag
bitmap and the fp16 outlier chunks in (batch, head, token, chunk) order.
Per (layer, role): the S secondaries of each kv-head, fp16 (a seeded model constant);
with median=prefill the kept median, fp16 per (batch row, kv-head) (cache bytes). The per-64-token
outlier index a fused kernel needs is derived state (`outlier_block_starts`,
built by kernels/layout.py or a kernel-side store), not stored bytes.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable, fp16_rounding_bound
from .fitted import FitsOnFirstWrite
from .packing import bits_for, mixed_layout, pack_bits, pack_mixed, unpack_bits, unpack_mixed
from .quaternion import conj, hamilton, hurwitz_units, nearest_hurwitz, random_unit_quaternions, right_mul_matrix

OUTLIER_BLOCK = 64  # tokens per entry of the outlier index a kernel uses
LOG_MIN_RATIO = 1 / 64  # smallest nonzero log-spaced radius level, relative to r_max
COS_45 = math.sqrt(0.5)  # 2T's covering radius on S^3 is 45 degrees


def outlier_block_starts(per_token: torch.Tensor) -> torch.Tensor:
    """Kernel-side outlier index from outlier counts per token `[B, H, T]`:
    `[B, H, ceil(T/64)]` int32, the start of each 64-token block's outliers within
    its (b, h) list (outliers of one (b, h) in (token, chunk) order). Derived state:
    HQMQ does not store it (kernels/layout.py and the kernel store rebuild it)."""
    B, H, T = per_token.shape
    per_block = torch.nn.functional.pad(per_token, (0, (-T) % OUTLIER_BLOCK))
    per_block = per_block.view(B, H, -1, OUTLIER_BLOCK).sum(-1)
    return (torch.cumsum(per_block, -1) - per_block).int().contiguous()


# Secondaries per (layer, role, kv-head). The codebook tables grow as 24*S (a kernel's fp16
# table: 1 MiB per head at 5461, x 180 heads of the embedded model) and the search is
# O(S) per chunk (CPU, 2 threads, one 64-token window of 2 heads x d 64: S=4096 0.17-2 s,
# 65536 2.4 s (idle) to 27 s (loaded); S=1e6 took 6 GB and hung). The limit is the largest
# S whose codes fit 17 bits, so every allowed S is allowed after `fill` too; 17 code bits
# per chunk is already past the ~5-bit caches the method is for (the paper's S <= 256).
MAX_S = (1 << 17) // 24  # 5461
CODEBOOKS = ("exact", "int8")  # decoded codeword precision (module docstring)
INT8_SCALE = 127  # codebook=int8: components on the grid k / 127, |k| <= 127


def int8_components(cw: torch.Tensor) -> torch.Tensor:
    """codebook=int8's integers k = round(127 u) of codewords u (unit quaternions' components
    lie in [-1, 1], so |k| <= 127 and k fits an int8; a kernel's int8 table stores them)."""
    return torch.round(cw * INT8_SCALE)


def int8_codewords(cw: torch.Tensor) -> torch.Tensor:
    """codebook=int8's codewords: each component rounded to the nearest k / 127."""
    return int8_components(cw) / INT8_SCALE


MEDIANS = ("write", "prefill")  # Med3x's median: over each write, or max(the prefill's kept, the write's)


class HQMQ(Quantizer):
    name = "hqmq"
    description = "Hurwitz quaternion multiplicative VQ: 2T x S seeded secondaries, r radius bits, optional Med3x"
    example_specs = tuple(
        f"hqmq:S={S},r={r}" + extra for S, r in ((24, 3), (96, 4), (256, 5)) for extra in ("", ",outliers=med3")
    ) + ("hqmq:S=96,r=4,fill=true",  # the paper's 3.79-bit point with its code field filled
         "hqmq:S=96,r=4,pack=mixed",  # ... and with its codes mixed-radix packed (same codes, fewer bytes)
         "hqmq:S=96,r=4,codebook=int8")  # ... and decoded by the int8 codebook (same bytes; the fast kernel's)
    head_dim_multiple = 4
    stochastic = True  # seeded secondaries: compare runs several seeds

    def __new__(cls, config=None, *args, **kwargs):
        # median=prefill keeps state across writes (fitted.py's mechanism: the kept median is
        # a per-row shared tensor fitted on the first write, counted once per batch row), so
        # such a quantizer is an `HQMQKeptMedian`; every other config stays this class.
        if cls is HQMQ and getattr(config, "median", "write") == "prefill":
            cls = HQMQKeptMedian
        return super().__new__(cls)

    @dataclasses.dataclass
    class Config:
        S: int = 96
        r: int = 4
        outliers: str = "none"  # or "med3"
        C: float = 3.0  # Med3x threshold: r > C * median radius
        # Med3x: the median the threshold uses (module docstring): "write" (over the chunks
        # of each write) or "prefill" (later writes: max of the prefill's kept median and
        # their own; the kept median is stored, fp16 per (b, h))
        median: str = "write"
        radius: str = "uniform"  # or "log"
        # Fill the code field: S becomes floor(2^b / 24), b = ceil(log2(24 S)) the code
        # bits the given S pays for (S=96 -> 170 at 12 bits), so the whole-bit code
        # field holds 24 S codewords instead of wasting most of its values.
        fill: bool = False
        # Code packing: "bits" (ceil(log2(24 S)) bits per code) or "mixed" (G codes as one
        # radix-24S integer per group, `packing.mixed_layout`; same decoded values).
        pack: str = "bits"
        # Decoded codeword precision: "exact" (p*s) or "int8" (`int8_codewords`)
        codebook: str = "exact"

    def validate_config(self):
        c = self.config
        if c.S < 1:
            raise QuantizerInputError(f"hqmq: S must be >= 1, got {c.S}")
        if c.fill and c.S <= MAX_S:  # the spec then names the S used: "hqmq:S=96,fill=true" -> S=170
            self.config = c = dataclasses.replace(c, S=(1 << bits_for(24 * c.S)) // 24)
        if c.S > MAX_S:
            raise QuantizerInputError(f"hqmq: S must be in 1..{MAX_S}, got {c.S}{' after fill' if c.fill else ''} "
                                      "(each (layer, role, kv-head) holds 24*S codewords and the search is O(S) "
                                      "per chunk)")
        if not 1 <= c.r <= 8:
            raise QuantizerInputError(f"hqmq: r (radius bits) must be in 1..8, got {c.r}")
        if c.outliers not in ("none", "med3"):
            raise QuantizerInputError(f"hqmq: outliers must be none or med3, got {c.outliers!r}")
        if c.median not in MEDIANS:
            raise QuantizerInputError(f"hqmq: median must be one of {', '.join(MEDIANS)}, got {c.median!r}")
        if c.median != "write" and c.outliers != "med3":
            raise QuantizerInputError(f"hqmq: median={c.median} needs outliers=med3 (it picks the median of "
                                      f"Med3x's outlier threshold; outliers={c.outliers} has none)")
        if not c.C > 1:
            raise QuantizerInputError(f"hqmq: C must be > 1, got {c.C}")
        if c.radius not in ("uniform", "log"):
            raise QuantizerInputError(f"hqmq: radius must be uniform or log, got {c.radius!r}")
        if c.pack not in ("bits", "mixed"):
            raise QuantizerInputError(f"hqmq: pack must be bits or mixed, got {c.pack!r}")
        if c.codebook not in CODEBOOKS:
            raise QuantizerInputError(f"hqmq: codebook must be one of {', '.join(CODEBOOKS)}, got {c.codebook!r}")
        self.append_matches_single_write = c.outliers == "none"
        if c.median == "prefill" and not isinstance(self, FitsOnFirstWrite):
            raise QuantizerInputError(f"hqmq: median=prefill needs the kept-median class ({type(self).__name__} is "
                                      "not an HQMQKeptMedian; build it as HQMQ(config) or get_quantizer(spec))")
        # median=prefill fits `r_med` on the first write: not every shared tensor is a constant
        self.shared_is_constant = c.median == "write"

    @property
    def code_bits(self) -> int:
        return bits_for(24 * self.config.S)

    def code_layout(self, nc: int) -> tuple[int, int, int, int]:
        """(G, W, W_last, row bytes) of the code field of a token vector of nc chunks:
        G = 1 and W = code_bits for pack=bits (`packing.mixed_layout` for pack=mixed)."""
        if self.config.pack == "mixed":
            return mixed_layout(24 * self.config.S, nc)
        w = self.code_bits
        return 1, w, 0, (nc * w + 7) // 8

    def pack_codes(self, code: torch.Tensor) -> torch.Tensor:
        if self.config.pack == "mixed":
            return pack_mixed(code, 24 * self.config.S)
        return pack_bits(code, self.code_bits)

    def unpack_codes(self, packed: torch.Tensor, nc: int) -> torch.Tensor:
        if self.config.pack == "mixed":
            return unpack_mixed(packed, 24 * self.config.S, nc)
        return unpack_bits(packed, self.code_bits, nc)

    @property
    def med3(self) -> bool:
        return self.config.outliers == "med3"

    @property
    def keeps_median(self) -> bool:
        """median=prefill: the first write's median is kept (shared `r_med`, fp16 [B, H])."""
        return self.config.median == "prefill"

    # ---- codebook ---------------------------------------------------------------
    shared_is_constant = True  # the seeded secondaries alone (base.py `_device_shared`)

    def make_shared(self, heads, head_dim):
        secondaries = []
        for h in range(heads):
            g = torch.Generator().manual_seed(self.head_seed(h))
            secondaries.append(random_unit_quaternions(self.config.S, g))
        shared = {"secondaries": torch.stack(secondaries).half()}  # [H, S, 4]
        if self.keeps_median:  # one row (fitted.py): an empty cache of B rows holds [B, H]
            shared["r_med"] = torch.zeros(1, heads, dtype=torch.float16)  # placeholder: max(0, m) = m
        return shared

    # ---- median=prefill: the kept median (fitted on the first write: `HQMQKeptMedian`) --
    @staticmethod
    def write_median(r: torch.Tensor) -> torch.Tensor:
        """Median chunk radius per (b, h) of radii r `[B, H, T, nc]`: `[B, H]` float32."""
        B, H = r.shape[:2]
        return r.reshape(B, H, -1).median(dim=-1).values

    def kept_median(self, x: torch.Tensor) -> torch.Tensor:
        """The median kept from the first write x `[B, H, T, D]` (float32): fp16 `[B, H]`,
        rounded toward zero, so max(kept, m) = m at that write (its threshold is exactly
        median=write's) and never inf."""
        B, H, T, D = x.shape
        m = self.write_median(x.reshape(B, H, T, D // 4, 4).norm(dim=-1))
        h = m.half()
        down = (h.view(torch.int16) - 1).view(torch.float16)  # the next fp16 toward zero (h > m >= 0)
        return torch.where(h.float() > m, down, h)

    def constant_shared(self):
        # Seeded per (layer, role, kv-head), never fitted: a model constant (base.py), not cache bytes.
        return frozenset({"secondaries"})

    @staticmethod
    def secondaries(shared) -> torch.Tensor:
        """The secondaries as used: the stored fp16 values, renormalised."""
        s = shared["secondaries"].float()
        return s / s.norm(dim=-1, keepdim=True)

    # ---- radius levels ----------------------------------------------------------------
    def radius_levels(self, r_max: torch.Tensor) -> torch.Tensor:
        """`[..., 2^r]` radius values of each code for per-vector r_max `[...]`."""
        L = (1 << self.config.r) - 1
        q = torch.arange(L + 1, device=r_max.device, dtype=torch.float32)
        if self.config.radius == "uniform" or L == 1:
            rel = q / L
        else:
            rel = torch.where(q > 0, LOG_MIN_RATIO ** ((L - q) / (L - 1)), torch.zeros_like(q))
        return r_max.unsqueeze(-1) * rel

    def _radius_codes(self, r: torch.Tensor, rm: torch.Tensor) -> torch.Tensor:
        L = (1 << self.config.r) - 1
        if self.config.radius == "uniform":
            safe = torch.where(rm > 0, rm, torch.ones_like(rm)).unsqueeze(-1)
            return torch.round(r / safe * L).clamp(0, L).long()
        levels = self.radius_levels(rm)  # [B, H, T, L+1]
        return (r.unsqueeze(-1) - levels.unsqueeze(-2)).abs().argmin(-1)

    # ---- classification shared by encode and error_bound ------------------------------
    def _split(self, x: torch.Tensor, kept: torch.Tensor | None = None):
        """Chunks, radii, outlier mask and r_max (fp16-rounded) of float32 x; `kept`: the
        kept median `[B or 1, H]` (median=prefill), the threshold then C * max(kept, median)."""
        B, H, T, D = x.shape
        chunks = x.reshape(B, H, T, D // 4, 4)
        r = chunks.norm(dim=-1)  # [B, H, T, nc]
        if self.med3:
            r_med = self.write_median(r)
            if kept is not None:
                r_med = torch.maximum(r_med, kept.to(r_med.device).float())
            r_med = r_med.view(B, H, 1, 1)
            outlier = (r > self.config.C * r_med) & (r > 0)
        else:
            outlier = torch.zeros_like(r, dtype=torch.bool)
        r_max = torch.where(outlier, torch.zeros_like(r), r).amax(-1)  # without the outliers
        check_fp16_storable("chunk radius r_max", r_max)
        return chunks, r, outlier, r_max.half()

    # ---- encode / decode --------------------------------------------------------------
    def search(self, u: torch.Tensor, shared) -> torch.Tensor:
        """Best code p*S + s for unit chunks u `[B, H, N, 4]`, O(S) per chunk."""
        s = self.secondaries(shared).to(u.device)  # [H, S, 4]
        H, S, _ = s.shape
        rot = right_mul_matrix(conj(s))  # u @ rot[h, j] = u * conj(s_j): [H, S, 4, 4]
        # Component-major: one matmul gives component i of u*conj(s_j) for every j as a
        # contiguous [n, S] slab, so the score below is four elementwise passes.
        by_component = rot.permute(0, 2, 3, 1).reshape(H, 4, 4 * S)  # [H, 4 (u), 4 (i) x S]
        B, _, N, _ = u.shape
        # Bound the [B, H, n, 4S] temporaries: on a CPU to ~1M floats (4 MB), so the score
        # passes run in cache ([2, 3, 8192, 4] chunks: S=256 57 ms vs 144 ms at 16M floats,
        # S=96 32 vs 57 ms); on a GPU to 16M (64 MB), since each block costs ~10 launches (at 1M the
        # H200's quantize-on-write HQMQ S=256 rows took 4.8 s instead of 0.8 s). Same codes:
        # the block only splits n.
        floats = (1 << 20) if u.device.type == "cpu" else (1 << 24)
        block = max(1, floats // max(1, 4 * B * H * S))
        codes = []
        for start in range(0, N, block):
            ub = u[:, :, start : start + block]
            a = torch.matmul(ub, by_component).abs_()  # [B, H, n, 4S]
            a0, a1, a2, a3 = a.chunk(4, dim=-1)
            # nearest_hurwitz's score for all S at once: max(max_i |v_i|, sum_i |v_i| / 2).
            axis = torch.maximum(a0, a1)
            torch.maximum(axis, torch.maximum(a2, a3), out=axis)
            score = torch.maximum(axis, (a0 + a1).add_(a2).add_(a3).mul_(0.5))
            best_s = score.argmax(-1)  # first maximum on ties
            v = torch.einsum("bhnk,bhnkj->bhnj", ub, rot[torch.arange(H, device=u.device).view(1, H, 1), best_s])
            p, _ = nearest_hurwitz(v)
            codes.append(p * S + best_s)
        return torch.cat(codes, dim=2)

    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        nc = D // 4
        chunks, r, outlier, r_max16 = self._split(x, shared.get("r_med") if self.keeps_median else None)
        safe_r = torch.where(r > 0, r, torch.ones_like(r)).unsqueeze(-1)
        u = torch.where((r > 0).unsqueeze(-1), chunks / safe_r, chunks.new_tensor([1.0, 0, 0, 0]))
        code = self.search(u.reshape(B, H, T * nc, 4), shared).view(B, H, T, nc)
        rq = self._radius_codes(torch.where(outlier, torch.zeros_like(r), r), r_max16.float())
        # A chunk decoded to zero (radius code 0, or an outlier stored aside) has no
        # direction: store code 0, so equal decoded tensors have equal bytes.
        code = torch.where((rq == 0) | outlier, torch.zeros_like(code), code)
        fields = {
            "codes": self.pack_codes(code),
            "radius": pack_bits(rq, self.config.r),
            "r_max": r_max16,
        }
        if self.med3:
            out_vals = chunks[outlier]  # [n_out, 4], row-major (b, h, t, chunk) order
            check_fp16_storable("outlier chunk", out_vals)
            fields.update(flags=pack_bits(outlier.long(), 1), outliers=out_vals.half())
        return Segment(fields, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        nc = D // 4
        f = seg.fields
        code = self.unpack_codes(f["codes"], nc)  # [B, H, T, nc]
        S = self.config.S
        p_idx, s_idx = code // S, code % S
        P = hurwitz_units(device=code.device)
        s = self.secondaries(shared).to(code.device)  # [H, S, 4]
        heads = torch.arange(H, device=code.device).view(1, H, 1, 1)
        cw = hamilton(P[p_idx], s[heads, s_idx])  # [B, H, T, nc, 4]
        if self.config.codebook == "int8":
            cw = int8_codewords(cw)
        levels = self.radius_levels(f["r_max"].float())  # [B, H, T, L+1]
        r_hat = levels.gather(-1, unpack_bits(f["radius"], self.config.r, nc))
        out = cw * r_hat.unsqueeze(-1)
        if self.med3:
            flags = unpack_bits(f["flags"], 1, nc).bool()
            out[flags] = f["outliers"].float()
        return out.reshape(B, H, T, D)

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        bits = (math.log2(24 * self.config.S) + self.config.r) / 4 + 16 / head_dim
        if self.med3:
            bits += 0.25  # the flag bit per chunk; each outlier adds 64 bits more, data-dependent
        return bits

    def error_bound(self, x):
        """Per chunk r*u coded as r^*c: ||r u - r^ c||^2 = (r - r^)^2 + r r^ ||u - c||^2
        for unit c. c is taken as the best of the 24 S codewords, found here by
        exhaustive search (independent of `search`: a search that misses the best
        codeword, e.g. one ignoring the secondaries, exceeds this bound); r^ is within
        half the widest level gap of r, or is r_max when r exceeds the fp16-rounded
        r_max; the expression is convex in r^, so the worst r^ is an end of that
        interval; codebook=int8 adds r^ ||c - int8(c)|| <= r^ / 127. Outliers: fp16 rounding
        of each element. median=prefill: x as coded with
        the median kept by `fitted_shared(x)` (fitted.py: the cache this instance wrote last)."""
        B, H, T, D = x.shape
        kept = self.fitted_shared(x)["r_med"] if self.keeps_median else None
        chunks, r, outlier, r_max16 = self._split(x, kept)
        rm = r_max16.float().unsqueeze(-1)
        levels = self.radius_levels(r_max16.float())
        g = (levels[..., 1:] - levels[..., :-1]).amax(-1, keepdim=True) / 2
        clamped = r > rm
        r_lo = torch.where(clamped, rm, (r - g).clamp(min=0))
        r_hi = torch.where(clamped, rm, torch.minimum(r + g, rm))
        d2 = self._best_direction_error(chunks, r, H).pow(2)
        e2 = torch.maximum((r - r_lo) ** 2 + r * r_lo * d2, (r - r_hi) ** 2 + r * r_hi * d2)
        if self.config.codebook == "int8":  # + r^ ||c - int8(c)|| <= r_hi / 127 (triangle inequality)
            e2 = (e2.sqrt() + r_hi / INT8_SCALE) ** 2
        exact = fp16_rounding_bound(chunks).pow(2).sum(-1)
        return torch.where(outlier, exact, e2).sum(-1).sqrt()

    def _best_direction_error(self, chunks: torch.Tensor, r: torch.Tensor, heads: int) -> torch.Tensor:
        """||u - c|| for the best codeword c of each chunk's direction u, by brute force."""
        shared = self.make_shared(heads, chunks.shape[-2] * 4)
        s = self.secondaries(shared).to(chunks.device)  # [H, S, 4]; make_shared builds on the CPU
        P = hurwitz_units(device=s.device)
        book = hamilton(P.view(1, 24, 1, 4), s.view(heads, 1, -1, 4)).reshape(heads, -1, 4)  # [H, 24S, 4]
        B, H, T, nc, _ = chunks.shape
        safe = torch.where(r > 0, r, torch.ones_like(r)).unsqueeze(-1)
        u = (chunks / safe).reshape(B, H, T * nc, 4)
        block = max(1, (1 << 22) // max(1, B * H * book.shape[1]))
        out = []
        for start in range(0, T * nc, block):
            ub = u[:, :, start : start + block]
            best = torch.matmul(ub, book.transpose(1, 2)).argmax(-1)  # [B, H, n]
            c = book[torch.arange(H, device=book.device).view(1, H, 1), best]
            out.append((ub - c).norm(dim=-1))
        return torch.cat(out, dim=2).view(B, H, T, nc)


class HQMQKeptMedian(FitsOnFirstWrite, HQMQ):
    """HQMQ + Med3x with `median=prefill` (what `HQMQ(config)` builds for it): the first
    write's median per (b, h) is kept as the per-row shared tensor `r_med` (fitted.py: fp16
    `[B, H]`, one row per batch row, placeholder zeros before the first write), and every
    write's threshold is C * max(r_med, its own median) (module docstring). Its own class
    because it keeps state across writes: fitted.py's append, checks and per-row byte count
    (`nbytes_as_row_caches`), while every other HQMQ config keeps the base append; and the
    fused store's step encoder serves `HQMQ` itself only (`Format.encodes_steps_of`), as
    kernels/formats/hqmq.py `device_refusal` declines this config."""

    def per_row_shared(self):
        return ("r_med",)

    def fit_shared(self, x, shared):
        return {"r_med": self.kept_median(x)}

    def _fit(self, x, shared):
        # fitted.py fits row by row; the median per (b, h) sees row b alone anyway, so one
        # call over the rows gives the same bytes.
        return self.fit_shared(x, shared)
