"""results.json and report.md of `kvqbench compare`: one writer at a time, never half
a file, resumed only under the same identity (dtype, device, ...), a clear message
for a corrupt file; seeds of stochastic quantizers with their spread; claim
verdicts: test_claims.py)."""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import sys

import pytest
from filelock import FileLock

from kvqbench.quantizers import registry
from kvqbench.suites.compare import cli, report, results
from kvqbench.suites.compare import provenance
from kvqbench.suites.compare import run as compare_run
from kvqbench.suites.harness import fetch, perplexity
from kvqbench.suites.harness.tiny_model import tiny_compare_args

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


compare_args = tiny_compare_args


def test_a_second_writer_waits_then_refuses(tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "r").mkdir()
    monkeypatch.setattr(results, "LOCK_WAIT_S", 0.3)
    with FileLock(str(tmp_path / "r" / "results.json.lock")):  # another run holds the folder
        assert cli.main(compare_args(tiny, tmp_path)) == 1
    err = capsys.readouterr().err
    assert "another kvqbench compare is writing" in err and "--run NAME" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "results.json").exists()
    assert cli.main(compare_args(tiny, tmp_path)) == 0  # once it is free


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path, monkeypatch):
    meta = {"model": {"name": "m"}, "corpus": {"name": "c"}, "windows": {"n": 1}, "protocols": ["p"]}
    folder = tmp_path / "run"
    with results.Run(folder, meta, fresh=False) as run:
        run.add({"protocol": "p", "spec": "fp16", "seed": 0, "ppl": 1.0})
        before = (folder / "results.json").read_bytes()

        def disk_full(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError):
            run.add({"protocol": "p", "spec": "int4", "seed": 0, "ppl": 2.0})
        assert (folder / "results.json").read_bytes() == before  # the old file, whole
        assert sorted(p.name for p in folder.iterdir()) == ["results.json", "results.json.lock"]
    with pytest.raises(RuntimeError, match="under its lock"):
        run.save()


def test_resume_with_another_dtype_is_refused(tiny, tmp_path, capsys):
    assert cli.main(compare_args(tiny, tmp_path, "--dtype", "float32")) == 0
    assert cli.main(compare_args(tiny, tmp_path, "--dtype", "bfloat16")) == 1
    err = capsys.readouterr().err
    assert "dtype" in err and "--fresh" in err and "Traceback" not in err
    assert cli.main(compare_args(tiny, tmp_path, "--dtype", "bfloat16", "--fresh")) == 0
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    assert data["meta"]["dtype"] == "bfloat16" and len(data["results"]) == 2


def test_identity_covers_what_changes_a_figure():
    base = {"model": {"name": "m", "sha256": "a", "attn_implementation": "sdpa"}, "corpus": {"name": "c"},
            "windows": {"n": 2, "tokens": 32, "starts": [0, 9]}, "protocols": ["prefill-then-decode"],
            "prefill_then_decode": {"context": 8, "decode_tokens": 4}, "dtype": "float32", "batch_size": 8,
            "hardware": {"device": "cpu"}, "versions": {"torch": "2", "transformers": "5"}}
    ident = results.identity(base)
    for path, value in [(("dtype",), "float16"), (("hardware", "device"), "cuda"), (("batch_size",), 1),
                        (("prefill_then_decode", "decode_tokens"), 64), (("model", "sha256"), "b"),
                        (("versions", "torch"), "3"), (("windows", "starts"), [0, 10])]:
        changed = json.loads(json.dumps(base))
        node = changed
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert results.identity(changed) != ident, path
    later = json.loads(json.dumps(base))
    later["model"]["load_seconds"] = 99.0  # not a figure
    assert results.identity(later) == ident


