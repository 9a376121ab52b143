"""The host-time tools of the latency suite on the CPU (kernels/cuda's Python walked with its
launches stubbed, `host_time.cuda_path_on_cpu`): host_time.py's tables, breakdown and write
figure, and host_drift.py's parts timed before and after other work. No figure is asserted
beyond being measured (host microseconds are a GPU host's, in reports/latency/)."""
from __future__ import annotations

import sys


def test_host_time_breakdown_names_where_a_call_goes(monkeypatch):
    """`host_time --breakdown` (CPU: the launch stubbed): route, kernel function and whole
    call in host us, then the call's functions by self time, the route among them."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvqbench.suites.bench.latency.host_time import host_breakdown

    text = host_breakdown("int4", 1, 256, hq=4, hkv=2, d=64, n=5)
    head, *rows = text.splitlines()
    parts = dict(p.rsplit(" ", 2)[0:2] for p in head.split(": ", 1)[1].split(", "))
    assert set(parts) == {"route", "triton kernel fn", "whole call"} and all(float(v) > 0 for v in parts.values())
    assert "function (cProfile)" in rows[0] and any("decode_attention" in r for r in rows[1:])


def test_host_time_passes_report_the_least_of_each_cell(monkeypatch, capsys):
    """`host_time --passes 2`: every row printed once per pass, then per cell the least over
    the passes (no pass below it, one pass at it) and the spread (most - least)."""
    import math

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvqbench.suites.bench.latency import host_time

    assert host_time.main(["--T", "256", "--B", "1", "--d", "64", "--formats", "int4", "--n", "3", "--passes", "2"]) == 0
    text = capsys.readouterr().out.split("walked on this CPU")[0]  # (the Triton table; the CUDA walk's follows)
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("int4")]
    assert len(rows) == 3 and "spread" in rows[2]
    passes = [[float(x) for x in r[2:5]] for r in rows[:2]]
    least, spread = [float(x) for x in rows[2][2:5]], [float(x) for x in rows[2][6:9]]
    for c in range(3):
        cell = [p[c] for p in passes]
        assert least[c] == min(cell) and math.isclose(spread[c], max(cell) - min(cell), abs_tol=0.11)


def test_host_time_walks_the_cuda_path_on_a_cpu(monkeypatch):
    """host_time on a CPU also times the CUDA backend's Python (`cuda_path_on_cpu`: q looks
    like a CUDA tensor, the launch stubbed): the breakdown names the CUDA kernel function
    and the .cu wrapper's functions; a format without a CUDA kernel gives NaN, not a
    Triton figure under the CUDA label."""
    import math

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvqbench.suites.bench.latency.host_time import cuda_path_host_us, host_breakdown

    text = host_breakdown("hqmq:S=96,r=4", 1, 256, hq=4, hkv=2, d=64, n=5, cuda_on_cpu=True)
    head, *rows = text.splitlines()
    assert "(CUDA path walked on the CPU)" in head and "cuda kernel fn" in head
    assert any("hqmq_decode.py" in r for r in rows[1:]) and not any("triton" in r for r in rows[1:])
    assert cuda_path_host_us("int4", 1, 256, hq=4, hkv=2, d=64, n=5) > 0
    assert cuda_path_host_us("hqmq:S=96,r=4", 1, 256, hq=4, hkv=2, d=64, n=5, step=True) > 0  # (retargets)
    assert math.isnan(cuda_path_host_us("fp16", 1, 256, hq=4, hkv=2, d=64, n=5))
    assert cuda_path_host_us("kivi:bits=4", 1, 256, hq=4, hkv=2, d=64, n=5, step=True) > 0  # (window rows)


def test_host_time_write_times_the_cache_write_without_running_its_kernels(monkeypatch):
    """`host_time --write` on a CPU: one layer's one-token K/V write through the quantized
    cache with the step encoders' launches stubbed (a positive figure; the launches counted,
    none run, the hook put back after), and no DynamicCache figure (its torch.cat copies the
    history on a CPU: data, not host time)."""
    import math

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvqbench.kernels import step_encode
    from kvqbench.suites.bench.latency import host_time

    monkeypatch.setattr(host_time, "HOST_US_CALLS", dict(n=5, warmup=1, rounds=2))
    before, hook = step_encode.LAUNCHES[0], step_encode.launch_hook
    us = host_time.write_host_us("int4", 1, 64, hkv=2, d=64, n=5)
    assert us > 0 and step_encode.LAUNCHES[0] - before == 2 * (1 + 1 + 2 * 5)  # K and V: prompt, warm-up, rounds
    assert step_encode.launch_hook is hook
    assert math.isnan(host_time.write_host_us(None, 1, 64, hkv=2, d=64, n=5))


def test_host_drift_times_each_part_before_and_after_the_work_between(monkeypatch, capsys):
    """host_drift on a CPU (the CUDA path walked): every step of the HQMQ plan key and of the
    call timed before and after the work between (here a stand-in: the suite's smoke run
    takes a minute), printed with the difference; the work ran once, on the asked T."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvqbench.suites.bench.latency import host_drift

    monkeypatch.setattr(host_drift, "CALLS", dict(n=3, warmup=1, rounds=2))
    ran = []
    assert host_drift.main(["--T", "256", "--d", "64", "--n", "3"], between=lambda T, out: ran.append(T)) == 0
    assert ran == [256]
    lines = capsys.readouterr().out.splitlines()
    for part in ("call", "fast route", "plan memo (the route's lookup)", "plan key lookup (full key)",
                 "key: tensor identities", "key: dict get", "pure python"):
        before, after, diff = (float(x) for x in next(ln for ln in lines if ln.startswith(part + " ")).split()[-3:])
        assert before > 0 and after > 0 and abs(after - before - diff) < 0.016  # (three figures rounded to 0.01)
    assert any(ln.startswith("state after:") and "hqmq plans kept" in ln for ln in lines)


