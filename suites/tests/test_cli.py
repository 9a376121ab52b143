"""The `kvqbench` command line on a tiny random model (harness/tiny_model.py): exit
codes that tell success, bad usage, partial failure, errors and Ctrl-C apart; every
argument checked before any model work; one-line errors, tracebacks only with
--debug; `--decode-tokens` honoured."""
from __future__ import annotations

import errno
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from kvqbench.suites.compare import cli
from kvqbench.suites.compare import run as compare_run
from kvqbench.suites.harness import models, perplexity
from kvqbench.suites.harness.tiny_model import tiny_compare_args

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


compare_args = tiny_compare_args


def results(out):
    return json.loads((out / "r" / "results.json").read_text())


def test_success_exits_0_with_an_int(tiny, tmp_path):
    code = cli.main(compare_args(tiny, tmp_path))
    assert code == 0 and type(code) is int  # sys.exit(Path) would have exited 1
    assert (tmp_path / "r" / "report.md").is_file()
    assert {r["spec"] for r in results(tmp_path)["results"]} == {"fp16", "int4"}


def test_progress_bar_counts_every_window_once(tiny, tmp_path, capsys):
    # 3 windows scored 2 per batch: the bar ends at configurations x windows (it once moved
    # one step per batch and ended at 52% of a default run)
    assert cli.main(compare_args(tiny, tmp_path, "--windows", "3", "--batch-size", "2", "--protocol", "both")) == 0
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "12/12 [" in err and "13/12" not in err  # 2 specs x 2 protocols x 3 windows


BAD_USAGE = [
    (["--specs", ""], "names no quantizer spec"),
    (["--specs", " ; "], "names no quantizer spec"),
    (["--specs", "fp16;nosuch"], "unknown quantizer 'nosuch'"),
    (["--specs", "int4:bits=x"], "not a valid int"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--seeds", "-1"], "--seeds must be >= 1"),
    (["--windows", "0"], "--windows must be >= 1"),
    (["--window", "1"], "--window must be >= 2"),
    (["--context", "0"], "--context must be >= 1"),
    (["--decode-tokens", "-4"], "--decode-tokens must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--lm-eval-limit", "0"], "--lm-eval-limit must be >= 1"),
    (["--lm-eval-metadata", "notjson"], "--lm-eval-metadata is not JSON"),
    (["--lm-eval-metadata", "[1, 2]"], "must be a JSON object"),
    (["--lm-eval-specs", "fp16"], "--lm-eval-specs needs --lm-eval"),
    (["--lm-eval", "kvqbench_rolling", "--lm-eval-specs", "fp16;int3"], "int3 not among them"),
    (["--lm-eval", "kvqbench_rolling", "--lm-eval-specs", " ; "], "--lm-eval-specs must name specs of this run"),
    (["--model", "no-such-model"], "--model"),
    (["--corpus", "no-such-corpus"], "--corpus"),
    (["--out", __file__], "is not a folder"),
    (["--out", __file__ + "/sub"], "--out: cannot write in"),  # under a regular file
    (["--device", "meta"], "--device meta: kvqbench compare runs on cpu or cuda[:N], not meta"),
    (["--run", "../x"], "must be a plain name"),  # it wrote outside --out
    (["--run", "a/b"], "must be a plain name"),
    (["--run", ".."], "must be a plain name"),
    (["--window", "2048"], "windows of 2048 tokens exceed the 1024-token context"),  # read from config.json
]


@pytest.mark.parametrize("extra,message", BAD_USAGE, ids=[" ".join(a) for a, _ in BAD_USAGE])
def test_bad_usage_exits_2_before_any_model_work(tiny, tmp_path, monkeypatch, capsys, extra, message):
    def no_model_work(*a, **k):
        raise AssertionError("model work started before the arguments were checked")

    monkeypatch.setattr(models, "load_model", no_model_work)
    args = compare_args(tiny, tmp_path)
    for i in range(0, len(extra), 2):  # the later value of a repeated option wins in argparse
        args += extra[i:i + 2]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


def test_an_unwritable_out_exits_2_before_any_model_work(tiny, tmp_path, monkeypatch, capsys):
    """(The row just measured was lost at the first save.)"""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model work before the check"))
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: refuse as a read-only mount would
        real = tempfile.mkstemp

        def read_only(*a, dir=None, **k):
            if dir is not None and Path(dir).resolve() == out.resolve():
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert cli.main(compare_args(tiny, out)) == 2
    err = capsys.readouterr().err
    assert f"--out: cannot write in {out}" in err and "Traceback" not in err


def test_a_window_past_the_context_is_refused_after_the_load_where_no_config_was_at_hand(
        tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare_run, "model_context", lambda name: None)  # e.g. an embedded model not fetched yet
    assert cli.main(compare_args(tiny, tmp_path, "--window", "2048")) == 2
    assert "exceed the 1024-token context" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_bad_precompile_thread_count_exits_2_before_any_model_work(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model work before the check"))
    monkeypatch.setenv("KVQBENCH_PRECOMPILE_THREADS", "eight")
    assert cli.main(compare_args(tiny, tmp_path)) == 2
    assert "KVQBENCH_PRECOMPILE_THREADS must be a whole number" in capsys.readouterr().err


def test_non_utf8_corpus_is_a_usage_error_naming_the_file(tiny, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 ".encode("latin-1") * 500)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded before the corpus"))
    args = compare_args(tiny, tmp_path)
    args[args.index("--corpus") + 1] = str(bad)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not UTF-8" in err and "Traceback" not in err


