"""Every edge a user meets in the bench (issues 32 and 33): a bad setting is one line before anything is measured;
a method that fails is a FAILED row and the others still run, `ar` failing included, and the report is always
written; Ctrl-C writes what finished, marked partial; a closed pipe loses nothing. The run folder is a toy trained
in seconds (toys.train_toy)."""
import json
import os
import signal
import subprocess
import sys

import pytest

from nanospec.bench import compare as bench
from nanospec.bench import batch as bench_batch
from nanospec.device import MAX_SEED

from toys import PROMPTS, ROOT


def small(ckpt, out, *flags):
    """A small bench: one prompt per category, a few tokens, greedy and t=1 unless the flags say otherwise."""
    return bench.main(["--quick", "--ckpt", str(ckpt), "--prompts", PROMPTS, "--device", "cpu",
                       "--prompts-per-category", "1", "--max-new-tokens", "6", "--out", str(out), *flags])


# ----------------------------------------------------------------------------- refused before anything is measured

def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


BAD = [  # (flags, files to make {name: content}, the start of the one line expected after "error: ")
    (["--out", ""], {}, "--out is empty"),
    (["--out", "{tmp}"], {}, "--out {tmp} is a folder"),
    (["--out", "/dev/full"], {}, "--out /dev/full is not a regular file"),
    (["--json", "{tmp}"], {}, "--json {tmp} is a folder"),
    # issue 40: a file that is not the bench's JSON was replaced, though the help says the figures are merged in
    (["--json", "{tmp}/notes.txt"], {"notes.txt": "my notes"}, "--json {tmp}/notes.txt is not the bench's JSON"),
    (["--json", "{tmp}/r.json"], {"r.json": '{"mine": 1}'}, "--json {tmp}/r.json is not the bench's JSON"),
    # a user's own file was replaced by the report
    (["--out", "{tmp}/notes.txt"], {"notes.txt": "my notes"}, "--out {tmp}/notes.txt is not a bench report"),
    (["--seed", "-1"], {}, "--seed must be in 0..2**63-1"),
    (["--seed", str(2**64 - 1)], {}, "--seed must be in 0..2**63-1"),
    (["--seed", str(MAX_SEED)], {}, f"--seed {MAX_SEED}: prompt i runs with seed + i"),
    (["--threads", "100000000"], {}, "--threads must be in 0.."),
    (["--threads", str((os.cpu_count() or 1) + 1)], {}, "--threads must be in 0.."),
    (["--prompts", "{tmp}"], {}, "--prompts {tmp} is a folder"),
    (["--prompts", "{tmp}/p.json"], {"p.json": "[]"}, "--prompts {tmp}/p.json holds no list of prompts"),
    (["--prompts", "{tmp}/p.json"], {"p.json": "{}"}, "--prompts {tmp}/p.json holds no list of prompts"),
    (["--prompts", "{tmp}/p.json"], {"p.json": '{"prompts": []}'}, "--prompts {tmp}/p.json holds no list"),
    (["--prompts", "{tmp}/p.json"], {"p.json": '{"prompts": [1]}'}, "--prompts {tmp}/p.json: prompt 1 is not"),
    (["--prompts", "{tmp}/p.json"], {"p.json": '{"prompts": [{"id": "a", "category": "c"}]}'},
     "--prompts {tmp}/p.json: prompt 1 is not"),
    (["--prompts", "{tmp}/p.json"], {"p.json": '{"prompts": [{"id": "a", "category": "c", "lines": [1, 2]}]}'},
     "--prompts {tmp}/p.json: prompt 1 is not"),
    (["--prompts", "{tmp}/p.json"], {"p.json": '{"prompts": [{"id": "a", "category": "c", "lines": "abc"}]}'},
     "--prompts {tmp}/p.json: prompt 1 is not"),
    (["--prompts", "{tmp}/p.json"], {"p.json": '{"prompts": [\n'}, "--prompts {tmp}/p.json is not valid JSON"),
]


