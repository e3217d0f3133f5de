"""
Tests for nanospec/verify.py: every lossless rule must reproduce the target distribution p exactly.

Four kinds of test, from cheapest to strongest:
  - exact: the output law computed FROM THE IMPLEMENTATION'S OWN accept_prob and residual, by enumerating
    the rule's branches, equals p to 1e-9 (hypothesis generates p and q, zeros and extreme ratios included);
  - statistical: 1e5+ draws through the real (batched) functions, total-variation distance to the exact law
    below a high-probability bound derived from the sample size (`tv_bound`);
  - negative controls: deliberately broken samplers, judged by the same statistic, must exceed the bound,
    which shows the statistical tests can see a bias of the size real bugs cause;
  - greedy: one-hot targets give the literal argmax-match answers.
Everything runs in float64 on toy distributions over V = 2..6 tokens and bigram toy "models".
"""
import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.tree import path_to
from nanospec.verify import (
    accept_prob,
    residual,
    sample,
    sample_without_replacement,
    typical_accept,
    verify_chain,
    verify_chain_greedy,
    verify_tree_descend,
    verify_tree_greedy,
    verify_tree_without_replacement,
    warp,
    without_replacement_proposals,
)
from nanospec.verify_reference import verify_tree_point_mass, verify_tree_sampled
from laws import (DELTA, EXACT, F64, N_DRAWS, P_BIGRAM, PARENTS_SAMPLED, Q_BIGRAM, SEEDS, SINGLE_STEP_CASES, START,
                  V3, V10, bigram_law, build_sampled_tree, dist, empirical_law, greedy_target, node_law, on_host,
                  one_hot, ordered_draws, pairs, run_chain, sequence_codes, tree_tv, tv, tv_bound,
                  verify_chain_point_mass)
from toys import random_tree


# ---------------------------------------------------------------------------------------------------------
# Exact laws, enumerated from the implementation's own accept_prob and residual


def chain_step_law(p, q):
    """One step of the chain rule: x ~ q, accepted or replaced by a residual sample. Sums over every x."""
    V = p.numel()
    xs = torch.arange(V)
    a = accept_prob(p.expand(V, V), q.expand(V, V), xs)  # (V,) acceptance of each possible draft
    accepted = q * a  # (V,) P(draft is x and accepted)
    return accepted + (1 - accepted.sum()) * residual(p, q), accepted.sum().item()


# ---------------------------------------------------------------------------------------------------------
# Exact laws of one step


@EXACT
@given(pairs())
def test_chain_step_law_is_p(pq):
    p, q = pq
    law, acceptance = chain_step_law(p, q)
    assert torch.allclose(law, p, rtol=0, atol=1e-9)
    assert acceptance == pytest.approx(torch.minimum(p, q).sum().item(), abs=1e-9)


@EXACT
@given(pairs(), st.data())
def test_point_mass_step_law_is_p(pq, data):
    """A guess x is a draft with q = one_hot(x): accepted with prob p(x), else the emitted token is p given
    y != x, which is what "sample y ~ p, keep it while y == x" produces. The emitted token follows p."""
    p, _ = pq
    V = p.numel()
    x = data.draw(st.integers(0, V - 1))
    law, acceptance = node_law(p, [one_hot(x, V)], [torch.tensor(x)])
    assert acceptance == pytest.approx(p[x].item(), abs=1e-12)
    assert torch.allclose(law, p, rtol=0, atol=1e-9)
    if p[x] < 1:
        y_given_mismatch = p.clone()
        y_given_mismatch[x] = 0
        assert torch.allclose(residual(p, one_hot(x, V)), y_given_mismatch / y_given_mismatch.sum(), atol=1e-12)


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


def test_accept_prob_and_residual_literal():
    p, q = dist([0.2, 0.8]), dist([0.6, 0.4])
    assert accept_prob(p, q, torch.tensor(0)).item() == pytest.approx(1 / 3)
    assert accept_prob(p, q, torch.tensor(1)).item() == 1.0
    assert residual(p, q).tolist() == [0.0, 1.0]
    assert residual(p, p).tolist() == p.tolist()  # empty residual falls back to p, no 0/0
    assert residual(p, torch.zeros(2, dtype=F64)).tolist() == pytest.approx(p.tolist())
    # a draft the proposal gives no mass: accepted iff the target wants it (never drawn in practice)
    assert accept_prob(dist([1, 0]), dist([0, 1]), torch.tensor(0)).item() == 1.0
    assert accept_prob(dist([0, 1]), dist([0, 1]), torch.tensor(0)).item() == 0.0


