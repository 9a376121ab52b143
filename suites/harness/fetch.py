"""The on-disk cache every fetched or converted artefact lives in, and the helpers that
fill it safely: a cross-process lock per item, an empty work folder on the same
filesystem (so the final rename is atomic), sha256 of files, progress lines, and pip
of this interpreter. `models.py` and `corpora.py` build on these.

Cache root: $KVQBENCH_CACHE or ~/.cache/kvqbench.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

def cache_dir() -> Path:
    root = Path(os.environ.get("KVQBENCH_CACHE") or Path.home() / ".cache" / "kvqbench")
    root.mkdir(parents=True, exist_ok=True)
    return root


def log(msg: str) -> None:
    # Progress of slow first-time steps; stderr keeps stdout clean for reports.
    print(f"[kvqbench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(rel: str):
    """Exclusive flock across processes (two runs, xdist workers) for first-time work."""
    path = cache_dir() / f"{rel}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
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


def pip(*args: str) -> None:
    """pip of this interpreter; its output is shown only when it fails."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