def test_an_earlier_report_may_be_replaced(tmp_path):
    """--out refuses a user's own file, never the bench's own earlier report (of one prompt or of a batch)."""
    for title in ("# nanospec bench, 2026-11-27 00:37", "# nanospec bench: batched decoding"):
        bench.check_writable("--out", write(tmp_path / "r.md", title + "\n\nold figures\n"))
    with pytest.raises(ValueError, match="is not a bench report"):
        bench.check_writable("--out", write(tmp_path / "r.md", "my notes about the bench\n"))


@pytest.mark.parametrize("flags, files, message", BAD, ids=[" ".join(b[0]) + "".join(b[1].values()) for b in BAD])
def test_bad_settings_are_refused_before_anything_is_measured(tmp_path, monkeypatch, flags, files, message):
    """Before: tracebacks after all the measuring (--out), tracebacks (--prompts), a KeyError (--seed), a
    segmentation fault (--threads 100000000), a string cut into characters ("lines": "abc")."""
    for name, content in files.items():
        write(tmp_path / name, content)
    monkeypatch.setattr(bench, "load_parts", lambda *a: pytest.fail("the models were loaded"))
    flags = [f.format(tmp=tmp_path) for f in flags]
    out = [] if "--out" in flags else ["--out", str(tmp_path / "r.md")]
    with pytest.raises(SystemExit) as e:
        bench.main(["--ckpt", "no-such-folder", "--prompts", PROMPTS, "--device", "cpu", *out, *flags])
    line = str(e.value.code)
    assert line.startswith("error: " + message.format(tmp=tmp_path)) and "\n" not in line, line


# ----------------------------------------------------------------------------- a failure never takes the run down

def failing_after(real, calls):
    """`real`, until it has been called `calls` times; then a RuntimeError, as a poisoned CUDA context gives. The
    calibration's sweeps (--adaptive sweep, before the warm-up) are not counted."""
    count = [0]

    def method(*args, **kwargs):
        count[0] += kwargs.get("adaptive") != "sweep"
        if count[0] > calls:
            raise RuntimeError("CUDA error: device-side assert triggered\nmore lines")
        return real(*args, **kwargs)
    return method


def test_a_method_that_fails_is_a_failed_row_and_the_rest_still_run(toy_out, tmp_path, monkeypatch):
    """jacobi passes its warm-up (2 temperatures) and its read count, then fails: its row says FAILED and why."""
    monkeypatch.setitem(bench.METHODS, "jacobi", failing_after(bench.METHODS["jacobi"], 3))
    got = small(toy_out, tmp_path / "r.md", "--methods", "jacobi,prompt-lookup")
    report = (tmp_path / "r.md").read_text()
    assert "jacobi" in got["failed"] and "RuntimeError: CUDA error: device-side assert triggered" in got["failed"]["jacobi"]
    rows = [line for line in report.splitlines() if line.startswith("| jacobi ")]
    assert len(rows) == 2 and all("| FAILED: RuntimeError: CUDA error" in row for row in rows), rows  # both tables
    assert {"ar", "prompt-lookup"} <= set(got["summaries"][0.0]) and {"ar", "prompt-lookup"} <= set(got["summaries"][1.0])


def test_ar_failing_still_gives_a_report_with_speedups_n_a(toy_out, tmp_path, monkeypatch):
    """Before: ZeroDivisionError in report.py, and no report. ar passes its warm-up, then fails."""
    monkeypatch.setitem(bench.METHODS, "ar", failing_after(bench.METHODS["ar"], 4))
    got = small(toy_out, tmp_path / "r.md", "--methods", "prompt-lookup", "--temperatures", "0")
    report = (tmp_path / "r.md").read_text()
    assert report == got["report"] and "- FAILED ar: RuntimeError" in report
    assert got["summaries"][0.0]["prompt-lookup"]["all"]["speedup"] is None
    row = next(line for line in report.splitlines() if line.startswith("| prompt-lookup"))
    assert "n/a" in row and "ar did not finish" in report


