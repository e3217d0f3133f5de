"""`parallelspec`: the drafter's group-wise training layout and the decoding method.

- The layout: the literal mask of the module docstring; no group can see another group's masks or the real
  tokens after its anchor (perturbing them leaves its logits unchanged, to the last bit); the logits of a group
  in the packed training forward equal the logits of an inference pass over the same prefix with a cache.
- Decoding: greedy output equals `ar`'s token for token (random and briefly trained drafters, chain and tree);
  one drafter pass per target verify step; the law of the first 3 sampled tokens is the target's exact law.
Everything in float64 on tiny random targets, so equalities are tight and argmax ties do not happen.
"""
import functools
from dataclasses import asdict

import pytest
import torch

from nanospec.model.checkpoint import save_atomic
from nanospec.model.load import Models, load_parallelspec
from nanospec.decoding import METHODS, check_method
from nanospec.model.drafters.parallelspec import group_layout
from laws import exact_law, parallelspec_sampled_law, tv, tv_bound
from toys import TOL, briefly_trained, parallelspec_sampling_models, random_ids, tiny_drafter, tiny_gpt

# ---------------------------------------------------------------------------------------------------------
# The training layout


def test_group_layout_literal():
    mask, pos = group_layout(0, 4, [1, 3], 2)
    assert pos.tolist() == [0, 1, 2, 3, 2, 3, 4, 5]
    assert mask.int().tolist() == [
        # x0 x1 x2 x3 A1 A2 B1 B2
        [1, 0, 0, 0, 0, 0, 0, 0],  # x0
        [1, 1, 0, 0, 0, 0, 0, 0],  # x1
        [1, 1, 1, 0, 0, 0, 0, 0],  # x2
        [1, 1, 1, 1, 0, 0, 0, 0],  # x3
        [1, 1, 0, 0, 1, 0, 0, 0],  # A1: anchor 1, position 2
        [1, 1, 0, 0, 1, 1, 0, 0],  # A2
        [1, 1, 1, 1, 0, 0, 1, 0],  # B1: anchor 3, position 4
        [1, 1, 1, 1, 0, 0, 1, 1],  # B2
    ]
    # inference = one group after everything, with a cache: plain causal attention
    mask, pos = group_layout(5, 2, [6], 3)
    assert pos.tolist() == [5, 6, 7, 8, 9]
    assert torch.equal(mask, torch.ones(5, 10, dtype=torch.bool).tril(diagonal=5))


def perturb_block_input(drafter, rows, generator):
    """A hook that adds noise to the first block's input x (B, T + G*k, C) at `rows` (real tokens first, then the
    masks group by group): how the tests below reach the embedded input without a second way of running the
    drafter. Returns the hook's handle (remove it when done)."""
    def hook(block, args):
        x = args[0].clone()
        x[0, rows] += torch.randn(len(rows), x.size(-1), generator=generator, dtype=x.dtype)
        return (x,) + args[1:]
    return drafter.blocks[0].register_forward_pre_hook(hook)


@torch.no_grad()
def test_no_group_sees_another_groups_tokens():
    target = tiny_gpt(0)
    drafter = tiny_drafter(target)
    ids, anchors, k = random_ids(12, seed=1), [2, 5, 6, 11], 3
    logits = drafter(target, torch.tensor([ids]), torch.tensor(anchors), k)  # (1, G, k, V)
    gen = torch.Generator().manual_seed(0)

    def perturbed(rows):  # the logits after adding noise to the block's input at `rows`
        handle = perturb_block_input(drafter, rows, gen)
        try:
            return drafter(target, torch.tensor([ids]), torch.tensor(anchors), k)
        finally:
            handle.remove()

    for g, a in enumerate(anchors):
        # what group g must not see: the real tokens after its anchor, and every other group's masks
        unseen = list(range(a + 1, len(ids)))
        unseen += [len(ids) + h * k + j for h in range(len(anchors)) if h != g for j in range(k)]
        assert torch.equal(perturbed(unseen)[0, g], logits[0, g])
        # negative control: what it does see (its anchor, its own first mask) changes its logits
        assert not torch.allclose(perturbed([a])[0, g], logits[0, g])
        assert not torch.allclose(perturbed([len(ids) + g * k])[0, g, 1:], logits[0, g, 1:])
    # the same through the tokens, changing the real tokens after the first anchor
    ids2 = ids[:anchors[0] + 1] + random_ids(len(ids) - anchors[0] - 1, seed=9)
    a = drafter(target, torch.tensor([ids]), torch.tensor(anchors), k)
    b = drafter(target, torch.tensor([ids2]), torch.tensor(anchors), k)
    assert torch.equal(a[0, 0], b[0, 0]) and not torch.allclose(a[0, 1:], b[0, 1:])


