"""The store <-> kernel contract: a `Packed` cache as the tensors the fused kernels read.

Every `*Flat` describes buffers whose token axis has a CAPACITY that may exceed
the valid length: the field `T` (KIVI: `n_groups` / `T_res`) is the valid length,
tensors are `[B, H, Tcap, ...]` buffers (contiguous, or a `[:, :, :n]` view of one)
and the kernels index them with their real per-(b, h) stride and read only valid
tokens. `flatten(packed)` builds them with Tcap == T; kernels/store.py appends into
larger buffers in place. The stored bytes are the quantizer's, unchanged (bit
layout of `quantizers/packing.py`: element i of width w at bits [i*w, (i+1)*w) of
each row's little-endian, LSB-first stream).

Formats:
- HQMQ (`HQMQFlat`): codes `[B,H,Tcap,CB]` u8, radius `[B,H,Tcap,RB]` u8, r_max
  `[B,H,Tcap]` fp16; with Med3x flags `[B,H,Tcap,FB]` u8, outliers PER (b, h)
  `[B,H,Ocap,4]` fp16 in (t, chunk) order, and `outlier_index [B,H,ceil(Tcap/64)]`
  int32, the start of each 64-token block's outliers within its (b, h) list
  (`quantizers.hqmq.outlier_block_starts`; derived kernel-side state, not part of
  the quantizer's stored bytes). Derived, not stored: the codeword source the
  kernel gathers from (`table_mode`): the S normalised secondaries `[H, S, 4]` plus
  the 24 units (the kernel forms P[p]*S[s], bit identical to `HQMQ.decode_tokens`
  in fp32), or the full codebook `[H, 24*S, 4]`; fp16 variants of either.
- naive int, per-token groups (`IntFlat`): codes `[B,H,Tcap,D*bits/8]` u8,
  scale/zero `[B,H,Tcap,D/G]` fp16. Per-channel key variants are refused.
- KIVI (`KIVIFlat`): keys codes `[B,H,NGcap,D,G*bits/8]` u8, scale/zero
  `[B,H,NGcap,D]`; values codes `[B,H,NGcap*G,D*bits/8]`, scale/zero
  `[B,H,NGcap*G,D/G]`; the fp16 window `residual [B,H,Rcap,D]` with `T_res` valid
  rows. `n_groups` quantized groups come first, the window last.
- fp8 (`FP8Flat`): codes `[B,H,Tcap,D]` u8 (the e4m3 / e5m2 bit patterns) and the
  per-kv-head scale `[H]` fp32.
- fp16 (`FP16Flat`): values `[B,H,Tcap,D]` fp16, the unquantized baseline in the engine.

A quantizer finds its kernel layout through its CLASS: a `kernel_layout(packed,
role)` method on the quantizer, or the `flatten` of its format (kernels/formats/, one
file per format; kernels/registry.py finds it by the class, never by name). The Flat
types live here, below both sides of the contract: the formats build and store them,
the backends (kernels/triton/, kernels/cuda/) read them.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from ..quantizers import Packed, parse_spec
from ..quantizers.hqmq import HQMQ, OUTLIER_BLOCK, int8_codewords, outlier_block_starts
from ..quantizers.packing import mixed_layout, unpack_bits
from ..quantizers.quaternion import hamilton, hurwitz_units
from . import registry


def _bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _rows(t: torch.Tensor | None, n: int) -> int:
    """Bytes of the first n rows (axis 2) of a [B, H, cap, ...] buffer."""
    if t is None or t.shape[2] == 0:
        return 0
    return _bytes(t) * n // t.shape[2]


def concat_field(packed: Packed, name: str) -> torch.Tensor:
    """Field `name` of every segment, concatenated along the token axis (contiguous)."""
    ts = [s.fields[name] for s in packed.segments]
    return (torch.cat(ts, dim=2) if len(ts) > 1 else ts[0]).contiguous()


_STAMPS = itertools.count(1)
# Fields set without a new stamp: the token counts (kept plans follow them: the CUDA
# backends' `_retarget`; KIVI's plan keys read which of its counts are nonzero themselves)
# and the memo itself.
UNSTAMPED = frozenset({"T", "n_groups", "n_res", "_plan_memo"})
_UNSET = object()


class Stamped:
    """Base of every `*Flat`: `stamp`, a number no state of any flat has had before, renewed
    by every field set except the token counts (`UNSTAMPED`). What a backend derives from a
    flat's other fields it can key on the stamp: one int read instead of every field
    (kernels/common.py `PlanCache.memo_get`). Set in place or by the dataclass's __init__,
    a field counts alike: KIVI's window flush sets `residual`, a Med3x build `flags`. A copy
    (copy / deepcopy / pickle) gets stamps of its own and no memo: a deep copy's tensors are
    not the ones a memo's plan points into."""
    _plan_memo = None

    def __setattr__(self, name, value):
        if name not in UNSTAMPED and self.__dict__.get(name, _UNSET) is not value:  # (the same object: no change)
            object.__setattr__(self, "stamp", next(_STAMPS))
        object.__setattr__(self, name, value)

    def __getstate__(self):
        return {n: x for n, x in self.__dict__.items() if n not in ("stamp", "_plan_memo")}

    def __setstate__(self, state):
        for n, x in state.items():
            setattr(self, n, x)
        object.__setattr__(self, "stamp", next(_STAMPS))


