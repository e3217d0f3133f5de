"""
The autograder: runs the chosen exercises' graded tests, prints a table and writes Gradescope's results.json.

    python -m nanospec.course.grade                       # this handout's exercises (handout.json), else all
    python -m nanospec.course.grade --ex 3,4              # (or: make grade EX=3,4)
    python -m nanospec.course.grade --submission /autograder/submission --json /autograder/results/results.json

One pytest run, in a subprocess, over the exercises' test files, selected by their markers (`-m "ex3 or ex4"`),
writes JUnit XML, where every test case names its exercise (tests/conftest.py). An exercise scores its points
times the share of its tests that passed. Before scoring, every exercise must have run exactly the number of
tests the registry gives it: a misspelt marker, a lost test or an empty selection is an error (exit status 2),
never full marks. The tests the registry names as an exercise's `gates` prove a law (an exact enumeration, a
statistical bound): if one of them fails, the exercise scores zero, whatever its other tests say. Each failure is
reported with its test's own message (what was expected, what came), and the table ends with the command that
shows everything (`python -m pytest -m exN -x`). A test file that cannot even be imported (say, a syntax error in the student's code) scores
0 with the error shown. Each pytest run says what it runs and may take --timeout seconds (`make grade
TIMEOUT=120`; default 300). A run that outlives it (an endless loop) names the test it was in, from pytest's
verbose output: that exercise is marked timed out and the others run once more without it, so one hang costs
only its own points and grading takes at most two timeouts. Nothing is timed: a score never depends on the
machine.

In a handout, only the exercises it blanks can be graded: grading another one would grade the reference code
that the handout kept, and report full marks for work nobody did. Run in a handout without --ex, it grades the
exercises its handout.json lists (the student's own copy, graded for the student).

--submission grades another folder (a student's repository) with THIS project's tests, and trusts nothing in it:
which exercises to grade comes from the instructor's command line (--ex, required), never from the
submission's handout.json, which the student can delete or edit (deleted, the reference code of every other
exercise would score as the student's); the folder is copied, and the copy's tests/ and pytest settings are
replaced by ours (conftest.py files above tests/ are not loaded), so editing the tests changes nothing and the
submission itself is never changed. Its pytest runs use one torch thread (tests/conftest.py, OMP_NUM_THREADS=1):
the graded tests' tiny models gain nothing from more, and a busy machine makes more wait on each other. The
results file is written (whole, then renamed) before the table is printed, so a reader that goes away early
(`| head -1`) loses nothing; Ctrl-C ends in one line and leaves no half-written results.
"""
import sys

if __name__ == "__main__":  # first: Ctrl-C and a closed pipe end it in one line or quietly
    from nanospec.device import plain_exits
    plain_exits()

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from nanospec.course.handout import STAMP
from nanospec.course.registry import EXERCISES, VERSION, parse_selection

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this project's root


@dataclass
class Case:
    file: str  # tests/test_ex03_accept_residual.py
    name: str  # test_docstring_example, or the module for a collection error
    exercise: int  # from the test's marker; None for a collection error
    outcome: str  # passed, failed, error, skipped
    message: str = ""  # the failure's message: "residual row 0 (...): expected [0.5, 0.5, 0.0], got [nan, ...]"
    detail: str = ""  # the report's full text (for a collection error: the traceback)


@dataclass
class Result:
    exercise: object  # the registry entry
    passed: int = 0
    ran: int = 0
    score: float = 0.0
    status: str = "ok"  # ok, not collected, timed out, registry mismatch, by hand
    notes: list = field(default_factory=list)  # what the student should read: failures, errors


def read_junit(path):
    """JUnit XML -> [Case]. pytest writes one testcase per test, with a <failure>, <error> or <skipped> child
    when it did not pass, and a collection error as a testcase named after the module."""
    cases = []
    for tc in ET.parse(path).iter("testcase"):
        classname, name = tc.get("classname", ""), tc.get("name", "")
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        module = classname if classname else name  # "tests.test_ex03_accept_residual"
        outcome, message, detail = "passed", "", ""
        for tag, label in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = tc.find(tag)
            if el is not None:
                outcome, detail = label, (el.text or "").strip()
                message = failure_message(el.get("message") or detail) or label
                break
        cases.append(Case(module.replace(".", "/") + ".py", name if classname else module,
                          int(props["exercise"]) if "exercise" in props else None, outcome, message, detail))
    return cases


