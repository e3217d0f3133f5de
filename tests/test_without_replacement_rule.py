"""
Children drawn WITHOUT replacement (Jeon et al. 2024): sample_without_replacement draws them (Gumbel-top-k), and
verify_tree_without_replacement checks child j against q without the siblings drawn before it
(without_replacement_proposals). The rule reproduces the target's law p exactly, and accepts at least as often as
SpecInfer's rule with i.i.d. children.

  - exact: every ordered draw's probability; one node's law, averaged over every possible draw, equals p to 1e-9
    (hypothesis's pairs, tests/laws.py); whole trees (2 drawn children per node, 2 levels), the first 3 tokens
    jointly equal the bigram target's law to 1e-9;
  - statistical: the sampler's law of ordered tuples, and 1e5 nodes and whole trees through the real function,
    within `tv_bound`;
  - negative controls: five rules that break one condition of the proof (drafts drawn with replacement, a rejected
    sibling's token drawn again, its mass kept, a fresh sample after every rejection, q unwarped) exceed the bound.
"""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.rules.verify import (accept_prob, residual, sample, sample_without_replacement,
                             verify_tree_without_replacement, warp, without_replacement_proposals)
from nanospec.rules.reference import verify_tree_sampled
from laws import (DELTA, EXACT, F64, N_DRAWS, P_BIGRAM, PARENTS_SAMPLED, Q_BIGRAM, SINGLE_STEP_CASES, START, V3,
                  bigram_law, build_sampled_tree, dist, empirical_law, node_law, ordered_draws, pairs, tree_tv, tv,
                  tv_bound)


# ---------------------------------------------------------------------------------------------------------
# Drawing without replacement: the proposals and the sampler


def test_without_replacement_proposals_literal():
    q = dist([0.5, 0.3, 0.2])
    expected = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.6, 0.4]], dtype=F64)  # the second draw: q without token 0
    assert torch.allclose(without_replacement_proposals(q, torch.tensor([0, 2])), expected, rtol=0, atol=1e-15)
    tuples, prob = ordered_draws(q, 2)  # [0, 1] drawn with 0.5 * 0.3/0.5; [1, 0] with 0.3 * 0.5/0.7
    assert prob[tuples.tolist().index([0, 1])].item() == pytest.approx(0.3)
    assert prob[tuples.tolist().index([1, 0])].item() == pytest.approx(0.3 * 0.5 / 0.7)
    assert prob.sum().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="distinct"):
        sample_without_replacement(dist([0.5, 0.5, 0.0]), 3)  # only two tokens can be drawn


@pytest.mark.parametrize("m", [1, 2, 3])
def test_sample_without_replacement_law(m):
    """Gumbel-top-k gives each ordered m-tuple the probability of m sequential draws (24 or fewer outcomes)."""
    q = dist([0.45, 0.3, 0.15, 0.1, 0.0])  # a token of probability 0 is never drawn
    tuples, exact = ordered_draws(q, m)
    draws = sample_without_replacement(q.expand(N_DRAWS, -1), m, torch.Generator().manual_seed(m))  # (n, m)
    assert (draws != 4).all() and (draws.sort(-1).values.diff(dim=-1) != 0).all()  # possible and distinct
    code = {tuple(t): i for i, t in enumerate(tuples.tolist())}
    got = empirical_law(torch.tensor([code[tuple(t)] for t in draws.tolist()]), len(tuples))
    assert tv(got, exact) < tv_bound(len(tuples), N_DRAWS)


# ---------------------------------------------------------------------------------------------------------
# Exact laws: one node, and whole trees


