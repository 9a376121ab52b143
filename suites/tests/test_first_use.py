"""The main-job benchmark's first-use diagnostics (suites/bench/first_use.py): compile events
summed per row and kernel, stack samples attributed to the row that was running."""
import time
import types

from kvqbench.suites.bench.first_use import FirstUseLog, StackSampler


def test_compile_events_are_summed_per_row_and_kernel():
    log = FirstUseLog()
    with log.installed():
        if not log.available:  # a Triton without the hooks: nothing to record, nothing to break
            return
        from triton import knobs

        before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        for row, name, key in (("a", "k1", 1), ("a", "k2", 2), ("b", "k1", 3)):
            log.row = row
            assert before(key=key, fn=types.SimpleNamespace(name=name), repr=name) is False  # never skip a compile
            time.sleep(0.01)
            after(key=key, fn=types.SimpleNamespace(name=name), repr=name)
    assert knobs.runtime.jit_cache_hook is not before  # uninstalled on leaving
    f = log.since(0)
    assert f["compiles"] == 3 and f["compile_s"] >= 0.03
    assert f["rows"]["a"]["compiles"] == 2 and f["rows"]["b"]["compiles"] == 1
    assert f["kernels"]["k1"]["compiles"] == 2
    assert log.since(3)["compiles"] == 0  # a later round starts at the events' end


def _spin_for(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_stack_samples_go_to_the_matching_row():
    log = FirstUseLog()
    with StackSampler(log, r"^row two$", interval=0.002) as s:
        log.row = "row one"
        _spin_for(0.15)
        log.row = "row two"
        _spin_for(0.3)
        log.row = "done"
    # every frame below the row's is on the stack in every sample (ties at 1.0): the default top 25
    # can leave the busy loop out under a deep runner's stack (pytest-xdist's), so ask for them all
    r = s.report(top=10_000)
    assert set(r) == {"row two"}, r.keys()
    assert r["row two"]["samples"] >= 10
    top = r["row two"]["on_stack"]
    assert any(k.endswith(" _spin_for") and v > 0.8 for k, v in top.items()), top
    assert max(r["row two"]["leaf"].values()) > 0.8  # the busy loop is where the samples land


def test_stack_samples_stop_at_the_boundary():
    log = FirstUseLog()
    log.row = "r"

    def boundary():
        _spin_for(0.2)

    with StackSampler(log, "r", interval=0.002, below="boundary") as s:
        boundary()
    names = s.report()["r"]["on_stack"]
    assert names and all(k.endswith(" _spin_for") for k in names), names  # nothing at or above it
