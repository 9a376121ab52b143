"""Shared pytest set-up: markers live in pyproject.toml. Every registered
quantizer's example configs (built-in and entry-point plugins) parametrize
the conformance suite through the `quantizer_spec` fixture."""
from __future__ import annotations

import os

import pytest
import torch

# `pytest -n N` on a multi-GPU runner: xdist worker gwK sees only GPU K (mod the GPUs
# present). It must run before anything initialises CUDA (the is_available below does):
# CUDA reads CUDA_VISIBLE_DEVICES once, at its first call.
from kvqbench.suites.compare.distributed import pin_xdist_worker_gpu  # noqa: E402

pin_xdist_worker_gpu()

# `pytest -n N`: each xdist worker's torch would start one intra-op thread per core, N x
# cores threads in all, and every CPU op (synthetic caches, references, encodes) then
# waits for a core. Each worker gets its share of the cores instead (at least one).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Triton fixes interpreter-or-compiler when a @triton.jit function is defined, and
# importing transformers' models already imports triton.language: without a GPU the
# kernels run only under the interpreter, so switch it on before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis: a CI profile that is thorough but bounded in time.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=60, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", max_examples=1000, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass


def pytest_generate_tests(metafunc):
    if "quantizer_spec" in metafunc.fixturenames:
        from kvqbench.suites.conformance import all_example_specs

        specs = all_example_specs()
        metafunc.parametrize("quantizer_spec", specs, ids=specs)


def pytest_collection_modifyitems(config, items):
    """Bench tests time things: they run only when asked for (`-m bench`)."""
    if "bench" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="benchmarks run only with -m bench")
    for item in items:
        if "bench" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Small models and short inputs run fastest on one thread; on a loaded
    machine extra threads make every small matmul wait for a core (10-100x)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
