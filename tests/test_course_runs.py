"""
The course grades what runs: every function a student writes (a registry `region`) is called when the methods
that need it decode, on the eager and on the static runtime (nanospec/fast/runtime.py). A graded exercise whose
function no method calls would teach a rule the project does not use; EXERCISES.md's "Which methods run" table
promises these calls. Instructor-only: handouts leave this file out (tests/test_course*.py).

How a call is seen: each exercise function's code is swapped for a trampoline that counts the call and runs
the original (`counting`), so a call counts wherever the caller found the function (`from nanospec.rules.verify
import verify_chain_greedy` in verify_step.py, `cache.rollback(...)` on a KVCache, `expand` looked up in
eagle_tree.py). Then one seeded generation per run below, on each runtime, must have called every function the run
names, e.g.

    speculative, t=1, static  -> verify_chain (exercise 4), accept_prob and residual (3), rollback (5)
    eagle, greedy, eager      -> grow_tree, expand, frontier_mask (9), tree_mask, tree_positions (6), ...

and it must call no exercise that its row of EXERCISES.md's table leaves out (a student who follows the table
would meet that exercise's NotImplementedError).

Negative control: a method that checks its guesses with a rule of its own (verify_step.py's
`verify_chain_greedy` swapped for a function that gives the same answers) decodes the same tokens, and the test
sees that exercise 2 was not called.
"""
import re
import types
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from nanospec.course.registry import EXERCISES
from nanospec.decoding import METHODS
from nanospec.steps import verify_step
from nanospec.fast.runtime import prepare
from nanospec.course.impostors import reference_function as region_function
from toys import every_part, random_ids

NEW_TOKENS = 12
HOOK = "__course_runs_calls__"  # the module global the trampolines call through
EXERCISE_OF = {fn: (ex.id, path) for ex in EXERCISES for path, fn in ex.regions}  # "KVCache.rollback" -> (5, ...)

# What the runs share: the verify step of a chain (exercise 2 greedy; 4 and 3 when sampling) and of a tree
# (exercise 6's mask and positions, 8's walk, 5's compaction; at t=1 drawn children are judged by traversal, or by
# 13 and 3 with --verify token).
CHAIN = ("verify_chain_greedy", "KVCache.rollback")
CHAIN_SAMPLED = ("verify_chain", "accept_prob", "residual", "KVCache.rollback")
TREE = ("tree_mask", "tree_positions", "_descend", "KVCache.compact")
DRAWN_TREE = ("tree_mask", "tree_positions", "tree_from_paths", "KVCache.compact")  # judged by traversal (default)
DRAWN_TREE_TOKEN = DRAWN_TREE + ("without_replacement_proposals", "accept_prob", "residual")  # --verify token
EAGLE = ("grow_tree", "expand", "frontier_mask", "KVCache.rollback")  # the head's cache goes back after growing
LOOKAHEAD = ("remember", "learn", "build_tree")
MEDUSA_TOPK = ("tree_from_paths", "medusa_tree")
PSPEC = ("group_layout",)
BLOCK = ("block_acceptance", "KVCache.rollback")  # the drafter's forward lays out its masks with exercise 11's function, every pass

