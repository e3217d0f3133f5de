"""
The impostor search: no function anywhere in a handout passes an exercise in place of the functions it blanks.
Every function defined in the handout's Python files (the package, the scripts, the tests and their helpers),
put in turn in place of each blanked function (the others kept as the reference has them), must fail the
exercise's graded tests: a handout holds no working answer of its exercises, in any form, under any name.

    python -m nanospec.course.impostors JOBS.json FOUND.json

JOBS is [[handout folder, exercise id], ...]; FOUND gets {"folder|id": [[file, function, blanked function], ...]},
the functions that passed (none, for a sound handout). tests/test_course.py runs it over every one-exercise
handout, and for its power asks about exercise 3 in exercise 4's handout, which keeps it: the search must find it.
The candidates are arbitrary functions called with the exercises' arguments, and one that opens an integer as a
file (fd 1!) or exits must not take its caller with it: run it in a process of its own, in a scratch working
folder.

Everything runs in this one process, without pytest's runner: an answer is installed by pointing the reference
function at it (`installed`: its code object is swapped for a one-line call, so every module that imported the
function sees the answer), and the exercise's graded tests are called directly (`run_items`), with their
parametrize cases expanded. tests/test_course_teeth.py runs its gallery of wrong answers the same way. It needs the
full project (the reference functions, the graded tests): instructor-only, handouts leave it out.
"""
import argparse
import ast
import functools
import importlib
import inspect
import itertools
import json
import os
import signal
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

from nanospec.course import grade, handout
from nanospec.course.registry import BY_ID

TESTS = os.path.join(grade.PROJECT, "tests")  # the graded tests and their helpers, imported as pytest imports them
HOOK = "__course_answer__"  # the global name the swapped-in code calls


# ---------------------------------------------------------------------------------------------------------
# Installing an answer in place of a reference function, and running an exercise's tests in this process


def reference_function(path, qualname):
    """The live function object of a registry region: ("nanospec/model/cache.py", "KVCache.rollback") -> function."""
    module = importlib.import_module(path[:-3].replace("/", "."))
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return module, obj


@functools.lru_cache(maxsize=None)
def trampoline_code():
    """The code of `def f(*args, **kwargs): return HOOK(*args, **kwargs)`: HOOK is read from the globals of the
    function that runs it, the reference's module."""
    namespace = {}
    exec(f"def trampoline(*args, **kwargs):\n    return {HOOK}(*args, **kwargs)\n", namespace)
    return namespace["trampoline"].__code__


@contextmanager
def installed(path, qualname, answer):
    """Every call of the reference function runs `answer` instead, for the duration of the block."""
    module, fn = reference_function(path, qualname)
    saved = fn.__code__
    module.__dict__[HOOK] = answer
    fn.__code__ = trampoline_code()
    try:
        yield
    finally:
        fn.__code__ = saved
        module.__dict__.pop(HOOK, None)


@functools.lru_cache(maxsize=None)
def parsed_answer(source):
    return ast.parse(textwrap.dedent(source))


@functools.lru_cache(maxsize=None)
def answer_code(source):
    """source -> (its code, the name of the function it defines): compiled once, run in any module's globals."""
    tree = parsed_answer(source)
    return compile(tree, "<answer>", "exec"), tree.body[-1].name


def compile_answer(path, source, extra_globals=None):
    """A function written as if it stood in `path` (the reference's module): source -> function object."""
    module = importlib.import_module(path[:-3].replace("/", "."))
    namespace = dict(module.__dict__)
    namespace.update(extra_globals or {})
    code, name = answer_code(source)
    exec(code, namespace)
    return namespace[name]


class Timeout(Exception):
    pass


