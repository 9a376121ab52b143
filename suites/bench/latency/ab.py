"""Latency suite runs side by side (suites/bench/gpu_ab.sh: a change and its base, timed in
turn on one GPU machine): every graphed non-Triton row per (B, T, d, method) of any run, as
us and x the same run's graphed fp16 SDPA, one column per run; a Markdown table on stdout.

    python -m kvqbench.suites.bench.latency.ab RUN_DIR [RUN_DIR ...]   (each holds latency.json)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def table(dirs: list[Path]) -> str:
    runs = {}
    for d in dirs:
        rows = json.loads((d / "latency.json").read_text())["latency"]
        runs[d] = {(r["B"], r["T"], r.get("d"), r["method"]): r for r in rows}
    keys = sorted({k for rows in runs.values() for k in rows if k[3].endswith("-graph") and "triton" not in k[3]})
    lines = ["| B | T | d | method | " + " | ".join(d.name for d in dirs) + " |",
             "|---:|---:|---:|---|" + "---:|" * len(dirs)]
    for k in keys:
        cells = []
        for d in dirs:
            r, sd = runs[d].get(k), runs[d].get((*k[:3], "fp16-sdpa-graph"))
            cells.append(f"{r['latency_us']:.1f} ({sd['latency_us'] / r['latency_us']:.2f}x)" if r and sd else "-")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(table([Path(a) for a in sys.argv[1:]]))
