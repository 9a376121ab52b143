"""Additive (residual) VQ, CommVQ-style: the `additive VQ` baseline of METHOD.md
section 2, calibration-free (codebooks fitted on the write, the default) or
calibrated (codebooks fitted once per model by EM on calibration K/V).

Each K/V token vector x (one kv-head, length D) is first rotated by a seeded
randomised Hadamard rotation of its (layer, role, kv-head) (`rotation`,
rotation.py), which spreads key-channel outliers over every coordinate, then
divided by its RMS s = ||x||/sqrt(D) (stored fp16; encode divides by the
stored value), and the normalised vector z is cut into D/dim chunks of `dim`
elements. Each chunk is coded as a sum of M codewords, one from each of M
codebooks of K = 2^K_bits codewords, by greedy residual coding (stage m picks
the codeword nearest to what stages 1..m-1 left over) or, with beam > 1, a
beam search keeping the `beam` best partial sums.

Codebooks (`codebooks`):
- "fitted" (default): residual k-means on the data being written, no
  calibration set: stage 1 is k-means on the chunks of z, stage m on the
  residuals that stages 1..m-1 (as stored, fp16) leave (vq.py: KMEANS_ITERS =
  6 Lloyd iterations on a seeded sample of at most 16 points per codeword).
  The first write into a cache fits them (fitted.py); later appends reuse
  them. The fit is per row (per sequence): a cache of B batch rows fits B sets,
  row b's on row b's tokens alone, coding row b only, so a batch of windows
  stores, byte for byte, what B one-window caches store. They are stored fp16
  and counted, amortised over the cache: M*K*dim*16 bits per (layer, role) and
  row (per kv-head with per_head=true).
- "calibrated" (`avq2-cal`, `avq3-cal`): fitted ONCE per model and (layer,
  role), on calibration K/V disjoint from what is scored (calibrated.py: the
  harness captures them from an fp16 pass over calibration windows,
  suites/harness/calibration.py), by EM over all stages jointly (vq.py `em_codebooks`):
  start from residual k-means, then alternate (E) encode every calibration chunk
  by beam search over the current codebooks (`beam`, at least CAL_BEAM) and (M)
  refit ALL M codebooks at once by least squares given those codes (the sum of
  the chosen codewords against the chunk: one linear system over the M*K
  codewords, so stage m's codewords are refitted knowing what the other stages
  chose, not only what the earlier ones left), EM_ITERS rounds, keeping the
  codebooks of the lowest calibration error seen. A cache then codes every write
  with them (beam search) and fits nothing. They are model constants
  (`constant_shared`), like the seeded rotation: one set per (layer, role) for
  every row and window, not charged per cache.
- "gaussian" (the earlier strawman): seeded N(0, gain_m^2 I) codewords,
  stage gains fixed on synthetic N(0, I) chunks (`stage_gains`), never fitted.
Codeword 0 of every codebook is the zero vector (EM keeps it there), so a stage
can always decline to code and a chunk's residual never grows (the error bound).

Measured (SmolLM2-135M, canterbury, 2 scored windows of 512 tokens, seed 0; calibration:
2 windows of 512 tokens right after the first scored one; cache bits, codebooks of
calibrated rows apart as model constants):
  K/V reconstruction, relative MSE, layers 0/7/15/22/29: avq2 0.0643 at 2.92 bits,
    avq2-cal 0.0674 at 2.25; avq3 0.0207 at 4.25, avq3-cal 0.0197 at 3.25.
  Ablation, layers 7 and 22: calibrated residual k-means alone 0.0774 greedy, 0.0689
    beam 8; + 3 EM rounds 0.0675 (6 rounds 0.0674; 4 calibration windows 0.0674);
    per-write fitted avq2 0.0641. Beam search gives most of the gain, EM ~2%.
  quantize-on-write PPL (fp16 39.13): avq2 69.50 at 2.92 bits, avq2-cal 71.24 at 2.25;
    avq3 45.29 at 4.25, avq3-cal 46.87 at 3.25. Calibrated codebooks cost a little
    error against codebooks fitted on the very window they code, and save their
    0.67 bits per stage.

Gain (`gain`): "lsq" (default) replaces the stored RMS, after coding, by the
least-squares scale <y, zhat>/||zhat||^2 (y the rotated x): the best scale
for those codes, at the same 16 bits. "rms" keeps s.

What of CommVQ (Li et al., ICML 2025) is here and what is not: here are
additive quantization of each token's vector as a sum of codewords, codebooks
trained by EM on calibration data (codebooks=calibrated), per-layer K and V
codebooks. Not here: CommVQ's learned lightweight ENCODER (a small network that
predicts the codes; here codes come from a beam search over the codebooks), its
training objective and data (a large calibration corpus; here a few windows of
the evaluation corpus, after the scored ones, in hard-assignment k-means-style
EM on normalised, Hadamard-rotated chunks), and its RoPE COMMUTATIVITY: CommVQ
constrains the key codebook to commute with the rotary embedding so that keys
are decoded inside attention (query times codebook precomputed) and can be
stored before RoPE; here keys are coded after RoPE, as the cache receives them,
with unconstrained codebooks, and the cache is decoded to vectors. The rotation
and the per-token RMS / lsq gain are the usual calibration-free VQ
preprocessing, not CommVQ's.

Stored per token vector: (D/dim)*M codes of K_bits bits, bit-packed, in
(chunk, stage) order (`codes`), and the fp16 gain (`gain`). Per (layer, role):
the codebooks, fp16 [R, H, M, K, dim] ([R, 1, M, K, dim] with per_head=false),
R = B batch rows when fitted (one set per row), R = 1 when seeded (gaussian:
one set serves every row) or calibrated, and with rotation=hadamard the sign
bits, uint8 [H, D/8].
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .base import Quantizer, QuantizerInputError, Segment, check_fp16_storable, stable_seed
from .calibrated import Calibrated
from .fitted import FitsOnFirstWrite, fold_rows, row_index
from .packing import pack_bits, unpack_bits
from .rotation import random_signs, rotate, signs_of, unrotate
from .vq import CAL_BEAM, CAL_POINTS_PER_CODEWORD, MAX_JOINT, em_codebooks, fit_residual_codebooks, residual_search

GAIN_SAMPLES = 4096  # synthetic chunks used to fix the stage gains (codebooks=gaussian)
GAIN_GRID = torch.linspace(0.2, 1.4, 13, dtype=torch.float64)  # x sqrt(residual energy per element)
BOUND_SLACK = 1e-5  # relative: float32 rotations and decode


def gaussian_codebooks(M: int, K: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """[M, K, dim] standard Gaussian codewords, codeword 0 of each stage zero."""
    cb = torch.randn(M, K, dim, generator=gen, dtype=torch.float64)
    cb[:, 0] = 0
    return cb


@functools.lru_cache(maxsize=None)
def stage_gains(M: int, K_bits: int, dim: int) -> tuple[float, ...]:
    """Codeword std of each stage (codebooks=gaussian), fixed on synthetic seeded
    N(0, I) chunks by greedy residual coding: per stage, the grid gain leaving
    the least residual energy. float64 on CPU: deterministic."""
    gen = torch.Generator().manual_seed(stable_seed("avq-gains", M, K_bits, dim))
    data = torch.randn(1, 1, GAIN_SAMPLES, dim, generator=gen, dtype=torch.float64)
    unit = gaussian_codebooks(M, 1 << K_bits, dim, gen)
    gains = []
    for m in range(M):
        scale = math.sqrt(float(data.pow(2).mean()))  # residual energy per element so far
        best = None
        for a in (GAIN_GRID * scale).tolist():
            _, res = residual_search(data, unit[None, m : m + 1] * a, 1)
            e = float(res.pow(2).mean())
            if best is None or e < best[0]:
                best = (e, a, res)
        gains.append(best[1])
        data = best[2]
    return tuple(gains)


# Candidates a chunk's encode weighs (codebooks x beam x codewords): fit and search time
# grow with it. CPU, 2 threads, one 64-token window of 2 heads x d 64: 2 x 8 x 4096 (65536)
# 0.44 s idle, 4 x 16 x 4096 8 s and 16 x 1 x 16384 9-27 s on a loaded machine (108 s on a
# 512-token window), 16 x 64 x 16384 274 s; the old bounds (16 x 64 x 65536) never
# finished. 2^16 keeps a window within seconds.
MAX_SEARCH = 1 << 16


class AdditiveVQ(Calibrated, FitsOnFirstWrite, Quantizer):
    name = "avq"
    description = ("additive VQ (CommVQ-style): Hadamard rotation, RMS gain, sums of M codewords: residual k-means "
                   "fitted on the write, or EM-calibrated once per model (codebooks=calibrated, beam search)")
    stochastic = True  # seeded rotation and k-means
    aliases = {**{f"avq{m}": {"M": m} for m in (2, 3, 4)},
               **{f"avq{m}-cal": {"M": m, "codebooks": "calibrated", "beam": 8} for m in (2, 3, 4)}}
    # ~2.9 and ~4.25 measured bits at 512 tokens x 3 kv-heads of 64 dims, codebooks
    # included (0.67 bits per stage there); beam=8 is ~10x slower to encode: an option.
    # The calibrated aliases (avq2-cal, avq3-cal: the CommVQ-like rows) are not examples:
    # every consumer of examples() (conformance, kvqbench list, the batch and bench tests)
    # codes with fresh uncalibrated instances. `kvqbench compare` runs them in its default
    # sweep (`calibrated_example_specs`, beside the per-write avq2 / avq3): without them the
    # AVQ family's front is the per-write fit, whose codebooks are cache bytes (avq2: 2.92
    # cache bits where avq2-cal stores 2.25). Their CPU cost there (SmolLM2-135M, 2 x 512-
    # token windows, 2-core VM, 2026-12-05): the capture ~2 s once; per seed, the 60 (layer,
    # role) EM fits 9.7 s (avq2-cal) / 18.0 s (avq3-cal) and the scoring 9.6 / 14.8 s
    # (avq2 per-write: 4.9 s).
    example_specs = ("avq2", "avq3")
    calibrated_example_specs = ("avq2-cal", "avq3-cal")

    @dataclasses.dataclass
    class Config:
        M: int = 2
        K_bits: int = 8
        dim: int = 8
        beam: int = 1
        gain: str = "lsq"  # or "rms"
        per_head: bool = False
        codebooks: str = "fitted"  # or "calibrated", "gaussian"
        rotation: str = "hadamard"  # or "none"

    def validate_config(self):
        c = self.config
        if not 1 <= c.M <= 16:
            raise QuantizerInputError(f"avq: M (codebooks) must be in 1..16, got {c.M}")
        if not 1 <= c.K_bits <= 14:  # 16384 codewords: more than a window's chunks to fit them on
            raise QuantizerInputError(f"avq: K_bits must be in 1..14, got {c.K_bits}")
        if not 1 <= c.dim <= 256:
            raise QuantizerInputError(f"avq: dim (chunk length) must be in 1..256, got {c.dim}")
        if not 1 <= c.beam <= 64:
            raise QuantizerInputError(f"avq: beam must be in 1..64, got {c.beam}")
        if c.gain not in ("lsq", "rms"):
            raise QuantizerInputError(f"avq: gain must be lsq or rms, got {c.gain!r}")
        if c.codebooks not in ("fitted", "calibrated", "gaussian"):
            raise QuantizerInputError(f"avq: codebooks must be fitted, calibrated or gaussian, got {c.codebooks!r}")
        if c.codebooks == "calibrated" and c.M << c.K_bits > MAX_JOINT:
            raise QuantizerInputError(f"avq: codebooks=calibrated refits the M x 2^K_bits = {c.M << c.K_bits} "
                                      f"codewords jointly; at most {MAX_JOINT} (lower M or K_bits)")
        if c.rotation not in ("hadamard", "none"):
            raise QuantizerInputError(f"avq: rotation must be hadamard or none, got {c.rotation!r}")
        work = c.M * c.beam * (1 << c.K_bits)
        if work > MAX_SEARCH:
            raise QuantizerInputError(f"avq: M x beam x 2^K_bits = {c.M} x {c.beam} x {1 << c.K_bits} = {work} "
                                      f"candidates per chunk exceeds {MAX_SEARCH} (fit and search time grow with it: "
                                      "lower K_bits, M or beam)")
        self.head_dim_multiple = c.dim  # chunks must tile the head vector
        # Seeded and calibrated codebooks code every write alike; fitted ones come from the first write.
        self.append_matches_single_write = c.codebooks != "fitted"
        self.needs_calibration = c.codebooks == "calibrated"  # calibrated.py

    # ---- codebooks and rotation ----------------------------------------------------
    def make_shared(self, heads, head_dim):
        c = self.config
        shared = {}
        if c.rotation == "hadamard":
            shared["signs"] = random_signs([self.head_seed(h) for h in range(heads)], head_dim)
        groups = heads if c.per_head else 1
        if c.codebooks != "gaussian":  # fitted: one row, replaced at the first write; B rows hold B
            # (fitted.py). calibrated: replaced by the calibration when a cache starts (calibrated.py).
            shared["codebooks"] = torch.zeros(1, groups, c.M, 1 << c.K_bits, c.dim, dtype=torch.float16)
            return shared
        g = torch.tensor(stage_gains(c.M, c.K_bits, c.dim), dtype=torch.float64).view(-1, 1, 1)
        if c.per_head:
            seeds = [self.head_seed(h) for h in range(heads)]
        else:
            seeds = [stable_seed(self.name, self.seed, self.layer, "all-heads", self.role)]
        cbs = [gaussian_codebooks(c.M, 1 << c.K_bits, c.dim, torch.Generator().manual_seed(s)) * g for s in seeds]
        shared["codebooks"] = torch.stack(cbs).half().unsqueeze(0)  # [1, H or 1, M, K, dim]: every row's
        return shared

    def per_row_shared(self):
        return ("codebooks",) if self.config.codebooks == "fitted" else ()

    def constant_shared(self):
        """The seeded rotation's signs, and codebooks that do not depend on the data written:
        seeded (gaussian) or calibrated once per model (calibrated.py)."""
        base = getattr(super(), "constant_shared", None)
        names = set(base()) if base is not None else set()
        if self.config.rotation == "hadamard":
            names.add("signs")
        if self.config.codebooks != "fitted":
            names.add("codebooks")
        return frozenset(names)

    def _chunks(self, x, shared):
        """Normalised rotated chunks of x [B, H, T, D] as the fit sees them: [G, B*T*D/dim, dim]."""
        c = self.config
        z, _ = self._normalise(self._rotate(x, shared))
        B, H, T, D = z.shape
        pts = z.reshape(B, H, -1, c.dim).transpose(0, 1).reshape(H, -1, c.dim)  # [H, B*N, dim]
        return pts if c.per_head else pts.reshape(1, -1, c.dim)

    def fit_shared(self, x, shared):  # x: one row [1, H, T, D]
        return self.fit_shared_rows(x, shared)

    def fit_shared_rows(self, x, shared):
        """Each row's codebooks fitted on its own chunks: the rows' point sets are groups of one
        residual k-means (fitted.py fit_shared_rows), each drawing what a one-row fit draws."""
        c = self.config
        if c.codebooks != "fitted":
            return {}
        B = x.shape[0]
        pts = torch.cat([self._chunks(x[b:b + 1], shared) for b in range(B)])  # [B G, N, dim]
        gen = torch.Generator().manual_seed(stable_seed(self.name, self.seed, self.layer, self.role, "fit"))
        cb = fit_residual_codebooks(pts, c.M, 1 << c.K_bits, gen)
        check_fp16_storable("avq codeword", cb)
        return {"codebooks": cb.half().view(B, -1, *cb.shape[1:])}

    def calibrate(self, x):
        """codebooks=calibrated: EM codebooks (`em_codebooks`) on calibration K/V x, float
        `[N, H, T, D]` (N windows of this layer and role), on a seeded sample of at most
        CAL_POINTS_PER_CODEWORD * K chunks per group. Returns {"codebooks": fp16 [1, G, M, K, dim]}
        for `load_calibration`."""
        c = self.config
        if c.codebooks != "calibrated":
            raise QuantizerInputError(f"{self.spec}: only codebooks=calibrated is calibrated")
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.numel() == 0 or x.shape[-1] % c.dim:
            raise QuantizerInputError(f"{self.spec}: calibration K/V must be a non-empty [N, H, T, D] tensor with "
                                      f"D a multiple of {c.dim}, got {tuple(getattr(x, 'shape', ()))}")
        if not torch.isfinite(x).all():
            raise QuantizerInputError(f"{self.spec}: calibration K/V hold NaN/Inf")
        x = x.float()
        shared = {k: v.to(x.device) for k, v in self.make_shared(x.shape[1], x.shape[3]).items()}
        gen = torch.Generator().manual_seed(stable_seed(self.name, self.seed, self.layer, self.role, "em"))
        K = 1 << c.K_bits
        pts = self._chunks(x, shared)
        cap = CAL_POINTS_PER_CODEWORD * K
        if pts.shape[1] > cap:
            pts = pts[:, torch.randperm(pts.shape[1], generator=gen)[:cap].to(pts.device)]
        cb = em_codebooks(pts, c.M, K, max(c.beam, CAL_BEAM), gen)
        check_fp16_storable("avq codeword", cb)
        return {"codebooks": cb.half().unsqueeze(0).cpu()}

    def _rotate(self, x, shared):
        if self.config.rotation == "none":
            return x
        return rotate(x, signs_of(shared["signs"], x.shape[-1]).to(x.device))

    def _unrotate(self, y, shared):
        if self.config.rotation == "none":
            return y
        return unrotate(y, signs_of(shared["signs"], y.shape[-1]).to(y.device))

    # ---- encode / decode --------------------------------------------------------------
    def _normalise(self, y):
        s = y.double().norm(dim=-1) / math.sqrt(y.shape[-1])  # float64: see vq.residual_search
        check_fp16_storable("avq RMS scale", s)
        s16 = s.half().float()
        return y / torch.where(s16 > 0, s16, torch.ones_like(s16)).unsqueeze(-1), s16

    def encode_tokens(self, x, shared):
        B, H, T, D = x.shape
        c = self.config
        y = self._rotate(x, shared)
        z, s = self._normalise(y)
        # Row b's chunks meet row b's codebooks (fold_rows): the same float64 scores as a
        # one-row write of row b.
        r, cb = fold_rows(z.reshape(B, H, T * (D // c.dim), c.dim), shared["codebooks"].float())
        codes, _ = residual_search(r, cb, c.beam)
        if c.gain == "lsq":
            zhat = self._decoded(codes, shared, (B, H, T, D)).double()  # exactly what decode sums
            nz = zhat.pow(2).sum(-1)
            s = (y.double() * zhat).sum(-1) / torch.where(nz > 0, nz, torch.ones_like(nz))  # zhat = 0 -> 0
            check_fp16_storable("avq gain", s)
        codes = codes.reshape(B, H, T, -1)  # (chunk, stage) order
        return Segment({"codes": pack_bits(codes, c.K_bits), "gain": s.half()}, T)

    def decode_tokens(self, seg, shared, shape):
        B, H, T, D = shape
        c = self.config
        codes = unpack_bits(seg.fields["codes"], c.K_bits, D // c.dim * c.M)
        y = self._decoded(codes, shared, shape) * seg.fields["gain"].float().unsqueeze(-1)
        return self._unrotate(y, shared)

    def _decoded(self, codes, shared, shape):
        """The normalised vector zhat, float32, from codes `[B, H, T, nc*M]` or `[B, H, T*nc, M]`."""
        B, H, T, D = shape
        c = self.config
        nc = D // c.dim
        codes = codes.reshape(B, H, T, nc, c.M)
        cb = shared["codebooks"].float()  # [1 or B, H or 1, M, K, dim]
        rows, heads = row_index(cb, 4), torch.arange(cb.shape[1], device=codes.device).view(1, -1, 1, 1)
        out = torch.zeros(B, H, T, nc, c.dim, device=codes.device)
        for m in range(c.M):  # one stage at a time: no [.., M, dim] temporary
            out += cb[:, :, m][rows, heads, codes[..., m]]
        return out.reshape(B, H, T, D)

    # ---- accounting and guarantees ----------------------------------------------------
    def formula_bits(self, head_dim):
        c = self.config
        return c.M * c.K_bits / c.dim + 16 / head_dim

    def error_bound(self, x):
        """For x coded with `fitted_shared(x)` (fitted.py). Greedy (and beam) residual coding never
        ends worse than after stage 1 (every later stage may pick the zero
        codeword; a beam keeps its best), so ||z - zhat|| <= e, the distance of
        each chunk of z to its nearest stage-1 codeword (brute force over the
        stored codebook), summed in quadrature. The RMS gain then errs by s e; the
        lsq gain is the best scale for zhat, so no worse, plus its fp16 rounding:
        relative 2^-11 of |<y, zhat>|/||zhat|| <= ||x||, and an absolute 2^-25
        times ||zhat|| <= 3 sqrt(D). An RMS that rounds to fp16 zero decodes 0: an
        error of ||x||. The rotation is orthogonal; float32 slack on top."""
        c = self.config
        shared = self.fitted_shared(x)
        B, H, T, D = x.shape
        z, s16 = self._normalise(self._rotate(x.float(), shared))
        ch = z.double().reshape(B, H, -1, c.dim)
        cb1 = shared["codebooks"].double()[:, :, 0]  # [1 or B, H or 1, K, dim]
        cb1 = cb1.expand(B, H, *cb1.shape[2:])  # row b's stage-1 codebook of each kv-head
        d2 = torch.stack([  # ||z - c||^2 = ||z||^2 - 2 <z, c> + ||c||^2, one batch row at a time
            (ch[b].pow(2).sum(-1, keepdim=True) - 2 * ch[b] @ cb1[b].transpose(1, 2)
             + cb1[b].pow(2).sum(-1).unsqueeze(1)).amin(-1).clamp(min=0) for b in range(B)])  # [B, H, T*nc]
        e = d2.reshape(B, H, T, -1).sum(-1).sqrt()
        n = x.double().norm(dim=-1)
        coded = s16.double() * e
        if c.gain == "lsq":
            coded = coded + 2.0**-11 * n + 2.0**-25 * 3 * math.sqrt(D)
        bound = torch.where(s16 > 0, coded, n)
        return (bound * (1 + BOUND_SLACK) + BOUND_SLACK * n).float()
