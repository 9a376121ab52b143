"""The report's "serving at a glance": per spec, what an inference engineer asks before
deploying a format, from the run's own records plus the newest latency report beside the
runs: its memory per token on this model, its quality under the protocol closest to
serving (deployed where the run has it), its greedy agreement with the model's own cache,
whether a fused kernel reads it (and what this run's decode steps read with), and how fast
the kernel a GPU routes it to was against fp16 SDPA.

Whether a fused kernel reads a spec is decided without a GPU: a small encode of the spec at
this model's head dim, flattened for its format's kernels (kernels/registry.py; every fused
format has a Triton kernel). WHICH backend a GPU takes, and its speed, are measurements: of
another run (the latency suite's, named with its GPU, date and shape), never of this one.
"""
from __future__ import annotations

from pathlib import Path

SPEED_AT = {"B": 8, "T": 32768}  # issue 28's shape of the latency suite: its graphed rows
BACKEND_TITLE = {"cuda": "CUDA", "triton": "Triton"}


def fused_reader(spec: str, head_dim: int) -> str:
    """Whether a fused decode-attention kernel reads this spec's caches at head_dim (every
    fused format has a Triton kernel; which backend a GPU call takes is a measurement: the
    speed column's), or that none does and decode steps dequantize + SDPA (dense steps)."""
    import torch

    from ...kernels import registry
    from ...kernels.layout import flatten
    from ...quantizers import get_quantizer, parse_spec

    if registry.format_of_quantizer(parse_spec(spec)[0]) is None:
        return "none: dense steps"
    try:  # the layout this spec makes at this head dim (one kv head, 64 tokens, seeded)
        k = torch.randn(1, 1, 64, head_dim, generator=torch.Generator().manual_seed(0))
        flatten(get_quantizer(spec, role="K").encode(k), "K")
    except (ValueError, TypeError) as e:  # a layout its format's kernels do not read
        why = str(e)
        return f"none: dense steps ({why[:70]}{'...' if len(why) > 70 else ''})"
    except Exception as e:  # noqa: BLE001 (a cell of the summary: never the end of the report)
        return f"? ({type(e).__name__})"
    return "fused"


def latency_figures(folder: Path, head_dim: int) -> tuple[str | None, dict[str, tuple[str, float]]]:
    """(where the figures come from, spec -> (backend, graphed fp16 SDPA time over the graphed
    fused call's at SPEED_AT)) from the newest latency suite JSON under <folder>/../latency/
    whose shape has this head dim; (None, {}) when there is none."""
    from ..bench.latency.head_dims import newest_runs

    found = newest_runs(Path(folder).parent / "latency").get(head_dim)
    if found is None:
        return None, {}
    path, lat = found
    when = str(lat["env"].get("time", ""))
    ratios = {}
    for method, spec in lat.get("method_specs", {}).items():
        for r in lat.get("latency", []):  # (the route backend="auto" took: `fused-<x>`, not `-triton` / `-cuda`)
            if (method.startswith("fused-") and r.get("method") == f"{method}-graph" and r.get("B") == SPEED_AT["B"]
                    and r.get("T") == SPEED_AT["T"] and isinstance(r.get("speedup_vs_fp16_sdpa"), (int, float))):
                ratios[spec] = (str(r.get("backend", "?")), r["speedup_vs_fp16_sdpa"])
    sh = lat["shape"]
    where = (f"{path.relative_to(Path(folder).parent)}: {lat['env'].get('gpu', '?')}, {when[:16]}, "
             f"Hq {sh.get('Hq')} / Hkv {sh.get('Hkv')} / d {sh.get('d')}")
    return where, ratios


def serving_section(data: dict, folder: Path, summarize) -> list[str]:
    """Markdown lines of the summary (none when the run has no rows)."""
    meta, results = data["meta"], data["results"]
    protocol = "deployed" if "deployed" in meta["protocols"] else meta["protocols"][0]
    rows = summarize(results, protocol)
    if not rows:
        return []
    m = meta["model"]
    d = m.get("head_dim")
    shape = (m.get("n_layers"), m.get("n_kv_heads"), d)
    per_token = 2 * shape[0] * shape[1] * d if all(shape) else None  # K and V elements per token, all layers
    fp16 = next((r["ppl"] for r in rows if r["spec"] == "fp16"), None)
    fid = (data.get("fidelity") or {}).get("rows") or {}
    ran: dict[str, set] = {}  # what this run's decode steps read the history with (records since 2026-12-06)
    for rec in results:
        if rec.get("protocol") == protocol and "error" not in rec and rec.get("decode_attention"):
            ran.setdefault(rec["spec"], set()).add(rec["decode_attention"])
    where, speed = latency_figures(folder, d) if d else (None, {})
    lines = ["## Serving at a glance", "",
             f"Per spec: the cache's own bytes per token on {m['name']} (every layer, K and V; model constants "
             f"apart), the {protocol} PPL against fp16's, the greedy match rate against the model's own cache "
             "(generation fidelity, where run), whether a fused decode kernel reads its caches at head_dim "
             f"{d} (else decode steps dequantize and run SDPA) and, where the records say, what this run's "
             "decode steps read the history with (cuda / triton kernel, dense = decoded history + SDPA), and "
             + (f"the backend decode_attention's auto route took in a latency run on a GPU and its speed: graphed "
                f"fp16 SDPA time over the graphed fused call's at B={SPEED_AT['B']}, T={SPEED_AT['T']} (above 1 is "
                f"faster than fp16; {where}; formats that run did not time: -)." if where else
                "no kernel speed: no latency report at this head dim beside the runs "
                "(`python -m kvqbench.suites.bench.latency --head-dim D --out reports/latency`, on a GPU)."), "",
             "| spec | cache bits | KV KiB per token | memory vs fp16 | PPL vs fp16 | greedy match rate | "
             "fused decode kernel |" + (" GPU backend, speed vs fp16 SDPA |" if where else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if where else "")]
    for r in rows:
        try:
            route = fused_reader(r["spec"], d) if d else "-"
        except ValueError as e:  # a spec this checkout no longer parses
            route = f"? ({str(e)[:60]})"
        if r["spec"] in ran:
            route += f"; this run: {'/'.join(sorted(ran[r['spec']]))}"
        f = fid.get(r["spec"]) or {}
        match = f"{f['match_rate']:.3f}" if "match_rate" in f else "-"
        rel = f"{100 * (r['ppl'] / fp16 - 1):+.2f}%" if fp16 else "-"
        backend, ratio = speed.get(r["spec"], ("", 0.0))
        cell = f" {BACKEND_TITLE.get(backend, backend)}, {ratio:.2f}x |" if backend else " - |"
        kib = f"{per_token * r['bits'] / 8 / 1024:.2f}" if per_token else "-"
        lines.append(f"| `{r['spec']}` | {r['bits']:.3f} | {kib} | "
                     f"{16 / r['bits']:.2f}x smaller | {rel} | {match} | {route} |" + (cell if where else ""))
    return lines + [""]


__all__ = ["SPEED_AT", "fused_reader", "latency_figures", "serving_section"]
