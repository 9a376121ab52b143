"""Fixtures shared by the tests of the command line, results file and distributed
runs: the tiny random model (suites/harness/tiny_model.py) and a private cache."""
import pytest

from kvqbench.suites.harness.tiny_model import make_tiny_model, tiny_corpus


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"model": folder, "corpus": text file} of the tiny model, made once per module."""
    root = tmp_path_factory.mktemp("tiny")
    return {"model": str(make_tiny_model(root / "model")), "corpus": str(tiny_corpus(root / "text.txt"))}


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Token files of the tiny model go to a temp cache, not the user's."""
    monkeypatch.setenv("KVQBENCH_CACHE", str(tmp_path / "cache"))

