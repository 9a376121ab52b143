"""Flatten a `Packed` cache into the contiguous tensors the fused kernels read.

The kernels read the STORED bytes unchanged (the bit layout of
`quantizers/packing.py`: element i of width w at bits [i*w, (i+1)*w) of each
row's little-endian, LSB-first stream); this module only concatenates segments
and derives the small per-(layer, role) lookup tables. Nothing here is on the
decode hot path: a serving system would append into these tensors in place;
the tests and the benchmark build them once.

Formats:

- HQMQ (`HQMQFlat`): codes `[B,H,T,CB]` u8, radius `[B,H,T,RB]` u8, r_max
  `[B,H,T]` fp16; with Med3x also flags `[B,H,T,FB]` u8, outliers `[n,4]` fp16
  in (b, h, t, chunk) order and outlier_index `[B,H,ceil(T/64)]` int32 (global
  start of each 64-token block's outliers). Several segments (a prefill then
  one-token appends) are concatenated along tokens; their outliers are put back
  in global (b, h, t, chunk) order and outlier_index is rebuilt for the
  concatenated token axis (per-segment blocks do not line up with 64-token
  blocks of the whole cache). Derived, not stored: the codeword source the
  kernel gathers from (`table_mode`): by default the S normalised secondaries
  `[H, S, 4]` fp32 plus the 24 unit Hurwitz quaternions, from which the kernel
  forms P[p]*S[s] with the same fp32 Hamilton product as `HQMQ.decode_tokens`
  (bit identical); or the full codebook `[H, 24*S, 4]` (one gather per chunk
  from a 24x larger table, measured slower); fp16 variants of either; and the
  radius levels relative to r_max `[2^r]`.
- naive int, per-token groups (`IntFlat`): codes `[B,H,T,D*bits/8]` u8,
  scale/zero `[B,H,T,D/G]` fp16. Per-channel key variants are refused.
- KIVI (`KIVIFlat`): keys codes `[B,H,NG,D,G*bits/8]` u8 with scale/zero
  `[B,H,NG,D]` (per channel over each G-token group), values codes
  `[B,H,NG*G,D*bits/8]` with scale/zero `[B,H,NG*G,D/G]`, and the fp16 window
  `[B,H,TR,D]` (TR may be 0). The quantized tokens come first, the window last.
"""
from __future__ import annotations

import dataclasses

import torch

from ..quantizers import Packed, parse_spec
from ..quantizers.packing import unpack_bits
from ..quantizers.quaternion import hamilton, hurwitz_units

OUTLIER_BLOCK = 64  # must match quantizers/hqmq.py


def _spec_of(packed: Packed):
    cls, config = parse_spec(packed.spec)
    return cls, config


