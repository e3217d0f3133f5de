"""Shared test settings. Tiny models gain nothing from several threads, and on a shared 2-core machine extra
threads only fight each other: one thread per test process.

The course's graded tests carry one marker per exercise (`ex1` .. `ex14`), registered here from the one
registry, nanospec/course/registry.py; pytest runs with --strict-markers, so a misspelt marker is an error.
Each graded test also records its exercise in the JUnit XML that the autograder reads.

The fixtures several test files share: `toy_run` (and `toy_out`, the same folder), the toy checkpoints the
bench's and gpu-check's tests share, trained once; `ckpt`, a tiny run folder decode.py reads; `fresh_imports`:
what a fresh interpreter imports to decode. The helpers the tests import live in tests/toys.py (the models and
run folders) and tests/laws.py (the laws and their statistics); no test file imports another."""
import json
import os
import subprocess
import sys

import pytest
import torch

from nanospec.rules import verify
from nanospec.course.registry import EXERCISES

torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation (a forward can be 10x slower)
pytest.register_assert_rewrite("laws", "toys")  # their asserts explain a failure as a test file's do


def pytest_configure(config):
    for ex in EXERCISES:
        config.addinivalue_line("markers", f"{ex.marker}: graded test of exercise {ex.id}, {ex.title}")


def pytest_collection_modifyitems(items):
    exercise_of = {ex.marker: ex.id for ex in EXERCISES}
    for item in items:
        ids = {exercise_of[m.name] for m in item.iter_markers() if m.name in exercise_of}
        item.user_properties += [("exercise", i) for i in sorted(ids)]


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    """One toy run folder for the whole session (toys.train_toy: the tokenizer, the target and every drafter,
    5 steps each): the tests that bench or check it only read it; one that damages a part copies it first."""
    from toys import train_toy
    return train_toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy_out(toy_run):
    return toy_run  # the bench's tests' name for it


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A run folder decode.py can read (toys.tiny_run_folder): a byte-level tokenizer and a random target with MTP
    heads, context 64; one per test file."""
    from toys import tiny_run_folder
    return tiny_run_folder(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="session")
def fresh_imports(toy_run):
    """The modules a fresh interpreter has loaded (sorted names): after importing every method ("methods"), then
    after `decode.py --method ar` on the toy run ("decode"); and torch's threads before and after decode.main
    ("threads_before", "threads"). One process for test_cli.py's and test_train_inputs.py's checks that the
    methods load no speed layer and decoding no training code, and test_edges_decode.py's that it runs on one
    thread (the variables that set torch's threads are unset there)."""
    script = ("import json, sys, torch, nanospec.decoding, nanospec.decoding.batched; methods = sorted(sys.modules); "
              "before = torch.get_num_threads(); "
              f"import decode; decode.main(['--ckpt', {str(toy_run)!r}, '--method', 'ar', '--prompt', 'def f(', "
              "'--max-new-tokens', '3', '--device', 'cpu']); "
              "print(json.dumps({'methods': methods, 'decode': sorted(sys.modules), 'threads_before': before, "
              "'threads': torch.get_num_threads()}), file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    res = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)),
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stderr.strip().splitlines()[-1])


@pytest.fixture
def exercise_3_stand_ins(monkeypatch):
    """Grade an exercise that builds on exercise 3 (4 and 13) alone: the course's own accept_prob and residual
    (tests/reference_ex03.py) replace nanospec/rules/verify.py's. A handout that blanks exercise 3 leaves that file
    out (it is the answer): there your own exercise 3 is used."""
    try:
        from reference_ex03 import slow_accept_prob, slow_residual
    except ImportError:
        return
    monkeypatch.setattr(verify, "accept_prob", slow_accept_prob)
    monkeypatch.setattr(verify, "residual", slow_residual)
