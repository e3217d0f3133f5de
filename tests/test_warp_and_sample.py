"""
What every rule draws with, and the laws it draws from (nanospec/rules/verify.py): `warp` turns logits into the
warped law (temperature, top-k, top-p; temperature 0 is one-hot at the first maximum), row by row with no hidden
state, so target and draft are warped alike; `sample` (Gumbel-max) draws each row from its law and never a token
of probability 0. Literal cases, a hypothesis property of top-p, and each row's sampled law within `tv_bound`
(tests/laws.py).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.rules.verify import pick_token, sample, warp
from laws import F64, N_DRAWS, dist, empirical_law, tv, tv_bound


# ---------------------------------------------------------------------------------------------------------
# warp


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


# ---------------------------------------------------------------------------------------------------------
# sample


def test_sample_law_and_shape():
    g = torch.Generator().manual_seed(0)
    p = dist([0.1, 0.0, 0.6, 0.3])
    draws = sample(p.expand(N_DRAWS, 4), g)
    assert draws.shape == (N_DRAWS,)
    assert (draws != 1).all()  # a zero-probability token is never drawn
    assert tv(empirical_law(draws, 4), p) < tv_bound(4, N_DRAWS)
    assert sample(p, g).shape == ()


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


def test_pick_token_is_a_draw_from_warp_and_greedy_its_argmax():
    """pick_token (a plain step's token: `ar`'s and every method's): greedy, the argmax itself (the first on a tie,
    as warp's one-hot), drawing nothing; sampled, exactly sample(warp(...)) with the same generator."""
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.1, 0.2, 0.4]], dtype=F64)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    assert pick_token(logits, 0.0, generator=g).tolist() == sample(warp(logits, 0.0)).tolist() == [1, 0]
    assert torch.equal(g.get_state(), state)  # greedy draws nothing
    for settings_ in ((1.0, None, None), (0.7, 3, 0.9)):
        want = sample(warp(logits, *settings_), torch.Generator().manual_seed(5))
        assert torch.equal(pick_token(logits, *settings_, generator=torch.Generator().manual_seed(5)), want)