def draft(drafter, target, cache, tokens, k):
    """One inference pass as the method makes it: the new real tokens (a list; the last one is the root) join the
    drafter's cache, k masks after the root guess the k tokens after it. Returns logits (k, V)."""
    return drafter(target, torch.tensor([tokens]), torch.tensor([len(tokens) - 1]), k, cache=cache)[0, 0]


@torch.no_grad()
def test_anchors_are_indices_into_the_new_tokens():
    """With 4 tokens cached, anchor 1 is the 2nd NEW token (absolute position 5), not position 1."""
    target = tiny_gpt(0)
    drafter = tiny_drafter(target)
    ids = random_ids(8, seed=4)
    cache = drafter.new_cache()
    draft(drafter, target, cache, ids[:4], 2)
    got = drafter(target, torch.tensor([ids[4:]]), torch.tensor([1]), 3, cache=cache)[0, 0]  # (3, V)
    want = drafter(target, torch.tensor([ids]), torch.tensor([5]), 3)[0, 0]  # no cache: the same group, absolute anchor 5
    assert torch.allclose(got, want, atol=TOL)
    assert not torch.allclose(got, drafter(target, torch.tensor([ids]), torch.tensor([1]), 3)[0, 0])  # not position 1


@torch.no_grad()
def test_training_logits_equal_inference_logits():
    target = tiny_gpt(1)
    drafter = tiny_drafter(target, seed=1, n_masks=4)
    ids, anchors = random_ids(15, seed=2), [0, 3, 4, 9, 14]
    packed = drafter(target, torch.tensor([ids]), torch.tensor(anchors))  # (1, G, 4, V) training layout
    for g, a in enumerate(anchors):
        cache = drafter.new_cache()
        split = a // 2  # the prefix reaches the drafter in two passes, as in decoding
        if split:
            draft(drafter, target, cache, ids[:split], 2)
        guesses = draft(drafter, target, cache, ids[split:a + 1], 4)  # (4, V)
        assert cache.length == a + 1  # the masks did not stay in the cache
        assert torch.allclose(guesses, packed[0, g], atol=TOL)
        # fewer masks give the same first guesses: mask j only sees masks before it
        assert torch.allclose(drafter(target, torch.tensor([ids[:a + 1]]), torch.tensor([a]), 2)[0, 0],
                              packed[0, g, :2], atol=TOL)


def test_checkpoint_holds_only_the_drafter(tmp_path):
    target = tiny_gpt(0)
    drafter = tiny_drafter(target)
    path = str(tmp_path / "parallelspec.pt")
    save_atomic({"config": asdict(drafter.config), "model": drafter.state_dict(), "tokenizer": "abc"}, path)
    loaded = load_parallelspec(path, "abc").double()
    assert not any(name.startswith(("wte", "wpe", "lm_head", "ln_f")) for name in drafter.state_dict())
    ids = random_ids(6)
    x = drafter(target, torch.tensor([ids]), torch.tensor([2, 5]))
    y = loaded(target, torch.tensor([ids]), torch.tensor([2, 5]))
    assert torch.allclose(x, y, atol=1e-6)  # the file holds float32 weights


# ---------------------------------------------------------------------------------------------------------
# Decoding


@functools.lru_cache
def trained_drafter(seed):
    return briefly_trained(tiny_gpt(seed, block_size=40), seed=seed)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tree", ["chain", "default"])
def test_greedy_equals_ar(seed, tree):
    target = tiny_gpt(seed, block_size=40)
    drafters = {"random": tiny_drafter(target, seed), "two blocks": tiny_drafter(target, seed + 1, n_layer=2),
                "trained": trained_drafter(seed)}
    for name, drafter in drafters.items():
        passes = []  # one entry per drafter forward
        handle = drafter.register_forward_hook(lambda *_: passes.append(1))
        for p in range(3):
            prompt = random_ids(1 + 7 * p, seed=10 * seed + p)
            want, _ = METHODS["ar"](Models(target=target), prompt, 25)
            draft_len = [None, 1, 2][p]
            passes.clear()
            got, stats = METHODS["parallelspec"](Models(target=target, parallelspec=drafter), prompt, 25,
                                                 tree=tree, draft_len=draft_len)
            assert got == want, (name, p, draft_len)
            steps = stats["target_forwards"] - 1  # the prefill drafts nothing
            assert steps - 1 <= len(passes) <= steps  # one pass per step (none for a last lone token)
        handle.remove()
    # runs into the context limit (block_size 40) without a crash
    got, stats = METHODS["parallelspec"](Models(target=target, parallelspec=drafters["trained"]), random_ids(30), 100,
                                         tree=tree)
    assert got == METHODS["ar"](Models(target=target), random_ids(30), 100)[0] and stats["stop"] == "context"


