"""
The tree rules reproduce the target's law p exactly: the point-mass rule for guesses not drawn (Medusa's top-k
trees, lookahead; nanospec/rules/reference.py's verify_tree_point_mass, and what tree_step runs, verify_tree_descend
and its greedy fast path verify_tree_greedy) and SpecInfer's rule for children drawn i.i.d. from q
(verify_tree_sampled). Typical acceptance (typical_accept) is lossy, and shown to be.

  - exact: one node's law with several guessed or drawn children (duplicates too), enumerated from the
    implementation's own accept_prob and residual, equals p to 1e-9 (hypothesis's pairs, tests/laws.py);
  - statistical: 1e5 whole trees of depth 2 through the real (batched) rules on a bigram target and draft, the
    first 3 tokens jointly (27 outcomes) within `tv_bound`; the descent's law of (last node, next token) on a
    tree with duplicate siblings;
  - negative controls: SpecInfer's rule on a top-k tree, and typical acceptance, exceed the same bound;
  - greedy: one-hot targets give the literal answers for every rule whatever the seed; verify_tree_descend and
    verify_tree_greedy equal verify_tree_point_mass on random trees, ties included; one tree is the batched rule
    with B = 1, and malformed parents are refused.
"""
import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanospec.rules.tree import path_to
from nanospec.rules.verify import (sample, typical_accept, verify_chain, verify_tree_descend, verify_tree_greedy,
                             verify_tree_without_replacement, warp)
from nanospec.rules.reference import verify_tree_point_mass, verify_tree_sampled
from laws import (EXACT, F64, PARENTS_SAMPLED, Q_BIGRAM, SEEDS, V10, build_sampled_tree, dist, empirical_law,
                  greedy_target, node_law, on_host, one_hot, pairs, tree_tv, tv, tv_bound, verify_chain_point_mass)
from toys import random_tree


# ---------------------------------------------------------------------------------------------------------
# Exact laws of one node


@EXACT
@given(pairs(), st.data())
def test_tree_point_mass_node_law_is_p(pq, data):
    """Several guessed children at one node, duplicates allowed: total acceptance = sum of p over the distinct
    children, and the emitted token follows p."""
    p, _ = pq
    V = p.numel()
    xs = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=5))
    law, acceptance = node_law(p, [one_hot(x, V) for x in xs], [torch.tensor(x) for x in xs])
    assert acceptance == pytest.approx(p[sorted(set(xs))].sum().item(), abs=1e-9)
    assert torch.allclose(law, p, rtol=0, atol=1e-9)


