"""Tensor operations per target forward outside the model calls, counted for every method: each aten op the host
runs between forwards (warping, drawing, the verify rules, building trees) is, on a GPU, a kernel launch that
costs the host some microseconds, as much as a tiny model's kernel itself. A temperature-1 step follows the same
rule as a greedy one with other laws (docs: "a sampled step is not a slower greedy step"), so it should cost the
same order of operations; the bench reports the counts (nanospec/bench/timing.py holds the counter, nanospec/bench/compare.py
counts one untimed run per row), and this file holds each method to a bound.

The counter (timing.counting_ops) watches every aten op while one generation runs (48 new tokens, tiny random
models with every part, each method with its default options), leaves out those made inside a model call (the
Timed wrapper's ledger.depth > 0), divides by the target forwards and prints the table (`pytest -s`): all ops,
and in brackets those that launch work on a GPU. Eager and static (runtime.prepare) run the same code outside
the models, so they count exactly alike."""
import pytest
import torch

from nanospec.rules import verify
from nanospec.decoding import METHODS
from nanospec.steps.run import Run
from nanospec.bench.timing import Ledger, Timed, counting_ops, timed_models
from nanospec.fast.runtime import prepare
from toys import every_part, random_ids

SAMPLINGS = {"greedy": 0.0, "t=1": 1.0}
NEW_TOKENS = 48
SLACK = 60  # issue 39: at t=1 at most twice the greedy count + 60 ops per target forward


@pytest.fixture(scope="module")
def models():
    return every_part()


def count(models, method, temperature, **options):
    """The counter of one seeded generation of NEW_TOKENS (ops.total, ops.launches, ops.ops by name) and its
    target forwards, with the models wrapped as the bench wraps them. The tree rules' index tables are built
    once per tree shape (verify.tree_tables): emptied first, every run builds its own."""
    verify.tree_tables.cache_clear()
    ledger = Ledger()
    timed = timed_models(models, ledger)
    with counting_ops(ledger) as ops:
        ids, stats = METHODS[method](timed, random_ids(8, seed=1), NEW_TOKENS, temperature=temperature, seed=0,
                                     **options)
    assert len(ids) == NEW_TOKENS
    return ops, stats["target_forwards"]


@pytest.fixture(scope="module")
def per_forward(models):
    """{method: {sampling: (ops, launches) per target forward}}, eager; each run also on the static path of
    fresh models, whose ops must be the eager run's, op for op (fresh: the static path pools its KV caches per
    model, so once warm it makes none, where eager makes a new one, two `zeros`, every generation)."""
    table = {}
    for method in METHODS:
        table[method] = {}
        for s, t in SAMPLINGS.items():
            ops, forwards = count(models, method, t)
            static, _ = count(prepare(every_part(), "static")[0], method, t)
            assert static.ops == ops.ops, f"{method} {s}: the static path counts {static.ops - ops.ops} more, " \
                                          f"{ops.ops - static.ops} fewer"
            table[method][s] = (ops.total / forwards, ops.launches / forwards)
    return table


def test_the_counter_counts_outside_the_models_only():
    """A literal example: views and a `.to` that changes nothing are ops that launch nothing; a model call's ops
    are the model's."""
    ledger = Ledger()
    model = Timed(lambda x: (x * 2).sum(), ledger, "drafting")  # a model call: two ops, inside
    with torch.inference_mode():
        x = torch.tensor([1.0, 2.0, 3.0])
        with counting_ops(ledger) as ops:
            y = x[1:]  # slice: a view
            z = y + 1  # add
            y.add_(1)  # add_: writes x's memory
            x.reshape(3, 1), x.to(torch.float32)  # a view, and a .to that returns x itself
            x.to(torch.float64)  # a copy
            float(z.sum())  # sum, then item: a copy to the host
            model(x)
    assert ops.ops == {"aten.slice.Tensor": 1, "aten.add.Tensor": 1, "aten.add_.Tensor": 1,
                       "aten.reshape.default": 1, "aten.to.dtype": 2, "aten.sum.default": 1, "aten.item.default": 1}
    assert (ops.total, ops.launches) == (8, 5)  # add, add_, the float64 copy, sum, item
    assert ledger.totals()["passes"] == 1 and ledger.depth == 0


def test_an_op_outside_the_model_counts_and_one_inside_does_not(monkeypatch):
    """Negative controls on `ar`: one more op per token outside the model adds exactly one per forward; three
    more inside the target's forward (a hook) add none, though without the Timed wrapper they count."""
    models = every_part()  # its own: the hook below stays on the target
    ops, forwards = count(models, "ar", 1.0)
    sample = Run.sample
    monkeypatch.setattr(Run, "sample", lambda run, logits: sample(run, logits + 0))  # + 0: one add, outside
    plus_one, _ = count(models, "ar", 1.0)
    assert plus_one.total == ops.total + forwards and plus_one.ops["aten.add.Tensor"] == ops.ops["aten.add.Tensor"] \
        + forwards
    monkeypatch.undo()
    hooked = []
    models.target.register_forward_hook(lambda module, args, out: hooked.append(out.logits.exp().sum().neg()))
    inside, _ = count(models, "ar", 1.0)
    assert len(hooked) == forwards and inside.ops == ops.ops
    with counting_ops(Ledger()) as bare:  # not wrapped: the ledger never sees a model call, so all of it counts
        METHODS["ar"](models, random_ids(8, seed=1), NEW_TOKENS, temperature=1.0, seed=0)
    assert bare.ops["aten.exp.default"] == forwards and bare.total > 5 * ops.total


def test_ops_per_target_forward_table(per_forward):
    """The table (pytest -s): every method counted the same on eager and static (the fixture checks it)."""
    print(f"\naten ops outside the models per target forward (kernel launches on a GPU in brackets), "
          f"{NEW_TOKENS} new tokens, tiny random models (eager = static)\n{'method':15s}"
          + "".join(f"{s:>18s}" for s in SAMPLINGS) + f"{'bound at t=1':>14s}")
    for method, by in per_forward.items():
        print(f"{method:15s}" + "".join(f"{by[s][0]:9.1f} ({by[s][1]:5.1f})" for s in SAMPLINGS)
              + f"{2 * by['greedy'][0] + SLACK:14.1f}")
    assert all(0 < launches <= ops for by in per_forward.values() for ops, launches in by.values())


@pytest.mark.parametrize("method", METHODS)
def test_a_sampled_step_costs_the_order_of_a_greedy_one(per_forward, method):
    greedy, sampled = per_forward[method]["greedy"][0], per_forward[method]["t=1"][0]
    assert sampled <= 2 * greedy + SLACK, f"{method}: {sampled:.1f} ops per forward at t=1, greedy {greedy:.1f}"