def failure_message(text, limit=600):
    """The words of a failure, without pytest's decoration: 'AssertionError: residual row 0 ...: expected ...'
    -> 'residual row 0 ...: expected ...'. Lines from pytest's own introspection ('assert ...', 'where ...') and
    the traceback are dropped; what is left is joined on one line and cut at `limit` characters."""
    kept = []
    for line in text.strip().splitlines():
        stripped = line.strip()
        if stripped.startswith(("assert ", "+ ", "- ", "where ", "and ", "E ", "Traceback", "File ")) or not stripped:
            if kept:
                break
            continue
        kept.append(stripped)
    words = " ".join(kept)
    for prefix in ("AssertionError: ", "builtins.AssertionError: "):
        words = words[len(prefix):] if words.startswith(prefix) else words
    return words if len(words) <= limit else words[:limit - 3] + "..."


def test_name(case):
    """'test_the_output_law_is_p_exactly[V=2]' -> 'test_the_output_law_is_p_exactly' (what the registry's gates name)."""
    return case.name.split("[", 1)[0]


def run_tests(root, exercises, junit, timeout):
    """One pytest subprocess over the exercises' tests, announced on stderr. Returns ([Case], None), or (None, the
    test file it was in) if it outlived `timeout` seconds (None if that cannot be told: a hang while importing)."""
    files = sorted({ex.test_file for ex in exercises})
    marks = " or ".join(ex.marker for ex in exercises)
    cmd = [sys.executable, "-m", "pytest", *files, "-m", marks, f"--junitxml={junit}", "-o", "addopts=", "-v",
           "--strict-markers", "-p", "no:cacheprovider", f"--confcutdir={os.path.join(root, 'tests')}"]
    print(f"grading exercise{'s' * (len(exercises) > 1)} {', '.join(str(ex.id) for ex in exercises)}: python -m "
          f"pytest -m '{marks}' (at most {timeout:g} s; TIMEOUT=... to change)", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",  # unbuffered: a killed run's
           "OMP_NUM_THREADS": "1"}                                                  # output names its last test
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "pytest.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            t0 = time.monotonic()
            try:
                while True:  # a line every PROGRESS_SECONDS: how many tests are done
                    try:
                        proc.wait(timeout=max(0.0, min(PROGRESS_SECONDS, t0 + timeout - time.monotonic())))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() - t0 >= timeout:
                            return None, running_file(log)
                        print(f"  ... {tests_done(log)} tests done ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                              flush=True)
            finally:
                if proc.poll() is None:  # out of time, or Ctrl-C: the run goes with us
                    proc.kill()
                    proc.wait()
    if not os.path.exists(junit):
        raise RuntimeError(f"pytest wrote no report in {root}: run `{' '.join(cmd[1:4])} ...` there to see why")
    return read_junit(junit), None


PROGRESS_SECONDS = 20  # how often a long pytest run says how far it got


def tests_done(log):
    """How many tests a verbose pytest run has finished so far, from its log."""
    with open(log, errors="replace") as f:
        return len(re.findall(r"::\S+ (?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", f.read()))


def running_file(log):
    """The test file of the test a killed verbose pytest run was in: pytest -v writes each test's id when it
    starts ('tests/test_ex05_kv_cache.py::test_x ') and its outcome when it ends; the last id without an outcome
    is the one that hung. None if every id it wrote has an outcome (it hung elsewhere, say while importing)."""
    with open(log, errors="replace") as f:
        lines = [line for line in f.read().splitlines() if "::" in line]
    if not lines:
        return None
    last = lines[-1]
    if re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", last):
        return None
    return last.split("::", 1)[0].strip()


def why(case, root):
    """The end of a collection error's traceback, e.g. 'nanospec/rules/verify.py, line 76: SyntaxError: expected ':''."""
    lines = [line[1:].strip() if line.startswith("E") else line.strip() for line in case.detail.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return case.message
    where = [m for m in (re.match(r'File "(.+)", line (\d+)', line) for line in lines) if m]
    place = f"{os.path.relpath(where[-1].group(1), root)}, line {where[-1].group(2)}: " if where else ""
    return place + lines[-1]


def score(exercises, cases, timed_out=(), root="."):
    """[Result] per exercise from the test cases (see the module docstring for the rules)."""
    results = []
    for ex in exercises:
        r = Result(ex)
        results.append(r)
        if ex.manual:
            r.status = "by hand"
            continue
        if ex.id in timed_out:
            r.status = "timed out"
            r.notes.append("the tests did not finish in time (an endless loop?); if they are only slow, give them "
                           "more: make grade TIMEOUT=600")
            continue
        broken = [c for c in cases if c.exercise is None and c.file == ex.test_file]
        if broken:
            r.status = "not collected"
            for c in broken:
                r.notes.append(f"{ex.test_file} could not be imported: {why(c, root)}")
            continue
        mine = [c for c in cases if c.exercise == ex.id]
        r.ran, r.passed = len(mine), sum(c.outcome == "passed" for c in mine)
        if r.ran != ex.tests:
            r.status = "registry mismatch"
            r.notes.append(f"{r.ran} tests ran with marker {ex.marker} in {ex.test_file} but the registry "
                           f"expects {ex.tests}: fix the marker or nanospec/course/registry.py")
            r.passed = 0
            continue
        names = {test_name(c) for c in mine}
        missing = [g for g in ex.gates if g not in names]
        if missing:
            r.status = "registry mismatch"
            r.notes.append(f"the registry names {', '.join(missing)} as a gate of {ex.marker} but no such test ran "
                           f"in {ex.test_file}: fix nanospec/course/registry.py")
            r.passed = 0
            continue
        failed_gates = sorted({test_name(c) for c in mine if c.outcome != "passed" and test_name(c) in ex.gates})
        r.score = 0.0 if failed_gates else round(ex.points * r.passed / ex.tests, 2)
        if failed_gates:
            r.status = "law failed"
            r.notes.append(f"0 points: {', '.join(failed_gates)} {'proves a law' if len(failed_gates) == 1 else 'prove laws'} "
                           f"your code must keep, and failed; a law test gates the exercise, whatever the others say")
        by_message = {}  # one line per distinct failure, with the tests that hit it
        for c in mine:
            if c.outcome != "passed":
                by_message.setdefault(f"{c.outcome}: {c.message}", []).append(c.name)
        for message, names in by_message.items():
            more = f", and {len(names) - 3} more" if len(names) > 3 else ""
            r.notes.append(f"{message}\n    in {', '.join(names[:3])}{more}")
    return results


def grade(root, exercises, junit=None, timeout=300):
    """Run and score: one run of every exercise; if it runs out of time, the exercise it hung in is timed out
    and the others run once more (if that one runs out too, what it did not finish is timed out). Returns
    [Result]."""
    graded = [ex for ex in exercises if not ex.manual]
    cases, timed_out = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in (1, 2):
            if not graded:
                break
            found, hung_in = run_tests(root, graded, junit or os.path.join(tmp, f"run{attempt}.xml"), timeout)
            if found is not None:
                cases = found
                break
            hung = [ex for ex in graded if ex.test_file == hung_in]
            if attempt == 2 or not hung:  # no second chance, or no way to tell which one hung: all of them
                hung = graded
            timed_out |= {ex.id for ex in hung}
            graded = [ex for ex in graded if ex not in hung]
            print(f"ran out of time in exercise{'s' * (len(hung) > 1)} {', '.join(str(ex.id) for ex in hung)}"
                  + (": running the others once more" if graded and attempt == 1 else ""), file=sys.stderr, flush=True)
    return score(exercises, cases, timed_out, root)


def table(results, root):
    w = max(len(r.exercise.title) for r in results) + 2
    lines = [f"nanospec course v{VERSION}: {root}", f"{'ex':>3}  {'exercise':<{w}}{'tests':>8}{'points':>12}"]
    auto = [r for r in results if not r.exercise.manual]
    for r in results:
        ex = r.exercise
        tests = "by hand" if ex.manual else f"{r.passed}/{ex.tests}"
        points = f"-/{ex.points}" if ex.manual else f"{r.score:g}/{ex.points}"
        flag = "" if r.status in ("ok", "by hand") else f"  ({r.status})"
        lines.append(f"{ex.id:>3}  {ex.title:<{w}}{tests:>8}{points:>12}{flag}")
    tests = f"{sum(r.passed for r in auto)}/{sum(r.exercise.tests for r in auto)}"
    points = f"{sum(r.score for r in auto):g}/{sum(r.exercise.points for r in auto)}"
    by_hand = sum(r.exercise.points for r in results if r.exercise.manual)
    lines.append(f"{'':>3}  {'total' + (f' (and {by_hand} points graded by hand)' if by_hand else ''):<{w}}"
                 f"{tests:>8}{points:>12}")
    for r in results:
        if r.notes:
            lines.append(f"\nexercise {r.exercise.id}:")
            lines += [f"  {note}" for note in r.notes[:8]]
            if len(r.notes) > 8:
                lines.append(f"  ... and {len(r.notes) - 8} more")
            lines.append(f"  to see everything: python -m pytest -m {r.exercise.marker} -x")
    return "\n".join(lines)


def gradescope(results, text, seconds):
    """Gradescope's results.json: one test entry per auto-graded exercise, with its score and what failed."""
    tests = []
    for r in results:
        ex = r.exercise
        if ex.manual:
            continue
        summary = f"{r.passed} of {ex.tests} tests passed" + ("" if r.status == "ok" else f" ({r.status})")
        hint = [f"to see everything: python -m pytest -m {ex.marker} -x"] if r.notes else []
        tests.append({"name": f"Exercise {ex.id}: {ex.title}", "number": str(ex.id), "score": r.score,
                      "max_score": ex.points, "output": "\n".join([summary] + r.notes + hint), "visibility": "visible"})
    return {"score": round(sum(t["score"] for t in tests), 2), "execution_time": round(seconds, 1),
            "output": text, "tests": tests}


def read_stamp(folder):
    """handout.json in `folder` as a dict, or None where there is none (or it is no record of ours)."""
    try:
        with open(os.path.join(folder, STAMP), encoding="utf-8") as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) and isinstance(stamp.get("exercises"), list) else None


def handout_exercises():
    """The ids of the exercises the handout this grader runs in blanks (its own handout.json), or None outside
    a handout. Only the grader's own folder counts: a submission's handout.json is the student's to edit."""
    stamp = read_stamp(PROJECT)
    return None if stamp is None else stamp["exercises"]


def default_selection():
    """The exercises of the handout this grader runs in (and the ones graded by hand it hands out), else all."""
    stamp = read_stamp(PROJECT)
    if stamp is None:
        return list(EXERCISES)
    ids = set(stamp["exercises"]) | set(stamp.get("by_hand", []))
    return [ex for ex in EXERCISES if ex.id in ids]


def check_in_handout(exercises):
    """In a handout, an exercise it does not blank is a ValueError: its code is still the reference's, and
    grading it would report full marks for nothing."""
    ids = handout_exercises()
    extra = [ex.id for ex in exercises if ids is not None and ex.id not in ids and not ex.manual]
    if extra:
        raise ValueError(f"exercise{'s' * (len(extra) > 1)} {', '.join(map(str, extra))} "
                         f"{'are' if len(extra) > 1 else 'is'} not in this handout (it has "
                         f"{', '.join(map(str, ids))}): its code is the reference's, so grading it means nothing; "
                         f"drop EX= to grade the handout's own")


NOT_COPIED = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "out"}  # at a submission's top:
# what the graded tests never read (history, caches, checkpoints: they are hermetic)
PYTEST_SETTINGS = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg", "conftest.py")  # a root's, read by pytest


