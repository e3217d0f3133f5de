"""Exercise 9 (EXERCISES.md): `grow_tree` in nanospec/steps/eagle_tree.py, EAGLE-2's tree of guesses grown by
confidence. A scripted head (its law depends only on the token it is fed) makes every step readable: the
docstring's example, a deeper tree with the exact tokens, positions, masks and features the head must be fed,
the rerank and its ties, the cache left as it was. Then a random head against the slow sequential oracle,
tests/toys.py's slow_tree.

The head's cache here is a stand-in (`ScriptedCache`, or a KVCache with its own rollback), so these tests
grade exercise 9 alone, whether or not exercise 5 (KVCache.rollback) is done.
Run: python -m pytest -m ex9"""
import pytest
import torch

from nanospec.steps.eagle_tree import grow_tree
from nanospec.model.drafters.eagle import eagle_config
from nanospec.model.cache import KVCache
from nanospec.model.gpt import Output
from nanospec.steps.run import tensor
from toys import random_head, random_ids, slow_tree, tiny_gpt

pytestmark = pytest.mark.ex9


class ScriptedHead:
    """A draft head whose law of the next token depends only on the token it is fed (Q[token]), and whose
    output feature is that token's id in every channel. It records what every call was fed."""

    def __init__(self, Q):
        self.Q, self.calls = Q, []

    def __call__(self, target, tokens, features, pos=None, cache=None, mask=None):
        ids = tokens[0].tolist()
        self.calls.append({"tokens": ids, "pos": None if pos is None else pos.tolist(),
                           "mask": None if mask is None else mask.int().tolist(),
                           "features": None if features is None else features[0, :, 0].tolist()})
        if cache is not None:
            cache.advance(len(ids))
        logits = torch.log(torch.tensor([self.Q[t] for t in ids], dtype=torch.float64) + 1e-30)[None]  # (1, T, V)
        hidden = torch.tensor(ids, dtype=torch.float64)[None, :, None].expand(1, len(ids), 3)  # (1, T, 3)
        return Output(logits=logits, hidden=hidden)


class ScriptedCache:
    """What grow_tree uses of the head's KVCache: its length, its device, advance (the head calls it) and
    rollback (as exercise 5 defines it, for a cache whose layers all hold the same number of tokens)."""

    def __init__(self, length):
        self.length, self.device, self.rollbacks = length, torch.device("cpu"), []

    def advance(self, T):
        self.length += T

    def rollback(self, length):
        self.rollbacks.append(length)
        self.length = length


# tokens: 0 "(", 1 "x", 2 "self", 3 ")", 4 ",", 5 other. Q[t]: the head's law of the token after t.
DOCSTRING_Q = {0: [0, 0.6, 0.3, 0, 0, 0.1], 1: [0, 0, 0, 0.9, 0.05, 0.05], 2: [0, 0, 0, 0.5, 0.4, 0.1]}


def test_docstring_example():
    head, cache = ScriptedHead(DOCSTRING_Q), ScriptedCache(5)
    draft = head(None, torch.tensor([[0]]), None)  # the head's output at the root's slot
    tokens, parents = grow_tree(head, None, cache, 0, draft, depth=2, width=2, total_tokens=4)
    assert (tokens, parents) == ([0, 1, 2, 3], [-1, 0, 0, 1]), \
        f"grow_tree on the docstring's head (depth 2, width 2, 4 tokens): expected ([0, 1, 2, 3], [-1, 0, 0, 1]), " \
        f"got {(tokens, parents)}"


DEEP_Q = {0: [0, 0.6, 0.3, 0, 0, 0.1], 1: [0, 0, 0, 0.9, 0.06, 0.04], 2: [0, 0, 0, 0.5, 0.4, 0.1],
          3: [0.7, 0.2, 0, 0, 0, 0.1], 4: [0, 0.5, 0.45, 0, 0, 0.05]}


def test_a_deeper_tree_and_what_the_head_is_fed():
    """width 2, depth 3, total 6, the root 0 at position L = 5. Scores (sum of log q on the path):
      depth 1: x(1) -0.51, self(2) -1.20            -> both expanded
      depth 2: under x: )(3) -0.62, ,(4) -3.32; under self: ) -1.90, , -2.12   -> expand ")"|x and ")"|self
      depth 3: under ")"|x: ((0) -0.97, x -2.23; under ")"|self: ( -2.25, x -3.51
    The 5 best of all: x, ")"|x, "("|")"|x, self, ")"|self; in creation order under the root 0."""
    L = 5
    head, cache = ScriptedHead(DEEP_Q), ScriptedCache(L)
    draft = head(None, torch.tensor([[0]]), None)
    tokens, parents = grow_tree(head, None, cache, 0, draft, depth=3, width=2, total_tokens=6)
    assert (tokens, parents) == ([0, 1, 2, 3, 3, 0], [-1, 0, 0, 1, 2, 3]), \
        f"grow_tree (depth 3, width 2, 6 tokens): expected ([0, 1, 2, 3, 3, 0], [-1, 0, 0, 1, 2, 3]), got {(tokens, parents)}"
    assert len(head.calls) == 3, f"depth 3 takes exactly two head passes after the draft, got {len(head.calls) - 1}"
    first, second = head.calls[1:]  # call 0 made the draft above; depth 3 takes two passes
    prefix = [1] * L
    # pass 1: the depth-1 nodes x, self at position L + 1, each seeing the prefix and itself; both read the
    # root's feature (the draft's output: token 0)
    assert (first["tokens"], first["pos"]) == ([1, 2], [L + 1, L + 1]), \
        f"head pass 1 must feed x, self at position {L + 1}, got tokens {first['tokens']} at {first['pos']}"
    assert first["mask"] == [prefix + [1, 0], prefix + [0, 1]], \
        f"head pass 1's mask (frontier_mask): each node sees the prefix and itself, got {first['mask']}"
    assert first["features"] == [0, 0], f"head pass 1 must read the root's feature [0, 0], got {first['features']}"
    # pass 2: ")"|x and ")"|self at L + 2, each seeing the prefix, its parent (fed in pass 1) and itself, and
    # reading its parent's output feature (x's is 1, self's is 2)
    assert (second["tokens"], second["pos"]) == ([3, 3], [L + 2, L + 2]), \
        f"head pass 2 must feed ')' under x and under self at {L + 2}, got {second['tokens']} at {second['pos']}"
    assert second["mask"] == [prefix + [1, 0, 1, 0], prefix + [0, 1, 0, 1]], \
        f"head pass 2's mask (frontier_mask): each node sees the prefix, its parent fed in pass 1, and itself, " \
        f"got {second['mask']}"
    assert second["features"] == [1, 2], f"head pass 2 must read its parents' features [1, 2], got {second['features']}"


