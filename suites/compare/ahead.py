"""The compare's use of kernels/precompile.py: Triton specialisations compiled ahead in a
thread pool while the first rows run, and what the rows compile recorded for the next run."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch


class AheadRun:
    """What `triton_ahead` yields: `row(spec)` names the row whose compiles are recorded;
    `pool` is the preloading (None when off)."""

    def __init__(self, recorder=None, pool=None):
        self.recorder, self.pool = recorder, pool

    def row(self, spec: str) -> None:
        if self.recorder is not None:
            self.recorder.label = spec


@contextmanager
def triton_ahead(args, device, model_info, plan, specs, record: bool = True):
    """The compare's use of kernels/precompile.py. On a CUDA run, the Triton specialisations a
    run of the same shape compiled before (`<cache>/triton_ahead/`; on a machine that has none,
    the copy the package ships for the default job, `precompile.SHIPPED`) compile in a thread
    pool while the first rows run, and what this run's rows compile is recorded per spec for the
    next run. Yields an `AheadRun` (the loop calls its `row` with each row's spec). Off with
    KVQBENCH_PRECOMPILE_THREADS=0, on a CPU, or where `precompile.supported()` says why not.
    Under torchrun every rank preloads (the kernels must be in each process's memory; a
    specialisation one rank compiled, the others load from Triton's disk cache) and rank 0
    alone records (`record=False` elsewhere: one writer of the manifest). It changes when
    kernels compile, never a figure."""
    from ...kernels import precompile as P

    threads = int(os.environ.get("KVQBENCH_PRECOMPILE_THREADS") or P.default_threads())  # checked by validate
    device = None if device is None else torch.device(device)  # the plan names it as a string
    if device is None or device.type != "cuda" or threads <= 0 or P.supported() is not None:
        yield AheadRun()
        return
    from ..harness.fetch import cache_dir, write_atomic

    shape = {k: model_info.get(k) for k in ("name", "sha256", "n_heads", "n_kv_heads", "head_dim", "dtype")}
    shape.update(lengths=plan["lengths"], windows=args.windows, batch_size=args.batch_size,
                 context=args.context, decode_tokens=args.decode_tokens,
                 capability=list(torch.cuda.get_device_capability(device)))
    name = P.manifest_name(shape)
    manifest = P.Manifest(cache_dir() / "triton_ahead" / name, shape)
    if not manifest.entries:
        manifest.entries = P.Manifest(P.SHIPPED / name, shape).entries
    pool = P.preload(manifest, list(dict.fromkeys(specs)), threads)
    if not record:
        try:
            yield AheadRun(None, pool)
        finally:
            pool.close()
        return
    rec = P.Recorder()
    try:
        with rec.installed():
            yield AheadRun(rec, pool)
    finally:
        pool.close()
        s = pool.summary()
        manifest.merge(rec.seen, set(pool.failed))
        try:
            manifest.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(manifest.path, manifest.dumps())
        except OSError as e:
            print(f"kvqbench: could not save {manifest.path}: {e}", file=sys.stderr)
        took = "" if s["seconds"] is None else f" in {s['seconds']} s"
        print(f"Triton ahead ({manifest.path.name}): {s['preloaded']} of {s['submitted']} specialisations "
              f"compiled by the pool{took}, {s['failed']} stale; the rows met "
              f"{sum(map(len, rec.seen.values()))} not yet in memory (compiled, or loaded from Triton's disk cache)",
              file=sys.stderr)
