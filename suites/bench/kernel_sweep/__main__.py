"""Entry point: `python -m kvqbench.suites.bench.kernel_sweep run|render ...`."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from . import __doc__ as DOC


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvqbench.suites.bench.kernel_sweep", description=DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="check and time the kernels (needs a CUDA GPU)")
    run.add_argument("--out", default="/tmp/bench_kernels")
    run.add_argument("--shapes", default="8x32768,1x32768", help="BxT,BxT,...")
    run.add_argument("--no-variants", action="store_true")
    run.add_argument("--skip-check", action="store_true")
    run.add_argument("--methods", default="", help="comma-separated subset of the methods")
    ren = sub.add_parser("render", help="reports/latency/kernels.{md,json,png} from a run's JSON")
    ren.add_argument("json", type=Path)
    ren.add_argument("--out", type=Path, default=Path("reports/latency"))
    ren.add_argument("--log", type=Path, help="bench log to copy beside the report")
    a = ap.parse_args(argv)
    if a.command == "render":
        from .render import render

        render(json.loads(a.json.read_text()), a.out)
        if a.log:
            shutil.copy(a.log, a.out / "kernels_bench.log")
        return 0
    import torch

    if not torch.cuda.is_available():
        ap.error("the kernel sweep times kernels on a CUDA GPU; none is available here")
    from .measure import run_sweep
    from .render import print_table

    res = run_sweep(a.out, a.shapes, variants=not a.no_variants, check=not a.skip_check,
                    methods=[m for m in a.methods.split(",") if m] or None)
    print_table(res)
    if res.get("checks_bad"):
        print(f"{len(res['checks_bad'])} kernel checks FAILED against the reference", file=sys.stderr)
        return 1
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
