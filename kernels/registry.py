"""The fused formats and their kernels: the table `decode_attention` routes by.

A `Format` is everything the fused path needs of one quantizer's caches, in one
object: its `*Flat` type (what the kernels read) and `flatten`, the fields its
store keeps along the token axis (or its own `KernelStore` subclass: its append
rule), its device step encoder, and its kernels, one `Kernel` per backend with the
rule that backend takes a call by. Built-in formats are the `FORMAT` objects of the
modules in `kernels/formats/`; an installed package adds its own through the
`kvqbench.formats` entry point group (the entry point names a `Format`). Both are
found on first use, like quantizers, and a format that cannot be registered is left
out, named by `broken_formats()`, without taking the others down.

    FORMAT = Format(name="naive_int", quantizer=NaiveInt, flat=IntFlat, flatten=flatten_int,
                    token_fields=("codes", "scale", "zero"), step=encode_step,
                    kernels=(Kernel("triton", int_decode_attention), Kernel("cuda", ...)))

Backends (`register_backend`): "cuda" (tried first by backend="auto", q on a CUDA
device) and "triton" (any device: the CPU interpreter too). `register_kernel` adds a
kernel of some backend to a format already registered (another backend's kernel for
the built-in int4, say).

Neutral: this module imports no format, backend or front (kernels/FORMATS.md).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
import threading
import warnings
from typing import Any, Callable, Mapping

ENTRY_POINT_GROUP = "kvqbench.formats"
BUILTIN_PACKAGE = __name__.rpartition(".")[0] + ".formats"


@dataclasses.dataclass(frozen=True)
class Backend:
    """A family of kernels: `order` says which backend="auto" tries first (higher
    first), `device` the device type q must be on (None: any)."""
    name: str
    title: str
    order: int = 0
    device: str | None = None


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, title: str, order: int = 0, device: str | None = None) -> Backend:
    """Declare a backend kernels can be registered for (idempotent for equal arguments)."""
    b = Backend(name, title, order, device)
    if _BACKENDS.get(name, b) != b:
        raise ValueError(f"backend {name!r} is already registered as {_BACKENDS[name]}")
    _BACKENDS[name] = b
    return b


register_backend("cuda", "CUDA", order=10, device="cuda")
register_backend("triton", "Triton", order=0)


def backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def is_backend(name: str) -> bool:
    return name in _BACKENDS


def on_device(q, device: str | None) -> bool:
    """Whether q is on the device type a backend needs (None: any)."""
    if device is None:
        return True
    if device == "cuda":
        return bool(q.is_cuda)
    return q.device.type == device


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One backend's decode-attention kernel of a format: `fn(q, k, v, **options)`.

    What backend="auto" asks before it gives a call to this kernel, in this order (the
    first answer that is not None is the reason it does not):
    - q on the backend's device;
    - `auto(k)`: the switch a GPU run sets (why auto does not route this cache here, e.g.
      the format is not verified on a GPU yet; None: it does);
    - `options`: the launch options it takes (None: any); a call with others is not its;
    - `valid_len`: whether it takes a device valid length;
    - `row_start`: whether it takes per-row key starts (a left-padded batch: keys before
      row_start[b] masked for row b), and `row_start_auto()` why auto does not give it
      such calls yet (the switch a GPU run sets; None: it does);
    - `unsupported(q, k, v)`: why it cannot take this call's layout (must not build);
    - `why_unavailable()`: why it cannot run here at all (may build, once);
    - `fits(q, k, v)`: why this device cannot hold the instance the call would launch (its
      library loaded: e.g. a CTA's shared memory past an older GPU's limit; runs last).
    `renamed`: the front's option names this kernel knows by another name.
    `fast(q, k, v[, valid_len])`: optional, the eager fast route of a call with no options
    or row_start, when this is the first kernel auto tries and `auto(k)` routes the cache
    here: the result where the kernel keeps a plan made for exactly this call's layouts
    (and for a valid_len or not, as the call has one: a plan that passed every check above
    when it was made), None to let the route decide. valid_len is passed only where given
    and `valid_len` is True (the fast route checks the tensor itself, as the launch does)."""
    backend: str
    fn: Callable
    title: str = ""
    auto: Callable[[Any], str | None] | None = None
    options: frozenset | None = None
    valid_len: bool = True
    row_start: bool = False
    row_start_auto: Callable[[], str | None] | None = None
    unsupported: Callable[..., str | None] | None = None
    why_unavailable: Callable[[], str | None] | None = None
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fast: Callable[..., Any] | None = None
    fits: Callable[..., str | None] | None = None

    @property
    def name(self) -> str:
        """How messages name it: its title, else "<Backend> kernel"."""
        return self.title or f"{_BACKENDS[self.backend].title} kernel"

    def declines(self, q, k, v, options: Mapping, valid_len, row_start=None) -> str | None:
        """Why backend="auto" does not give this call to this kernel (None: it takes it)."""
        b = _BACKENDS[self.backend]
        if not on_device(q, b.device):
            return f"q is not on a {b.title} device"
        if self.auto is not None:
            why = self.auto(k)
            if why:
                return why
        if options and self.options is not None:
            foreign = set(options) - self.options
            if foreign:
                return f"launch options {', '.join(sorted(foreign))} are not the {self.name}'s"
        if valid_len is not None and not self.valid_len:
            return f"the {self.name} takes no valid_len (device lengths)"
        if row_start is not None:
            if not self.row_start:
                return f"the {self.name} takes no row_start (per-row key starts of a left-padded batch)"
            why = self.row_start_auto() if self.row_start_auto is not None else None
            if why:
                return why
        if self.unsupported is not None:
            why = self.unsupported(q, k, v)
            if why:
                return why
        if self.why_unavailable is not None:
            why = self.why_unavailable()
            if why:
                return why
        return self.fits(q, k, v) if self.fits is not None else None


    def refusal(self, q, k, v) -> str | None:
        """Why this kernel cannot run this call here when asked for by name (None: it can):
        its library does not build or load here, q is on another device, or it does not
        take the layout. (Not the auto switch: an opt-in call runs what auto keeps off.)"""
        why = self.why_unavailable() if self.why_unavailable is not None else None
        if why:
            return why
        b = _BACKENDS[self.backend]
        if not on_device(q, b.device):
            return f"q is not on a {b.title} device"
        why = self.unsupported(q, k, v) if self.unsupported is not None else None
        if why:
            return why
        return self.fits(q, k, v) if self.fits is not None else None


