"""Evaluation text and the fixed token windows every quantizer is scored on.

Embedded corpora are public-domain English texts that registries ship (the only source
on machines without a model hub; see shared/OFFLINE.md). They are extracted once into
the cache and pinned by the sha256 of the extracted text (checked on every load):
    corpora/<name>.txt, corpora/<name>.json   text and its info (json written last)
    downloads/                                 the sdist / .deb they came from, each
                                               hash-checked before it is opened
    tokens/<text sha>-<tokenizer sha>.npy      token ids of a text (int32), used only if they
                                               decode to that text (see tokenize_text)
    .tmp-corpus-<name>/                        work folder, removed afterwards
Nothing fetched is executed: the canterbury sdist is downloaded by URL from the
package index and only read as a tar archive (never built), and extraction uses
tarfile's 'data' filter (no links out of the folder, no devices, no odd modes).
The texts are probably in the models' training data: fine for comparing quantizers
with each other, not for claims about generalisation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

from .fetch import (cache_dir, download, fresh_tmp, index_file, locked, log, pip, read_meta, sha256_file,
                    write_atomic)

CORPORA: dict[str, dict] = {
    "canterbury": dict(
        description="Canterbury corpus English texts alice29, asyoulik, lcet10, plrabn12 "
        "(CRLF -> LF, joined by blank lines)",
        source="PyPI sdist brotli==1.2.1, tests/testdata/",
        sha256="f5cd862a266bb9f53b31418d0ec8c2df6869a3abb3128a4e9d665190f5a3bcce",
        # The sdist as PyPI lists it (simple API); checked before the archive is opened.
        archive=("brotli", "brotli-1.2.1.tar.gz",
                 "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"),
    ),
    "austen": dict(
        description="Jane Austen's six novels in publication order (lines joined by \\n, "
        "books by blank lines)",
        source="Debian r-cran-janeaustenr=1.0.0-1, data/Rdata.rdb (read with PyPI rdata==1.1.0)",
        sha256="7f77b3747b535329741d65eafa6742c714087743969518a1a5e15a7afe058272",
    ),
    "wikitext2": dict(description="WikiText-2 raw, test split, rows joined by '\\n\\n'",
                      source="Hugging Face hub Salesforce/wikitext wikitext-2-raw-v1 (datasets)"),
    "wikitext103": dict(description="WikiText-103 raw, test split, rows joined by '\\n\\n'",
                        source="Hugging Face hub Salesforce/wikitext wikitext-103-raw-v1 (datasets)"),
}
DEFAULT_CORPUS = "canterbury"
CANTERBURY_FILES = ["alice29.txt", "asyoulik.txt", "lcet10.txt", "plrabn12.txt"]
AUSTEN_DEB = "r-cran-janeaustenr=1.0.0-1"
AUSTEN_BOOKS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
                "northangerabbey", "persuasion"]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fetch_archive(project: str, filename: str, sha256: str) -> Path:
    """downloads/<filename>: a release file of `project`, fetched by URL from the
    configured package index and sha256-checked before it is used; a cached copy that
    fails the check (truncated, edited) is fetched again. Never built, never run."""
    dest = cache_dir() / "downloads" / filename
    if dest.is_file() and sha256_file(dest) == sha256:
        return dest
    log(f"{project}: fetching {filename} from the package index (first use only)")
    return download(index_file(project, filename), dest, sha256)


def _canterbury(work: Path) -> str:
    sdist = fetch_archive(*CORPORA["canterbury"]["archive"])
    members = [f"brotli-1.2.1/tests/testdata/{f}" for f in CANTERBURY_FILES]
    with tarfile.open(sdist) as tar:
        tar.extractall(work, members=[tar.getmember(m) for m in members], filter="data")
    # Three of the four files use CRLF; normalise so line ends tokenise alike.
    texts = [_decode((work / m).read_bytes(), f"{sdist.name}:{m}", "ascii") for m in members]
    return "\n\n".join(t.replace("\r\n", "\n").strip("\n") for t in texts)


def _decode(data: bytes, where: str, encoding: str = "utf-8") -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not {encoding.upper()} text: byte {data[e.start]:#04x} at offset "
                         f"{e.start} ({e.reason}); convert it to UTF-8 first") from None


# Runs in a child interpreter: rdata (with its pandas/xarray deps) may live only in a
# private target folder, which must not shadow this process's numpy.
_RDATA_SCRIPT = r"""
import json, struct, sys, zlib, warnings
import rdata
warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS" for the index
base, out = sys.argv[1], sys.argv[2]
# R lazy-load database: Rdata.rdx (an .rds) maps each object to (offset, length) in
# Rdata.rdb, where it is a 4-byte big-endian length + zlib-compressed serialisation.
index = rdata.read_rds(base + ".rdx")
blob = open(base + ".rdb", "rb").read()
objs = {}
for name, (off, n) in index["variables"].items():
    raw = zlib.decompress(blob[int(off) + 4:int(off) + int(n)])
    assert len(raw) == struct.unpack(">I", blob[int(off):int(off) + 4])[0]
    objs[str(name)] = [str(s) for s in rdata.conversion.convert(rdata.parser.parse_data(raw))]
