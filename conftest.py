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


def _patch_the_interpreter_once_per_launch():
    """Under the Triton interpreter, every call of a @triton.jit helper from inside a
    kernel (pack_row, tl.sum, tl.where's helpers...: thousands per launch, once per grid
    program) re-runs `_patch_lang`, which walks triton.language with inspect.getmembers
    to swap its builtins for the interpreter's; the launch already did that for the same
    modules, and nothing undoes it before the launch ends. This skips a helper's re-patch
    when every language module its globals hold was patched during the current launch
    (the first patch of any other module still runs), so the kernels execute the same
    numpy operations: bit-identical results (suites/tests/test_conftest_speedups.py), in
    15-20% less CPU for the interpreter-bound tests (reports/ci/durations.md). A no-op on
    a GPU, without triton, or on a Triton whose interpreter lacks these internals."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect
        import threading

        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:  # pragma: no cover
        return
    orig_patch = getattr(it, "_patch_lang", None)
    grid = getattr(it, "GridExecutor", None)
    if orig_patch is None or grid is None or not hasattr(it, "_LangPatchScope") or hasattr(orig_patch, "memo"):
        return
    orig_call = grid.__call__
    memo = threading.local()  # .launch: ids of the modules patched during this thread's current launch
    memo.enabled, memo.skipped = True, 0

    def patch_lang(fn):
        patched = getattr(memo, "launch", None)
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}
        if patched is not None and langs and langs <= patched and getattr(memo, "enabled", True):
            memo.skipped = getattr(memo, "skipped", 0) + 1
            return it._LangPatchScope()  # nothing to undo
        scope = orig_patch(fn)
        if patched is not None:
            patched |= langs
        return scope

    def call(self, *args, **kwargs):
        outer, memo.launch = getattr(memo, "launch", None), set()
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            memo.launch = outer

    patch_lang.memo = memo
    it._patch_lang, grid.__call__ = patch_lang, call


def _run_each_test_in_a_roomy_frame():
    """Python 3.11 keeps frames on a per-thread stack of 16 KiB chunks, allocated with mmap
    when a call crosses into a new chunk and unmapped when it returns (CPython's
    `_PyThreadState_BumpFramePointerSlow` / `_PyThreadState_PopFrame`). A hot loop whose
    calls straddle a chunk boundary pays an mmap + munmap per call: under the Triton
    interpreter, with pytest's, transformers' and the harness' frames below it, the
    kernels' tests made ~800k of each per test (strace), half their CPU time as system
    time. Each test (its setup, call and teardown) runs instead inside one frame sized
    ~128 KiB by unused local names, which gets a 256 KiB chunk of its own: the ~128 KiB
    above it hold any test's stack, so no call in it allocates a chunk. Nothing the
    tests do or check changes (test_conftest_speedups.py checks it is in place)."""
    import _pytest.runner as runner

    orig = getattr(runner, "runtestprotocol", None)
    if orig is None or hasattr(orig, "roomy"):
        return
    names = " = ".join(f"_{i}" for i in range(ROOMY_LOCALS))
    code = (f"def roomy(fn, *args, **kwargs):\n    if fn is None:  # never: the names only size the frame\n"
            f"        {names} = None\n    return fn(*args, **kwargs)\n")
    ns: dict = {}
    exec(compile(code, "<conftest.py roomy frame>", "exec"), ns)
    roomy = ns["roomy"]

    def runtestprotocol(item, log=True, nextitem=None):
        return roomy(orig, item, log=log, nextitem=nextitem)

    runtestprotocol.roomy = roomy
    runner.runtestprotocol = runtestprotocol


ROOMY_LOCALS = 16000  # 8 bytes each: a 128 KiB frame
if os.environ.get("KVQBENCH_PLAIN_PYTEST") != "1":  # "1": neither speed-up (to measure what they save)
    _patch_the_interpreter_once_per_launch()
    _run_each_test_in_a_roomy_frame()

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
