"""The Triton kernels compile for sm_90 (H100 / H200) on a machine without a GPU
(kernels/aot_check.py). CI runs the kernels under the interpreter, which takes constructs
the compiler refuses: a loop-carried int as a static_range bound (the beam search of
kernels/vq_step.py) passed every interpreter test and failed to build on an H100. Each case
compiles in a process without the interpreter, at head_dim 64 (the embedded models')."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CASES = {
    # every default spec's dense step kernels (spherical, additive / flat VQ): prefill write and graphed step
    "dense-steps": ["--dense-steps", "--head-dims", "64", "--dtypes", "float16"],
    # the fused decode-attention kernels (HQMQ, Med3x, int4, KIVI-2/4, fp8) and HQMQ's search
    "decode": ["--d", "64"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile them for real")
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_compile_for_sm90_without_a_gpu(case):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "kvqbench.kernels.aot_check", *CASES[case]], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "FAIL" not in r.stdout and r.stdout.count("OK ") >= 10, r.stdout[-2000:]  # variants were compiled