@contextmanager
def time_limit(seconds):
    """A hung answer (an endless loop) fails instead of hanging the suite. Main thread only, as pytest runs."""
    def on_alarm(signum, frame):
        raise Timeout(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@functools.lru_cache(maxsize=None)
def graded_items(ex):
    """[(name with its case id, function, kwargs)] of exercise ex's graded tests, in file order, with their
    parametrize cases expanded (the graded tests use no fixture but an autouse one, handled in run_items).
    The test file is imported from tests/, which pytest and `main` put on sys.path."""
    module = importlib.import_module(Path(ex.test_file).stem)
    items = []
    for name, fn in sorted(((n, f) for n, f in vars(module).items() if n.startswith("test_") and callable(f)),
                           key=lambda nf: nf[1].__code__.co_firstlineno):
        params = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        cases = [("", {})]
        for mark in params:
            names = mark.args[0] if not isinstance(mark.args[0], str) else \
                [a.strip() for a in mark.args[0].split(",")]
            ids = mark.kwargs.get("ids")
            expanded = []
            for i, values in enumerate(mark.args[1]):
                values = values if len(names) > 1 else (values,)
                label = ids[i] if isinstance(ids, (list, tuple)) else ids(values[0]) if callable(ids) else str(i)
                expanded.append((label, dict(zip(names, values))))
            cases = [(f"{a}-{b}".strip("-"), {**ka, **kb}) for (a, ka), (b, kb) in itertools.product(cases, expanded)]
        items += [(f"{name}[{label}]" if label else name, fn, kwargs) for label, kwargs in cases]
    return module, tuple(items)


def run_items(ex, gates_only=False, stop_at_first_failure=False, seconds=20, gates_first=True):
    """Run exercise ex's graded tests here: gates first (cheapest first, in the registry's order), then the
    rest. Returns [grade.Case]; after a failing gate the others are reported 'skipped' (the gate alone decides
    the score). The autouse fixture of exercises 4 and 13 (the course's copy of exercise 3) is applied."""
    module, items = graded_items(ex)
    items = list(items)
    base = lambda name: name.split("[", 1)[0]  # noqa: E731
    order = {g: i for i, g in enumerate(ex.gates)}
    if gates_first:
        items.sort(key=lambda it: order.get(base(it[0]), len(order)))
    cases, stopped = [], False
    mp = pytest.MonkeyPatch()
    try:
        if getattr(module, "slow_accept_prob", None) is not None:
            from nanospec.rules import verify
            mp.setattr(verify, "accept_prob", module.slow_accept_prob)
            mp.setattr(verify, "residual", module.slow_residual)
        for name, fn, kwargs in items:
            if stopped or (gates_only and base(name) not in ex.gates):
                cases.append(grade.Case(ex.test_file, name, ex.id, "skipped", "not run"))
                continue
            try:
                with time_limit(seconds):
                    fn(**kwargs)
                cases.append(grade.Case(ex.test_file, name, ex.id, "passed"))
            except BaseException as e:  # noqa: BLE001 - any failure of an answer (SystemExit too) is a failure
                cases.append(grade.Case(ex.test_file, name, ex.id, "failed", f"{type(e).__name__}: {e}"))
                stopped = stop_at_first_failure or base(name) in ex.gates
    finally:
        mp.undo()
    return cases


# ---------------------------------------------------------------------------------------------------------
# The search: every function of a handout in place of each blanked one

_parsed, _unparsed, _compiled = {}, {}, {}


def handout_functions(folder):
    """[(file, qualified name, function object)] for every function defined anywhere in the handout's Python
    files (nested ones and methods too, decorators dropped), each compiled in its own module's globals where
    that module can be imported here. Files are parsed once per distinct content."""
    found = []
    for path in sorted(Path(folder).rglob("*.py")):
        rel = path.relative_to(folder).as_posix()
        text = path.read_text(encoding="utf-8")
        if text not in _parsed:
            try:
                _parsed[text] = ast.parse(text)
            except SyntaxError:
                _parsed[text] = None
        tree = _parsed[text]
        if tree is None:
            continue
        home = {}
        try:
            stem = rel[:-3].replace("/", ".") if rel.startswith("nanospec/") else Path(rel).stem
            runs = rel.startswith("scripts/") or path.name == "__main__.py"  # a command runs when imported
            home = {} if runs else vars(importlib.import_module(stem))
        except (Exception, pytest.skip.Exception):  # noqa: BLE001 - a script that does not import (or a test
            # module that skips itself when an optional package is missing): its functions see the target's globals
            home = {}
        for qualname, node in handout.functions(tree).items():
            if node.name.startswith("test_") or any("fixture" in ast.unparse(d) for d in node.decorator_list):
                continue  # pytest's own: they take fixtures and return nothing (their text is leak-checked)
            key = (text, qualname)
            if key not in _unparsed:
                decorators, node.decorator_list = node.decorator_list, []
                try:
                    _unparsed[key] = ast.unparse(node)
                finally:
                    node.decorator_list = decorators
            found.append((rel, qualname, _unparsed[key], home))
    return found


def binds(source, n):
    """Whether the function defined by `source` (decorators dropped) can be called with n positional arguments:
    what inspect.signature(function).bind(*range(n)) says of it once compiled, read from its syntax alone."""
    try:
        args = parsed_answer(source).body[-1].args
    except SyntaxError:
        return False
    positional = args.posonlyargs + args.args
    required = len(positional) - len(args.defaults)
    kw_required = sum(d is None for d in args.kw_defaults)
    return required <= n and (n <= len(positional) or args.vararg is not None) and kw_required == 0


def passing_impostors(folder, ex, limit_s=3):
    """[(file, function, region)] of the handout's functions that pass ALL of exercise ex's tests in place of
    one of its blanked functions (the others kept as the reference has them). A function that cannot even be
    called the same way cannot pass: it is passed over before it is compiled."""
    found, functions = [], handout_functions(folder)
    for path, function in ex.regions:
        module, target = reference_function(path, function)
        required = [p for p in inspect.signature(target).parameters.values()
                    if p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
        for rel, qualname, source, home in functions:
            if not binds(source, len(required)):
                continue
            key = (path, rel, qualname, source)
            if key not in _compiled:
                try:
                    _compiled[key] = compile_answer(path, source, home)
                except Exception:  # noqa: BLE001 - a function that cannot be defined here cannot pass
                    _compiled[key] = None
            candidate = _compiled[key]
            try:
                inspect.signature(candidate).bind(*range(len(required)))
            except Exception:  # noqa: BLE001 - cannot even be called the same way: it cannot pass
                continue
            with installed(path, function, candidate), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cases = run_items(ex, stop_at_first_failure=True, seconds=limit_s, gates_first=False)
            if all(c.outcome == "passed" for c in cases):
                found.append((rel, qualname, function))
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description="The impostor search: the functions of each handout that pass an "
                                            "exercise in place of the functions it blanks (none, for a sound handout).")
    p.add_argument("jobs", help="a JSON file: [[handout folder, exercise id], ...]")
    p.add_argument("found", help='where to write {"folder|id": [[file, function, blanked function], ...]}')
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    with open(args.jobs) as f:
        jobs = json.load(f)
    result = {f"{folder}|{ex_id}": [list(x) for x in passing_impostors(folder, BY_ID[ex_id])] for folder, ex_id in jobs}
    with open(args.found, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
