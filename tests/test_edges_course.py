"""Every edge a user meets in the course kit, the Makefile and the figures (issue 33): `make grade` says what it
runs, takes TIMEOUT= and reruns at most once after a hang, naming the exercise that hung; it refuses an exercise
the handout does not blank; the Makefile passes every value as one word (no injection) and lists its targets;
`make figures` writes to a folder git ignores unless asked; the step figure's title is not cut mid-word."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanospec.bench import figures
from nanospec.course import grade, handout as handout_kit
from nanospec.course.handout import make_handout
from nanospec.course.registry import BY_ID, parse_selection

ROOT = Path(__file__).resolve().parent.parent
ARGV = "python3 -c 'import sys; print(sys.argv[1:])'"  # a PYTHON for make that prints the arguments it gets


# ----------------------------------------------------------------------------- make grade: what it runs, hangs

def test_the_running_test_is_read_from_a_killed_verbose_run(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("tests/test_ex01_prompt_lookup.py::test_a PASSED      [ 10%]\n"
                   "tests/test_ex03_accept_residual.py::test_b ")
    assert grade.running_file(str(log)) == "tests/test_ex03_accept_residual.py"
    log.write_text("tests/test_ex01_prompt_lookup.py::test_a PASSED      [ 10%]\n")  # between tests: unknown
    assert grade.running_file(str(log)) is None
    log.write_text("collecting ... ")
    assert grade.running_file(str(log)) is None


@pytest.mark.parametrize("second, timed_out", [("finishes", {1}), ("hangs too", {1, 3, 4})])
def test_one_rerun_at_most_after_a_hang(monkeypatch, second, timed_out):
    """The first run hangs in exercise 1: it is timed out, the others run once more; if that run hangs too,
    what is left is timed out, and nothing runs a third time."""
    calls = []

    def run_tests(root, exercises, junit, timeout):
        calls.append([ex.id for ex in exercises])
        if len(calls) == 1:
            return None, BY_ID[1].test_file
        if second == "hangs too":
            return None, BY_ID[3].test_file
        return [grade.Case(ex.test_file, f"t{i}", ex.id, "passed") for ex in exercises for i in range(ex.tests)], None
    monkeypatch.setattr(grade, "run_tests", run_tests)
    results = grade.grade(".", [BY_ID[1], BY_ID[3], BY_ID[4]], timeout=5)
    assert calls == [[1, 3, 4], [3, 4]]
    assert {r.exercise.id for r in results if r.status == "timed out"} == timed_out
    assert all("TIMEOUT=" in r.notes[0] for r in results if r.status == "timed out")


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    """A handout of exercise 1, answered with an endless loop."""
    out = tmp_path_factory.mktemp("course") / "h"
    make_handout(ROOT, out, parse_selection("1"))
    path = out / "nanospec" / "decoding" / "prompt_lookup.py"
    text = path.read_text()
    blank = next(line for line in text.splitlines() if "raise NotImplementedError(\"exercise 1" in line)
    path.write_text(text.replace(blank, blank.split("raise")[0] + "while True: pass  # a student's endless loop"))
    return out


def run_grade(folder, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "nanospec.course.grade", "--json", "", *args], cwd=folder,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def test_an_endless_loop_is_timed_out_after_timeout_seconds(handout):
    """Before: 600 s of silence, then the exercise alone for another 600 s. Now it says what it runs and gives up
    after --timeout (the rerun of the others, and which test hung, are proven above without waiting). 6 s: pytest
    starts and collects in about 4 on a quiet 2-core machine; on a busy one the run may be stopped before the
    loop, which grade reports alike (the one exercise it ran timed out)."""
    run = run_grade(handout, "--timeout", "6", timeout=120)
    assert run.returncode == 0, run.stderr
    assert "grading exercise 1: python -m pytest -m 'ex1' (at most 6 s" in run.stderr
    assert "ran out of time in exercise 1" in run.stderr and "once more" not in run.stderr  # nothing else to run
    assert next(line for line in run.stdout.splitlines() if line.startswith("  1 ")).endswith("(timed out)")
    assert "an endless loop?" in run.stdout and "make grade TIMEOUT=600" in run.stdout


def test_an_exercise_the_handout_does_not_blank_is_refused(handout):
    """Before: `make grade EX=5` in a handout of exercise 1 graded the untouched reference: 8/8."""
    run = run_grade(handout, "--ex", "5")
    assert run.returncode == 1 and run.stderr.startswith("error: exercise 5 is not in this handout (it has 1)")
    assert len(run.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- a grader that trusts only itself (issue 40)

def tree_of(folder):
    """{relative path: bytes} of every file under folder: what a command must leave as it was."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture
