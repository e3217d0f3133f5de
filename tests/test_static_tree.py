"""The tree methods (medusa, eagle, parallelspec, lookahead) on the static runtime (nanospec/static.py): with
--runtime static each gives the plain path's ids token for token, greedy (and then `ar`'s) and, seeded, at
temperature 1, up to the context's end. On the static path every tree verify forward is padded to the method's
node budget (tree_step.tree_runtime), so the target's forwards come in few shapes: the prompt, the budget, and
(parallelspec's chain) k + 1; the padded nodes are never accepted, which the equality with the plain path shows.
The drafters' static forwards (StaticEagle, StaticParallelSpec) are held to their plain forwards, the top-k EAGLE
tree grown on the device to exercise 9's grow_tree, and test_device's meta check runs on the static path."""
import pytest
import torch

from nanospec.decoding import METHODS
from nanospec.decoding.tree_step import tree_step
from nanospec.parts import Models
from nanospec.static import KEPT, StaticGPT, runtime_model
from test_eagle import random_head
from test_model import random_ids, tiny_gpt
from test_parallelspec import tiny_drafter

# method, options, the node budget its static tree forwards are padded to
CASES = [
    ("medusa", {}, 4),  # the default tree within the 2 heads: 3 paths + the root
    ("medusa", {"tree": "large", "draft_sampling": "topk"}, 13),  # 12 paths within the 2 heads + the root
    ("medusa", {"verify": "typical"}, 4),
    ("eagle", {}, 8),  # total_tokens
    ("eagle", {"depth": 3, "width": 2, "total_tokens": 6, "draft_sampling": "topk"}, 6),
    ("parallelspec", {}, 8),  # SMALL_TREE within 3 masks: 7 paths + the root
    ("parallelspec", {"tree": "chain"}, None),  # chain_step: no padding, k + 1 tokens
    ("lookahead", {}, 18),  # tree_size(3, 4, 3)
    ("lookahead", {"window": 2, "ngram": 3, "guesses": 2}, 8),
]


def tree_models(seed):
    target = tiny_gpt(seed)
    return Models(target=target, eagle=random_head(target, seed), parallelspec=tiny_drafter(target, seed))


def both_runtimes(method, models, prompt, n, **kw):
    return [METHODS[method](models, prompt, n, runtime=r, **kw) for r in ("static", "eager")]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method, options, budget", CASES)
def test_static_tree_method_equals_plain(method, options, budget, temperature):
    for seed in range(2):
        models, prompt = tree_models(seed), random_ids(5 + 3 * seed, seed=seed)
        n = models.target.config.block_size  # more than fits: the last steps run at the context's end
        (ids, stats), (plain_ids, plain_stats) = both_runtimes(method, models, prompt, n, temperature=temperature,
                                                               seed=seed, **options)
        assert ids == plain_ids, (method, options, seed)
        assert (stats["runtime"], plain_stats["runtime"]) == ("static", "eager")
        assert stats["accepted_per_step"] == plain_stats["accepted_per_step"]  # the same drafts were made
        if temperature == 0 and options.get("verify") != "typical":
            assert ids == METHODS["ar"](models, prompt, n)[0]


@pytest.mark.parametrize("method, options, budget", [c for c in CASES if c[2] is not None])
def test_static_tree_forwards_have_one_shape(method, options, budget):
    """Every target forward after the prompt has the budget's shape (T = budget), however big each tree was."""
    models = tree_models(0)
    prompt = random_ids(6, seed=3)
    METHODS[method](models, prompt, 30, runtime="static", **options)
    (static,) = KEPT[models.target].values()  # the one StaticGPT the method ran on
    shapes = {key[1][0][0] for key in static.graphs.entries} | {key[1][0][0] for key in static.graphs.seen}
    assert shapes <= {(1, len(prompt)), (1, budget)} and (1, budget) in shapes


@torch.inference_mode()
def test_padded_tree_step_is_the_plain_tree_step():
    """tree_step with a budget on a StaticGPT: the same emitted tokens, path and cache as without padding on the
    plain model, on a tree with a branch; the forward ran over budget nodes."""
    from nanospec.decoding.run import start
    target = tiny_gpt(2)
    static, cache, _ = runtime_model(target, "static", max_len=target.config.block_size + 9)
    plain = target.new_cache(max_len=target.config.block_size + 9)
    run = start(Models(target=target), [1, 2, 3], 5)
    target(torch.tensor([[1, 2, 3]]), cache=plain), static(torch.tensor([[1, 2, 3]]), cache=cache)
    best = target(torch.tensor([[1, 2, 3, 4]])).logits[0, -1].argmax().item()  # the target's token after 4
    tokens, parents = [4, best, (best + 1) % 11, 7], [-1, 0, 0, 1]
    got = tree_step(run, static, cache, tokens, parents, budget=9)
    expected = tree_step(run, target, plain, tokens, parents)
    assert got[:2] == expected[:2] and got[1][0] == 1 and got[2].logits.shape[1] == 9
    assert cache.lengths == plain.lengths
    n = plain.length
    torch.testing.assert_close(cache.k[:, :, :, :n], plain.k[:, :, :, :n], atol=1e-12, rtol=0)
    assert isinstance(static, StaticGPT)


