"""Spherical random quantizer (TurboQuant, Zandieh et al. 2025), calibration-free:
the `spherical random` baseline of METHOD.md section 2.

Each K/V token vector x (one kv-head, length D) is rotated by a seeded random
orthogonal matrix O of its (layer, role, kv-head): y = O x. After a random
rotation the unit vector u = y/||y|| is uniform on the sphere whatever x was,
so each coordinate follows one known law, (1 + u_i)/2 ~ Beta((D-1)/2, (D-1)/2),
and one scalar codebook serves every coordinate: the Lloyd-Max quantizer of
that exact law with 2^bits levels (`levels=beta`, default; lloyd_max.py),
computed at first use, never from data, rounded to fp16 values, a
deterministic function of (bits, D) and not stored, like HQMQ's 2T.
`levels=gaussian` is the earlier N(0, 1/D) approximation. Each coordinate of u
gets the nearest level: v.

Gain (`gain`): "lsq" (default) stores the least-squares scale g of the decoded
direction w = O^T v, g = <x, w>/||w||^2: the best scale for those codes, so
never worse than the norm, at the same 16 bits. "norm" stores ||y|| and
decodes ||y|| O^T v/||v|| (TurboQuant_mse stores the norm).

QJL (`qjl=true`, keys only: TurboQuant_prod): the MSE stage gets bits-1 bits
(each part of an outlier split its bits-1), and the residual of the WHOLE vector
r = x - x_mse (x_mse exactly what decode returns for it, both parts placed) is
sketched by 1 bit per row of a seeded Gaussian matrix S (m = D rows, fp16
[D, D] per (layer, role), shared by the kv-heads), z = sign(S r), plus ||r|| in
fp16. Decode adds r_hat = sqrt(pi/2)/m ||r|| S^T z, so <q, x_hat> = <q, x_mse> +
the QJL estimator of <q, r>: unbiased over S for every query q (S is drawn
independently of the rotations and of the data), at the price of a larger
reconstruction error than the MSE stage alone. The split keeps the budget:
(D-N)(bits-1) + N(outlier_bits-1) + D sign bits. Tested over seeds with and
without the split (suites/tests/test_turboquant.py, test_baselines.py): |z| of
the mean error of <q, x_hat> was 0.1-0.3 (bound 4), the MSE stage alone z = -42.
Values ignore qjl and use all `bits` for the MSE stage (TurboQuant_prod is
about inner products).

Rotation (`rotation`), one per kv-head and part, each a function of (seed,
layer, role, kv-head, part) alone:
- "dense" (default): a Haar rotation, the Q of a QR of a seeded Gaussian with
  its signs fixed by diag(R) > 0, kept fp16 [H, d, d].
- "hadamard": the randomised Hadamard O = W diag(s)/sqrt(d) (rotation.py; W
  Sylvester's, s seeded signs kept as 1 bit each); d a power of two only.
- "structured": any d (rotation.py `structured_rotation`): 3 rounds of seeded
  signs, a seeded permutation and Sylvester's Hadamard of the largest order
  p <= d on the first p then the last p coordinates; it keeps only its seed,
  8 bytes per kv-head and part (`rotseed`), and decode rebuilds the matrix
  from it (rounded to fp16, as "dense"). Measured against a dense Haar rotation
  (float64, the coding error ||x - x_hat||^2/||x||^2 of the MSE stage alone,
  40 seeds of 256 vectors each, mean +- its standard error): on Gaussian data
  they agree to the noise (any orthogonal matrix gives the same law); on
  outlier-heavy data (4 channels scaled 20, 12, 8, 5) at 2 bits, Haar vs
  structured: d=16 0.0980+-0.0018 vs 0.1023+-0.0024, d=48 0.1138+-0.0020 vs
  0.1087+-0.0011, d=96 0.1155+-0.0011 vs 0.1151+-0.0010, d=128 0.1149 vs 0.1139;
  at 3 bits d=16 0.0264 vs 0.0274, d=48 0.0329 vs 0.0306, d=96 0.0335 vs 0.0333.
  Worst case seen: a single dominant channel (x20) in a 16-channel part, 3
  bits: 0.0255+-0.0009 vs 0.0299+-0.0016 (+17%; more rounds did not close it).
  One round (no re-mixing) is clearly worse at d = 48 / 96 (+36% / +55%). End
  to end, D = 64 split 48 + 16 (outlier_fraction=0.25), 16 seeds, 4 kv-heads x
  256 tokens with 6 outlier channels per head: 2 bits dense 0.0318+-0.0002 vs
  structured 0.0326+-0.0006, 3 bits 0.0086 vs 0.0089; Gaussian 0.0882 vs 0.0879.
Decode applies exactly the matrix it holds (fp16 values, or +-1 and a scale);
encode applies the exact inverse of that matrix (not its transpose: fp16
leaves it ~1e-3 from orthogonal), so the coordinates coded are exactly those
decode reads.

Outlier channels (`outliers=N`, or `outlier_fraction=f`: N = round(f D);
TurboQuant's KV experiments): the N channels of each kv-head with the largest
RMS over the first write (the prefill; fitted.py; a calibration-free stand-in
for however the paper picks them) are split off and coded by a second,
independent instance with `outlier_bits` bits (default bits+1) and its own
rotation and gain; the other D-N get `bits`. Any N in 1..D-1 with "dense" or
"structured" ("hadamard" needs both parts a power of two). E.g. D=128, N=32,
bits=2: (96*2 + 32*3)/128 = 2.25 code bits per element; N = D/2 gives 2.5. The
channel mask is stored, 1 bit per channel per kv-head (a cache byte: fitted on
the data). The fit is per row (per sequence): a cache of B batch rows stores B
masks, row b's from row b's first-write RMS alone and splitting row b only, so
a batch of windows stores, byte for byte, what B one-window caches store
(fitted.py). Without outlier channels nothing is fitted.

Model constants (`constant_shared`, METHOD.md section 3): the rotations
(`rotation`, `signs` or `rotseed`, and their `_o`) and the QJL sketch `qjl` are
functions of (config, layer, role, seed, heads, head_dim): reported once per
model, not as cache bits. The `outlier_mask` is fitted on the write: a cache
byte. Counted as cache bytes, the dense fp16 rotations of a 48 + 16 split at
2 bits (4 kv-heads, 256 tokens) measured 5.25 bits per element where the codes,
gains and mask are 2.754; "structured" keeps 2 x 8 bytes per kv-head (2.762 in
all).

The sweep (`example_specs`) carries the paper's KV points with the structured
rotation: `spherical2.5` / `spherical3.5` = 2 / 3 bits + 50% outlier channels at
3 / 4 bits (2.5 / 3.5 code bits), and `spherical2.25` = 2 bits + 25% at 3 bits,
the split the paper describes for its 2.5-bit setup ("32 outlier channels at 3
bits, 96 at 2": 2.25 code bits; with the two fp16 gains, 2.5 measured bits at
D = 128, 2.75 at D = 64). `spherical3.25` (3 bits + 25% at 4) is an alias.

What of TurboQuant is not here: how the paper picks its outlier channels (here:
RMS over the prefill, fixed after it); whether its KV runs use the split with
the MSE stage or with QJL (both are here; the sweep runs MSE only); its exact
bit accounting (its 2.5 / 3.5 labels do not follow from the split it describes,
see above; here bits are measured, gains and the mask included); its dense
rotation held at full precision (here fp16 with an exact inverse, or the
structured stand-in, measured above); the norm as the stored scale (`gain=norm`;
the default lsq gain is never worse); and any fused GPU kernel (decode here
dequantizes the history). Its codebooks are the same Lloyd-Max levels of the
Beta law.

Stored per token vector: D codes of `bits` bits (bits-1 for qjl keys),
bit-packed (`codes`), the fp16 gain (`gain`); qjl keys add the D sign bits
(`qjl_signs`) and the fp16 residual norm (`qjl_norm`). Per (layer, role): the
`rotation` of each kv-head (fp16 [H, D, D]), its `signs` (uint8 [H, D/8]) or
its `rotseed` (uint8 [H, 8]); qjl keys add the sketch matrix `qjl` (fp16
[D, D]). With N outlier channels the outlier part stores `codes_o` (N codes of
outlier_bits, minus 1 for qjl keys) and `gain_o` per token vector, and per
(layer, role) and batch row `outlier_mask` (uint8 [B, H, D/8]) and its own
`rotation_o` (fp16 [H, N, N]), `signs_o` or `rotseed_o`; the regular part's
rotation is then [H, D-N, D-N].

(About 490 lines: one quantizer file, as the plugin contract asks; TurboQuant's MSE
levels, QJL keys and the outlier-channel split share its rotation and packing code.)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable, stable_seed
from .derived import derived
from .fitted import FitsOnFirstWrite
from .lloyd_max import lloyd_max_gaussian, lloyd_max_sphere
from .packing import pack_bits, unpack_bits
from .rotation import random_signs, seed_bytes, seeds_of, structured_rotation, sylvester_hadamard

ROTATIONS = ("dense", "hadamard", "structured")
QJL_SCALE = math.sqrt(math.pi / 2)  # E[<s, q> sign(<s, r>)] = sqrt(2/pi) <q, r>/||r|| for Gaussian s


def _expand_index(idx, shape):
    """Channel indices [R, H, d] (R = 1 or B) as a gather/scatter index [B, H, T, d]."""
    B, H, T, _ = shape
    return idx.unsqueeze(2).expand(B, H, T, idx.shape[-1])


class Spherical(FitsOnFirstWrite, Quantizer):
    name = "spherical"
    description = ("TurboQuant: seeded random rotation (dense, Hadamard or structured), Lloyd-Max codes of the exact "
                   "Beta coordinate law, fp16 gain, optional QJL and outlier-channel split")
    stochastic = True  # seeded rotation (and QJL sketch)
    # The whole-bit aliases use the randomised Hadamard rotation: D bits per kv-head
    # (model constants, like every rotation here), where a dense fp16 one keeps 16 D^2.
    # TurboQuant's KV experiments split outlier channels off and give them one bit more
    # (module docstring): sphericalB.5 = B bits + 50% outlier channels at B+1 = B.5 code
    # bits; sphericalB.25 = B bits + 25% at B+1 (the paper's stated split: 32 of 128
    # channels) = B.25 code bits. Both with the structured rotation (any part size).
    aliases = {
        **{f"spherical{b}": {"bits": b, "rotation": "hadamard"} for b in (2, 3, 4)},
        **{f"spherical{b}-qjl": {"bits": b, "rotation": "hadamard", "qjl": True} for b in (3, 4)},
        **{f"spherical{b}{tail}": {"bits": b, "rotation": "structured", "outlier_fraction": f}
           for b in (2, 3) for tail, f in ((".5", 0.5), (".25", 0.25))},
    }
    # The sweep: whole bits, QJL, and the paper's 2.5 / 3.5-bit KV points as code bits
    # (2 / 3 bits + 50% of the channels, picked by RMS, at 3 / 4 bits; measured bits add
    # the two fp16 gains, 32/D) and its stated split (2 bits + 25% at 3 bits = 2.25 code
    # bits; 2.5 measured bits at D = 128 with the two gains, 2.75 at D = 64).
    example_specs = ("spherical3", "spherical4", "spherical4-qjl", "spherical2.5", "spherical3.5", "spherical2.25")

    @dataclasses.dataclass
    class Config:
        bits: int = 4
        gain: str = "lsq"  # or "norm"
        rotation: str = "dense"  # or "hadamard" (power-of-two parts), "structured" (any size, stores its seed)
        levels: str = "beta"  # or "gaussian" (the earlier N(0, 1/D) levels)
        qjl: bool = False  # keys: bits-1 MSE bits + a 1-bit QJL sketch of the residual
        outliers: int = 0  # channels per kv-head split off and coded with outlier_bits
        outlier_bits: int = 0  # 0 = bits + 1
        outlier_fraction: float = 0.0  # or this fraction of head_dim (rounded) as outlier channels

    def validate_config(self):
        c = self.config
        if not 1 <= c.bits <= 8:
            raise QuantizerInputError(f"spherical: bits must be in 1..8, got {c.bits}")
        if c.gain not in ("lsq", "norm"):
            raise QuantizerInputError(f"spherical: gain must be lsq or norm, got {c.gain!r}")
        if c.rotation not in ROTATIONS:
            raise QuantizerInputError(f"spherical: rotation must be one of {', '.join(ROTATIONS)}, got {c.rotation!r}")
        if c.levels not in ("beta", "gaussian"):
            raise QuantizerInputError(f"spherical: levels must be beta or gaussian, got {c.levels!r}")
        if c.qjl and c.bits < 2:
            raise QuantizerInputError("spherical: qjl needs bits >= 2 (bits-1 for the MSE stage, 1 for the sketch)")
        if c.outliers < 0 or not 0 <= c.outlier_bits <= 8:
            raise QuantizerInputError(f"spherical: need outliers >= 0 and outlier_bits in 0..8, got "
                                      f"outliers={c.outliers}, outlier_bits={c.outlier_bits}")
        if not (0 <= c.outlier_fraction < 1) or math.isnan(c.outlier_fraction):
            raise QuantizerInputError(f"spherical: outlier_fraction must be in [0, 1), got {c.outlier_fraction}")
        if c.outliers and c.outlier_fraction:
            raise QuantizerInputError(f"spherical: give outliers (a channel count, here {c.outliers}) or "
                                      f"outlier_fraction (here {c.outlier_fraction}), not both")
        if c.qjl and self.has_outliers and self.out_bits < 2:
            raise QuantizerInputError(f"spherical: qjl with outlier channels needs outlier_bits >= 2 (outlier_bits-1 "
                                      f"for their MSE stage), got {self.out_bits}")
        if c.levels == "beta":
            self.head_dim_multiple = 2  # the Beta law of a coordinate needs D >= 2; D = 1 has no sphere
        # Without outlier channels nothing is fitted: every write codes alike.
        self.append_matches_single_write = not self.has_outliers

    @property
    def has_outliers(self) -> bool:
        return bool(self.config.outliers or self.config.outlier_fraction)

    def n_out(self, head_dim: int) -> int:
        """Outlier channels per kv-head at this head_dim (0: no split)."""
        c = self.config
        return c.outliers if not c.outlier_fraction else int(round(c.outlier_fraction * head_dim))

    @property
    def out_bits(self) -> int:
        return self.config.outlier_bits or min(8, self.config.bits + 1)

    def parts(self, head_dim: int):
        """(field suffix, channels, MSE-stage bits) of each independently coded part."""
        if not self.has_outliers:
            return [("", head_dim, self.mse_bits)]
        n = self.n_out(head_dim)
        if not 0 < n < head_dim:
            what = (f"outlier_fraction={self.config.outlier_fraction} gives {n} channels" if self.config.outlier_fraction
                    else f"outliers={n}")
            raise QuantizerInputError(f"spherical: {what} at head_dim {head_dim}; the split needs 1..{head_dim - 1} "
                                      "outlier channels")
        return [("", head_dim - n, self.mse_bits), ("_o", n, self.out_bits - (1 if self.use_qjl else 0))]

    @property
    def use_qjl(self) -> bool:
        return self.config.qjl and self.role == "K"

    @property
    def mse_bits(self) -> int:
        return self.config.bits - 1 if self.use_qjl else self.config.bits

    # ---- the rotation and the sketch ---------------------------------------------------
    def make_shared(self, heads, head_dim):
        shared = {}
        if self.use_qjl:
            g = torch.Generator().manual_seed(stable_seed(self.name, self.seed, self.layer, self.role, "qjl"))
            shared["qjl"] = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64).half()
        parts = self.parts(head_dim)
        if self.has_outliers:  # placeholder: the first N channels, replaced at the first write; one row (fitted.py)
            n = parts[1][1]
            shared["outlier_mask"] = pack_bits((torch.arange(head_dim) < n).long().expand(1, heads, -1), 1)
        for part, d, _ in parts:
            seeds = [self.head_seed(h) if not part else stable_seed(self.name, self.seed, self.layer, h, self.role, part)
                     for h in range(heads)]
            if self.config.rotation == "hadamard":
                if d & (d - 1):
                    raise QuantizerInputError(
                        f"spherical: rotation=hadamard needs power-of-two parts, got {d} channels"
                        + (f" (head_dim {head_dim} split {head_dim - d if part == '' else d} outlier channels off)"
                           if len(parts) > 1 else "") + "; rotation=structured takes any size")
                shared["signs" + part] = random_signs(seeds, d)  # [H, d/8]
                continue
            if self.config.rotation == "structured":
                shared["rotseed" + part] = seed_bytes(seeds)  # [H, 8]: the rotation is a function of it
                continue
            rots = []
            for seed in seeds:
                g = torch.Generator().manual_seed(seed)
                q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
                rots.append(q * torch.sign(torch.diagonal(r)))  # sign fix: the unique QR with diag(R) > 0
            shared["rotation" + part] = torch.stack(rots).half()  # [H, d, d]
        return shared

    def per_row_shared(self):
        return ("outlier_mask",) if self.has_outliers else ()

    def constant_shared(self) -> frozenset[str]:
        """The shared tensors that are a function of (config, layer, role, seed, heads,
        head_dim) alone, model constants (METHOD.md section 3): the rotations or their
        sign bits or seeds, and the QJL sketch matrix. The outlier mask is fitted on the
        first write: per-write bytes."""
        kind = {"dense": "rotation", "hadamard": "signs", "structured": "rotseed"}[self.config.rotation]
        names = {kind} | ({kind + "_o"} if self.has_outliers else set()) | ({"qjl"} if self.use_qjl else set())
        return frozenset(names)

    def fit_shared(self, x, shared):  # x: one row [1, H, T, D]
        if not self.has_outliers:
            return {}
        rms = x.pow(2).mean(dim=(0, 2))  # [H, D]
        n = self.n_out(x.shape[-1])
        mask = torch.zeros_like(rms, dtype=torch.long).scatter_(1, rms.topk(n, dim=-1).indices, 1)
        return {"outlier_mask": pack_bits(mask, 1).unsqueeze(0)}

    def channel_index(self, shared, head_dim: int, device):
        """Sorted channel indices [R, H, d] of each part, from the stored mask (R = 1
        or the batch rows: a one-row mask serves every row)."""
        if not self.has_outliers:
            return [None]
        n = self.n_out(head_dim)
        source = shared["outlier_mask"]

        def build():
            mask = unpack_bits(source.to(device), 1, head_dim)  # [R, H, D]
            order = torch.argsort(mask, dim=-1, descending=True, stable=True)
            return [order[..., n:].sort(-1).values, order[..., :n].sort(-1).values]
        # once per stored mask (derived.py): a decode step's write and read each asked for it
        # again, ~12 of its ~200 ops per part and step
        return derived(source, ("spherical.channel_index", n, head_dim, str(device)), build)

    @staticmethod
    def _take(x, idx):
        return x if idx is None else x.gather(-1, _expand_index(idx, x.shape))

    def matrices(self, shared, head_dim: int, device, part: str = ""):
        """Decode is x = c * (y @ M) for rows y (x = O^T y in columns), with M
        exactly the stored values: the fp16 rotation (c = 1), or W diag(s) with
        entries +-1 (c = 1/sqrt(D)). Returns float64 (M, c, A_inv), A_inv the
        inverse of A = c M, which encode uses: y = x @ A_inv are then exactly the
        coordinates decode reads, so fp16 storage of O costs the coding nothing.
        A_inv comes from Newton-Schulz steps X <- X (2I - A X) from X = A^T, which
        square the ~1e-3 error of the fp16 rotation each step (exact for
        hadamard): deterministic, no solver. Built once per stored tensor (derived.py)."""
        kind = {"dense": "rotation", "hadamard": "signs", "structured": "rotseed"}[self.config.rotation]
        source = shared[kind + part]
        return derived(source, ("spherical.matrices", self.config.rotation, head_dim, str(device), part),
                       lambda: self._matrices(shared, head_dim, device, part))

    def _matrices(self, shared, head_dim: int, device, part: str):
        if self.config.rotation == "hadamard":
            s = 1 - 2 * unpack_bits(shared["signs" + part].to(device), 1, head_dim).double()  # [H, D]
            m = sylvester_hadamard(head_dim).double().to(device) * s.unsqueeze(-2)  # W diag(s)
            c = 1 / math.sqrt(head_dim)
        elif self.config.rotation == "structured":
            # decode M = R^T (x = y R^T), rounded to fp16 like the dense rotation: exact products in _unscaled
            m, c = _structured(tuple(seeds_of(shared["rotseed" + part])), head_dim).double().to(device), 1.0
        else:
            m, c = shared["rotation" + part].to(device).double(), 1.0
        a = m * c
        eye = torch.eye(head_dim, dtype=torch.float64, device=device)
        inv = a.transpose(-1, -2)
        for _ in range(3):
            inv = inv @ (2 * eye - a @ inv)
        return m, c, inv

    # ---- the scalar codebook ---------------------------------------------------------
    def levels(self, head_dim: int, device, bits: int | None = None):
        """float64 levels of one coordinate of u (the Beta law, or N(0, 1/D)),
        rounded to fp16 values (see `_unscaled`), and the midpoints between them."""
        n = 1 << (self.mse_bits if bits is None else bits)
        return _levels(self.config.levels, n, head_dim, str(device))

    # Everything below runs in float64 so the stored codes and gains do not hang on
    # the order a matmul of a given batch shape sums in: one token written alone
    # stores what it stores inside a long write (append_matches_single_write).
    def _coords(self, x, mats):
        """y = x A^-1 of every token vector, its norm and unit direction u."""
        y = torch.matmul(x.double(), mats[2])
        n = y.norm(dim=-1, keepdim=True)
        return y, n, y / torch.where(n > 0, n, torch.ones_like(n))  # x = 0 -> u = 0, gain 0

    @staticmethod
    def _unscaled(v, mats):
        """v @ M in float64: EXACT, hence the same for any batch shape or summation
        order. v is on the fp16 grid and M is fp16 or +-1, so every product fits
        in 22 significant bits at a multiple of 2^-48, and every partial sum is
        below 2^3 (|v| <= sqrt(D) max|level| < 4, M's columns near unit length;
        or <= sqrt(D)*4 with +-1 entries): within float64's 53 bits."""
        return torch.matmul(v, mats[0])

    # ---- encode / decode --------------------------------------------------------------
    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        fields = {}
        mse = None  # qjl: the MSE-stage decode of the whole vector, exactly as decode builds it
        for (part, d, bits), idx in zip(self.parts(D), self.channel_index(shared, D, x.device)):
            xp = self._take(x, idx)
            mats = self.matrices(shared, d, x.device, part)
            y, n, u = self._coords(xp, mats)
            lv, edges = self.levels(d, x.device, bits)
            codes = torch.bucketize(u, edges)  # nearest level: cells are split at the midpoints
            if self.config.gain == "lsq":
                w = self._unscaled(lv[codes], mats) * mats[1]  # what decode returns for gain 1; != 0
                g = (xp.double() * w).sum(-1) / w.pow(2).sum(-1)  # (no level is 0, A is invertible)
            else:
                g = n.squeeze(-1)
            check_fp16_storable("spherical gain", g)
            fields.update({"codes" + part: pack_bits(codes, bits), "gain" + part: g.half()})
            if self.use_qjl:
                xp_hat = self._mse_decoded(lv[codes], fields["gain" + part], mats)
                mse = self._place(mse, xp_hat, idx, (B, H, T, D))
        if self.use_qjl:
            r = x.double() - mse  # exactly what decode adds the sketch to
            rn = r.norm(dim=-1)
            check_fp16_storable("spherical qjl residual norm", rn)
            proj = torch.matmul(r, shared["qjl"].double().transpose(0, 1))  # [B, H, T, m]
            fields.update(qjl_signs=pack_bits((proj < 0).long(), 1), qjl_norm=rn.half())
        return Segment(fields, T)

    @staticmethod
    def _place(out, xp, idx, shape):
        """Part xp (its channels idx; None: the whole vector) placed into out (None: a new
        float64 zeros of `shape`)."""
        if idx is None:
            return xp
        if out is None:
            out = torch.zeros(shape, dtype=torch.float64, device=xp.device)
        return out.scatter_(-1, _expand_index(idx, shape), xp)

    def _mse_decoded(self, v, gain16, mats):
        """float64 MSE-stage decode from levels v [B, H, T, D] and the stored gain."""
        scale = gain16.double() * mats[1]
        if self.config.gain == "norm":
            scale = scale / v.pow(2).sum(-1).sqrt()  # exact sum too: fp16-grid squares
        return self._unscaled(v, mats) * scale.unsqueeze(-1)

    def _qjl_decoded(self, fields, s_matrix, D):
        """r_hat = sqrt(pi/2)/m ||r|| S^T z; z @ S is exact in float64 (+-1 times
        fp16 values: integer multiples of 2^-24 far below 2^53 of them)."""
        z = 1 - 2 * unpack_bits(fields["qjl_signs"], 1, D).double()  # [B, H, T, m]
        m = s_matrix.shape[0]
        return torch.matmul(z, s_matrix.double()) * (fields["qjl_norm"].double() * (QJL_SCALE / m)).unsqueeze(-1)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        dev = seg.fields["gain"].device
        out = None
        for (part, d, bits), idx in zip(self.parts(D), self.channel_index(shared, D, dev)):
            mats = self.matrices(shared, d, dev, part)
            lv, _ = self.levels(d, dev, bits)
            xp = self._mse_decoded(lv[unpack_bits(seg.fields["codes" + part], bits, d)], seg.fields["gain" + part], mats)
            out = self._place(out, xp, idx, (B, H, T, D))
        if self.use_qjl:
            out = out + self._qjl_decoded(seg.fields, shared["qjl"], D)
        return out.float()

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        bits = sum(d * b + 16 for _, d, b in self.parts(head_dim)) / head_dim  # codes and a gain per part
        return bits + 1 + 16 / head_dim if self.use_qjl else bits  # + a sketch bit per row and the residual norm

    def error_bound(self, x):
        """MSE stage: per coordinate of u, at most the largest distance from the
        level of its cell to that cell's edges (for an outer cell, to u itself:
        the clipping error). Their L2 sum eps bounds ||u - v||, so the angle
        between u and v is at most asin(eps) and ||u - v/||v|||| <= f =
        2 sin(asin(eps)/2) (2 when eps >= 1). Decoding ||y|| v/||v|| then errs by
        at most sigma_max(A) ||y|| f <= kappa(A) ||x|| f, and the lsq gain is the
        best scale for v, so no worse. Add the fp16 rounding of the gain (relative
        2^-11, times kappa; absolute 2^-25 times ||v @ A|| <= sigma_max sqrt(D)
        max|level|) and slack for the float32 output.
        QJL keys: ||r - r_hat|| <= ||r|| + ||r_hat||, and ||r_hat|| <=
        sqrt(pi/2)/m ||r||_fp16 sigma_max(S) sqrt(m), ||r|| being at most the MSE
        bound above (plus fp16 rounding of the stored norm).
        Outlier channels: the two parts are disjoint channel sets, each coded as
        above, so their bounds add in quadrature."""
        D = x.shape[-1]
        shared = self.fitted_shared(x)
        total = 0
        for (part, d, bits), idx in zip(self.parts(D), self.channel_index(shared, D, x.device)):
            total = total + self._part_bound(self._take(x, idx), shared, part, d, bits).pow(2)
        bound, nx = total.sqrt(), x.double().norm(dim=-1)
        if self.use_qjl:
            s_max = float(torch.linalg.svdvals(shared["qjl"].double().cpu())[0])
            m = shared["qjl"].shape[0]
            bound = bound * (1 + QJL_SCALE / math.sqrt(m) * s_max * (1 + 2.0**-10))
        return (bound * (1 + 1e-6) + 1e-6 * nx).float()

    def _part_bound(self, x, shared, part, d, bits):
        """The MSE-stage bound above for one part (channels d, `bits` bits), float64."""
        mats = self.matrices(shared, d, x.device, part)
        _, n, u = self._coords(x, mats)
        lv, edges = self.levels(d, x.device, bits)
        k = torch.bucketize(u, edges)
        c = lv[k]
        inf = edges.new_tensor([math.inf])
        lo, hi = torch.cat([-inf, edges])[k], torch.cat([edges, inf])[k]
        lo = torch.where(torch.isinf(lo), torch.minimum(u, c), lo)
        hi = torch.where(torch.isinf(hi), torch.maximum(u, c), hi)
        eps = (torch.maximum(c - lo, hi - c) + 1e-12).pow(2).sum(-1).sqrt()
        f = torch.where(eps < 1, 2 * torch.sin(torch.asin(eps.clamp(max=1.0)) / 2), torch.full_like(eps, 2.0))
        sv = torch.linalg.svdvals(mats[0].cpu() * mats[1]).to(x.device)  # [H, d], descending
        smax, kappa = sv[:, 0].view(-1, 1), (sv[:, 0] / sv[:, -1]).view(-1, 1)  # per kv-head
        v_max = math.sqrt(d) * float(lv.abs().max())
        return x.double().norm(dim=-1) * kappa * (f + 2.0**-11) + 2.0**-25 * smax * max(1.0, v_max)


@functools.lru_cache(maxsize=1024)
def _structured(seeds: tuple[int, ...], d: int) -> torch.Tensor:
    """fp16 [H, d, d]: decode's M = R^T of each kv-head's structured rotation, once per
    (seeds, d) in a process (each fresh cache of a window stores the same seeds)."""
    return torch.stack([structured_rotation(s, d).T.half() for s in seeds])


@functools.lru_cache(maxsize=64)
def _levels(kind: str, n: int, head_dim: int, device: str):
    """Spherical.levels, once per (law, n, head_dim, device): small float64 tensors that
    no caller writes."""
    if kind == "beta":
        lv = torch.tensor(lloyd_max_sphere(n, head_dim), dtype=torch.float64)
    else:
        lv = torch.tensor(lloyd_max_gaussian(n), dtype=torch.float64) / math.sqrt(head_dim)
    lv = lv.half().double().to(device)
    return lv, (lv[1:] + lv[:-1]) / 2

