"""kernels/precompile.py (Triton specialisations compiled ahead from a manifest) and the
compare's use of it. What needs a GPU (the compile itself, whether a launch then loads from
disk, bit-identical outputs) is `python -m kvqbench.suites.bench.precompile_check` on one
(H200, 2026-12-02: 6 specialisations 6.85 s one after another, 2.68 s in 8 threads, the
launches after it 0.02 s in Triton's compile path, outputs bit-identical); here the plumbing:
the manifest file, the hook, stale entries, and that a CPU run does none of it."""
from __future__ import annotations

import json
import types

import pytest
import torch

from kvqbench.kernels import precompile as P
from kvqbench.suites.compare import ahead as compare_ahead

pytestmark = pytest.mark.usefixtures("private_cache")

SHAPE = {"name": "tiny", "head_dim": 64}


def data(name="kvqbench.kernels.triton.naive_int._int_split_kernel", n=0):
    return json.dumps({"name": name, "n": n})


def test_manifest_round_trip_merge_and_what_reads_as_empty(tmp_path):
    path = tmp_path / "m.json"
    m = P.Manifest(path, SHAPE)
    assert m.entries == {}  # no file
    a, b, c = data(n=1), data(n=2), data(n=3)
    m.merge({"int4": [a, b], "hqmq": [c]})
    m.merge({"int4": [b]})  # seen again: kept once
    path.write_bytes(m.dumps())
    again = P.Manifest(path, SHAPE)
    assert again.entries == {"int4": [a, b], "hqmq": [c]}
    again.merge({}, failed={a, c})  # entries that failed to preload are dropped everywhere
    assert again.entries == {"int4": [b], "hqmq": []}
    assert P.Manifest(path, {"name": "other"}).entries == {}  # another run shape
    path.write_text("{not json")
    assert P.Manifest(path, SHAPE).entries == {}
    path.write_text(json.dumps({"format": P.FORMAT + 1, "shape": SHAPE, "entries": {"x": [a]}}))
    assert P.Manifest(path, SHAPE).entries == {}
    m = P.Manifest(tmp_path / "cap.json", SHAPE)
    m.merge({"s": [data(n=i) for i in range(P.MAX_PER_LABEL + 5)]})
    assert len(m.entries["s"]) == P.MAX_PER_LABEL and m.entries["s"][-1] == data(n=P.MAX_PER_LABEL + 4)


def test_recorder_chains_the_previous_hook_and_records_launch_compiles_only():
    pytest.importorskip("triton")
    from triton import knobs

    calls = []

    def previous(**kw):
        calls.append(kw["key"])
        return False

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = previous
    try:
        rec = P.Recorder()
        with rec.installed():
            hook = knobs.runtime.jit_cache_hook
            assert hook(key=1, compile={"specialization_data": data(n=1)}) is False  # no label yet
            rec.label = "int4"
            hook(key=2, compile={"specialization_data": data(n=2)})
            hook(key=3, compile={"specialization_data": data(n=2)})  # the same one again
            hook(key=4, compile={"specialization_data": data(n=4)}, is_manual_warmup=True)
            hook(key=5, compile={})  # a Triton without the data
        assert knobs.runtime.jit_cache_hook is previous  # restored
    finally:
        knobs.runtime.jit_cache_hook = old
    assert calls == [1, 2, 3, 4, 5]  # every call reached the hook installed before
    assert dict(rec.seen) == {"int4": [data(n=2)]}


def test_preload_counts_what_cannot_compile_and_never_raises(tmp_path):
    m = P.Manifest(tmp_path / "m.json", SHAPE)
    gone, foreign = data("kvqbench.kernels.no_such_module._k"), data("kvqbench.kernels.precompile.no_such_kernel")
    real = data()  # a real kernel: without a GPU its compile fails too, and is counted
    m.merge({"a": [gone, foreign], "b": [real, gone]})
    pool = P.preload(m, ["a", "b", "not-in-the-manifest"], threads=2)
    pool.wait(timeout=60)
    pool.close()
    s = pool.summary()
    assert s["submitted"] == 3 and s["failed"] + s["preloaded"] == 3  # `gone` once
    if not torch.cuda.is_available():
        assert s["failed"] == 3 and s["seconds"] is not None
        assert any("no_such_module" in e for e in s["first_errors"])


def test_a_cpu_compare_neither_preloads_nor_records(tmp_path):
    args = types.SimpleNamespace(windows=2, batch_size=1, context=8, decode_tokens=4)
    with compare_ahead.triton_ahead(args, "cpu", {"name": "tiny"}, {"lengths": {}}, ["int4"]) as ahead:
        ahead.row("int4")
        assert ahead.pool is None
    from kvqbench.suites.harness.fetch import cache_dir

    assert not (cache_dir() / "triton_ahead").exists()


