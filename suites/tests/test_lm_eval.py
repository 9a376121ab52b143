"""The lm-eval model class and the offline tasks, on the real default model (CPU, tiny
slices): registration, that every K/V read is quantized (loglikelihood) and that
generation goes through the quantized cache, that the passkey task tells a broken
cache (int2 per token) from a good one, the `kvqbench-lm-eval` command line, and
`kvqbench compare --lm-eval`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from kvqbench.quantizers import QuantizerInputError  # noqa: E402
from kvqbench.suites.lm_eval import tasks as T  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs  # noqa: E402
from kvqbench.suites.lm_eval.evaluate import evaluate, task_scores  # noqa: E402
from kvqbench.suites.lm_eval.model import KVQuantLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

PASSKEY = {"passkey_docs": 3, "passkey_chars": 1200}  # ~330 tokens a prompt: seconds each
ROLLING = {"rolling_docs": 1, "rolling_chars": 400}


@pytest.fixture(scope="module")
def base():
    """The default model with its own cache, loaded once; each test wraps it again."""
    return KVQuantLM("smollm2-135m", quantizer="plain", device="cpu")


def wrap(base, spec, seed=0):
    return KVQuantLM(base.model, tokenizer=base.tokenizer, quantizer=spec, seed=seed)


def test_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("kvqbench") is KVQuantLM


def test_bad_spec_fails_at_construction_and_quoted_specs_are_accepted(base):
    with pytest.raises(QuantizerInputError):
        wrap(base, "int4:bits=99")
    assert wrap(base, "'hqmq:S=24,r=3'").spec == "hqmq:S=24,r=3"  # as a shell-quoted CLI value
    assert wrap(base, "plain").spec is None


def test_a_spec_split_at_its_commas_is_refused_not_truncated(base):
    """lm-eval splits model_args on ',': `quantizer=hqmq:S=96,r=4` arrives as
    quantizer='hqmq:S=96' plus r=4, which used to run S=96 with the default r."""
    with pytest.raises(QuantizerInputError, match=r"r=4.*quantizer=hqmq:S=96;r=4"):
        KVQuantLM.create_from_arg_string("pretrained=smollm2-135m,quantizer=hqmq:S=96,r=4,seed=1")
    with pytest.raises(QuantizerInputError, match="split at its commas"):  # quotes do not survive the split
        KVQuantLM.create_from_arg_string("pretrained=smollm2-135m,quantizer='hqmq:S=96,r=4'")
    assert wrap(base, "hqmq:S=96;r=4").spec == "hqmq:S=96,r=4"
    assert wrap(base, "'hqmq:S=96,r=4'").spec == "hqmq:S=96,r=4"


def test_unknown_model_args_are_refused_before_the_model_loads(monkeypatch, capsys):
    """Issue item 1: `--model_args pretrained=smollm2-135m,spec=int4` (the key is
    quantizer=) ran the default fp16 cache and exited 0; an unknown key is now refused
    before any model work, naming it and the known keys."""
    import inspect

    from lm_eval.models.huggingface import HFLM

    from kvqbench.suites.harness import models
    from kvqbench.suites.lm_eval import cli

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    rc = cli.main(["--model", "kvqbench", "--model_args", "pretrained=smollm2-135m,spec=int4",
                   "--tasks", "kvqbench_rolling", "--limit", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown model_args spec;" in err and "quantizer" in err and "max_length" in err
    from kvqbench.suites.lm_eval.model import ModelArgsError, known_args

    lm_eval_adds = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}  # as simple_evaluate passes them
    with pytest.raises(ModelArgsError, match="unknown model_args qunatizer, zz;"):
        KVQuantLM.create_from_arg_string("pretrained=smollm2-135m,qunatizer=int4,zz=1", lm_eval_adds)
    with pytest.raises(ModelArgsError, match="peft would be ignored"):  # known to HFLM, but only for its own loading
        KVQuantLM.create_from_arg_string("pretrained=smollm2-135m,peft=some/adapter", lm_eval_adds)
    hflm = {n for n, p in inspect.signature(HFLM.__init__).parameters.items() if n != "self" and p.kind != p.VAR_KEYWORD}
    assert hflm | {"quantizer", "seed", "attn_implementation", "trust_remote_code"} <= set(known_args())


def test_known_model_args_are_taken(base):
    lm = KVQuantLM.create_from_arg_obj({"pretrained": base.model, "tokenizer": base.tokenizer, "quantizer": "int4",
                                        "max_length": 64, "trust_remote_code": False},
                                       {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    assert lm.max_length == 64 and lm.spec == "int4"


def test_batch_size_in_model_args_beside_the_command_lines_flag(base):
    """lm-eval's CLI always passes `--batch_size` (default 1): `model_args=...,batch_size=3`
    raised "multiple values for keyword argument" on the H200. One value, or the flag at its
    default, is taken; two different values are refused, naming both."""
    from kvqbench.suites.lm_eval.model import ModelArgsError

    args = {"pretrained": base.model, "tokenizer": base.tokenizer, "quantizer": "int4", "batch_size": "3"}
    for flag in (1, "1", "3", None):
        lm = KVQuantLM.create_from_arg_obj(dict(args), {"batch_size": flag, "device": "cpu"})
        assert lm.kv_gen_batch == 3
    lm = KVQuantLM.create_from_arg_obj({k: v for k, v in args.items() if k != "batch_size"}, {"batch_size": 4, "device": "cpu"})
    assert lm.kv_gen_batch == 4
    with pytest.raises(ModelArgsError, match="batch_size given twice.*batch_size=3.*--batch_size 5"):
        KVQuantLM.create_from_arg_obj(dict(args), {"batch_size": 5, "device": "cpu"})


def test_task_documents_are_fixed_and_well_formed():
    a, b = T.passkey_docs(passkey_docs=5, passkey_chars=800)["test"], T.passkey_docs(passkey_docs=5, passkey_chars=800)["test"]
    assert a.to_list() == b.to_list()
    assert len({d["depth"] for d in a}) == 5 and len({d["answer"] for d in a}) == 5
    for d in a:
        assert d["input"].count(d["answer"]) == 2  # the needle says it twice; nothing else has it
        assert d["input"].startswith(T.INTRO) and d["input"].endswith(T.QUESTION)
        assert 800 <= len(d["input"]) - len(T.INTRO) - len(T.QUESTION) <= 800 + len(T.NEEDLE) + 10
    assert T.passkey_process_results(a[0], [f" {a[0]['answer']}. Remember"]) == {"exact_match": 1.0}
    assert T.passkey_process_results(a[0], [" the golden key"]) == {"exact_match": 0.0}
    roll = T.rolling_docs(rolling_docs=3, rolling_chars=500)["test"]
    assert len(roll) == 3 and all(400 <= len(d["text"]) <= 500 for d in roll)
    assert roll[0]["start"] == 0 and roll.to_list() == T.rolling_docs(rolling_docs=3, rolling_chars=500)["test"].to_list()


def test_loglikelihood_reads_quantized_kv(base):
    """_model_call == one forward through a fresh QuantizedCache (quantize-on-write)."""
    ids = torch.tensor([base.tok_encode("Alice was beginning to get very tired of sitting by her sister")])
    plain = base._model_call(ids)
    diff = {}
    for spec in ("fp16", "int2"):
        lm = wrap(base, spec, seed=3)
        got = lm._model_call(ids)
        cache = QuantizedCache(spec, config=base.model.config, seed=3)
        with torch.no_grad():
            want = base.model(input_ids=ids, **cache_kwargs(base.model, cache), use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert lm.kv_calls["forward"] == 1 and lm.bits_per_element() == cache.bits_per_element()
        diff[spec] = (got - plain).abs().max().item()
    assert diff["fp16"] < 0.1 and diff["int2"] > 20 * diff["fp16"], diff


def test_rolling_task_orders_caches(base):
    ppl = {}
    for spec in ("plain", "fp16", "int2"):
        lm = wrap(base, spec)
        s = task_scores(evaluate(["kvqbench_rolling"], lm=lm, metadata=ROLLING))["kvqbench_rolling"]
        ppl[spec] = s["word_perplexity"]
    assert ppl["fp16"] == pytest.approx(ppl["plain"], rel=1e-3)
    assert ppl["int2"] > 1.5 * ppl["fp16"]


BROKEN = "int:bits=1,group=64"  # 1.5 bits: no retrieval left


def test_passkey_tells_a_broken_cache_from_a_good_one(base):
    """fp16 finds the passkey, a 1-bit cache never does. (Not int2: the generation engine's
    exact prefill leaves it some retrieval, and how much depends on the CPU's arithmetic:
    0 of 3 passkeys on one 2-core machine, 1 of 3 and 2 of 12 on another, where the 1-bit
    cache found 0 of 12.)"""
    acc = {}
    for spec in ("fp16", BROKEN):
        lm = wrap(base, spec)
        res = evaluate(["kvqbench_passkey"], lm=lm, metadata=PASSKEY)
        acc[spec] = task_scores(res)["kvqbench_passkey"]["exact_match"]
        assert lm.kv_calls["generate"] == PASSKEY["passkey_docs"]  # the quantized cache ran generate
        assert lm.bits_per_element() == {"fp16": 16.0, BROKEN: 1.5}[spec]
        assert res["config"]["kv_quantizer"] == spec
    assert acc["fp16"] >= 2 / 3, acc
    assert acc[BROKEN] == 0.0, acc


def test_generation_runs_batched_through_the_engine(base):
    """generate_until: `batch_size` requests per engine call (rows of different prompt
    lengths in length groups), the same answers as one at a time, tokens/s reported."""
    one, three = wrap(base, "int4"), KVQuantLM(base.model, tokenizer=base.tokenizer, quantizer="int4", batch_size=3)
    res = {}
    for name, lm in (("one", one), ("three", three)):
        r = evaluate(["kvqbench_passkey"], lm=lm, metadata=PASSKEY, log_samples=True)
        res[name] = [s["resps"] for s in r["samples"]["kvqbench_passkey"]]
        gen = r["config"]["kv_generation"] if "kv_generation" in r["config"] else lm.get_model_info()["kv_generation"]
        assert gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0 and gen["modes"]
        assert gen["batch_size"] == {"one": 1, "three": 3}[name]  # requests per engine call, as asked
        assert lm.kv_calls["generate"] == PASSKEY["passkey_docs"]
    assert one.kv_generation["calls"] == 3 and three.kv_generation["calls"] == 1  # one engine call for the batch
    assert res["one"] == res["three"]
    assert one.bits_per_element() == three.bits_per_element()


def test_command_line(tmp_path):
    """`kvqbench-lm-eval`: lm-eval's CLI with the model registered and the offline tasks
    included; a quantizer spec with commas, quoted."""
    exe = Path(sys.executable).with_name("kvqbench-lm-eval")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvqbench.suites.lm_eval.cli"]
    cmd += ["--model", "kvqbench", "--model_args", "pretrained=smollm2-135m,quantizer='hqmq:S=24,r=3',seed=1",
            "--tasks", "kvqbench_rolling", "--device", "cpu", "--metadata", json.dumps(ROLLING),
            "--output_path", str(tmp_path / "out")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kvqbench_rolling" in r.stdout and "word_perplexity" in r.stdout
    [path] = (tmp_path / "out").rglob("results_*.json")
    res = json.loads(path.read_text())
    assert res["config"]["kv_quantizer"] == "hqmq:S=24,r=3" and res["config"]["kv_seed"] == 1
    assert 3 < res["config"]["kv_bits_per_element"] < 5


def test_compare_adds_task_scores(tmp_path):
    from kvqbench.suites.compare import cli

    args = ["compare", "--specs", "fp16;int2", "--window", "48", "--windows", "1", "--seeds", "1",
            "--device", "cpu", "--out", str(tmp_path), "--run", "t", "--lm-eval", "kvqbench_rolling",
            "--lm-eval-metadata", json.dumps(ROLLING)]
    assert cli.main(args) == 0
    data = json.loads((tmp_path / "t" / "results.json").read_text())
    le = {r["spec"]: r["lm_eval"] for r in data["results"]}
    assert set(le) == {"fp16", "int2"}
    wp = {s: v["scores"]["kvqbench_rolling"]["word_perplexity"] for s, v in le.items()}
    assert wp["int2"] > wp["fp16"] and le["int2"]["bits_per_element"] == 3.0
    report = (tmp_path / "t" / "report.md").read_text()
    assert "## Downstream tasks (lm-eval)" in report and "kvqbench_rolling word_perplexity" in report
    assert "| generation tokens/s (steps, requests per call) |" in report  # (a loglikelihood task: "-" in it)
    # --lm-eval-specs: a sweep scores only the specs a claim compares
    assert cli.main([*args[:-6], "--run", "u", "--lm-eval", "kvqbench_rolling", "--lm-eval-specs", "int2",
                     "--lm-eval-metadata", json.dumps(ROLLING)]) == 0
    data = json.loads((tmp_path / "u" / "results.json").read_text())
    assert {r["spec"]: "lm_eval" in r for r in data["results"]} == {"fp16": False, "int2": True}


def test_compare_scores_keep_the_generation_speed(base):
    """What `compare --lm-eval` stores of a generation task: the scores and the engine's
    tokens/s and step mode (the report's last lm-eval column)."""
    from kvqbench.suites.lm_eval.evaluate import compare_scores

    rec = compare_scores(base.model, base.tokenizer, "int4", 0, "kvqbench_passkey", metadata=PASSKEY)
    gen = rec["kv_generation"]
    assert rec["kv_calls"]["generate"] == PASSKEY["passkey_docs"] and gen["calls"] == 1  # 3 requests, one call
    assert gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0 and gen["modes"] and gen["batch_size"] == 8
