"""scripts/head_bound.py: the chance a guess blind to the token sampled before it is accepted at t=1.
`best_blind` is held to a brute-force search over the simplex, and to the marginal and any other law it must beat;
`bound` runs on a toy target: every figure a probability, the head and the marginal never above the best."""
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from toys import tiny_gpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import head_bound  # noqa: E402  (a script, not a package module)


def test_the_docstring_examples():
    p2, w = torch.tensor([[0.9, 0.1], [0.1, 0.9]], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert head_bound.acceptance(torch.eye(2, dtype=torch.float64), w, w) == pytest.approx(0.5)
    best, q = head_bound.best_blind(p2, w)
    assert best == pytest.approx(0.6) and q.sum() == pytest.approx(1.0)


def test_best_blind_is_the_maximum_over_the_simplex():
    g = torch.Generator().manual_seed(0)
    grid = [torch.tensor([a, b, 1 - a - b], dtype=torch.float64) for a, b in
            itertools.product(np.linspace(0, 1, 101), repeat=2) if a + b <= 1 + 1e-12]
    for _ in range(5):
        p2 = torch.softmax(2 * torch.randn(4, 3, generator=g, dtype=torch.float64), -1)  # 4 tokens x, V = 3
        w = torch.softmax(torch.randn(4, generator=g, dtype=torch.float64), -1)
        best, q = head_bound.best_blind(p2, w)
        searched = max(head_bound.acceptance(p2, w, c.clamp(min=0)) for c in grid)
        assert searched <= best + 1e-9 and best - searched < 0.01  # the grid's step is 0.01
        assert (q >= 0).all() and q.sum() == pytest.approx(1.0) and head_bound.acceptance(p2, w, q) == pytest.approx(best)


def test_the_best_beats_the_marginal_and_any_law_and_is_1_when_x_changes_nothing():
    g = torch.Generator().manual_seed(1)
    p2 = torch.softmax(3 * torch.randn(6, 20, generator=g, dtype=torch.float64), -1)
    w = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    best, _ = head_bound.best_blind(p2, w)
    marginal = head_bound.acceptance(p2, w, (w[:, None] * p2).sum(0))
    assert marginal <= best + 1e-12 and best < 1.0
    for _ in range(20):
        assert head_bound.acceptance(p2, w, torch.softmax(torch.randn(20, generator=g, dtype=torch.float64), -1)) <= best
    same = p2[:1].expand(6, -1)  # token t+1 changes nothing: the law of t+2 itself is accepted every time
    assert head_bound.best_blind(same, w)[0] == pytest.approx(1.0)
    assert head_bound.acceptance(same, w, p2[0]) == pytest.approx(1.0)


def test_bound_on_a_toy_target():
    target = tiny_gpt(3)
    tokens = np.random.default_rng(0).integers(0, 11, 500).astype(np.uint16)
    out = head_bound.bound(target, tokens, contexts=4, length=10, top=11)
    assert all(len(v) == 4 for v in out.values())
    assert out["covered"] == pytest.approx([1.0] * 4)  # every one of the 11 tokens followed
    for h, m, b in zip(out["head"], out["marginal"], out["best"]):
        assert 0 < h <= b + 1e-12 and 0 < m <= b + 1e-12 and b <= 1