# ---------------------------------------------------------------------------------------------------------
# Theory: with fixed p and q the emitted count per step is a truncated geometric


def truncated_geometric(a, k):
    """P(N = n) for n = 1..k+1 tokens emitted per step, per-token acceptance a."""
    return torch.tensor([a ** (n - 1) * (1 - a) for n in range(1, k + 1)] + [a**k], dtype=F64)


P_FIXED, Q_FIXED, K_FIXED = dist([0.5, 0.3, 0.2, 0.0]), dist([0.2, 0.3, 0.3, 0.2]), 4


def test_emitted_count_law_exact():
    """Enumerate every draft sequence x ~ q^k and the accept/reject branches with the implementation's
    accept_prob: the count of emitted tokens is truncated geometric with a = sum(min(p, q))."""
    p, q, k, V = P_FIXED, Q_FIXED, K_FIXED, P_FIXED.numel()
    law = torch.zeros(k + 1, dtype=F64)
    for xs in itertools.product(range(V), repeat=k):
        prob = math.prod(q[x].item() for x in xs)
        a = accept_prob(p.expand(k, V), q.expand(k, V), torch.tensor(xs)).tolist()
        reach = 1.0
        for n in range(k):  # rejected at position n -> n accepted, n + 1 emitted
            law[n] += prob * reach * (1 - a[n])
            reach *= a[n]
        law[k] += prob * reach
    a = torch.minimum(p, q).sum().item()
    assert torch.allclose(law, truncated_geometric(a, k), rtol=0, atol=1e-12)
    mean = (law * torch.arange(1, k + 2)).sum().item()
    assert mean == pytest.approx((1 - a ** (k + 1)) / (1 - a), abs=1e-12)


def test_emitted_count_law_sampled():
    p, q, k, V = P_FIXED, Q_FIXED, K_FIXED, P_FIXED.numel()
    g = torch.Generator().manual_seed(0)
    n = N_DRAWS
    drafts = sample(q.expand(n, k, V), g)  # (n, k)
    n_acc, _ = verify_chain(p.expand(n, k + 1, V), q.expand(n, k, V), drafts, g)
    a = torch.minimum(p, q).sum().item()
    assert tv(empirical_law(n_acc, k + 1), truncated_geometric(a, k)) < tv_bound(k + 1, n)
    # Hoeffding for the mean of a count in [1, k+1]: |mean - E[N]| < k sqrt(ln(2/delta) / (2n)) w.p. 1 - delta
    mean_bound = k * math.sqrt(math.log(2 / DELTA) / (2 * n))
    assert abs((n_acc + 1).double().mean().item() - (1 - a ** (k + 1)) / (1 - a)) < mean_bound


# ---------------------------------------------------------------------------------------------------------
# Statistical tests through the real functions, with toy bigram "models"

def chain_tv(verify, L=4, **kw):
    seqs = run_chain(verify, L=L, **kw)
    law = empirical_law(sequence_codes(seqs, V3), V3**L)
    return tv(law, bigram_law(P_BIGRAM, START, L)), tv_bound(V3**L, seqs.size(0))


def real_chain(p_target, q_draft, drafts, g):
    return verify_chain(p_target, q_draft[:, :-1], drafts, g)


def real_chain_point_mass(p_target, q_draft, drafts, g):
    return verify_chain_point_mass(p_target, drafts, g)


@pytest.mark.parametrize("case", SINGLE_STEP_CASES)
def test_chain_single_step_sampled(case):
    p, q = SINGLE_STEP_CASES[case]
    V, n = p.numel(), N_DRAWS
    g = torch.Generator().manual_seed(1)
    drafts = sample(q.expand(n, 1, V), g)  # (n, 1)
    n_acc, nxt = verify_chain(p.expand(n, 2, V), q.expand(n, 1, V), drafts, g)
    first = torch.where(n_acc == 1, drafts[:, 0], nxt)  # the first emitted token
    assert tv(empirical_law(first, V), p) < tv_bound(V, n)
    acceptance = n_acc.double().mean().item()
    assert abs(acceptance - torch.minimum(p, q).sum().item()) < math.sqrt(math.log(2 / DELTA) / (2 * n))