def _bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ---------------------------------------------------------------------------------------
# HQMQ
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class HQMQFlat:
    B: int
    H: int
    T: int
    D: int
    S: int
    code_bits: int
    r_bits: int
    codes: torch.Tensor
    radius: torch.Tensor
    r_max: torch.Tensor
    table: torch.Tensor  # what the kernel gathers codewords from (see table_mode)
    rel: torch.Tensor  # [2^r] fp32
    sec: torch.Tensor | None = None  # [H, S, 4] fp32 normalised secondaries (HQMQ.secondaries)
    ptab: torch.Tensor | None = None  # [24, 4] fp32 unit Hurwitz quaternions (hurwitz_units order)
    table_mode: str = "secondaries"  # or "codebook"
    flags: torch.Tensor | None = None
    outliers: torch.Tensor | None = None
    outlier_index: torch.Tensor | None = None
    dtype: torch.dtype = torch.float16  # dtype the cache was written in
    log_radius: bool = False  # radius levels log-spaced (else uniform q/L)

    @property
    def has_outliers(self) -> bool:
        return self.flags is not None

    @property
    def cache_nbytes(self) -> int:
        """Stored bytes of the cache (what `Packed.nbytes` counts, less the fp16 secondaries)."""
        return _bytes(self.codes, self.radius, self.r_max, self.flags, self.outliers, self.outlier_index)

    @property
    def read_nbytes(self) -> int:
        """Bytes a decode step must read: the cache plus the lookup tables it gathers from."""
        return self.cache_nbytes + _bytes(self.table, self.rel) + (
            _bytes(self.ptab) if self.table_mode == "secondaries" else 0)

    def with_table(self, mode: str = "secondaries", dtype=torch.float32) -> "HQMQFlat":
        """The same cache with another codeword source for the kernel:
        - "secondaries": the S normalised secondaries `[H, S, 4]`; the kernel forms
          P[p]*S[s] itself (exact in fp32: the products by 0, +-1, +-1/2 are exact and
          the sums run in HQMQ.decode_tokens' order);
        - "codebook": all 24*S codewords `[H, 24*S, 4]`, one gather per chunk but from
          a table 24x larger (slow: scattered L1 lines).
        fp16 tables are within an fp16 ulp per component (not bit-identical)."""
        if mode == "secondaries":
            t = self.sec
        elif mode == "codebook":
            t = codebook_from_secondaries(self.sec)
        else:
            raise ValueError(f"table mode must be secondaries or codebook, got {mode!r}")
        return dataclasses.replace(self, table=t.to(dtype).contiguous(), table_mode=mode)

    def tile(self, batch_reps: int, token_reps: int) -> "HQMQFlat":
        """A larger valid cache: this one repeated along batch and tokens (benchmarks)."""
        if token_reps > 1 and self.T % OUTLIER_BLOCK:
            raise ValueError(f"tiling along tokens needs T % {OUTLIER_BLOCK} == 0, got T={self.T}")
        rep4 = (batch_reps, 1, token_reps, 1)
        out = dataclasses.replace(
            self,
            B=self.B * batch_reps,
            T=self.T * token_reps,
            codes=self.codes.repeat(rep4),
            radius=self.radius.repeat(rep4),
            r_max=self.r_max.repeat(rep4[:3]),
        )
        if self.has_outliers:
            B, H = self.B, self.H
            starts = self.outlier_index.long().flatten()
            ends = torch.cat([starts[1:], starts.new_tensor([self.outliers.shape[0]])])
            per_block = (ends - starts).view(B, H, -1)
            total_bh = per_block.sum(-1)  # [B, H]
            first_bh = starts.view(B, H, -1)[:, :, 0]
            pieces = []
            for _ in range(batch_reps):
                for b in range(B):
                    for h in range(H):
                        n, s0 = int(total_bh[b, h]), int(first_bh[b, h])
                        pieces.append(torch.arange(s0, s0 + n, device=starts.device).repeat(token_reps))
            idx = torch.cat(pieces) if pieces else starts.new_zeros(0)
            pb = per_block.repeat(batch_reps, 1, token_reps).flatten()
            new_starts = (torch.cumsum(pb, 0) - pb).view(B * batch_reps, H, -1)
            out.flags = self.flags.repeat(rep4)
            out.outliers = self.outliers[idx].contiguous()
            if out.outliers.shape[0] >= 2**31:
                raise ValueError("more outliers than int32 outlier_index can address")
            out.outlier_index = new_starts.int().contiguous()
        return out


def normalised_secondaries(shared: dict) -> torch.Tensor:
    s = shared["secondaries"].float()
    return (s / s.norm(dim=-1, keepdim=True)).contiguous()  # HQMQ.secondaries


def codebook_from_secondaries(s: torch.Tensor) -> torch.Tensor:
    """Codebook `[H, 24*S, 4]`: row p*S+s is P[p]*S[s], as `HQMQ.decode_tokens` computes it."""
    H, S, _ = s.shape
    P = hurwitz_units(device=s.device)  # [24, 4]
    code = torch.arange(24 * S, device=s.device)
    p_idx, s_idx = code // S, code % S
    return hamilton(P[p_idx].unsqueeze(0).expand(H, -1, -1), s[:, s_idx]).contiguous()  # [H, 24S, 4]


def hqmq_table(shared: dict, S: int, table_dtype=torch.float32) -> torch.Tensor:
    """The full codebook `[H, 24*S, 4]` in table_dtype."""
    return codebook_from_secondaries(normalised_secondaries(shared)).to(table_dtype).contiguous()


