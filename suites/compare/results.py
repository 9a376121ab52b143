"""results.json of one `kvqbench compare` run: one writer at a time, never half a file,
and resumed only by a run that would measure the same figures.

- A lock file beside it (filelock) is held for the whole run: a second run into the
  same folder waits `LOCK_WAIT_S` and then refuses with a message that says why.
- Every save is a unique temp file + fsync + atomic rename (`fetch.write_atomic`).
- The run's identity is everything that changes a figure: model and corpus bytes,
  windows, protocols and their parameters, dtype, device, library versions. A rerun
  resumes only when it is equal; otherwise it refuses and names `--fresh`.
- A record counts as measured only when it is well formed (`row_problem`) and was made
  by the code that would measure it now (`Run.done`'s stamp: the quantizer's class and
  resolved config, kvqbench's version and commit, the plugin's distribution version;
  for a calibrated spec also its calibration windows, `calibration_stamps`); any other
  is measured again and replaced. Fields this version does not know (written
  by a newer one) are kept on save.
"""
from __future__ import annotations

import json
import math
import sys
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


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# (key, test, what it must be) for every record, then for a measured (not failed) one:
# the fields resume and the report read.
_KEY_FIELDS = (("protocol", lambda v: isinstance(v, str), "a string"),
               ("spec", lambda v: isinstance(v, str), "a string"),
               ("seed", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"))
_MEASURED_FIELDS = (("ppl", lambda v: _number(v) and v > 0, "a finite number > 0"),
                    ("nll_sum", _number, "a finite number"), ("bits_per_element", _number, "a finite number"),
                    ("formula_bits", _number, "a finite number"), ("family", lambda v: isinstance(v, str), "a string"),
                    ("wall_s", _number, "a finite number"),
                    ("lm_eval", lambda v: isinstance(v, dict), "an object"),
                    # the cache's own bits and the model constants (quantizers/base.py), written since
                    # they were split; a record made before has only `bits_per_element`, the total
                    ("cache_bits_per_element", _number, "a finite number"),
                    ("constant_nbytes", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                     "an integer >= 0"))
# Measured fields a record may lack: lm_eval (only with --lm-eval); the split of the bits
# (records made before it still load, and the report falls back to their total bits).
_OPTIONAL_FIELDS = ("lm_eval", "cache_bits_per_element", "constant_nbytes")


def row_problem(r) -> str | None:
    """Why record `r` of results.json cannot be used (None: it can)."""
    if not isinstance(r, dict):
        return f"is a {type(r).__name__}, not an object"
    failed = "error" in r
    for key, ok, what in _KEY_FIELDS + ((("error", lambda v: isinstance(v, str), "a string"),) if failed
                                        else _MEASURED_FIELDS):
        if key not in r:
            if key not in _OPTIONAL_FIELDS:
                return f"has no {key!r}"
        elif not ok(r[key]):
            return f"has {key} = {json.dumps(r[key])[:40]}, not {what}"
    return None


def _row_name(i: int, r) -> str:
    g = r.get if isinstance(r, dict) else (lambda k: None)
    return f"record {i} ({g('protocol')} {g('spec')} seed {g('seed')})"


# meta keys this version writes only on some runs: an old value must not outlive its run.
_OWN_OPTIONAL_META = ("distributed",)
# top-level keys this version reads and writes itself; any other is kept as it was.
_OWN_TOP = ("meta", "results", "diagnostics", "fidelity")


def stamp_matches(r: dict, stamp: dict | None) -> bool:
    """Was record `r` made by the code `stamp` describes? The working tree's `dirty` flag
    is not compared: it says nothing of which edits, and a development checkout must
    still resume after Ctrl-C."""
    if stamp is None:
        return True
    strip = lambda v: {k: x for k, x in v.items() if k != "dirty"} if isinstance(v, dict) else v  # noqa: E731
    return all(strip(r.get(k)) == strip(v) for k, v in stamp.items())


def calibration_stamps(stamps: dict, meta: dict, calibrated: list[str]) -> dict:
    """`stamps` (spec -> stamp) with the run's calibration windows (meta["calibration"]:
    count, tokens, ranges) added to the stamps of the `calibrated` specs: their rows, and
    their fidelity, are measured again when a rerun calibrates on other windows (other
    --calibration-windows, --window, corpus ranges); other specs' stamps are unchanged."""
    cal = meta.get("calibration")
    if not calibrated:
        return stamps
    if not isinstance(cal, dict):
        raise ValueError(f"calibrated specs {calibrated} but no meta['calibration'] to stamp their rows with")
    mark = {k: cal.get(k) for k in ("n", "tokens", "ranges")}
    return {spec: ({**st, "calibration": mark} if spec in calibrated else st) for spec, st in stamps.items()}


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
            if not isinstance(results, list):
                raise TypeError("'results' is not a list of records")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RunError(f"{self.path} is not a readable results file ({type(e).__name__}: {str(e)[:120]}); "
                           "rerun with --fresh to start this run over (its old results are discarded), "
                           "or move the file away") from None
        diff = _differences(old_id, identity(self.meta))
        if diff:
            raise RunError(f"{self.path} holds a run measured under other settings ({'; '.join(diff[:4])}); "
                           "rerun with --fresh to overwrite it, or use --run NAME for a new run")
        kept = []
        for i, r in enumerate(results):
            why = row_problem(r)
            if why:  # never counted as measured, never in the report: measured again if this run has it
                print(f"kvqbench compare: warning: {self.path}: {_row_name(i, r)} {why}; dropped "
                      "(measured again when this run includes it)", file=sys.stderr)
            elif "error" not in r:  # failures are retried
                kept.append(r)
        self.data["results"] = kept
        self.data["diagnostics"] = old.get("diagnostics")
        if isinstance(old.get("fidelity"), dict):  # generation fidelity, per spec (run.py _fidelity)
            self.data["fidelity"] = old["fidelity"]
        # What a newer version wrote is kept, not dropped on the next save.
        self.data.update({k: v for k, v in old.items() if k not in _OWN_TOP})
        self.data["meta"] = {**{k: v for k, v in old["meta"].items() if k not in _OWN_OPTIONAL_META},
                             **self.meta}

    def done(self, protocol: str, spec: str, seed: int, stamp: dict | None = None) -> bool:
        """Is (protocol, spec, seed) measured, by the code `stamp` describes (see `stamp_matches`)?"""
        return any((r["protocol"], r["spec"], r["seed"]) == (protocol, spec, seed) and stamp_matches(r, stamp)
                   for r in self.data["results"])

    def stale(self, jobs, stamps: dict) -> list[dict]:
        """Earlier records of `jobs` ((protocol, spec, seed)) made by other code than `stamps`
        describes (another commit, a changed config): measured again, so a rerun says so."""
        keys = set(jobs)
        return [r for r in self.data["results"] if (r["protocol"], r["spec"], r["seed"]) in keys
                and not stamp_matches(r, stamps.get(r["spec"]))]

    def add(self, record: dict) -> None:
        """Append `record`, replacing an earlier one of its (protocol, spec, seed)."""
        key = tuple(record.get(k) for k in ("protocol", "spec", "seed"))
        self.data["results"] = [r for r in self.data["results"]
                                if tuple(r.get(k) for k in ("protocol", "spec", "seed")) != key] + [record]
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
