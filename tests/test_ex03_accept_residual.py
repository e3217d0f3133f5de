"""Exercise 3 (EXERCISES.md): `accept_prob` and `residual` in nanospec/rules/verify.py, the two pieces of every lossless
rule. Literal values, the edge cases (q(x) = 0, p = q, point masses), batched shapes, then the law itself:
draft x ~ q, accept with accept_prob, else draw from residual; the output must follow p, exactly by
enumeration and within a stated bound by sampling. Those law tests are gates (nanospec/course/registry.py): if
one fails the exercise scores zero, since a step with the wrong law is wrong whatever its literal cases say.
Run: python -m pytest -m ex3 -x"""
import pytest
import torch

from nanospec.rules.verify import accept_prob, residual
from laws import empirical_law, tv, tv_bound
from teach import expect, expect_close, expect_equal, expect_law

pytestmark = pytest.mark.ex3

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def test_docstring_example():
    p, q = t([0.2, 0.8]), t([0.6, 0.4])
    expect_close(accept_prob(p, q, torch.tensor(0)), 1 / 3, "accept_prob(p=[0.2, 0.8], q=[0.6, 0.4], x=0)")
    expect_close(accept_prob(p, q, torch.tensor(1)), 1.0, "accept_prob(p=[0.2, 0.8], q=[0.6, 0.4], x=1)")
    expect_close(residual(p, q), [0.0, 1.0], "residual(p=[0.2, 0.8], q=[0.6, 0.4])")


def test_a_token_the_draft_cannot_draw():
    """q(x) = 0: accepted if p(x) > 0 (it never happens for a real draw; no 0/0), and 0 if p(x) = 0 too."""
    p, q = t([0.5, 0.5, 0.0]), t([1.0, 0.0, 0.0])
    expect_close(accept_prob(p, q, torch.tensor(1)), 1.0, "accept_prob where q(x) = 0 and p(x) = 0.5")
    expect_close(accept_prob(p, q, torch.tensor(2)), 0.0, "accept_prob where q(x) = 0 and p(x) = 0")


def test_residual_when_nothing_is_left():
    """p == q: no rejection can happen, and residual returns p (no division by zero, no NaN)."""
    p = t([0.25, 0.75, 0.0])
    expect_close(residual(p, p.clone()), p, "residual(p, q) with p == q (nothing left: return p)", atol=0)


def test_point_mass_and_empty_drafts():
    """q = one_hot(x): p without x, renormalised (the rule for guesses); q = 0: p itself (the bonus)."""
    p = t([0.5, 0.3, 0.2])
    expect_close(residual(p, t([1.0, 0.0, 0.0])), [0.0, 0.6, 0.4], "residual(p=[0.5, 0.3, 0.2], q=one_hot(0))")
    expect_close(residual(p, torch.zeros(3, dtype=F64)), p, "residual(p=[0.5, 0.3, 0.2], q=0)")
    expect_close(accept_prob(p, t([0.0, 1.0, 0.0]), torch.tensor(1)), 0.3,
                 "accept_prob(p=[0.5, 0.3, 0.2], q=one_hot(1), x=1)")


def test_extreme_ratios_stay_finite():
    p, q = t([1e-300, 1.0 - 1e-300]), t([1.0 - 1e-12, 1e-12])
    a = accept_prob(p.expand(2, 2), q.expand(2, 2), torch.tensor([0, 1]))  # (2,): x = 0, x = 1
    r = residual(p, q)
    expect(torch.isfinite(a).all() and torch.isfinite(r).all(),
           f"accept_prob and residual at ratios of 1e-300 must stay finite: got {a.tolist()} and {r.tolist()}")
    expect(a[1].item() == 1.0 and a[0].item() < 1e-290,
           f"accept_prob(p=[1e-300, 1], q=[1, 1e-12]) for x = 0, 1: expected [~1e-300, 1.0], got {a.tolist()}")
    expect_close(r, [0.0, 1.0], "residual(p=[1e-300, 1], q=[1, 1e-12])")


