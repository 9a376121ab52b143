"""The CUDA backend's build and load machinery: nvcc at first use, ctypes, no torch headers.

Build: `nvcc -O3 --use_fast_math -shared` of one .cu file of this folder (the shared
`*.cuh` headers hashed in; ~15 s) for the device's architecture (sm_90a on an H100/H200),
into the torch extensions cache (`TORCH_EXTENSIONS_DIR`, else torch's default) under a name
hashing the source, flags and nvcc version; concurrent builders wait for one nvcc (a file
lock) and the library appears by an atomic rename. `KernelLibrary` builds and loads one
source once per process, at first use: importing this module runs no nvcc and touches no
GPU. `load_library` says why a library cannot be had here (no CUDA torch, ROCm, a GPU
older than sm_80, no nvcc, a failed build). The switches a built library is told (the fused
combine, programmatic dependent launch) live here too; what every launch shares (plans,
GQA split, scratch partials) is launch.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

try:
    import fcntl  # POSIX: the build lock between processes
except ImportError:  # pragma: no cover - no CUDA build on such hosts anyway
    fcntl = None

import torch

FLAGS = ["-O3", "--use_fast_math", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo"]
# A source whose results must equal torch's bit for bit (step_write.cu: the stored bytes of a
# cache write): IEEE division and denormals, no FMA contraction (torch rounds each product)
EXACT_FLAGS = ["-O3", "-fmad=false", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo"]
QTYPE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # the .cu sources' dtype codes (q, out)


def nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc") or ""]:
        if cand and os.path.exists(cand):
            return cand
    return None


def arch_flags(cap: tuple[int, int]) -> list[str]:
    a = f"{cap[0]}{cap[1]}"
    if cap == (9, 0):  # Hopper: the arch-specific target
        return ["-gencode", "arch=compute_90a,code=sm_90a"]
    return ["-gencode", f"arch=compute_{a},code=sm_{a}"]


def build_dir() -> Path:
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / "kvqbench_cuda_decode"


def compile_library(source: Path, stem: str, cap: tuple[int, int], extra: tuple[str, ...] = (),
                    base: tuple[str, ...] = tuple(FLAGS)) -> Path:
    """nvcc `source` into a shared library for compute capability `cap`, once per
    source/flags/compiler/arch (the file name carries their hash); extra: more nvcc flags
    (the fused build's define: FusedCombine); base: the flags before them (FLAGS or
    EXACT_FLAGS). Raises RuntimeError (nvcc missing or failing) or OSError / SubprocessError."""
    path = nvcc()
    if path is None:
        raise RuntimeError("no nvcc found (CUDA_HOME / PATH): cannot build the CUDA kernels")
    ver = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = list(base) + arch_flags(cap) + list(extra)
    headers = "".join(h.read_text() for h in sorted(source.parent.glob("*.cuh")))  # included by every source
    key = hashlib.sha256((source.read_text() + headers + "\0".join(flags) + ver).encode()).hexdigest()[:16]
    out = build_dir() / f"{stem}_sm{cap[0]}{cap[1]}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One build per machine: processes starting together (pytest-xdist workers, torchrun
    # ranks) wait for the first one's nvcc instead of each running its own (`pytest -n 19`
    # would start 38 nvcc processes on a fresh host); the lock is released if its
    # holder dies, and the library appears by an atomic rename, so a reader never sees half.
    with open(out.parent / f"{stem}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            print(f"kvqbench: building {source.name} for sm_{cap[0]}{cap[1]} (once per machine, about a minute)",
                  file=sys.stderr, flush=True)
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            r = subprocess.run([path, *flags, "-o", str(tmp), str(source)], capture_output=True, text=True,
                               timeout=900)
            if r.returncode != 0:
                raise RuntimeError(f"nvcc failed ({r.returncode}): {(r.stderr or r.stdout)[-800:]}")
            os.replace(tmp, out)
    return out


def load_library(source: Path, stem: str, extra: tuple[str, ...] = (),
                 base: tuple[str, ...] = tuple(FLAGS)) -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) for `source` built for this GPU, or (None, why not): no CUDA
    device, ROCm, a GPU below sm_80 (mma.sync m16n8k16), no nvcc, a failed build."""
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    if getattr(torch.version, "hip", None):
        return None, "ROCm torch: the kernels are CUDA (mma.sync, movmatrix)"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return None, f"GPU sm_{cap[0]}{cap[1]}: the kernels need sm_80+ (mma.sync m16n8k16)"
    try:
        return ctypes.CDLL(str(compile_library(source, stem, cap, extra, base))), None
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, f"building/loading {source.name} failed: {type(e).__name__}: {e}"


class KernelLibrary:
    """One CUDA source's library (decode_attention.cu's, hqmq_decode.cu's), built and loaded once
    per process at first use: `load()` gives it or None, `why` the reason when it is None
    (from `load_library`, or from `declare(lib)`, which sets the entry points' ctypes
    signatures and may refuse the library by returning a reason). extra: more nvcc flags
    (another build of the same source: the fused combine's, FusedCombine); base: FLAGS or
    EXACT_FLAGS."""

    def __init__(self, source: Path, stem: str, declare, extra: tuple[str, ...] = (), base=tuple(FLAGS)):
        self.source, self.stem, self._declare, self.extra, self.base = source, stem, declare, tuple(extra), tuple(base)
        self.lib: ctypes.CDLL | None = None
        self.why: str | None = None
        self._tried = False
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                lib, self.why = load_library(self.source, self.stem, self.extra, self.base)
                if lib is not None:
                    self.why = self._declare(lib)
                    self.lib = lib if self.why is None else None
            return self.lib

    def why_unavailable(self) -> str | None:
        """None when the CUDA kernels are built and loadable here, else the reason (builds
        them on the first call)."""
        self.load()
        return self.why

    def entry(self, name: str):
        """The library's entry point `name`, loading it first; RuntimeError (saying why)
        when the library is unavailable."""
        lib = self.lib or self.load()
        if lib is None:
            raise RuntimeError(f"{self.source.name} ({self.stem}) is unavailable: {self.why}")
        return getattr(lib, name)