def test_a_cuda_compare_records_per_spec_and_drops_stale_entries(monkeypatch, capsys):
    """The enabled path with the device faked: what the rows' compiles report is saved per
    spec; the next run of the same shape preloads it (here it cannot compile: no GPU, or a
    fake entry) and saves the manifest without what failed."""
    pytest.importorskip("triton")
    from triton import knobs

    from kvqbench.suites.harness.fetch import cache_dir

    monkeypatch.setattr(P, "supported", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("KVQBENCH_PRECOMPILE_THREADS", "2")
    args = types.SimpleNamespace(windows=2, batch_size=1, context=8, decode_tokens=4)
    shape = ({"name": "tiny", "dtype": "float32"}, {"lengths": {"prefill-then-decode": 12}})
    cuda = torch.device("cuda")  # named only: nothing here touches a GPU
    entry = data("kvqbench.kernels.no_such_module._k")
    with compare_ahead.triton_ahead(args, cuda, *shape, ["int4", "hqmq:S=96,r=4"]) as ahead:
        ahead.row("int4")
        knobs.runtime.jit_cache_hook(key=1, compile={"specialization_data": entry})
    files = list((cache_dir() / "triton_ahead").glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["entries"] == {"int4": [entry]}
    with compare_ahead.triton_ahead(args, cuda, *shape, ["int4"]) as ahead:
        ahead.pool.wait(timeout=60)  # a run's rows give the pool time; this one has none
    assert json.loads(files[0].read_text())["entries"] == {"int4": []}  # stale: dropped
    err = capsys.readouterr().err
    assert "0 of 1 specialisations compiled by the pool" in err and "1 stale" in err


def test_a_machine_without_its_own_manifest_uses_the_shipped_one(monkeypatch, tmp_path, capsys):
    """No manifest in the user's cache (a fresh machine): the package's copy of the same name
    is preloaded, and what survives is saved to the user's cache."""
    from kvqbench.suites.harness.fetch import cache_dir

    monkeypatch.setattr(P, "supported", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("KVQBENCH_PRECOMPILE_THREADS", "1")
    args = types.SimpleNamespace(windows=2, batch_size=1, context=8, decode_tokens=4)
    shape = ({"name": "tiny", "dtype": "float32"}, {"lengths": {"prefill-then-decode": 12}})
    with compare_ahead.triton_ahead(args, torch.device("cuda"), *shape, ["int4"]):
        pass  # records nothing: learns the file name
    (mine,) = (cache_dir() / "triton_ahead").glob("*.json")
    package = tmp_path / "pkg"
    (package / "triton_ahead").mkdir(parents=True)
    shipped = P.Manifest(package / "triton_ahead" / mine.name, json.loads(mine.read_text())["shape"])
    shipped.merge({"int4": [data("kvqbench.kernels.no_such_module._k")], "kivi": [data(n=9)]})
    shipped.path.write_bytes(shipped.dumps())
    mine.unlink()
    monkeypatch.setattr(P, "SHIPPED", package / "triton_ahead")
    capsys.readouterr()
    with compare_ahead.triton_ahead(args, torch.device("cuda"), *shape, ["int4"]) as ahead:
        ahead.pool.wait(timeout=60)
    assert "0 of 1 specialisations" in capsys.readouterr().err  # int4's entry only: the run's spec
    assert json.loads(mine.read_text())["entries"] == {"int4": [], "kivi": [data(n=9)]}


def test_the_shipped_manifests_are_found_by_their_shape_and_name_existing_kernels():
    # A shipped file is only used if its name is the hash the compare computes from its shape,
    # and each entry names a kernel by module path: a renamed or moved kernel leaves the entry
    # stale (it then costs a failed compile on every fresh machine), so re-record it then.
    pytest.importorskip("triton")
    files = sorted(P.SHIPPED.glob("*.json"))
    assert files, P.SHIPPED
    for f in files:
        d = json.loads(f.read_text())
        assert d["format"] == P.FORMAT
        assert f.name == P.manifest_name(d["shape"])
        assert P.Manifest(f, d["shape"]).entries == d["entries"]
        names = {json.loads(x)["name"] for datas in d["entries"].values() for x in datas}
        for name in names:  # a Triton kernel of that name (under the interpreter an InterpretedFunction)
            k = P._kernel(name)
            assert getattr(getattr(k, "fn", None), "__name__", None) == name.rpartition(".")[2], name
        # ... with the parameters recorded: a parameter added since leaves the entry stale (a
        # failed compile on every fresh machine; 29 of 33 in one shipped file went so unseen)
        stale = [why for datas in d["entries"].values() for x in datas if (why := P.stale(x))]
        assert not stale, f"{f.name}: re-record it (the compare on a GPU) or drop these: {stale[:3]}"