def test_forward_costs_that_fail_leave_the_table_standing(toy_out, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(bench, "forward_costs", broken)
    got = small(toy_out, tmp_path / "r.md", "--methods", "speculative", "--temperatures", "0")
    assert "- forward costs not measured: RuntimeError: out of memory" in got["report"]
    assert "Not measured" in got["report"] and "speculative" in got["summaries"][0.0]


def test_ctrl_c_writes_what_finished_marked_partial(toy_out, tmp_path, monkeypatch):
    """A KeyboardInterrupt in the middle of temperature 1: the greedy table is written, marked PARTIAL."""
    real = bench.METHODS["prompt-lookup"]
    calls = [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if kwargs.get("temperature") == 1.0 and calls[0] > 6:  # past the warm-ups and read counts
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setitem(bench.METHODS, "prompt-lookup", interrupted)
    with pytest.raises(SystemExit) as e:
        small(toy_out, tmp_path / "r.md", "--methods", "prompt-lookup")
    assert e.value.code == 130
    report = (tmp_path / "r.md").read_text()
    assert report.startswith("# nanospec bench (partial)") and "- PARTIAL: interrupted (Ctrl-C)" in report
    assert "## greedy (temperature 0)" in report and "## temperature 1" not in report


def test_the_batch_table_reports_failed_cells(toy_out, tmp_path, monkeypatch):
    real = bench_batch.generate

    def generate(models, prompts, max_new_tokens, method="ar", **kwargs):
        if method == "speculative" or (method == "ar" and len(prompts) == 2):
            raise RuntimeError("no memory left")
        return real(models, prompts, max_new_tokens, method=method, **kwargs)
    monkeypatch.setattr(bench_batch, "generate", generate)
    got = small(toy_out, tmp_path / "b.md", "--batch-sizes", "1,2", "--temperatures", "0")
    table = (tmp_path / "b.md").read_text()
    assert table.count("FAILED: RuntimeError: no memory left") == 3  # speculative at 1 and 2, ar at 2
    assert "n/a" in table and got["batch"]["greedy"]["prompt-lookup"].keys() == {"1"}  # no speedup without ar


def test_ctrl_c_in_the_batch_table_keeps_the_batch_sizes_that_finished(toy_out, tmp_path, monkeypatch):
    real = bench_batch.generate

    def generate(models, prompts, *args, **kwargs):
        if len(prompts) == 2:
            raise KeyboardInterrupt
        return real(models, prompts, *args, **kwargs)
    monkeypatch.setattr(bench_batch, "generate", generate)
    with pytest.raises(SystemExit) as e:
        small(toy_out, tmp_path / "b.md", "--batch-sizes", "1,2", "--temperatures", "0")
    table = (tmp_path / "b.md").read_text()
    assert e.value.code == 130 and table.startswith("# nanospec bench: batched decoding (partial)")
    assert "the batch sizes that finished (1 of 2)" in table and "\n| 1 " in table and "\n| 2 " not in table


# ----------------------------------------------------------------------------- real processes: Ctrl-C, a closed pipe

def start_bench(toy_out, out, *flags):
    return subprocess.Popen([sys.executable, "-m", "nanospec.bench", "--ckpt", str(toy_out), "--prompts", PROMPTS,
                             "--device", "cpu", "--methods", "prompt-lookup", "--max-new-tokens", "6",
                             "--out", str(out), *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)


def test_sigint_mid_bench_writes_a_partial_report(toy_out, tmp_path):
    """Before: a KeyboardInterrupt traceback and nothing written."""
    proc = start_bench(toy_out, tmp_path / "r.md", "--prompts-per-category", "-1", "--repeats", "3")
    for line in proc.stderr:  # the first prompt done: something is measured
        if b"done (1/" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and b"Traceback" not in err, err
    assert err.decode().strip().splitlines()[-1].endswith("wrote the partial report (" + str(tmp_path / "r.md") + ")")
    assert "- PARTIAL: interrupted (Ctrl-C)" in (tmp_path / "r.md").read_text()


def test_a_closed_pipe_loses_no_report(toy_out, tmp_path):
    """`make bench | head`: before, the report was printed first and the BrokenPipeError lost the file."""
    proc = start_bench(toy_out, tmp_path / "r.md", "--quick", "--prompts-per-category", "1", "--temperatures", "0",
                       "--json", str(tmp_path / "r.json"))
    proc.stdout.close()  # the reader is gone before the report is printed
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and b"Traceback" not in err, err
    assert "## greedy (temperature 0)" in (tmp_path / "r.md").read_text()
    assert json.loads((tmp_path / "r.json").read_text())["methods"]["ar"]["greedy"] == [1.0, 1.0]
