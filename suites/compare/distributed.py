"""`kvqbench compare` over several processes launched by `torchrun` (or by `compare
--workers N` itself, `launch`): one rank per GPU (NCCL), several ranks per GPU (gloo: for
host-bound runs), or per CPU process (gloo), on one node or many through torchrun's
rendezvous.
The launcher, the rendezvous and the collectives are torch's; this module only says
who scores what and how the figures are put back together.

Work is split in units: (protocol, spec, seed) x window batch, the batches being the
very ones a single process scores (`perplexity.batch_rows` windows each, cut from the
start). Units are dealt round-robin to the ranks in rounds of whole configurations;
after each round the per-batch figures (float64 NLL sum, predicted tokens, stored
bytes and elements) are gathered to rank 0 as Python objects and summed there in
batch order, exactly as the single-process loop adds them, so a configuration's
figures do not depend on the world size or on which rank scored which batch. Rank 0
alone holds results.json (its lock, its saves) and writes the report; it saves after
every round, so a killed run loses at most the round in flight, and a rerun with any
world size resumes on the (protocol, spec, seed) records as before.

A configuration's `wall_s` is then the summed scoring time of its batches on all
ranks; the scoring phase's own wall time and each rank's busy time are in
meta.distributed.scoring. Also here: `--device-map` (a model spread over a node's GPUs
by accelerate: one rank per node) and the GPU pinning of pytest-xdist workers.

A single process without torchrun never comes here (`launched()` is False).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

Job = tuple  # (protocol, spec, seed), as run.jobs_for makes them
# Ranks wait for each other at every round; a round on a big model can be long, so the
# collectives' timeout is generous (NCCL's default is 10 minutes).
COLLECTIVE_TIMEOUT = timedelta(hours=2)
UNITS_PER_RANK = 4  # units each rank scores per round: fewer syncs, better balance, more lost on a kill
# A model whose weights take more than this share of one GPU is spread over the node's
# GPUs: the rest is for activations, the logits (perplexity.LOGITS_BUDGET) and the cache.
FITS_ONE_GPU = 0.75
# Summed over batches; `constant_nbytes` (the model constants, once per model) is not.
SUMMED = ("nll_sum", "n_predicted", "cache_nbytes", "total_nbytes", "cache_elements", "n_windows", "wall_s")


class DistributedSetupError(ValueError):
    """torchrun's environment or the device flags do not fit together; the message says how."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str  # "nccl" or "gloo"
    device: str   # where this rank's model lives: "cpu", "cuda:<local_rank>", or "cuda:0" under a device map

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Unit:
    """Windows [start, stop) of one configuration: batch `batch` of `rows` windows."""
    job: Job
    batch: int
    start: int
    stop: int
    rows: int


