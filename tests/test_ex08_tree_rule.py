"""Exercise 8 (EXERCISES.md): `_descend` in nanospec/rules/verify.py, the walk behind both tree rules that nanospec's
tree methods call: `verify_tree_greedy` (y = the argmax at each node) and `verify_tree_descend` (y drawn from
the target's law at each node). Literal greedy walks (a miss at the root, a full path plus the bonus, a
duplicate sibling), what any walk must satisfy on random trees, and the sampled rule's law: exactly, by
enumerating every draw, and statistically through verify_tree_descend. The law tests and the random-tree
test are gates (nanospec/course/registry.py): if one fails the exercise scores zero.
Run: python -m pytest -m ex8 -x"""
import itertools
import random

import pytest
import torch

from nanospec.rules.verify import _descend, verify_tree_descend, verify_tree_greedy
from laws import empirical_law, tv, tv_bound
from teach import expect, expect_equal, expect_law

pytestmark = pytest.mark.ex8

F64 = torch.float64


def logits_with_argmax(best, V=10):
    logits = torch.zeros(len(best), V, dtype=F64)
    logits[torch.arange(len(best)), torch.tensor(best)] = 1.0
    return logits


@pytest.mark.parametrize("tokens, parents, best, expected", [
    # the docstring's tree: the root's argmax 8 is node 2's token; node 2 has no child holding 7
    ([0, 5, 8, 9], [-1, 0, 0, 1], [8, 1, 7, 4], ([2], 7)),
    # nothing at the root matches: no guess accepted, the target's own token
    ([0, 5, 8, 9], [-1, 0, 0, 1], [3, 9, 7, 4], ([], 3)),
    # a whole root-to-leaf path accepted, then the bonus from the leaf
    ([0, 5, 8, 9], [-1, 0, 0, 1], [5, 9, 7, 4], ([1, 3], 4)),
    # two siblings hold 5: the walk takes the first; the second (whose child would match) is never entered
    ([0, 5, 5, 3], [-1, 0, 0, 2], [5, 7, 3, 1], ([1], 7)),
    # only a root: one plain step
    ([6], [-1], [2], ([], 2)),
], ids=["docstring", "miss-at-root", "full-path-and-bonus", "duplicate-sibling", "root-only"])
def test_greedy_literal(tokens, parents, best, expected):
    got = verify_tree_greedy(logits_with_argmax(best), tokens, parents)
    expect_equal(got, expected, f"verify_tree_greedy (your _descend with pick = argmax) on tokens {tokens}, "
                                f"parents {parents}, argmax after each node {best}, as (path, y)")


def random_tree(n, V, rng):
    return [rng.randrange(V) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)]


def test_greedy_walks_on_random_trees():
    """What the answer must be, stated without the walk: the path runs from a child of the root down, parent
    to child; each node on it holds the target's argmax at its parent and is the FIRST child there holding it;
    the emitted token is the argmax at the path's last node, and no child of that node holds it."""
    rng = random.Random(0)
    for _ in range(300):
        V = rng.randrange(2, 5)  # few tokens: matches and duplicate siblings are common
        tokens, parents = random_tree(rng.randrange(1, 10), V, rng)
        best = [rng.randrange(V) for _ in tokens]
        path, nxt = verify_tree_greedy(logits_with_argmax(best, V), tokens, parents)
        case = f"_descend on tokens {tokens}, parents {parents}, argmax after each node {best} gave {(path, nxt)}"
        expect(isinstance(path, list) and all(type(n) is int for n in path) and type(nxt) is int,
               f"{case}: the path must be a list of Python ints and y an int")
        prev = 0
        for node in path:
            expect(parents[node] == prev and tokens[node] == best[prev],
                   f"{case}: node {node} is not a child of {prev} holding the argmax {best[prev]} there")
            first = min(c for c in range(len(tokens)) if parents[c] == prev and tokens[c] == best[prev])
            expect(node == first, f"{case}: at node {prev} the first child holding {best[prev]} is {first}, not {node}")
            prev = node
        expect(nxt == best[prev], f"{case}: y must be the argmax {best[prev]} at the last entered node {prev}")
        expect(all(tokens[c] != nxt for c in range(len(tokens)) if parents[c] == prev),
               f"{case}: a child of the last node {prev} holds y = {nxt}: the walk stopped too early")