@EXACT
@given(pairs(), st.integers(1, 3))
def test_tree_sampled_node_law_is_p(pq, m):
    """m children drawn i.i.d. from q at one node (SpecInfer): averaged over every possible set of children,
    the emitted token follows p."""
    p, q = pq
    V = p.numel()
    children = torch.tensor(list(itertools.product(range(V), repeat=m)))  # (V^m, m) every possible draw
    prob = q[children].prod(-1)  # (V^m,) its probability under q
    P, Q = p.expand(V**m, V), q.expand(V**m, V)
    laws, _ = node_law(P, [Q] * m, children.unbind(-1))  # (V^m, V)
    assert torch.allclose((prob[:, None] * laws).sum(0), p, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# Statistical tests through the real functions: whole trees on bigram toys (tests/laws.py's run_tree)
# Every node's children are proposed from Q_BIGRAM at the node's token. Depth 2.


PARENTS_TOPK = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # 3 guesses per node: top-1, top-2, top-1 again


TOP_GUESSES = Q_BIGRAM.argsort(-1, descending=True)[:, [0, 1, 0]]  # (V, 3) guesses after each token


def build_topk_tree(root, g):
    """root (n,) -> tokens (n, N): a deterministic tree of the draft's top guesses, with a duplicate."""
    tokens = torch.zeros(root.size(0), len(PARENTS_TOPK), dtype=torch.long)
    tokens[:, 0] = root
    for u in range(len(PARENTS_TOPK)):
        children = [c for c, par in enumerate(PARENTS_TOPK) if par == u]
        if children:
            tokens[:, children] = TOP_GUESSES[tokens[:, u]]
    return tokens


def real_tree_sampled(p_target, q_draft, tokens, parents, g):
    return verify_tree_sampled(p_target, q_draft, tokens, parents, g)


def real_tree_point_mass(p_target, q_draft, tokens, parents, g):
    return verify_tree_point_mass(p_target, tokens, parents, g)


def test_tree_sampled_joint_law_sampled():
    distance, bound = tree_tv(real_tree_sampled, build_sampled_tree, PARENTS_SAMPLED)
    assert distance < bound


def test_tree_point_mass_joint_law_sampled():
    distance, bound = tree_tv(real_tree_point_mass, build_topk_tree, PARENTS_TOPK)
    assert distance < bound


def test_tree_point_mass_on_sampled_children_is_also_exact():
    """The point-mass rule does not care how the children were chosen, so random children are fine too."""
    distance, bound = tree_tv(real_tree_point_mass, build_sampled_tree, PARENTS_SAMPLED)
    assert distance < bound


# ---------------------------------------------------------------------------------------------------------
# Negative controls: each changes one thing in a correct rule, and the same statistic must catch it.


def broken_topk_tree_with_draft_q(p_target, q_draft, tokens, parents, g):
    """A deterministic top-k tree verified with min(1, p/q), q = the draft's softmax: the children were not
    samples of q, so the sampled-children rule does not apply."""
    return verify_tree_sampled(p_target, q_draft, tokens, parents, g)


def lossy_typical(p_target, q_draft, tokens, parents, g):
    return typical_accept(p_target, tokens, parents, generator=g)


@pytest.mark.parametrize("broken", [broken_topk_tree_with_draft_q, lossy_typical], ids=lambda f: f.__name__)
def test_tree_negative_controls_fail(broken):
    distance, bound = tree_tv(broken, build_topk_tree, PARENTS_TOPK)
    assert distance > bound, f"{broken.__name__}: TV {distance:.4f} within the bound {bound:.4f}"


# ---------------------------------------------------------------------------------------------------------
# Greedy: one-hot targets give the literal argmax-match answers, whatever the randomness


TREE_TOKENS = [0, 5, 8, 9, 7, 5]


TREE_PARENTS = [-1, 0, 0, 1, 1, 4]  # root -> {5, 8}; 5 -> {9, 7}; 7 -> {5}


@pytest.mark.parametrize(
    "argmaxes, expected",
    [
        ([8, 1, 7, 4, 2, 6], ([2], 7)),  # 5 rejected, 8 accepted (a leaf): emit [8, 7]
        ([5, 7, 0, 0, 5, 6], ([1, 4, 5], 6)),  # 5, 7, 5 accepted to the deepest leaf, bonus 6
        ([5, 3, 0, 0, 0, 0], ([1], 3)),  # 5 accepted, neither 9 nor 7: emit [5, 3]
        ([2, 0, 0, 0, 0, 0], ([], 2)),  # nothing accepted: emit [2]
    ],
)
def test_tree_greedy_literal(argmaxes, expected):
    p = greedy_target(argmaxes)
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        q = torch.softmax(torch.randn(len(TREE_TOKENS), V10, generator=g, dtype=F64), -1)
        assert on_host(verify_tree_point_mass(p, TREE_TOKENS, TREE_PARENTS, g)) == expected
        assert on_host(verify_tree_sampled(p, q, TREE_TOKENS, TREE_PARENTS, g)) == expected
        assert on_host(verify_tree_without_replacement(p, q, TREE_TOKENS, TREE_PARENTS, g)) == expected
        assert on_host(typical_accept(p, TREE_TOKENS, TREE_PARENTS, generator=g)) == expected


# ---------------------------------------------------------------------------------------------------------
# Typical acceptance, literal: deterministic acceptance of any plausible child


def test_typical_accept_literal():
    p_root = dist([0.5, 0.3, 0.2])  # entropy 1.03 nats: threshold min(0.09, 0.3 * e^-1.03 = 0.107) = 0.09
    p_other = dist([0.05, 0.05, 0.9])
    p = torch.stack([p_root, p_other, p_other, p_other])  # (4, 3) next-token distribution after each node
    g = torch.Generator().manual_seed(0)
    # 0.2 > 0.09: token 2 is always accepted, where p would give it 20%
    assert on_host(typical_accept(p[:2], [0, 2], [-1, 0], generator=g))[0] == [1]
    # two accepted children at the same depth: the higher log p wins (token 0, p = 0.5, over token 2)
    assert on_host(typical_accept(p[:3], [0, 2, 0], [-1, 0, 0], generator=g))[0] == [2]
    # a longer accepted path beats a more probable short one: root -> 2 -> 2 over root -> 0
    assert on_host(typical_accept(p, [0, 0, 2, 2], [-1, 0, 0, 2], generator=g))[0] == [2, 3]


# ---------------------------------------------------------------------------------------------------------
# One chain or tree is the B = 1 case of the same rule (leading dimensions)


@pytest.mark.parametrize("seed", range(5))
def test_per_step_matches_batched(seed):
    g = torch.Generator().manual_seed(100 + seed)
    V, k = 5, 3
    p = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=F64), -1)
    q = torch.softmax(torch.randn(k, V, generator=g, dtype=F64), -1)
    x = sample(q, g)
    tokens = torch.randint(V, (len(TREE_PARENTS),), generator=g)
    pt = torch.softmax(torch.randn(len(TREE_PARENTS), V, generator=g, dtype=F64), -1)
    qt = torch.softmax(torch.randn(len(TREE_PARENTS), V, generator=g, dtype=F64), -1)

    def both(single, batched):
        a = single(torch.Generator().manual_seed(seed))
        b = batched(torch.Generator().manual_seed(seed))
        return a, b

    a, (n, t) = both(lambda g: verify_chain(p, q, x, g), lambda g: verify_chain(p[None], q[None], x[None], g))
    assert on_host(a) == (int(n), int(t))
    a, (n, t) = both(lambda g: verify_chain_point_mass(p, x, g), lambda g: verify_chain_point_mass(p[None], x[None], g))
    assert on_host(a) == (int(n), int(t))
    for single, batched in [
        (
            lambda g: verify_tree_point_mass(pt, tokens, TREE_PARENTS, g),
            lambda g: verify_tree_point_mass(pt[None], tokens[None], TREE_PARENTS, g),
        ),
        (
            lambda g: verify_tree_sampled(pt, qt, tokens, TREE_PARENTS, g),
            lambda g: verify_tree_sampled(pt[None], qt[None], tokens[None], TREE_PARENTS, g),
        ),
        (
            lambda g: verify_tree_without_replacement(pt, qt, tokens, TREE_PARENTS, g),
            lambda g: verify_tree_without_replacement(pt[None], qt[None], tokens[None], TREE_PARENTS, g),
        ),
        (
            lambda g: typical_accept(pt, tokens, TREE_PARENTS, generator=g),
            lambda g: typical_accept(pt[None], tokens[None], TREE_PARENTS, generator=g),
        ),
    ]:
        one, (bpath, bnxt) = both(single, batched)
        assert on_host(one) == ([int(v) for v in bpath[0] if v >= 0], int(bnxt))