def test_gpu_prebuild_builds_every_kernel_library_and_fails_by_name(tmp_path, monkeypatch, capsys):
    """suites/bench/gpu_prebuild.py builds every KernelLibrary of kernels/cuda (a new source's
    library would otherwise meet nvcc on the GPU, in device time), into --out as
    compile_library names them, and exits 1 naming a library whose build failed."""
    import importlib
    import os
    import pkgutil

    from kvqbench.kernels import cuda as cuda_pkg
    from kvqbench.kernels.cuda import library
    from kvqbench.suites.bench import gpu_prebuild

    found = set()
    for m in pkgutil.iter_modules(cuda_pkg.__path__):
        mod = importlib.import_module(f"{cuda_pkg.__name__}.{m.name}")
        found |= {id(x) for x in vars(mod).values() if isinstance(x, library.KernelLibrary)}
    assert found and {id(x) for x in gpu_prebuild.libraries()} == found

    def fake(source, stem, cap, extra, base):
        assert cap == (8, 6) and os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path.resolve())
        if stem == "kvq_hqmq_fused":
            raise RuntimeError("nvcc failed (1): boom")
        p = tmp_path / f"{stem}.so"
        p.write_bytes(b"x")
        return p

    monkeypatch.setattr(library, "compile_library", fake)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    assert gpu_prebuild.main(["--cap", "8.6", "--out", str(tmp_path), "--jobs", "2"]) == 1
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"  # (the caller's build root is kept)
    out, err = capsys.readouterr()
    assert "kvq_hqmq_fused: FAILED RuntimeError: nvcc failed (1): boom" in err
    assert "kvq_decode:" in out and "kvq_step_write:" in out


def test_audit_state_names_an_audit_hook_that_is_not_filelocks():
    """toolkit.audit_state reads whether a Python audit hook slows id() (every host figure of
    a process depends on it): a process given a hook of its own (not filelock's) is named so,
    and its id() reads dearer than the same process without it. (Whether the plain process
    is flagged is the machine's business: a filelock imported at startup, as the GPU image's
    3.32.5 is, brings its own.) Subprocesses: a hook cannot be removed once added."""
    import re
    import subprocess
    import sys

    code = ("import sys\n{}\nfrom kvqbench.suites.bench.toolkit import audit_state\nprint(audit_state()[1])")
    plain = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True, check=True)
    hooked = subprocess.run([sys.executable, "-c", code.format("sys.addaudithook(lambda e, a: None)")],
                            capture_output=True, text=True, check=True)
    assert "audit hook is in" in hooked.stdout, hooked.stdout  # (filelock's, where it is imported, or another)
    id_ns = [float(re.search(r"id\(\) (\d+) ns", r.stdout).group(1)) for r in (plain, hooked)]
    assert id_ns[0] < id_ns[1], (plain.stdout, hooked.stdout)


def test_audit_state_finds_filelocks_hook_in_either_module(monkeypatch):
    """filelock's fork-safety hook lives in filelock._core._fork (4.3) or filelock._api (the
    GPU image's 3.32.5, which the flag missed on 2026-12-07): either module, once loaded on
    Python >= 3.12, sets the flag; a filelock without the hook's function does not."""
    import types

    from kvqbench.suites.bench.toolkit import audit_state

    monkeypatch.setattr(sys, "version_info", (3, 12, 3, "final", 0))
    for name in [m for m in sys.modules if m.startswith("filelock")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "filelock", types.ModuleType("filelock"))
    assert audit_state()[0] is False
    for name in ("filelock._api", "filelock._core._fork"):
        mod = types.ModuleType(name)
        mod._audit_fork_safety = lambda event, args: None
        monkeypatch.setitem(sys.modules, name, mod)
        assert audit_state()[0] is True, name
        monkeypatch.delitem(sys.modules, name)
