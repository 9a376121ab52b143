"""Shared by the asv benchmarks: the quantizer specs they are parameterized over (every
quantizer's examples; the fused formats' benchmark specs, `fused_specs()`, read from the
checkout's kernels/formats/ the same way), and the benchmark toolkit (`toolkit()`:
synthetic K/V, the tiler) of the checkout.

asv runs a parameter by its INDEX in the list it discovered, at every commit, so
the list must be the same whichever commit is installed. It is therefore read
from the registry of the checkout asv runs from (these files' own source tree:
`quantizers/` beside `suites/`), not from the installed kvqbench: the quantizer
modules are loaded from there under a private package name (no folder goes on
sys.path), and every class with a `name` contributes `examples()`, as
`kvqbench.quantizers.registry()` does. Entry-point plugins installed in asv's
environment are added from the installed registry (the same at every commit).
A commit that does not know a spec skips it (NotImplementedError: n/a in asv).
Outside a source tree, the installed registry is used.

The toolkit (suites/bench/toolkit.py, beside this folder) is benchmark code like these
files, so it is read from the checkout too (by its path, under a private name; it
imports no kvqbench module when loaded): the data and the tiling are then the same at
every commit, only the installed kvqbench they time changes, and a commit from before
the toolkit existed is measured all the same.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

SOURCE_QUANTIZERS = Path(__file__).resolve().parents[3] / "quantizers"
_ALIAS = "_kvqbench_asv_source_quantizers"
SOURCE_TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit.py"
_TOOLKIT_ALIAS = "_kvqbench_asv_source_toolkit"


def _source_examples() -> dict[str, tuple[str, ...]] | None:
    """{plugin name: example specs} of the source tree's built-in quantizers."""
    init = SOURCE_QUANTIZERS / "__init__.py"
    if not init.is_file():
        return None
    if _ALIAS not in sys.modules:
        spec = importlib.util.spec_from_file_location(_ALIAS, init, submodule_search_locations=[str(SOURCE_QUANTIZERS)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[_ALIAS] = pkg
        spec.loader.exec_module(pkg)
    pkg = sys.modules[_ALIAS]
    base = importlib.import_module(f"{_ALIAS}.base")
    found = {}
    for path in sorted(SOURCE_QUANTIZERS.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        mod = importlib.import_module(f"{_ALIAS}.{path.stem}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, base.Quantizer) and obj.__module__ == mod.__name__ \
                    and "name" in vars(obj):
                found[obj.name] = tuple(obj.examples())
    return found


def toolkit():
    """The checkout's benchmark toolkit module (see the module docstring); outside a
    source tree, the installed one."""
    if _TOOLKIT_ALIAS not in sys.modules:
        if not SOURCE_TOOLKIT.is_file():
            return importlib.import_module("kvqbench.suites.bench.toolkit")
        spec = importlib.util.spec_from_file_location(_TOOLKIT_ALIAS, SOURCE_TOOLKIT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_TOOLKIT_ALIAS] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[_TOOLKIT_ALIAS]
            raise
    return sys.modules[_TOOLKIT_ALIAS]


def _installed_examples(plugins_only: bool) -> dict[str, tuple[str, ...]]:
    from kvqbench.quantizers import registry

    return {name: tuple(cls.examples()) for name, cls in registry().items()
            if not (plugins_only and cls.__module__.startswith("kvqbench.quantizers."))}


def example_specs() -> list[str]:
    """fp16 first, then every example config of every registered quantizer, by name."""
    try:
        examples = _source_examples()
    except Exception:  # noqa: BLE001 (a broken source tree: fall back to what is installed)
        examples = None
    if examples is None:
        examples = _installed_examples(plugins_only=False)
    else:
        try:
            examples.update({k: v for k, v in _installed_examples(plugins_only=True).items() if k not in examples})
        except Exception:  # noqa: BLE001 (an installed commit whose registry cannot load plugins)
            pass
    specs = ["fp16"]
    for name in sorted(examples):
        specs += [s for s in examples[name] if s not in specs]
    return specs


SOURCE_FORMATS = Path(__file__).resolve().parents[3] / "kernels" / "formats"


def _source_fused_specs() -> list[str] | None:
    """The `bench` specs of the checkout's fused formats (kernels/formats/*.py), read from
    each `Format(...)`'s literal `bench={...}` without importing the file (it imports
    Triton and the installed kvqbench's kernels); None outside a source tree."""
    if not SOURCE_FORMATS.is_dir():
        return None
    specs = []
    for path in sorted(SOURCE_FORMATS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Format":
                specs += [v for kw in node.keywords if kw.arg == "bench" for v in ast.literal_eval(kw.value).values()]
    return specs


def fused_specs() -> list[str]:
    """Every fused format's benchmark specs (kernels/registry.py `Format.bench`): the
    checkout's, the same at every commit as `example_specs`, then those of formats that
    installed plugins register through the `kvqbench.formats` entry points."""
    try:
        specs = _source_fused_specs()
    except Exception:  # noqa: BLE001 (a broken source tree: what is installed)
        specs = None
    if specs is None:
        try:
            from kvqbench.kernels import registry

            return list(registry.bench_specs().values())
        except Exception:  # noqa: BLE001 (an installed commit without the format registry)
            return []
    try:
        for ep in importlib.metadata.entry_points(group="kvqbench.formats"):
            specs += list(ep.load().bench.values())
    except Exception:  # noqa: BLE001 (a plugin that cannot load: its specs are not timed)
        pass
    return list(dict.fromkeys(specs))


def quantizer_or_skip(spec: str, **kw):
    """The installed commit's quantizer, or NotImplementedError (asv: skipped, shown as
    n/a) when that commit does not know this spec."""
    from kvqbench.quantizers import get_quantizer

    try:
        return get_quantizer(spec, **kw)
    except ValueError as e:  # QuantizerInputError: unknown name or option at this commit
        raise NotImplementedError(f"{spec}: {e}") from e


class CachedFigures:
    """Base of benchmarks whose figures are all computed once, in `setup_cache`, as
    {spec: {figure: value}}: a spec missing there (unknown to the installed commit) is
    skipped. Their `track_` methods are `cached_figure(...)`."""

    def setup(self, cache, spec):
        if spec not in cache:
            raise NotImplementedError(f"{spec} not available at this commit")


def cached_figure(key: str, unit: str, doc: str | None = None):
    """A `track_` method returning figure `key` of its spec from `setup_cache`'s dict.
    asv names it by the attribute it is assigned to and versions it by `pretty_source`."""

    def track(self, cache, spec):
        return cache[spec][key]

    track.unit, track.__doc__ = unit, doc
    track.pretty_source = f"return cache[spec][{key!r}]  # {unit}"
    return track


def head_dim_for(spec: str) -> int:
    """The head_dim the conformance suite uses (64 unless the config's groups need more)."""
    from kvqbench.suites.conformance import head_dim_for as conformance_head_dim

    quantizer_or_skip(spec)  # a spec this commit does not know: skipped
    try:
        return conformance_head_dim(spec)
    except (AssertionError, ValueError) as e:  # accepts none of the head dims tried
        raise NotImplementedError(str(e)) from e


SPECS = example_specs()
