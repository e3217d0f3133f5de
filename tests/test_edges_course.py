"""Every edge a user meets in the course kit, the Makefile and the figures (issue 33): `make grade` says what it
runs, takes TIMEOUT= and reruns at most once after a hang, naming the exercise that hung; it refuses an exercise
the handout does not blank; the Makefile passes every value as one word (no injection) and lists its targets;
`make figures` writes to a folder git ignores unless asked; the step figure's title is not cut mid-word."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanospec import figures
from nanospec.course import grade
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
    assert make("figures", f"PYTHON={ARGV}").splitlines()[-1] == str(['-m', 'nanospec.figures'])
    assert make("figures", f"PYTHON={ARGV}", "OUT=docs/figures").splitlines()[-1] == str(
        ['-m', 'nanospec.figures', '--out', 'docs/figures'])
    # issue 40: CKPT= reaches the figures (before, they were drawn from out/ whatever CKPT said)
    assert make("figures", f"PYTHON={ARGV}", "CKPT=out-gpu").splitlines()[-1] == str(
        ['-m', 'nanospec.figures', '--ckpt', 'out-gpu'])


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
