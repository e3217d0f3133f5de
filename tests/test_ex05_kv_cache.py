"""Exercise 5 (EXERCISES.md): `KVCache.rollback` and `KVCache.compact` in nanospec/model/cache.py: after a verify
forward, keep what was accepted and forget the rest. The cache's lengths after each operation, the slots'
contents literally, and the one check that matters: the next forward sees exactly what a fresh forward over
the accepted text would (tiny random float64 GPTs; tree layouts written out by hand, not by tree.py).
Run: python -m pytest -m ex5"""
import random

import pytest
import torch

from nanospec.model.cache import KVCache
from nanospec.model.gpt import GPTConfig
from toys import TOL, full_logits, random_ids, tiny_gpt

pytestmark = pytest.mark.ex5


def numbered_cache(length, n_layer=2):
    """A cache whose slot s holds the value s in every key and value entry: moves are easy to read."""
    cache = KVCache(GPTConfig(n_layer=n_layer, n_head=1, n_embd=2, block_size=12), dtype=torch.float64)
    slots = torch.arange(12, dtype=torch.float64)[:, None].expand(12, 2)  # (S, hs)
    cache.k[:], cache.v[:] = slots, -slots
    cache.advance(length)
    return cache


def slot_values(cache):
    L = cache.length
    return cache.k[0, 0, 0, :L, 0].tolist(), cache.v[1, 0, 0, :L, 0].tolist()


def test_rollback_lengths():
    cache = numbered_cache(9)
    cache.rollback(5)
    assert cache.length == 5 and cache.layer_lengths == [5, 5], \
        f"rollback(5) from 9: expected layer_lengths [5, 5], got {cache.layer_lengths}"
    cache.rollback(5)  # to the current length: nothing changes
    assert cache.layer_lengths == [5, 5], \
        f"rollback(5) at length 5 must change nothing, got layer_lengths {cache.layer_lengths}"
    cache.rollback(0)
    assert cache.layer_lengths == [0, 0], f"rollback(0): expected layer_lengths [0, 0], got {cache.layer_lengths}"


def test_rollback_when_the_lower_layers_ran_ahead():
    """early-exit drafts with the lower layers only, so they hold more tokens than the upper ones for a while.
    Rolling back to n forgets every slot from n on in EVERY layer; a layer holding fewer keeps its own count."""
    cache = numbered_cache(5)
    cache.advance(3, layers=[0])  # layer 0 drafted 3 tokens ahead: lengths [8, 5]
    cache.rollback(6)
    assert cache.layer_lengths == [6, 5], (f"layer_lengths [8, 5], rollback(6): layer 0 forgets slots 6.., layer 1 (5 "
                                           f"slots) keeps its own count: expected [6, 5], got {cache.layer_lengths}")
    cache.rollback(2)
    assert cache.layer_lengths == [2, 2], \
        f"layer_lengths [6, 5], rollback(2): expected [2, 2], got {cache.layer_lengths}"


@torch.no_grad()
@pytest.mark.parametrize("n_accepted", [0, 2, 4], ids=lambda n: f"{n}-accepted")
def test_chain_step_then_rollback_equals_recomputation(n_accepted):
    """The chain verify step: the cache holds the prefix; a forward over [last, d1..d4] writes 5 tokens;
    n drafts are accepted, so keep prefix + last + d1..dn. The next forward must see exactly that text."""
    model = tiny_gpt(3)
    prefix, last, drafts = random_ids(7, seed=1), 4, random_ids(4, seed=2)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache=cache)
    model(torch.tensor([[last] + drafts]), cache=cache)
    assert cache.length == len(prefix) + 5, f"after two forwards the cache must hold 12 tokens, got {cache.length}"
    cache.rollback(len(prefix) + 1 + n_accepted)
    assert cache.length == len(prefix) + 1 + n_accepted, \
        f"rollback({len(prefix) + 1 + n_accepted}): expected length {len(prefix) + 1 + n_accepted}, got {cache.length}"
    kept = prefix + [last] + drafts[:n_accepted]
    nxt = random_ids(3, seed=3)
    got = model(torch.tensor([nxt]), cache=cache).logits[0]  # (3, V)
    off = (got - full_logits(model, kept + nxt)[-3:]).abs().max().item()
    assert off <= TOL, (f"after rollback to prefix + last + {n_accepted} accepted drafts, the next forward's logits "
                        f"differ from a plain forward over that text by {off:.3g} (tolerance {TOL})")