def submission(tmp_path):
    """A student's repository: the handout of exercise 1, left blank, with handout.json deleted (before, the
    grader then graded every exercise, the kept reference code of 2..14 scoring as the student's: 107 of 112),
    and files a full checkout has that grading once deleted (tests/test_course.py) or read (a pytest.ini)."""
    out = tmp_path / "student"
    make_handout(ROOT, out, parse_selection("1"))
    (out / "handout.json").unlink()
    (out / "tests" / "test_course.py").write_text("# the instructor's, in a full checkout\n")
    (out / "pytest.ini").write_text("[pytest]\naddopts = -p no:junitxml\n")
    return out


def test_a_submission_is_graded_on_the_instructors_exercises_in_a_copy(submission, tmp_path):
    """The Gradescope command, a real process whose standard output is a pipe already closed (`| head -1`):
    without --ex one line says to name the exercises; with --ex 1 only exercise 1 is graded (0 points: it is
    blank), the results are written whole before anything is printed, and no file of the submission changed."""
    before = tree_of(submission)
    results = tmp_path / "results.json"
    base = [sys.executable, "-m", "nanospec.course.grade", "--submission", str(submission), "--json", str(results)]
    refused = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.startswith("error: --submission needs --ex, the exercises "
                                                                 "you handed out") and refused.stderr.count("\n") == 1
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run(base + ["--ex", "1"], cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=300, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    os.close(write)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    graded = json.loads(results.read_text())
    assert graded["score"] == 0 and [t["number"] for t in graded["tests"]] == ["1"]
    assert tree_of(submission) == before


def test_a_tampered_record_changes_nothing(submission, monkeypatch, capsys):
    """The submission's handout.json says what the student likes: the exercises graded are --ex's, and the line
    that says they differ is a note. In place, a handout grades its own exercises, and an exercise graded by
    hand only when it was handed out (before, a one-exercise handout listed exercise 12)."""
    (submission / "handout.json").write_text(json.dumps({"exercises": [2, 3], "generated": {}}))
    seen = []
    monkeypatch.setattr(grade, "grade", lambda root, exercises, junit, timeout: seen.append(
        (root, [ex.id for ex in exercises])) or [])
    monkeypatch.setattr(grade, "table", lambda results, root: "table")
    grade.main(["--submission", str(submission), "--ex", "1", "--json", ""])
    assert seen[0][1] == [1] and seen[0][0] != str(submission)  # graded in a copy
    assert "note: the submission's handout.json lists exercises 2, 3; grading 1, as --ex says" in capsys.readouterr().err
    monkeypatch.setattr(grade, "PROJECT", str(submission))  # a grader running in that handout, in place
    assert [ex.id for ex in grade.default_selection()] == [2, 3]
    (submission / "handout.json").write_text(json.dumps({"exercises": [1], "by_hand": [12]}))
    assert [ex.id for ex in grade.default_selection()] == [1, 12]
    (submission / "handout.json").write_text(json.dumps({"exercises": [1]}))
    assert [ex.id for ex in grade.default_selection()] == [1]


def test_a_results_file_that_is_not_the_graders_is_kept(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(SystemExit) as stop:
        grade.main(["--ex", "1", "--json", str(notes)])
    assert stop.value.code == f"error: --json {notes} is not a results file of the grader's: it is kept; give " \
                              "another file"
    assert notes.read_text() == "my notes"


def test_a_long_pytest_run_says_how_far_it_got(monkeypatch, capsys, tmp_path):
    """Every PROGRESS_SECONDS of a pytest run, a line with the tests done so far (from its verbose log)."""
    class Slow:  # a pytest run that takes two looks to finish
        def __init__(self, cmd, stdout, **kw):
            self.out, self.looks = stdout, 0

        def wait(self, timeout=None):
            self.looks += 1
            self.out.write(f"tests/test_ex01_prompt_lookup.py::test_{self.looks} PASSED\n")
            self.out.flush()
            if self.looks < 3:
                raise subprocess.TimeoutExpired("pytest", timeout)

        def poll(self):
            return 0
    monkeypatch.setattr(grade.subprocess, "Popen", Slow)
    monkeypatch.setattr(grade, "PROGRESS_SECONDS", 0.01)
    with pytest.raises(RuntimeError, match="pytest wrote no report"):
        grade.run_tests(str(tmp_path), [BY_ID[1]], str(tmp_path / "r.xml"), timeout=60)
    err = capsys.readouterr().err.splitlines()
    assert err[1:] == ["  ... 1 tests done (0 s)", "  ... 2 tests done (0 s)"], err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the pytest run in /proc")
def test_ctrl_c_while_grading_ends_in_one_line_and_stops_the_run(handout, tmp_path):
    """A real process (before, a traceback): SIGINT while the endless loop runs ends the grader with
    'interrupted', status 130, no results file, and the pytest run it started gone with it."""
    results = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "nanospec.course.grade", "--timeout", "120", "--json",
                             str(results)], cwd=handout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)

    def pytest_runs():  # the processes running pytest in the handout
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if os.readlink(f"/proc/{pid}/cwd") == str(handout) and b"\0-m\0pytest\0" in cmdline:
                    found.append(pid)
            except OSError:
                pass
        return found
    for _ in range(600):  # until pytest runs (within a minute)
        if pytest_runs():
            break
        proc.poll() is None or pytest.fail(proc.stderr.read())
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.endswith("interrupted\n") and "Traceback" not in err, err
    assert not results.exists() and pytest_runs() == []


