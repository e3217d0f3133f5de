"""
The course kit's teeth (nanospec/course, EXERCISES.md), proven on handouts built from this very source.
Instructor-only: handouts leave this file out.

  - In a handout with EVERY exercise blanked, run through the autograder (one pytest subprocess), each
    exercise's graded tests all fail, each with its own exercise's NotImplementedError: not an import or
    syntax error, and not another exercise's. So no graded test needs another exercise's code, and in the
    handout of one exercise alone its tests reach the same stub. On the full code they pass: the rest of this
    suite runs them.
  - The handout of each exercise alone: its stubs keep the reference's signature and docstring and only raise,
    every other function and file is the reference's, and no line of a removed body is anywhere in the copy.
  - The copy holds no .git, bytecode, out/, data/*.txt, marker comment or this file, and what needs no
    blanked function still runs there (an `ar` generation, decode.py).
  - The autograder's rules (the count check, collection errors, partial credit, Gradescope's format) on a
    literal JUnit report, and the generator's one-line errors on malformed markers.
  - No function anywhere in a one-exercise handout passes that exercise in place of its blanked functions
    (the impostor search, nanospec/course/impostors.py), and the search has power: asked about exercise 3 in
    exercise 4's handout, which keeps exercise 3, it finds it.
The all-exercise handout is built and graded once per session, the one-exercise handouts once each, and the
grading and the impostor search run side by side in two processes.
"""
import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanospec.course import grade, handout
from nanospec.course.handout import HandoutError, find_regions, functions, make_handout
from nanospec.course.registry import BY_ID, EXERCISES, VERSION, parse_selection

ROOT = Path(__file__).resolve().parents[1]
GRADED = [ex for ex in EXERCISES if not ex.manual]


def files_under(folder):
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def handouts(tmp_path_factory):
    """Every handout this file looks at, made once, and the two slow runs over them started at once, each in a
    process of its own (two cores, half the wait): the autograder over the handout with every exercise blanked,
    and the impostor search (nanospec/course/impostors.py) over each one-exercise handout."""
    base = tmp_path_factory.mktemp("course")
    out = base / "handout"
    summary = make_handout(ROOT, out, list(EXERCISES))
    files = files_under(out)  # before anything runs there
    alone = {}
    for ex in GRADED:
        alone[ex.id] = base / f"ex{ex.id}"
        make_handout(ROOT, alone[ex.id], [ex])
    junit, results = base / "report.xml", base / "results.json"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    # --timeout 550: on a busy machine the blank handout's one run may outlast make grade's default (300 s)
    grading = subprocess.Popen([sys.executable, "-m", "nanospec.course.grade", "--junit", str(junit), "--json",
                                str(results), "--timeout", "550"], cwd=out, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env)
    # the impostor search: (exercise 3 asked of exercise 4's handout, which keeps it, is the power check)
    jobs = [[str(alone[ex.id]), ex.id] for ex in GRADED] + [[str(alone[4]), 3]]
    (base / "jobs.json").write_text(json.dumps(jobs))
    searching = subprocess.Popen([sys.executable, "-m", "nanospec.course.impostors", str(base / "jobs.json"),
                                  str(base / "found.json")], cwd=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, stdin=subprocess.DEVNULL, env={**env, "PYTHONPATH": str(ROOT)})
    stdout, stderr = grading.communicate(timeout=600)
    run = subprocess.CompletedProcess(grading.args, grading.returncode, stdout, stderr)
    blank = SimpleNamespace(path=out, summary=summary, files=files, run=run,
                            cases=grade.read_junit(junit) if junit.exists() else [],
                            results=json.loads(results.read_text()) if results.exists() else None)
    _, search_err = searching.communicate(timeout=600)
    found = json.loads((base / "found.json").read_text()) if searching.returncode == 0 else None
    return SimpleNamespace(blank=blank, alone=alone, found=found, search_error=search_err[-3000:])


@pytest.fixture(scope="module")
def all_blanked(handouts):
    """Every exercise blanked, then graded in place by the autograder, as a student's untouched copy would be."""
    return handouts.blank


@pytest.fixture(scope="module")
def alone(handouts):
    """The handout of each exercise by itself: {exercise id: folder}."""
    return handouts.alone