_POPCOUNT8 = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# HQMQ
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class HQMQFlat(Stamped):
    B: int
    H: int
    T: int  # valid tokens (codes.shape[2] is the capacity)
    D: int
    S: int
    code_bits: int
    r_bits: int
    codes: torch.Tensor
    radius: torch.Tensor
    r_max: torch.Tensor
    table: torch.Tensor  # what the kernel gathers codewords from (see table_mode)
    rel: torch.Tensor  # [2^r] fp32 radius levels relative to r_max
    sec: torch.Tensor | None = None  # [H, S, 4] fp32 normalised secondaries (HQMQ.secondaries)
    ptab: torch.Tensor | None = None  # [24, 4] fp32 unit Hurwitz quaternions (hurwitz_units order)
    table_mode: str = "secondaries"  # or "codebook"
    flags: torch.Tensor | None = None
    outliers: torch.Tensor | None = None  # [B, H, Ocap, 4] fp16, per (b, h)
    outlier_index: torch.Tensor | None = None  # [B, H, ceil(Tcap/64)] int32
    dtype: torch.dtype = torch.float16  # dtype the cache was written in
    log_radius: bool = False  # radius levels log-spaced (else uniform q/L)
    # Code rows: "bits" (code_bits per code) or "mixed" (HQMQ pack=mixed with groups of
    # G > 1 codes, each one radix-24S integer: `code_layout`; a mixed layout with G = 1
    # is "bits" byte for byte, and flatten calls it that)
    code_pack: str = "bits"
    codebook: str = "exact"  # decoded codeword precision (HQMQ codebook=): "exact" or "int8"
    rel16: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # rel in fp16 (fp16 decode path)

    def __post_init__(self):
        if self.rel16 is None:  # made once; dataclasses.replace (the store's per-step refresh) carries it
            self.rel16 = self.rel.half()

    @property
    def has_outliers(self) -> bool:
        return self.flags is not None

    @property
    def code_layout(self) -> tuple[int, int, int, int]:
        """(G, W, W_last, row bytes) of the code rows (quantizers/packing.py `mixed_layout`):
        G = 1, W = code_bits for "bits"."""
        nc = self.D // 4
        if self.code_pack == "mixed":
            return mixed_layout(24 * self.S, nc)
        return 1, self.code_bits, 0, (nc * self.code_bits + 7) // 8

    @property
    def n_outliers(self) -> int:
        """Valid outlier chunks (set flag bits of the valid tokens); a host sync."""
        if not self.has_outliers:
            return 0
        f = self.flags[:, :, : self.T].long()
        return int(_POPCOUNT8.to(f.device)[f].sum())

    @property
    def cache_nbytes(self) -> int:
        """Valid stored bytes (what `Packed.nbytes` counts, less the fp16 secondaries)."""
        n = _rows(self.codes, self.T) + _rows(self.radius, self.T) + _rows(self.r_max, self.T)
        if self.has_outliers:
            n += _rows(self.flags, self.T) + self.n_outliers * 4 * self.outliers.element_size()
        return n

    @property
    def read_nbytes(self) -> int:
        """Bytes a decode step must read: the cache, the derived outlier index, the tables."""
        idx = _bytes(self.outlier_index) * self.T // max(1, self.codes.shape[2]) if self.has_outliers else 0
        return self.cache_nbytes + idx + _bytes(self.table, self.rel) + (
            _bytes(self.ptab) if self.table_mode == "secondaries" else 0)

    def with_table(self, mode: str = "secondaries", dtype=torch.float32) -> "HQMQFlat":
        """The same cache with another codeword source for the kernel:
        - "secondaries": the S normalised secondaries `[H, S, 4]`; the kernel forms
          P[p]*S[s] itself (exact in fp32: the products by 0, +-1, +-1/2 are exact and
          the sums run in HQMQ.decode_tokens' order);
        - "codebook": all 24*S codewords `[H, 24*S, 4]`, one gather per chunk.
        fp16 tables are within an fp16 ulp per component (not bit-identical). A codebook=int8
        cache always gets "codebook" (its rounded codewords; a kernel forming P[p]*S[s]
        would not round them)."""
        if mode not in ("secondaries", "codebook"):
            raise ValueError(f"table mode must be secondaries or codebook, got {mode!r}")
        if self.codebook != "exact":
            mode = "codebook"
        make = (lambda: self.sec) if mode == "secondaries" else (
            lambda: codebook_from_secondaries(self.sec, self.codebook))
        t = derived(self.sec, ("table", mode, dtype, self.codebook), lambda: make().to(dtype).contiguous())
        return dataclasses.replace(self, table=t, table_mode=mode)

    def tile(self, batch_reps: int, token_reps: int) -> "HQMQFlat":
        """A larger valid cache (Tcap == T): this one's valid tokens repeated along batch
        and tokens (benchmarks)."""
        if token_reps > 1 and self.T % OUTLIER_BLOCK:
            raise ValueError(f"tiling along tokens needs T % {OUTLIER_BLOCK} == 0, got T={self.T}")
        rep4 = (batch_reps, 1, token_reps, 1)
        T = self.T
        out = dataclasses.replace(
            self, B=self.B * batch_reps, T=T * token_reps,
            codes=self.codes[:, :, :T].repeat(rep4), radius=self.radius[:, :, :T].repeat(rep4),
            r_max=self.r_max[:, :, :T].repeat(rep4[:3]))
        if self.has_outliers:
            flags = self.flags[:, :, :T]
            nc = self.D // 4
            per_tok = unpack_bits(flags, 1, nc).sum(-1)  # [B, H, T]
            n_bh = per_tok.sum(-1)  # [B, H]
            ocap = whole_blocks(max(1, int(n_bh.max()) * token_reps))
            pos = torch.arange(ocap, device=flags.device).view(1, 1, -1)
            src = pos % n_bh.clamp_min(1).unsqueeze(-1)
            outl = torch.gather(self.outliers, 2, src.unsqueeze(-1).expand(-1, -1, -1, 4))
            outl = torch.where((pos < (n_bh * token_reps).unsqueeze(-1)).unsqueeze(-1), outl, 0)
            out.flags = flags.repeat(rep4)
            out.outliers = outl.repeat(batch_reps, 1, 1, 1).contiguous()
            out.outlier_index = outlier_block_starts(per_tok.repeat(rep4[:3]))
        return out


