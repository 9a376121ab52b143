"""Rendering of a latency report: Markdown tables, the latency-vs-T plot and the
roofline plot, from the result dict alone (so `latency.json` of any run can be
rendered again: `python -m kvqbench.suites.bench.latency --render reports/latency/latency.json`).
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
         "Rows: `fused-<x>` is what ships, `decode_attention(q, k, v)` with backend=\"auto\" and each "
         "backend's defaults (backend = the one that ran; why not CUDA in the note); `fused-<x>-triton` the "
         "Triton kernel with the tuner's config; `fused-<x>-cuda` the CUDA kernel by opt-in where auto does "
         "not take it; `-graph` the same call replayed as a CUDA graph (B=1 and the focus shape), compared "
         "with `fp16-sdpa-graph`; at the focus `fused-<x>-padded` a left-padded batch (row b's keys from "
         "b T / 32 on, `row_start`), auto and the other backend (`-padded-triton` / `-padded-cuda`), its bytes "
         "the whole cache. "
         "x = same-run fp16 SDPA us / row us. host us: an eager fused call's issue time (the call returning, "
         "no sync; host_time.py), the Python it runs before its kernel; after the slash, the same when each "
         "call has another token count, as eager decode steps do (`host_us_step`); it is the host CPU's "
         f"Python: {env.get('host_cpu', 'host CPU not recorded')}, load {env.get('host_load_1min', '?')} at the start.",
         "",
         "| B | T | method | backend | latency (us) | host us | x fp16 SDPA | GB/s | of copy BW | bytes (MB) | note |",
         "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["B"], r["T"], r["method"])):
        note = "; ".join(str(n) for n in (r.get("note"), r.get("why_not_cuda"), r.get("config")) if n)
        x = f"{r['speedup_vs_fp16_sdpa']:.2f}" if "speedup_vs_fp16_sdpa" in r else ""
        host = (f"{r['host_us']:.1f}" if "host_us" in r else "") + \
            (f" / {r['host_us_step']:.1f}" if "host_us_step" in r else "")
        L.append(f"| {r['B']} | {r['T']} | {r['method']} | {r.get('backend', '')} | {r['latency_us']:.1f} | {host} | {x} | "
                 f"{r['GBps']:.0f} | {r['frac_copy_bw']:.2f} | {r['bytes'] / 1e6:.1f} | {note} |")
    skipped = [r for r in res["latency"] if "latency_us" not in r]
    if skipped:
        L += ["", "Not measured:", ""] + [f"- B={r['B']} T={r['T']} {r.get('method', '')}: "
                                          f"{r.get('skipped') or r.get('error')}" for r in skipped]
    L += target_lines(res["targets"], res.get("shape", {}))
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


def _fmt(v, spec=".1f"):
    return "" if v is None else format(v, spec)


def target_lines(t: dict, shape: dict | None = None) -> list[str]:
    """The targets section: issue 10's targets as a table (from targets.targets), the rest as JSON.
    shape: the run's (a run at other heads than the issues' Hq 32 / Hkv 8 says so first)."""
    L = ["", "## Targets (issue 10; reported, not asserted)", ""]
    heads = ((shape or {}).get("Hq", 32), (shape or {}).get("Hkv", 8))
    if heads != (32, 8):
        L += [f"The issues set these targets for Hq 32 / Hkv 8 (Llama-3-8B); this run has Hq {heads[0]} / Hkv "
              f"{heads[1]}: its rows read as this shape's ratios, not as the issues' verdicts.", ""]
    if "focus" not in t:  # a report from before the issue-10 targets
        return L + ["```", json.dumps(t, indent=1), "```"]
    met = {True: "yes", False: "**no**", None: "not measured"}
    fb, b1 = t["shapes"]["focus_B_T"], t["shapes"]["b1_B_T"]
    L += [f"Shipped rows (`fused-<x>`) at B={fb[0]} T={fb[1]} and B={b1[0]} T={b1[1]}, against this run's fp16 SDPA.",
          "", "| shape | row | backend | us | fp16 SDPA us / x | target | met |", "|---|---|---|---:|---|---|---|"]
    for name, group in (("focus", t["focus"]), ("CUDA opt-in (not shipped)", t.get("cuda_opt_in_not_shipped", {}))):
        for m, g in group.items():
            x = (f"{_fmt(g.get('fp16_sdpa_us'))} / {_fmt(g.get('speedup'), '.2f')}x" if "speedup" in g else "")
            if "ratio_to_hqmq" in g:
                x += f" ({g['ratio_to_hqmq']:.2f}x {g.get('hqmq_row', 'fused-hqmq')})"
            L.append(f"| {name} B={fb[0]} T={fb[1]} | {m} | {g.get('backend') or ''} | {_fmt(g.get('us'))} | {x} | "
                     f"{g['target']} | {met[g['met']]}{' (' + g['missing'] + ')' if g.get('missing') else ''} |")
    for m, g in t["b1"].items():
        x = ", ".join(f"{k.split('_')[0]} {g[k]:.2f}x" for k in ("eager_speedup", "graph_speedup") if k in g)
        L.append(f"| B={b1[0]} T={b1[1]} | {m} | | | {x} | {g['target']} | {met[g['met']]} |")
    if "graphed" in t:  # issue 28's, on graphed calls (and eager host time)
        L += ["", f"Issue 28's targets: graphed calls against the graphed fp16 SDPA at B={fb[0]} T={fb[1]} and "
              f"B={b1[0]} T={b1[1]}; eager host time per call at B={b1[0]} T={b1[1]}.", "",
              "| target | row | backend | us | x fp16 SDPA graph / host us | target | met |",
              "|---|---|---|---:|---|---|---|"]
        for key, g in t["graphed"].items():
            x = f"{g['speedup']:.2f}x" if "speedup" in g else ""
            x += f" ({g['ratio_to_hqmq']:.2f}x {g['hqmq_row']})" if "ratio_to_hqmq" in g else ""
            x += f"{g['host_us']:.1f} us" if "host_us" in g else ""
            L.append(f"| {key} | {g['row']} | {g.get('backend') or ''} | {_fmt(g.get('us'))} | {x} | {g['target']} | "
                     f"{met[g['met']]}{' (' + g['missing'] + ')' if g.get('missing') else ''} |")
    rest = {k: v for k, v in t.items() if k not in ("shapes", "focus", "b1", "cuda_opt_in_not_shipped", "graphed")}
    return L + ["", "```", json.dumps(rest, indent=1), "```"]


def _format(method: str) -> str:
    """The cache format of a row ("int4", "hqmq-med3", "fp16-sdpa"): its name without
    the fused- prefix and the -triton / -cuda / -graph suffixes."""
    return method.removeprefix("fused-").removesuffix("-graph").removesuffix("-triton").removesuffix("-cuda")


def _kind(method: str) -> str:
    if method.startswith("fp16-sdpa"):
        return "fp16 SDPA"
    for suffix, kind in (("-triton", "Triton (tuned)"), ("-cuda", "CUDA opt-in")):
        if method.removesuffix("-graph").endswith(suffix):
            return kind
    return "shipped (auto)"


def write_roofline(path: Path, res: dict) -> bool:
    """Bytes read per call (x) against us (y), log-log, at the focus shape and at B=1 of its
    T (two panels), with the line us = bytes / copy bandwidth of the same run; one marker
    per row kind, filled eager, hollow CUDA-graph replays. False when no row is there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    shapes = res.get("targets", {}).get("shapes", {})
    shapes = [tuple(shapes.get("focus_B_T", (8, 32768))), tuple(shapes.get("b1_B_T", (1, 32768)))]
    rows = [r for r in res["latency"] if "latency_us" in r and "bytes" in r and r.get("method") != "fake-quant"
            and "-padded" not in r["method"]]  # (a padded batch's calls need not read all of their bytes)
    panels = [(s, [r for r in rows if (r["B"], r["T"]) == s]) for s in dict.fromkeys(shapes)]
    panels = [p for p in panels if p[1]]
    if not panels:
        return False
    copy = res["copy_bandwidth"]["GBps_read_plus_write"]
    markers = {"shipped (auto)": "o", "Triton (tuned)": "s", "CUDA opt-in": "^", "fp16 SDPA": "*"}
    fmts = sorted({_format(r["method"]) for r in rows})
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(fmts)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, ((B, T), prs) in zip(axes[0], panels):
        lo, hi = min(r["bytes"] for r in prs) / 2, max(r["bytes"] for r in prs) * 2
        ax.plot([lo, hi], [lo / copy / 1e3, hi / copy / 1e3], "k--", lw=1)  # GB/s = bytes / us / 1e3
        for r in prs:
            m = r["method"]
            c = colors[_format(m)]
            ax.plot(r["bytes"], r["latency_us"], markers[_kind(m)], ms=9 if _kind(m) == "fp16 SDPA" else 7,
                    color=c, mfc="none" if m.endswith("-graph") else c)
            ax.annotate(m.removeprefix("fused-"), (r["bytes"], r["latency_us"]), fontsize=6,
                        xytext=(4, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes read per call (packed or fp16 K+V, tables, q, output)")
        ax.set_ylabel("us per decode-step attention call")
        ax.set_title(f"B={B}, T={T} (hollow: CUDA-graph replay)")
        ax.grid(True, which="both", alpha=0.3)
        handles = [Line2D([], [], ls="--", color="k", label=f"us = bytes / copy BW ({copy:.4g} GB/s)")]
        handles += [Line2D([], [], ls="", marker=mk, color="gray", label=k) for k, mk in markers.items()]
        handles += [Line2D([], [], ls="", marker="o", color=c, label=f) for f, c in colors.items()]
        ax.legend(handles=handles, fontsize=7)
    fig.suptitle(f"{res['env'].get('gpu')} - roofline: time against bytes read, same-run copy bandwidth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
    """latency.md, latency.png and latency_roofline.png beside latency.json."""
    write_markdown(out / "latency.md", res)
    write_plot(out / "latency.png", res)
    write_roofline(out / "latency_roofline.png", res)
