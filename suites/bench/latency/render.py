"""Rendering of a latency report: Markdown tables and the latency-vs-T plot, from
the result dict alone (so `latency.json` of any run can be rendered again:
`python -m kvqbench.suites.bench.latency --render reports/latency/latency.json`).
"""
from __future__ import annotations

import json
from pathlib import Path


def write_markdown(path: Path, res: dict):
    env, rows = res["env"], [r for r in res["latency"] if "latency_us" in r]
    L = [f"# Decode-step attention latency ({env.get('gpu')})", "",
         f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, driver {env.get('driver', '')}; "
         f"{env.get('time')}. Shapes: Hq {res['shape']['Hq']}, Hkv {res['shape']['Hkv']}, d {res['shape']['d']}, "
         f"fp16 queries. Device-to-device copy bandwidth measured in this run: "
         f"**{res['copy_bandwidth']['GBps_read_plus_write']:.0f} GB/s** (read + write).", "",
         "Latency = median of triton.testing.do_bench (CUDA events, L2 flushed before each call). GB/s = bytes "
         "the method must read (packed or fp16 K+V, lookup tables, q, output) / latency; fake-quant is charged "
         "only the packed bytes it starts from.", "",
         "| B | T | method | latency (us) | GB/s | of copy BW | bytes (MB) | note |",
         "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["B"], r["T"], r["method"])):
        note = r.get("note", "") or (f"{r.get('config', '')}" if r.get("config") else "")
        L.append(f"| {r['B']} | {r['T']} | {r['method']} | {r['latency_us']:.1f} | {r['GBps']:.0f} | "
                 f"{r['frac_copy_bw']:.2f} | {r['bytes'] / 1e6:.1f} | {note} |")
    skipped = [r for r in res["latency"] if "latency_us" not in r]
    if skipped:
        L += ["", "Not measured:", ""] + [f"- B={r['B']} T={r['T']} {r.get('method', '')}: "
                                          f"{r.get('skipped') or r.get('error')}" for r in skipped]
    L += ["", "## Targets (reported, not asserted)", "", "```", json.dumps(res["targets"], indent=1), "```"]
    enc = res.get("encode")
    if enc:
        L += ["", "## HQMQ encode throughput", "", f"Shape {enc['shape']} ({enc['chunks']} chunks).", "",
              "| spec | kernel search (chunks/s) | full encode (chunks/s) | torch search (chunks/s) | "
              "arithmetic floor (chunks/s) | kernel / floor |", "|---|---:|---:|---:|---:|---:|"]
        for k, v in enc.items():
            if isinstance(v, dict):
                L.append(f"| {k} | {v['kernel_search_chunks_per_s']:.3g} | {v['full_encode_chunks_per_s']:.3g} | "
                         f"{v['torch_search_chunks_per_s']:.3g} | {v.get('arith_floor_chunks_per_s', float('nan')):.3g} | "
                         f"{v.get('kernel_frac_of_floor', float('nan')):.2f} |")
        note = next((v.get("floor_note") for v in enc.values() if isinstance(v, dict) and v.get("floor_note")), "")
        L += ["", f"Floor: {note}. Full encode = torch radii/median/u + kernel search + torch radius codes and "
              "bit packing."]
    mem = res.get("memory")
    if mem:
        pj = mem["projection"]
        L += ["", "## Memory: stored bytes per token per layer (measured from Packed.nbytes)", "",
              f"{mem['kv_heads']} KV heads x d {mem['head_dim']}, K+V; fp16 = {mem['fp16_bytes_per_token_per_layer']} "
              f"B. Data: {mem['data']}.", "",
              f"| spec | bytes/token/layer | bits/element | vs fp16 | {pj['label'].split(' (')[0]}: "
              f"{pj['model']} at {pj['tokens']} tokens ({pj['layers']} layers) GB |", "|---|---:|---:|---:|---:|"]
        for r in mem["rows"]:
            L.append(f"| {r['spec']} | {r['bytes_per_token_per_layer']:.1f} | {r['bits_per_element']:.3f} | "
                     f"{r['ratio_vs_fp16']:.2f}x | {r['projection_GB']:.2f} |")
        L += ["", f"The last column is a {pj['label']}; paper's claim: {pj['paper_claim']}."]
    if res.get("tuning"):
        L += ["", "## Launch configs tried at the focus shape", "", "```", json.dumps(res["tuning"], indent=1), "```"]
    path.write_text("\n".join(L) + "\n")


def write_plot(path: Path, res: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["latency"] if "latency_us" in r]
    Bs = sorted({r["B"] for r in rows})
    if not Bs:
        return
    fig, axes = plt.subplots(1, len(Bs), figsize=(5.5 * len(Bs), 4.5), squeeze=False)
    for ax, B in zip(axes[0], Bs):
        for m in sorted({r["method"] for r in rows}):
            pts = sorted((r["T"], r["latency_us"]) for r in rows if r["method"] == m and r["B"] == B)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cached tokens T")
        ax.set_ylabel("decode-step attention latency (us)")
        ax.set_title(f"B={B}, Hq {res['shape']['Hq']}, Hkv {res['shape']['Hkv']}, d {res['shape']['d']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['env'].get('gpu')} - one query per sequence, all T keys (non-causal)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(out: Path, res: dict):
    """latency.md and latency.png beside latency.json."""
    write_markdown(out / "latency.md", res)
    write_plot(out / "latency.png", res)
