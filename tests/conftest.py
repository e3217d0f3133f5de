"""Shared test settings. Tiny models gain nothing from several threads, and on a shared 2-core machine extra
threads only fight each other: one thread per test process.

The course's graded tests carry one marker per exercise (`ex1` .. `ex14`), registered here from the one
registry, nanospec/course/registry.py; pytest runs with --strict-markers, so a misspelt marker is an error.
Each graded test also records its exercise in the JUnit XML that the autograder reads. `toy_run`: the toy
checkpoints the bench's and gpu-check's tests share, trained once."""
import pytest
import torch

from nanospec import verify
from nanospec.course.registry import EXERCISES

torch.set_num_threads(1)


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
    """One toy run folder for the whole session (test_bench.train_toy: the tokenizer, the target and every drafter,
    5 steps each): the tests that bench or check it only read it; one that damages a part copies it first."""
    from test_bench import train_toy
    return train_toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture
def exercise_3_stand_ins(monkeypatch):
    """Grade an exercise that builds on exercise 3 (4 and 13) alone: the course's own accept_prob and residual
    (tests/reference_ex03.py) replace nanospec/verify.py's. A handout that blanks exercise 3 leaves that file
    out (it is the answer): there your own exercise 3 is used."""
    try:
        from reference_ex03 import slow_accept_prob, slow_residual
    except ImportError:
        return
    monkeypatch.setattr(verify, "accept_prob", slow_accept_prob)
    monkeypatch.setattr(verify, "residual", slow_residual)
