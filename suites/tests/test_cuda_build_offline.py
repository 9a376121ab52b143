"""The CUDA sources build for sm_90a (H100 / H200) on a machine without a GPU, and their
libraries agree with the Python that drives them. Kernel work done offline (a session
without device time) otherwise meets nvcc first on the GPU, where a build error costs the
call. Each library is built as `KernelLibrary.load` builds it (kernels/cuda/library.py
`compile_library`: the same flags and arch, into a temporary build root), then loaded with
ctypes and checked by the module's own `_declare` (entry points, the plan structs' sizes
against their ctypes mirrors) and, for HQMQ, the variant count. No kernel runs here: the GPU
tests (test_cuda_*.py) do that. Skipped without nvcc, and on a GPU (those tests build)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvqbench.kernels.cuda import decode_attention as cd
from kvqbench.kernels.cuda import hqmq_decode as ch
from kvqbench.kernels.cuda import library, step_write

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CUDA tests build the libraries for real"),
    pytest.mark.skipif(library.nvcc() is None, reason="no nvcc on this machine"),
]

LIBS = {"decode_attention": cd._LIB, "hqmq_decode": ch._LIB, "step_write": step_write._LIB}


@pytest.mark.parametrize("name", sorted(LIBS))
def test_the_cuda_library_builds_for_sm90_and_matches_its_python(name, tmp_path, monkeypatch):
    lib = LIBS[name]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(library.PDL, "_setters", [])  # (a declare attaches its library's PDL setter: not kept)
    path = library.compile_library(lib.source, lib.stem, (9, 0), lib.extra, lib.base)
    try:
        so = ctypes.CDLL(str(path))
    except OSError as e:  # (the CUDA runtime is linked statically; a driver-less loader may still refuse)
        pytest.skip(f"built, but not loadable here: {e}")
    why = lib._declare(so)
    assert why is None, why
    if lib is ch._LIB:
        so.kvq_hqmq_num_variants.restype = ctypes.c_int
        assert so.kvq_hqmq_num_variants() == ch.JOINT_VARIANT + 1  # (0 .. NUM_VARIANTS - 1, then the joint one)
