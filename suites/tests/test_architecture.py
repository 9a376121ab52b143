"""The import structure of the package (STYLE.md, "Kernel code as a house"): imports run one
way, and a room imports only the public names of another.

Every .py file under quantizers/, kernels/ and suites/ is parsed (not imported); its
imports of kvqbench modules, relative or absolute, at module level or inside functions,
are resolved to the modules they load. The test fails on any import cycle between
modules and on any import of an underscore-prefixed name (dunders aside) from another
module. Discovery by name (the registries' importlib / entry points) is not an import
edge: that is how plugins are found, below whatever finds them.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("quantizers", "kernels", "suites")
PACKAGE = "kvqbench"


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out[".".join([PACKAGE, *parts])] = (path, is_pkg)
    return out


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    """The absolute module a relative `from` import names (PEP 328)."""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(name: str, modules) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph():
    """(module -> modules it imports, [(importer, module, private name)])."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[tuple[str, str, str]] = []
    for module, (path, is_pkg) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        target = _known(alias.name, modules)
                        if target:
                            edges[module].add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    source = _resolve(module, is_pkg, node.level, node.module)
                elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                    source = node.module
                else:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:  # `from package import module`
                        edges[module].add(sub)
                        hidden = alias.name.startswith("_")
                    else:
                        target = _known(source, modules)
                        if target:
                            edges[module].add(target)
                        hidden = alias.name.startswith("_") and not (
                            alias.name.startswith("__") and alias.name.endswith("__"))
                    if hidden:
                        private.append((module, source, alias.name))
        edges[module].discard(module)
    return edges, private


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_walk_sees_the_package():
    edges, _ = import_graph()
    assert "kvqbench.kernels.decode_attention" in edges and "kvqbench.quantizers.base" in edges
    assert "kvqbench.kernels.registry" in edges["kvqbench.kernels.decode_attention"]
    assert "kvqbench.kernels.common" in edges["kvqbench.kernels.cuda.hqmq_decode"]  # relative, two levels up
    assert "kvqbench.kernels.store" in edges["kvqbench.suites.harness.kv_cache"]
    # a cycle and a private import of a made-up graph are found
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    edges, _ = import_graph()
    cycles = import_cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    _, private = import_graph()
    assert not private, "private names imported from another module: " + "; ".join(
        f"{m} imports {name} from {src}" for m, src, name in private)


def test_backends_import_neither_the_front_nor_each_other():
    """The kernels' house: the front routes to backends through the registry; a backend
    (kernels/triton/, kernels/cuda/) imports neither the front nor the other backend,
    and the neutral modules (common, registry, layout) import no format or backend."""
    edges, _ = import_graph()
    front = "kvqbench.kernels.decode_attention"
    for module, targets in edges.items():
        for backend, other in (("triton", "cuda"), ("cuda", "triton")):
            if module.startswith(f"kvqbench.kernels.{backend}.") or module == f"kvqbench.kernels.{backend}":
                assert front not in targets, (module, "imports the front")
                assert not any(t.startswith(f"kvqbench.kernels.{other}") for t in targets), (module, targets)
    for neutral in ("common", "registry", "layout"):
        targets = edges[f"kvqbench.kernels.{neutral}"]
        assert not any(t.startswith(("kvqbench.kernels.formats", "kvqbench.kernels.triton", "kvqbench.kernels.cuda"))
                       or t == front for t in targets), (neutral, targets)


def test_long_files_state_why():
    """Issue 26: no Python file outside kernel sources (files with Triton kernels) over
    ~450 lines without a reason at its top, as "(About N lines: why ...)" with N within
    20% of its length (a file that grew past its reason is read again)."""
    root = Path(__file__).resolve().parents[2]
    missing = []
    for d in ("quantizers", "kernels", "suites"):
        for p in sorted((root / d).rglob("*.py")):
            text = p.read_text()
            n = text.count("\n")
            if n <= 450 or "@triton.jit" in text:
                continue
            m = re.search(r"\(About (\d+) lines", "\n".join(text.splitlines()[:150]))
            if not m or not 0.8 * n <= int(m.group(1)) <= 1.2 * n:
                missing.append(f"{p.relative_to(root)} ({n} lines; states {m.group(1) if m else 'no reason'})")
    assert not missing, "long files without a current reason at their top: " + ", ".join(missing)