json.dump(objs, open(out, "w"))
"""


def _austen(work: Path) -> str:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError("corpus 'austen' needs apt-get and dpkg-deb (Debian/Ubuntu) to fetch "
                           f"{AUSTEN_DEB}; use 'canterbury' or a text file path instead")
    dl = cache_dir() / "downloads"
    dl.mkdir(exist_ok=True)
    debs = sorted(dl.glob("r-cran-janeaustenr_1.0.0-1_*.deb"))
    side = dl / "r-cran-janeaustenr.sha256"  # recorded when apt (which verifies it) fetched it
    if debs and (not side.is_file() or side.read_text().strip() != sha256_file(debs[0])):
        log(f"austen: cached {debs[0].name} failed its check; fetching it again")
        debs[0].unlink()
        debs = []
    if not debs:
        log(f"austen: apt-get download {AUSTEN_DEB} (1.6 MB; first use only)")
        r = subprocess.run(["apt-get", "download", AUSTEN_DEB], cwd=work,
                           capture_output=True, text=True)
        got = sorted(work.glob("*.deb"))
        if r.returncode != 0 or not got:
            raise RuntimeError(f"apt-get download {AUSTEN_DEB} failed (try `apt-get update`; "
                               f"needs a Debian-family package index):\n{r.stderr[-1500:]}")
        write_atomic(side, sha256_file(got[0]).encode())
        os.replace(got[0], dl / got[0].name)
        debs = [dl / got[0].name]
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(work / "deb")], check=True)
    env = dict(os.environ)
    if importlib.util.find_spec("rdata") is None or importlib.util.find_spec("xarray") is None:
        log("austen: pip-installing rdata==1.1.0 (+ deps) into a private folder to read the R data")
        pip("install", "-q", "--no-compile", "--only-binary", ":all:",
            "--target", str(work / "rdata"), "rdata==1.1.0")
        env["PYTHONPATH"] = str(work / "rdata")
    out = work / "austen.json"
    subprocess.run([sys.executable, "-c", _RDATA_SCRIPT,
                    str(work / "deb/usr/lib/R/site-library/janeaustenr/data/Rdata"), str(out)],
                   env=env, check=True)
    books = json.loads(out.read_text())
    return "\n\n".join("\n".join(books[b]).strip("\n") for b in AUSTEN_BOOKS)


def _wikitext(name: str) -> str:
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError(f"corpus {name!r} needs the `datasets` package "
                           "(pip install 'kvqbench[eval]') and the Hugging Face hub") from e
    config = {"wikitext2": "wikitext-2-raw-v1", "wikitext103": "wikitext-103-raw-v1"}[name]
    try:
        ds = datasets.load_dataset("Salesforce/wikitext", config, split="test")
    except Exception as e:  # offline machines: connection errors of several kinds
        raise RuntimeError(f"corpus {name!r} could not be fetched from the Hugging Face hub "
                           f"(offline?): {type(e).__name__}: {str(e)[:300]}. Offline, use "
                           f"'canterbury', 'austen' or a text file path") from e
    return "\n\n".join(ds["text"])  # the usual HF perplexity recipe


def load_corpus(name: str = DEFAULT_CORPUS) -> tuple[str, dict]:
    """Return (text, info) for a corpus name in CORPORA or a path to a UTF-8 text file.

    info: name, description, source, sha256 (of the UTF-8 text), n_chars, path.
    Embedded corpora are extracted once into the cache and refused if the extracted
    text's sha256 differs from the pinned one.
    """
    name = str(name)
    if name not in CORPORA:
        path = Path(name).expanduser()
        if path.is_file():
            text = _decode(path.read_bytes(), str(path))  # verbatim (read_text turns \r\n into \n)
            return text, dict(name=path.name, description="local text file",
                              source=str(path.resolve()), sha256=_sha(text),
                              n_chars=len(text), path=str(path.resolve()))
        raise ValueError(f"unknown corpus {name!r}: not one of {sorted(CORPORA)} and not an "
                         "existing text file")
    spec = CORPORA[name]
    txt, meta = cache_dir() / "corpora" / f"{name}.txt", cache_dir() / "corpora" / f"{name}.json"

    def cached():
        if not meta.exists():
            return None, "not extracted yet"
        info, why = read_meta(meta, **dict.fromkeys(("name", "description", "source", "sha256", "path"), str),
                              n_chars=int)
        if info is None:
            return None, why
        try:
            text = txt.read_bytes().decode("utf-8")
        except (OSError, ValueError) as e:
            return None, f"{txt.name} unreadable ({type(e).__name__})"
        # The text is hashed on every load: the sha256 a run records is that of the text it used.
        ok = info["sha256"] == _sha(text) and spec.get("sha256") in (None, info["sha256"])
        return ((text, info), "") if ok else (None, "its text no longer has the recorded sha256")

    if (hit := cached()[0]) is not None:
        return hit
    with locked(f"corpora/{name}"):
        hit, why = cached()
        if hit is not None:
            return hit
        if meta.exists() or txt.exists():
            log(f"{name}: cached corpus in {txt.parent} failed its check ({why}); extracting it again")
        work = fresh_tmp(f"corpus-{name}")
        try:
            if name == "canterbury":
                text = _canterbury(work)
            elif name == "austen":
                text = _austen(work)
            else:
                text = _wikitext(name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        sha = _sha(text)
        if spec.get("sha256") not in (None, sha):
            raise RuntimeError(f"corpus {name!r}: extracted text has sha256 {sha}, expected "
                               f"{spec['sha256']}; refusing to benchmark on different text")
        info = dict(name=name, description=spec["description"], source=spec["source"],
                    sha256=sha, n_chars=len(text), path=str(txt))
        txt.parent.mkdir(exist_ok=True)
        for path, data in ((txt, text), (meta, json.dumps(info, indent=1))):
            write_atomic(path, data.encode("utf-8"))  # the json (validity) last
        log(f"{name}: {len(text)} characters cached in {txt}")
    return text, info


_TOKENS_MEMO: dict = {}  # one entry per process, on top of the on-disk cache below


def tokenize_text(tokenizer, text: str) -> list[int]:
    """All token ids of text, without special tokens (token_windows adds the
    tokenizer's own prefix to each window). Tokenizing is ~100k chars/s on a small CPU (40 s for
    austen), so fast tokenizers' results are cached on disk, keyed by the text's sha256
    and the sha256 of the tokenizer's full serialisation. A token file is used only if
    its ids decode back to `text` exactly (tens of ms for canterbury): that ties it to
    the hash-checked text, where a hash kept beside the file would vouch only for
    itself (a swapped file with a rewritten hash passed). A file that fails is
    tokenized again; a tokenizer whose own ids do not decode back to the text (a lossy
    normaliser) gets no token file, as its files could not be checked."""
    text_sha = _sha(text)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tok_sha = hashlib.sha256(backend.to_str().encode()).hexdigest() if backend else None
    key = (text_sha, tok_sha or id(tokenizer))
    if key in _TOKENS_MEMO:
        return _TOKENS_MEMO[key]
    path = cache_dir() / "tokens" / f"{text_sha[:16]}-{tok_sha[:16]}.npy" if tok_sha else None
    ids = _load_tokens(path, backend, text) if path is not None else None
    if ids is None:
        # verbose=False: silence "longer than model_max_length" (we cut windows ourselves).
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if path is not None and _spells(backend, ids, text):
            _save_tokens(path, ids)
    _TOKENS_MEMO.clear()
    _TOKENS_MEMO[key] = ids
    return ids


def _spells(backend, ids: list[int], text: str) -> bool:
    """Whether `ids` decode to exactly `text` (the tokenizers backend: no clean-up of spaces)."""
    try:
        return backend.decode(ids, skip_special_tokens=False) == text
    except Exception:  # ids the vocabulary lacks: the backend raises its own error types
        return False


def _load_tokens(path: Path, backend, text: str) -> list[int] | None:
    """Token ids from `path` if they spell `text`, else None."""
    if not path.is_file():
        return None
    try:
        ids = np.load(path, allow_pickle=False).tolist()
        ok = isinstance(ids, list) and all(isinstance(i, int) for i in ids[:1]) and _spells(backend, ids, text)
    except (OSError, ValueError, EOFError):
        ok = False
    if not ok:
        log(f"token cache {path.name} failed its check (its ids do not spell the corpus text); tokenizing again")
        return None
    return ids


def _save_tokens(path: Path, ids: list[int]) -> None:
    import io

    path.parent.mkdir(exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, np.asarray(ids, dtype=np.int32))
    write_atomic(path, buf.getvalue())


def window_starts(n_tokens: int, window: int, n_windows: int, stride=None) -> list[int]:
    """Token offsets of the windows; see token_windows."""
    if window < 1 or n_windows < 1:
        raise ValueError(f"window ({window}) and n_windows ({n_windows}) must be >= 1")
    if stride is None:
        # Evenly spaced over the whole corpus, first at 0, last ending at the final token;
        # requiring n_windows*window tokens keeps them disjoint.
        need = n_windows * window
        if n_tokens < need:
            raise ValueError(f"corpus too short: {n_tokens} tokens, but {n_windows} disjoint "
                             f"windows of {window} need {need}")
        if n_windows == 1:
            return [0]
        return [i * (n_tokens - window) // (n_windows - 1) for i in range(n_windows)]
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    need = (n_windows - 1) * stride + window
    if n_tokens < need:
        raise ValueError(f"corpus too short: {n_tokens} tokens, but {n_windows} windows of "
                         f"{window} at stride {stride} need {need}")
    return [i * stride for i in range(n_windows)]


def special_prefix(tokenizer) -> list[int]:
    """Tokens the tokenizer itself puts before text (Gemma's <bos>; none for SmolLM2 or
    Qwen2.5). Models trained with one need it: Gemma-3 scores canterbury at PPL ~220
    without its <bos> and ~22 with it."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    i = next((k for k in range(len(full)) if full[k:k + len(plain)] == plain), 0)
    return full[:i]


