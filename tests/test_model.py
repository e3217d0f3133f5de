"""The fast paths of the model (KV cache, masked tree forward, rollback, compaction) against the slow path:
a plain full forward over the exact sequence each token should see. float64, so equality is tight."""
import random

import pytest
import torch

from nanospec.rules.tree import path_to, tree_mask, tree_positions
from toys import TOL, full_logits, random_ids, random_tree, tiny_gpt


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 5], [3, 4, 5], [12]])
def test_incremental_cached_forward_equals_full_forward(chunks):
    model = tiny_gpt()
    ids = random_ids(sum(chunks))
    cache, got, i = model.new_cache(), [], 0
    for n in chunks:
        got.append(model(torch.tensor([ids[i:i + n]]), cache=cache).logits[0])
        i += n
    assert cache.length == len(ids)
    assert torch.allclose(torch.cat(got), full_logits(model, ids), atol=TOL)


@torch.no_grad()
def test_heads_predict_from_the_same_hidden_state():
    model = tiny_gpt()
    ids = random_ids(10)
    out = model(torch.tensor([ids]))
    heads = model.head_logits(out.hidden)
    assert heads.shape == (1, 2, 10, 11)
    cache = model.new_cache()
    model(torch.tensor([ids[:7]]), cache=cache)
    last = model(torch.tensor([ids[7:]]), cache=cache)
    assert torch.allclose(model.head_logits(last.hidden)[0], heads[0, :, 7:], atol=TOL)
    assert not torch.allclose(heads[0, 0], out.logits[0], atol=1e-3)  # heads are not the main head


@torch.no_grad()
def test_rollback_then_reappend_equals_recomputation():
    model = tiny_gpt()
    ids, wrong = random_ids(14, seed=1), random_ids(6, seed=2)
    cache = model.new_cache()
    model(torch.tensor([ids[:8]]), cache=cache)
    model(torch.tensor([wrong]), cache=cache)  # a rejected draft of 6 tokens
    cache.rollback(8)
    got = model(torch.tensor([ids[8:]]), cache=cache).logits[0]
    assert torch.allclose(got, full_logits(model, ids)[8:], atol=TOL)


@torch.no_grad()
@pytest.mark.parametrize("seed", range(5))
def test_tree_forward_equals_plain_forward_along_each_path(seed):
    rng = random.Random(seed)
    model = tiny_gpt(seed)
    prefix = random_ids(rng.randrange(1, 10), seed=seed)
    tokens, parents = random_tree(rng.randrange(2, 16), 11, rng)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache=cache)
    P = len(prefix)
    out = model(torch.tensor([tokens]), pos=tree_positions(parents, P), cache=cache, mask=tree_mask(parents, P))
    for node in range(len(tokens)):
        path_tokens = [tokens[i] for i in path_to(parents, node)]
        expect = full_logits(model, prefix + path_tokens)[-1]
        assert torch.allclose(out.logits[0, node], expect, atol=TOL), f"node {node}"


@torch.no_grad()
@pytest.mark.parametrize("seed", range(5))
def test_compaction_to_an_accepted_path_equals_recomputation(seed):
    rng = random.Random(seed)
    model = tiny_gpt(seed)
    prefix = random_ids(5, seed=seed)
    tokens, parents = random_tree(12, 11, rng)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache=cache)
    P = len(prefix)
    model(torch.tensor([tokens]), pos=tree_positions(parents, P), cache=cache, mask=tree_mask(parents, P))
    leaf = rng.randrange(len(tokens))
    path = path_to(parents, leaf)
    cache.compact(list(range(P)) + [P + i for i in path])
    accepted = prefix + [tokens[i] for i in path]
    assert cache.length == len(accepted)
    # the compacted cache must behave exactly like one built from the accepted text
    nxt = random_ids(3, seed=seed + 100)
    got = model(torch.tensor([nxt]), cache=cache).logits[0]
    assert torch.allclose(got, full_logits(model, accepted + nxt)[-3:], atol=TOL)
    fresh = model.new_cache()
    model(torch.tensor([accepted]), cache=fresh)
    L = len(accepted)
    assert torch.allclose(cache.k[..., :L, :], fresh.k[..., :L, :], atol=TOL)
    assert torch.allclose(cache.v[..., :L, :], fresh.v[..., :L, :], atol=TOL)


def test_tree_mask_literal():
    # the docstring's example: root -> x -> ")", root -> self
    mask = tree_mask([-1, 0, 1, 0], prefix_len=2).int().tolist()
    assert mask == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    assert tree_positions([-1, 0, 1, 0], 2).tolist() == [2, 3, 4, 3]


def test_place_literal():
    """2 tokens cached, 3 new: slots and positions 2, 3, 4, a causal mask over every slot of the cache (0 = may
    look, -inf = hidden); a tree's mask over the cached and new tokens is padded alike; no cache: positions 0, 1, 2
    and no mask at all (plain causal attention among the new tokens)."""
    model = tiny_gpt()
    cache = model.new_cache(max_len=7)
    model(torch.tensor([[1, 2]]), cache=cache)
    at = model.place(torch.tensor([[3, 4, 5]]), cache)
    assert at.slots.tolist() == [[2, 3, 4]] and at.pos.tolist() == [[2, 3, 4]] and at.cache is cache
    assert (at.mask == 0).int().tolist() == [[[[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]]]]
    assert at.mask.unique().tolist() == [float("-inf"), 0.0]
    tree = tree_mask([-1, 0, 0], 2)
    at = model.place(torch.tensor([[3, 4, 5]]), cache, pos=tree_positions([-1, 0, 0], 2), mask=tree)
    assert at.pos.tolist() == [2, 3, 3] and (at.mask == 0).int().tolist() == [[[
        [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0]]]]
    at = model.place(torch.tensor([[3, 4, 5]]))
    assert at.pos.tolist() == [0, 1, 2] and at.mask is None and at.slots is None and at.cache is None


@torch.no_grad()
def test_a_forward_told_its_default_placement_computes_the_same():
    """The fast layer hands a forward its positions and mask as tensors: told the default positions and the
    causal mask over the cached and new tokens, a forward computes exactly what it computes by default; a shifted
    position must not."""
    model = tiny_gpt()
    ids = random_ids(9, seed=3)
    for split in (0, 4):
        cache = model.new_cache()
        if split:
            model(torch.tensor([ids[:split]]), cache=cache)
        x = torch.tensor([ids[split:]])
        T = x.size(1)
        pos, mask = torch.arange(split, split + T), torch.ones(T, split + T, dtype=torch.bool).tril(split)
        by_default = model(x, cache=cache).logits
        cache.rollback(split)
        told = model(x, pos=pos, mask=mask, cache=cache).logits
        assert torch.equal(told, by_default)
        cache.rollback(split)
        assert not torch.allclose(model(x, pos=pos + 1, mask=mask, cache=cache).logits, by_default)


def test_cache_overflow_is_a_clear_error():
    model = tiny_gpt(block_size=8)
    cache = model.new_cache()
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.tensor([random_ids(9)]), pos=torch.arange(9) % 8, cache=cache)
