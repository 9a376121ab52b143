"""Compile a GPU run's kernels in parallel, ahead of the rows that need them.

On a machine whose Triton cache is empty, the first row of each configuration waits
for its kernels to compile (the HQMQ / Med3x / KIVI / int / fp8 write and attention
kernels, and the CUDA graph of its decode step): one compile after another in the one
process, ~60 s of the default `--protocol both` sweep on the H200 (reports/decode/).
Compiling is host work (LLVM, ptxas) and a GPU machine has cores to spare, so
`kvqbench compare` starts a few worker processes beside its own loop. Each worker
builds a ONE-layer model of the run's config (same heads, head dim, dtype, attention;
random weights) on the same GPU and scores every configuration it is dealt (seed 0,
each protocol, the run's window length, context and rows per batch) on random token
ids: the same kernels with the same specialisations, so Triton's on-disk cache holds
them when the run's own rows get there. What the workers compute is thrown away;
nothing measured comes from them, and a kernel they did not meet compiles on first use
as before. A worker that fails only logs (`warmup.log` in the run's folder).

Configurations are dealt one at a time in the order the run reaches them
(prefill-then-decode first: its decode steps meet most kernels; quantize-on-write rows
come first in the run but compile little). The run terminates the workers when it
ends. Off on a CPU (no Triton kernels run there), under torchrun (the ranks already
work in parallel) and with `--warmup-workers 0`.
"""
from __future__ import annotations

import copy
import os
import pickle
import re
import sys
import time
from pathlib import Path

import torch

MAX_WORKERS = 8
GIB = 1 << 30
CONTEXT_BYTES = GIB  # a CUDA context plus torch's allocator slack per worker process
_state: dict = {}  # in a worker: the one-layer model and the run's shapes


def one_layer_config(config):
    """A copy of a model config with one decoder layer (per-layer lists cut to it)."""
    cfg = copy.deepcopy(config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = 1
    for name in ("layer_types", "sliding_window_pattern_list"):
        if isinstance(getattr(text, name, None), list):
            setattr(text, name, getattr(text, name)[:1])
    return cfg


def worker_bytes(model) -> int:
    """GPU bytes one worker needs: its one-layer model's parameters plus a context."""
    layer = re.compile(r"\.layers\.(\d+)\.")
    n = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
            if (m := layer.search(name)) is None or m.group(1) == "0")
    return n + CONTEXT_BYTES


