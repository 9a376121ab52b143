"""Our `kernels/` folder must never be taken for HF's kernel-hub package
(`import kernels`), which transformers probes for at import time."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib.util, sys
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils
import kvqbench.kernels, kvqbench.quantizers, kvqbench.suites
from kvqbench.suites.harness.kv_cache import QuantizedCache
assert not import_utils.is_kernels_available(), "transformers thinks HF kernels is installed"
spec = importlib.util.find_spec("kernels")
assert spec is None or "kvqbench" not in str(spec.origin), spec
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 128, (1, 12))
with torch.inference_mode():
    out = model(ids, past_key_values=QuantizedCache("int4", config=cfg), use_cache=True)
assert torch.isfinite(out.logits).all()
print("ok", transformers.__version__)
"""


def _run(cwd):
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_transformers_runs_a_model_beside_our_code_from_elsewhere(tmp_path):
    res = _run(tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr


def test_transformers_runs_a_model_with_the_repo_root_on_sys_path():
    """`python -c` from the repo root puts the root on sys.path, the worst case."""
    res = _run(REPO)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