# ----------------------------------------------------------------------------- the handout (issue 40)

def test_a_handout_holds_only_tracked_files(tmp_path):
    """Before: a stray notes.txt the instructor had not added went to the students."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "kept.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("not for students\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "kept.py"], cwd=repo, check=True)
    assert handout_kit.source_files(repo) == ["kept.py"]


def test_the_handout_names_a_git_folder_only_when_there_is_one(tmp_path, capsys):
    out = tmp_path / "h"
    handout_kit.main(["--ex", "1", "--out", str(out), "--root", str(ROOT)])
    (out / "mine.txt").write_text("mine")
    handout_kit.main(["--ex", "1", "--out", str(out), "--root", str(ROOT)])
    assert "1 files it did not write left as they were" in capsys.readouterr().out  # before: "(.git included)"
    (out / ".git").mkdir()
    handout_kit.main(["--ex", "1", "--out", str(out), "--root", str(ROOT)])
    assert "2 files it did not write (.git included) left as they were" in capsys.readouterr().out


def test_a_closed_pipe_ends_the_handout_quietly(tmp_path):
    """`make handout | head -1` with nothing to read: a real process whose standard output is a pipe already
    closed writes the whole handout and ends quietly, status 0 (before, a BrokenPipeError traceback)."""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "nanospec.course.handout", "--ex", "1", "--out", str(tmp_path / "h")],
                          cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads((tmp_path / "h" / "handout.json").read_text())["exercises"] == [1]


def test_ctrl_c_while_updating_a_handout_waits_for_the_last_file(tmp_path, monkeypatch):
    """The moves into an earlier handout hold Ctrl-C back until the last is done: interrupted, the handout is
    the new one whole (its handout.json lists what is there), never half old and half new."""
    out = tmp_path / "h"
    make_handout(ROOT, out, parse_selection("1"))
    real = handout_kit.install

    def interrupted_midway(staging, out, files, before):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C before the first move
        return real(staging, out, files, before)
    monkeypatch.setattr(handout_kit, "install", interrupted_midway)
    with pytest.raises(KeyboardInterrupt):
        make_handout(ROOT, out, parse_selection("2"))
    stamp = json.loads((out / "handout.json").read_text())
    assert stamp["exercises"] == [2] and handout_kit.changed_since(str(out), stamp["generated"]) == []


# ----------------------------------------------------------------------------- the Makefile

def make(*args):
    run = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@needs_make
def test_make_alone_lists_the_targets():
    """Before: plain `make` ran pip install, the first target."""
    out = make()
    for target in ("train", "test", "bench", "figures", "handout", "grade"):
        assert f"make {target} " in out, target


@needs_make
@pytest.mark.parametrize("out", ["/tmp/a b", "/tmp/x;echo INJECTED", "it's $$HOME `id`"])
def test_make_passes_each_value_as_one_word(out):
    """Before: OUT="/tmp/a b" was two arguments and OUT="/tmp/x;echo INJECTED" ran the echo."""
    printed = make("handout", f"PYTHON={ARGV}", f"OUT={out}")
    assert printed.splitlines()[-1] == str(['-m', 'nanospec.course.handout', '--ex', 'all', '--out',
                                            out.replace("$$", "$")])
    assert "INJECTED\n" not in printed.replace("INJECTED'", "")


@needs_make
def test_make_grade_takes_a_timeout_and_figures_an_out():
    grade_args = make("grade", f"PYTHON={ARGV}", "EX=1", "TIMEOUT=30").splitlines()[-1]
    assert grade_args == str(['-m', 'nanospec.course.grade', '--ex', '1', '--timeout', '30'])
    assert make("figures", f"PYTHON={ARGV}").splitlines()[-1] == str(['-m', 'nanospec.bench.figures'])
    assert make("figures", f"PYTHON={ARGV}", "OUT=docs/figures").splitlines()[-1] == str(
        ['-m', 'nanospec.bench.figures', '--out', 'docs/figures'])
    # issue 40: CKPT= reaches the figures (before, they were drawn from out/ whatever CKPT said)
    assert make("figures", f"PYTHON={ARGV}", "CKPT=out-gpu").splitlines()[-1] == str(
        ['-m', 'nanospec.bench.figures', '--ckpt', 'out-gpu'])


@needs_make
@pytest.mark.parametrize("value, overwrite", [("", False), ("0", False), ("no", False), ("1", True), ("yes", True)])
def test_overwrite_0_means_no(value, overwrite):
    """Before: `make handout OVERWRITE=0` replaced a student's edited file: any value at all was a yes."""
    printed = make("handout", f"PYTHON={ARGV}", "OUT=/tmp/h", f"OVERWRITE={value}").splitlines()[-1]
    assert ("'--overwrite'" in printed) == overwrite, printed