def launched(environ=None) -> bool:
    """Was this process started by torchrun (or anything that sets its variables)?"""
    env = os.environ if environ is None else environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _env_int(env, key: str, default=None) -> int:
    value = env.get(key, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedSetupError(f"torchrun variable {key}={value!r} is not an integer") from None


def plan_ranks(device: str, device_map: str | None = None, environ=None, cuda_count: int | None = None) -> Ranks:
    """Read torchrun's environment and choose the backend and this rank's device;
    pure (no process group), so every refusal is a clear message before any work.

    device: the run's device as `compare --device` gives it ("cpu", "cuda"). Under
    several ranks the GPU index comes from LOCAL_RANK, so an explicit "cuda:1" is refused.
    device_map: "auto" spreads one model over every GPU of the node, which then runs
    one rank only (LOCAL_WORLD_SIZE 1).
    """
    env = os.environ if environ is None else environ
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    local_rank = _env_int(env, "LOCAL_RANK")
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise DistributedSetupError(f"inconsistent torchrun variables RANK={rank} WORLD_SIZE={world} "
                                    f"LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world}")
    dev = torch.device(device)
    if dev.type == "cpu":
        if device_map not in (None, "none"):
            raise DistributedSetupError(f"--device-map {device_map} spreads a model over GPUs; this run is on the CPU")
        return Ranks(rank, world, local_rank, local_world, "gloo", "cpu")
    if dev.type != "cuda":
        raise DistributedSetupError(f"--device {device}: torchrun runs here on cpu (gloo) or cuda (NCCL)")
    if dev.index is not None and world > 1:
        raise DistributedSetupError(f"--device {device}: under torchrun each rank takes the GPU of its LOCAL_RANK; "
                                    "pass --device cuda (or CUDA_VISIBLE_DEVICES to choose the GPUs)")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if device_map == "auto":
        if local_world != 1:
            raise DistributedSetupError(f"--device-map auto spreads each rank's model over all {count} GPUs of its "
                                        f"node, so run one rank per node (--nproc-per-node 1), not {local_world}")
        return Ranks(rank, world, local_rank, local_world, "nccl", "cuda:0")
    if count < 1:
        raise DistributedSetupError(f"--device {device} but no GPU is visible on this node")
    if local_world > count:
        # More ranks than GPUs: they share the GPUs round-robin. NCCL refuses two ranks on
        # one GPU, and every collective here carries Python objects, so gloo (over the
        # host) does. Why share: decode steps of quantizers without a device step encoder
        # run as ordinary torch ops and are bound by the host's Python, not by the GPU
        # (reports/decode/compare_both_h200.md); N processes use N of the host's cores.
        # Each rank holds its own model and caches: size N to the GPU's memory.
        return Ranks(rank, world, local_rank, local_world, "gloo", f"cuda:{local_rank % count}")
    return Ranks(rank, world, local_rank, local_world, "nccl", f"cuda:{local_rank}")


def weights_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Bytes the model in `folder` takes as `dtype`, from its safetensors headers (the
    tensors themselves are not read)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    numel = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        numel += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return numel * torch.empty((), dtype=dtype).element_size()


def choose_device_map(flag: str | None, model: str, dtype: torch.dtype, device: str) -> str | None:
    """`--device-map`: "auto" or "none" as given; unset, "auto" on a GPU run when the
    weights of a local model folder exceed FITS_ONE_GPU of one GPU's memory (embedded
    models are small; a hub id is not sized before it is fetched: pass the flag)."""
    on_gpu = torch.device(device).type == "cuda"
    if flag == "auto" and not on_gpu:
        raise DistributedSetupError(f"--device-map auto spreads a model over GPUs; this run is on {device}")
    if flag is not None or not on_gpu or not Path(model).expanduser().is_dir():
        return None if flag in (None, "none") else flag
    try:
        need = weights_bytes(Path(model).expanduser(), dtype)
    except (OSError, ValueError, KeyError):
        return None  # not sized here: the load will say what is wrong with the folder
    have = torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory
    return "auto" if need > FITS_ONE_GPU * have else None


def pin_xdist_worker_gpu(environ=None, gpus: int | None = None) -> str | None:
    """`pytest -n N` on a multi-GPU runner: pin pytest-xdist worker gwK to GPU K (mod the
    GPUs visible) through CUDA_VISIBLE_DEVICES, so everything it runs sees one GPU.
    Call it from a `pytest_configure` hook (before any test module asks torch for CUDA).
    Returns the GPU chosen, or None outside xdist or without GPUs."""
    env = os.environ if environ is None else environ
    worker = env.get("PYTEST_XDIST_WORKER", "")
    if not re.fullmatch(r"gw\d+", worker):
        return None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        count = torch.cuda.device_count() if gpus is None else gpus  # NVML: CUDA itself stays uninitialised
        visible = [str(i) for i in range(count)]
    if not visible:
        return None
    env["CUDA_VISIBLE_DEVICES"] = visible[int(worker[2:]) % len(visible)]
    return env["CUDA_VISIBLE_DEVICES"]


def start(device: str, device_map: str | None = None) -> Ranks:
    """Join the process group torchrun set up (env:// rendezvous) and pin this rank's GPU."""
    ranks = plan_ranks(device, device_map)
    if ranks.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(ranks.device))  # NCCL's object collectives use the current device
    if not dist.is_initialized():
        dist.init_process_group(ranks.backend, timeout=COLLECTIVE_TIMEOUT)
    return ranks


def stop() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def local_main_first(ranks: Ranks | None) -> Iterator[None]:
    """The body runs on each node's local rank 0 first, then on the others: the first
    load of a model fetches and converts it into the node's cache once, the rest read it."""
    if ranks is None or ranks.world_size == 1:
        yield
        return
    if ranks.local_rank != 0:
        dist.barrier()
    yield
    if ranks.local_rank == 0:
        dist.barrier()