def test_trained_drafter_accepts_more_than_a_random_one():
    """Not a law, a sanity check of the training loss: 60 steps of distillation on random text roughly double
    the accepted guesses of 4 greedy generations (about 100 against 50)."""
    target = tiny_gpt(0)

    def accepted(drafter):
        models = Models(target=target, parallelspec=drafter)
        return sum(METHODS["parallelspec"](models, random_ids(5, seed=s), 40)[1]["accepted"] for s in range(4))

    assert accepted(briefly_trained(target, steps=60)) > 1.5 * accepted(tiny_drafter(target))


V = 5  # sampling tests: a tiny vocabulary, so the law of 3 tokens has only 125 outcomes
PROMPT = [1, 3, 2]


@pytest.mark.parametrize("tree, draft_sampling, sampling, n", [
    ("chain", "sample", (1.0, None, None), 2000),  # guesses drawn from each mask's q: Leviathan's rule
    ("chain", "topk", (1.0, None, None), 1000),  # each mask's top-1: the point-mass rule
    ("0;1;0,0;1,0;0,1", "sample", (0.8, 4, None), 2000),  # a drawn tree, warping applied alike to q and p
    ("0;1;0,0;1,0;0,1", "topk", (0.8, 4, None), 1000),
])
def test_sampling_first_tokens_follow_the_target_law(tree, draft_sampling, sampling, n):
    """First 3 tokens, 125 outcomes. A correct sampler's empirical law is within tv_bound(125, n) of the
    exact law with probability 1 - 1e-6 (Bretagnolle-Huber-Carol, tests/laws.py): 0.158 for n = 2000, 0.224
    for n = 1000 (a correct run comes out near half that). Guesses must be accepted often, or the test would
    only check the target's own tokens."""
    models = parallelspec_sampling_models()
    law, accepted = parallelspec_sampled_law(models, PROMPT, 3, n, sampling, tree=tree, draft_sampling=draft_sampling)
    assert tv(law, exact_law(models.target, PROMPT, 3, sampling)) < tv_bound(V ** 3, n)
    assert accepted > n / 4, accepted


def test_sampling_test_sees_a_biased_rule(monkeypatch):
    """Negative control: a rule that accepts every guess (and then samples the bonus) must fail the test
    above, even with few draws: the guesses are the drafter's top-1, not samples of the target. The bound
    for n = 300 is 0.41; this rule comes out near 0.96."""
    from nanospec.steps.options import VERIFY_RULES

    def accept_all(p_target, q_draft, draft_tokens, generator):  # the rule chain_step runs: (1, k+1, V), (1, k, V),
        k = draft_tokens.size(1)  # (1, k): one row
        return torch.tensor([k]), torch.multinomial(p_target[0, k], 1, generator=generator)

    monkeypatch.setattr(VERIFY_RULES["token"], "chain", accept_all)
    models, n, sampling = parallelspec_sampling_models(), 300, (1.0, None, None)
    law, _ = parallelspec_sampled_law(models, PROMPT, 3, n, sampling, tree="chain", draft_sampling="topk")
    assert tv(law, exact_law(models.target, PROMPT, 3, sampling)) > tv_bound(V ** 3, n)


def test_missing_drafter_is_a_clear_error():
    models = Models(target=tiny_gpt(0))
    with pytest.raises(ValueError, match="train_tiny.py --stage parallelspec"):
        check_method("parallelspec", models)
    with pytest.raises(ValueError, match="train_tiny.py --stage parallelspec"):
        METHODS["parallelspec"](models, [1, 2], 5)
    models.parallelspec = tiny_drafter(models.target)
    with pytest.raises(ValueError, match="draft_len"):
        METHODS["parallelspec"](models, [1, 2], 5, draft_len=4)
    with pytest.raises(ValueError, match="block does not judge a tree of drawn guesses.*; or --tree chain$"):
        METHODS["parallelspec"](models, [1, 2], 5, temperature=1.0, verify="block")
