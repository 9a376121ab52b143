"""The on-disk cache every fetched or converted artefact lives in, and the helpers that
fill it safely and check what it serves:

- `locked`: a cross-process lock per item (filelock), so two runs never build one item;
- `fresh_tmp`: an empty work folder on the cache's filesystem (the final rename is atomic);
- `download`: a file by URL into the cache, sha256-checked BEFORE anyone opens it;
- `index_file`: a release file's URL and sha256 from the package index pip is configured
  with (PEP 691 JSON simple API, PEP 503 HTML as the fallback), so data is fetched
  without running any package's build code;
- `manifest` / `check_manifest`: sha256, size and mtime of every file of a cached folder,
  recorded when it is made and checked when it is served (size+mtime cheaply, the full
  hash when they differ or when asked; models.py hashes what it loads on top of this);
- `read_meta`: a cache's JSON record, or why it is unusable (missing, unparsable, or
  parsable but of the wrong shape: all mean "make the item again", never a crash);
- `pip` of this interpreter, `log` lines for slow first-time steps.

Cache root: $KVQBENCH_CACHE or ~/.cache/kvqbench.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from filelock import FileLock

PYPI_SIMPLE = "https://pypi.org/simple"
LOCK_WAIT_S = 3600  # a first-time model conversion may take minutes on a small CPU


def cache_dir() -> Path:
    root = Path(os.environ.get("KVQBENCH_CACHE") or Path.home() / ".cache" / "kvqbench")
    root.mkdir(parents=True, exist_ok=True)
    return root


def log(msg: str) -> None:
    # Progress of slow first-time steps; stderr keeps stdout clean for reports.
    print(f"[kvqbench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(rel: str, timeout: float = LOCK_WAIT_S):
    """Exclusive lock across processes (two runs, xdist workers) for first-time work."""
    path = cache_dir() / f"{rel}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path), timeout=timeout):
        yield


def fresh_tmp(tag: str) -> Path:
    """Empty work folder in the cache (same filesystem, so the final rename is atomic).
    Call it only under the item's lock: it clears what an interrupted run left."""
    tmp = cache_dir() / f".tmp-{tag}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _umask_mode(tmp: str) -> None:
    # mkstemp creates 0600 files; give the final file the mode open() would have.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a unique temp file + fsync + rename: readers see
    the old file or the new one, never half of one, and concurrent writers never share
    a temp file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        _umask_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# --- verified cache folders ----------------------------------------------------------------