@pytest.mark.parametrize("content", ["{not json", '{"meta": {}}', '{"meta": 1, "results": []}', "[]"])
def test_corrupt_results_file_names_fresh(tiny, tmp_path, capsys, content):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.json").write_text(content)
    assert cli.main(compare_args(tiny, tmp_path)) == 1
    err = capsys.readouterr().err
    assert "not a readable results file" in err and "--fresh" in err and "Traceback" not in err
    assert cli.main(compare_args(tiny, tmp_path, "--fresh")) == 0


# --- resume: only well-formed records, made by the code that would measure them now ------------

PLUGIN = """
import dataclasses
from kvqbench.quantizers.naive_int import NaiveInt


class MyQ(NaiveInt):
    name = "myq"
    aliases = {{}}

    @dataclasses.dataclass
    class Config(NaiveInt.Config):
        bits: int = {bits}
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """install(bits, version): (re)installs entry-point plugin `myq` (distribution myq-dist)
    with `bits` as its default."""
    root = tmp_path / "plugin"
    (root / "myq_dist-0.dist-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a rewrite within the same second must be seen

    def install(bits: int, version: str) -> None:
        (root / "myq_plugin.py").write_text(PLUGIN.format(bits=bits))
        dist = root / "myq_dist-0.dist-info"
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: myq-dist\nVersion: {version}\n")
        (dist / "entry_points.txt").write_text("[kvqbench.quantizers]\nmyq = myq_plugin:MyQ\n")
        sys.modules.pop("myq_plugin", None)
        registry(refresh=True)

    yield install
    monkeypatch.undo()
    sys.modules.pop("myq_plugin", None)
    registry(refresh=True)


def test_resume_measures_again_what_other_code_measured(tiny, tmp_path, plugin, monkeypatch, capsys):
    """A record carries its quantizer's resolved config and the versions of the code that
    measured it; one another config or version measured is not "already measured" (it
    was: a plugin whose default went from 4 to 2 bits reran with its 4-bit row kept)."""
    def run():
        assert cli.main(compare_args(tiny, tmp_path, specs="fp16;myq")) == 0
        data = json.loads((tmp_path / "r" / "results.json").read_text())
        assert sorted(r["spec"] for r in data["results"]) == ["fp16", "myq"]  # replaced, not added
        return {r["spec"]: r for r in data["results"]}, capsys.readouterr().err

    plugin(bits=4, version="0.1")
    by, _ = run()
    q, own = by["myq"], importlib.metadata.version("kvqbench")
    assert q["quantizer"]["class"] == "myq_plugin.MyQ" and q["quantizer"]["config"]["bits"] == 4
    assert q["versions"]["plugin"] == {"distribution": "myq-dist", "version": "0.1"}
    assert by["fp16"]["versions"]["plugin"] == {"distribution": "kvqbench", "version": own}
    assert q["versions"]["kvqbench"] == own and q["versions"]["commit"] == provenance.kvqbench_version()["commit"]
    bits4 = q["bits_per_element"]

    plugin(bits=2, version="0.1")  # the default changed, the version did not
    by, err = run()
    assert "2 configurations, 1 already measured" in err and "1 of them were measured by other code" in err
    assert by["myq"]["quantizer"]["config"]["bits"] == 2 and by["myq"]["bits_per_element"] < bits4

    plugin(bits=2, version="0.2")  # a new release of the plugin
    by, err = run()
    assert "2 configurations, 1 already measured" in err and by["myq"]["versions"]["plugin"]["version"] == "0.2"

    code = {"version": "9.9", "commit": "f" * 40, "dirty": False}  # another kvqbench
    monkeypatch.setattr(provenance, "kvqbench_version", lambda: code)
    by, err = run()
    assert "2 configurations, 0 already measured" in err and by["fp16"]["versions"]["kvqbench"] == "9.9"
    assert "2 of them were measured by other code" in err and "now fffffff" in err and "kvqbench report" in err
    code = dict(code, dirty=True)  # an edited checkout still resumes (after Ctrl-C, say)
    by, err = run()
    assert "2 configurations, 2 already measured" in err


def test_report_re_renders_without_measuring(tiny, tmp_path, monkeypatch, capsys):
    """`kvqbench report DIR` writes report.md from results.json as it is (a rerun of
    compare after a commit measures again), never touches the records, waits for a
    running compare's lock, and names a folder that is not a run."""
    assert cli.main(compare_args(tiny, tmp_path, specs="fp16;int4")) == 0
    folder = tmp_path / "r"
    records = (folder / "results.json").read_bytes()
    (folder / "report.md").unlink()
    monkeypatch.setattr(provenance, "kvqbench_version", lambda: {"version": "9.9", "commit": "e" * 40, "dirty": False})
    monkeypatch.setattr(compare_run, "run_compare", lambda args: pytest.fail("report measured"))
    assert cli.main(["report", str(folder)]) == 0
    md = (folder / "report.md").read_text()
    assert "int4" in md and (folder / "results.json").read_bytes() == records
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no results.json" in capsys.readouterr().err
    monkeypatch.setattr(results, "LOCK_WAIT_S", 0.2)
    with FileLock(str(folder / "results.json.lock")):
        assert cli.main(["report", str(folder)]) == 1
    assert "being written" in capsys.readouterr().err


