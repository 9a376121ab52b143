"""How long the main job takes: `kvqbench compare` with its defaults, timed whole
(pytest-benchmark; marked `bench`, so skipped unless `-m bench`).

    pytest -m bench --benchmark-enable suites/bench/bench_compare.py --benchmark-autosave

Issue 9's budgets: on a 2-core CPU machine the default `kvqbench compare`
(quantize-on-write, 2 x 512-token windows, every default configuration and seed) under
5 minutes; on a GPU `kvqbench compare --protocol both --windows 4 --window 512` under 3
minutes, and (issue 29) `--protocol deployed` with the same windows under 3 minutes too.
The budget goes into `extra_info` beside the measured seconds of each round, the device
and the run's shape; it is reported, never asserted (a timing is not a test). The model and
corpus are fetched and converted, and on a GPU the CUDA kernel libraries built, before
the timed round (a cached first run's work), so the figure is the compare itself: model
load, every configuration (Triton's first-use compiles included), the report.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from kvqbench.suites.bench.first_use import FirstUseLog, StackSampler

pytestmark = pytest.mark.bench

BOTH = ["--protocol", "both", "--windows", "4", "--window", "512"]
DEPLOYED = ["--protocol", "deployed", "--windows", "4", "--window", "512"]  # issue 29's budget
# id: (extra arguments, where it runs, ranks under torchrun (1: one plain process), budget in
# seconds, rounds). On a GPU two rounds: the first compiles every Triton kernel it meets
# (Triton's cache, ~/.triton, empty on a fresh machine: its size is recorded), the second
# finds them compiled, as any later run on that machine does; each round its own output.
CASES = {
    "cpu-default": ([], "cpu", 1, 300, 1),
    "gpu-both-4x512": (BOTH, "cuda", 1, 180, 2),
    "gpu-deployed-4x512": (DEPLOYED, "cuda", 1, 180, 2),
    # 4 processes sharing the GPU (gloo, suites/compare/distributed.py): host-bound decode
    # steps (those that take no CUDA graph) overlap
    "gpu-both-4x512-4ranks": (BOTH, "cuda", 4, 180, 2),
    # issue 29's budget through the plain command with `--workers 4` (it launches the four
    # ranks itself; the Triton manifest preloaded on each)
    "gpu-workers4-deployed-4x512": (DEPLOYED + ["--workers", "4"], "cuda", 1, 180, 2),
}


def _triton_cache_entries() -> int:
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return len(os.listdir(root)) if os.path.isdir(root) else 0


@pytest.mark.parametrize("case", list(CASES))
def test_compare_wall_time(benchmark, tmp_path, case):
    from kvqbench.suites.compare import cli
    from kvqbench.suites.compare.run import DEFAULT_CORPUS, DEFAULT_MODEL
    from kvqbench.suites.harness import fidelity as fidelity_mod
    from kvqbench.suites.harness import perplexity as scoring  # run.py imports its functions per call
    from kvqbench.suites.harness.corpora import load_corpus
    from kvqbench.suites.harness.models import embedded_folder

    extra, device, ranks, budget, rounds = CASES[case]
    rounds = int(os.environ.get("KVQBENCH_BENCH_ROUNDS", rounds))  # 1: the cold round alone (a short GPU call)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the GPU budget needs a CUDA GPU")
    embedded_folder(DEFAULT_MODEL)  # fetch + convert once, untimed
    load_corpus(DEFAULT_CORPUS)
    if device == "cuda":  # the CUDA kernel libraries too: built once per machine (~20 s each), cached
        from kvqbench.kernels.cuda import decode_attention as cuda_decode
        from kvqbench.kernels.cuda import hqmq_decode as cuda_hqmq

        built = {m.__name__: m.why_unavailable() for m in (cuda_decode, cuda_hqmq)}
        benchmark.extra_info["cuda_libraries"] = built
    codes, walls, triton_entries, first_use, stacks = [], [], [], [], []
    log = FirstUseLog()  # Triton compiles per row (one process only: ranks == 1)
    # KVQBENCH_SAMPLE_ROWS: a regular expression of row labels ("prefill-then-decode hqmq:S=96,r=4
    # seed=0", "deployed avq2 seed=0", "fidelity spherical3.5 seed=0") whose stacks are sampled
    # (StackSampler), each round
    sample_rows = os.environ.get("KVQBENCH_SAMPLE_ROWS")

    def labelled(fn, protocol):  # the compare's scoring functions, telling the log the row
        def scored(model, windows, spec, seed=0, **kw):
            log.row = f"{protocol} {spec} seed={seed}"
            return fn(model, windows, spec, seed, **kw)
        return scored

    def labelled_fidelity(fn):  # fidelity(model, prompts, spec, reference, seed=0, ...)
        def generated(model, prompts, spec, *a, **kw):
            log.row = f"fidelity {spec} seed={kw.get('seed', 0)}"
            return fn(model, prompts, spec, *a, **kw)
        return generated

    def run():
        argv = ["compare", "--device", device, "--out", str(tmp_path), "--run-name", f"timed{len(walls)}", *extra]
        triton_entries.append(_triton_cache_entries())
        start = len(log.events)
        t0 = time.perf_counter()
        if ranks == 1:
            sampler = StackSampler(log, sample_rows, below="scored") if sample_rows else contextlib.nullcontext()
            with log.installed(), sampler, \
                    mock.patch.object(scoring, "ppl_quantize_on_write",
                                      labelled(scoring.ppl_quantize_on_write, "quantize-on-write")), \
                    mock.patch.object(scoring, "ppl_prefill_then_decode",
                                      labelled(scoring.ppl_prefill_then_decode, "prefill-then-decode")), \
                    mock.patch.object(scoring, "ppl_deployed", labelled(scoring.ppl_deployed, "deployed")), \
                    mock.patch.object(fidelity_mod, "fidelity", labelled_fidelity(fidelity_mod.fidelity)):
                codes.append(cli.main(argv))
            log.row = "after the rows"
            first_use.append(log.since(start))
            if sample_rows:
                stacks.append(sampler.report())
        else:  # torchrun's own launcher, as the README's command
            codes.append(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc-per-node", str(ranks), "-m", "kvqbench.suites.compare.cli",
                                         *argv]).returncode)
        walls.append(time.perf_counter() - t0)
        print(f"round {len(walls)}: {walls[-1]:.1f} s (Triton cache entries before it: {triton_entries[-1]})",
              flush=True)
        if first_use:
            f = first_use[-1]
            print(f"  Triton: {f['compiles']} compiles, {f['compile_s']} s compiling, "
                  f"{f['first_launch_init_s']} s first-launch init", flush=True)
            for row, r in list(f["rows"].items())[:25]:
                print(f"    {r['compile_s']:6.2f} s {r['compiles']:3d} compiles  +{r['init_s']:5.2f} s init  {row}")
            for k, r in list(f["kernels"].items())[:25]:
                print(f"    {r['compile_s']:6.2f} s {r['compiles']:3d} compiles  {k}")
        for row, r in (stacks[-1] if stacks else {}).items():
            print(f"  stack samples of {row}: {r['samples']} x {r['interval_s']} s")
            for kind in ("on_stack", "leaf"):
                print(f"   {kind}:")
                for fn, share in list(r[kind].items())[:15]:
                    print(f"    {share:6.1%}  {fn}")

    benchmark.pedantic(run, rounds=rounds, iterations=1)
    keep = os.environ.get("KVQBENCH_BENCH_KEEP")  # a folder: each round's report is kept there (a GPU
    if keep:                                      # call's $OUT), since its round is a real compare run
        for i in range(rounds):
            shutil.copytree(tmp_path / f"timed{i}", os.path.join(keep, f"round{i + 1}"), dirs_exist_ok=True)
    data = [json.loads((tmp_path / f"timed{i}" / "results.json").read_text()) for i in range(rounds)]
    benchmark.extra_info.update({
        "case": case, "argv": " ".join(["compare", "--device", device, *extra]), "ranks": ranks,
        "wall_s_per_round": walls, "triton_cache_entries_before_round": triton_entries, "budget_s": budget,
        "within_budget_per_round": [w < budget for w in walls], "triton_first_use_per_round": first_use,
        "stack_samples_per_round": stacks,
        "configurations": len(data[0]["results"]), "device": device, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None})
    assert codes == [0] * rounds
    assert all(d["results"] and all(r.get("ppl") for r in d["results"]) for d in data)