def token_windows(tokenizer, text: str, window: int, n_windows: int,
                  stride=None) -> torch.Tensor:
    """LongTensor [n_windows, window] of token ids: the fixed windows every quantizer is
    scored on.

    The whole text is tokenized once without special tokens (N tokens). Each window is
    the tokenizer's own special prefix (its BOS if it adds one by default, e.g. Gemma;
    nothing for SmolLM2/Qwen2.5), then L = window - len(prefix) consecutive corpus
    tokens. With stride=None (the default) the windows are spread evenly over the whole
    corpus: window i starts at token i*(N-L)//(n_windows-1), so the first starts at 0
    and the last ends at the corpus's end; N must be >= n_windows*L so they never
    overlap. With an integer stride, window i starts at i*stride (stride=L gives
    contiguous windows from the start). Deterministic: same tokenizer and text, same
    windows. Raises ValueError if the corpus is too short.
    """
    prefix = special_prefix(tokenizer)
    body = window - len(prefix)
    if body < 1:
        raise ValueError(f"window {window} leaves no room after the {len(prefix)} special tokens")
    ids = tokenize_text(tokenizer, text)
    starts = window_starts(len(ids), body, n_windows, stride)
    return torch.tensor([prefix + ids[s:s + body] for s in starts], dtype=torch.long)
