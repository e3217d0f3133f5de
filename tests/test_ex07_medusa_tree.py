"""Exercise 7 (EXERCISES.md): `tree_from_paths` in nanospec/rules/tree.py and `medusa_tree` in
nanospec/steps/tree_guesses.py: Medusa's candidate tree, a fixed list of paths of head ranks filled with each
head's top-k guesses. Literal layouts, the errors a bad path list must give, and the heads of a random tiny GPT
filling medusa's own preset trees.
Run: python -m pytest -m ex7"""
import pytest
import torch

from nanospec.steps.tree_guesses import TREES, medusa_tree
from nanospec.rules.tree import path_to, tree_from_paths
from toys import random_ids, tiny_gpt

pytestmark = pytest.mark.ex7


def test_docstring_example():
    parents, nodes = tree_from_paths([(1,), (0, 0), (0,)])
    assert (parents, nodes) == ([-1, 0, 0, 1], [(), (0,), (1,), (0, 0)]), \
        f"tree_from_paths([(1,), (0, 0), (0,)]): expected parents [-1, 0, 0, 1], nodes [(), (0,), (1,), (0, 0)], " \
        f"got {parents}, {nodes}"


def test_nodes_by_depth_then_rank_and_duplicates_merged():
    parents, nodes = tree_from_paths([[0, 1], (1, 0), (0,), (2,), (1,), (0, 0), (0,), (0, 1, 0)])
    want = [(), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 1, 0)]
    assert nodes == want, f"tree_from_paths: nodes by depth, then rank, each once (lists as tuples): expected {want}, " \
                          f"got {nodes}"
    assert parents == [-1, 0, 0, 0, 1, 1, 2, 5], f"tree_from_paths: expected parents [-1, 0, 0, 0, 1, 1, 2, 5], got {parents}"


@pytest.mark.parametrize("paths, message", [
    ([(0,), (1, 0)], "parent"),  # (1, 0) hangs under (1,), which is not in the tree
    ([(0,), (0, -1)], "rank"),  # ranks count from 0
    ([(0,), ()], "rank"),  # the empty path is the root, not a guess
], ids=["missing-parent", "negative-rank", "empty-path"])
def test_bad_paths_are_clear_errors(paths, message):
    with pytest.raises(ValueError, match=message):
        tree_from_paths(paths)


def test_medusa_tree_docstring_example():
    tokens, parents = medusa_tree(7, [[5, 3], [9, 2]], [(0,), (1,), (0, 0)])
    assert (tokens, parents) == ([7, 5, 3, 9], [-1, 0, 0, 1]), \
        f"medusa_tree(7, [[5, 3], [9, 2]], [(0,), (1,), (0, 0)]): expected ([7, 5, 3, 9], [-1, 0, 0, 1]), got {(tokens, parents)}"


def test_medusa_default_tree_from_a_tensor_of_candidates():
    """medusa's default tree: head 1's top-2, then the top-1 chain under its first guess. The candidates come
    as a LongTensor (topk indices); the tree holds Python ints."""
    candidates = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    tokens, parents = medusa_tree(torch.tensor(4), candidates, [(0,), (1,), (0, 0), (0, 0, 0)])
    assert tokens == [4, 11, 12, 21, 31] and parents == [-1, 0, 0, 1, 3], \
        f"medusa_tree on medusa's default tree: expected ([4, 11, 12, 21, 31], [-1, 0, 0, 1, 3]), got {(tokens, parents)}"
    assert all(type(t) is int for t in tokens), f"medusa_tree's tokens must be Python ints, got {[type(t).__name__ for t in tokens]}"


@torch.no_grad()
@pytest.mark.parametrize("preset", ["default", "large"], ids=["default-tree", "large-tree"])
def test_the_heads_fill_medusas_presets(preset):
    """A random tiny GPT's MTP heads give the candidates, as medusa.generate asks for them; then every node at
    depth d with rank r must hold head d's (r+1)-th best guess, and its parent must be the node of its path
    without the last rank."""
    model = tiny_gpt(0, n_future=3)
    paths = TREES[preset]
    width = max(max(p) for p in paths) + 1
    hidden = model(torch.tensor([random_ids(6)])).hidden[:, -1:]  # (1, 1, C) the last position's trunk state
    candidates = model.head_logits(hidden, 3)[0, :, 0].topk(width, dim=-1).indices  # (3, width)
    tokens, parents = medusa_tree(9, candidates, paths)
    _, nodes = tree_from_paths(paths)
    assert tokens[0] == 9 and parents[0] == -1 and len(tokens) == len(paths) + 1, \
        f"medusa_tree on the {preset} tree: the root must be node 0 (token 9) and there must be {len(paths) + 1} nodes"
    for i in range(1, len(tokens)):
        ranks = nodes[i]
        want = candidates[len(ranks) - 1, ranks[-1]].item()
        assert tokens[i] == want, (f"{preset} tree, node {i} (path {ranks}): it must hold head {len(ranks)}'s guess of "
                                   f"rank {ranks[-1]}, {want}; got {tokens[i]}")
        got = [nodes[j] for j in path_to(parents, i)]
        assert got == [ranks[:d] for d in range(len(ranks) + 1)], \
            f"{preset} tree, node {i} (path {ranks}): its ancestors must be the path's prefixes, got {got}"