class Switch:
    """A process-wide on / off that its module reads at every call (THE SWITCH of a feature
    kept behind its GPU measurements); `set` flips it inside a block."""

    def __init__(self, on: bool):
        self.on = on

    @contextlib.contextmanager
    def set(self, on: bool):
        """On (or off) inside the block, as before it after."""
        old, self.on = self.on, on
        try:
            yield
        finally:
            self.on = old


class FusedCombine(Switch):
    """THE SWITCH of the fused combine: a call's split kernel merges its own partials (the
    last CTA of each row group, common.cuh `combine_rows`, the same bits as the combine
    launch) instead of a second launch, so an eager call issues one kernel, not two. Off by
    default: its GPU tests passed (H100, 2026-12-06: every fused call bit-equal to the
    unfused one) but it loses on GPU time: the last CTA merges a whole kv head's rows alone.
    Graphed, B=1, T=32k (reports/latency/fused_combine_h100_2026-12-06/): int4 31.9 -> 38.9
    us, fp8 42.0 -> 49.3, HQMQ 32.8 -> 39.7; B=8: int4, fp8, KIVI 2-3% slower, HQMQ 1% faster;
    for 1-2 us less host time per eager call (host_time_h100_2026-12-06c.txt, B=8: int4
    20.5 -> 19.2 us, fp8 20.6 -> 19.2). `KVQBENCH_FUSED_COMBINE=1` turns it on for a
    process. Read at every launch (no plan holds it), so `on` may be set in a run;
    `mode()` names what runs now, for a benchmark to record. The fused kernels are another
    build of each .cu (FUSED_DEFINE; built at the first fused call), so the default
    library, its kernels and its build time stay as they were. Plans are shared: the same
    struct, the same splits. Each call's counters (B * Hkv int32) sit beside its partials:
    in its workspace (`workspace_counters`) or the scratch buffer of its stream and thread
    (`fresh_partials`), zeroed when allocated and left at zero by every launch."""

    def mode(self) -> str:
        return "fused" if self.on else "split+combine"


def fused_declare(build: str, run: str, declare):
    """The `declare` of a source's fused build (KernelLibrary's): the build flag `build`
    checked, the entry `run` set (the default entry's nine pointers, then the counters),
    then the default build's own declarations."""
    def declare_fused(lib) -> str | None:
        getattr(lib, build).restype = ctypes.c_int
        if getattr(lib, build)() != 1:
            return "not a fused build (KVQ_FUSED_COMBINE)"
        entry = getattr(lib, run)
        entry.argtypes = [ctypes.c_void_p] * 10
        entry.restype = ctypes.c_int
        return declare(lib)
    return declare_fused


class LaunchOverlap(Switch):
    """THE SWITCH of programmatic dependent launch (common.cuh `pdl_on`): a CUDA call's combine
    is launched as its split kernel's programmatic dependent, so the GPU starts the combine's
    CTAs while the split kernel's last wave finishes (each waits for the split grid's
    partials) instead of after it: the gap between the two kernels goes, the combine's
    arithmetic and its order stay, so the result is the same bits. sm_90+ only (a library on
    an older GPU is told 0). Its GPU tests pass (2026-12-07), but it stays off: eager calls
    end 0.5-2 us sooner, graphed ones do not (H100, B=8 T=32k: as fast or 0.4-1.3 us slower;
    B=1 HQMQ / Med3x 1.6 us slower: the waiting combine CTAs take slots from the split
    kernel's tail, and a graph has no launch gap to hide; reports/latency/h100_2026-12-07/).
    `KVQBENCH_PDL=1` turns it on for a process. A library, once loaded, is told the state
    (`attach`: its kvq_*set_pdl entry), and again at every change of `on`."""

    def __init__(self, on: bool):
        self._setters: list = []
        super().__init__(on)

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = bool(value)
        for setter, capable in self._setters:
            setter(int(self._on and capable))

    def attach(self, setter) -> None:
        """Tell a loaded library's `setter` (its ctypes entry, int -> void) the state, now and
        at every change; PDL needs sm_90+, so an older device's library is always told 0."""
        capable = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
        self._setters.append((setter, capable))
        setter(int(self._on and capable))


FUSED_COMBINE = FusedCombine(os.environ.get("KVQBENCH_FUSED_COMBINE", "0").strip() == "1")
PDL = LaunchOverlap(os.environ.get("KVQBENCH_PDL", "0").strip() == "1")
FUSED_DEFINE = ("-DKVQ_FUSED_COMBINE=1",)  # the fused build's nvcc flag (KernelLibrary extra)


__all__ = ["FLAGS", "EXACT_FLAGS", "QTYPE", "FUSED_COMBINE", "FUSED_DEFINE", "FusedCombine", "KernelLibrary", "Switch",
           "fused_declare", "LaunchOverlap", "PDL", "arch_flags", "build_dir", "compile_library", "load_library", "nvcc"]