@pytest.fixture(scope="module")
def impostors(handouts):
    """The functions of a handout that pass an exercise in place of its blanked functions:
    impostors(folder, exercise id) -> {(file, function, blanked function)}."""
    assert handouts.found is not None, handouts.search_error
    return lambda folder, ex_id: {tuple(x) for x in handouts.found[f"{folder}|{ex_id}"]}


# ---------------------------------------------------------------------------------------------------------
# The graded tests fail in the handout, each with its own exercise's stub


def test_every_graded_test_fails_with_its_own_exercises_stub(all_blanked):
    assert all_blanked.cases, all_blanked.run.stdout + all_blanked.run.stderr
    assert not [c for c in all_blanked.cases if c.exercise is None], "a graded test file did not import"
    for ex in GRADED:
        mine = [c for c in all_blanked.cases if c.exercise == ex.id]
        assert len(mine) == ex.tests, f"exercise {ex.id}: {len(mine)} tests ran, the registry says {ex.tests}"
        for c in mine:
            assert c.outcome in ("failed", "error"), (ex.id, c.name, c.outcome)
            own = f"NotImplementedError: exercise {ex.id}: implement "
            assert c.message.startswith(own), (ex.id, c.name, c.message)


def test_the_autograder_scores_the_blank_handout_zero(all_blanked):
    run, results = all_blanked.run, all_blanked.results
    assert run.returncode == 0, run.stdout + run.stderr
    total_tests = sum(ex.tests for ex in GRADED)
    total_points = sum(ex.points for ex in GRADED)
    assert f"0/{total_tests}" in run.stdout and f"0/{total_points}" in run.stdout
    assert results["score"] == 0
    assert [t["number"] for t in results["tests"]] == [str(ex.id) for ex in GRADED]
    for t, ex in zip(results["tests"], GRADED):
        assert t["name"] == f"Exercise {ex.id}: {ex.title}" and t["max_score"] == ex.points and t["score"] == 0
        assert t["output"].startswith(f"0 of {ex.tests} tests passed") and f"exercise {ex.id}: implement" in t["output"]


# ---------------------------------------------------------------------------------------------------------
# What the copy holds


def test_the_copy_holds_only_what_students_should_have(all_blanked):
    files = all_blanked.files
    assert not [f for f in files if f.startswith((".git/", "out/")) or "__pycache__" in f or f.endswith(".pyc")
                or (f.startswith("data/") and f.endswith(".txt"))]
    assert not [f for f in files if f.startswith("tests/test_course")] and "EXERCISES.md" in files
    assert "nanospec/course/impostors.py" not in files and "nanospec/course/grade.py" in files  # the kit's own search
    withheld = {f for ex in GRADED for f in ex.reference}  # every exercise blanked: no working copy ships
    assert withheld and not withheld & set(files)
    assert set(files) == set(handout.source_files(ROOT)) - withheld | {"handout.json"}
    for f in files:
        if f.endswith(".py"):
            text = (all_blanked.path / f).read_text()
            comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
                        if t.type == tokenize.COMMENT]
            assert not [c for c in comments if re.match(r"#\s*(BEGIN|END)\s*SOLUTION", c, re.IGNORECASE)], f
    stamp = json.loads((all_blanked.path / "handout.json").read_text())
    assert stamp["version"] == VERSION and stamp["exercises"] == [ex.id for ex in GRADED]


def reference_regions():
    """{path: (text, [Region])} for every file with solution markers in this source."""
    found = {}
    for rel in handout.source_files(ROOT):
        if rel.endswith(".py"):
            text = (ROOT / rel).read_text()
            regions = find_regions(text, rel)
            if regions:
                found[rel] = (text, regions)
    return found


