"""Exercise 13 (EXERCISES.md): `without_replacement_proposals` in nanospec/rules/verify.py, the heart of recursive
rejection sampling over children drawn WITHOUT replacement (Jeon et al. 2024, arXiv 2402.14160): the law each
distinct child was drawn from, which `verify_tree_without_replacement` checks it against. Literal rows, then
the law: enumerating every ordered draw of m distinct children (their probabilities are written out below as
exact fractions), the token the node emits must follow p exactly, and a negative control in the same test
shows that the enumeration catches the with-replacement rule applied to distinct children; and trees drawn by
`sample_without_replacement` and verified by `verify_tree_without_replacement` keep the target's law when
sampled. The law tests are gates (nanospec/course/registry.py): if one fails the exercise scores zero.

Exercise 3's `accept_prob` and `residual` are the course's own copy (tests/reference_ex03.py) where it is
shipped, so exercise 13 is graded alone; a handout that blanks exercise 3 uses yours.
Run: python -m pytest -m ex13 -x"""
from fractions import Fraction as Fr

import pytest
import torch

from nanospec.rules import verify
from nanospec.rules.verify import sample_without_replacement, verify_tree_without_replacement, \
    without_replacement_proposals
from laws import empirical_law, tv, tv_bound
from teach import expect, expect_close, expect_law

pytestmark = [pytest.mark.ex13, pytest.mark.usefixtures("exercise_3_stand_ins")]  # tests/conftest.py

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def test_docstring_example():
    got = without_replacement_proposals(t([0.5, 0.3, 0.2]), torch.tensor([0, 2]))
    expect_close(got, [[0.5, 0.3, 0.2], [0.0, 0.6, 0.4]], "without_replacement_proposals(q=[0.5, 0.3, 0.2], "
                                                          "drawn=[0, 2])", atol=1e-15)


def test_nothing_left_is_a_zero_row():
    """q = [0.5, 0.5, 0]: after tokens 0 and 1 nothing is left; that row is all zeros (no NaN, no 0/0)."""
    got = without_replacement_proposals(t([0.5, 0.5, 0.0]), torch.tensor([1, 0, 2]))
    expect_close(got, [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
                 "without_replacement_proposals(q=[0.5, 0.5, 0], drawn=[1, 0, 2])", atol=1e-15)


def test_batched_rows_are_independent():
    """q (2, 2, V), drawn (2, 2, k) -> (2, 2, k, V): each row's draws remove tokens from that row's q only."""
    q = t([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]], [[0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]]])  # (2, 2, 3)
    drawn = torch.tensor([[[2, 0], [1, 2]], [[0, 1], [2, 1]]])  # (2, 2, 2)
    expected = t([[[[0.5, 0.25, 0.25], [2 / 3, 1 / 3, 0.0]], [[0.1, 0.2, 0.7], [0.125, 0.0, 0.875]]],
                  [[[0.2, 0.2, 0.6], [0.0, 0.25, 0.75]], [[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]]]])
    expect_close(without_replacement_proposals(q, drawn), expected,
                 "without_replacement_proposals on q (2, 2, 3) and drawn (2, 2, 2)", atol=1e-12)


# One node, V = 4: q the draft's law there, p the target's. DRAWS[m] = every ordered tuple of m distinct
# children with its exact probability under m draws without replacement from Q (worked out once by hand).
Q = [0.5, 0.25, 0.125, 0.125]
P = [0.1, 0.2, 0.3, 0.4]
DRAWS = {
    1: {(0,): Fr(1, 2), (1,): Fr(1, 4), (2,): Fr(1, 8), (3,): Fr(1, 8)},
    2: {(0, 1): Fr(1, 4), (0, 2): Fr(1, 8), (0, 3): Fr(1, 8), (1, 0): Fr(1, 6), (1, 2): Fr(1, 24),
        (1, 3): Fr(1, 24), (2, 0): Fr(1, 14), (2, 1): Fr(1, 28), (2, 3): Fr(1, 56), (3, 0): Fr(1, 14),
        (3, 1): Fr(1, 28), (3, 2): Fr(1, 56)},
    3: {(0, 1, 2): Fr(1, 8), (0, 1, 3): Fr(1, 8), (0, 2, 1): Fr(1, 12), (0, 2, 3): Fr(1, 24), (0, 3, 1): Fr(1, 12),
        (0, 3, 2): Fr(1, 24), (1, 0, 2): Fr(1, 12), (1, 0, 3): Fr(1, 12), (1, 2, 0): Fr(1, 30),
        (1, 2, 3): Fr(1, 120), (1, 3, 0): Fr(1, 30), (1, 3, 2): Fr(1, 120), (2, 0, 1): Fr(1, 21),
        (2, 0, 3): Fr(1, 42), (2, 1, 0): Fr(1, 35), (2, 1, 3): Fr(1, 140), (2, 3, 0): Fr(1, 84),
        (2, 3, 1): Fr(1, 168), (3, 0, 1): Fr(1, 21), (3, 0, 2): Fr(1, 42), (3, 1, 0): Fr(1, 35),
        (3, 1, 2): Fr(1, 140), (3, 2, 0): Fr(1, 84), (3, 2, 1): Fr(1, 168)},
}


