"""Does compiling Triton specialisations ahead in threads (kernels/precompile.py) pay here?
A GPU diagnostic, `python -m kvqbench.suites.bench.precompile_check [--threads N]`:

1. a child process with an empty Triton cache launches the Triton decode kernels of a few
   formats one after another (what a fresh machine's rows do) and records their
   specialisations: the serial compile seconds;
2. a second child, with another empty cache, compiles that manifest in N threads, then
   launches the same kernels: the pool's wall seconds, the seconds its launches still spend in
   Triton's compile path (a disk-cache load when the key matched) and whether every output
   equals the first child's bit for bit.

Prints one JSON line per child and a verdict line. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPECS = ["int4", "kivi:bits=2", "hqmq:S=24,r=3", "hqmq:S=96,r=4", "hqmq:S=256,r=5"]


def _launches(specs):
    """Every spec's Triton decode attention on a small cache: the outputs."""
    import torch

    from kvqbench.kernels import layout as L
    from kvqbench.kernels.decode_attention import decode_attention
    from kvqbench.quantizers import get_quantizer

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 3, 333, 64, generator=g).half().cuda() for _ in range(2))
    q = torch.randn(2, 9, 1, 64, generator=g).half().cuda()
    outs = []
    for spec in specs:
        pk = get_quantizer(spec, role="K", seed=3).encode(k)
        pv = get_quantizer(spec, role="V", seed=3).encode(v)
        outs.append(decode_attention(q, L.flatten(pk, "K"), L.flatten(pv, "V"), backend="triton"))
    torch.cuda.synchronize()
    return outs


def child(mode: str, manifest_path: str, threads: int, out_path: str) -> None:
    import torch

    from kvqbench.kernels import precompile as P
    from kvqbench.suites.bench.first_use import FirstUseLog
    from kvqbench.suites.harness.fetch import write_atomic

    shape = {"check": 1}
    res = {"mode": mode, "triton_cache": os.environ.get("TRITON_CACHE_DIR")}
    if mode == "pool":
        m = P.Manifest(manifest_path, shape)
        t0 = time.perf_counter()
        pool = P.preload(m, ["all"], threads)
        pool.wait()
        res.update(pool_wall_s=round(time.perf_counter() - t0, 2), pool=pool.summary(), threads=threads)
    rec, log = P.Recorder(), FirstUseLog()  # the Recorder chains the log's hook
    rec.label = "all"
    t0 = time.perf_counter()
    with log.installed(), rec.installed():
        outs = _launches(SPECS)
    first = log.since(0)
    res.update(launch_wall_s=round(time.perf_counter() - t0, 2), compile_path_s=first["compile_s"],
               first_launch_init_s=first["first_launch_init_s"], compiles_met=first["compiles"])
    if mode == "record":
        m = P.Manifest(manifest_path, shape)
        m.merge(rec.seen)
        write_atomic(Path(manifest_path), m.dumps())
    torch.save([o.cpu() for o in outs], out_path)
    print(json.dumps(res), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--child", nargs=3, metavar=("MODE", "MANIFEST", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], a.child[1], a.threads, a.child[2])
        return 0
    import torch

    work = tempfile.mkdtemp(prefix="kvq_precompile_")
    manifest = os.path.join(work, "manifest.json")
    for mode in ("record", "pool"):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(dir=work))
        r = subprocess.run([sys.executable, "-m", "kvqbench.suites.bench.precompile_check", "--threads",
                            str(a.threads), "--child", mode, manifest, os.path.join(work, f"{mode}.pt")], env=env)
        if r.returncode != 0:
            print(f"child {mode} failed ({r.returncode})")
            return 1
    same = all(torch.equal(x, y) for x, y in zip(torch.load(os.path.join(work, "record.pt")),
                                                    torch.load(os.path.join(work, "pool.pt"))))
    print(f"outputs bit-identical with and without the pool: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