def test_argparse_errors_and_help(capsys):
    assert cli.main(["compare", "--protocol", "sideways"]) == 2
    assert cli.main(["compare", "--windows", "four"]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["--help"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_list_names_unknown_quantizers(capsys):
    assert cli.main(["list", "nosuch"]) == 2
    assert "unknown quantizer(s) 'nosuch'" in capsys.readouterr().err
    assert cli.main(["list", "fp16", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "fp16:" in out and "16.000" in out
    assert cli.main(["list", "--tokens", "0"]) == 2


def test_some_configuration_failed_exits_3_with_the_report_written(tiny, tmp_path, monkeypatch):
    real = perplexity.ppl_quantize_on_write

    def flaky(model, windows, spec, seed=0, **kw):
        if spec == "int4":
            raise RuntimeError("planted failure")
        return real(model, windows, spec, seed, **kw)

    monkeypatch.setattr(perplexity, "ppl_quantize_on_write", flaky)
    assert cli.main(compare_args(tiny, tmp_path)) == compare_run.EXIT_PARTIAL == 3
    report = (tmp_path / "r" / "report.md").read_text()
    assert "FAILED `int4`" in report and "planted failure" in report
    monkeypatch.setattr(perplexity, "ppl_quantize_on_write", real)
    assert cli.main(compare_args(tiny, tmp_path)) == 0  # the rerun retries only the failure


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(tiny, tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(models, "load_model", broken)
    assert cli.main(compare_args(tiny, tmp_path)) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: disk on fire" in err and "--debug" in err and "Traceback" not in err
    assert cli.main(["--debug"] + compare_args(tiny, tmp_path)) == 1
    assert "Traceback" in capsys.readouterr().err
    assert cli.main(compare_args(tiny, tmp_path, "--debug")) == 1
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_exits_130_and_the_rerun_resumes(tiny, tmp_path, monkeypatch, capsys):
    real, calls = perplexity.ppl_quantize_on_write, []

    def interrupted(model, windows, spec, seed=0, **kw):
        calls.append(spec)
        if spec == "int4" and calls.count("int4") == 1:
            # A real Ctrl-C mid-configuration, raised in this (the main) thread.
            signal.raise_signal(signal.SIGINT)
            time.sleep(5)
        return real(model, windows, spec, seed, **kw)

    monkeypatch.setattr(perplexity, "ppl_quantize_on_write", interrupted)
    # Python's own handler, as a terminal's Ctrl-C meets it: a process started in the
    # background by a shell without job control inherits SIGINT ignored (a fresh-clone run
    # launched that way failed here); the test is of the command, not of its parent.
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(compare_args(tiny, tmp_path)) == 130
    finally:
        signal.signal(signal.SIGINT, saved)
    assert "interrupted" in capsys.readouterr().err
    assert [r["spec"] for r in results(tmp_path)["results"]] == ["fp16"]
    assert cli.main(compare_args(tiny, tmp_path)) == 0
    assert calls == ["fp16", "int4", "int4"]  # fp16 was not measured twice


def test_decode_tokens_are_honoured(tiny, tmp_path):
    """prefill-then-decode scores exactly --decode-tokens tokens after --context, in
    windows of context + decode tokens, whatever --window says (it was ignored: a
    context of 8 with 4 decode tokens in 64-token windows ran 55 steps)."""
    args = compare_args(tiny, tmp_path, "--protocol", "both", "--window", "40", "--context", "8",
                        "--decode-tokens", "4", specs="fp16")
    assert cli.main(args) == 0
    data = results(tmp_path)
    by = {r["protocol"]: r for r in data["results"]}
    ptd, qow = by["prefill-then-decode"], by["quantize-on-write"]
    assert (ptd["window"], ptd["context"], ptd["n_predicted"]) == (12, 8, 2 * 4)
    assert ptd["decode_steps"] == 3  # the last scored token is never written
    assert (qow["window"], qow["n_predicted"]) == (40, 2 * 39)
    assert data["meta"]["prefill_then_decode"] == {"context": 8, "decode_tokens": 4}
    assert data["meta"]["windows"]["per_protocol"] == {"quantize-on-write": 40, "prefill-then-decode": 12}
    assert "4 tokens scored after it" in (tmp_path / "r" / "report.md").read_text()


def test_default_windows_depend_on_the_device(tiny, monkeypatch):
    """The CPU default is sized to the 5-minute budget (run.CPU_WINDOWS); a GPU gets more."""
    import torch

    parser = cli.build_parser()
    for device, want in (("cpu", compare_run.CPU_WINDOWS), ("cuda", compare_run.GPU_WINDOWS)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        args = parser.parse_args(["compare", "--model", tiny["model"], "--corpus", tiny["corpus"], "--specs", "fp16"])
        compare_run.validate(args)
        assert args.windows == want
    args = parser.parse_args(["compare", "--model", tiny["model"], "--corpus", tiny["corpus"], "--windows", "5"])
    compare_run.validate(args)
    assert args.windows == 5