# The sampled rule, on one small tree over 3 tokens: node 0 -> {1: token 0, 2: token 0 (a duplicate),
# 3: token 1}; node 1 -> {4: token 2}. The target's law after each node, rows 0..4:
TOKENS, PARENTS = [2, 0, 0, 1, 2], [-1, 0, 0, 0, 1]
P = torch.tensor([[0.3, 0.5, 0.2], [0.1, 0.1, 0.8], [0.4, 0.4, 0.2], [0.6, 0.2, 0.2], [0.25, 0.25, 0.5]], dtype=F64)
OUTCOMES = [((), 2), ((1,), 0), ((1,), 1), ((1, 4), 0), ((1, 4), 1), ((1, 4), 2), ((3,), 0), ((3,), 1),
            ((3,), 2)]


def point_mass_law():
    """The law the rule must have (Medusa / EAGLE-2's point-mass rule, verify_tree_point_mass): a child is
    entered with its parent's probability of its token (a duplicate sibling: 0), and at the last node the
    emitted token is drawn from p there, never one of its children's tokens."""
    law = {}
    for path, y in OUTCOMES:
        prob, prev = 1.0, 0
        for node in path:
            prob, prev = prob * P[prev, TOKENS[node]].item(), node
        law[(path, y)] = prob * P[prev, y].item()
    return law


def test_sampled_law_by_enumerating_every_draw():
    """GATE. A lossless walk draws ONE y per node it visits (the draw that tests the children is the one it
    emits), so it can be fed one pre-drawn y per node. Enumerating all 3^5 assignments, weighted by their
    probabilities, gives the walk's exact law. A walk that asks pick() twice at a node (a fresh draw after a
    mismatch, one draw per child) is caught here: that is what biases the output."""
    law = {}
    for ys in itertools.product(range(3), repeat=len(TOKENS)):
        weight = 1.0
        for node, y in enumerate(ys):
            weight *= P[node, y].item()
        asked = []

        def pick(node):
            asked.append(node)
            return ys[node]

        path, y = _descend(TOKENS, PARENTS, pick)
        twice = sorted({n for n in asked if asked.count(n) > 1})
        expect(not twice, f"_descend called pick() more than once at node {twice[0] if twice else 0} (calls: "
                          f"{asked}): the y drawn at a node is both the test of its children and, if none holds "
                          f"it, the emitted token; drawing again (after a mismatch, or per child) biases the law")
        key = (tuple(path), y)
        expect(key in point_mass_law(), f"_descend returned {key} with draws {list(ys)} at nodes 0..4, which is "
                                        f"not a (path, y) the rule can produce on tokens {TOKENS}, parents {PARENTS}")
        law[key] = law.get(key, 0.0) + weight
    for key, prob in point_mass_law().items():
        expect(abs(law.get(key, 0.0) - prob) < 1e-12, f"P(path, y = {key}) by enumeration: expected {prob:.6f}, "
                                                        f"got {law.get(key, 0.0):.6f}")


def test_sampled_law_through_verify_tree_descend():
    """8,000 seeded runs of verify_tree_descend; the law of (path, token) within tv_bound of the exact one."""
    g, n = torch.Generator().manual_seed(0), 8_000
    code = {outcome: i for i, outcome in enumerate(OUTCOMES)}
    outcomes = [(tuple(path), y) for path, y in (verify_tree_descend(P, TOKENS, PARENTS, g) for _ in range(n))]
    wrong = [o for o in outcomes if o not in code]
    expect(not wrong, f"verify_tree_descend returned {wrong[0] if wrong else 0}, not a (path, y) the rule can "
                      f"produce on tokens {TOKENS}, parents {PARENTS}")
    draws = torch.tensor([code[o] for o in outcomes])
    law = point_mass_law()
    exact = torch.tensor([law[o] for o in OUTCOMES], dtype=F64)
    got = empirical_law(draws, len(OUTCOMES))
    expect_law(tv(got, exact), tv_bound(len(OUTCOMES), n), "the law of (path, y) from verify_tree_descend (your "
               "_descend with pick = a sample of p at the node)", got, exact)
