"""results.json of one `kvqbench compare` run: one writer at a time, never half a file,
and resumed only by a run that would measure the same figures.

- A lock file beside it (filelock) is held for the whole run: a second run into the
  same folder waits `LOCK_WAIT_S` and then refuses with a message that says why.
- Every save is a unique temp file + fsync + atomic rename (`fetch.write_atomic`).
- The run's identity is everything that changes a figure: model and corpus bytes,
  windows, protocols and their parameters, dtype, device, library versions. A rerun
  resumes only when it is equal; otherwise it refuses and names `--fresh`.
"""
from __future__ import annotations

import json
from pathlib import Path

from filelock import FileLock, Timeout

from ..harness.fetch import write_atomic

LOCK_WAIT_S = 10.0


class RunError(Exception):
    """A run that cannot go on for a reason the user can fix; the message says how."""


def identity(meta: dict) -> dict:
    """What must match for a rerun to resume (not, say, how long the model took to load)."""
    m, c, hw, v = meta["model"], meta["corpus"], meta.get("hardware", {}), meta.get("versions", {})
    return {
        "model": [m.get("name"), m.get("sha256")], "corpus": [c.get("name"), c.get("sha256")],
        "windows": {k: meta["windows"].get(k) for k in ("n", "tokens", "starts")},
        "protocols": list(meta["protocols"]),
        "prefill_then_decode": meta.get("prefill_then_decode")
        if {"prefill-then-decode", "deployed"} & set(meta["protocols"]) else None,
        "fidelity": meta.get("fidelity"),
        "dtype": meta.get("dtype"), "device": hw.get("device"), "gpu": hw.get("gpu"),
        "attn_implementation": m.get("attn_implementation"), "batch_size": meta.get("batch_size"),
        # Last-bit float differences flip rounding decisions (issue 13: int4 moved 1.8%
        # between two machines with equal fp16), so library versions are part of it.
        "torch": v.get("torch"), "transformers": v.get("transformers"),
    }


def _differences(old: dict, new: dict) -> list[str]:
    return [f"{k}: {json.dumps(old.get(k))[:60]} -> {json.dumps(new.get(k))[:60]}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


class Run:
    """meta + one record per (protocol, spec, seed); use as a context manager, which
    holds the folder's lock from reading results.json to the last save."""

    def __init__(self, folder: Path, meta: dict, fresh: bool):
        self.folder, self.path = Path(folder), Path(folder) / "results.json"
        self.meta, self.fresh = meta, fresh
        self.data = {"meta": meta, "results": [], "diagnostics": None}
        self.lock = FileLock(str(self.path) + ".lock")

    def __enter__(self) -> "Run":
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire(timeout=LOCK_WAIT_S)
        except Timeout:
            raise RunError(f"another kvqbench compare is writing {self.path} (lock {self.lock.lock_file} held "
                           f"for more than {LOCK_WAIT_S:.0f} s); wait for it to finish, or write elsewhere "
                           "with --run NAME or --out DIR") from None
        try:
            self._resume()
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    def _resume(self) -> None:
        if self.fresh or not self.path.exists():
            return
        try:
            old = json.loads(self.path.read_text(encoding="utf-8"))
            old_id, results = identity(old["meta"]), old["results"]
            if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
                raise TypeError("'results' is not a list of records")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RunError(f"{self.path} is not a readable results file ({type(e).__name__}: {str(e)[:120]}); "
                           "rerun with --fresh to start this run over (its old results are discarded), "
                           "or move the file away") from None
        diff = _differences(old_id, identity(self.meta))
        if diff:
            raise RunError(f"{self.path} holds a run measured under other settings ({'; '.join(diff[:4])}); "
                           "rerun with --fresh to overwrite it, or use --run NAME for a new run")
        self.data["results"] = [r for r in results if "error" not in r]  # failures are retried
        self.data["diagnostics"] = old.get("diagnostics")
        if isinstance(old.get("fidelity"), dict):  # generation fidelity, per spec (run.py _fidelity)
            self.data["fidelity"] = old["fidelity"]

    def done(self, protocol: str, spec: str, seed: int) -> bool:
        return any((r["protocol"], r["spec"], r["seed"]) == (protocol, spec, seed) for r in self.data["results"])

    def add(self, record: dict) -> None:
        self.data["results"].append(record)
        self.save()

    def save(self) -> None:
        if not self.lock.is_locked:
            raise RuntimeError("Run.save outside `with Run(...)`: results.json is written under its lock only")
        write_atomic(self.path, json.dumps(self.data, indent=1).encode("utf-8"))

    def failures(self) -> list[str]:
        """One line per failed configuration or lm-eval request of this run."""
        out = [f"{r['protocol']} {r['spec']} seed {r['seed']}: {r['error']}" for r in self.data["results"]
               if "error" in r]
        out += [f"lm-eval {r['spec']}: {r['lm_eval']['error']}" for r in self.data["results"]
                if "error" in r.get("lm_eval", {})]
        rows = (self.data.get("fidelity") or {}).get("rows", {})
        out += [f"fidelity {spec}: {f['error']}" for spec, f in rows.items() if "error" in f]
        return out