def test_the_cache_is_left_as_it_was():
    """The head's passes write the guessed nodes into its cache; grow_tree must roll them back to L."""
    head, cache = ScriptedHead(DEEP_Q), ScriptedCache(5)
    draft = head(None, torch.tensor([[0]]), None)
    grow_tree(head, None, cache, 0, draft, depth=3, width=2, total_tokens=6)
    assert cache.length == 5 and cache.rollbacks == [5], \
        f"grow_tree must roll the head's cache back to 5 once, got length {cache.length}, rollbacks {cache.rollbacks}"


def test_depth_one_is_the_top_guesses_of_the_draft():
    """No head pass: the root's best `width` tokens, cut to total_tokens - 1 by score, in creation order."""
    head, cache = ScriptedHead({0: [0.1, 0.4, 0.3, 0.2]}), ScriptedCache(3)
    draft = head(None, torch.tensor([[0]]), None)
    got = grow_tree(head, None, cache, 7, draft, depth=1, width=3, total_tokens=3)
    assert got == ([7, 1, 2], [-1, 0, 0]), f"grow_tree depth 1, width 3, 3 tokens: expected ([7, 1, 2], [-1, 0, 0]), got {got}"
    assert len(head.calls) == 1 and cache.length == 3, "depth 1 needs no head pass and leaves the cache as it was"
    # no room for a guess, or no depth: the root alone
    got = grow_tree(head, None, cache, 7, draft, depth=2, width=3, total_tokens=1)
    assert got == ([7], [-1]), f"grow_tree with total_tokens=1 (no room for a guess): expected ([7], [-1]), got {got}"
    got = grow_tree(head, None, cache, 7, draft, depth=0, width=3, total_tokens=5)
    assert got == ([7], [-1]), f"grow_tree with depth 0: expected ([7], [-1]), got {got}"


def test_ties_keep_the_older_node():
    """A head certain of everything: every node scores log 1 = 0. The rerank breaks ties by creation order,
    so with room for 2 guesses the kept ones are the first node and its child, never an orphan."""
    head, cache = ScriptedHead({0: [0, 1.0, 0], 1: [0, 0, 1.0], 2: [1.0, 0, 0]}), ScriptedCache(4)
    draft = head(None, torch.tensor([[0]]), None)
    tokens, parents = grow_tree(head, None, cache, 0, draft, depth=3, width=1, total_tokens=3)
    assert (tokens, parents) == ([0, 1, 2], [-1, 0, 1]), \
        f"grow_tree with every score tied: the older nodes win, expected ([0, 1, 2], [-1, 0, 1]), got {(tokens, parents)}"


class OneLayerCache(KVCache):
    """The real head's cache, with rollback as exercise 5 defines it for its single layer."""

    def rollback(self, length):
        self.layer_lengths = [length]


@torch.no_grad()
@pytest.mark.parametrize("seed", range(2), ids=lambda s: f"seed-{s}")
def test_random_head_grows_the_slow_oracles_tree(seed):
    """A random EAGLE head on a random tiny GPT: the batched, masked passes must grow exactly the tree that
    tests/toys.py's slow_tree grows one plain forward per node (no cache, no mask)."""
    target = tiny_gpt(seed)
    head = random_head(target, seed)
    seq = random_ids(5 + seed, seed=seed)  # x_0..x_L, x_L = the root
    features = target(tensor(seq[:-1], "cpu")).hidden[0]  # (L, C) the target's features f_0..f_{L-1}
    cache = OneLayerCache(eagle_config(target.config), dtype=torch.float64)
    draft = head(target, tensor(seq[1:], "cpu"), features[None], cache=cache)
    for depth, width, total in [(2, 3, 6), (3, 2, 7), (4, 3, 40)]:
        got = grow_tree(head, target, cache, seq[-1], draft, depth, width, total)
        case = f"grow_tree(depth={depth}, width={width}, total_tokens={total}) with a random head"
        assert cache.length == len(seq) - 1, f"{case}: the head's cache must be back at {len(seq) - 1}, got {cache.length}"
        want = slow_tree(head, target, seq[1:], features, seq[-1], depth, width, total)
        assert got == want, f"{case}: expected the slow oracle's tree {want}, got {got}"
        tokens, parents = got
        size = min(total, width + (depth - 1) * width * width + 1)
        assert len(tokens) == size, f"{case}: expected {size} nodes, got {len(tokens)}"
