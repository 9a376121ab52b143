"""Our `kernels/` folder must never shadow Hugging Face's `kernels` package (the
kernel hub, which transformers >= 5.25 requires and imports under that name),
from any working directory, while `kvqbench.kernels` keeps working.

The worst case is the repository root on sys.path (`python -c`, `python -m`,
torchrun, a notebook started there): `import kernels` then finds our folder
first, and kernels/__init__.py must hand the name over to HF's package."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# HF's package is installed in the pinned set (transformers requires it); where it is
# not, the same checks run with the "absent" expectation.
try:
    HF_KERNELS = importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    HF_KERNELS = None

SCRIPT = """
import importlib.metadata, os, sys
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils
import kvqbench.kernels, kvqbench.quantizers, kvqbench.suites
from kvqbench.kernels.layout import flatten  # a real submodule of ours still imports
from kvqbench.suites.harness.kv_cache import QuantizedCache
repo = os.path.realpath({repo!r})
import kernels
where = os.path.realpath(getattr(kernels, "__file__", None) or "")
try:
    hf = importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    hf = None
if hf:
    # HF's own package, with its own public names, whatever the working directory
    assert where != os.path.join(repo, "kernels", "__init__.py"), ("our folder was imported as `kernels`", where)
    assert kernels.__version__ == hf, (kernels.__version__, hf)
    from kernels import get_kernel  # what transformers imports from it
    assert import_utils.is_kernels_available()
else:
    assert not import_utils.is_kernels_available(), "transformers takes our folder for HF kernels"
    assert not hasattr(kernels, "get_kernel")
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 128, (1, 12))
with torch.inference_mode():
    out = model(ids, past_key_values=QuantizedCache("int4", config=cfg), use_cache=True)
assert torch.isfinite(out.logits).all()
print("ok", transformers.__version__, hf, os.environ.get("RANK", "-"))
"""


def _script(tmp_path) -> Path:
    """The check as a module `shadow_check` in its own folder (for `python -m`)."""
    pkg = tmp_path / "mods"
    pkg.mkdir(exist_ok=True)
    (pkg / "shadow_check.py").write_text(SCRIPT.format(repo=str(REPO)))
    return pkg


def _ok(res):
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-3000:] + res.stderr[-6000:]


def test_transformers_runs_a_model_beside_our_code_from_elsewhere(tmp_path):
    res = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=str(REPO))], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    _ok(res)


def test_transformers_runs_a_model_with_the_repo_root_on_sys_path():
    """`python -c` from the repo root puts the root on sys.path, the worst case."""
    res = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=str(REPO))], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    _ok(res)


def test_python_dash_m_from_the_repo_root(tmp_path):
    """`python -m` puts the working directory (the root) first on sys.path."""
    env = {**os.environ, "PYTHONPATH": str(_script(tmp_path))}
    res = subprocess.run([sys.executable, "-m", "shadow_check"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    _ok(res)


def test_torchrun_from_the_repo_root(tmp_path):
    """Two ranks of torchrun started in the root (`-m`: the root on sys.path)."""
    env = {**os.environ, "PYTHONPATH": str(_script(tmp_path)), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "shadow_check"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    _ok(res)
    assert res.stdout.count("ok") == 2, res.stdout


@pytest.mark.skipif(HF_KERNELS is None, reason="HF kernels is not installed: the tests above cover its absence")
def test_with_hf_kernels_absent_our_folder_reads_as_not_installed(tmp_path):
    """The other state a user can be in (transformers < 5.25 did not require HF
    kernels): an interpreter whose site folder holds everything but HF's package."""
    site_dir = Path(importlib.metadata.distribution("kernels").locate_file(""))
    view = tmp_path / "site"
    view.mkdir()
    for entry in site_dir.iterdir():
        if entry.name == "kernels" or (entry.name.startswith("kernels-") and entry.name.endswith(".dist-info")):
            continue
        (view / entry.name).symlink_to(entry)
    boot = f"import site, sys; site.addsitedir({str(view)!r}); sys.path.insert(0, '');\n"
    res = subprocess.run([sys.executable, "-S", "-c", boot + SCRIPT.format(repo=str(REPO))], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    _ok(res)
    assert res.stdout.split()[2] == "None", res.stdout
