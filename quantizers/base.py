"""The one quantizer interface every plugin implements, and the packed object.

A quantizer instance belongs to one (layer, role) of one model; it codes K or
V tensors shaped `[batch, kv_heads, tokens, head_dim]`. Writes are appended
along the token axis:

    q = get_quantizer("hqmq:S=96,r=4", layer=3, role="K", seed=0)
    packed = q.encode(k_prefill)        # first write
    packed = q.append(packed, k_step)   # a decode-step write of one token
    k_hat = q.decode(packed)            # everything written so far

A `Packed` is a list of immutable `Segment`s (runs of tokens, each a dict of
stored tensors: bit-packed uint8 codes, fp16 scales, ...) plus `shared`
tensors stored once per (layer, role) (codebooks, rotations), amortised over
the cache. `Packed.nbytes` counts every stored byte; bits per element are
measured from it, never computed from a formula.

Bytes in two parts (METHOD.md section 3 and 4 "Bits:"): shared tensors drawn from
a seed and independent of the data (a rotation, a QJL sketch, HQMQ's secondaries,
Hadamard signs) are MODEL CONSTANTS: a deployed cache regenerates them once per
model, not per cache. A quantizer names them in `constant_shared()` (default: none,
the conservative answer: every byte is a cache byte), and its Packed carries the
names (`Packed.constant`). Then:
  `cache_nbytes` / `cache_bits_per_element`: what the cache stores per write
      (segments, and shared tensors fitted to the data: codebooks fitted on the
      write, outlier masks, scales), the figure to compare methods by;
  `constant_nbytes`: the model constants, to be reported once per model;
  `nbytes` / `bits_per_element`: the TOTAL (both parts, as if the constants were
      stored with every cache), kept for compatibility.
The conformance suite (suites/conformance.py `check_constant_shared`) checks that
every declared constant is byte-identical across writes of different data.

A plugin implements `encode_tokens` / `decode_tokens` for one run of tokens
(float32 in, float32 out) and `formula_bits`; it overrides `append` only when
its state spans writes (KIVI's fp16 window and token groups; `append_windowed`
is that mechanism, shared).

`decode` trusts nothing it is given (`check_packed`, run once per segment):
the Packed must come from this quantizer's spec; every segment must hold exactly
the fields, shapes and dtypes that `encode_tokens` stores for its shape (learnt
by encoding reference tensors of that shape once); and finite stored bytes that
decode to NaN/Inf raise `CorruptPackedError` instead of reaching attention.

(About 660 lines: the one contract every plugin implements, Quantizer, Segment, Packed
and the value checks, kept in one file so a plugin author reads it in one place.)
"""
from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .checks import require

FP16_MAX = 65504.0
ROLES = ("K", "V")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# A segment whose only field is this holds its tokens as written, in fp16 (a KIVI-style
# window of recent tokens not yet quantized). The base class validates and decodes it,
# so every plugin that keeps a window stores it the same way.
WINDOW_FIELD = "residual"

# Tokens of the host-side probe that finds a format's data-dependent fields (`_variable`):
# enough for heavy-tailed data to make Med3x outliers, KIVI groups and windows alike
PROBE_TOKENS = 128


class QuantizerInputError(ValueError):
    """Bad input to a quantizer: the message names the problem."""


class CorruptPackedError(QuantizerInputError):
    """A Packed its quantizer cannot have written (another spec, fields of the wrong
    shape or dtype) or whose stored bytes decode to NaN/Inf."""


@dataclasses.dataclass(eq=False)
class Segment:
    """A run of `tokens` tokens as stored. `fields` holds ONLY stored bytes."""

    fields: dict[str, torch.Tensor]
    tokens: int
    # Decoded copy kept beside the stored bytes so a growing cache decodes each
    # segment once; never counted as storage.
    _decoded: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())


