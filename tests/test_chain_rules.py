"""
The chain rule (nanospec/rules/verify.py: accept_prob, residual, verify_chain, and verify_chain_greedy, its fast path at
temperature 0) reproduces the target's law p exactly, for guesses drawn from q and for guesses not drawn (the
point-mass rule, q = one_hot(x)).

  - exact: one step's law, enumerated FROM THE IMPLEMENTATION'S OWN accept_prob and residual, equals p to 1e-9
    (hypothesis generates p and q: zeros, equal pairs, disjoint supports, one-hots, ratios of 1e12); the number of
    tokens a step emits is a truncated geometric with a = sum(min(p, q));
  - statistical: 1e5 chains through the real (batched) verify_chain, a bigram target and draft: one step's token
    and acceptance rate, and 4 emitted tokens jointly (81 outcomes), within `tv_bound` (tests/laws.py);
  - negative controls: five broken rules (a residual not normalised, a bonus drawn from q, a fresh draw from p
    after a rejection, one uniform for the whole chain, Medusa's fresh sample after a mismatch) exceed the same
    bound, which shows the statistical tests see a bias of the size real bugs cause;
  - greedy: one-hot targets give the literal argmax-match answers whatever the draft and the seed, and
    verify_chain_greedy equals both rules, ties included; the rule draws from its generator only.
"""
import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanospec.rules.verify import (accept_prob, race_noise, residual, sample, verify_chain, verify_chain_coupled,
                                   verify_chain_greedy, warp)
from laws import (DELTA, EXACT, F64, N_DRAWS, P_BIGRAM, SEEDS, SINGLE_STEP_CASES, START, V3, V10, bigram_law, dist,
                  empirical_law, greedy_target, node_law, on_host, one_hot, pairs, run_chain, sequence_codes, tv,
                  tv_bound, verify_chain_point_mass)


# ---------------------------------------------------------------------------------------------------------
# Exact laws of one step


def chain_step_law(p, q):
    """One step of the chain rule: x ~ q, accepted or replaced by a residual sample. Sums over every x."""
    V = p.numel()
    xs = torch.arange(V)
    a = accept_prob(p.expand(V, V), q.expand(V, V), xs)  # (V,) acceptance of each possible draft
    accepted = q * a  # (V,) P(draft is x and accepted)
    return accepted + (1 - accepted.sum()) * residual(p, q), accepted.sum().item()


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
# Statistical tests through the real functions, with toy bigram "models" (tests/laws.py's run_chain)


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
# Randomness only from the generator


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


# ---------------------------------------------------------------------------------------------------------
# Coupled guesses: the drafter and the target run one race per position (verify_chain_coupled)


def same_winner(p, q):
    """P(q and p pick the same token in one race) = sum_v 1 / sum_y max(p_y / p_v, q_y / q_v): v wins both when
    every other clock E_y beats E_v max(p_y / p_v, q_y / q_v), with E_v = e: prod_y exp(-e m_y), integrated
    against exp(-e)."""
    ratios = torch.maximum(p[None, :] / p[:, None], q[None, :] / q[:, None])  # (V, V) row v
    return float((1.0 / ratios.sum(1)).sum())


def test_a_coupled_chain_emits_p_at_every_position_and_accepts_as_often_as_one_race_agrees():
    """Two guesses, V = 4, fixed p (3 positions) and q (2), N races each: the first token's law is p_0, the second's
    (given the first guess accepted) p_1, within tv_bound(4, n) with probability 1 - 1e-6; guess 1 is accepted as
    often as the two laws win one race alike (same_winner, Hoeffding: within sqrt(ln(2/delta) / 2N)), which is
    at most sum(min(p, q)), Leviathan's rule's chance."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(2, 4, generator=g, dtype=torch.float64), -1)
    N = 20000
    first, second, accepted = [], [], 0
    for _ in range(N):
        noise = race_noise((3, 4), g, torch.float64)
        guesses = sample(q, noise=noise[:2]).tolist()
        n, nxt = verify_chain_coupled(p, noise, guesses)
        emitted = guesses[:n] + [nxt]
        first.append(emitted[0])
        accepted += n >= 1
        if n >= 1:
            second.append(emitted[1])
    law = lambda tokens: torch.bincount(torch.tensor(tokens), minlength=4).double() / len(tokens)  # noqa: E731
    assert 0.5 * (law(first) - p[0]).abs().sum() < tv_bound(4, N)
    assert 0.5 * (law(second) - p[1]).abs().sum() < tv_bound(4, len(second))
    chance = same_winner(p[0], q[0])
    assert abs(accepted / N - chance) < math.sqrt(math.log(2 / DELTA) / (2 * N))
    assert 0.2 < chance <= float(torch.minimum(p[0], q[0]).sum())


def test_coupled_rule_literal():
    """The docstring's example: p_0 = [0.2, 0.8], q_0 = [0.6, 0.4], u = [0.5, 0.6]: the draft's race is won by 0
    (times E / q = [1.16, 1.28]), the target's by 1 ([3.47, 0.64]): rejected, 1 comes out. A guess that is the
    target's winner is accepted, and the winner after it is the bonus."""
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    noise = torch.tensor([[0.5, 0.6], [0.9, 0.1]]).log()
    assert sample(torch.tensor([0.6, 0.4]), noise=noise[0]).item() == 0
    assert verify_chain_coupled(p, noise, [0]) == (0, 1)
    assert verify_chain_coupled(p, noise, [1]) == (1, 0)  # times after it: [0.21, 4.6] -> 0