@dataclasses.dataclass(eq=False)
class Format:
    """One fused format (see the module docstring).

    - `quantizer`: the quantizer class whose caches it reads; subclasses inherit it
      (the nearest class in the MRO with a format), but only `quantizer` itself gets the
      step encoder (a subclass may encode differently).
    - `flat`: its `*Flat` type(s) (the first is what `flatten` returns; more for views,
      e.g. KIVI's graph view); `flatten(packed, role=None, **options)` builds one.
    - `token_fields`: Segment fields along the token axis, `[B, H, t, ...]`: what the
      generic `KernelStore` keeps in growable buffers (its Flat then has fields of those
      names and a valid length `T`); `store`: a `KernelStore` subclass with the format's
      own append rule instead (None: `KernelStore`).
    - `step(store, x, errors, t0, pos=None, **extra)`: the device step encoder: writes a
      one-token write x into the store's buffers at token t0, or at the device position
      `pos` (CUDA graphs); None: decode steps take the quantizer's own write.
    - `multi_step`: whether `step` also takes a t-token write x `[B, H, t, D]` at t0 in
      one launch (KIVI: two, its window and its groups), storing exactly what t
      one-token steps store (no per-write state; what a quantizer fits on its first write,
      fp8's scale, is fitted before the write by `Quantizer.empty_for` and refitted in place
      after a rewind, `KernelStore.refit`; a window whose flushes follow from the token
      count is fine, KIVI's), or exactly what
      the quantizer's own write of them stores (HQMQ + Med3x: its median over the write,
      two launches, `hqmq_med3_write`): a bool, or a
      callable of the quantizer (the store's stepper) saying it per config. Such a fused
      cache's multi-token writes (a prefill) are encoded on the device too
      (`KernelStore.create_empty`, `steps`).
    - `configure(flat, **options)`: a flat the store should hold instead (HQMQ: the
      codeword table the kernel gathers from); None: as flattened.
    - `kernels`: its decode-attention kernels, one per backend.
    - `device_encoder(q) -> Quantizer`: a copy of quantizer q whose multi-token writes
      (a prefill) run on device kernels, storing the same fields (codes may differ only
      at exact ties of the search); a fused cache on CUDA writes through it. None: q.
    - `bench`: label -> spec the benchmarks time for this format ("int4": "int4")."""
    name: str
    quantizer: type
    flat: Any
    flatten: Callable
    kernels: tuple = ()
    token_fields: tuple = ()
    store: type | None = None
    step: Callable | None = None
    multi_step: Callable[[Any], bool] | bool = False
    configure: Callable | None = None
    device_encoder: Callable | None = None
    bench: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.flat = tuple(self.flat) if isinstance(self.flat, (tuple, list)) else (self.flat,)
        self.kernels = tuple(self.kernels)
        self.token_fields = tuple(self.token_fields)
        self.bench = dict(self.bench)
        self._order = (None, (), {})  # (the kernels tuple it was made from, ordered, by_backend)

    def _table(self):
        if self._order[0] is not self.kernels:  # (made again when `kernels` is replaced)
            known = sorted((k for k in self.kernels if k.backend in _BACKENDS),
                           key=lambda k: -_BACKENDS[k.backend].order)
            self._order = (self.kernels, tuple(known), {k.backend: k for k in known})
        return self._order

    @property
    def ordered(self) -> tuple:
        """Its kernels in the order backend="auto" tries them (the backends' order)."""
        return self._table()[1]

    @property
    def by_backend(self) -> dict:
        return self._table()[2]

    @property
    def stores(self) -> bool:
        """Whether a `KernelStore` can hold this format's caches."""
        return self.store is not None or bool(self.token_fields)

    def encodes_steps_of(self, quantizer_cls) -> bool:
        """Whether the step encoder reproduces this quantizer class's writes (its own class only)."""
        return self.step is not None and quantizer_cls is self.quantizer