@dataclasses.dataclass(eq=False)
class Packed:
    """Everything one (layer, role) of the quantized cache stores."""

    batch: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    segments: list[Segment]
    shared: dict[str, torch.Tensor]
    spec: str
    # Names of the `shared` tensors that are model constants (seeded, independent of the
    # data: Quantizer.constant_shared), counted by `constant_nbytes`, not `cache_nbytes`.
    constant: frozenset[str] = frozenset()

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.tokens, self.head_dim)

    @property
    def numel(self) -> int:
        return self.batch * self.heads * self.tokens * self.head_dim

    def nbytes_by_field(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for seg in self.segments:
            for k, t in seg.fields.items():
                out[k] = out.get(k, 0) + t.numel() * t.element_size()
        for k, t in self.shared.items():
            out["shared:" + k] = t.numel() * t.element_size()
        return out

    @property
    def nbytes(self) -> int:
        """TOTAL stored bytes: `cache_nbytes + constant_nbytes`."""
        return sum(self.nbytes_by_field().values())

    @property
    def constant_nbytes(self) -> int:
        """Bytes of the shared tensors that are model constants (`constant`): regenerated
        from the seed once per model, so not bytes of this cache."""
        return sum(t.numel() * t.element_size() for k, t in self.shared.items() if k in self.constant)

    @property
    def cache_nbytes(self) -> int:
        """Bytes this cache stores for its writes: every segment byte and every shared
        tensor that is not a model constant (codebooks fitted on the write, masks, scales)."""
        return self.nbytes - self.constant_nbytes

    @property
    def bits_per_element(self) -> float:
        """Measured TOTAL: every stored byte, model constants included, x 8 / K/V elements."""
        return self.nbytes * 8 / self.numel if self.numel else float("nan")

    @property
    def cache_bits_per_element(self) -> float:
        """Measured cache bits: `cache_nbytes` x 8 / K/V elements (model constants apart)."""
        return self.cache_nbytes * 8 / self.numel if self.numel else float("nan")

    def digest(self) -> str:
        """sha256 of every stored byte, in order: equal digests mean equal bytes."""
        h = hashlib.sha256()
        for name in sorted(self.shared):
            h.update(self.shared[name].contiguous().cpu().view(torch.uint8).numpy().tobytes())
        for seg in self.segments:
            for name in sorted(seg.fields):
                h.update(name.encode())
                h.update(seg.fields[name].contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def stable_seed(*parts) -> int:
    """A 63-bit seed from any parts (layer, head, role, user seed): stable across
    runs and machines, unlike Python's salted hash()."""
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def fp16_rounding_bound(x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fp16(x) - x| for |x| <= FP16_MAX: half an ulp, 2^-11 |x|
    for normal values, and half the subnormal spacing, 2^-25, below 2^-14."""
    return torch.clamp_min(x.abs() * 2.0**-11, 2.0**-25)


def check_fp16_storable(name: str, t: torch.Tensor) -> None:
    """Values stored as fp16 must fit: silently storing inf would decode garbage.
    (Through `checks.require`: deferred inside `deferred_checks()`.)"""
    if t.numel():
        mx = t.detach().abs().amax()
        require(mx > FP16_MAX, lambda: QuantizerInputError(
            f"{name} of magnitude {float(mx):.4g} overflows the fp16 the cache stores "
            f"(max {FP16_MAX}); rescale the input"))


class Quantizer(ABC):
    """Base of every plugin. Subclasses set `name`, `description`, a `Config`
    dataclass, and implement `encode_tokens`, `decode_tokens`, `formula_bits`."""

    name: ClassVar[str]
    description: ClassVar[str]
    Config: ClassVar[type]
    # Short names for common configs, e.g. {"int4": {"bits": 4}}.
    aliases: ClassVar[dict[str, dict]] = {}
    # True when writing tokens one call at a time stores the same bytes and
    # decodes to the same tensor as writing them all at once. Methods whose
    # statistics depend on the write (a per-write median, a per-write group)
    # say False and document why.
    append_matches_single_write: ClassVar[bool] = True
    # Head dims must be a multiple of this (4 for quaternion chunks).
    head_dim_multiple: ClassVar[int] = 1
    # Configs that `kvqbench list`, the conformance suite and the benchmarks
    # exercise; empty means just the plugin's name (its default config).
    example_specs: ClassVar[tuple[str, ...]] = ()
    # Calibrated configs (quantizers/calibrated.py: fitted once per model on calibration
    # K/V) that `kvqbench compare`'s default sweep also runs (it calibrates them); the
    # other consumers of `examples()` code with fresh, uncalibrated instances, so they
    # are kept apart.
    calibrated_example_specs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config=None, *, layer: int = 0, role: str = "K", seed: int = 0):
        if role not in ROLES:
            raise QuantizerInputError(f"role must be one of {ROLES}, got {role!r}")
        self.config = config if config is not None else self.Config()
        self.layer, self.role, self.seed = int(layer), role, int(seed)
        self.validate_config()

    # ---- what a plugin implements -------------------------------------------------
    def validate_config(self) -> None:
        """Raise QuantizerInputError on bad config values."""

    def make_shared(self, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
        """Tensors stored once per (layer, role): codebooks, rotations. On CPU;
        moved to the data's device by the base class. Seed them from
        `self.head_seed(h)` so every (layer, kv-head, role) gets its own."""
        return {}

    def constant_shared(self) -> frozenset[str]:
        """Names of the `make_shared` tensors that are MODEL CONSTANTS: a deterministic
        function of (config, layer, role, seed, heads, head_dim), never of the data
        written (a seeded rotation, sketch matrix, secondary codebook). A deployed cache
        regenerates them once per model, so they are reported apart (`constant_nbytes`)
        and not charged to the cache's bits. Default: none (every byte a cache byte).
        Anything fitted to the data (a codebook fitted on the write, a scale) must not
        be named; the conformance suite encodes different data and checks that every
        named tensor is byte-identical."""
        return frozenset()

    @abstractmethod
    def encode_tokens(self, x: torch.Tensor, shared: dict[str, torch.Tensor]) -> Segment:
        """Code float32 `[B, H, T, D]` into a Segment of stored tensors."""

    @abstractmethod
    def decode_tokens(self, seg: Segment, shared: dict[str, torch.Tensor], shape) -> torch.Tensor:
        """Decode a Segment to float32 `shape` = (B, H, T, D)."""

    @abstractmethod
    def formula_bits(self, head_dim: int) -> float:
        """The textbook bits per element, for comparison with the measured value."""

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Upper bound on the L2 round-trip error of each token vector `[B, H, T]`
        for float32 input x; the conformance suite checks decode against it."""
        return x.norm(dim=-1)

    # ---- the shared mechanics --------------------------------------------------------
    @classmethod
    def examples(cls) -> tuple[str, ...]:
        return cls.example_specs or (cls.name,)

    @property
    def spec(self) -> str:
        fields = dataclasses.fields(self.config)
        args = ",".join(f"{f.name}={getattr(self.config, f.name)}" for f in fields)
        return f"{self.name}:{args}" if args else self.name

    def __repr__(self) -> str:
        return f"<{self.spec} layer={self.layer} role={self.role} seed={self.seed}>"

    def head_seed(self, head: int) -> int:
        return stable_seed(self.name, self.seed, self.layer, head, self.role)

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise QuantizerInputError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise QuantizerInputError(
                f"expected [batch, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}"
            )
        if x.dtype not in SUPPORTED_DTYPES:
            raise QuantizerInputError(f"dtype {x.dtype} not supported; use one of {SUPPORTED_DTYPES}")
        if x.numel() == 0:
            raise QuantizerInputError(f"empty tensor of shape {tuple(x.shape)}: nothing to quantize")
        d = x.shape[-1]
        if d % self.head_dim_multiple:
            raise QuantizerInputError(
                f"{self.name} needs head_dim divisible by {self.head_dim_multiple}, got {d}"
            )
        bad = (~torch.isfinite(x)).sum()
        require(bad > 0, lambda: QuantizerInputError(f"input has {int(bad)} NaN/Inf values; a cache cannot store them"))

    def empty(self, like: torch.Tensor) -> Packed:
        B, H, _, D = like.shape
        shared = self._device_shared(H, D, like.device)
        return Packed(B, H, D, like.dtype, like.device, [], shared, self.spec, self._constant_names(shared))

    def empty_for(self, first: torch.Tensor) -> Packed:
        """`empty(first)` ready for the first write `first`: whatever a quantizer fits on its
        first write (fitted.py) already fitted on it, so a device encoder (kernels/) codes
        that write, and the writes after it, as `append` would."""
        return self.empty(first)

    # `make_shared` is a pure function of (spec, seed, layer, role, heads, head_dim): every
    # tensor it gives is a model constant (seeded, never fitted), so one copy per device is
    # kept for the process, as an engine builds them once at load (a fresh cache per prompt
    # would otherwise redraw them and rebuild their tables per layer: HQMQ's prefill on an
    # H200 spent ~60 of ~120 ms there). Opt-in: a fitted quantizer's shared tensors change.
    shared_is_constant: ClassVar[bool] = False
    _constants: ClassVar[dict] = {}

    def _device_shared(self, heads: int, head_dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        """`make_shared(heads, head_dim)` on `device`: a new dict; its tensors shared between
        caches where `shared_is_constant` (never to be written in place)."""
        if not self.shared_is_constant:
            return {k: v.to(device) for k, v in self.make_shared(heads, head_dim).items()}
        key = (type(self), self.spec, self.seed, self.layer, self.role, heads, head_dim, torch.device(device))
        got = Quantizer._constants.get(key)
        if got is None:
            if len(Quantizer._constants) >= 8192:  # many models / seeds in one process: start again
                Quantizer._constants.clear()
            got = {k: v.to(device) for k, v in self.make_shared(heads, head_dim).items()}
            Quantizer._constants[key] = got
        return dict(got)

    def _constant_names(self, shared: dict) -> frozenset[str]:
        """`constant_shared()`, checked: a frozenset of names of tensors `make_shared` gives."""
        names = self.constant_shared()
        if not isinstance(names, frozenset) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"{type(self).__name__}.constant_shared() must return a frozenset of shared tensor "
                            f"names, got {names!r}")
        unknown = names - set(shared)
        if unknown:
            raise TypeError(f"{type(self).__name__}.constant_shared() names {sorted(unknown)}, which make_shared "
                            f"does not give (it gives {sorted(shared)})")
        return names

    def encode(self, x: torch.Tensor) -> Packed:
        """Code one write into a fresh packed cache."""
        self.check_input(x)
        return self.append(self.empty(x), x)

    def append(self, packed: Packed | None, x: torch.Tensor) -> Packed:
        """Return a packed cache holding `packed`'s tokens then `x`'s. `packed` is not
        modified; its segments are shared with the result."""
        if packed is None:
            return self.encode(x)
        self.check_input(x)
        self._check_compatible(packed, x)
        seg = self._encode_segment(x.float(), packed.shared)
        return dataclasses.replace(packed, segments=packed.segments + [seg])

    def appends_one_segment(self) -> bool:
        """Whether `append` to a non-empty cache adds exactly one Segment, `encode_tokens`
        of the write, and keeps no other state across writes: true of this base `append`;
        a class that overrides `append` answers for itself (False unless it says so).
        Decode steps of such a quantizer can be replayed from a CUDA graph
        (suites/harness/dense_steps.py)."""
        return type(self).append is Quantizer.append

    def append_windowed(self, packed: Packed | None, x: torch.Tensor, group: int) -> Packed:
        """`append` for methods that quantize runs of `group` tokens cut at fixed
        positions 0, G, 2G, ... (KIVI's scheme): the newest tokens wait in an fp16
        window segment until `self.quantized_tokens(total)` (whole groups; the subclass
        says how many of `total` written tokens are quantized) reaches them, so a
        one-token decode write stores one fp16 token, not a one-token group, and
        token-by-token writes store exactly what one write stores."""
        if packed is None:
            packed = self.empty(x)
        self.check_input(x)
        self._check_compatible(packed, x)
        check_fp16_storable("K/V value", x)
        segs = list(packed.segments)
        # Every token is quantized from its fp16 value, whether it waited or not.
        pending = x.half().float()
        if segs and set(segs[-1].fields) == {WINDOW_FIELD}:
            pending = torch.cat([segs.pop().fields[WINDOW_FIELD].float(), pending], dim=2)
        done = sum(s.tokens for s in segs)  # already quantized: whole groups
        n_quant = self.quantized_tokens(done + pending.shape[2]) - done
        # A long write (a prefill) encodes its groups in one call where the format can
        # (`encode_groups`): a 32k-token prefill is 1024 groups, a Python loop of launches
        # per group on a GPU.
        split = self.encode_groups(pending[:, :, :n_quant], packed.shared, group) if n_quant > group else None
        if split is not None:
            segs.extend(split)
        else:
            for start in range(0, n_quant, group):
                segs.append(self._encode_segment(pending[:, :, start : start + group], packed.shared))
        if pending.shape[2] > n_quant:
            rest = pending[:, :, n_quant:]
            segs.append(Segment({WINDOW_FIELD: rest.half()}, rest.shape[2]))
        return dataclasses.replace(packed, segments=segs)

    def encode_groups(self, x: torch.Tensor, shared: dict, group: int) -> list[Segment] | None:
        """For `append_windowed`: the n whole groups of `group` tokens in x, encoded in one
        call, as the n one-group segments that encoding each group alone stores (bit for
        bit; views are fine), or None where the format cannot (the default: the groups
        are then encoded one by one)."""
        return None

    def merge_groups(self, segs: list[Segment]) -> Segment | None:
        """For `decode`: one segment whose decode is that of the consecutive quantized
        one-group segments `segs`, or None (the default: each decoded alone)."""
        return None

    def decode(self, packed: Packed) -> torch.Tensor:
        """Everything written so far, `[B, H, T, D]` in the dtype that was written.
        Raises CorruptPackedError for a Packed this quantizer cannot have written."""
        self.check_packed(packed)
        if not packed.segments:
            raise QuantizerInputError("decode of an empty packed cache")
        parts, segs, i = [], packed.segments, 0
        merges = type(self).merge_groups is not Quantizer.merge_groups
        while i < len(segs):
            j = i  # a run of undecoded quantized segments: decoded in one call where the format merges them
            while merges and j < len(segs) and self._mergeable(segs[j]):
                j += 1
            if j - i < 2:
                parts.append(self._decode_segment(packed, i, segs[i]))
                i += 1
                continue
            run = segs[i:j]
            for k, seg in enumerate(run, i):  # every stored segment passes the checks it would alone
                self._check_segment(packed, k, seg, (packed.batch, packed.heads, seg.tokens, packed.head_dim),
                                    finite=False)
            merged = self.merge_groups(run)
            if merged is None:
                for k, seg in enumerate(run, i):
                    self._check_fields_finite(packed, k, seg)
                    seg._decoded = self._decode_checked(packed, f"segment {k}", seg)
                    parts.append(seg._decoded)
            else:
                # The merged fields hold every byte of the run: one finiteness check (not one per
                # group and field, thousands of launches for a long prefill), and on failure the
                # message names the first segment and field at fault, as the check alone would.
                bad = sum(_non_finite(t) for t in merged.fields.values() if t.is_floating_point())
                # Bound now (the loop moves i on before a deferred check runs), and only the
                # stored fields: a queued factory holding the segments (or the Packed) would keep
                # their decoded copies, a dense history, alive until the flush.
                require(bad > 0, lambda first=i, fields=[s.fields for s in run], spec=packed.spec:
                        self._first_non_finite(spec, first, fields))
                out = self._decode_checked(packed, f"segments {i}-{j - 1}", merged)
                t = 0
                for seg in run:
                    seg._decoded, t = out[:, :, t : t + seg.tokens], t + seg.tokens
                parts.append(out)
            i = j
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    @staticmethod
    def _mergeable(seg) -> bool:
        return (isinstance(seg, Segment) and seg._decoded is None and isinstance(seg.tokens, int) and seg.tokens > 0
                and set(seg.fields) != {WINDOW_FIELD})

    def _decode_segment(self, packed: Packed, index: int, seg: Segment) -> torch.Tensor:
        if not isinstance(seg, Segment) or not isinstance(seg.tokens, int) or seg.tokens < 1:
            raise CorruptPackedError(f"segment {index} of a {packed.spec} cache is not a Segment of >= 1 tokens")
        if seg._decoded is None:
            self._check_segment(packed, index, seg, (packed.batch, packed.heads, seg.tokens, packed.head_dim))
            seg._decoded = self._decode_checked(packed, f"segment {index}", seg)
        return seg._decoded

    def _decode_checked(self, packed: Packed, what: str, seg: Segment) -> torch.Tensor:
        """`seg` decoded (its fields already checked), in the written dtype; a decode that
        fails, has the wrong shape or yields NaN/Inf from finite bytes is CorruptPackedError."""
        shape = (packed.batch, packed.heads, seg.tokens, packed.head_dim)
        where = f"{what} ({seg.tokens} tokens) of a {packed.spec} cache"
        try:
            if set(seg.fields) == {WINDOW_FIELD}:
                out = seg.fields[WINDOW_FIELD].float()
            else:
                out = self.decode_tokens(seg, packed.shared, shape)
        except QuantizerInputError:
            raise
        except (RuntimeError, LookupError, ValueError, TypeError) as e:
            # Fields of the right shapes can still hold values the format never
            # writes (a code past the codebook, outlier counts that disagree).
            raise CorruptPackedError(f"{where} does not decode ({type(e).__name__}: {e}); "
                                     "its stored bytes are corrupt") from e
        if tuple(out.shape) != shape:
            raise CorruptPackedError(f"{where} decodes to shape {tuple(out.shape)}, not {shape}")
        # Contiguous: a decode may be a transposed view (KIVI keys decode channel-major), and
        # SDPA's fused CUDA kernels need unit stride on the last axis: handed a transposed
        # history, a prefill fell back to the math path and its [B, Hq, T, T] float32 scores
        # (85.8 GiB peak at 32k tokens on the H200, call 23e).
        cast = out.to(packed.dtype).contiguous()
        n_dec, n_cast, dtype = _non_finite(out), _non_finite(cast), packed.dtype
        # (the factory must not capture `packed`: see `decode`'s merged check)
        require((n_dec + n_cast) > 0, lambda: CorruptPackedError(
            f"{where} decodes to {int(n_dec)} NaN/Inf values from finite stored bytes" if int(n_dec) else
            f"{where} overflows {dtype} with {int(n_cast)} NaN/Inf values from finite stored bytes"))
        return cast

    # ---- validation of what decode and append are given --------------------------------
    def check_packed(self, packed: Packed) -> None:
        """Raise CorruptPackedError unless `packed` is something this quantizer writes:
        its spec, shared tensors of the shapes and dtypes `make_shared` gives, and
        segments whose fields `_check_segment` accepts (checked when first decoded)."""
        if not isinstance(packed, Packed):
            raise QuantizerInputError(f"expected a Packed, got {type(packed).__name__}")
        if packed.spec != self.spec:
            raise CorruptPackedError(
                f"this cache was written by {packed.spec!r}; {self.spec!r} cannot read it "
                "(use the quantizer that wrote it)"
            )
        dims = (packed.batch, packed.heads, packed.head_dim)
        if not all(isinstance(n, int) and n > 0 for n in dims) or packed.dtype not in SUPPORTED_DTYPES:
            raise CorruptPackedError(f"packed cache of [B, H, D] = {dims}, dtype {packed.dtype} is not one "
                                     "a quantizer writes")
        expected = self._shared_layout(packed.heads, packed.head_dim)
        _compare_fields(packed.shared, expected, "shared tensors", variable=())
        for name, t in packed.shared.items():
            if t.is_floating_point():
                check_stored_finite(t, f"shared tensor {name!r}")

    def _check_segment(self, packed: Packed, index: int, seg: Segment, shape, finite: bool = True) -> None:
        """Fields of the names, shapes and dtypes this format stores for `shape`; and (`finite`)
        no NaN/Inf in a floating field."""
        where = f"segment {index} of a {packed.spec} cache"
        if set(seg.fields) == {WINDOW_FIELD}:
            expected = {WINDOW_FIELD: (shape, torch.float16)}
            variable = ()
        else:
            expected, variable = self.segment_layout(shape)
            if expected is None:
                raise CorruptPackedError(f"{where}: {self.spec} never stores a segment of {shape[2]} tokens "
                                         f"at [B, H, D] = {(shape[0], shape[1], shape[3])} ({variable})")
        _compare_fields(seg.fields, expected, where, variable)
        if finite:
            self._check_fields_finite(packed, index, seg)

    @staticmethod
    def _check_fields_finite(packed: Packed, index: int, seg: Segment) -> None:
        for name, t in seg.fields.items():
            if t.is_floating_point():
                check_stored_finite(t, f"segment {index} of a {packed.spec} cache, field {name!r},")

    @staticmethod
    def _first_non_finite(spec: str, first: int, run_fields: list[dict]) -> Exception:
        """The error `_check_fields_finite` raises for the first segment at fault of a run
        (segments first, first + 1, ... with these fields)."""
        for k, fields in enumerate(run_fields, first):
            for name, t in fields.items():
                n = int(_non_finite(t)) if t.is_floating_point() else 0
                if n:
                    return CorruptPackedError(f"segment {k} of a {spec} cache, field {name!r}, holds {n} "
                                              "NaN/Inf values: the stored bytes are corrupt")
        return CorruptPackedError(f"segments {first}-{first + len(run_fields) - 1} of a {spec} cache hold NaN/Inf "
                                  "values: the stored bytes are corrupt")

    # Field layouts {name: (shape, dtype)} per (class, spec, role, segment shape): learnt
    # from this process's own writes (free) or, for a shape never written here, from
    # encoding zeros of that shape once.
    _layouts: ClassVar[dict] = {}
    # Fields whose leading dimension depends on the values (a list of outliers): only
    # their dtype and trailing dims are checked. A plugin may declare them; they are
    # also found by encoding zeros and heavy-tailed data once per (spec, role, H, D).
    data_dependent_fields: ClassVar[tuple[str, ...]] = ()

    def _encode_segment(self, x: torch.Tensor, shared: dict) -> Segment:
        """`encode_tokens`, remembering the layout it stores for this shape."""
        seg = self.encode_tokens(x, shared)
        self.learn_layout(tuple(x.shape), seg)
        return seg

    def learn_layout(self, shape, seg: Segment) -> None:
        """Remember the fields a segment of `shape` (B, H, T, D) written by this process
        stores, what `segment_layout` checks later segments of that shape against; a second
        write of the shape with other lengths marks those fields data-dependent. Writers
        outside `encode_tokens` call it for their segments (the fused stores' device
        encoders, suites/harness/kv_cache.py): else the first read of every new prompt
        length encoded zeros of its whole shape on the host to learn it (a CPU, launches
        stubbed: most of a 32768-token write's 17 s (int4) / 97 s (HQMQ); an H100's decode
        benchmark prefilled 32768 x 8 tokens in 8.7 / 48 s against fp16's 2.0, 2026-12-06)."""
        if set(seg.fields) == {WINDOW_FIELD}:  # (a window of fp16 tokens: checked as such, not learnt)
            return
        key = self._layout_key("segment", tuple(shape))
        layout = {k: (tuple(t.shape), t.dtype) for k, t in seg.fields.items()}
        known = Quantizer._layouts.setdefault(key, layout)
        if known != layout:  # a second write of this shape stored other lengths: data-dependent
            self._variable(tuple(shape)).update(k for k in layout if layout[k] != known.get(k))

    def _layout_key(self, *parts):
        return (type(self), self.spec, self.role) + parts

    def _variable(self, shape) -> set[str]:
        key = self._layout_key("variable", shape[1], shape[3])
        if key not in Quantizer._layouts:
            found = set(self.data_dependent_fields)
            shared = self._reference_shared(shape[1], shape[3])
            # (one batch row of at most PROBE_TOKENS tokens: which fields' lengths follow
            # the values is a property of (H, D), and the probe runs on the host)
            shape = (1, shape[1], min(shape[2], PROBE_TOKENS), shape[3])
            try:
                zeros = self.encode_tokens(torch.zeros(shape), shared).fields
                g = torch.Generator().manual_seed(0)
                scale = torch.rand(shape, generator=g).pow(8).mul(100).add(0.1)  # heavy tails
                heavy = self.encode_tokens(torch.randn(shape, generator=g) * scale, shared).fields
                found |= {k for k in zeros if k in heavy and zeros[k].shape != heavy[k].shape}
            except (ValueError, RuntimeError):
                pass  # not a shape this format stores; the layout check says so
            Quantizer._layouts[key] = found
        return Quantizer._layouts[key]

    def segment_layout(self, shape):
        """({field: (shape, dtype)} a segment of `shape` = (B, H, T, D) stores, the names of
        its fields whose length depends on the data), or (None, why) for a shape this
        format never stores. Learnt from this process's writes, else by encoding zeros."""
        variable = self._variable(shape)
        key = self._layout_key("segment", tuple(shape))
        if key not in Quantizer._layouts:
            try:
                fields = self.encode_tokens(torch.zeros(shape), self._reference_shared(shape[1], shape[3])).fields
            except (ValueError, RuntimeError) as e:  # not a shape this format stores
                return None, str(e)
            Quantizer._layouts[key] = {k: (tuple(t.shape), t.dtype) for k, t in fields.items()}
        return Quantizer._layouts[key], variable

    def _reference_shared(self, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
        key = self._layout_key("shared", heads, head_dim)
        if key not in Quantizer._layouts:
            Quantizer._layouts[key] = self.make_shared(heads, head_dim)
        return Quantizer._layouts[key]

    def _shared_layout(self, heads: int, head_dim: int) -> dict:
        return {k: (tuple(t.shape), t.dtype) for k, t in self._reference_shared(heads, head_dim).items()}

    def _check_compatible(self, packed: Packed, x: torch.Tensor) -> None:
        if not isinstance(packed, Packed):
            raise QuantizerInputError(f"append to a {type(packed).__name__}, not a Packed")
        if packed.spec != self.spec:
            raise CorruptPackedError(
                f"append with {self.spec!r} to a cache written by {packed.spec!r}: one cache holds one format"
            )
        B, H, _, D = x.shape
        if (B, H, D) != (packed.batch, packed.heads, packed.head_dim):
            raise QuantizerInputError(
                f"append of shape {tuple(x.shape)} to a cache of [B={packed.batch}, "
                f"H={packed.heads}, D={packed.head_dim}]"
            )
        if x.dtype != packed.dtype:
            raise QuantizerInputError(f"append of {x.dtype} to a cache of {packed.dtype}")
        if x.device != packed.device:
            raise QuantizerInputError(f"append on {x.device} to a cache on {packed.device}")

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def _compare_fields(fields: dict, expected: dict, where: str, variable) -> None:
    """Names, dtypes and shapes of stored tensors against the format's."""
    if set(fields) != set(expected):
        raise CorruptPackedError(f"{where} holds fields {sorted(fields)}; the format stores {sorted(expected)}")
    for name, t in fields.items():
        shape, dtype = expected[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise CorruptPackedError(f"{where}: field {name!r} is {got}; the format stores {dtype}")
        ok = tuple(t.shape)[1:] == shape[1:] and t.dim() == len(shape) if name in variable \
            else tuple(t.shape) == shape
        if not ok:
            raise CorruptPackedError(f"{where}: field {name!r} has shape {tuple(t.shape)}; the format stores "
                                     f"{shape}" + (" (any length)" if name in variable else ""))


def _non_finite(t: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(t)).sum()


def check_stored_finite(t: torch.Tensor, where: str) -> None:
    """CorruptPackedError (queued under deferred_checks) when stored tensor t holds NaN/Inf."""
    n = _non_finite(t)
    require(n > 0, lambda: CorruptPackedError(f"{where} holds {int(n)} NaN/Inf values: the stored bytes are corrupt"))