def test_tree_rules_reject_malformed_parents():
    p = dist([[0.5, 0.5]] * 3)
    for bad in ([0, 0, 0], [-1, 0, -1]):  # node 0 must be the one root
        with pytest.raises(ValueError):
            verify_tree_point_mass(p, [0, 1, 1], bad)
    with pytest.raises(AssertionError):  # a parent must come before its children (nanospec/rules/tree.py)
        verify_tree_sampled(p, p, [0, 1, 1], [-1, 2, 0])


# ---------------------------------------------------------------------------------------------------------
# The rules tree_step runs (verify_tree_descend, verify_tree_greedy) against the reference rule they compute,
# verify_tree_point_mass, and against the exact law


@pytest.mark.parametrize("seed", range(30))
def test_descend_equals_verify_tree_point_mass_under_greedy(seed):
    rng = random.Random(seed)
    tokens, parents = random_tree(rng.randrange(1, 15), 4, rng)  # vocab 4: many duplicate siblings
    argmax = torch.randint(0, 4, (len(tokens),), generator=torch.Generator().manual_seed(seed))
    p_target = torch.nn.functional.one_hot(argmax, 4).double()  # (N, V) greedy: one-hot
    expect = on_host(verify_tree_point_mass(p_target, torch.tensor(tokens), parents))
    assert verify_tree_descend(p_target, tokens, parents) == expect


