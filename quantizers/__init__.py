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
import importlib
import importlib.metadata
import pkgutil
import typing

from .base import CorruptPackedError, Packed, Quantizer, QuantizerInputError, Segment

ENTRY_POINT_GROUP = "kvqbench.quantizers"
_registry: dict[str, type[Quantizer]] | None = None


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
    """name -> Quantizer class, for built-in and entry-point plugins."""
    global _registry
    if _registry is not None and not refresh:
        return _registry
    found: dict[str, type[Quantizer]] = {}

    def add(cls: type[Quantizer], origin: str) -> None:
        if cls.name in found and found[cls.name] is not cls:
            raise RuntimeError(f"quantizer name {cls.name!r} registered twice ({origin})")
        found[cls.name] = cls

    for info in pkgutil.iter_modules(__path__):  # shared modules simply define no plugin
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for cls in _subclasses_in(mod):
            add(cls, mod.__name__)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Quantizer)):
            raise TypeError(f"entry point {ep.name} = {ep.value} is not a Quantizer subclass")
        add(cls, f"entry point {ep.value}")
    _registry = found
    return found


def _aliases() -> dict[str, tuple[type[Quantizer], dict]]:
    return {a: (cls, kw) for cls in registry().values() for a, kw in cls.aliases.items()}


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
        raise QuantizerInputError(f"unknown quantizer {head!r}; known: {', '.join(names())}")
    hints = typing.get_type_hints(cls.Config)
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
    "CorruptPackedError",
    "Packed",
    "Quantizer",
    "QuantizerInputError",
    "Segment",
    "get_quantizer",
    "names",
    "parse_spec",
    "registry",
]