def manifest(folder: Path, skip: tuple[str, ...] = ()) -> dict:
    """{relative path: {sha256, size, mtime_ns}} of every file under `folder`."""
    folder = Path(folder)
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in skip:
            st = p.stat()
            out[rel] = {"sha256": sha256_file(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def read_meta(path: Path, /, **fields: type) -> tuple[dict | None, str]:
    """(the JSON object in `path`, "") if it parses and each of `fields` has its type,
    else (None, why). Valid JSON of another shape (`[1, 2, 3]`, a field missing or of
    the wrong type) is a damaged record like any other, for the caller to rebuild."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path.name} missing"
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, f"{path.name} unreadable ({type(e).__name__})"
    if not isinstance(meta, dict):
        return None, f"{path.name} holds a JSON {type(meta).__name__}, not an object"
    bad = [k for k, t in fields.items() if not isinstance(meta.get(k), t)]
    if bad:
        return None, f"{path.name} lacks a valid {', '.join(bad)}"
    return meta, ""


def _valid_record(want) -> bool:
    return isinstance(want, dict) and isinstance(want.get("sha256"), str) \
        and all(isinstance(want.get(k), int) for k in ("size", "mtime_ns"))


def check_manifest(folder: Path, files: dict, full: bool = False) -> str | None:
    """None if every file of `files` (a `manifest`) is in `folder` with its recorded
    content, else why not. A file whose size and mtime are as recorded is trusted
    without hashing unless `full`: a changed size or mtime costs a full hash."""
    if not files or not isinstance(files, dict):
        return "no file hashes recorded"
    if not all(_valid_record(w) for w in files.values()):
        return "malformed file records"
    for rel, want in files.items():
        p = Path(folder) / rel
        try:
            st = p.stat()
        except OSError:
            return f"{rel} is missing"
        if st.st_size != want["size"]:
            return f"{rel} has {st.st_size} bytes, {want['size']} were recorded"
        if full or st.st_mtime_ns != want["mtime_ns"]:
            got = sha256_file(p)
            if got != want["sha256"]:
                return f"{rel} has sha256 {got[:16]}..., {want['sha256'][:16]}... was recorded"
    return None


# --- downloads -----------------------------------------------------------------------------

def pip_index_urls() -> list[str]:
    """The package indexes pip is configured with (index-url first, then extra ones),
    from PIP_INDEX_URL / PIP_EXTRA_INDEX_URL or `pip config list`; PyPI by default."""
    env = {k: os.environ.get(k, "") for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    conf: dict[str, list[str]] = {"index-url": [], "extra-index-url": []}
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                           text=True, timeout=60)
        for line in r.stdout.splitlines():  # e.g. global.index-url='https://...'
            m = re.fullmatch(r"[^.]*\.(index-url|extra-index-url)='(.*)'", line.strip())
            if m:
                conf[m.group(1)] += m.group(2).split()
    except (OSError, subprocess.SubprocessError):
        pass
    main = env["PIP_INDEX_URL"].split() or conf["index-url"][:1] or [PYPI_SIMPLE]
    extra = env["PIP_EXTRA_INDEX_URL"].split() or conf["extra-index-url"]
    return list(dict.fromkeys(main + extra))


def _index_page(index: str, project: str) -> tuple[list[dict], str]:
    """Files of `project` on one index as [{filename, url, sha256}], and the page URL."""
    page = f"{index.rstrip('/')}/{project}/"
    if page.startswith("file:"):  # a local index (a folder per project holding index.html)
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(page).path))
        body, kind = (local / "index.html").read_text(encoding="utf-8"), "text/html"
    else:
        req = urllib.request.Request(page, headers={
            "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = resp.read().decode("utf-8")
            kind = resp.headers.get("Content-Type", "")
    if "json" in kind or body.lstrip().startswith("{"):
        files = [{"filename": f["filename"], "url": urllib.parse.urljoin(page, f["url"]),
                  "sha256": f.get("hashes", {}).get("sha256")} for f in json.loads(body)["files"]]
    else:  # PEP 503 HTML: <a href="URL#sha256=HEX">filename</a>
        files = []
        for href, name in re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body):
            url, _, frag = href.partition("#")
            files.append({"filename": name.strip(), "url": urllib.parse.urljoin(page, url),
                          "sha256": frag.split("=", 1)[1] if frag.startswith("sha256=") else None})
    return files, page


def index_file(project: str, filename: str) -> str:
    """URL of release file `filename` of `project` on the first configured index that
    lists it. Nothing is downloaded or run here; `download` checks the bytes."""
    tried = []
    for index in pip_index_urls():
        try:
            files, page = _index_page(index, project)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # also JSON of the wrong shape
            tried.append(f"{index} ({type(e).__name__}: {str(e)[:120]})")
            continue
        for f in files:
            if f["filename"] == filename:
                return f["url"]
        tried.append(f"{page} (no {filename})")
    raise RuntimeError(f"{filename} not found on any configured package index: {'; '.join(tried)}")


def download(url: str, dest: Path, sha256: str) -> Path:
    """Fetch `url` to `dest`, keeping it only if its sha256 is `sha256` (checked before
    the file is opened by anything else). A `dest` already there is re-checked and
    fetched again if it does not match (e.g. truncated by an interrupted run)."""
    dest = Path(dest)
    if dest.is_file():
        got = sha256_file(dest)
        if got == sha256:
            return dest
        log(f"cached {dest.name} has sha256 {got[:16]}..., expected {sha256[:16]}...: fetching it again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading {url}")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=120) as resp:
            for block in iter(lambda: resp.read(1 << 20), b""):
                h.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != sha256:
            raise RuntimeError(f"{url}: sha256 {h.hexdigest()}, expected {sha256}; refusing to use it")
        _umask_mode(tmp)
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return dest


def pip(*args: str) -> None:
    """pip of this interpreter; its output is shown only when it fails."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
