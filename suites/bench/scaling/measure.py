"""Measuring the scaling of `kvqbench compare` over ranks: launch a run under torchrun,
read its results.json, summarise throughput and agreement, the resume check. The
benchmark is described in the package docstring (`python -m kvqbench.suites.bench.scaling`)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SAME_PPL_REL = 1e-6  # the bound between world sizes (CPU runs agree to the bit)
ALREADY = re.compile(r"(\d+) configurations, (\d+) already measured")


def compare_command(nproc: int | None, compare_args: list[str], out: Path, run: str, fresh: bool = True) -> list[str]:
    """`kvqbench compare` under torchrun with `nproc` ranks, or a plain process (None)."""
    tail = ["compare", *compare_args, "--out", str(out), "--run-name", run] + (["--fresh"] if fresh else [])
    if nproc is None:
        return [sys.executable, "-m", "kvqbench.suites.compare.cli", *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "kvqbench.suites.compare.cli", *tail]


def launch(cmd: list[str], log: Path, stop_when=None) -> dict:
    """Run `cmd` with its output in `log`; if `stop_when()` turns true while it runs
    (polled every 0.2 s), stop it: SIGTERM to the process group this call started
    (torchrun and its workers). Returns exit code, wall seconds, whether it was stopped."""
    # torchrun sets OMP_NUM_THREADS=1 for N > 1 ranks only; the same for every N keeps
    # CPU runs comparable (a 1-rank run with all threads on a loaded machine crawled: 23x slower).
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    t0, stopped = time.perf_counter(), False
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while stop_when is not None and p.poll() is None:
            if stop_when():
                os.killpg(p.pid, signal.SIGTERM)
                stopped = True
                break
            time.sleep(0.2)
        rc = p.wait()
    return {"cmd": cmd, "rc": rc, "wall_s": round(time.perf_counter() - t0, 3), "stopped": stopped, "log": str(log)}


def read_run(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def records(data: dict) -> dict:
    return {(r["protocol"], r["spec"], r["seed"]): r for r in data["results"] if "error" not in r}


def compare_figures(base: dict, other: dict) -> dict:
    """Worst PPL disagreement of `other` against `base` over their common configurations."""
    a, b = records(base), records(other)
    common = sorted(set(a) & set(b))
    rel = [abs(b[k]["ppl"] / a[k]["ppl"] - 1) for k in common]
    return {"configurations": len(common), "missing": [list(k) for k in sorted(set(a) ^ set(b))],
            "max_ppl_rel_diff": max(rel, default=0.0),
            "bit_identical": sum(a[k]["nll_sum"] == b[k]["nll_sum"] and a[k]["cache_nbytes"] == b[k]["cache_nbytes"]
                                 for k in common),
            "same": bool(common) and max(rel) <= SAME_PPL_REL and len(common) == len(a) == len(b)}


def summarise(runs: dict[int, dict]) -> dict:
    """Per N: scored tokens, scoring wall, throughput, speed-up and efficiency against
    the first N, per-rank busy seconds, and agreement of the figures with the first N."""
    first = min(runs)
    rows = {}
    for n, data in sorted(runs.items()):
        scoring = data["meta"]["distributed"]["scoring"]
        tokens = sum(r["n_predicted"] for r in records(data).values())
        rows[n] = {"ranks": n, "scored_tokens": tokens, "scoring_wall_s": scoring["wall_s"],
                   "tokens_per_s": tokens / scoring["wall_s"], "busy_s_per_rank": scoring["busy_s_per_rank"],
                   "rounds": scoring["rounds"], "units": scoring["units"],
                   "devices": [r.get("gpu") or r["device"] for r in data["meta"]["distributed"]["ranks"]],
                   "agreement": compare_figures(runs[first], data)}
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / rows[first]["tokens_per_s"]
        row["efficiency"] = row["speedup"] * first / row["ranks"]
    return {"baseline_ranks": first, "rows": [rows[n] for n in sorted(rows)]}


def scored(folder: Path) -> bool:
    """Did the run finish its scoring phase? (torchrun exits 1 whatever a rank's own
    status, so a partial failure, exit 3 of one process, is told apart by the file.)"""
    try:
        return "scoring" in read_run(folder)["meta"]["distributed"]
    except (OSError, ValueError, KeyError):
        return False


def saved_count(path: Path) -> int:
    try:
        return len(records(read_run(path)))
    except (OSError, ValueError, KeyError):  # not written yet
        return 0


def resume_check(n: int, compare_args: list[str], folder: Path, baseline: dict) -> dict:
    """Stop an `n`-rank run once half the grid is saved, resume it on one process."""
    run, half = f"resume_ranks{n}", max(1, len(records(baseline)) // 2)
    path = folder / "runs" / run
    t0 = time.perf_counter()
    killed = launch(compare_command(n, compare_args, folder / "runs", run), folder / f"{run}_killed.log",
                    stop_when=lambda: saved_count(path) >= half)
    stopped_after = time.perf_counter() - t0
    saved = records(read_run(path)) if (path / "results.json").exists() else {}
    log = folder / f"{run}_resumed.log"
    done = launch(compare_command(None, compare_args, folder / "runs", run, fresh=False), log)
    found = ALREADY.findall(log.read_text())
    total, already = (int(found[-1][0]), int(found[-1][1])) if found else (None, None)
    after = read_run(path)
    kept = all(records(after).get(k) == r for k, r in saved.items())  # the very records: not measured again
    agreement = compare_figures(baseline, after)
    return {"ranks": n, "stopped_after_s": round(stopped_after, 2), "stopped": killed["stopped"],
            "saved": len(saved), "total": total,
            "already_measured": already, "resumed_rc": done["rc"], "kept_unchanged": kept,
            "agreement": agreement, "passes": bool(done["rc"] == 0 and kept and already == len(saved)
                                                   and 0 < len(saved) < (total or 0) and agreement["same"])}
