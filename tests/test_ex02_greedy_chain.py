"""Exercise 2 (EXERCISES.md): `verify_chain_greedy` in nanospec/rules/verify.py: accept guesses while they equal the
target's argmax, then emit the argmax after the last accepted one. Literal cases at every place a guess can
fail, all accepted plus the bonus, no guesses, ties, then random chains.
Run: python -m pytest -m ex2"""
import random

import pytest
import torch

from nanospec.rules.verify import verify_chain_greedy

pytestmark = pytest.mark.ex2


def logits_with_argmax(best, V=10, seed=0):
    """(len(best), V) logits whose row i has its maximum at best[i], the other entries random and lower."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(len(best), V, generator=g, dtype=torch.float64)
    logits[torch.arange(len(best)), torch.tensor(best)] = 2.0
    return logits


TARGET = [5, 9, 7, 3, 6]  # the target's argmax after [last, d1, d2, d3, d4]


@pytest.mark.parametrize("draft, expected", [
    ([4, 9, 7, 3], (0, 5)),  # the first guess is wrong: nothing accepted, emit the target's 5
    ([5, 1, 7, 3], (1, 9)),  # a wrong guess in the middle: the later right guesses do not count
    ([5, 9, 7, 8], (3, 3)),  # the last guess is wrong
    ([5, 9, 7, 3], (4, 6)),  # all four accepted, plus the bonus: 5 tokens from one forward
    ([], (0, 5)),  # no guesses (nothing to draft): a plain decoding step
], ids=["first-wrong", "middle-wrong", "last-wrong", "all-accepted", "no-guesses"])
def test_literal(draft, expected):
    logits = logits_with_argmax(TARGET[:len(draft) + 1])
    got = verify_chain_greedy(logits, torch.tensor(draft, dtype=torch.long))
    assert got == expected, (f"verify_chain_greedy, draft {draft}, target argmax {TARGET[:len(draft) + 1]}: expected "
                             f"(n_accepted, next_token) = {expected}, got {got}")


def test_docstring_example():
    got = verify_chain_greedy(logits_with_argmax([5, 9, 7, 3]), torch.tensor([5, 9, 2]))
    assert got == (2, 7), f"verify_chain_greedy, draft [5, 9, 2], argmax [5, 9, 7, 3]: expected (2, 7), got {got}"


def test_returns_python_ints_and_takes_a_list_too():
    n, nxt = verify_chain_greedy(logits_with_argmax([5, 9, 7, 3]), [5, 9, 2])
    assert (n, nxt) == (2, 7) and type(n) is int and type(nxt) is int, \
        f"verify_chain_greedy with a list draft [5, 9, 2]: expected Python ints (2, 7), got {(n, nxt)!r} " \
        f"of types {type(n).__name__}, {type(nxt).__name__}"


def test_ties_go_to_the_first_maximum():
    """The same tie-break as warp(logits, 0) and torch.argmax: the lowest index among equal maxima."""
    logits = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    got = verify_chain_greedy(logits, torch.tensor([2]))
    assert got == (0, 1), f"ties: row 0 is [1, 3, 3], its argmax is 1 (the first maximum); draft [2]: expected (0, 1), got {got}"
    got = verify_chain_greedy(logits, torch.tensor([1]))
    assert got == (1, 0), f"ties: rows [1, 3, 3] and [2, 2, 0], draft [1]: expected (1, 0), got {got}"


def test_random_chains():
    """A draft that copies the argmax up to position j and then errs is accepted exactly up to j."""
    rng = random.Random(0)
    for trial in range(200):
        k, V = rng.randrange(1, 8), rng.randrange(2, 20)
        logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(trial), dtype=torch.float64)
        best = logits.argmax(-1).tolist()
        j = rng.randrange(k + 1)  # j == k: every guess right
        draft = best[:j] + [(b + 1 + rng.randrange(V - 1)) % V for b in best[j:k]]
        got = verify_chain_greedy(logits, torch.tensor(draft))
        assert got == (j, best[j]), f"verify_chain_greedy, draft {draft}, argmax {best}: expected {(j, best[j])}, got {got}"