@pytest.mark.parametrize("seed", range(30))
def test_greedy_fast_path_equals_both_tree_rules(seed):
    """tree_step's greedy shortcut (one argmax, no one-hot rows) against the two rules on warp(logits, 0);
    integer logits make ties common, which all three must break the same way (the first maximum)."""
    rng = random.Random(seed)
    tokens, parents = random_tree(rng.randrange(1, 15), 4, rng)
    logits = torch.randint(0, 3, (len(tokens), 4), generator=torch.Generator().manual_seed(seed)).double()
    p_target = warp(logits, 0.0)
    expect = on_host(verify_tree_point_mass(p_target, torch.tensor(tokens), parents))
    assert verify_tree_greedy(logits, tokens, parents) == expect == verify_tree_descend(p_target, tokens, parents)


def test_descend_follows_the_point_mass_law():
    """Law of (last accepted node, next token) on a tree with duplicate siblings, V = 4, against the exact law:
    P(walk to m, then y) = product of p_parent(token) along m's path x p_m(y) if no child of m holds y
    (a duplicate sibling is never entered). 7 nodes x 4 tokens = 28 outcomes; verify_tree_point_mass (batched)
    is held to the same law, so both compute one rule."""
    tokens, parents = [0, 1, 1, 2, 3, 0, 3], [-1, 0, 0, 0, 1, 1, 3]  # node 2 duplicates node 1
    V, N, n = 4, 7, 10000
    p_target = torch.softmax(torch.randn(N, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    exact = torch.zeros(N * V, dtype=torch.float64)
    first = {}
    for c in range(1, N):
        first.setdefault((parents[c], tokens[c]), c)
    for m in range(N):
        if any(first.get((parents[c], tokens[c])) != c for c in path_to(parents, m)[1:]):
            continue  # m lies under a duplicate: unreachable
        reach = torch.prod(torch.tensor([p_target[parents[c], tokens[c]] for c in path_to(parents, m)[1:]] + [1.0]))
        for y in range(V):
            if (m, y) not in first:
                exact[m * V + y] = reach * p_target[m, y]
    g = torch.Generator().manual_seed(1)
    walks = [verify_tree_descend(p_target, tokens, parents, g) for _ in range(n)]
    got = empirical_law(torch.tensor([(path[-1] if path else 0) * V + y for path, y in walks]), N * V)
    paths, nxt = verify_tree_point_mass(p_target.expand(n, N, V), torch.tensor(tokens).expand(n, N), parents, g)
    last = torch.where(paths >= 0, paths, 0).max(-1).values  # (n,) deepest accepted node (indices grow with depth)
    reference = empirical_law(last * V + nxt, N * V)
    assert abs(exact.sum().item() - 1) < 1e-12
    assert tv(got, exact) < tv_bound(N * V, n)  # 0.041
    assert tv(reference, exact) < tv_bound(N * V, n)


def test_an_unset_verify_judges_each_kind_of_guesses_by_its_default_rule():
    """--verify left unset (None, the tree methods' default): a drawn tree is judged by traversal, a tree of top-k
    guesses by the token rule's descent, a chain by the token rule; a rule named is that rule, and a rule that
    cannot judge the guesses is a one-line error naming those that can."""
    from nanospec.rules.verify import verify_tree_traversal
    from nanospec.steps.verify_step import judge_of
    assert judge_of(None, "drawn_tree") is verify_tree_traversal
    assert judge_of(None, "fixed_tree") is verify_tree_descend
    assert judge_of(None, "chain") is verify_chain
    assert judge_of("token", "drawn_tree") is verify_tree_without_replacement
    with pytest.raises(ValueError, match="does not judge a tree of guesses not drawn.*token, typical$"):
        judge_of("traversal", "fixed_tree")
    with pytest.raises(ValueError, match="does not judge a chain of guesses.*token, block; or --tree dynamic$"):
        judge_of("traversal", "chain", "--tree dynamic")
