"""Quantizer plugins and their registry.

Every module in this folder that defines a `Quantizer` subclass with a `name`
is registered on first use; out-of-tree quantizers register through the
`kvqbench.quantizers` entry point group (the entry point names a Quantizer
subclass). Both are found, listed and put through every suite the same way.

    get_quantizer("hqmq:S=96,r=4,outliers=med3", layer=0, role="K", seed=0)
    get_quantizer("int4")            # an alias: naive int with bits=4
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import pkgutil
import typing
import warnings

from .base import CorruptPackedError, Packed, Quantizer, QuantizerInputError, Segment

ENTRY_POINT_GROUP = "kvqbench.quantizers"
_registry: dict[str, type[Quantizer]] | None = None
_alias_table: dict[str, tuple[type[Quantizer], dict]] | None = None
_broken: list["BrokenPlugin"] = []


@dataclasses.dataclass(frozen=True)
class BrokenPlugin:
    """A plugin left out of the registry, and why: a module or entry point whose import
    raised, a class that is abstract or not a Quantizer, or a name or alias that another
    plugin (a built-in first) already holds. Every other quantizer keeps working."""
    origin: str  # "module kvqbench.quantizers.x", "entry point name = pkg:Class", ...
    error: str  # one line
    names: tuple[str, ...] = ()  # the spec names it would have answered to

    def __str__(self) -> str:
        return f"{self.origin}: {self.error}"


def broken_plugins() -> list[BrokenPlugin]:
    """Plugins skipped by the last registry build (see `BrokenPlugin`)."""
    registry()
    return list(_broken)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _unusable(cls) -> str | None:
    if not (isinstance(cls, type) and issubclass(cls, Quantizer)):
        return f"{cls!r} is not a Quantizer subclass"
    if inspect.isabstract(cls):
        return f"{cls.__name__} is abstract (does not implement {', '.join(sorted(cls.__abstractmethods__))})"
    if not isinstance(vars(cls).get("name", getattr(cls, "name", None)), str):
        return f"{cls.__name__} has no `name`"
    # Checked here, not at first use: the registry reads `aliases` while it is built (a
    # list there took every quantizer down), and `kvqbench list` parses every alias.
    if not dataclasses.is_dataclass(getattr(cls, "Config", None)):
        return f"{cls.__name__}.Config is not a dataclass"
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    aliases = cls.aliases
    if not isinstance(aliases, dict) or not all(isinstance(a, str) and isinstance(kw, dict)
                                                for a, kw in aliases.items()):
        return f"{cls.__name__}.aliases must map names to dicts of Config values, got {aliases!r}"[:300]
    for a, kw in aliases.items():
        if set(kw) - fields:
            return f"{cls.__name__}.aliases[{a!r}] sets {sorted(set(kw) - fields)}, not fields of its Config"
    return None


def _subclasses_in(module) -> list[type[Quantizer]]:
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, Quantizer)
        and obj.__module__ == module.__name__
        and "name" in vars(obj)
    ]


def registry(refresh: bool = False) -> dict[str, type[Quantizer]]:
    """name -> Quantizer class, for built-in and entry-point plugins. A plugin that cannot
    be loaded, or whose name or alias is already taken, is left out with a warning and
    listed by `broken_plugins()`; built-ins are registered first, so a plugin never
    replaces one. Two built-ins claiming one name is a bug of this package and raises."""
    global _registry, _alias_table, _broken
    if _registry is not None and not refresh:
        return _registry
    found: dict[str, type[Quantizer]] = {}
    aliases: dict[str, tuple[type[Quantizer], dict]] = {}
    broken: list[BrokenPlugin] = []
    owner: dict[str, str] = {}  # name or alias -> who holds it

    def add(cls, origin: str, builtin: bool, asked_as: tuple[str, ...] = ()) -> None:
        why = _unusable(cls)
        if why:  # named by what a user would ask for: the entry point's and the class's names
            own = getattr(cls, "name", None)
            broken.append(BrokenPlugin(origin, why, asked_as + ((own,) if isinstance(own, str) else ())))
            return
        claims = [cls.name] + [a for a in cls.aliases if a != cls.name]
        if found.get(cls.name) is cls:
            return
        taken = [c for c in claims if c in owner]
        if taken:
            msg = (f"{', '.join(map(repr, taken))} already taken by {', '.join(sorted({owner[c] for c in taken}))}; "
                   f"{cls.__name__} left out")
            if builtin:
                raise RuntimeError(f"quantizer {origin}: {msg}")
            broken.append(BrokenPlugin(origin, msg, tuple(claims)))
            return
        found[cls.name] = cls
        for c in claims:
            owner[c] = origin
        aliases.update({a: (cls, kw) for a, kw in cls.aliases.items()})

    for info in pkgutil.iter_modules(__path__):  # shared modules simply define no plugin
        origin = f"module {__name__}.{info.name}"
        try:
            mod = importlib.import_module(f"{__name__}.{info.name}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 (one broken file must not take every quantizer down)
            broken.append(BrokenPlugin(origin, _one_line(e), (info.name,)))
            continue
        for cls in _subclasses_in(mod):
            add(cls, f"{origin} ({cls.__name__})", builtin=True)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        origin = f"entry point {ep.name} = {ep.value}"
        try:
            cls = ep.load()
        except (Exception, SystemExit) as e:  # noqa: BLE001 (an installed plugin that fails to import, or exits)
            broken.append(BrokenPlugin(origin, _one_line(e), (ep.name,)))
            continue
        add(cls, origin, builtin=False, asked_as=(ep.name,))
    _registry, _alias_table, _broken = found, aliases, broken
    for b in broken:
        warnings.warn(f"kvqbench: quantizer plugin skipped: {b}", RuntimeWarning, stacklevel=2)
    return found


def _aliases() -> dict[str, tuple[type[Quantizer], dict]]:
    registry()
    return dict(_alias_table or {})


def names() -> list[str]:
    """Every name a spec may start with: plugin names and their aliases."""
    return sorted(set(registry()) | set(_aliases()))


def _convert(value: str, typ, key: str, spec: str):
    try:
        if typ is bool:
            if value.lower() in {"1", "true", "yes", "on"}:
                return True
            if value.lower() in {"0", "false", "no", "off"}:
                return False
            raise ValueError
        return typ(value)
    except ValueError:
        raise QuantizerInputError(f"{spec!r}: {key}={value!r} is not a valid {typ.__name__}") from None


@functools.lru_cache(maxsize=None)
def _config_hints(config_cls: type) -> dict:
    """A Config's field types, evaluated once per class: `typing.get_type_hints` compiles
    each string annotation anew (~0.2 ms a spec), and a cache parses its spec per layer."""
    return typing.get_type_hints(config_cls)


def parse_spec(spec: str) -> tuple[type[Quantizer], object]:
    """'name:key=value,...' -> (Quantizer class, its Config)."""
    if not isinstance(spec, str) or not spec.strip():
        raise QuantizerInputError(f"quantizer spec must be a non-empty string, got {spec!r}")
    head, _, rest = spec.strip().partition(":")
    reg, aliases = registry(), _aliases()
    if head in reg:
        cls, kw = reg[head], {}
    elif head in aliases:
        cls, kw = aliases[head]
        kw = dict(kw)
    else:
        failed = [b for b in broken_plugins() if head in b.names]
        if failed:
            raise QuantizerInputError(f"quantizer {head!r} is a plugin that could not be registered: "
                                      + "; ".join(map(str, failed)))
        raise QuantizerInputError(f"unknown quantizer {head!r}; known: {', '.join(names())}")
    hints = _config_hints(cls.Config)
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise QuantizerInputError(f"{spec!r}: expected key=value, got {item!r}")
        if key not in fields:
            raise QuantizerInputError(
                f"{spec!r}: {cls.name} has no option {key!r}; options: {', '.join(sorted(fields))}"
            )
        kw[key] = _convert(value.strip(), hints[key], key, spec)
    return cls, cls.Config(**kw)


def get_quantizer(spec: str, *, layer: int = 0, role: str = "K", seed: int = 0) -> Quantizer:
    cls, config = parse_spec(spec)
    return cls(config, layer=layer, role=role, seed=seed)


__all__ = [
    "BrokenPlugin",
    "CorruptPackedError",
    "Packed",
    "Quantizer",
    "QuantizerInputError",
    "Segment",
    "broken_plugins",
    "get_quantizer",
    "names",
    "parse_spec",
    "registry",
]