def test_malformed_records_are_measured_again_and_newer_fields_kept(tiny, tmp_path, capsys):
    args = compare_args(tiny, tmp_path, specs="fp16;int4;int8")
    assert cli.main(args) == 0
    path = tmp_path / "r" / "results.json"
    data = json.loads(path.read_text())
    by = {r["spec"]: r for r in data["results"]}
    by["fp16"]["ppl"] = float("nan")  # counted as measured, reported as +nan%
    by["int4"]["ppl"] = "12.5"  # a TypeError in the report
    by["int8"]["from_a_newer_version"] = {"x": 1}
    data["results"] += [{k: v for k, v in by["int8"].items() if k != "protocol"}, "not a record"]  # a KeyError
    data["written_by_a_newer_version"] = [1, 2]
    data["meta"]["newer_meta"] = "kept"
    path.write_text(json.dumps(data))
    md = report.write_report(tmp_path / "r").read_text()  # the report alone never crashes on them
    assert "+nan%" not in md and "| `int8` |" in md

    capsys.readouterr()
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "3 configurations, 1 already measured" in err
    assert "(quantize-on-write fp16 seed 0) has ppl = NaN, not a finite number > 0" in err
    assert "(quantize-on-write int4 seed 0) has ppl = \"12.5\"" in err
    assert "(None int8 seed 0) has no 'protocol'" in err and "is a str, not an object" in err
    data = json.loads(path.read_text())
    assert sorted(r["spec"] for r in data["results"]) == ["fp16", "int4", "int8"]
    assert all(isinstance(r["ppl"], float) and math.isfinite(r["ppl"]) for r in data["results"])
    assert next(r for r in data["results"] if r["spec"] == "int8")["from_a_newer_version"] == {"x": 1}
    assert data["written_by_a_newer_version"] == [1, 2] and data["meta"]["newer_meta"] == "kept"
    assert "+nan%" not in (tmp_path / "r" / "report.md").read_text()


def test_a_non_finite_perplexity_is_a_failure_not_a_figure(tiny, tmp_path, monkeypatch):
    real = perplexity.ppl_quantize_on_write

    def nan_int4(model, windows, spec, seed=0, **kw):
        r = real(model, windows, spec, seed, **kw)
        return dict(r, nll_sum=float("nan"), ppl=float("nan")) if spec == "int4" else r

    monkeypatch.setattr(perplexity, "ppl_quantize_on_write", nan_int4)
    assert cli.main(compare_args(tiny, tmp_path)) == compare_run.EXIT_PARTIAL
    md = (tmp_path / "r" / "report.md").read_text()
    assert "FAILED `int4` seed 0: non-finite perplexity nan" in md and "+nan%" not in md