def secret_lines(exercise_ids):
    """The stripped lines of the removed bodies (code and comments apart) that the rest of the project's code
    does not also hold: those must not appear in a handout. Written apart from handout.py's own check."""
    regions = reference_regions()
    body, outside = set(), []
    for rel in handout.source_files(ROOT):
        if not rel.endswith(".py") or rel.startswith(("tests/test_ex", "tests/test_course")):
            continue
        lines = (ROOT / rel).read_text().splitlines()
        spans = [(r.begin, r.end) for r in regions.get(rel, (None, []))[1]]
        for i, line in enumerate(lines, start=1):
            inside = any(a <= i <= b for a, b in spans)
            owner = next((r for r in regions.get(rel, (None, []))[1] if r.begin < i < r.end), None)
            if owner is not None and owner.exercise in exercise_ids:
                code, _, comment = line.partition("  # ")
                body.update(piece.strip() for piece in (code, comment) if len(piece.strip()) >= 20)
            elif not inside:
                outside.append(line)
    everywhere = "\n".join(outside)
    return {piece for piece in body if piece not in everywhere}


def assert_no_leak(folder, lines):
    assert lines, "nothing to look for"
    for f in files_under(folder):
        try:
            text = (Path(folder) / f).read_text()
        except UnicodeDecodeError:
            continue
        leaked = [line for line in lines if line in text]
        assert not leaked, f"{f} holds {leaked[:3]} from a removed body"


def test_no_line_of_any_removed_body_survives(all_blanked):
    assert_no_leak(all_blanked.path, secret_lines({ex.id for ex in GRADED}))


def test_each_exercise_alone_blanks_exactly_its_functions(alone):
    regions = reference_regions()
    for ex in GRADED:
        folder = alone[ex.id]
        assert json.loads((folder / "handout.json").read_text())["exercises"] == [ex.id]
        mine = set(ex.regions)
        for rel in files_under(folder):
            if rel == "handout.json":
                continue
            if rel in ("README.md", "EXERCISES.md"):  # rewritten for students (test_course_teeth.py)
                continue
            if rel not in regions:  # no marker: the very file
                assert (folder / rel).read_bytes() == (ROOT / rel).read_bytes(), (ex.id, rel)
                continue
            ref, new = functions(ast.parse(regions[rel][0])), functions(ast.parse((folder / rel).read_text()))
            gone = [n for n in ref if any(n.startswith(f"{fn}.") for path, fn in mine if path == rel)]
            assert set(ref) - set(gone) == set(new), (ex.id, rel)  # only functions nested in a stub go
            for name, a in ref.items():
                if name in gone:
                    continue
                b = new[name]
                if (rel, name) not in mine:  # another exercise's or none: the reference's code
                    assert ast.dump(a) == ast.dump(b), (ex.id, rel, name)
                    continue
                assert ast.dump(a.args) == ast.dump(b.args), (ex.id, name)
                assert [ast.dump(d) for d in a.decorator_list] == [ast.dump(d) for d in b.decorator_list]
                assert ast.get_docstring(a) == ast.get_docstring(b) and ast.get_docstring(b), (ex.id, name)
                assert len(b.body) == 2 and isinstance(b.body[1], ast.Raise), (ex.id, name)
                message = b.body[1].exc.args[0].value
                assert message == f"exercise {ex.id}: implement {name} in {rel}, see EXERCISES.md"
        assert_no_leak(folder, secret_lines({ex.id}))


@pytest.mark.parametrize("ex", GRADED, ids=[f"ex{ex.id}" for ex in GRADED])
def test_no_function_in_a_handout_passes_the_exercise_it_blanks(alone, impostors, ex):
    """Every function defined anywhere in the handout of ex alone (the package, the scripts, every test file
    and helper), put in place of each blanked function in turn, fails ex's graded tests (run in process by
    nanospec/course/impostors.py). Exercise 4's tests once carried a complete exercise 3; that copy now stays out."""
    assert impostors(str(alone[ex.id]), ex.id) == set()


def test_the_impostor_search_finds_an_answer_that_is_there(alone, impostors):
    """Power: the handout of exercise 4 keeps exercise 3 (verify.py's own and tests/reference_ex03.py); the
    search finds both when asked about exercise 3."""
    found = {(rel, fn) for rel, fn, _ in impostors(str(alone[4]), 3)}
    assert {("nanospec/rules/verify.py", "accept_prob"), ("tests/reference_ex03.py", "slow_accept_prob"),
            ("nanospec/rules/verify.py", "residual"), ("tests/reference_ex03.py", "slow_residual")} <= found, found