# run name -> (method, temperature, options, the exercise functions it must call)
RUNS = {
    "prompt-lookup": ("prompt-lookup", 0.0, {}, ("lookup",) + CHAIN),
    "jacobi": ("jacobi", 0.0, {}, CHAIN),
    "speculative": ("speculative", 0.0, {}, CHAIN),
    "mtp": ("mtp", 0.0, {}, CHAIN),
    "early-exit": ("early-exit", 0.0, {}, CHAIN),
    "parallelspec-chain": ("parallelspec", 0.0, {"tree": "chain"}, PSPEC + CHAIN),
    "medusa": ("medusa", 0.0, {}, MEDUSA_TOPK + TREE),
    "eagle": ("eagle", 0.0, {}, CHAIN),  # a chain, the default
    "eagle-tree": ("eagle", 0.0, {"tree": "dynamic"}, EAGLE + TREE),
    "lookahead": ("lookahead", 0.0, {}, LOOKAHEAD + TREE),
    "parallelspec": ("parallelspec", 0.0, {}, PSPEC + MEDUSA_TOPK + TREE),
    "prompt-lookup-t1": ("prompt-lookup", 1.0, {}, ("lookup",) + CHAIN_SAMPLED),
    "jacobi-t1": ("jacobi", 1.0, {}, CHAIN_SAMPLED),
    "speculative-t1": ("speculative", 1.0, {}, CHAIN_SAMPLED),
    "mtp-t1": ("mtp", 1.0, {}, CHAIN),  # coupled, the default: greedy's rule on each race's winners
    "mtp-sample-t1": ("mtp", 1.0, {"draft_sampling": "sample"}, CHAIN_SAMPLED),
    "mtp-topk-t1": ("mtp", 1.0, {"draft_sampling": "topk"}, CHAIN_SAMPLED),
    "early-exit-t1": ("early-exit", 1.0, {}, CHAIN_SAMPLED),
    "parallelspec-chain-t1": ("parallelspec", 1.0, {"tree": "chain"}, PSPEC + CHAIN_SAMPLED),
    "parallelspec-chain-topk-t1": ("parallelspec", 1.0, {"tree": "chain", "draft_sampling": "topk"},
                                   PSPEC + CHAIN_SAMPLED),
    "medusa-t1": ("medusa", 1.0, {}, DRAWN_TREE),
    "medusa-topk-t1": ("medusa", 1.0, {"draft_sampling": "topk"}, MEDUSA_TOPK + TREE),
    "eagle-t1": ("eagle", 1.0, {}, CHAIN_SAMPLED),
    "eagle-tree-t1": ("eagle", 1.0, {"tree": "dynamic"}, ("frontier_mask", "KVCache.rollback") + DRAWN_TREE),
    "eagle-topk-t1": ("eagle", 1.0, {"tree": "dynamic", "draft_sampling": "topk"}, EAGLE + TREE),
    "lookahead-t1": ("lookahead", 1.0, {}, LOOKAHEAD + TREE),
    "parallelspec-t1": ("parallelspec", 1.0, {}, PSPEC + DRAWN_TREE),
    "parallelspec-topk-t1": ("parallelspec", 1.0, {"draft_sampling": "topk"}, PSPEC + MEDUSA_TOPK + TREE),
    # --verify token: a drawn tree is judged from the root down by exercises 13 and 3 in place of traversal's walk
    "medusa-token-t1": ("medusa", 1.0, {"verify": "token"}, DRAWN_TREE_TOKEN),
    "eagle-token-t1": ("eagle", 1.0, {"tree": "dynamic", "verify": "token"},
                       ("frontier_mask", "KVCache.rollback") + DRAWN_TREE_TOKEN),
    "parallelspec-token-t1": ("parallelspec", 1.0, {"verify": "token"}, PSPEC + DRAWN_TREE_TOKEN),
    # --verify block: a chain drafted from a q is judged by exercise 14 in place of 4 (greedy: still exercise 2)
    "speculative-block-t1": ("speculative", 1.0, {"verify": "block"}, BLOCK),
    "mtp-block-t1": ("mtp", 1.0, {"verify": "block", "draft_sampling": "sample"}, BLOCK),
    "early-exit-block-t1": ("early-exit", 1.0, {"verify": "block"}, BLOCK),
    "parallelspec-chain-block-t1": ("parallelspec", 1.0, {"tree": "chain", "verify": "block"}, PSPEC + BLOCK),
    "eagle-block-t1": ("eagle", 1.0, {"verify": "block"}, BLOCK),
}


def table():
    """EXERCISES.md's "Which methods run" table: {"speculative": ({2, 5}, {3, 4, 5}), ...}, the exercises a method
    needs greedy and at temperature 1; "parallelspec --tree chain" and "eagle --tree dynamic" have their own rows."""
    text = (Path(__file__).resolve().parents[1] / "EXERCISES.md").read_text()
    rows = {}
    for cells in re.findall(r"^\| (`.+?) \| (.+?) \| (.+?) \|$", text, re.MULTILINE):
        needs = tuple({int(n) for n in re.findall(r"\d+", cell)} for cell in cells[1:])
        rows.update((name, needs) for name in re.findall(r"`([^`]+)`", cells[0]))
    return rows


@contextmanager
def counting(qualnames):
    """Count every call of each function named (registry regions), wherever it is called from: its code becomes
    `return <module>.__course_runs_calls__[name](*args, **kwargs)`, which counts and runs a copy of the original.
    Yields the Counter {name: calls}."""
    calls, saved = Counter(), []
    try:
        for name in qualnames:
            module, fn = region_function(EXERCISE_OF[name][1], name)
            original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            original.__kwdefaults__ = fn.__kwdefaults__

            def counted(*args, _name=name, _original=original, **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)

            module.__dict__.setdefault(HOOK, {})[name] = counted
            namespace = {}
            exec(f"def trampoline(*args, **kwargs):\n    return {HOOK}[{name!r}](*args, **kwargs)\n", namespace)
            saved.append((module, fn, fn.__code__))
            fn.__code__ = namespace["trampoline"].__code__
        yield calls
    finally:
        for module, fn, code in reversed(saved):
            fn.__code__ = code
            module.__dict__.pop(HOOK, None)


