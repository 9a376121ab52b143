"""Entry point: `python -m kvqbench.suites.bench.scaling` (see the package docstring)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from . import __doc__ as DOC
from .measure import compare_command, launch, read_run, resume_check, scored, summarise
from .render import render


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.scaling", description=DOC,
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
