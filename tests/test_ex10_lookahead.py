"""Exercise 10 (EXERCISES.md): `remember`, `learn` and `build_tree` in nanospec/decoding/lookahead.py: the n-gram
pool and the one tree that holds the verification branch (a trie of pooled n-grams) and the Jacobi window.
Literal pools and trees (the docstrings' examples and the module's drawn layout), then what every window node
must see, read from its root-to-node path.
Run: python -m pytest -m ex10"""
import random

import pytest

from nanospec.decoding.lookahead import build_tree, learn, remember
from nanospec.rules.tree import path_to

pytestmark = pytest.mark.ex10


def test_remember_keeps_the_newest_few_per_key():
    pool = {}
    remember(pool, 7, (1, 2), 2)
    remember(pool, 7, (3, 4), 2)
    remember(pool, 8, (5, 6), 2)
    assert pool == {7: [(1, 2), (3, 4)], 8: [(5, 6)]}, f"remember: n-grams under their key, oldest first, got {pool}"
    remember(pool, 7, (1, 2), 2)  # seen again: it becomes the newest, not a duplicate
    assert pool[7] == [(3, 4), (1, 2)], f"remember (1, 2) again under 7: it must move to the newest place, got {pool[7]}"
    remember(pool, 7, (9, 9), 2)  # a third one: the oldest goes
    assert pool[7] == [(1, 2), (9, 9)], f"remember a third n-gram with guesses=2: the oldest goes, got {pool[7]}"


def test_remember_with_no_room_keeps_nothing():
    pool = {}
    remember(pool, 3, (1, 1), 0)
    assert pool.get(3, []) == [], f"remember with guesses=0 must keep nothing, got {pool}"


def test_learn_docstring_example():
    pool = {}
    learn(pool, [4, 7, 4, 8], 1, 3, 5)
    assert pool == {7: [(4, 8)]}, f"learn([4, 7, 4, 8], new=1, N=3): expected {{7: [(4, 8)]}}, got {pool}"


def test_learn_a_whole_prompt_then_only_the_new_tokens():
    """A prompt: every n-gram (N = 3) under its first token, in order. Then 2 new tokens: only the n-grams
    that end in them."""
    pool = {}
    seq = [1, 2, 3, 1, 2, 4]
    learn(pool, seq, len(seq), 3, 4)
    want = {1: [(2, 3), (2, 4)], 2: [(3, 1)], 3: [(1, 2)]}
    assert pool == want, f"learn of the whole prompt {seq} (N=3): expected {want}, got {pool}"
    seq += [2, 3]
    learn(pool, seq, 2, 3, 4)  # n-grams (2, 4, 2) and (4, 2, 3)
    want = {1: [(2, 3), (2, 4)], 2: [(3, 1), (4, 2)], 3: [(1, 2)], 4: [(2, 3)]}
    assert pool == want, f"learn of 2 new tokens: only (2, 4, 2) and (4, 2, 3) are new, expected {want}, got {pool}"
    learn(pool, [5], 1, 3, 4)  # shorter than an n-gram: nothing to learn
    assert 5 not in pool, f"learn([5]) is shorter than an n-gram and must learn nothing, got {pool}"


def test_build_tree_docstring_example():
    got = build_tree(7, [(5, 9), (5, 3)], [[4], [6, 8]])
    want = ([7, 5, 9, 3, 4, 6, 8], [-1, 0, 1, 1, 0, 0, 4], [[4], [5, 6]], [0, 4])
    assert got == want, f"build_tree(7, [(5, 9), (5, 3)], [[4], [6, 8]]): expected (tokens, parents, where, chain) " \
                        f"{want}, got {got}"


def test_build_tree_the_drawn_layout():
    """lookahead.py's drawing: W = 3, N = 3, one candidate [c1, c2]; nodes x c1 c2 a0 a1 b0 b1 b2."""
    x, c1, c2, a0, a1, b0, b1, b2 = range(8)
    got = build_tree(x, [(c1, c2)], [[a0, a1], [b0, b1, b2]])
    # c1 under x; a0 under x, a1 under a0; b_i under column i
    want = (list(range(8)), [-1, 0, 1, 0, 3, 0, 3, 4], [[3, 4], [5, 6, 7]], [0, 3, 4])
    assert got == want, f"build_tree on lookahead.py's drawing (W = 3, N = 3): expected {want}, got {got}"


def test_build_tree_shares_prefixes_and_can_skip_the_window():
    """Pooled n-grams with a common start share its node (each guess is checked once); without levels (the
    last steps before the context's end) the tree is the trie alone."""
    got = build_tree(0, [(1, 2, 3), (1, 2, 4), (1, 5, 6)], [])
    want = ([0, 1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 2, 1, 5], [[]], [0])
    assert got == want, f"build_tree with shared prefixes and no window: expected {want}, got {got}"


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
        case = f"build_tree(99, {grams}, {levels})"
        assert all(p < i for i, p in enumerate(parents)) and parents[0] == -1, \
            f"{case}: parents {parents} must start with -1 and put every parent before its children"
        size = 1 + len({g[:d] for g in grams for d in range(1, N)}) + W - 1 + W * (N - 2)
        assert len(tokens) == size, f"{case}: expected {size} nodes (shared prefixes once), got {len(tokens)}"
        assert [tokens[n] for n in chain] == [99] + levels[0] and len(where) == N - 1, \
            f"{case}: the chain must hold [99] + level 0, got {[tokens[n] for n in chain]}"
        for level in range(1, N - 1):
            for i in range(W):
                seen = [tokens[n] for n in path_to(parents, where[level][i])]
                want = [99] + levels[0][:i] + [levels[lv][i] for lv in range(1, level + 1)]
                assert seen == want, f"{case}: level {level}, column {i} must see its Jacobi trajectory {want}, sees {seen}"
        trie = {tuple(tokens[n] for n in path_to(parents, node))[1:] for node in range(1, len(tokens))}
        missing = [g for g in grams if any(g[:d] not in trie for d in range(1, N))]
        assert not missing, f"{case}: the pooled n-grams {missing} are not paths from the root"