def test_chain_joint_law_sampled():
    """k = 3 sampled drafts per step, 4 emitted tokens judged jointly (81 outcomes)."""
    distance, bound = chain_tv(real_chain)
    assert distance < bound


def test_chain_point_mass_joint_law_sampled():
    """Deterministic drafts (the draft's top-1 chain) verified with the point-mass rule."""
    distance, bound = chain_tv(real_chain_point_mass, greedy_drafts=True)
    assert distance < bound


# Trees: every node's children are proposed from Q_BIGRAM at the node's token. Depth 2.
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


def _chain_accept(p_target, q_draft, drafts, u):
    k = drafts.size(1)
    accepted = u < accept_prob(p_target[:, :k], q_draft[:, :k], drafts)
    return accepted.long().cumprod(-1).sum(-1)  # (n,)


def broken_unnormalised_residual(p_target, q_draft, drafts, g):
    """After a rejection, inverse-CDF sampling from max(0, p - q) WITHOUT dividing by its mass: the missing
    mass falls on the last token, i.e. a mixture of the residual and a point mass."""
    n, k = drafts.shape
    n_acc = _chain_accept(p_target, q_draft, drafts, torch.rand(n, k, generator=g, dtype=F64))
    rows = torch.arange(n)
    q_next = torch.where((n_acc < k)[:, None], q_draft[rows, n_acc], 0.0)  # q = 0 at the bonus: plain p
    excess = (p_target[rows, n_acc] - q_next).clamp(min=0)  # (n, V), not normalised
    u = torch.rand(n, 1, generator=g, dtype=F64)
    nxt = (excess.cumsum(-1) <= u).sum(-1).clamp(max=excess.size(-1) - 1)
    return n_acc, nxt


def broken_bonus_from_q(p_target, q_draft, drafts, g):
    """When every draft is accepted, the bonus token is drawn from the draft's q instead of the target's p."""
    n, k = drafts.shape
    n_acc = _chain_accept(p_target, q_draft, drafts, torch.rand(n, k, generator=g, dtype=F64))
    rows = torch.arange(n)
    dist_next = residual(p_target[rows, n_acc], q_draft[rows, n_acc])
    dist_next = torch.where((n_acc == k)[:, None], q_draft[:, k], dist_next)
    return n_acc, sample(dist_next, g)


def broken_resample_from_p(p_target, q_draft, drafts, g):
    """After a rejection, a fresh sample of p instead of the residual (over-produces tokens q favours)."""
    n, k = drafts.shape
    n_acc = _chain_accept(p_target, q_draft, drafts, torch.rand(n, k, generator=g, dtype=F64))
    return n_acc, sample(p_target[torch.arange(n), n_acc], g)


def broken_reseeded_rng(p_target, q_draft, drafts, g):
    """The RNG re-seeded inside the accept loop: every position of a chain sees the same uniform, so once the
    first draft is accepted the later ones are accepted too often."""
    n, k = drafts.shape
    same_u = torch.rand(n, 1, generator=g, dtype=F64).expand(n, k)
    n_acc = _chain_accept(p_target, q_draft, drafts, same_u)
    rows = torch.arange(n)
    q_next = torch.where((n_acc < k)[:, None], q_draft[rows, n_acc], 0.0)
    return n_acc, sample(residual(p_target[rows, n_acc], q_next), g)


def broken_fresh_sample_after_mismatch(p_target, q_draft, drafts, g):
    """Medusa's sample-and-match as implemented: compare y ~ p with the guess, and after a mismatch emit a
    FRESH sample of p rather than y. The guess x then comes out with prob p(x) + (1 - p(x)) p(x)."""
    n, k = drafts.shape
    y = sample(p_target[:, :k], g)  # (n, k) the samples compared with the guesses
    n_acc = (y == drafts).long().cumprod(-1).sum(-1)
    return n_acc, sample(p_target[torch.arange(n), n_acc], g)


def broken_topk_tree_with_draft_q(p_target, q_draft, tokens, parents, g):
    """A deterministic top-k tree verified with min(1, p/q), q = the draft's softmax: the children were not
    samples of q, so the sampled-children rule does not apply."""
    return verify_tree_sampled(p_target, q_draft, tokens, parents, g)