@dataclasses.dataclass(frozen=True)
class BrokenFormat:
    """A format left out of the registry, and why (the others keep working)."""
    origin: str
    error: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.error}"


_lock = threading.RLock()
_formats: dict[str, Format] | None = None
_by_flat: dict[type, Format] = {}
_by_quantizer: dict[type, Format] = {}
_broken: list[BrokenFormat] = []
_added: list[tuple[str, Kernel]] = []  # register_kernel calls, kept across refreshes


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _unusable(fmt) -> str | None:
    if not isinstance(fmt, Format):
        return f"{fmt!r} is not a kvqbench.kernels.registry.Format"
    if not isinstance(fmt.name, str) or not fmt.name:
        return "a format needs a name"
    if not isinstance(fmt.quantizer, type):
        return f"format {fmt.name!r}: quantizer {fmt.quantizer!r} is not a class"
    if not fmt.flat or not all(isinstance(t, type) for t in fmt.flat):
        return f"format {fmt.name!r}: flat must be the Flat type(s)"
    if not callable(fmt.flatten):
        return f"format {fmt.name!r}: flatten is not callable"
    for k in fmt.kernels:
        if not isinstance(k, Kernel) or not callable(k.fn):
            return f"format {fmt.name!r}: {k!r} is not a Kernel"
        if k.backend not in _BACKENDS:
            return f"format {fmt.name!r}: unknown backend {k.backend!r} (known: {', '.join(sorted(_BACKENDS))})"
    if len({k.backend for k in fmt.kernels}) != len(fmt.kernels):
        return f"format {fmt.name!r}: two kernels of one backend"
    return None