def test_what_needs_no_exercise_still_runs_in_the_handout(all_blanked):
    """With every exercise blanked: the package, decode.py, train_tiny.py and the bench import; `ar` decodes
    (exactly the slow loop's tokens); `decode.py --method list` lists the methods."""
    code = """
import torch, decode, train_tiny, nanospec.bench
from nanospec.model.gpt import GPT, GPTConfig
from nanospec.model.load import Models
from nanospec.decoding import METHODS
from nanospec.decoding.ar import generate_nocache
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=11, block_size=32, n_layer=1, n_head=2, n_embd=8, n_future=1)).eval()
ids, stats = METHODS["ar"](Models(target=model), [1, 2, 3], 6)
assert ids == generate_nocache(model, [1, 2, 3], 6) and stats["new_tokens"] == 6
decode.main(["--method", "list"])
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=all_blanked.path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == 0, run.stderr
    assert "medusa" in run.stdout and "parallelspec" in run.stdout


def test_a_handout_is_not_a_source_for_another(all_blanked, tmp_path):
    with pytest.raises(HandoutError, match="itself a handout"):
        make_handout(all_blanked.path, tmp_path / "again", list(EXERCISES))


# ---------------------------------------------------------------------------------------------------------
# The autograder's rules, on a literal report


REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_ex01_prompt_lookup" name="test_a"><properties><property name="exercise" value="1"/></properties></testcase>
<testcase classname="tests.test_ex01_prompt_lookup" name="test_b"><properties><property name="exercise" value="1"/></properties><failure message="AssertionError: assert [9] == [9, 4]">...</failure></testcase>
<testcase classname="" name="tests.test_ex02_greedy_chain"><error message="collection failure">tests/test_ex02_greedy_chain.py:10: in &lt;module&gt;
    from nanospec.rules.verify import verify_chain_greedy
E     File "/course/nanospec/rules/verify.py", line 76
E       def accept_prob(p, q, x)
E                               ^
E   SyntaxError: expected ':'</error></testcase>
<testcase classname="tests.test_ex03_accept_residual" name="test_c"><properties><property name="exercise" value="3"/></properties></testcase>
</testsuite></testsuites>"""