def node_law(p, proposals, xs):
    """The law of the token one node emits when children xs, drawn from `proposals` (one q row each), are tried
    in order from target p (the tree rule's walk, computed exactly instead of drawn):
    child j is accepted with accept_prob(P, q_j, x_j); after a rejection P <- residual(P, q_j); when every child
    is rejected the node emits a sample of P. p (V,), proposals (m, V), xs (m,) -> (V,)."""
    law, reach, P = torch.zeros_like(p), 1.0, p
    for q_j, x_j in zip(proposals, xs):
        a = verify.accept_prob(P, q_j, x_j)
        law[x_j] += reach * a
        reach = reach * (1 - a)
        P = verify.residual(P, q_j)
    return law + reach * P


def enumerated_law(m, proposals_of):
    """Sum over every ordered draw of m distinct children, weighted by its exact probability."""
    law = torch.zeros(4, dtype=F64)
    for xs, prob in DRAWS[m].items():
        law += float(prob) * node_law(t(P), proposals_of(xs), torch.tensor(xs))
    return law


@pytest.mark.parametrize("m", [1, 2, 3], ids=lambda m: f"{m}-children")
def test_the_node_law_is_p_by_enumeration(m):
    """GATE. For every ordered draw of m distinct children: the rows your function gives must be the laws they
    were drawn from (the product of each row at its drawn token is the draw's probability), and the token the
    node emits, averaged over all draws, must follow p exactly."""
    for xs, prob in DRAWS[m].items():
        rows = without_replacement_proposals(t(Q), torch.tensor(xs))  # (m, V)
        expect(tuple(rows.shape) == (m, 4), f"without_replacement_proposals(q={Q}, drawn={list(xs)}): expected "
                                            f"shape ({m}, 4), got {tuple(rows.shape)}")
        chance = rows[torch.arange(m), torch.tensor(xs)].prod().item()
        expect(abs(chance - float(prob)) < 1e-12,
               f"without_replacement_proposals(q={Q}, drawn={list(xs)}) = {rows.tolist()}: the chance of drawing "
               f"{list(xs)} in that order from these rows is {chance:.6f}, but without replacement it is "
               f"{prob} = {float(prob):.6f}")
    law = enumerated_law(m, lambda xs: without_replacement_proposals(t(Q), torch.tensor(xs)))
    expect_close(law, P, f"the law of the token a node emits with {m} distinct children checked against your "
                         f"proposals, over every draw (it must be p)")
    if m > 1:  # the negative control: the same enumeration sees the with-replacement rule's bias
        biased = enumerated_law(m, lambda xs: t(Q).expand(len(xs), 4))
        gap = (biased - t(P)).abs().sum().item() / 2
        expect(gap > 0.01, f"negative control: checking distinct children against q itself should be biased, "
                           f"but its enumerated law {biased.tolist()} is within {gap:.2g} of p")


def test_a_drawn_tree_keeps_the_law_when_sampled():
    """GATE. 40,000 trees over 3 tokens (a bigram target PB and draft QB): 2 children of the root drawn without
    replacement from QB[root], 2 under the first child from QB[its token]; verify_tree_without_replacement
    (which calls your function) picks the path. The first two tokens of the text (the second drawn from the
    target when only one was emitted) must follow the target's bigram law, within tv_bound."""
    B, V, g = 40_000, 3, torch.Generator().manual_seed(0)
    PB = t([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.1, 0.6]])  # PB[prev] = law of the next token
    QB = t([[0.2, 0.7, 0.1], [0.5, 0.1, 0.4], [0.1, 0.5, 0.4]])
    parents = [-1, 0, 0, 1, 1]
    tokens = torch.zeros(B, 5, dtype=torch.long)  # root token 0
    tokens[:, 1:3] = sample_without_replacement(QB[tokens[:, 0]], 2, g)
    tokens[:, 3:5] = sample_without_replacement(QB[tokens[:, 1]], 2, g)
    path, nxt = verify_tree_without_replacement(PB[tokens], QB[tokens], tokens, parents, g)
    rows = torch.arange(B)
    first = torch.where(path[:, 0] >= 0, tokens[rows, path[:, 0].clamp(min=0)], nxt)
    second_in_tree = torch.where(path[:, 1] >= 0, tokens[rows, path[:, 1].clamp(min=0)], nxt)
    completed = torch.multinomial(PB[first], 1, generator=g)[:, 0]  # the next step, when only one was emitted
    second = torch.where(path[:, 0] >= 0, second_in_tree, completed)
    got = empirical_law(first * V + second, V * V)
    exact = (PB[0][:, None] * PB).flatten()  # P(a, b) = PB[0, a] PB[a, b]
    expect_law(tv(got, exact), tv_bound(V * V, B), "the first two tokens after verify_tree_without_replacement "
               "on trees drawn without replacement, against the bigram target's law", got, exact)