def formats(refresh: bool = False) -> dict[str, Format]:
    """name -> Format, built-ins first, then entry-point plugins (found once)."""
    global _formats, _broken
    if _formats is not None and not refresh:
        return _formats
    with _lock:
        if _formats is not None and not refresh:
            return _formats
        found: dict[str, Format] = {}
        by_flat: dict[type, Format] = {}
        by_q: dict[type, Format] = {}
        broken: list[BrokenFormat] = []

        def add(fmt, origin: str, builtin: bool) -> None:
            why = _unusable(fmt)
            if why is None:
                taken = [f"name {fmt.name!r}"] if fmt.name in found else []
                taken += [f"{t.__name__}" for t in fmt.flat if t in by_flat]
                taken += [f"quantizer {fmt.quantizer.__name__}"] if fmt.quantizer in by_q else []
                if taken:
                    why = f"{', '.join(taken)} already taken; format {fmt.name!r} left out"
            if why:
                if builtin:
                    raise RuntimeError(f"format {origin}: {why}")
                broken.append(BrokenFormat(origin, why))
                return
            found[fmt.name] = fmt
            by_flat.update({t: fmt for t in fmt.flat})
            by_q[fmt.quantizer] = fmt

        pkg = importlib.import_module(BUILTIN_PACKAGE)
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            origin = f"module {BUILTIN_PACKAGE}.{info.name}"
            try:  # (e.g. no Triton here: the dense path serves every cache then)
                mod = importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}")
            except Exception as e:  # noqa: BLE001 (one broken file must not take every format down)
                broken.append(BrokenFormat(origin, _one_line(e)))
                continue
            if hasattr(mod, "FORMAT"):
                add(mod.FORMAT, origin, builtin=True)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            origin = f"entry point {ep.name} = {ep.value}"
            try:
                fmt = ep.load()
            except Exception as e:  # noqa: BLE001 (an installed plugin that fails to import)
                broken.append(BrokenFormat(origin, _one_line(e)))
                continue
            add(fmt, origin, builtin=False)
        for name, kernel in _added:
            if name in found:
                _attach(found[name], kernel)
        _by_flat.clear()
        _by_flat.update(by_flat)
        _by_quantizer.clear()
        _by_quantizer.update(by_q)
        _formats, _broken = found, broken
    for b in broken:
        warnings.warn(f"kvqbench: fused format skipped: {b}", RuntimeWarning, stacklevel=2)
    return found


def _attach(fmt: Format, kernel: Kernel) -> None:
    fmt.kernels = tuple(k for k in fmt.kernels if k.backend != kernel.backend) + (kernel,)


def register_kernel(format_name: str, kernel: Kernel) -> None:
    """Give a registered format a kernel of some backend (replacing its kernel of that
    backend): a backend declares itself for formats it did not define."""
    if kernel.backend not in _BACKENDS:
        raise ValueError(f"unknown backend {kernel.backend!r}: register_backend it first")
    table = formats()
    if format_name not in table:
        raise KeyError(f"no fused format {format_name!r}; known: {', '.join(sorted(table))}")
    with _lock:
        _added.append((format_name, kernel))
        _attach(table[format_name], kernel)


def broken_formats() -> list[BrokenFormat]:
    """Formats skipped by the last registry build (see `BrokenFormat`)."""
    formats()
    return list(_broken)


def format_of_flat(flat_type: type) -> Format | None:
    """The format whose kernels read this `*Flat` type (exactly this type), or None."""
    if _formats is None:
        formats()
    return _by_flat.get(flat_type)


def format_of_quantizer(cls: type) -> Format | None:
    """The format of a quantizer class: its own, else that of the nearest class in its
    MRO that has one (a subclass under another name reads as its parent); None: no
    fused kernel reads its caches."""
    if _formats is None:
        formats()
    for c in cls.__mro__:
        if c in _by_quantizer:
            return _by_quantizer[c]
    return None


def bench_specs() -> dict[str, str]:
    """label -> quantizer spec of every format's benchmark rows (`Format.bench`), in
    registry order: what the benchmarks time by default."""
    out: dict[str, str] = {}
    for fmt in formats().values():
        for label, spec in fmt.bench.items():
            out.setdefault(label, spec)
    return out


__all__ = ["Backend", "BrokenFormat", "ENTRY_POINT_GROUP", "Format", "Kernel", "backends", "bench_specs",
           "broken_formats", "format_of_flat", "format_of_quantizer", "formats", "is_backend", "on_device",
           "register_backend", "register_kernel"]