def copy_submission(submission, dest):
    """Copy the submission to dest, to be graded there: the submission itself is never changed. Links are copied
    as links; its history, caches and checkpoints stay behind (NOT_COPIED, out-*/, data-*/)."""
    def ignore(folder, names):
        if os.path.abspath(folder) != os.path.abspath(submission):
            return {n for n in names if n in ("__pycache__", ".pytest_cache")}
        return {n for n in names if n in NOT_COPIED or n.startswith(("out-", "data-"))}
    shutil.copytree(submission, dest, symlinks=True, ignore=ignore)


def install_tests(root):
    """Replace the copy's tests/ by this project's (the graded files, their helpers, conftest.py) and its pytest
    settings by ours: a student's pytest.ini, setup.cfg or root conftest.py changes nothing."""
    for name in ("tests",) + PYTEST_SETTINGS:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    shutil.copytree(os.path.join(PROJECT, "tests"), os.path.join(root, "tests"),
                    ignore=shutil.ignore_patterns("__pycache__", "test_course*.py"))
    if os.path.exists(os.path.join(PROJECT, "pyproject.toml")):
        shutil.copy(os.path.join(PROJECT, "pyproject.toml"), os.path.join(root, "pyproject.toml"))


def submission_note(submission, exercises):
    """A line when the submission's own handout.json names other exercises than the command line: a note only,
    never a reason to grade anything else (the student can edit it). None when they agree or there is none."""
    stamp = read_stamp(submission)
    graded = sorted(ex.id for ex in exercises if not ex.manual)
    if stamp is None or sorted(stamp["exercises"]) == graded:
        return None
    return (f"note: the submission's {STAMP} lists exercises {', '.join(map(str, stamp['exercises'])) or 'none'}; "
            f"grading {', '.join(map(str, graded))}, as --ex says")