@EXACT
@given(pairs(), st.integers(1, 3))
def test_tree_without_replacement_node_law_is_p(pq, m):
    """m children drawn without replacement from q at one node, each checked against q without the siblings
    before it: averaged over every possible draw, the emitted token follows p exactly."""
    p, q = pq
    m = min(m, int((q > 0).sum()))  # no more draws than q has tokens
    tuples, prob = ordered_draws(q, m)
    proposals = without_replacement_proposals(q.expand(len(tuples), -1), tuples)  # (T, m, V)
    laws, _ = node_law(p.expand(len(tuples), -1), proposals.unbind(-2), tuples.unbind(-1))  # (T, V)
    assert torch.allclose((prob[:, None] * laws).sum(0), p, rtol=0, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(pairs(), st.integers(2, 3))
def test_without_replacement_accepts_at_least_as_often_as_iid(pq, m):
    """The reason to draw without replacement (Jeon et al. 2024): the chance that some child is accepted is
    never below SpecInfer's with i.i.d. children, exactly computed, on every generated (p, q)."""
    p, q = pq
    V, m = p.numel(), min(m, int((q > 0).sum()))
    tuples, prob = ordered_draws(q, m)
    proposals = without_replacement_proposals(q.expand(len(tuples), -1), tuples)
    _, accepted = node_law(p.expand(len(tuples), -1), proposals.unbind(-2), tuples.unbind(-1))
    iid = torch.tensor(list(itertools.product(range(V), repeat=m)), dtype=torch.long)  # (V^m, m)
    _, accepted_iid = node_law(p.expand(len(iid), -1), [q.expand(len(iid), -1)] * m, iid.unbind(-1))
    assert (prob * accepted).sum().item() >= (q[iid].prod(-1) * accepted_iid).sum().item() - 1e-12


def drawn_tree_law(token, L, m, D, d=0):
    """EXACT law (V3**L,) of the next L tokens after `token` when every step verifies a tree drawn below its root:
    m children per node down to depth D, each node's drawn without replacement from Q_BIGRAM at its token, checked
    with the implementation's accept_prob and residual against P_BIGRAM. d: the depth `token` has in the current
    tree (at depth D it has no children: the target's own token follows and a new tree starts)."""
    if L == 0:
        return torch.ones(1, dtype=F64)
    law = torch.zeros(V3**L, dtype=F64)
    P, fresh = P_BIGRAM[token], lambda y: drawn_tree_law(y, L - 1, m, D)  # fresh: a new step, rooted at y
    if d == D:
        for y in range(V3):
            law[y * V3 ** (L - 1):(y + 1) * V3 ** (L - 1)] += P[y] * fresh(y)
        return law
    tuples, prob = ordered_draws(Q_BIGRAM[token], m)
    for xs, p_xs in zip(tuples, prob.tolist()):
        reach = p_xs  # probability of this draw and of every child before j being rejected
        for q_j, x in zip(without_replacement_proposals(Q_BIGRAM[token], xs), xs):
            a = accept_prob(P, q_j, x).item()
            y = int(x)
            law[y * V3 ** (L - 1):(y + 1) * V3 ** (L - 1)] += reach * a * drawn_tree_law(y, L - 1, m, D, d + 1)
            reach *= 1 - a
            P = residual(P, q_j)
        for y in range(V3):
            law[y * V3 ** (L - 1):(y + 1) * V3 ** (L - 1)] += reach * P[y] * fresh(y)
        P = P_BIGRAM[token]
    return law


def test_tree_without_replacement_joint_law_exact():
    """Whole trees, exactly: 2 drawn children per node, 2 levels, the first 3 tokens jointly (27 outcomes) equal
    the target's bigram law to 1e-9. This is the descent too: reaching a child says nothing about the draws
    below it, which the rule's proof needs."""
    law = drawn_tree_law(START, 3, m=2, D=2)
    assert torch.allclose(law, bigram_law(P_BIGRAM, START, 3), rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# Statistical tests through the real function, with toy bigram "models"


def build_distinct_tree(root, g, q_table=Q_BIGRAM):
    """root (n,) -> tokens (n, N) with PARENTS_SAMPLED's shape: each node's 2 children drawn WITHOUT replacement
    from q at their parent's token (Gumbel-top-k), in draw order."""
    tokens = torch.zeros(root.size(0), len(PARENTS_SAMPLED), dtype=torch.long)
    tokens[:, 0] = root
    for u in range(len(PARENTS_SAMPLED)):
        children = [c for c, par in enumerate(PARENTS_SAMPLED) if par == u]
        if children:
            tokens[:, children] = sample_without_replacement(q_table[tokens[:, u]], len(children), g)
    return tokens


def real_tree_without_replacement(p_target, q_draft, tokens, parents, g):
    return verify_tree_without_replacement(p_target, q_draft, tokens, parents, g)


@pytest.mark.parametrize("case", SINGLE_STEP_CASES)
def test_tree_without_replacement_single_node_sampled(case):
    """One node, 3 children drawn without replacement (2 where q has only 2 tokens), 1e5 trees through the real
    function: the emitted token follows p within tv_bound, and the acceptance rate matches the exact one within
    Hoeffding's bound."""
    p, q = SINGLE_STEP_CASES[case]
    V, n, m = p.numel(), N_DRAWS, min(3, int((q > 0).sum()))
    g = torch.Generator().manual_seed(2)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), sample_without_replacement(q.expand(n, V), m, g)], 1)
    path, nxt = verify_tree_without_replacement(p.expand(n, m + 1, V), q.expand(n, m + 1, V), tokens,
                                                        [-1] + [0] * m, g)
    first = torch.where(path[:, 0] >= 0, tokens.gather(1, path.clamp(min=0))[:, 0], nxt)  # the emitted token
    assert tv(empirical_law(first, V), p) < tv_bound(V, n)
    tuples, prob = ordered_draws(q, m)
    proposals = without_replacement_proposals(q.expand(len(tuples), -1), tuples)
    _, accepted = node_law(p.expand(len(tuples), -1), proposals.unbind(-2), tuples.unbind(-1))
    exact = (prob * accepted).sum().item()
    assert abs((path[:, 0] >= 0).double().mean().item() - exact) < math.sqrt(math.log(2 / DELTA) / (2 * n))


