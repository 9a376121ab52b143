"""What one latency run measures: methods, shapes and limits, in one dataclass.

`LatencyConfig.full()` is the GPU run (Llama-3-8B attention shapes); `smoke()`
is the same plumbing at tiny shapes, which runs on the CPU through the Triton
interpreter. Everything a section reads comes from here, nothing from argparse.

The fused methods are every registered format's benchmark specs (`fused-<label>`,
kernels/registry.py `bench_specs`, plugins' formats included): read when first asked
for (`FUSED_SPECS`, `METHOD_SPECS`), so importing this module imports no kernels (the
command line sets TRITON_INTERPRET first on a CPU).
"""
from __future__ import annotations

import dataclasses

FAKE_QUANT_SPEC = "hqmq:S=96,r=4,outliers=med3"


def fused_specs() -> dict[str, str]:
    """method name -> quantizer spec of its packed cache (fp16-sdpa needs none)."""
    from ....kernels import registry

    return {f"fused-{label}": spec for label, spec in registry.bench_specs().items()}


def __getattr__(name: str):
    if name == "FUSED_SPECS":
        return fused_specs()
    if name == "METHOD_SPECS":
        return {**fused_specs(), "fake-quant": FAKE_QUANT_SPEC}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ENCODE_SPECS = ("hqmq:S=96,r=4", "hqmq:S=96,r=4,outliers=med3")
MEMORY_SPECS = ("fp16", "int4", "int2", "kivi:bits=4", "kivi:bits=2", "hqmq:S=24,r=3", "hqmq:S=96,r=4",
                "hqmq:S=24,r=3,outliers=med3", "hqmq:S=96,r=4,outliers=med3")
# The memory section's projection: computed from this config, never measured on the model.
PROJECTION = {"model": "Llama-3-70B", "layers": 80, "kv_heads": 8, "head_dim": 128, "tokens": 131072}
# Launch config where none is tuned: the kernels' own defaults (set from the H200
# sweeps in kernels/), so an untuned run measures the kernels as shipped.
DEFAULT_LAUNCH: dict = {}


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
    hq: int  # query heads
    hkv: int  # KV heads
    d: int  # head dim
    t0: int  # tokens really encoded; larger caches tile them (a multiple of 64)
    tokens: tuple[int, ...]  # cached tokens T measured
    batches: tuple[int, ...]  # batch sizes B measured
    focus: tuple[int, int]  # (B, T) where the targets are checked and the kernels tuned
    encode_tokens: int  # tokens of the encode-throughput input
    memory_tokens: int  # tokens of the memory figure (its slope is measured between half and all)
    copy_bytes: int  # bytes of the device-to-device copy that sets the bandwidth yardstick
    budget_s: float = 400.0  # no new (B, T) shape starts after this many seconds
    tune: bool = True  # tune the launch config at the focus shape (GPU only)
    encode: bool = True  # run the encode-throughput section
    memory: bool = True  # run the memory section
    fp16_max_bytes: int = 80 << 30  # fp16 K+V larger than this are not allocated
    fake_max_token_heads: int = 4 << 20  # torch decode temporaries ~10 KB per token-head

    def __post_init__(self):
        if self.hq % self.hkv:
            raise ValueError(f"query heads {self.hq} must be a multiple of KV heads {self.hkv}")
        if self.t0 % 64:
            raise ValueError(f"encoded tokens t0={self.t0} must be a multiple of 64 (tiling along tokens)")
        if self.focus[0] not in self.batches or self.focus[1] not in self.tokens:
            raise ValueError(f"focus {self.focus} is not among batches {self.batches} x tokens {self.tokens}")

    @classmethod
    def full(cls, **overrides) -> "LatencyConfig":
        """The GPU run: Hq 32, Hkv 8, d 128; T in {4k, 16k, 32k, 128k}; B in {1, 8, 32}."""
        return cls(**{**dict(hq=32, hkv=8, d=128, t0=4096, tokens=(4096, 16384, 32768, 131072), batches=(1, 8, 32),
                               focus=(8, 32768), encode_tokens=32768, memory_tokens=4096, copy_bytes=4 << 30),
                      **overrides})

    @classmethod
    def smoke(cls, **overrides) -> "LatencyConfig":
        """Tiny shapes that exercise every code path on the CPU (Triton interpreter)."""
        return cls(**{**dict(hq=4, hkv=2, d=64, t0=256, tokens=(256, 512), batches=(1, 2), focus=(2, 512),
                               encode_tokens=256, memory_tokens=256, copy_bytes=1 << 20),
                      **overrides})

    @property
    def shape(self) -> dict:
        """The shape block of the report."""
        return {"Hq": self.hq, "Hkv": self.hkv, "d": self.d, "encoded_tokens": self.t0}

    def combos(self) -> list[tuple[int, int]]:
        """(B, T) in measuring order: the focus first (where tuning happens), then by B, T."""
        return sorted(((b, t) for b in self.batches for t in self.tokens),
                      key=lambda c: (c != self.focus, c[0], c[1]))