@torch.inference_mode()
def test_static_eagle_head_is_the_plain_head():
    """StaticEagle against the head's plain forward on its own cache: a refresh over a few tokens, then frontier
    passes under tree masks (as expand runs them), then a rollback to the accepted slots, several times."""
    from nanospec.drafters.eagle import StaticEagle
    from nanospec.tree import frontier_mask
    target = tiny_gpt(1).float()
    head = random_head(target, 1).float()
    plain, cache = head.new_cache(max_len=64), head.new_cache(max_len=64)
    static = StaticEagle(head, cache)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        m = 3 if step == 0 else 1 + step % 2  # a refresh: the accepted tokens with true features
        tokens, feats = torch.randint(0, 11, (1, m), generator=g), torch.randn(1, m, 16, generator=g)
        expected, got = head(target, tokens, feats, cache=plain), static(target, tokens, feats, cache=cache)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
        L, fed, parent = plain.length, {}, [-1, -1, 0, 1]
        for frontier, d in (([0, 1], 1), ([2, 3], 2)):  # two frontier passes of a tree of depth 2
            mask = frontier_mask(L, fed, frontier, parent)
            pos = torch.full((2,), L + d)
            tok, f = torch.randint(0, 11, (1, 2), generator=g), torch.randn(1, 2, 16, generator=g)
            expected = head(target, tok, f, pos, plain, mask)
            got = static(target, tok, f, pos, cache, mask)
            torch.testing.assert_close(got.hidden, expected.hidden, atol=1e-5, rtol=0)
            torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
        plain.rollback(L), cache.rollback(L)


@torch.inference_mode()
def test_static_parallelspec_drafter_is_the_plain_drafter():
    """StaticParallelSpec.draft against ParallelSpec.draft: passes over the prompt, then over 1..3 new tokens each,
    with k masks (the masks' keys are written and forgotten): the same logits, the same cache lengths."""
    from nanospec.drafters.parallelspec import StaticParallelSpec
    target = tiny_gpt(2)
    drafter = tiny_drafter(target, 2)
    plain, cache = drafter.new_cache(), drafter.new_cache()
    static = StaticParallelSpec(drafter, cache)
    g = torch.Generator().manual_seed(1)
    for m in [6, 1, 3, 2, 1, 1, 3]:
        tokens, k = torch.randint(0, 11, (m,), generator=g).tolist(), 1 + m % 3
        expected = drafter.draft(target, plain, tokens, k)
        torch.testing.assert_close(static.draft(target, cache, tokens, k), expected, atol=1e-10, rtol=0)
        assert cache.lengths == plain.lengths


@pytest.mark.parametrize("depth, width, total", [(1, 3, 4), (2, 4, 8), (3, 2, 6), (3, 3, 30), (4, 2, 9)])
@torch.inference_mode()
def test_grow_tree_on_device_is_exercise_9s_grow_tree(depth, width, total):
    """The static runtime's top-k EAGLE tree (drafters/eagle.grow_tree_on_device) is eagle.grow_tree's, node for
    node, and leaves the head's cache as it found it."""
    from nanospec.decoding.eagle import grow_tree, refresh
    from nanospec.drafters.eagle import grow_tree_on_device
    for seed in range(3):
        target = tiny_gpt(seed)
        head = random_head(target, seed)
        seq = random_ids(7, seed=seed)
        dcache = head.new_cache(max_len=80)
        draft = refresh(head, target, dcache, seq[1:], target(torch.tensor([seq])).hidden[0, :-1])
        expected = grow_tree(head, target, dcache, seq[-1], draft, depth, width, total)
        tokens, parents = grow_tree_on_device(head, target, dcache, seq[-1], draft, depth, width, total)
        assert (tokens.tolist(), parents.tolist()) == expected and dcache.length == 6


@pytest.mark.parametrize("method", ["medusa", "eagle", "parallelspec", "lookahead"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_tree_path_makes_every_tensor_on_the_models_device(method, temperature):
    """test_device.py's check (a tensor made without naming a device lands on meta and fails), on the static path."""
    import test_device
    models = tree_models(0)
    with torch.device("meta"), test_device.on_meta_fails():
        ids, _ = METHODS[method](models, random_ids(6, seed=3), 12, temperature=temperature, seed=0,
                                 runtime="static")
    assert len(ids) == 12


def test_drafters_static_forwards_are_kept_from_one_generation_to_the_next():
    """A second generation reuses the drafters' static forwards (each shape captured once per process on CUDA), on
    emptied caches, and gives the same ids; a dropped drafter drops them."""
    import gc
    import weakref
    models = tree_models(1)
    for method, part in (("eagle", models.eagle), ("parallelspec", models.parallelspec)):
        first = METHODS[method](models, [1, 2, 3], 20, runtime="static")[0]
        (static,) = KEPT[part].values()
        assert METHODS[method](models, [1, 2, 3], 20, runtime="static")[0] == first
        assert list(KEPT[part].values()) == [static]
    drafters = [weakref.ref(models.eagle), weakref.ref(models.parallelspec)]
    n = len(KEPT)
    models = static = part = None  # the loop variable held the last drafter too
    gc.collect()
    assert all(ref() is None for ref in drafters), "a kept static drafter keeps its drafter alive"
    assert len(KEPT) <= n - 2  # their entries (and the target's) went with them