def derived(t: torch.Tensor, key, make):
    """`make()`, a tensor computed from the model constant t alone (HQMQ's secondaries),
    kept on t: a cache built per prompt then reuses the tables of the constants the
    quantizer keeps per device (quantizers/base.py `_device_shared`) instead of
    rebuilding them per layer and role. t must never be written in place."""
    memo = getattr(t, "_kvq_derived", None)
    if memo is None:
        memo = t._kvq_derived = {}
    if key not in memo:
        memo[key] = make()
    return memo[key]


def normalised_secondaries(shared: dict) -> torch.Tensor:
    return derived(shared["secondaries"], "normalised", lambda: HQMQ.secondaries(shared).contiguous())


def units_on(device) -> torch.Tensor:
    """The 24 Hurwitz units as a contiguous fp32 table on `device` (one per device)."""
    device = torch.device(device)
    if device not in _UNITS:
        _UNITS[device] = hurwitz_units(device=device).contiguous()
    return _UNITS[device]


_UNITS: dict = {}


def codebook_from_secondaries(s: torch.Tensor, codebook: str = "exact") -> torch.Tensor:
    """Codebook `[H, 24*S, 4]`: row p*S+s is P[p]*S[s], as `HQMQ.decode_tokens` computes it
    (codebook="int8": rounded as it rounds them)."""
    H, S, _ = s.shape
    P = hurwitz_units(device=s.device)  # [24, 4]
    code = torch.arange(24 * S, device=s.device)
    p_idx, s_idx = code // S, code % S
    cw = hamilton(P[p_idx].unsqueeze(0).expand(H, -1, -1), s[:, s_idx])  # [H, 24S, 4]
    return (int8_codewords(cw) if codebook == "int8" else cw).contiguous()


