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

A plugin implements `encode_tokens` / `decode_tokens` for one run of tokens
(float32 in, float32 out) and `formula_bits`; it overrides `append` only when
its state spans writes (KIVI's fp16 window and token groups).
"""
from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

FP16_MAX = 65504.0
ROLES = ("K", "V")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QuantizerInputError(ValueError):
    """Bad input to a quantizer: the message names the problem."""


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
        return sum(self.nbytes_by_field().values())

    @property
    def bits_per_element(self) -> float:
        """Measured: every stored byte x 8 / number of K/V elements."""
        return self.nbytes * 8 / self.numel if self.numel else float("nan")

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


def check_fp16_storable(name: str, t: torch.Tensor) -> None:
    """Values stored as fp16 must fit: silently storing inf would decode garbage."""
    if t.numel() and float(t.abs().max()) > FP16_MAX:
        raise QuantizerInputError(
            f"{name} of magnitude {float(t.abs().max()):.4g} overflows the fp16 the cache stores "
            f"(max {FP16_MAX}); rescale the input"
        )


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
        if not torch.isfinite(x).all():
            bad = (~torch.isfinite(x)).sum().item()
            raise QuantizerInputError(f"input has {bad} NaN/Inf values; a cache cannot store them")

    def empty(self, like: torch.Tensor) -> Packed:
        B, H, _, D = like.shape
        shared = {k: v.to(like.device) for k, v in self.make_shared(H, D).items()}
        return Packed(B, H, D, like.dtype, like.device, [], shared, self.spec)

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
        seg = self.encode_tokens(x.float(), packed.shared)
        return dataclasses.replace(packed, segments=packed.segments + [seg])

    def decode(self, packed: Packed) -> torch.Tensor:
        """Everything written so far, `[B, H, T, D]` in the dtype that was written."""
        if not packed.segments:
            raise QuantizerInputError("decode of an empty packed cache")
        parts = [self._decode_segment(packed, s) for s in packed.segments]
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def _decode_segment(self, packed: Packed, seg: Segment) -> torch.Tensor:
        if seg._decoded is None:
            shape = (packed.batch, packed.heads, seg.tokens, packed.head_dim)
            seg._decoded = self.decode_tokens(seg, packed.shared, shape).to(packed.dtype)
        return seg._decoded

    def _check_compatible(self, packed: Packed, x: torch.Tensor) -> None:
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
