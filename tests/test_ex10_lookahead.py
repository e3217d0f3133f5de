"""Exercise 10 (EXERCISES.md): `remember`, `learn` and `build_tree` in nanospec/decoding/lookahead.py: the n-gram
pool and the one tree that holds the verification branch (a trie of pooled n-grams) and the Jacobi window.
Literal pools and trees (the docstrings' examples and the module's drawn layout), then what every window node
must see, read from its root-to-node path.
Run: python -m pytest -m ex10"""
import random

import pytest

from nanospec.decoding.lookahead import build_tree, learn, remember
from nanospec.tree import path_to

pytestmark = pytest.mark.ex10


def test_remember_keeps_the_newest_few_per_key():
    pool = {}
    remember(pool, 7, (1, 2), 2)
    remember(pool, 7, (3, 4), 2)
    remember(pool, 8, (5, 6), 2)
    assert pool == {7: [(1, 2), (3, 4)], 8: [(5, 6)]}
    remember(pool, 7, (1, 2), 2)  # seen again: it becomes the newest, not a duplicate
    assert pool[7] == [(3, 4), (1, 2)]
    remember(pool, 7, (9, 9), 2)  # a third one: the oldest goes
    assert pool[7] == [(1, 2), (9, 9)]


def test_remember_with_no_room_keeps_nothing():
    pool = {}
    remember(pool, 3, (1, 1), 0)
    assert pool.get(3, []) == []


def test_learn_docstring_example():
    pool = {}
    learn(pool, [4, 7, 4, 8], 1, 3, 5)
    assert pool == {7: [(4, 8)]}


def test_learn_a_whole_prompt_then_only_the_new_tokens():
    """A prompt: every n-gram (N = 3) under its first token, in order. Then 2 new tokens: only the n-grams
    that end in them."""
    pool = {}
    seq = [1, 2, 3, 1, 2, 4]
    learn(pool, seq, len(seq), 3, 4)
    assert pool == {1: [(2, 3), (2, 4)], 2: [(3, 1)], 3: [(1, 2)]}
    seq += [2, 3]
    learn(pool, seq, 2, 3, 4)  # n-grams (2, 4, 2) and (4, 2, 3)
    assert pool == {1: [(2, 3), (2, 4)], 2: [(3, 1), (4, 2)], 3: [(1, 2)], 4: [(2, 3)]}
    learn(pool, [5], 1, 3, 4)  # shorter than an n-gram: nothing to learn
    assert 5 not in pool


def test_build_tree_docstring_example():
    tokens, parents, where, chain = build_tree(7, [(5, 9), (5, 3)], [[4], [6, 8]])
    assert tokens == [7, 5, 9, 3, 4, 6, 8]
    assert parents == [-1, 0, 1, 1, 0, 0, 4]
    assert where == [[4], [5, 6]] and chain == [0, 4]


def test_build_tree_the_drawn_layout():
    """lookahead.py's drawing: W = 3, N = 3, one candidate [c1, c2]; nodes x c1 c2 a0 a1 b0 b1 b2."""
    x, c1, c2, a0, a1, b0, b1, b2 = range(8)
    tokens, parents, where, chain = build_tree(x, [(c1, c2)], [[a0, a1], [b0, b1, b2]])
    assert tokens == list(range(8))
    assert parents == [-1, 0, 1, 0, 3, 0, 3, 4]  # c1 under x; a0 under x, a1 under a0; b_i under column i
    assert where == [[3, 4], [5, 6, 7]] and chain == [0, 3, 4]


def test_build_tree_shares_prefixes_and_can_skip_the_window():
    """Pooled n-grams with a common start share its node (each guess is checked once); without levels (the
    last steps before the context's end) the tree is the trie alone."""
    tokens, parents, where, chain = build_tree(0, [(1, 2, 3), (1, 2, 4), (1, 5, 6)], [])
    assert tokens == [0, 1, 2, 3, 4, 5, 6]
    assert parents == [-1, 0, 1, 2, 2, 1, 5]
    assert where == [[]] and chain == [0]


def test_every_window_node_sees_its_jacobi_trajectory():
    """For random windows and pools: window column i at level l must see (on its root-to-node path) exactly
    x, level 0's columns before i, then column i of levels 1..l: the sequence whose next token Jacobi
    iteration asks the target for. Each pooled n-gram must be a path from the root, and nodes come after
    their parents."""
    rng = random.Random(0)
    for _ in range(100):
        W, N = rng.randrange(1, 5), rng.randrange(3, 6)
        levels = [[rng.randrange(50) for _ in range(W - (level == 0))] for level in range(N - 1)]
        grams = [tuple(rng.randrange(3) for _ in range(N - 1)) for _ in range(rng.randrange(4))]
        tokens, parents, where, chain = build_tree(99, grams, levels)
        assert all(p < i for i, p in enumerate(parents)) and parents[0] == -1
        assert len(tokens) == 1 + len({g[:d] for g in grams for d in range(1, N)}) + W - 1 + W * (N - 2)
        assert [tokens[n] for n in chain] == [99] + levels[0] and len(where) == N - 1
        for level in range(1, N - 1):
            for i in range(W):
                seen = [tokens[n] for n in path_to(parents, where[level][i])]
                assert seen == [99] + levels[0][:i] + [levels[lv][i] for lv in range(1, level + 1)]
        trie = {tuple(tokens[n] for n in path_to(parents, node))[1:] for node in range(1, len(tokens))}
        assert all(g[:d] in trie for g in grams for d in range(1, N))
