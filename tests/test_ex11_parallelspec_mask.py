"""Exercise 11 (EXERCISES.md): `group_layout` in nanospec/model/drafters/parallelspec.py, the attention mask and
position ids that pack many training prefixes into one sequence (ParallelSpec's group-wise training). Literal
layouts (the docstring's, inference's one group after a cache, no group at all, groups in any order), then the
two properties it exists for, on a random tiny drafter: no group sees another group or the text after its
anchor, and the packed training forward gives exactly the logits inference gives.
Run: python -m pytest -m ex11"""
import pytest
import torch

from nanospec.model.drafters.parallelspec import group_layout
from toys import TOL, random_ids, tiny_drafter, tiny_gpt

pytestmark = pytest.mark.ex11


def test_docstring_example():
    """4 real tokens, groups of k = 2 masks after anchors 1 and 3, nothing cached."""
    mask, pos = group_layout(0, 4, [1, 3], 2)
    assert mask.dtype == torch.bool and pos.dtype == torch.long, \
        f"group_layout must return a bool mask and long positions, got {mask.dtype} and {pos.dtype}"
    assert pos.tolist() == [0, 1, 2, 3, 2, 3, 4, 5], \
        f"group_layout(0, 4, [1, 3], 2): positions [0, 1, 2, 3, 2, 3, 4, 5] (masks continue their anchor), got {pos.tolist()}"
    assert mask.int().tolist() == [
        # x0 x1 x2 x3 A1 A2 B1 B2
        [1, 0, 0, 0, 0, 0, 0, 0],  # x0: real tokens are causal and never see a mask
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # A1 (anchor 1, position 2): x0, x1 and itself
        [1, 1, 0, 0, 1, 1, 0, 0],  # A2: also A1, never group B
        [1, 1, 1, 1, 0, 0, 1, 0],  # B1 (anchor 3, position 4)
        [1, 1, 1, 1, 0, 0, 1, 1],
    ], f"group_layout(0, 4, [1, 3], 2): the mask drawn in the module docstring, got {mask.int().tolist()}"


def test_inference_is_one_group_after_the_cache():
    """At inference 5 tokens are cached, 2 new real tokens come, then k = 3 masks after the root (position 6):
    plain causal attention over everything, positions 5..9."""
    mask, pos = group_layout(5, 2, [6], 3)
    assert mask.shape == (5, 10) and pos.tolist() == [5, 6, 7, 8, 9], \
        f"group_layout(5, 2, [6], 3): expected a (5, 10) mask and positions 5..9, got {tuple(mask.shape)}, {pos.tolist()}"
    assert torch.equal(mask, torch.ones(5, 10, dtype=torch.bool).tril(diagonal=5)), \
        f"group_layout(5, 2, [6], 3): one group after the cache is plain causal attention, got {mask.int().tolist()}"


def test_no_group_is_a_causal_forward():
    mask, pos = group_layout(2, 3, [], 4)
    assert mask.shape == (3, 5) and pos.tolist() == [2, 3, 4], \
        f"group_layout(2, 3, [], 4): expected a (3, 5) mask and positions [2, 3, 4], got {tuple(mask.shape)}, {pos.tolist()}"
    assert torch.equal(mask, torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)), \
        f"group_layout with no anchors must be a causal forward, got {mask.int().tolist()}"


def test_groups_in_any_order_with_a_tensor_of_anchors():
    """Groups follow the anchors' order as given; anchor 0 gives a group that sees only x0."""
    mask, pos = group_layout(0, 3, torch.tensor([2, 0]), 1)
    assert pos.tolist() == [0, 1, 2, 3, 1], f"group_layout(0, 3, tensor([2, 0]), 1): expected positions [0, 1, 2, 3, 1], " \
                                            f"got {pos.tolist()}"
    want = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],  # the group after anchor 2
            [1, 0, 0, 0, 1]]  # the group after anchor 0
    assert mask.int().tolist() == want, f"group_layout(0, 3, tensor([2, 0]), 1): expected {want}, got {mask.int().tolist()}"


def test_sizes_for_many_groups():
    n_cached, n_real, anchors, k = 3, 6, [3, 5, 8, 4], 3
    mask, pos = group_layout(n_cached, n_real, anchors, k)
    R = n_real + len(anchors) * k
    assert mask.shape == (R, n_cached + R) and pos.shape == (R,), \
        f"group_layout(3, 6, {anchors}, 3): expected a ({R}, {n_cached + R}) mask and ({R},) positions, " \
        f"got {tuple(mask.shape)}, {tuple(pos.shape)}"
    for g, a in enumerate(anchors):
        for j in range(k):
            row = n_real + g * k + j
            assert pos[row].item() == a + 1 + j, f"group {g} (anchor {a}), mask {j}: position {a + 1 + j}, got {pos[row].item()}"
            want = list(range(a + 1)) + [n_cached + n_real + g * k + i for i in range(j + 1)]
            got = mask[row].nonzero()[:, 0].tolist()
            assert got == want, f"group {g} (anchor {a}), mask {j} must see columns {want}, it sees {got}"


@torch.no_grad()
def test_a_group_does_not_see_the_text_after_its_anchor():
    """Change the real text after the first anchor: the first group's guesses must not move, the others'
    must (a random drafter, so a leak through the mask would show)."""
    target = tiny_gpt(0)
    drafter = tiny_drafter(target)
    ids, anchors = random_ids(12, seed=1), [2, 5, 9]
    changed = ids[:3] + random_ids(9, seed=7)
    a = drafter(target, torch.tensor([ids]), torch.tensor(anchors), 3)  # (1, G, k, V)
    b = drafter(target, torch.tensor([changed]), torch.tensor(anchors), 3)
    assert torch.equal(a[0, 0], b[0, 0]), "the group after anchor 2 changed when only the text after it changed: " \
                                          "its masks see real tokens past their anchor"
    assert not torch.allclose(a[0, 1:], b[0, 1:]), "the groups after anchors 5 and 9 did not change with the text " \
                                                   "before them: they do not see it"


@torch.no_grad()
def test_packed_training_logits_equal_inference_logits():
    """Every group of one packed training forward must give exactly what inference gives for its prefix: the
    drafter reading x_0..x_a with its cache, then k masks (two passes, as decoding feeds it)."""
    target = tiny_gpt(1)
    drafter = tiny_drafter(target, seed=1, n_masks=4)
    ids, anchors = random_ids(14, seed=2), [0, 4, 7, 13]
    packed = drafter(target, torch.tensor([ids]), torch.tensor(anchors))  # (1, G, 4, V)
    for g, a in enumerate(anchors):
        cache = drafter.new_cache()
        if a >= 2:  # a first pass reads x_0..x_(a//2 - 1), its 2 masks after the last of them (then forgotten)
            drafter(target, torch.tensor([ids[:a // 2]]), torch.tensor([a // 2 - 1]), 2, cache=cache)
        new = ids[cache.length:a + 1]  # the rest of the prefix; the masks follow its last token, x_a
        guesses = drafter(target, torch.tensor([new]), torch.tensor([len(new) - 1]), 4, cache=cache)[0, 0]  # (4, V)
        off = (guesses - packed[0, g]).abs().max().item()
        assert off <= TOL, (f"group {g} (anchor {a}) of the packed training forward differs by {off:.3g} from what "
                            f"inference gives for the prefix x_0..x_{a}")
