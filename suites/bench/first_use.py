"""Where a fresh machine's extra seconds go: every Triton compile a run meets, timed and
attributed to the compare row that met it (a diagnostic of the main-job benchmark,
`bench_compare.py`, recorded in its `extra_info`; nothing in the package depends on it).

Triton calls `knobs.runtime.jit_cache_hook` before it compiles a kernel specialisation it
has not met in this process (the on-disk cache is looked up inside that compile, so a
warm cache shows as short compiles) and `jit_post_compile_hook` after; the first launch of
a compiled kernel then loads its module and builds its launcher (`_init_handles`), timed
too. Triton versions without these hooks record nothing (`available` False).

What is neither a compile nor an init shows in `StackSampler`: the main thread's Python
stack sampled from a second thread every few milliseconds while the row label matches a
pattern (no tracing, so the rows run at their own speed), summed per function.
"""
from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from contextlib import contextmanager


class FirstUseLog:
    def __init__(self):
        self.row = "startup"
        self.events: list[dict] = []  # {"row", "kernel", "compile_s"} and {"row", "init_s"}
        self.available = False
        self._started: dict[str, float] = {}
        self._undo: list = []

    # -- Triton hooks ----------------------------------------------------------------------
    # keyword arguments as Triton 3.4-3.9 pass them (key, repr, fn, compile, ...); a version that
    # passes others loses its events, never the run
    def _before(self, **kw):
        self._started[str(kw.get("key"))] = time.perf_counter()
        return False  # a true value would tell Triton to skip the compile

    def _after(self, **kw):
        t0 = self._started.pop(str(kw.get("key")), None)
        if t0 is not None:
            name = getattr(kw.get("fn"), "name", None) or str(kw.get("repr", "?")).split("[")[0]
            self.events.append({"row": self.row, "kernel": name, "compile_s": time.perf_counter() - t0})

    @contextmanager
    def installed(self):
        try:
            from triton import knobs
            from triton.compiler.compiler import CompiledKernel
        except ImportError:
            yield self
            return
        rt = knobs.runtime
        if not (hasattr(rt, "jit_cache_hook") and hasattr(CompiledKernel, "_init_handles")):
            yield self
            return
        self.available = True
        old = (rt.jit_cache_hook, rt.jit_post_compile_hook, CompiledKernel._init_handles)
        init = CompiledKernel._init_handles
        log = self

        def timed_init(kernel):
            fresh = getattr(kernel, "module", None) is None  # Triton sets it on the first call
            t0 = time.perf_counter()
            init(kernel)
            if fresh:
                log.events.append({"row": log.row, "kernel": getattr(kernel, "name", "?"),
                                   "init_s": time.perf_counter() - t0})

        rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after
        CompiledKernel._init_handles = timed_init
        try:
            yield self
        finally:
            rt.jit_cache_hook, rt.jit_post_compile_hook, CompiledKernel._init_handles = old

    # -- summaries -------------------------------------------------------------------------
    def since(self, start: int) -> dict:
        """Totals of the events from index `start` on (one round): compiles, seconds, and
        per row and per kernel (the largest first)."""
        ev = self.events[start:]
        rows, kernels = collections.defaultdict(lambda: [0, 0.0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            r = rows[e["row"]]
            if "compile_s" in e:
                r[0] += 1
                r[1] += e["compile_s"]
                kernels[e["kernel"]][0] += 1
                kernels[e["kernel"]][1] += e["compile_s"]
            else:
                r[2] += e["init_s"]
        by_time = lambda d: sorted(d.items(), key=lambda kv: -sum(kv[1][1:]))  # noqa: E731
        return {
            "available": self.available,
            "compiles": sum(1 for e in ev if "compile_s" in e),
            "compile_s": round(sum(e.get("compile_s", 0.0) for e in ev), 2),
            "first_launch_init_s": round(sum(e.get("init_s", 0.0) for e in ev), 2),
            "rows": {k: {"compiles": n, "compile_s": round(c, 2), "init_s": round(i, 2)}
                     for k, (n, c, i) in by_time(rows)},
            "kernels": {k: {"compiles": n, "compile_s": round(c, 2)} for k, (n, c) in by_time(kernels)},
        }


class StackSampler:
    """Samples the calling thread's stack every `interval` s while `log.row` matches
    `pattern` (a regular expression), from a daemon thread; `report()` gives, per sampled
    row, the sample count, the functions most often on the stack (inclusive: a function
    counts once per sample however deep) and the innermost Python functions (`leaf`: where
    the time is, C calls included), each as its share of the row's samples."""

    def __init__(self, log: FirstUseLog, pattern: str, interval: float = 0.005, below: str | None = None):
        self.log, self.pattern, self.interval = log, re.compile(pattern), interval
        self.below = below  # a function name: only the frames it called count (the row's own work)
        self.target = threading.get_ident()
        self.samples: dict[str, int] = collections.Counter()
        self.on_stack: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")

    def _run(self):
        while not self._stop.wait(self.interval):
            row = self.log.row
            if not self.pattern.search(row):
                continue
            frame = sys._current_frames().get(self.target)
            names = []
            while frame is not None and frame.f_code.co_name != self.below:
                code = frame.f_code
                names.append(f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} {code.co_name}")
                frame = frame.f_back
            if not names or (self.below and frame is None):  # outside the boundary: between rows
                continue
            self.samples[row] += 1
            self.on_stack[row].update(set(names))
            self.leaf[row][names[0]] += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 25) -> dict:
        return {row: {"samples": n, "interval_s": self.interval,
                      "on_stack": {f: round(c / n, 3) for f, c in self.on_stack[row].most_common(top)},
                      "leaf": {f: round(c / n, 3) for f, c in self.leaf[row].most_common(top)}}
                for row, n in self.samples.items()}