@needs_make
def test_an_overwrite_value_that_is_neither_is_refused():
    run = subprocess.run(["make", "--no-print-directory", "handout", f"PYTHON={ARGV}", "OVERWRITE=maybe"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "OVERWRITE=maybe: say OVERWRITE=1" in run.stderr and not run.stdout


# ----------------------------------------------------------------------------- the figures

def test_make_figures_writes_to_an_ignored_folder_unless_asked():
    """Before: `make figures` rewrote the tracked docs/figures/*.png from whatever model was in out/."""
    default = figures.parse_args([]).out
    assert default == os.path.join("runs", "figures") and figures.parse_args(["--out", "x"]).out == "x"
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(default, "bench.png")], cwd=ROOT)
    assert ignored.returncode == 0  # git ignores it: the tree stays clean


@pytest.mark.parametrize("text, width, shown", [
    ("    def __init__(self, name):\n        self.name =", 60, "    def __init__(self, name):\n        self.name ="),
    ("    def __init__(self, name):\n        self.name =", 40, "...        self.name ="),
    ("import os\ndef main(", 12, "...def main("),
    ("x = a_long_name + another_long_name", 20, "...+ another_long_name"),
])
def test_the_step_figures_context_is_cut_between_words(text, width, shown):
    """Before: the title read 'after "_init__(self, name)...' (the last 40 characters, mid-word)."""
    assert figures.tail(text, width) == shown