def test_the_autograder_rules_on_a_literal_report(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(REPORT)
    cases = grade.read_junit(path)
    assert [(c.file, c.name, c.exercise, c.outcome) for c in cases] == [
        ("tests/test_ex01_prompt_lookup.py", "test_a", 1, "passed"),
        ("tests/test_ex01_prompt_lookup.py", "test_b", 1, "failed"),
        ("tests/test_ex02_greedy_chain.py", "tests.test_ex02_greedy_chain", None, "error"),
        ("tests/test_ex03_accept_residual.py", "test_c", 3, "passed")]
    ex1, ex2, ex3 = parse_selection("1-3")
    ex1 = replace(ex1, tests=2, gates=())  # an exercise 1 of two tests, none of them a gate (see test_course_teeth.py)
    r1, r2, r3 = grade.score([ex1, ex2, ex3], cases, root="/course")
    # partial credit: 1 of 2 tests passed -> half the points, and the failure is shown
    assert (r1.passed, r1.score, r1.status) == (1, ex1.points / 2, "ok")
    assert "failed: assert [9] == [9, 4]" in r1.notes[0] and "test_b" in r1.notes[0]
    # a test file that does not import: 0 points, the error shown
    assert (r2.score, r2.status) == (0, "not collected")
    assert r2.notes == ["tests/test_ex02_greedy_chain.py could not be imported: nanospec/rules/verify.py, line 76: "
                        "SyntaxError: expected ':'"]
    # 1 test ran where the registry expects more: an error, never points
    assert (r3.score, r3.status) == (0, "registry mismatch") and f"expects {ex3.tests}" in r3.notes[0]
    results = grade.gradescope([r1, r2, r3], "the table", 1.0)
    assert results["score"] == ex1.points / 2 and results["output"] == "the table"
    assert [(t["score"], t["max_score"]) for t in results["tests"]] == [(ex1.points / 2, ex1.points),
                                                                        (0, ex2.points), (0, ex3.points)]


def test_the_autograder_exits_2_when_the_registry_and_the_tests_disagree(tmp_path, monkeypatch):
    ex = parse_selection("1")[0]
    wrong = replace(ex, tests=ex.tests + 1)
    monkeypatch.setattr(grade, "grade", lambda root, exercises, junit, timeout: grade.score(
        [wrong], [grade.Case(ex.test_file, f"t{i}", ex.id, "passed") for i in range(ex.tests)]))
    with pytest.raises(SystemExit) as stop:
        grade.main(["--ex", "1", "--json", str(tmp_path / "r.json")])
    assert stop.value.code == 2


# ---------------------------------------------------------------------------------------------------------
# The generator's errors


def marked(body):
    return f'def f(x):\n    """Doc."""\n{body}'


@pytest.mark.parametrize("source, message", [
    (marked("    # BEGIN SOLUTION ex1\n    y = x\n    return y\n"), "never closed"),
    (marked("    y = x\n    # END SOLUTION ex1\n    return y\n"), "without a BEGIN"),
    (marked("    # BEGIN SOLUTION ex1\n    y = x\n    # END SOLUTION ex2\n"), "does not close"),
    (marked("    # BEGIN SOLUTION ex1\n    y = [x,\n    # END SOLUTION ex1\n         x]\n"), "cuts statement"),
    (marked("    # BEGIN SOLUTION ex1\n    # END SOLUTION ex1\n    return x\n"), "holds no statement"),
    (marked("    # begin solution ex1\n    return x\n"), "malformed marker"),
    (marked("    return x  # BEGIN SOLUTION ex1\n"), "alone on its line"),
    ("# BEGIN SOLUTION ex1\nx = 1\n# END SOLUTION ex1\n", "inside one function"),
    ('def f(x):\n    # BEGIN SOLUTION ex1\n    """Doc."""\n    return x\n    # END SOLUTION ex1\n',
     "after its docstring"),
])
def test_malformed_markers_are_one_line_errors(source, message):
    with pytest.raises(HandoutError, match=message):
        find_regions(source, "f.py")


def test_a_registered_function_without_its_markers_is_an_error(tmp_path):
    regions = [r for text, rs in reference_regions().values() for r in rs]
    handout.check_registry(regions)  # the real source: every registered function marked once
    with pytest.raises(HandoutError, match="has no '# BEGIN SOLUTION ex1' region"):
        handout.check_registry([r for r in regions if r.exercise != 1])
    with pytest.raises(HandoutError, match="which the registry does not list"):
        handout.check_registry(regions + [handout.Region("nanospec/x.py", "g", 1, 1, 3, "    ")])


def test_exercises_md_agrees_with_the_registry():
    """EXERCISES.md's table and headings name every exercise as the registry does, with its tests and points, at
    the registry's version; prerequisites come earlier in the course."""
    text = (ROOT / "EXERCISES.md").read_text()
    assert f"Course version **{VERSION}**" in text and f"- **{VERSION}** (" in text
    rows = {int(m.group(1)): m.groups()[1:] for m in re.finditer(
        r"^\| (\d+) \| (.+?) \| .+? \| (\d+|by hand) \| (\d+) \|$", text, re.MULTILINE)}
    for ex in EXERCISES:
        assert rows[ex.id] == (ex.title, "by hand" if ex.manual else str(ex.tests), str(ex.points)), ex.id
        assert f"\n## {ex.id}. {ex.title}\n" in text, ex.id
        assert all(0 < p < ex.id for p in ex.prerequisites), ex.id
        for path, function in ex.regions:
            assert f"`{function.split('.')[-1]}" in text and path in text, (ex.id, function)
    assert len(rows) == len(EXERCISES) and 8 <= len(EXERCISES) <= 14


def test_exercise_selection():
    assert [ex.id for ex in parse_selection("3,4")] == [3, 4]
    assert [ex.id for ex in parse_selection("1-3,7")] == [1, 2, 3, 7]
    assert len(parse_selection("all")) == len(EXERCISES)
    for bad, message in [("15", "no exercise 15"), ("three", "bad exercise list"), ("3-1", "low to high, 1-3")]:
        with pytest.raises(ValueError, match=message):
            parse_selection(bad)
