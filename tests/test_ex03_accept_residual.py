"""Exercise 3 (EXERCISES.md): `accept_prob` and `residual` in nanospec/verify.py, the two pieces of every lossless
rule. Literal values, the edge cases (q(x) = 0, p = q, point masses), batched shapes, then the law itself:
draft x ~ q, accept with accept_prob, else draw from residual; the output must follow p, exactly by
enumeration and within a stated bound by sampling.
Run: python -m pytest -m ex3"""
import pytest
import torch

from nanospec.verify import accept_prob, residual
from test_verify import empirical_law, tv, tv_bound

pytestmark = pytest.mark.ex3

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def test_docstring_example():
    p, q = t([0.2, 0.8]), t([0.6, 0.4])
    assert accept_prob(p, q, torch.tensor(0)).item() == pytest.approx(1 / 3, abs=1e-12)
    assert accept_prob(p, q, torch.tensor(1)).item() == pytest.approx(1.0, abs=1e-12)
    assert torch.allclose(residual(p, q), t([0.0, 1.0]), atol=1e-12)


def test_a_token_the_draft_cannot_draw():
    """q(x) = 0: accepted if p(x) > 0 (it never happens for a real draw; no 0/0), and 0 if p(x) = 0 too."""
    p, q = t([0.5, 0.5, 0.0]), t([1.0, 0.0, 0.0])
    assert accept_prob(p, q, torch.tensor(1)).item() == 1.0
    assert accept_prob(p, q, torch.tensor(2)).item() == 0.0


def test_residual_when_nothing_is_left():
    """p == q: no rejection can happen, and residual returns p (no division by zero, no NaN)."""
    p = t([0.25, 0.75, 0.0])
    assert torch.equal(residual(p, p.clone()), p)


def test_point_mass_and_empty_drafts():
    """q = one_hot(x): p without x, renormalised (the rule for guesses); q = 0: p itself (the bonus)."""
    p = t([0.5, 0.3, 0.2])
    assert torch.allclose(residual(p, t([1.0, 0.0, 0.0])), t([0.0, 0.6, 0.4]), atol=1e-12)
    assert torch.allclose(residual(p, torch.zeros(3, dtype=F64)), p, atol=1e-12)
    assert accept_prob(p, t([0.0, 1.0, 0.0]), torch.tensor(1)).item() == pytest.approx(0.3, abs=1e-12)


def test_extreme_ratios_stay_finite():
    p, q = t([1e-300, 1.0 - 1e-300]), t([1.0 - 1e-12, 1e-12])
    a = accept_prob(p.expand(2, 2), q.expand(2, 2), torch.tensor([0, 1]))  # (2,): x = 0, x = 1
    r = residual(p, q)
    assert torch.isfinite(a).all() and torch.isfinite(r).all()
    assert a[1].item() == 1.0 and a[0].item() < 1e-290
    assert torch.allclose(r, t([0.0, 1.0]), atol=1e-12)


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
    x = torch.randint(0, 5, (4, 6))
    a = accept_prob(p, q, x)
    assert a.shape == (4, 6) and a.dtype == F64 and (a >= 0).all() and (a <= 1).all()
    for b in range(4):
        for j in range(6):
            assert a[b, j].item() == pytest.approx(accept_prob(p[b, j], q[b, j], x[b, j]).item(), abs=1e-15)
    r = residual(p, q)
    assert r.shape == (4, 6, 5) and r.dtype == F64 and (r >= 0).all()
    assert torch.allclose(r.sum(-1), torch.ones(4, 6, dtype=F64), atol=1e-12)


def test_the_output_law_is_p_exactly():
    """Enumerate every draft x: P(out = y) = q(y) a(y) + sum_x q(x) (1 - a(x)) r(y) must equal p(y), and the
    chance of accepting must be sum_y min(p(y), q(y)) (= 1 - TV(p, q))."""
    for V in (2, 3, 6):
        p, q = random_pairs(200, V, seed=V)
        xs = torch.arange(V).expand(200, V)  # (200, V) every draft token, for each pair
        a = accept_prob(p[:, None, :].expand(200, V, V), q[:, None, :].expand(200, V, V), xs)  # (200, V)
        accepted = q * a  # (200, V) P(draft = x and accepted)
        law = accepted + (1 - accepted.sum(-1, keepdim=True)) * residual(p, q)
        assert torch.allclose(law, p, atol=1e-12), V
        assert torch.allclose(accepted.sum(-1), torch.minimum(p, q).sum(-1), atol=1e-12), V


def test_the_output_law_is_p_when_sampled():
    """200,000 seeded draws of the step, total variation to p within tv_bound (wrong with prob < 1e-6)."""
    p, q = t([0.1, 0.0, 0.5, 0.15, 0.25]), t([0.4, 0.3, 0.1, 0.2, 0.0])
    n, g = 200_000, torch.Generator().manual_seed(0)
    x = torch.multinomial(q, n, replacement=True, generator=g)  # (n,) drafts
    keep = torch.rand(n, generator=g, dtype=F64) < accept_prob(p.expand(n, 5), q.expand(n, 5), x)
    fallback = torch.multinomial(residual(p, q), n, replacement=True, generator=g)  # (n,)
    out = torch.where(keep, x, fallback)
    assert tv(empirical_law(out, 5), p) < tv_bound(5, n)
