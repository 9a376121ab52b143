"""A broken or conflicting plugin is left out, named, and never takes the other
quantizers down or replaces one of them (issue 25, items 3 and 4)."""
from __future__ import annotations

import sys

import pytest

import kvqbench.quantizers as Q
from kvqbench.suites.tests.plugin_helpers import install_plugins, uninstall_plugins
from kvqbench.quantizers import QuantizerInputError, broken_plugins, get_quantizer, registry
from kvqbench.suites.compare import cli

PLUGINS = '''
import dataclasses
from kvqbench.quantizers.naive_int import NaiveInt
from kvqbench.quantizers.base import Quantizer


class Sneaky(NaiveInt):
    """Takes over `int4` at 3 bits if the registry lets it."""
    name = "sneaky"
    aliases = {"int4": {"bits": 3}}


class Shadow(NaiveInt):
    name = "int"  # a built-in's name


class Abstract(Quantizer):
    name = "abstract"

    @dataclasses.dataclass
    class Config:
        bits: int = 4


class Good(NaiveInt):
    name = "goodplugin"
    aliases = {}
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    # and a broken module among the built-ins' folder
    extra = tmp_path / "builtin_dir"
    extra.mkdir()
    (extra / "zz_broken_builtin.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.setattr(Q, "__path__", list(Q.__path__) + [str(extra)])
    modules = {"my_plugins": PLUGINS, "broken_plugin": "raise ImportError('needs libfoo')\n"}
    yield install_plugins(tmp_path, monkeypatch, modules, """\
        sneaky = my_plugins:Sneaky
        shadow = my_plugins:Shadow
        abstract = my_plugins:Abstract
        goodplugin = my_plugins:Good
        broken = broken_plugin:Thing
        """)
    uninstall_plugins(monkeypatch, [*modules, "kvqbench.quantizers.zz_broken_builtin"])


def test_every_other_quantizer_works_and_the_broken_ones_are_named(plugins):
    assert get_quantizer("int4").config.bits == 4  # not the plugin's alias at 3 bits
    assert get_quantizer("goodplugin:bits=3").config.bits == 3  # a sound plugin beside them is registered
    by = {b.origin.split(" (")[0]: b.error for b in broken_plugins()}
    assert "ModuleNotFoundError" in by["module kvqbench.quantizers.zz_broken_builtin"]
    assert "needs libfoo" in by["entry point broken = broken_plugin:Thing"]
    assert "abstract" in by["entry point abstract = my_plugins:Abstract"]
    assert "'int4' already taken" in by["entry point sneaky = my_plugins:Sneaky"]
    assert "'int', 'int2'" in by["entry point shadow = my_plugins:Shadow"]
    assert len(plugins) >= 5 and all("quantizer plugin skipped" in str(w.message) for w in plugins)


def test_asking_for_a_left_out_plugin_says_why(plugins):
    with pytest.raises(QuantizerInputError, match="could not be registered.*needs libfoo"):
        get_quantizer("broken")
    with pytest.raises(QuantizerInputError, match="could not be registered.*'int4' already taken"):
        get_quantizer("sneaky")


def test_list_and_report_name_them(plugins, capsys, tmp_path):
    assert cli.main(["list", "int", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "plugins that failed to load" in out and "needs libfoo" in out and "'int4' already taken" in out
    from kvqbench.suites.compare.report import broken_plugins_section
    section = "\n".join(broken_plugins_section())
    assert "## Plugins left out" in section and "zz_broken_builtin" in section


def test_two_builtins_claiming_one_name_is_a_bug_that_raises(monkeypatch, tmp_path):
    extra = tmp_path / "dup"
    extra.mkdir()
    (extra / "zz_dup.py").write_text("from kvqbench.quantizers.naive_int import NaiveInt\n"
                                     "class Dup(NaiveInt):\n    name = 'int'\n")
    monkeypatch.setattr(Q, "__path__", list(Q.__path__) + [str(extra)])
    try:
        with pytest.raises(RuntimeError, match="'int', 'int2'.* already taken"):
            registry(refresh=True)
    finally:
        monkeypatch.undo()
        sys.modules.pop("kvqbench.quantizers.zz_dup", None)
        registry(refresh=True)