def lossy_typical(p_target, q_draft, tokens, parents, g):
    return typical_accept(p_target, tokens, parents, generator=g)


@pytest.mark.parametrize(
    "broken, greedy_drafts",
    [
        (broken_unnormalised_residual, False),
        (broken_bonus_from_q, False),
        (broken_resample_from_p, False),
        (broken_reseeded_rng, False),
        (broken_fresh_sample_after_mismatch, True),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_chain_negative_controls_fail(broken, greedy_drafts):
    distance, bound = chain_tv(broken, greedy_drafts=greedy_drafts)
    assert distance > bound, f"{broken.__name__}: TV {distance:.4f} within the bound {bound:.4f}"


@pytest.mark.parametrize("broken", [broken_topk_tree_with_draft_q, lossy_typical], ids=lambda f: f.__name__)
def test_tree_negative_controls_fail(broken):
    distance, bound = tree_tv(broken, build_topk_tree, PARENTS_TOPK)
    assert distance > bound, f"{broken.__name__}: TV {distance:.4f} within the bound {bound:.4f}"


# ---------------------------------------------------------------------------------------------------------
# Greedy: one-hot targets give the literal argmax-match answers, whatever the randomness

@pytest.mark.parametrize(
    "draft, argmaxes, expected",
    [
        ([5, 9, 2], [5, 9, 7, 3], (2, 7)),  # emit [5, 9, 7]
        ([5, 9, 7], [5, 9, 7, 3], (3, 3)),  # all accepted, bonus 3: emit [5, 9, 7, 3]
        ([1, 9, 7], [5, 9, 7, 3], (0, 5)),  # first rejected: emit [5]
        ([], [4], (0, 4)),  # nothing drafted: plain greedy step
    ],
)
def test_chain_greedy_literal(draft, argmaxes, expected):
    p = greedy_target(argmaxes)
    x = torch.tensor(draft, dtype=torch.long)
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        q_one_hot = one_hot(x, V10).reshape(len(draft), V10)  # a greedy draft
        q_soft = torch.softmax(torch.randn(len(draft), V10, generator=g, dtype=F64), -1)  # a sampling draft
        assert on_host(verify_chain(p, q_one_hot, x, g)) == expected
        assert on_host(verify_chain(p, q_soft, x, g)) == expected
        assert on_host(verify_chain_point_mass(p, x, g)) == expected


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
# One chain or tree is the B = 1 case of the same rule (leading dimensions); randomness only from the generator


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


def test_uses_only_the_given_generator():
    p, q = SINGLE_STEP_CASES["generic"]
    state = torch.get_rng_state()
    g = torch.Generator().manual_seed(0)
    results = [on_host(verify_chain(p.expand(4, 4), q.expand(3, 4), torch.tensor([0, 1, 2]), g)) for _ in range(50)]
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    assert len(set(results)) > 1  # the generator advances between calls instead of being re-seeded
    g = torch.Generator().manual_seed(0)
    again = [on_host(verify_chain(p.expand(4, 4), q.expand(3, 4), torch.tensor([0, 1, 2]), g)) for _ in range(50)]
    assert results == again


def test_tree_rules_reject_malformed_parents():
    p = dist([[0.5, 0.5]] * 3)
    for bad in ([0, 0, 0], [-1, 0, -1]):  # node 0 must be the one root
        with pytest.raises(ValueError):
            verify_tree_point_mass(p, [0, 1, 1], bad)
    with pytest.raises(AssertionError):  # a parent must come before its children (nanospec/tree.py)
        verify_tree_sampled(p, p, [0, 1, 1], [-1, 2, 0])


# ---------------------------------------------------------------------------------------------------------
# warp and sample


def test_warp_greedy_is_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 0.0]], dtype=F64)
    probs = warp(logits, temperature=0.0)
    assert probs.dtype == F64
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]  # ties go to the first index
    g = torch.Generator().manual_seed(0)
    assert sample(probs.expand(1000, 2, 4), g).unique(dim=0).tolist() == [[1, 0]]