def check_results_file(path):
    """--json: a file it may write, checked before grading: a folder, or a file that is not a results file of
    ours (Gradescope's, with "tests" and "score"), is a ValueError; nothing of the user's is replaced unasked."""
    if os.path.isdir(path):
        raise ValueError(f"--json {path} is a folder: give a file name, e.g. {os.path.join(path, 'results.json')}")
    if os.path.isfile(path) and os.path.getsize(path):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if not (isinstance(data, dict) and "tests" in data and "score" in data):
            raise ValueError(f"--json {path} is not a results file of the grader's: it is kept; give another file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--json {path}: the folder {folder} does not exist")


def write_results(path, results):
    """Gradescope's results.json, whole or not at all: a temporary file beside it, renamed over it."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv=None):
    p = argparse.ArgumentParser(description="Grade nanospec's exercises: run their tests, print a table, write "
                                            "Gradescope's results.json.")
    p.add_argument("--ex", default=None, help="exercises to grade: 3,4 or 1-4 or all (default: in a handout, its "
                                              "exercises, else all; with --submission it must be given: the "
                                              "exercises you handed out)")
    p.add_argument("--submission", default=None, help="grade a copy of this folder (a student's) with this "
                                                      "project's tests, which replace its tests/ there; the folder "
                                                      "itself is never changed (default: this project, in place)")
    p.add_argument("--json", default="results.json", help="where to write Gradescope's results (default "
                                                          "results.json; '' = do not write)")
    p.add_argument("--junit", default=None, help="also keep pytest's JUnit XML here")
    p.add_argument("--timeout", type=float, default=300, help="seconds one pytest run may take (default 300); "
                   "after a run that runs out, the exercise it hung in scores 0 and the others run once more")
    args = p.parse_args(argv)
    root = os.path.abspath(args.submission or PROJECT)
    with tempfile.TemporaryDirectory(prefix="nanospec-grade-") as scratch:
        try:
            if not os.path.isdir(os.path.join(root, "nanospec")):
                raise ValueError(f"{root} holds no nanospec/ folder: is it a copy of the project?")
            if not args.timeout > 0:
                raise ValueError(f"--timeout must be a number of seconds above 0, got {args.timeout:g}")
            if args.submission and args.ex is None:
                raise ValueError("--submission needs --ex, the exercises you handed out (e.g. --ex 1-11): the "
                                 f"submission's own {STAMP} is the student's to delete or edit, so it cannot say")
            exercises = default_selection() if args.ex is None else parse_selection(args.ex)
            check_in_handout(exercises)
            if args.json:
                check_results_file(args.json)
            where = root
            if args.submission:  # graded in a copy: nothing of the student's is changed
                note = submission_note(root, exercises)
                if note:
                    print(note, file=sys.stderr, flush=True)
                where = os.path.join(scratch, "submission")
                copy_submission(root, where)
                install_tests(where)
            t0 = time.time()
            results = grade(where, exercises, args.junit, args.timeout)
        except (ValueError, RuntimeError, OSError) as e:
            sys.exit(f"error: {e}")
    text = table(results, root)
    if args.json:  # first the file, then the table: a reader that closes the pipe early loses nothing
        try:
            write_results(args.json, gradescope(results, text, time.time() - t0))
        except OSError as e:
            print(text)
            sys.exit(f"error: could not write --json {args.json} ({e.strerror or e}); the table is above")
    print(text)
    if args.json:
        print(f"\nwrote {args.json}")
    if any(r.status == "registry mismatch" for r in results):
        sys.exit(2)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # here, not at exit: a reader that closed the pipe ends it quietly (plain_exits)
