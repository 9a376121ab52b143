"""scaling.md from a scaling report (measure.summarise + the runs' meta)."""
from __future__ import annotations

import shlex

from .measure import SAME_PPL_REL, records


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
