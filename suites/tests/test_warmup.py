"""The compare's kernel warm-up (suites/compare/warmup.py): worker processes that score
the coming configurations on a one-layer copy of the model, results thrown away. What
it buys (compiles done in parallel on a GPU) is timed by suites/bench/bench_compare.py;
here: the copy, when it starts, and that a worker runs, logs and survives failures."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig

from kvqbench.suites.compare import warmup
from kvqbench.suites.harness.models import load_model


def test_one_layer_config_is_a_cut_copy():
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=100)
    cfg.layer_types = ["full_attention"] * 4
    one = warmup.one_layer_config(cfg)
    assert (one.num_hidden_layers, one.layer_types) == (1, ["full_attention"])
    assert (cfg.num_hidden_layers, len(cfg.layer_types)) == (4, 4)  # the run's model keeps its config
    assert (one.num_attention_heads, one.num_key_value_heads, one.hidden_size) == (2, 1, 64)


def test_worker_count(tiny):
    model, _, _ = load_model(tiny["model"], device="cpu")
    assert warmup.n_workers(None, "cpu", model, 10)[0] == 0
    assert warmup.n_workers(0, "cuda", model, 10) == (0, "--warmup-workers 0")
    with pytest.raises(ValueError, match="--warmup-workers must be >= 0"):
        warmup.n_workers(-1, "cuda", model, 10)
    # one layer of two, plus a context
    layers = sum(p.numel() * 4 for n, p in model.named_parameters() if ".layers.1." in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert warmup.worker_bytes(model) == total - layers + warmup.CONTEXT_BYTES
    if torch.cuda.is_available():
        n, _ = warmup.n_workers(None, "cuda", model.cuda(), 3)
        assert 1 <= n <= 3


def test_workers_score_their_jobs_log_them_and_survive_a_failure(tiny, tmp_path):
    """On the CPU (the run itself never starts them there): two workers share four jobs,
    the second impossible (a context as long as the window); both exit 0, every job
    logged once, the plan files removed."""
    model, _, _ = load_model(tiny["model"], device="cpu")
    jobs = [("prefill-then-decode", "int4", 2, 40, 32), ("prefill-then-decode", "int8", 2, 40, 40),
            ("quantize-on-write", "hqmq:S=24,r=3", 2, 40, 32), ("quantize-on-write", "int2", 1, 40, 32)]
    with warmup.Warmup(model, "cpu", jobs, 2, tmp_path) as w:
        assert w.wait(300) == [0, 0]
    text = (tmp_path / "warmup.log").read_text()
    assert text.count("] ready") == 2, text
    lines = [line for line in text.splitlines() if re.search(r"\] \S+ \S+: [0-9.]+ s", line)]
    assert sorted(re.search(r"\] (\S+ \S+): ", line)[1] for line in lines) == sorted(
        f"{p} {s}" for p, s, *_ in jobs), text
    failed = [line for line in lines if "Error" in line]
    assert len(failed) == 1 and "int8" in failed[0] and "context must be in 1..39" in failed[0]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["warmup.log"]


def test_a_worker_that_cannot_build_the_model_exits_1(tmp_path):
    import pickle
    import subprocess
    import sys

    plan = tmp_path / "warmup.plan"
    plan.write_bytes(pickle.dumps({"config": None, "dtype": torch.float32, "device": "cpu", "attn": "sdpa",
                                   "jobs": [("quantize-on-write", "int4", 1, 8, 4)]}))
    r = subprocess.run([sys.executable, "-m", "kvqbench.suites.compare.warmup", str(plan)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "worker start:" in r.stdout, r.stdout + r.stderr


def test_jobs_put_prefill_then_decode_first():
    rows = {(p, s): 1 for p in ("quantize-on-write", "prefill-then-decode") for s in ("a", "b")}
    got = warmup.jobs(["a", "b"], ["quantize-on-write", "prefill-then-decode"], rows,
                      {"quantize-on-write": 512, "prefill-then-decode": 448}, 384)
    assert [(p[0], s) for p, s, *_ in got] == [("p", "a"), ("p", "b"), ("q", "a"), ("q", "b")]
    assert got[0][3:] == (448, 384) and got[2][3] == 512