def test_tree_without_replacement_joint_law_sampled():
    distance, bound = tree_tv(real_tree_without_replacement, build_distinct_tree, PARENTS_SAMPLED)
    assert distance < bound


# ---------------------------------------------------------------------------------------------------------
# Negative controls for drawn trees: each breaks one condition of the rule's proof; the joint-law statistic
# above must see it.


def broken_with_replacement_drafts(p_target, q_draft, tokens, parents, g):
    """(run on i.i.d. children) Drafts drawn WITH replacement, checked as if drawn without: a repeated token is
    always rejected and a fresh one is checked against a q it was not drawn from."""
    return verify_tree_without_replacement(p_target, q_draft, tokens, parents, g)


def broken_rejected_sibling_drawn_again(p_target, q_draft, tokens, parents, g):
    """(run on distinct children) Each child checked against the parent's whole q, as if a rejected sibling's
    token could have been drawn again: SpecInfer's i.i.d. rule on children that are not i.i.d."""
    return verify_tree_sampled(p_target, q_draft, tokens, parents, g)


def broken_rejected_mass_kept(p_target, q_draft, tokens, parents, g):
    """(run on distinct children) After a rejection the target P stays as it was: the rejected token keeps its
    mass, so it can still be emitted (or accepted as a later child) more often than p allows."""
    from nanospec.rules import verify

    real = verify.residual
    verify.residual = lambda p, q: p  # only inside this call
    try:
        return verify_tree_without_replacement(p_target, q_draft, tokens, parents, g)
    finally:
        verify.residual = real


def broken_resample_after_rejections(p_target, q_draft, tokens, parents, g):
    """(run on distinct children) When every child of a node is rejected, a fresh sample of the node's p instead
    of the residual: the rejected siblings' tokens come out again."""
    path, _ = verify_tree_without_replacement(p_target, q_draft, tokens, parents, g)
    last = torch.where(path >= 0, path, 0).max(-1).values  # (n,) the last accepted node (indices grow with depth)
    return path, sample(p_target[torch.arange(len(last)), last], g)


def broken_unwarped_q(p_target, q_draft, tokens, parents, g):
    """(run on children drawn from warp(log q, temperature 0.5)) Checked against the UNwarped q."""
    return verify_tree_without_replacement(p_target, q_draft, tokens, parents, g)


Q_WARPED = warp(torch.log(Q_BIGRAM), temperature=0.5)  # what a drafter warped like the target draws from


@pytest.mark.parametrize("broken, build", [
    (broken_with_replacement_drafts, build_sampled_tree),
    (broken_rejected_sibling_drawn_again, build_distinct_tree),
    (broken_rejected_mass_kept, build_distinct_tree),
    (broken_resample_after_rejections, build_distinct_tree),
    (broken_unwarped_q, lambda root, g: build_distinct_tree(root, g, Q_WARPED)),
], ids=lambda v: getattr(v, "__name__", ""))
def test_drawn_tree_negative_controls_fail(broken, build):
    distance, bound = tree_tv(broken, build, PARENTS_SAMPLED)
    assert distance > bound, f"{broken.__name__}: TV {distance:.4f} within the bound {bound:.4f}"


def test_drawn_tree_with_warped_q_is_exact():
    """The control above with the q the children really came from: within the bound (the rule, not the
    warping, was at fault)."""
    def verify(p_target, q_draft, tokens, parents, g):
        return verify_tree_without_replacement(p_target, Q_WARPED[tokens], tokens, parents, g)

    distance, bound = tree_tv(verify, lambda root, g: build_distinct_tree(root, g, Q_WARPED), PARENTS_SAMPLED)
    assert distance < bound