def n_workers(requested: int | None, device: str, model, n_jobs: int) -> tuple[int, str]:
    """(workers, why) for this run: `requested` (None: auto) bounded by the cores, the
    configurations and the GPU's free memory; 0 with the reason where none start."""
    if requested is not None and requested < 0:
        raise ValueError(f"--warmup-workers must be >= 0, got {requested}")
    if requested == 0:
        return 0, "--warmup-workers 0"
    if not str(device).startswith("cuda"):
        return 0, "no GPU kernels to compile on a CPU"
    cores = max(1, (os.cpu_count() or 1) - 2)  # the run's own process and its GPU feeder keep two
    n = min(requested if requested is not None else min(MAX_WORKERS, cores // 2), n_jobs)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    fit = int(free * 0.5) // worker_bytes(model)  # half of what is free: the run's rows need the rest
    if fit < n:
        n = fit
    return max(0, n), ("" if n > 0 else "the GPU has no memory to spare for them")


def _init(config, dtype, device: str, attn: str) -> None:
    """Worker start: one thread, the one-layer model on the GPU."""
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    _state["model"] = model.to(dtype).eval()
    _state["vocab"] = model.get_input_embeddings().weight.shape[0]
    print(f"[warmup {os.getpid()}] ready", flush=True)


def _warm(job: tuple) -> str | None:
    """Score one configuration on random ids; the error, or None."""
    from ..harness.perplexity import ppl_prefill_then_decode, ppl_quantize_on_write

    protocol, spec, rows, length, context = job
    t0 = time.perf_counter()
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(_state["vocab"], (rows, length), generator=g)
        if protocol == "quantize-on-write":
            ppl_quantize_on_write(_state["model"], ids, spec, 0, batch_size=rows)
        else:
            ppl_prefill_then_decode(_state["model"], ids, spec, 0, context=context, batch_size=rows)
        error = None
    except Exception as e:  # the run's own row will meet it and record it; here it is only logged
        error = f"{type(e).__name__}: {e}"
    dt = time.perf_counter() - t0
    print(f"[warmup {os.getpid()}] {protocol} {spec}: {dt:.1f} s{' ' + error if error else ''}", flush=True)
    return error


def _claim(plan: Path) -> int:
    """The next job's index, shared by the workers through a counter file beside the plan."""
    from filelock import FileLock

    counter = plan.with_suffix(".next")
    with FileLock(str(plan.with_suffix(".lock"))):
        i = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(i + 1))
    return i


def work(plan: Path) -> int:
    """A worker's life (`python -m kvqbench.suites.compare.warmup PLAN`): jobs until none
    is left; exit 0 also when some failed (logged), 1 when the model could not be built."""
    spec = pickle.loads(plan.read_bytes())
    try:
        _init(spec["config"], spec["dtype"], spec["device"], spec["attn"])
    except Exception as e:
        print(f"[warmup {os.getpid()}] worker start: {type(e).__name__}: {e}", flush=True)
        return 1
    while (i := _claim(plan)) < len(spec["jobs"]):
        _warm(spec["jobs"][i])
    return 0


class Warmup:
    """The worker processes of one run (a context manager: ended on exit). They are
    plain `python -m` processes, not a multiprocessing pool: they do not depend on how
    the run itself was started, and one that fails simply exits."""

    def __init__(self, model, device: str, jobs: list[tuple], workers: int, folder: Path):
        import subprocess

        self.log = folder / "warmup.log"
        self.plan = folder / "warmup.plan"
        for stale in (self.plan.with_suffix(".next"),):
            stale.unlink(missing_ok=True)
        self.plan.write_bytes(pickle.dumps({
            "config": one_layer_config(model.config), "dtype": next(model.parameters()).dtype,
            "device": str(device), "attn": getattr(model.config, "_attn_implementation", None) or "sdpa",
            "jobs": jobs}))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as out:  # a new session: the terminal's Ctrl-C is the run's, it ends them
            self.procs = [subprocess.Popen([sys.executable, "-m", __name__, str(self.plan)], stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                           start_new_session=True) for _ in range(workers)]

    def __enter__(self):
        return self

    def wait(self, timeout: float) -> list[int | None]:
        """The workers' exit codes after at most `timeout` s (None: still running)."""
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except Exception:
                pass
        return [p.poll() for p in self.procs]

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except Exception:
                p.kill()
        for f in (self.plan, self.plan.with_suffix(".next"), self.plan.with_suffix(".lock")):
            f.unlink(missing_ok=True)
        return False


def jobs(specs: list[str], protocols: list[str], rows: dict, lengths: dict, context: int) -> list[tuple]:
    """One warm-up job per (protocol, spec), prefill-then-decode first, in spec order."""
    order = sorted(protocols, key=lambda p: p != "prefill-then-decode")
    return [(p, s, rows[(p, s)], lengths[p], context) for p in order for s in specs]


def start(args, model, device: str, specs: list[str], protocols: list[str], rows: dict, lengths: dict,
          folder: Path) -> Warmup | None:
    """The run's warm-up pool, or None (the reason printed) where none starts."""
    todo = jobs(specs, protocols, rows, lengths, args.context)
    n, why = n_workers(getattr(args, "warmup_workers", None), device, model, len(todo))
    if n == 0:
        if str(device).startswith("cuda"):
            print(f"kernel warm-up: off ({why})", file=sys.stderr)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    w = Warmup(model, device, todo, n, folder)
    print(f"kernel warm-up: {n} worker processes compile the GPU kernels of {len(todo)} configurations "
          f"ahead of the rows on a one-layer copy of the model (nothing measured; log {w.log})",
          file=sys.stderr, flush=True)
    return w


__all__ = ["Warmup", "start", "work", "jobs", "n_workers", "one_layer_config", "worker_bytes", "MAX_WORKERS"]

if __name__ == "__main__":
    sys.exit(work(Path(sys.argv[1])))

