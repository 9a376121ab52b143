"""Triton specialisations compiled ahead, in threads, from a manifest of what a run of the
same shape compiled before.

Why: on a machine whose Triton cache is empty (a fresh GPU runner, or any commit that changes
a kernel's source, which changes every key of that kernel) a run compiles each kernel
specialisation the first time a launch meets it, one after another in the main thread: the
main job on the H200 spent 32-39 s of its cold round that way while 15 of 16 cores idled
(reports/decode/compare_both_h200.md).

How: Triton's `jit_cache_hook` receives, before each compile, the specialisation's
`specialization_data` (JSON: kernel name, signature, constexprs, attributes, options, target).
`Recorder` collects them per label (the compare's quantizer spec); `Manifest` keeps them in a
JSON file; `preload` compiles each in a thread pool into Triton's ON-DISK cache only, through
`JITFunction.preload`'s own decoding of the data with its last step (`_do_compile`, which also
puts the kernel into the JIT's in-memory cache) replaced by a plain compile. The launch that
later meets the key misses in memory, finds the binary on disk and loads it (milliseconds)
instead of compiling it (seconds). The in-memory cache is left to the main thread on purpose:
a second CompiledKernel for a key the main thread already launched would replace its object,
and Triton unloads the module of a collected CompiledKernel, under any CUDA graph holding it.
A stale entry (a kernel whose parameters changed) fails to compile and is counted; one whose
key no longer matches compiles a binary nobody loads. Either way results cannot differ: the
JIT only ever loads the binary of its own key.

Nothing here runs without a CUDA device and a Triton that has the hook and `preload` (the
interpreter compiles nothing): `supported()` says why not.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import importlib
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

FORMAT = 1
MAX_PER_LABEL = 64  # a bound on what one label preloads (the default compare's worst is 6)
SHIPPED = Path(__file__).parent / "triton_ahead"  # manifests the package carries for fresh machines


def manifest_name(shape: dict) -> str:
    """The file name of the manifest for a run of this shape (a hash of it): the same in
    the cache and in SHIPPED."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16] + ".json"


