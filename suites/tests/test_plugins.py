"""Out-of-tree plugins: the README's worked example, installed through a
`kvqbench.quantizers` entry point, is found, listed and conformance-tested
exactly like a built-in."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvqbench.quantizers import get_quantizer, registry
from kvqbench.suites import conformance
from kvqbench.suites.compare import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """The README's example plugin as an installed distribution (dist-info with an
    entry point) on sys.path; the registry is rebuilt around it."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Adding a quantizer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_kvq.py").write_text(code)
    dist = tmp_path / "my_kvq-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kvq\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [kvqbench.quantizers]
        absmax = my_kvq:AbsmaxInt
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry(refresh=True)
    yield tmp_path
    monkeypatch.undo()
    sys.modules.pop("my_kvq", None)
    registry(refresh=True)


def test_entry_point_plugin_is_registered_and_conforms(installed_plugin):
    assert "absmax" in registry()
    q = get_quantizer("absmax:bits=4")
    assert q.encode(conformance.reference_tensor(64)).bits_per_element == 4 + 16 / 64
    conformance.check_quantizer("absmax:bits=4")


def test_entry_point_plugin_is_listed(installed_plugin, capsys):
    cli.main(["list", "absmax", "--tokens", "64"])
    out = capsys.readouterr().out
    assert re.search(r"absmax:bits=4\s+4\.250", out), out


def test_entry_point_plugin_gets_the_per_quantizer_suites(installed_plugin):
    """A fresh pytest run collects the plugin's configs into the conformance, fuzz
    and bad-input suites, as it does every built-in's."""
    env = dict(os.environ, PYTHONPATH=str(installed_plugin))
    suites = [str(REPO / "suites" / "tests" / f) for f in ("test_conformance.py", "test_fuzz.py", "test_bad_input.py")]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", *suites,
         "-q", "-k", "absmax", "-p", "no:cacheprovider", "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml")],
        cwd=installed_plugin, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    # conformance 6, fuzz 2, bad input 9 (3 NaN/Inf, 3 empty, dtype/rank, append, zeros, overflow)
    assert re.search(r"\b(\d+) passed\b", res.stdout), res.stdout
    assert int(re.search(r"\b(\d+) passed\b", res.stdout).group(1)) >= 6 + 2 + 9, res.stdout