def describe(ranks: Ranks) -> dict:
    """What results.json records of the run's ranks (a collective: every rank calls it)."""
    me = {"rank": ranks.rank, "host": socket.gethostname(), "device": ranks.device}
    if ranks.device.startswith("cuda"):
        me["gpu"] = torch.cuda.get_device_name(torch.device(ranks.device))
    everyone = [None] * ranks.world_size
    dist.all_gather_object(everyone, me)
    return {"launcher": "torchrun", "world_size": ranks.world_size, "backend": ranks.backend,
            "ranks": everyone, "units_per_rank_per_round": UNITS_PER_RANK}


def check_same(ranks: Ranks, tensor: torch.Tensor, what: str) -> None:
    """Refuse to go on unless every rank holds the same `tensor` (the token windows)."""
    digest = hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    everyone = [None] * ranks.world_size
    dist.all_gather_object(everyone, digest)
    if len(set(everyone)) != 1:
        odd = [r for r, d in enumerate(everyone) if d != everyone[0]]
        raise RuntimeError(f"ranks {odd} hold other {what} than rank 0 (different files or versions per node?)")


def units_of(job: Job, n_windows: int, rows: int) -> list[Unit]:
    """The window batches one process scores for `job`: [0, rows), [rows, 2 rows), ..."""
    if rows < 1 or n_windows < 1:
        raise ValueError(f"need rows >= 1 and n_windows >= 1, got {rows}, {n_windows}")
    return [Unit(job, b, s, min(s + rows, n_windows), rows) for b, s in enumerate(range(0, n_windows, rows))]


def plan_rounds(todo: list[Job], units_by_job: dict, world_size: int,
                per_rank: int = UNITS_PER_RANK) -> list[list[Unit]]:
    """Consecutive whole configurations per round, until the round holds at least
    `per_rank` units per rank; a round's units in configuration, then batch order."""
    rounds, current = [], []
    for job in todo:
        current += units_by_job[job]
        if len(current) >= per_rank * world_size:
            rounds.append(current)
            current = []
    if current:
        rounds.append(current)
    return rounds


def mine(units: list[Unit], rank: int, world_size: int) -> list[Unit]:
    """Round-robin: rank r scores units r, r + world, ... (neighbours in the grid tend
    to cost alike, so this spreads cheap and dear configurations over the ranks)."""
    return units[rank::world_size]


def combine(job: Job, parts: list[tuple[int, dict]]) -> dict:
    """One configuration's record from its batches' records [(batch, record)]: sums
    in batch order (float64 NLL added as the single-process loop adds it), PPL and
    bits recomputed from the sums. A failed batch fails the configuration."""
    parts = sorted(parts, key=lambda p: p[0])
    if [b for b, _ in parts] != list(range(len(parts))):
        raise RuntimeError(f"{job}: batches {[b for b, _ in parts]} gathered, expected 0..{len(parts) - 1}")
    errors = [(b, r["error"]) for b, r in parts if "error" in r]
    if errors:
        protocol, spec, seed = job
        return {"protocol": protocol, "spec": spec, "seed": seed,
                "error": f"{errors[0][1]} (window batch {errors[0][0]})"}
    out = dict(parts[0][1])
    for key in SUMMED:
        total = 0.0 if isinstance(out[key], float) else 0
        for _, r in parts:
            total += r[key]
        out[key] = total
    for key in ("window_nll", "continuations"):  # per window (NLL sums, greedy twins' tokens), in window order
        if all(key in r for _, r in parts):
            out[key] = [x for _, r in parts for x in r[key]]
    out["ppl"] = math.exp(out["nll_sum"] / out["n_predicted"])
    numel = out["cache_elements"]
    # total (constants charged to every window, as before the split) and the cache's own
    out["bits_per_element"] = out["total_nbytes"] * 8 / numel if numel else float("nan")
    out["cache_bits_per_element"] = out["cache_nbytes"] * 8 / numel if numel else float("nan")
    out["constant_nbytes"] = max(r["constant_nbytes"] for _, r in parts)  # one model's, not summed
    return out