def _rebuild_outliers(packed: Packed, nc: int):
    """Outliers of several segments in global (b, h, t, chunk) order, and their index."""
    B, H = packed.batch, packed.heads
    masks, vals = [], []
    for seg in packed.segments:
        f = seg.fields
        m = unpack_bits(f["flags"], 1, nc).bool()  # [B, H, Ts, nc]
        v = torch.zeros(*m.shape, 4, dtype=torch.float16, device=m.device)
        v[m] = f["outliers"]
        masks.append(m)
        vals.append(v)
    mask = torch.cat(masks, dim=2)
    outliers = torch.cat(vals, dim=2)[mask].contiguous()
    T = mask.shape[2]
    per_tok = mask.sum(-1)
    per_block = torch.nn.functional.pad(per_tok, (0, (-T) % OUTLIER_BLOCK))
    per_block = per_block.view(B, H, -1, OUTLIER_BLOCK).sum(-1).flatten()
    starts = torch.cumsum(per_block, 0) - per_block
    return outliers, starts.view(B, H, -1).int().contiguous()


def flatten_hqmq(packed: Packed, table_dtype=torch.float32, table_mode: str = "secondaries") -> HQMQFlat:
    cls, cfg = _spec_of(packed)
    if cls.name != "hqmq":
        raise ValueError(f"flatten_hqmq needs an hqmq cache, got {packed.spec!r}")
    if not packed.segments:
        raise ValueError("empty packed cache")
    q = cls(cfg)
    D = packed.head_dim
    nc = D // 4
    segs = packed.segments

    def cat(name):
        ts = [s.fields[name] for s in segs]
        return (torch.cat(ts, dim=2) if len(ts) > 1 else ts[0]).contiguous()

    rel = q.radius_levels(torch.ones((), device=packed.device)).float().contiguous()
    flat = HQMQFlat(
        B=packed.batch, H=packed.heads, T=packed.tokens, D=D, S=cfg.S,
        code_bits=q.code_bits, r_bits=cfg.r,
        codes=cat("codes"), radius=cat("radius"), r_max=cat("r_max"),
        table=torch.empty(0), rel=rel, dtype=packed.dtype,
        log_radius=cfg.radius == "log" and cfg.r > 1,
        sec=normalised_secondaries(packed.shared), ptab=hurwitz_units(device=packed.device).contiguous(),
    )
    flat = flat.with_table(table_mode, table_dtype)
    if q.med3:
        flat.flags = cat("flags")
        if len(segs) == 1:
            flat.outliers = segs[0].fields["outliers"].contiguous()
            flat.outlier_index = segs[0].fields["outlier_index"].contiguous()
        else:
            flat.outliers, flat.outlier_index = _rebuild_outliers(packed, nc)
    return flat


# ---------------------------------------------------------------------------------------
# naive int (per-token groups)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class IntFlat:
    B: int
    H: int
    T: int
    D: int
    bits: int
    group: int
    codes: torch.Tensor  # [B, H, T, D*bits/8] u8
    scale: torch.Tensor  # [B, H, T, D/G] fp16
    zero: torch.Tensor
    dtype: torch.dtype = torch.float16

    @property
    def cache_nbytes(self) -> int:
        return _bytes(self.codes, self.scale, self.zero)

    read_nbytes = cache_nbytes

    def tile(self, batch_reps: int, token_reps: int) -> "IntFlat":
        rep = (batch_reps, 1, token_reps, 1)
        return dataclasses.replace(
            self, B=self.B * batch_reps, T=self.T * token_reps,
            codes=self.codes.repeat(rep), scale=self.scale.repeat(rep), zero=self.zero.repeat(rep),
        )


def flatten_int(packed: Packed) -> IntFlat:
    cls, cfg = _spec_of(packed)
    if cls.name != "int":
        raise ValueError(f"flatten_int needs a naive int cache, got {packed.spec!r}")
    if "codes" not in packed.segments[0].fields:
        raise ValueError("the fused int kernel reads per-token groups only (keys=per-token); "
                         f"got per-channel key fields in {packed.spec!r}")

    def cat(name):
        ts = [s.fields[name] for s in packed.segments]
        return (torch.cat(ts, dim=2) if len(ts) > 1 else ts[0]).contiguous()

    return IntFlat(B=packed.batch, H=packed.heads, T=packed.tokens, D=packed.head_dim,
                   bits=cfg.bits, group=cfg.group, codes=cat("codes"), scale=cat("scale"),
                   zero=cat("zero"), dtype=packed.dtype)