def hqmq_table(shared: dict, S: int, table_dtype=torch.float32) -> torch.Tensor:
    """The full codebook `[H, 24*S, 4]` in table_dtype."""
    return codebook_from_secondaries(normalised_secondaries(shared)).to(table_dtype).contiguous()


def whole_blocks(n: int) -> int:
    """n rounded up to whole OUTLIER_BLOCKs (64): token capacities, and the Med3x outlier
    lists' capacities, so that a list's stride (a kernel argument, which Triton specialises
    by its divisibility by 16) is the same kind whatever the outlier count."""
    return -(-n // OUTLIER_BLOCK) * OUTLIER_BLOCK


# ---------------------------------------------------------------------------------------
# naive int (per-token groups)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class IntFlat(Stamped):
    B: int
    H: int
    T: int  # valid tokens
    D: int
    bits: int
    group: int
    codes: torch.Tensor  # [B, H, Tcap, D*bits/8] u8
    scale: torch.Tensor  # [B, H, Tcap, D/G] fp16
    zero: torch.Tensor
    dtype: torch.dtype = torch.float16

    @property
    def cache_nbytes(self) -> int:
        return sum(_rows(t, self.T) for t in (self.codes, self.scale, self.zero))

    read_nbytes = cache_nbytes

    def tile(self, batch_reps: int, token_reps: int) -> "IntFlat":
        rep = (batch_reps, 1, token_reps, 1)
        T = self.T
        return dataclasses.replace(
            self, B=self.B * batch_reps, T=T * token_reps, codes=self.codes[:, :, :T].repeat(rep),
            scale=self.scale[:, :, :T].repeat(rep), zero=self.zero[:, :, :T].repeat(rep))


# ---------------------------------------------------------------------------------------
# KIVI
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class KIVIFlat(Stamped):
    B: int
    H: int
    D: int
    bits: int
    group: int
    role: str
    n_groups: int  # valid quantized G-token groups
    codes: torch.Tensor | None  # K: [B,H,NGcap,D,GB]; V: [B,H,NGcap*G,DB]
    scale: torch.Tensor | None  # K: [B,H,NGcap,D];    V: [B,H,NGcap*G,D/G]
    zero: torch.Tensor | None
    residual: torch.Tensor  # [B, H, Rcap, D] fp16
    dtype: torch.dtype = torch.float16
    n_res: int | None = None  # valid window rows (None: all of residual's rows)

    @property
    def T_quant(self) -> int:
        return self.n_groups * self.group

    @property
    def T_res(self) -> int:
        return self.residual.shape[2] if self.n_res is None else self.n_res

    @property
    def T(self) -> int:
        return self.T_quant + self.T_res

    @property
    def cache_nbytes(self) -> int:
        nq = self.n_groups if self.role == "K" else self.T_quant
        return (sum(_rows(t, nq) for t in (self.codes, self.scale, self.zero))
                + _rows(self.residual, self.T_res))

    read_nbytes = cache_nbytes

    def tile(self, batch_reps: int, n_groups: int) -> "KIVIFlat":
        """A valid cache of `n_groups` quantized groups: this one's groups repeated
        cyclically, along batch too; the fp16 window stays at the end (benchmarks). Its
        window length is an int, as the decode store's flats hold it (None would make every
        length read a tensor shape read, which a benchmark's host time would then charge)."""
        if self.n_groups == 0:
            raise ValueError("nothing to tile: no quantized groups")
        reps = -(-n_groups // self.n_groups)
        per = 1 if self.role == "K" else self.group
        nv, nt = self.n_groups * per, n_groups * per  # along axis 2

        def rep(t):
            r = (batch_reps, 1, reps) + (1,) * (t.dim() - 3)
            return t[:, :, :nv].repeat(r)[:, :, :nt].contiguous()

        return dataclasses.replace(
            self, B=self.B * batch_reps, n_groups=n_groups, n_res=self.T_res,
            codes=rep(self.codes), scale=rep(self.scale), zero=rep(self.zero),
            residual=self.residual[:, :, : self.T_res].repeat(batch_reps, 1, 1, 1),
        )


@dataclasses.dataclass
class KIVIGraphFlat(KIVIFlat):
    """A `KIVIFlat` whose group and window counts follow a device valid length (CUDA graphs;
    `KernelStore.graph_view`): `policy` (A, P), the window policy of
    `formats.kivi.kivi_policy` (q(T) = max(0, T - A) // P * P tokens quantized, T - q(T) in
    the window), and `capacity`, the tokens the buffers hold (the bound the grid is cut
    for). The buffers are the store's, at capacity; n_groups / n_res are not read by a
    call with `valid_len`. (Its own class: a host-count KIVIFlat has no policy.)"""
    policy: tuple[int, int] | None = None
    capacity: int = 0



# ---------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class FP8Flat(Stamped):
    B: int
    H: int
    T: int  # valid tokens
    D: int
    fmt: str  # "e4m3" or "e5m2"
    codes: torch.Tensor  # [B, H, Tcap, D] u8 fp8 bit patterns
    scale: torch.Tensor  # [H] fp32 (the stored fp16 scale, exactly)
    dtype: torch.dtype = torch.float16

    @property
    def cache_nbytes(self) -> int:
        return _rows(self.codes, self.T) + 2 * self.H

    read_nbytes = cache_nbytes

    def tile(self, batch_reps: int, token_reps: int) -> "FP8Flat":
        return dataclasses.replace(self, B=self.B * batch_reps, T=self.T * token_reps,
                                   codes=self.codes[:, :, : self.T].repeat(batch_reps, 1, token_reps, 1))


@dataclasses.dataclass
class FP16Flat(Stamped):
    """The fp16 store: K or V as the fp16 quantizer stores them (the engine's baseline)."""
    B: int
    H: int
    T: int  # valid tokens
    D: int
    values: torch.Tensor  # [B, H, Tcap, D] fp16
    dtype: torch.dtype = torch.float16

    @property
    def cache_nbytes(self) -> int:
        return _rows(self.values, self.T)

    read_nbytes = cache_nbytes

    def tile(self, batch_reps: int, token_reps: int) -> "FP16Flat":
        return dataclasses.replace(self, B=self.B * batch_reps, T=self.T * token_reps,
                                   values=self.values[:, :, : self.T].repeat(batch_reps, 1, token_reps, 1))


# ---------------------------------------------------------------------------------------
# the way in
# ---------------------------------------------------------------------------------------
def flatten(packed: Packed, role: str | None = None, **kw):
    """The `*Flat` of a packed cache, found through its quantizer CLASS: a `kernel_layout`
    method of the quantizer, else the flatten of its format (kernels/registry.py: the
    nearest class in its MRO with a registered format)."""
    cls, cfg = parse_spec(packed.spec)
    own = getattr(cls, "kernel_layout", None)
    if own is not None:
        return cls(cfg, role=role or "K").kernel_layout(packed, role or "K", **kw)
    fmt = registry.format_of_quantizer(cls)
    if fmt is None:
        raise ValueError(f"no fused kernel reads {cls.__name__} caches ({packed.spec!r})")
    return fmt.flatten(packed, role, **kw)


__all__ = ["HQMQFlat", "IntFlat", "KIVIFlat", "KIVIGraphFlat", "FP8Flat", "FP16Flat", "flatten", "concat_field", "hqmq_table",
           "codebook_from_secondaries", "normalised_secondaries", "whole_blocks", "OUTLIER_BLOCK"]
