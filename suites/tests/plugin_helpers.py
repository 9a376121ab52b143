"""Throwaway out-of-tree quantizer plugins for tests (installed as a distribution with
entry points on sys.path, as a user's package would be)."""
from __future__ import annotations


def install_plugins(tmp_path, monkeypatch, modules: dict[str, str], entry_points: str, dist: str = "test-plugins"):
    """Throwaway out-of-tree plugins: each of `modules` (name -> source) as a file on
    sys.path, and a distribution whose `kvqbench.quantizers` entry points are
    `entry_points` (lines `name = module:Class`); the registry is rebuilt, its warnings
    returned. Undo with `uninstall_plugins`."""
    import textwrap
    import warnings

    from kvqbench.quantizers import registry

    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
    info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvqbench.quantizers]\n" + textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry(refresh=True)
    return caught


def uninstall_plugins(monkeypatch, modules) -> None:
    import sys

    from kvqbench.quantizers import registry

    monkeypatch.undo()
    for m in modules:
        sys.modules.pop(m, None)
    registry(refresh=True)