# ---------------------------------------------------------------------------------------
# KIVI
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class KIVIFlat:
    B: int
    H: int
    D: int
    bits: int
    group: int
    role: str
    n_groups: int  # quantized G-token groups
    codes: torch.Tensor | None  # K: [B,H,NG,D,GB]; V: [B,H,NG*G,DB]
    scale: torch.Tensor | None  # K: [B,H,NG,D];    V: [B,H,NG*G,D/G]
    zero: torch.Tensor | None
    residual: torch.Tensor  # [B, H, TR, D] fp16 (TR may be 0)
    dtype: torch.dtype = torch.float16

    @property
    def T_quant(self) -> int:
        return self.n_groups * self.group

    @property
    def T_res(self) -> int:
        return self.residual.shape[2]

    @property
    def T(self) -> int:
        return self.T_quant + self.T_res

    @property
    def cache_nbytes(self) -> int:
        return _bytes(self.codes, self.scale, self.zero, self.residual)

    read_nbytes = cache_nbytes

    def tile(self, batch_reps: int, n_groups: int) -> "KIVIFlat":
        """A valid cache of `n_groups` quantized groups: this one's groups repeated
        cyclically, along batch too; the fp16 window stays at the end (benchmarks)."""
        if self.n_groups == 0:
            raise ValueError("nothing to tile: no quantized groups")
        reps = -(-n_groups // self.n_groups)
        nt = n_groups if self.role == "K" else n_groups * self.group  # along axis 2

        def rep(t):
            r = (batch_reps, 1, reps) + (1,) * (t.dim() - 3)
            return t.repeat(r)[:, :, :nt].contiguous()

        return dataclasses.replace(
            self, B=self.B * batch_reps, n_groups=n_groups,
            codes=rep(self.codes), scale=rep(self.scale), zero=rep(self.zero),
            residual=self.residual.repeat(batch_reps, 1, 1, 1),
        )


def flatten_kivi(packed: Packed, role: str) -> KIVIFlat:
    cls, cfg = _spec_of(packed)
    if cls.name != "kivi":
        raise ValueError(f"flatten_kivi needs a kivi cache, got {packed.spec!r}")
    if role not in ("K", "V"):
        raise ValueError(f"role must be K or V, got {role!r}")
    B, H, D = packed.batch, packed.heads, packed.head_dim
    quant = [s for s in packed.segments if "residual" not in s.fields]
    res = [s for s in packed.segments if "residual" in s.fields]
    if len(res) > 1 or (res and packed.segments[-1] is not res[0]):
        raise ValueError("KIVI cache must hold its fp16 window last, once")
    residual = (res[0].fields["residual"] if res else
                torch.zeros(B, H, 0, D, dtype=torch.float16, device=packed.device)).contiguous()
    ng = len(quant)
    codes = scale = zero = None
    if ng:
        if role == "K":
            codes = torch.stack([s.fields["codes"] for s in quant], dim=2).contiguous()
            scale = torch.stack([s.fields["scale"].squeeze(-1) for s in quant], dim=2).contiguous()
            zero = torch.stack([s.fields["zero"].squeeze(-1) for s in quant], dim=2).contiguous()
        else:
            codes = torch.cat([s.fields["codes"] for s in quant], dim=2).contiguous()
            scale = torch.cat([s.fields["scale"] for s in quant], dim=2).contiguous()
            zero = torch.cat([s.fields["zero"] for s in quant], dim=2).contiguous()
    return KIVIFlat(B=B, H=H, D=D, bits=cfg.bits, group=cfg.group, role=role, n_groups=ng,
                    codes=codes, scale=scale, zero=zero, residual=residual, dtype=packed.dtype)


def flatten(packed: Packed, role: str | None = None, **kw):
    """Dispatch on the cache's spec: HQMQFlat, IntFlat or KIVIFlat."""
    cls, _ = _spec_of(packed)
    if cls.name == "hqmq":
        return flatten_hqmq(packed, **kw)
    if cls.name == "int":
        return flatten_int(packed)
    if cls.name == "kivi":
        return flatten_kivi(packed, role or "K")
    raise ValueError(f"no fused kernel reads {cls.name!r} caches")


__all__ = ["HQMQFlat", "IntFlat", "KIVIFlat", "flatten", "flatten_hqmq", "flatten_int",
           "flatten_kivi", "hqmq_table", "codebook_from_secondaries", "OUTLIER_BLOCK"]
