"""Exercise 6 (EXERCISES.md): `tree_mask` and `tree_positions` in nanospec/rules/tree.py: how one forward verifies a
whole tree of guesses. Literal masks for a chain, a star and the docstring's tree, then the property the two
exist for: every node's logits equal a plain forward along its own root-to-node path.
Run: python -m pytest -m ex6"""
import random

import pytest
import torch

from nanospec.rules.tree import path_to, tree_mask, tree_positions
from toys import TOL, full_logits, random_ids, tiny_gpt

pytestmark = pytest.mark.ex6


def test_docstring_example():
    """root "(" -> "x" -> ")", root -> "self", after a cached prefix of 2 tokens."""
    mask = tree_mask([-1, 0, 1, 0], prefix_len=2)
    assert mask.dtype == torch.bool and mask.shape == (4, 6), \
        f"tree_mask([-1, 0, 1, 0], prefix_len=2): expected a bool (4, 6), got {mask.dtype} {tuple(mask.shape)}"
    want = [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    assert mask.int().tolist() == want, f"tree_mask([-1, 0, 1, 0], 2): expected rows {want}, got {mask.int().tolist()}"
    pos = tree_positions([-1, 0, 1, 0], 2)
    assert pos.dtype == torch.long and pos.tolist() == [2, 3, 4, 3], \
        f"tree_positions([-1, 0, 1, 0], 2): expected the LongTensor [2, 3, 4, 3], got {pos.dtype} {pos.tolist()}"


def test_a_chain_is_causal_attention():
    """Each node the child of the one before: the mask is the ordinary causal mask after the prefix."""
    parents = [-1, 0, 1, 2, 3]
    got = tree_mask(parents, 3)
    assert torch.equal(got, torch.ones(5, 8, dtype=torch.bool).tril(diagonal=3)), \
        f"tree_mask of a chain [-1, 0, 1, 2, 3] after 3 tokens must be the causal mask, got {got.int().tolist()}"
    got = tree_positions(parents, 3).tolist()
    assert got == [3, 4, 5, 6, 7], f"tree_positions of a chain after 3 tokens: expected [3, 4, 5, 6, 7], got {got}"


def test_a_star_sees_only_the_root():
    """Every guess a child of the root (Medusa's "wide" tree): each sees the root and itself, all at depth 1."""
    mask = tree_mask([-1, 0, 0, 0], 0).int().tolist()
    assert mask == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], \
        f"tree_mask of a star [-1, 0, 0, 0]: each child sees the root and itself, got {mask}"
    pos = tree_positions([-1, 0, 0, 0], 0).tolist()
    assert pos == [0, 1, 1, 1], f"tree_positions of a star: expected [0, 1, 1, 1], got {pos}"


def test_siblings_and_cousins_never_see_each_other():
    """parents [-1, 0, 0, 1, 2, 1]: node 3 and node 5 are siblings under node 1, node 4 their cousin."""
    mask = tree_mask([-1, 0, 0, 1, 2, 1], 1).int().tolist()
    want = [[1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0, 1]]
    assert mask == want, f"tree_mask([-1, 0, 0, 1, 2, 1], 1): expected rows {want}, got {mask}"
    pos = tree_positions([-1, 0, 0, 1, 2, 1], 1).tolist()
    assert pos == [1, 2, 2, 3, 3, 3], f"tree_positions([-1, 0, 0, 1, 2, 1], 1): expected [1, 2, 2, 3, 3, 3], got {pos}"


def random_tree(n, rng):
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def test_random_trees_agree_with_their_paths():
    """For random trees: node i sees slot j of the new tokens iff j is on i's root-to-node path (path_to), sees
    the whole prefix, and sits at position prefix + (path length - 1)."""
    rng = random.Random(0)
    for _ in range(100):
        parents, P = random_tree(rng.randrange(1, 12), rng), rng.randrange(0, 6)
        mask, pos = tree_mask(parents, P), tree_positions(parents, P)
        for i in range(len(parents)):
            path = path_to(parents, i)
            case = f"parents {parents}, prefix {P}, node {i}"
            assert mask[i, :P].all(), f"{case}: tree_mask must let every node see the whole prefix"
            sees = [j for j in range(len(parents)) if mask[i, P + j]]
            assert sees == path, f"{case}: the node must see exactly its root-to-node path {path}, it sees {sees}"
            assert pos[i].item() == P + len(path) - 1, \
                f"{case}: tree_positions must be prefix + depth = {P + len(path) - 1}, got {pos[i].item()}"


@torch.no_grad()
@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"seed-{s}")
def test_tree_forward_equals_a_plain_forward_along_each_path(seed):
    """One forward over a random tree after a cached prefix; each node's logits must equal those of a plain
    forward over prefix + the tokens on its path (float64, random tiny GPT)."""
    rng = random.Random(seed)
    model = tiny_gpt(seed)
    prefix = random_ids(rng.randrange(1, 8), seed=seed)
    parents = random_tree(rng.randrange(2, 14), rng)
    tokens = random_ids(len(parents), seed=seed + 50)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache=cache)
    P = len(prefix)
    out = model(torch.tensor([tokens]), pos=tree_positions(parents, P), cache=cache, mask=tree_mask(parents, P))
    for node in range(len(parents)):
        seq = prefix + [tokens[i] for i in path_to(parents, node)]
        off = (out.logits[0, node] - full_logits(model, seq)[-1]).abs().max().item()
        assert off <= TOL, (f"parents {parents} after a prefix of {P}: node {node}'s logits from the tree forward differ "
                            f"by {off:.3g} from a plain forward over the prefix and its path {path_to(parents, node)}")