def random_pairs(n, V, seed):
    """n pairs of distributions over V tokens, with zeros in p and in q, as (n, V) float64."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, V, generator=g, dtype=F64) * (torch.rand(n, V, generator=g) > 0.3)
    q = torch.rand(n, V, generator=g, dtype=F64) * (torch.rand(n, V, generator=g) > 0.3)
    p[:, 0] += 1e-3  # no all-zero row
    q[:, -1] += 1e-3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def test_batched_shapes():
    """Any leading dimensions: p, q (B, k, V), x (B, k) -> accept_prob (B, k); residual (B, k, V), rows of 1."""
    p, q = random_pairs(24, 5, seed=1)
    p, q = p.view(4, 6, 5), q.view(4, 6, 5)
    x = torch.randint(0, 5, (4, 6), generator=torch.Generator().manual_seed(0))
    a = accept_prob(p, q, x)
    expect(a.shape == (4, 6) and a.dtype == F64,
           f"accept_prob on p, q (4, 6, 5) and x (4, 6): expected a float64 (4, 6), got {a.dtype} {tuple(a.shape)}")
    expect(bool(((a >= 0) & (a <= 1)).all()), f"accept_prob must lie in [0, 1], got {a.min().item()} .. "
                                               f"{a.max().item()}")
    one_by_one = torch.stack([torch.stack([accept_prob(p[b, j], q[b, j], x[b, j]) for j in range(6)])
                              for b in range(4)])
    expect_close(a, one_by_one, "accept_prob on a (4, 6) batch against each of its 24 rows alone", atol=1e-15)
    r = residual(p, q)
    expect(r.shape == (4, 6, 5) and r.dtype == F64,
           f"residual on p, q (4, 6, 5): expected a float64 (4, 6, 5), got {r.dtype} {tuple(r.shape)}")
    expect(bool((r >= 0).all()), f"residual must be a distribution: it has a negative entry {r.min().item()}")
    expect_close(r.sum(-1), torch.ones(4, 6, dtype=F64), "the sums of residual's rows (each must be 1)")


def step_law(p, q):
    """The exact law of one step, from your two functions: enumerate every draft x. P(out = y) =
    q(y) a(y) + (1 - sum_x q(x) a(x)) r(y). p, q (n, V) -> law (n, V), acceptance (n,)."""
    n, V = p.shape
    xs = torch.arange(V).expand(n, V)  # (n, V) every draft token, for each pair
    a = accept_prob(p[:, None, :].expand(n, V, V), q[:, None, :].expand(n, V, V), xs)  # (n, V)
    accepted = q * a  # (n, V) P(draft = x and accepted)
    return accepted + (1 - accepted.sum(-1, keepdim=True)) * residual(p, q), accepted.sum(-1)


@pytest.mark.parametrize("V", [2, 3, 6], ids=lambda V: f"V={V}")
def test_the_output_law_is_p_exactly(V):
    """GATE. Enumerate every draft x: the output's law must equal p, and the chance of accepting must be
    sum_y min(p(y), q(y)) (= 1 - TV(p, q)), on 200 random pairs of which some have p == q or q one-hot."""
    p, q = random_pairs(200, V, seed=V)
    q[::7] = p[::7]  # p == q: nothing left to normalise, in some rows of the batch only
    q[3::7] = torch.nn.functional.one_hot(torch.arange(3, 200, 7) % V, V).to(F64)  # point-mass drafts
    law, accepted = step_law(p, q)
    bad = (~torch.isclose(law, p, rtol=0, atol=1e-12)).any(-1).nonzero().flatten()
    expect(len(bad) == 0, f"the law of 'x ~ q, keep x with accept_prob, else draw from residual' must be p "
                          f"(V = {V}): {len(bad)} of 200 pairs differ; the first, p = {p[bad[0]].tolist() if len(bad) else 0}, "
                          f"q = {q[bad[0]].tolist() if len(bad) else 0}, gives {law[bad[0]].tolist() if len(bad) else 0}")
    expect_close(accepted, torch.minimum(p, q).sum(-1), f"the acceptance chance sum_x q(x) accept_prob(x) "
                                                          f"against sum min(p, q) (V = {V})")


def test_zero_mass_is_decided_row_by_row():
    """GATE. One batch: row 0 has p == q (nothing left: its residual is p), row 1 has mass left. Deciding
    'nothing left' once for the whole batch gives row 0 a NaN (0/0) or row 1 the wrong law."""
    p = t([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = t([[0.5, 0.5, 0.0], [0.6, 0.3, 0.1]])
    r = residual(p, q)
    expect_close(r[0], p[0], "residual row 0 (p == q there, in a batch whose row 1 has mass left): it must be p")
    expect_close(r[1], [0.0, 0.0, 1.0], "residual row 1 (p = [0.2, 0.3, 0.5], q = [0.6, 0.3, 0.1]), in a batch "
                                        "whose row 0 has p == q")
    r_swapped = residual(p.flip(0), q.flip(0))
    expect_close(r_swapped, r.flip(0), "residual on the same two rows in the other order")


def test_the_output_law_is_p_when_sampled():
    """GATE. 200,000 seeded draws of the step, total variation to p within tv_bound (wrong with prob < 1e-6)."""
    p, q = t([0.1, 0.0, 0.5, 0.15, 0.25]), t([0.4, 0.3, 0.1, 0.2, 0.0])
    n, g = 200_000, torch.Generator().manual_seed(0)
    x = torch.multinomial(q, n, replacement=True, generator=g)  # (n,) drafts
    keep = torch.rand(n, generator=g, dtype=F64) < accept_prob(p.expand(n, 5), q.expand(n, 5), x)
    fallback = torch.multinomial(residual(p, q).clamp(min=0).nan_to_num(1.0), n, replacement=True, generator=g)
    out = torch.where(keep, x, fallback)
    law = empirical_law(out, 5)
    expect_law(tv(law, p), tv_bound(5, n), "the sampled law of one step (accept_prob, then residual) against p",
               law, p)