def test_warp_top_k():
    probs = warp(torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=F64), temperature=1.0, top_k=2)
    expected = torch.softmax(torch.tensor([2.0, 1.0], dtype=F64), -1).tolist() + [0.0, 0.0]
    assert probs.tolist() == pytest.approx(expected)
    assert warp(torch.tensor([1.0, 3.0, 2.0]), temperature=0.5, top_k=1).tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.7, [0.0, 0.625, 0.0, 0.375]),  # 0.5 < 0.7, 0.5 + 0.3 reaches it
        (0.85, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]),  # needs three tokens
        (0.4, [0.0, 1.0, 0.0, 0.0]),  # the top token alone reaches it
        (0.0, [0.0, 1.0, 0.0, 0.0]),  # degenerate: still keeps the top token
        (1.0, [0.15, 0.5, 0.05, 0.3]),  # disabled
    ],
)
def test_warp_top_p_literal(top_p, expected):
    probs = warp(torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=F64)), temperature=1.0, top_p=top_p)
    assert probs.tolist() == pytest.approx(expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=8), st.floats(0.05, 0.95))
def test_warp_top_p_keeps_smallest_prefix_reaching_p(logits, top_p):
    logits = torch.tensor(logits, dtype=F64)
    full = torch.softmax(logits, -1)
    kept = warp(logits, temperature=1.0, top_p=top_p) > 0
    mass = full[kept].sum().item()
    assert mass >= top_p - 1e-12  # reaches p
    assert mass - full[kept].min().item() < top_p + 1e-12  # dropping its least likely token would not
    if (~kept).any():
        assert full[kept].min() >= full[~kept].max()  # a prefix of the sorted order


def test_warp_same_for_target_and_draft():
    """Warping is row by row with no hidden state: target and draft logits stacked together get exactly what
    each gets alone, for every setting the methods use."""
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(2, 7, 11, generator=g, dtype=F64)  # (T, V) each
    for kw in [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=3),
               dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=5, top_p=0.6)]:
        stacked = warp(torch.stack([target, draft]), **kw)
        assert torch.equal(stacked[0], warp(target, **kw))
        assert torch.equal(stacked[1], warp(draft, **kw))
        assert torch.equal(warp(target.clone(), **kw), warp(target, **kw))


def test_sample_law_and_shape():
    g = torch.Generator().manual_seed(0)
    p = dist([0.1, 0.0, 0.6, 0.3])
    draws = sample(p.expand(N_DRAWS, 4), g)
    assert draws.shape == (N_DRAWS,)
    assert (draws != 1).all()  # a zero-probability token is never drawn
    assert tv(empirical_law(draws, 4), p) < tv_bound(4, N_DRAWS)
    assert sample(p, g).shape == ()


@pytest.mark.parametrize("seed", range(20))
def test_greedy_fast_path_equals_both_chain_rules_on_one_hot_distributions(seed):
    """verify_chain_greedy is the fast path decoding uses at temperature 0; the rules are the slow oracle.
    Integer logits in a small range make ties common, so the tie-break is checked too."""
    g = torch.Generator().manual_seed(seed)
    k, V = 1 + seed % 5, 4
    logits = torch.randint(0, 3, (k + 1, V), generator=g).double()  # (k+1, V), many ties
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(k, generator=g) < 0.7, best[:k], torch.randint(0, V, (k,), generator=g))
    p = warp(logits, 0.0)
    q = torch.nn.functional.one_hot(drafts, V).double()
    fast = verify_chain_greedy(logits, drafts)
    assert fast == on_host(verify_chain_point_mass(p, drafts, g)) == on_host(verify_chain(p, q, drafts, g))


# ---------------------------------------------------------------------------------------------------------
# Children drawn WITHOUT replacement (Jeon et al. 2024): sample_without_replacement draws them, and
# verify_tree_without_replacement checks child j against q without the siblings drawn before it.


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
    from nanospec import verify

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


def test_sample_follows_each_rows_law_and_never_draws_a_zero():
    """sample (Gumbel-max, what every rule draws with; the tree point-mass rule draws every node's y at once): each
    row's empirical law within the stated TV bound of p, a token of probability 0 never drawn, a one-hot row always its hot index."""
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]], dtype=F64)
    n = 40_000
    g = torch.Generator().manual_seed(0)
    y = sample(p[None].expand(n, -1, -1), g)  # (n, 3)
    for row in range(3):
        law = empirical_law(y[:, row], 5)
        assert tv(law, p[row]) < tv_bound(5, n), f"row {row}: law {law.tolist()} against p {p[row].tolist()}"
        assert (law[p[row] == 0] == 0).all(), f"row {row} drew a token of probability 0: {law.tolist()}"
