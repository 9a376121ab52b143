"""Scaling of `kvqbench compare` over ranks (issue 12): the same grid scored under
`torchrun --nproc-per-node N` for each N of `--ranks`, throughput = scored tokens
(sum of every configuration's predicted tokens) / wall seconds of the scoring phase
(results.json meta.distributed.scoring.wall_s: from the first unit to the last
gather, model loading and the report excluded), and the figures of every N checked
against the first N's (PPL to 1e-6 relative).

    python -m kvqbench.suites.bench.scaling --ranks 1,2 --out reports/scaling -- --windows 16 --window 1024
    python -m kvqbench.suites.bench.scaling --ranks 1,2 --resume-check -- --device cpu --model DIR --specs "fp16;int4"

Everything after `--` goes to `kvqbench compare` unchanged (model, corpus, grid,
device). Every N runs `--fresh` into <out>/<name>/runs/ranks<N>. Before the timed
runs, an untimed one at the largest N fills the on-disk Triton compile cache, so no
N pays for compiling what another already compiled; in-process autotuning is paid
by every process in every run alike. Every run gets OMP_NUM_THREADS=1 unless the
caller sets it (torchrun itself does so for N > 1 only). `--resume-check` then starts the largest N
again, stops it (SIGTERM to torchrun) once results.json holds half the grid, resumes
on one process without torchrun and checks that what was saved was not measured again
and that the figures still match. Writes scaling.json and scaling.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SAME_PPL_REL = 1e-6  # the issue's bound between world sizes (CPU runs agree to the bit)
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


def render(report: dict) -> str:
    meta, s = report["meta"], report["summary"]
    hw, v = meta["hardware"], meta["versions"]
    lines = [f"# Scaling of `kvqbench compare`: {meta['model']['name']} on {meta['corpus']['name']}", "",
             f"Hardware: {hw.get('gpu') or hw.get('cpu')} ({hw['device']}), {hw.get('cpu_count')} CPU cores, "
             f"{hw['platform']}; torch {v.get('torch')}, transformers {v.get('transformers')}, "
             f"triton {v.get('triton', '-')}.",
             f"Grid: {len(records(report['runs'][str(s['baseline_ranks'])]))} configurations, protocols "
             f"{', '.join(meta['protocols'])}, {meta['windows']['n']} windows x {meta['windows']['tokens']} tokens, "
             f"batch size {meta['batch_size']}, dtype {meta['dtype']}.",
             "Throughput: scored tokens / wall seconds of the scoring phase (model load and report excluded), "
             f"every N under torchrun; figures checked against N={s['baseline_ranks']} (PPL to "
             f"{SAME_PPL_REL:g} relative).", "",
             "| ranks | devices | scored tokens | scoring wall (s) | tokens/s | speed-up | efficiency | "
             "busy s per rank | max PPL rel. diff | bit-identical | same |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        a = r["agreement"]
        lines.append(f"| {r['ranks']} | {', '.join(sorted(set(r['devices'])))} | {r['scored_tokens']} | "
                     f"{r['scoring_wall_s']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['efficiency']:.0%} | {', '.join(f'{b:.1f}' for b in r['busy_s_per_rank'])} | "
                     f"{a['max_ppl_rel_diff']:.2e} | {a['bit_identical']}/{a['configurations']} | "
                     f"{'yes' if a['same'] else 'NO'} |")
    rc = report.get("resume_check")
    if rc:
        lines += ["", f"Resume check: {rc['ranks']} ranks stopped after {rc['stopped_after_s']:.1f} s with "
                  f"{rc['saved']} of {rc['total']} configurations saved; one process without torchrun then "
                  f"reported {rc['already_measured']} already measured and measured the rest; figures "
                  f"{'match' if rc['agreement']['same'] else 'DO NOT match'} the baseline "
                  f"(max PPL rel. diff {rc['agreement']['max_ppl_rel_diff']:.2e}).",
                  f"Verdict: {'passes' if rc['passes'] else 'FAILS'} (nothing saved was measured again)."]
    lines += ["", f"Commands (OMP_NUM_THREADS={report.get('omp_num_threads')}):", ""]
    lines += [f"    {shlex.join(c)}" for c in report["commands"]]
    return "\n".join(lines) + "\n"


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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts; the first is the baseline")
    p.add_argument("--out", default="reports/scaling", help="reports folder")
    p.add_argument("--name", default="scaling", help="subfolder of --out for this benchmark")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed run that fills the compile cache")
    p.add_argument("--resume-check", action="store_true",
                   help="also stop the largest N half-way and resume it on one process")
    args = p.parse_args(own)
    try:
        ranks = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if not ranks or min(ranks) < 1:
        p.error(f"--ranks needs rank counts >= 1, got {args.ranks!r}")
    folder = Path(args.out) / args.name
    shutil.rmtree(folder / "runs", ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    commands, runs, walls = [], {}, {}
    if not args.no_warmup:
        cmd = compare_command(max(ranks), compare_args, folder / "runs", "warmup")
        launch(cmd, folder / "warmup.log")
        if not scored(folder / "runs" / "warmup"):
            print(f"warm-up run failed; see {folder / 'warmup.log'}", file=sys.stderr)
            return 1
    for n in ranks:
        cmd = compare_command(n, compare_args, folder / "runs", f"ranks{n}")
        commands.append(cmd)
        done = launch(cmd, folder / f"ranks{n}.log")
        print(f"{n} rank(s): exit {done['rc']} in {done['wall_s']:.1f} s", file=sys.stderr)
        if not scored(folder / "runs" / f"ranks{n}"):  # a failed configuration is not a failed run
            print(f"run with {n} ranks failed; see {done['log']}", file=sys.stderr)
            return 1
        runs[n], walls[n] = read_run(folder / "runs" / f"ranks{n}"), done["wall_s"]
    summary = summarise(runs)
    for row in summary["rows"]:
        row["process_wall_s"] = walls[row["ranks"]]
    report = {"meta": runs[ranks[0]]["meta"], "summary": summary, "commands": commands,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
              "runs": {str(n): data for n, data in runs.items()}}
    if args.resume_check:
        n = max(ranks)
        report["resume_check"] = resume_check(n, compare_args, folder, runs[ranks[0]])
    (folder / "scaling.json").write_text(json.dumps(report, indent=1))
    (folder / "scaling.md").write_text(render(report))
    print((folder / "scaling.md").read_text())
    ok = all(r["agreement"]["same"] for r in summary["rows"]) and report.get("resume_check", {}).get("passes", True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