@pytest.fixture(scope="module")
def runtimes():
    models = every_part()
    static, path = prepare(models, "static")
    assert path == "static" and static.target is not models.target  # the target really is wrapped
    return {"eager": prepare(models, "eager")[0], "static": static}


def generate(models, run):
    """One seeded generation of a run -> (tokens, calls of every exercise function)."""
    method, temperature, options, _ = RUNS[run]
    with counting(EXERCISE_OF) as calls:
        ids, _ = METHODS[method](models, random_ids(8, seed=1), NEW_TOKENS, temperature=temperature, seed=0,
                                 **options)
    assert len(ids) == NEW_TOKENS
    return ids, calls


def test_every_exercise_function_is_called_by_some_run():
    """RUNS against the registry: every function a student writes is named by a run, and only those; every
    method but ar runs, and EXERCISES.md's table has a row for each."""
    assert len(EXERCISE_OF) == sum(len(ex.regions) for ex in EXERCISES)  # each function's name says which
    named = {fn for *_, functions in RUNS.values() for fn in functions}
    assert named == set(EXERCISE_OF), (set(EXERCISE_OF) - named, named - set(EXERCISE_OF))
    assert {method for method, *_ in RUNS.values()} == set(METHODS) - {"ar"}
    assert set(METHODS) <= set(table()) and table()["speculative"] == ({2, 5}, {3, 4, 5})


@pytest.mark.parametrize("runtime", ["eager", "static"])
@pytest.mark.parametrize("run", list(RUNS))
def test_the_method_calls_its_exercises(runtimes, runtime, run):
    method, temperature, options, functions = RUNS[run]
    _, calls = generate(runtimes[runtime], run)
    missing = [f"{fn} (exercise {EXERCISE_OF[fn][0]}, {EXERCISE_OF[fn][1]})" for fn in functions if not calls[fn]]
    setting = " ".join([method, *(f"--{k.replace('_', '-')} {v}" for k, v in options.items()),
                        "greedy" if temperature == 0 else f"at temperature {temperature}"])
    assert not missing, f"{setting} on the {runtime} runtime never called {', '.join(missing)}"
    if not {"draft_sampling", "verify"} & set(options):  # the table's rows are the default options (the rest: prose)
        row = table()[method + (f" --tree {options['tree']}" if "tree" in options else "")][temperature > 0]
        called = {EXERCISE_OF[fn][0] for fn in calls if calls[fn]}
        assert called <= row, f"{setting} calls exercises {sorted(called - row)}, which EXERCISES.md does not name"


def test_the_trampolines_count_and_change_nothing(runtimes):
    """The counting is invisible: tokens as without it, every function back in place after the block."""
    from nanospec.rules.verify import verify_chain_greedy
    code = verify_chain_greedy.__code__
    for run in ("speculative", "eagle-t1"):
        method, temperature, options, _ = RUNS[run]
        plain, _ = METHODS[method](runtimes["eager"], random_ids(8, seed=1), NEW_TOKENS, temperature=temperature,
                                   seed=0, **options)
        assert generate(runtimes["eager"], run)[0] == plain
    assert verify_chain_greedy.__code__ is code
    assert verify_chain_greedy(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), [1]) == (1, 0)


def test_a_method_with_a_rule_of_its_own_is_caught(runtimes, monkeypatch):
    """Negative control: verify_step.py checks greedy chains with its own copy of exercise 2's rule. The tokens
    stay right (it is the same rule), and only the count says that exercise 2 no longer runs."""
    def own_rule(logits, drafts):  # the same answers, not the student's function
        best = logits.argmax(-1).tolist()
        n = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
        return n, best[n]
    expected, calls = generate(runtimes["eager"], "speculative")
    assert calls["verify_chain_greedy"] > 0
    monkeypatch.setattr(verify_step, "verify_chain_greedy", own_rule)
    ids, calls = generate(runtimes["eager"], "speculative")
    assert ids == expected and calls["verify_chain_greedy"] == 0 and calls["KVCache.rollback"] > 0