def _score(units: list[Unit], measure: Callable[[Unit], dict]) -> list[tuple[Job, int, dict]]:
    out = []
    for u in units:
        try:
            out.append((u.job, u.batch, measure(u)))
        except Exception as e:  # the configuration fails on rank 0's record, the run goes on
            out.append((u.job, u.batch, {"error": f"{type(e).__name__}: {e}"}))
    return out


def score_rounds(ranks: Ranks, todo: list[Job] | None, rows_of: Callable[[Job], int], n_windows: int,
                 measure: Callable[[Unit], dict], on_record: Callable[[Job, dict], None] | None = None,
                 per_rank: int = UNITS_PER_RANK) -> dict:
    """Score `todo` (rank 0's list; the others pass None and receive it) over the ranks.

    measure(unit) -> the perplexity record of windows [unit.start, unit.stop) scored
    `unit.rows` at a time (may raise). on_record(job, record) runs on rank 0 for each
    configuration, in `todo` order, once its round is gathered (a record with "error"
    for a failed one). Ends the process group: what follows is rank 0's alone.
    Returns (rank 0) the scoring summary: wall seconds, units, rounds, per-rank busy seconds.
    """
    box = [todo]
    dist.broadcast_object_list(box, src=0)
    todo = box[0]
    units_by_job = {job: units_of(job, n_windows, rows_of(job)) for job in todo}
    rounds = plan_rounds(todo, units_by_job, ranks.world_size, per_rank)
    t0, busy = time.perf_counter(), 0.0
    for units in rounds:
        t = time.perf_counter()
        scored = _score(mine(units, ranks.rank, ranks.world_size), measure)
        busy += time.perf_counter() - t
        gathered = [None] * ranks.world_size if ranks.is_main else None
        dist.gather_object(scored, gathered, dst=0)
        if ranks.is_main:
            by_job: dict = {}
            for part in gathered:
                for job, batch, record in part:
                    by_job.setdefault(tuple(job), []).append((batch, record))
            for job in dict.fromkeys(u.job for u in units):
                record = combine(job, by_job.get(job, []))
                if on_record:
                    on_record(job, record)
    wall = time.perf_counter() - t0
    busy_all = [None] * ranks.world_size if ranks.is_main else None
    dist.gather_object(round(busy, 3), busy_all, dst=0)
    stop()
    return {"world_size": ranks.world_size, "wall_s": round(wall, 3), "configurations": len(todo),
            "units": sum(len(u) for u in rounds), "rounds": len(rounds), "busy_s_per_rank": busy_all}


def worker_argv(argv: list[str]) -> list[str]:
    """The command line each rank of `compare --workers` runs: this one without --workers,
    and --run spelt --run-name (torchrun's argparse takes --run for its own --run-path)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--workers":
            skip = True
        elif not a.startswith("--workers="):
            out.append("--run-name" if a == "--run" else ("--run-name=" + a[6:] if a.startswith("--run=") else a))
    return out


def launch(argv: list[str], workers: int, folder: Path) -> str:
    """`kvqbench compare --workers N`: the command line `argv` (the CLI's own) as N ranks on
    this machine through torch's launcher (`torch.distributed.run --standalone`, which
    starts the processes and their rendezvous); on one GPU they share it over gloo
    (`plan_ranks`; on one H200 four such ranks made every row 1.3-3x slower, 2026-12-05:
    it pays where ranks get GPUs of their own). Returns "ok"; "partial" when torchrun failed (its exit 1 for any rank) after
    rank 0 wrote this launch's report with failed rows in it (a single process's exit 3);
    else "failed"."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
           "-m", "kvqbench.suites.compare.cli", *worker_argv(argv)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.time()
    if subprocess.run(cmd, env=env).returncode == 0:
        return "ok"
    try:
        written = (folder / "report.md").stat().st_mtime >= started
        failed = any("error" in r for r in json.loads((folder / "results.json").read_text())["results"])
    except (OSError, ValueError, KeyError):
        return "failed"
    return "partial" if written and failed else "failed"


__all__ = ["Ranks", "Unit", "DistributedSetupError", "launched", "plan_ranks", "weights_bytes",
           "choose_device_map", "pin_xdist_worker_gpu", "start", "stop",
           "local_main_first", "describe", "check_same", "units_of", "plan_rounds", "mine", "combine",
           "score_rounds", "worker_argv", "launch", "COLLECTIVE_TIMEOUT", "UNITS_PER_RANK"]