def test_compact_docstring_example():
    """Length 7, keep [0, 1, 2, 3, 5]: the prefix stays, slot 4 takes slot 5's keys and values, length 5."""
    cache = numbered_cache(7)
    cache.compact([0, 1, 2, 3, 5])
    assert cache.layer_lengths == [5, 5], \
        f"compact([0, 1, 2, 3, 5]) of 7 slots: expected layer_lengths [5, 5], got {cache.layer_lengths}"
    got = slot_values(cache)
    assert got == ([0, 1, 2, 3, 5], [-0.0, -1, -2, -3, -5]), \
        f"compact([0, 1, 2, 3, 5]): slots 0..4 must hold the keys [0, 1, 2, 3, 5] and values [0, -1, -2, -3, -5], got {got}"


def test_compact_moves_every_layer_and_accepts_a_tensor():
    cache = numbered_cache(9)
    cache.compact(torch.tensor([0, 2, 3, 7]))
    assert cache.layer_lengths == [4, 4], \
        f"compact(tensor [0, 2, 3, 7]): expected layer_lengths [4, 4], got {cache.layer_lengths}"
    for layer in range(2):
        k, v = cache.k[layer, 0, 0, :4, 1].tolist(), cache.v[layer, 0, 0, :4, 1].tolist()
        assert (k, v) == ([0, 2, 3, 7], [0, -2, -3, -7]), \
            f"compact([0, 2, 3, 7]), layer {layer}: expected keys [0, 2, 3, 7] and values [0, -2, -3, -7], got {k}, {v}"


@torch.no_grad()
def test_tree_steps_then_compaction_equal_recomputation():
    """Four tree verify steps in a row, each keeping a random root-to-node path. The tree (parents) is fixed and
    its mask and positions are written out here. After every step the cache must equal a fresh forward over the
    accepted text, and the next tokens' logits must be those of a plain forward."""
    model, rng = tiny_gpt(4), random.Random(0)
    parents = [-1, 0, 1, 0, 3, 3]  # node 0 -> 1 -> 2; node 0 -> 3 -> {4, 5}
    ancestors = [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4], [0, 3, 5]]  # each node's path from the root
    text = random_ids(5, seed=5)
    cache = model.new_cache()
    model(torch.tensor([text]), cache=cache)
    for step in range(4):
        P = cache.length
        tokens = random_ids(len(parents), seed=10 + step)
        mask = torch.ones(len(parents), P + len(parents), dtype=torch.bool)
        mask[:, P:] = False
        for node, path in enumerate(ancestors):
            mask[node, [P + a for a in path]] = True
        pos = torch.tensor([P + len(path) - 1 for path in ancestors])
        model(torch.tensor([tokens]), pos=pos, cache=cache, mask=mask)
        path = ancestors[rng.randrange(len(parents))]
        cache.compact(list(range(P)) + [P + node for node in path])
        text = text + [tokens[node] for node in path]
        assert cache.length == len(text), f"tree step {step}, kept path {path}: expected length {len(text)}, got {cache.length}"
        fresh = model.new_cache()
        model(torch.tensor([text]), cache=fresh)
        L = len(text)
        for name, mine, ref in (("keys", cache.k, fresh.k), ("values", cache.v, fresh.v)):
            off = (mine[..., :L, :] - ref[..., :L, :]).abs().max().item()
            assert off <= TOL, (f"tree step {step}, compact to the prefix + path {path}: the cache's {name} differ "
                                f"from a fresh forward over the accepted text by {off:.3g}")
    nxt = random_ids(2, seed=99)
    off = (model(torch.tensor([nxt]), cache=cache).logits[0] - full_logits(model, text + nxt)[-2:]).abs().max().item()
    assert off <= TOL, f"after four tree steps, the next logits differ from a plain forward by {off:.3g}"