def test_write_atomic_gives_the_umask_mode(tmp_path):
    fetch.write_atomic(tmp_path / "f", b"x")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~mask


# --- seeds --------------------------------------------------------------------------------

def test_stochastic_quantizers_run_over_seeds_by_default(monkeypatch):
    from kvqbench.quantizers import parse_spec

    assert compare_run.is_stochastic("hqmq:S=24,r=3") and compare_run.is_stochastic("spherical3")
    assert not compare_run.is_stochastic("int4") and not compare_run.is_stochastic("fp16")
    cls = parse_spec("int4")[0]
    monkeypatch.setattr(cls, "stochastic", True, raising=False)  # a plugin that says so
    assert compare_run.is_stochastic("int4")
    jobs = compare_run.jobs_for(["fp16", "int4", "hqmq:S=24,r=3"], ["quantize-on-write"], 3)
    assert [j for j in jobs if j[1] == "fp16"] == [("quantize-on-write", "fp16", 0)]
    assert sorted(s for _, spec, s in jobs if spec == "hqmq:S=24,r=3") == [0, 1, 2]
    assert jobs[:3] == [("quantize-on-write", s, 0) for s in ("fp16", "int4", "hqmq:S=24,r=3")]
    default = [a for a in cli.build_parser()._subparsers._group_actions[0].choices["compare"]._actions
               if a.dest == "seeds"][0].default
    assert default >= 3


def test_compare_runs_seeds_and_reports_their_spread(tiny, tmp_path):
    args = compare_args(tiny, tmp_path, specs="fp16;int4;hqmq:S=24,r=3")
    args[args.index("--seeds") + 1] = "3"
    assert cli.main(args) == 0
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    seeds = {(r["spec"], r["seed"]) for r in data["results"]}
    assert seeds == {("fp16", 0), ("int4", 0), ("hqmq:S=24,r=3", 0), ("hqmq:S=24,r=3", 1), ("hqmq:S=24,r=3", 2)}
    rows = {r["spec"]: r for r in report.summarize(data["results"], "quantize-on-write")}
    h = rows["hqmq:S=24,r=3"]
    ppl = [r["ppl"] for r in data["results"] if r["spec"] == "hqmq:S=24,r=3"]
    assert h["n"] == 3 and h["ppl_min"] == min(ppl) and h["ppl_max"] == max(ppl)
    assert h["ppl"] == pytest.approx(sum(ppl) / 3) and rows["int4"]["ppl_sd"] is None
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"| `hqmq:S=24,r=3` | 3 |" in md and f"{min(ppl):.4f}-{max(ppl):.4f}" in md


def test_report_has_no_fixed_sentences(tiny, tmp_path):
    assert cli.main(compare_args(tiny, tmp_path, specs="fp16;kivi:bits=2;kivi:bits=4,residual=16")) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "128 tokens" not in md.replace("up to 128 recent tokens", "")
    assert "up to 16 recent tokens" in md and "hub datasets unreachable" not in md
    assert "not measured in this run: no latency report" in md


def test_hardware_names_the_cpu_and_its_vector_isa(tmp_path, monkeypatch):
    """A run names the arithmetic it came from: the CPU's model name (quantized PPLs move by a
    few percent between CPUs) and the ISA torch's kernels use; without /proc/cpuinfo, what
    `platform` knows."""
    hw = provenance.hardware("cpu")
    assert hw["cpu"] and hw["cpu_capability"] and hw["torch_threads"] >= 1 and hw["device"] == "cpu"
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Example CPU @ 2.0GHz\nflags\t\t: fpu\n")
    real = provenance.Path
    monkeypatch.setattr(provenance, "Path", lambda p: real(fake) if p == "/proc/cpuinfo" else real(p))
    assert provenance.cpu_model() == "Example CPU @ 2.0GHz"
    monkeypatch.setattr(provenance, "Path", lambda p: real(tmp_path / "absent"))
    assert provenance.cpu_model()  # platform's answer
