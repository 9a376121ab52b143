"""Device-position decode steps of a DENSE layer: any quantizer's one-token write, graphable.

A fused layer's decode steps are encoded by device kernels at a position read from the
cache's device counter (kernels/store.py), so the whole step can be captured in a CUDA
graph (kernels/graphs.py). A dense layer (no fused kernel reads its format: fp16,
spherical, additive / flat VQ, Hadamard int, ...) takes the same kind of step whenever its
quantizer's one-token write is ONE segment of fixed field shapes computed by tensor ops
alone. The step runs the quantizer's own `encode_tokens` and `decode` (the code the host
path runs, not a copy) on the token, writes each stored field into a preallocated buffer
at row (position - first position) and the decoded token into the layer's decoded
history at the position; attention reads the history's reserved rows under a mask of the
device valid length (padding.masked_attention). Nothing in it is a host value, so it is
captured and replayed. On CUDA, spherical (TurboQuant), additive VQ and flat VQ take a
device encoder instead (`device_encoder`, `KERNELS`: kernels/spherical_step.py,
kernels/vq_step.py): one Triton launch per layer and role that stores the same bytes and
writes the same decoded token, where the torch code replays 170-576 aten ops; a prefill's
encode (after the quantizer's fit) goes through the same kernels (`segment_writer`).

Not graphable (`unsupported` names why): an `append` that keeps state across writes
(`Quantizer.appends_one_segment`: KIVI's windows, per-channel int keys), fields whose
length depends on the data (Med3x's outlier list), and, on CUDA, an encode or decode that
synchronises with the host (`probe`: one write under torch's sync debug mode, which does not
see every synchronising op; one it misses makes the capture fail, and GraphedDecodeStep
then runs the steps uncaptured and names the reason).

The stored bytes are those of the host path: the run's Segments (one per step, views of
the field buffers) hold the fields `append` would have stored, so `Packed.nbytes` stays
the one source of measured bits. Value checks inside a step are sticky
(quantizers/checks.py `StickyChecks`): each replay ORs its verdicts into device flags,
read when the layer's Packed is next read.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from ...kernels import spherical_step, vq_step
from ...kernels.step_encode import TablesStep, overflow_error
from ...kernels.store import TokenBuffer
from ...quantizers import Packed, Segment
from ...quantizers.base import WINDOW_FIELD, Quantizer, QuantizerInputError
from ...quantizers.checks import StickyChecks


def unsupported(q: Quantizer, packed: Packed) -> str | None:
    """Why `q`'s one-token writes to `packed` cannot be device-position steps (None: they
    can, unless `probe` finds a host synchronisation on CUDA). Host only."""
    if not q.appends_one_segment():
        return f"{q.spec} {q.role}: its append keeps state across writes (windows / groups of tokens)"
    layout, variable = q.segment_layout((packed.batch, packed.heads, 1, packed.head_dim))
    if layout is None:
        return f"{q.spec} {q.role}: no one-token segment ({variable})"
    if variable:
        return (f"{q.spec} {q.role}: a write's {', '.join(sorted(variable))} has a data-dependent length "
                "(the buffers a graph holds have fixed shapes)")
    if WINDOW_FIELD in layout:
        return f"{q.spec} {q.role}: a one-token write is kept as an fp16 window"
    return None


def code_one_token(q: Quantizer, x: torch.Tensor, packed: Packed) -> tuple[dict, torch.Tensor]:
    """(stored fields, decoded token) of the one-token write x to `packed`, through the
    quantizer: what `append` stores and what `decode` of that segment gives."""
    q.check_input(x)
    fields = q.encode_tokens(x.float(), packed.shared).fields
    return fields, q.decode(dataclasses.replace(packed, segments=[Segment(fields, 1)]))


def probe(q: Quantizer, packed: Packed, decoded: TokenBuffer) -> str | None:
    """On CUDA: one write's quantizer work on the last token held, under torch's sync debug
    mode; the host synchronisation it finds (a graph cannot hold one), or None. Writes
    nothing. Elsewhere None (no capture there). Once per format, role and write shape in
    a process (`PROBED`): the answer is the code path's, the same at every layer and seed,
    and a probe write costs an eager step's launches for its layer (60 per row of a
    30-layer model, each row of a compare building a new cache)."""
    if decoded.buf.device.type != "cuda":
        return None
    key = (type(q), q.spec, q.role, packed.batch, packed.heads, packed.head_dim, packed.dtype, str(packed.device))
    if key in PROBED:
        return PROBED[key]
    x = decoded.valid[:, :, -1:]
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    why = None
    try:
        with StickyChecks("probe").step():
            code_one_token(q, x, packed)
    except RuntimeError as e:
        why = f"{q.spec} {q.role}: a one-token write synchronises with the host ({str(e)[:200]})"
    finally:
        torch.cuda.set_sync_debug_mode(before)
    PROBED[key] = why
    return why


PROBED: dict = {}  # (quantizer class, spec, role, batch, heads, head_dim, dtype, device) -> probe's answer

# Dense formats whose writes a device kernel encodes, by quantizer name: the module whose
# `Tables` the kernel reads and whose `unsupported` says where it cannot (kernels/
# spherical_step.py, kernels/vq_step.py). A decode step is then one launch where the torch
# path replays its encode and decode op by op (spherical 170-330 aten ops per layer and step,
# avq / flat VQ 196-576).
KERNELS = {"spherical": (spherical_step, spherical_step.SphericalTables),
           "avq": (vq_step, vq_step.VQTables), "flatvq": (vq_step, vq_step.VQTables)}

# Decode steps through those kernels: on CUDA ("cuda"); "always" also on the CPU (the Triton
# interpreter: tests); "never".
DEVICE_ENCODERS = "cuda"

# Multi-token writes (a prefill) through the same kernels, after the quantizer's own fit:
# on CUDA ("cuda"); "always" also on the CPU (tests); "never".
SEGMENT_ENCODERS = "cuda"

ENCODER_FALLBACKS: dict = {}  # (spec, role) -> why its step kernel gave way to the torch path in this process


def _wanted(setting: str, device: torch.device) -> bool:
    return setting == "always" or (setting == "cuda" and device.type == "cuda")


def segment_writer(q: Quantizer, device: torch.device, cache: dict, role: str):
    """The quantizer a dense layer's multi-token write goes through: `q` whose encode is
    the device kernel (one launch for the write's fields), or None (q itself). Made once
    per role into `cache`."""
    if q.name not in KERNELS or not _wanted(SEGMENT_ENCODERS, device):
        return None
    key = ("dense", role)
    if key not in cache:
        cache[key] = KERNELS[q.name][0].kernel_quantizer(q)
    return cache[key]


def device_encoder(q: Quantizer, packed: Packed, fields: dict, checks: StickyChecks):
    """The device encoder of q's one-token writes into `fields` (None: the torch path),
    its flags watched by `checks`."""
    module, tables = KERNELS.get(q.name, (None, None))
    if module is None or module.unsupported(q, packed.head_dim):
        return None
    made = tables(q, packed.shared, packed.head_dim, packed.batch, packed.device)
    flags = torch.zeros(2, dtype=torch.int32, device=packed.device)
    checks.watch(flags[0], lambda: QuantizerInputError("input has NaN/Inf values; a cache cannot store them"))
    checks.watch(flags[1], lambda: overflow_error(made))
    return TablesStep(made, packed.heads, fields, flags)


class DenseSteps:
    """Device-position one-token writes of one (layer, role) of a dense layer, for
    positions `base` .. `reserved - 1` (`base`: the tokens held when it was made)."""

    def __init__(self, q: Quantizer, packed: Packed, decoded: TokenBuffer, reserved: int, where: str):
        self.q, self.decoded, self.base = q, decoded, packed.tokens
        layout, _ = q.segment_layout((packed.batch, packed.heads, 1, packed.head_dim))
        rows = reserved - self.base
        self.fields = {name: torch.empty((rows,) + shape, dtype=dtype, device=packed.device)
                       for name, (shape, dtype) in layout.items()}
        decoded.ensure(reserved)  # before any capture: the graph holds its address
        # Rows past the valid length are masked out of the scores, but a masked row still
        # meets V in the weighted sum (0 x NaN = NaN): the uninitialised rows must be finite.
        with torch.inference_mode(decoded.buf.is_inference()):
            decoded.buf[:, :, decoded.length:].zero_()
        self.checks = StickyChecks(where)
        self.encoder, self.encoded = None, False
        if _wanted(DEVICE_ENCODERS, packed.device):
            self.encoder = device_encoder(q, packed, self.fields, self.checks)
        self.run_start = self.run_end = self.base  # positions of the steps not yet folded, [start, end)

    def step_at(self, x: torch.Tensor, pos: torch.Tensor, packed: Packed) -> None:
        """Write token x `[B, H, 1, D]` at device position `pos` (int32 `[1]`); no host state
        changes (`advance` accounts for it)."""
        if self.encoder is not None:  # one launch: the torch path's bytes (device_encoder)
            try:
                self.encoder(x if x.stride(-1) == 1 else x.contiguous(), pos, self.base, self.decoded.buf)
                self.encoded = True
                return
            except (CompilationError, OutOfResources) as e:  # this GPU cannot build the kernel: the torch path
                if self.encoded:  # (a compile happens at the first call, a warm-up before any capture)
                    raise
                why = f"{self.q.spec} {self.q.role}: its step kernel does not build here ({type(e).__name__}: " \
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); the torch path writes its steps"
                ENCODER_FALLBACKS[(self.q.spec, self.q.role)] = why
                warnings.warn(why)
                self.encoder = None
        with self.checks.step():
            fields, dec = code_one_token(self.q, x, packed)
        if set(fields) != set(self.fields):
            raise RuntimeError(f"{self.q.spec} {self.q.role}: a one-token write stored fields {sorted(fields)}, "
                               f"not the {sorted(self.fields)} its layout learnt")
        row = (pos - self.base).long()
        for name, t in fields.items():
            self.fields[name].index_copy_(0, row, t.unsqueeze(0))
        self.decoded.buf.index_copy_(2, pos.long(), dec)

    def advance(self, tokens_before: int, n: int) -> None:
        """Host bookkeeping of n steps that ran after `tokens_before` tokens."""
        if self.run_end != tokens_before:  # a host-path write came between: a new run
            self.run_start = self.run_end = tokens_before
        self.run_end += n
        self.decoded.length = self.run_end

    @property
    def in_run(self) -> bool:
        return self.run_end > self.run_start

    def run_segments(self, base: list[Segment]) -> list[Segment]:
        """`base` (the Packed's segments when the run began), then one Segment per step of
        the run: views of the field buffers (as `KernelStore.run_segments`)."""
        rows = range(self.run_start - self.base, self.run_end - self.base)
        return base + [Segment({name: f[i] for name, f in self.fields.items()}, 1) for i in rows]

    def end_run(self) -> None:
        self.run_start = self.run_end

    def buffers(self) -> list[torch.Tensor]:
        return [self.decoded.buf, *self.fields.values(), *self.checks.flags, *(f for f, _ in self.checks.watched)]


__all__ = ["DEVICE_ENCODERS", "ENCODER_FALLBACKS", "KERNELS", "PROBED", "SEGMENT_ENCODERS", "DenseSteps",
           "code_one_token", "device_encoder", "probe", "segment_writer", "unsupported"]