def supported() -> str | None:
    """None when specialisations can be recorded and preloaded here, else why not."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton runs in the interpreter (nothing is compiled)"
    try:
        import torch
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        return f"Triton is not importable ({e})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not hasattr(knobs.runtime, "jit_cache_hook") or not hasattr(JITFunction, "preload"):
        return "this Triton has no jit_cache_hook / JITFunction.preload"
    return None


class Recorder:
    """Collects the `specialization_data` of every compile a launch triggers while installed,
    under the current `label`; chains any hook installed before it (e.g. the benchmark's
    first-use log). A hook call means an in-memory miss of the JIT: a compile, or a load from
    Triton's on-disk cache (what `preload` leaves there). Manual `warmup` calls are not recorded."""

    def __init__(self):
        self.label: str | None = None
        self.seen: dict[str, list[str]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def _hook(self, previous, **kw):
        data = (kw.get("compile") or {}).get("specialization_data")
        if data and self.label is not None and not kw.get("is_manual_warmup"):
            with self._lock:
                if data not in self.seen[self.label]:
                    self.seen[self.label].append(data)
        return previous(**kw) if previous is not None else False  # True would skip the compile

    @contextmanager
    def installed(self):
        from triton import knobs

        rt = knobs.runtime
        previous = rt.jit_cache_hook
        rt.jit_cache_hook = lambda **kw: self._hook(previous, **kw)
        try:
            yield self
        finally:
            rt.jit_cache_hook = previous


class Manifest:
    """{label: [specialization_data, ...]} for one run shape, read from a JSON file; `dumps()`
    gives the file's bytes for the caller to write (atomically). A file that does not parse, or
    of another format or shape, reads as empty (it only ever saves time)."""

    def __init__(self, path: Path, shape: dict):
        self.path, self.shape = Path(path), shape
        self.entries: dict[str, list[str]] = {}
        try:
            d = json.loads(self.path.read_text())
            if d.get("format") == FORMAT and d.get("shape") == shape:
                self.entries = {k: list(v)[-MAX_PER_LABEL:] for k, v in d["entries"].items()}
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass

    def merge(self, seen: dict[str, list[str]], failed: set[str] = frozenset()) -> None:
        """Drop entries that failed to preload; add what a run met (the newest kept)."""
        self.entries = {label: [x for x in datas if x not in failed] for label, datas in self.entries.items()}
        for label, datas in seen.items():
            kept = self.entries.setdefault(label, [])
            self.entries[label] = (kept + [x for x in datas if x not in kept])[-MAX_PER_LABEL:]

    def dumps(self) -> bytes:
        return json.dumps({"format": FORMAT, "shape": self.shape, "entries": self.entries}, indent=0).encode()


def _kernel(full_name: str):
    """The JITFunction `package.module.name` names (the name Triton serialises)."""
    module, _, attr = full_name.rpartition(".")
    obj = importlib.import_module(module)
    return getattr(obj, attr)


def stale(data: str) -> str | None:
    """Why a recorded specialisation no longer fits its kernel (None: it does): the kernel is
    gone, or its parameters are not the ones recorded (a parameter added since: the entry
    cannot compile, and costs a failed compile on every fresh machine)."""
    d = json.loads(data)
    try:
        names = list(_kernel(d["name"]).arg_names)
    except (ImportError, AttributeError) as e:
        return f"{d['name']}: {e}"
    if list(d["signature"]) != names:
        missing = [n for n in names if n not in d["signature"]]
        extra = [n for n in d["signature"] if n not in names]
        return f"{d['name']}: parameters differ (missing {missing}, gone {extra})"
    return None


class _DiskOnly:
    """A JITFunction as `JITFunction.preload` sees it, except that its final step compiles into
    the on-disk cache and keeps nothing (see the module's docstring for why). The CompiledKernel
    it drops was never loaded (Triton loads a module at its first launch), so dropping it
    unloads nothing."""

    def __init__(self, fn):
        self._fn = fn

    def __getattr__(self, name):
        return getattr(self._fn, name)

    def _do_compile(self, key, signature, device, constexprs, options, attrs, *_, **__):
        target = self._fn.device_caches[device][2]
        self._fn.compile(self._fn.ASTSource(self._fn, signature, constexprs, attrs), target=target,
                         options=options.__dict__)


class Preloading:
    """The thread pool's work: `wait()` for it, `summary()` of it. The pool's threads are
    daemons of a sort: `close()` cancels what has not started and does not wait."""

    def __init__(self, datas: list[str], threads: int):
        self.t0 = time.perf_counter()
        self.failed: dict[str, str] = {}
        self.done = 0
        self.seconds = None
        self._lock = threading.Lock()
        self._n = len(datas)  # before any task can finish and look
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads),
                                                           thread_name_prefix="kvqbench-precompile")
        self._futures = [self._pool.submit(self._one, d) for d in datas]

    def _one(self, data: str) -> None:
        error = None
        try:
            from triton.runtime.jit import JITFunction

            why = stale(data)  # (counted without the compile it would fail)
            if why:
                error = f"stale: {why}"[:200]
            else:
                JITFunction.preload(_DiskOnly(_kernel(json.loads(data)["name"])), data)
        except Exception as e:  # foreign, or refused by Triton: counted, never used
            error = f"{type(e).__name__}: {e}"[:200]
        with self._lock:
            if error is None:
                self.done += 1
            else:
                self.failed[data] = error
            if self.done + len(self.failed) == self._n:
                self.seconds = time.perf_counter() - self.t0

    def wait(self, timeout: float | None = None) -> None:
        concurrent.futures.wait(self._futures, timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def summary(self) -> dict:
        return {"submitted": self._n, "preloaded": self.done, "failed": len(self.failed),
                "seconds": None if self.seconds is None else round(self.seconds, 2),
                "first_errors": sorted(set(self.failed.values()))[:3]}


def preload(manifest: Manifest, labels: list[str], threads: int) -> Preloading:
    """Start compiling every entry of `labels` in `threads` threads (returns at once)."""
    datas, seen = [], set()
    for label in labels:
        for d in manifest.entries.get(label, []):
            if d not in seen:
                seen.add(d)
                datas.append(d)
    return Preloading(datas, threads)


def default_threads() -> int:
    """Half the cores, at most 8: ptxas and LLVM run outside the GIL, Triton's front end inside it,
    so more threads mostly contend with the run's own host work."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))
