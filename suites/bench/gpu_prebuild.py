"""Build the CUDA libraries on the CPU machine for a GPU's architecture, so that a GPU call
finds them built instead of spending its device time in nvcc (a fresh H200 machine spent
~180 s on hqmq_decode.cu alone, 369 s on two trees side by side; 2026-12-07).

    python -m kvqbench.suites.bench.gpu_prebuild                  # sm_90a into .gpubuild/
    python -m kvqbench.suites.bench.gpu_prebuild --cap 8.0 --out DIR

The libraries land where `kernels/cuda/library.compile_library` looks when
TORCH_EXTENSIONS_DIR is the output folder; their names carry the hash of source, headers,
flags and `nvcc --version`, so a GPU machine whose nvcc differs builds its own and never
loads a stale one. On the GPU machine: carry `.gpubuild` and `export
TORCH_EXTENSIONS_DIR=$PWD/.gpubuild` after sourcing gpu_env.sh (gpu_env.sh does it when
.gpubuild exists). Needs nvcc here; exits 1 naming the library whose build failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def libraries():
    """Every KernelLibrary of kernels/cuda (plain and fused builds)."""
    from ...kernels.cuda import decode_attention, hqmq_decode, step_write

    return [decode_attention._LIB, decode_attention._FUSED, hqmq_decode._LIB, hqmq_decode._FUSED, step_write._LIB]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", default="9.0", help="compute capability, e.g. 9.0 (H100 / H200) or 8.0")
    ap.add_argument("--out", default=".gpubuild", help="the folder to use as TORCH_EXTENSIONS_DIR")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes side by side")
    a = ap.parse_args(argv)
    root = Path(a.out).resolve()
    old = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)  # read by build_dir() at each build
    try:
        return _build_all(root, tuple(int(x) for x in a.cap.split(".")), a.jobs)
    finally:  # (an in-process caller keeps its own build root)
        if old is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = old


def _build_all(root: Path, cap: tuple[int, int], jobs: int) -> int:
    from ...kernels.cuda.library import compile_library

    t0 = time.time()

    def build(lib):
        try:
            return lib.stem, compile_library(lib.source, lib.stem, cap, lib.extra, lib.base), None
        except Exception as e:  # noqa: BLE001 - reported per library below
            return lib.stem, None, f"{type(e).__name__}: {e}"

    failed = 0
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for stem, path, err in pool.map(build, libraries()):
            if err:
                failed += 1
                print(f"{stem}: FAILED {err}", file=sys.stderr)
            else:
                print(f"{stem}: {path} ({path.stat().st_size / 2**20:.1f} MiB, {time.time() - t0:.0f} s)", flush=True)
    total = sum(f.stat().st_size for f in root.rglob("*.so")) / 2**20
    print(f"{root}: {total:.0f} MiB of libraries" + ("  (the run tool carries 64 MiB in all: remove the folder "
                                                     "and build again to drop stale ones)" if total > 40 else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
