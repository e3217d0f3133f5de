"""`early-exit` self-speculation and the adaptive draft length shared by every chain method.

  - the model's layer-range forward and per-layer KV cache against the slow path (one full forward): the
    lower layers run ahead over guesses, the upper layers catch up over their outputs, a rollback cuts all;
  - the early-exit draft's logits equal a plain forward through a model made of the first E layers (+ head,
    + the adapter when there is one);
  - greedy: `early-exit` for every exit layer and several k, and every chain method with every adaptive rule,
    token for token equal to `ar`;
  - sampling with adaptive stopping switched on: the empirical joint law of the first 3 tokens stays within a
    total-variation bound of the target's exact law (bound derived from the number of draws);
  - the two rules' bookkeeping, literally.
Tiny float64 models, so argmax ties do not happen.
"""
from dataclasses import replace

import pytest
import torch

from nanospec.model.load import Models
from nanospec.decoding import METHODS, MODULES
from nanospec.steps.adaptive import DraftLength
from nanospec.model.drafters.early_exit import ExitAdapter, exit_logits
from nanospec.training.drafter_losses import exit_losses
from nanospec.model.gpt import GPT
from laws import empirical_law, exact_law, sequence_codes, tv, tv_bound
from toys import TOL, full_logits, random_adapter, random_ids, tiny_drafter, tiny_gpt, toy_gpt


def first_layers(model, E):
    """The slow oracle of the draft: a standalone GPT made of the model's first E blocks, its embeddings, final
    norm and unembedding."""
    small = GPT(replace(model.config, n_layer=E)).double().eval()
    small.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("blocks.") or int(k.split(".")[1]) < E})
    return small


# ---------------------------------------------------------------------------------------------------------
# The model: layer ranges and per-layer cache lengths


@torch.no_grad()
@pytest.mark.parametrize("E", [1, 2])
def test_layer_range_forward_equals_full_forward(E):
    model = tiny_gpt(0, n_layer=3)
    ids = random_ids(9)
    lower = model(torch.tensor([ids]), layers=(0, E))
    assert lower.logits is None  # a range that stops early has no logits of its own
    upper = model(None, layers=(E, 3), hidden_in=lower.hidden)
    assert torch.allclose(upper.logits[0], full_logits(model, ids), atol=TOL)
    assert torch.allclose(lower.hidden, first_layers(model, E)(torch.tensor([ids])).hidden, atol=TOL)


@torch.no_grad()
@pytest.mark.parametrize("E, n_keep", [(1, 0), (1, 3), (2, 4), (2, 2)])
def test_lower_layers_ahead_then_upper_layers_catch_up(E, n_keep):
    """The early-exit step at the model level: the prefix goes through every layer; then 4 tokens go through
    blocks 1..E one at a time (the cache's lower layers run ahead), then blocks E+1..3 read their outputs in
    one pass. The logits must be those of a full forward, and after a rollback to n_keep of the new tokens
    the cache must continue exactly like one built from the kept text."""
    model = tiny_gpt(1, n_layer=3)
    prefix, new, more = random_ids(5, seed=1), random_ids(4, seed=2), random_ids(3, seed=3)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache=cache)
    hidden = [model(torch.tensor([[t]]), cache=cache, layers=(0, E)).hidden for t in new]
    assert cache.layer_lengths == [9] * E + [5] * (3 - E)
    out = model(None, cache=cache, layers=(E, 3), hidden_in=torch.cat(hidden, dim=1))
    assert cache.layer_lengths == [9, 9, 9]
    assert torch.allclose(out.logits[0], full_logits(model, prefix + new)[5:], atol=TOL)
    cache.rollback(5 + n_keep)
    assert cache.layer_lengths == [5 + n_keep] * 3
    kept = prefix + new[:n_keep]
    got = model(torch.tensor([more]), cache=cache).logits[0]
    assert torch.allclose(got, full_logits(model, kept + more)[-3:], atol=TOL)


@torch.no_grad()
def test_rollback_while_lower_layers_are_ahead():
    model = tiny_gpt(2, n_layer=3)
    ids = random_ids(8, seed=4)
    cache = model.new_cache()
    model(torch.tensor([ids[:4]]), cache=cache)
    model(torch.tensor([ids[4:]]), cache=cache, layers=(0, 2))  # lower layers at 8, the top one at 4
    cache.rollback(6)  # cuts the lower layers; the top one, shorter, keeps its 4
    assert cache.layer_lengths == [6, 6, 4]
    cache.rollback(4)
    got = model(torch.tensor([ids[4:]]), cache=cache).logits[0]
    assert torch.allclose(got, full_logits(model, ids)[4:], atol=TOL)


# ---------------------------------------------------------------------------------------------------------
# The draft's logits


@torch.no_grad()
@pytest.mark.parametrize("E", [1, 2, 3])
@pytest.mark.parametrize("with_adapter", [False, True])
def test_exit_logits_equal_a_plain_forward_through_the_first_layers(E, with_adapter):
    model = tiny_gpt(3, n_layer=4)
    adapter = random_adapter(model) if with_adapter else None
    ids = random_ids(7, seed=5)
    got = exit_logits(model, adapter, E, model(torch.tensor([ids]), layers=(0, E)).hidden)
    small = first_layers(model, E)
    if adapter is None:
        expect = small(torch.tensor([ids])).logits
    else:  # the adapter sits between block E and the shared final norm
        expect = small.lm_head(small.ln_f(adapter.exits[E - 1](small(torch.tensor([ids])).hidden)))
        assert not torch.allclose(got, small(torch.tensor([ids])).logits, atol=1e-3)  # the adapter does something
    assert torch.allclose(got, expect, atol=TOL)


def test_distilling_the_adapter_brings_the_exit_closer_to_the_target():
    """A few steps of the early_exit stage's loss on a frozen tiny target: every exit's KL to the target's law
    goes down, and the untrained adapter (zero last projection) starts as the plain exit."""
    target = tiny_gpt(5, n_layer=3).requires_grad_(False)
    torch.manual_seed(0)
    for p in target.blocks.parameters():  # random blocks that matter: the exits differ from the target
        p.data.add_(0.3 * torch.randn_like(p))
    adapter = ExitAdapter(target.config).double()
    w = torch.randint(0, 11, (8, 24))  # (B, T) windows of random text
    before = exit_losses(adapter, target, w)
    assert before["exit1"].item() == pytest.approx(exit_losses(None, target, w)["exit1"].item())
    opt = torch.optim.Adam(adapter.parameters(), lr=1e-2)
    for _ in range(30):
        loss = sum(v for k, v in exit_losses(adapter, target, w).items() if k.startswith("exit"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = exit_losses(adapter, target, w)
    assert all(after[f"exit{E}"] < 0.5 * before[f"exit{E}"] for E in (1, 2)), (before, after)


# ---------------------------------------------------------------------------------------------------------
# Greedy: `ar`'s tokens


PROMPTS = [random_ids(n, seed=n) for n in (1, 4, 11)] + [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]]  # last: repeats


def check_counts(ids, stats):
    steps = stats["accepted_per_step"]
    assert sum(steps) == stats["new_tokens"] == len(ids) and stats["target_forwards"] == len(steps)
    assert 0 <= stats["accepted"] <= stats["drafted"]


@pytest.mark.parametrize("E, k, with_adapter", [(E, k, (E + k) % 2 == 0) for E in (1, 2, 3) for k in (1, 3, 6)])
def test_early_exit_greedy_equals_ar(E, k, with_adapter):
    """Every exit layer with every draft length; the adapter on in half of them, so that each exit layer and each
    length runs with and without it (the adapter changes only which tokens are guessed)."""
    target = tiny_gpt(E, n_layer=4)
    models = Models(target=target, early_exit=random_adapter(target, E) if with_adapter else None)
    long_steps = 0
    for prompt in PROMPTS:
        expect = METHODS["ar"](models, prompt, 25)[0]
        ids, stats = METHODS["early-exit"](models, prompt, 25, exit_layer=E, draft_len=k)
        assert ids == expect
        check_counts(ids, stats)
        long_steps += sum(n >= 2 for n in stats["accepted_per_step"])
    assert long_steps > 0  # guesses do get accepted: the lower and upper caches met in the middle


@pytest.mark.parametrize("prompt_len", range(8, 13))
def test_early_exit_stops_at_the_context_limit_like_ar(prompt_len):
    target = tiny_gpt(4, n_layer=3, block_size=16)
    prompt = random_ids(prompt_len, seed=prompt_len)
    expect = METHODS["ar"](Models(target=target), prompt, 100)[0]
    ids, stats = METHODS["early-exit"](Models(target=target), prompt, 100, exit_layer=1, draft_len=5)
    assert ids == expect and stats["stop"] == "context"


def chain_models(seed):
    """Every part a chain method might need, tiny and random."""
    target = tiny_gpt(seed, n_layer=3, n_future=3)
    return Models(target=target, draft=tiny_gpt(seed + 50, n_layer=1, n_future=0),
                  early_exit=random_adapter(target, seed), parallelspec=tiny_drafter(target, seed))


CHAIN_METHODS = [name for name, module in MODULES.items()  # the methods that take the length rules
                 if "history" in (module.OPTIONS.get("adaptive") or (0, 0, 0, 0, 0, ()))[5]]
RULES = [pytest.param("off", {}, id="off"), pytest.param("history", {}, id="history"),  # vocab 11: p ~ 0.1
         pytest.param("confidence", {"confidence": 0.12}, id="confidence-0.12"),  # cuts some chains
         pytest.param("confidence", {"confidence": 0.3}, id="confidence-0.3")]  # cuts nearly all after 1 guess


@pytest.mark.parametrize("method", CHAIN_METHODS)
@pytest.mark.parametrize("rule, extra, seed", [pytest.param(*r.values, i % 2, id=r.id) for i, r in enumerate(RULES)])
def test_every_chain_method_with_every_rule_greedy_equals_ar(method, rule, extra, seed):
    """On the models of seed 0 or 1, taking turns from rule to rule: every method meets both."""
    models = chain_models(seed)
    if any(getattr(models, part, None) is None for part in MODULES[method].NEEDS):
        pytest.skip(f"no tiny {MODULES[method].NEEDS} in this test")
    if extra and "confidence" not in MODULES[method].OPTIONS:  # prompt-lookup: no probabilities
        with pytest.raises(ValueError, match="history"):
            METHODS[method](models, PROMPTS[0], 5, adaptive=rule)
        return
    for prompt in PROMPTS:
        expect = METHODS["ar"](models, prompt, 30)[0]
        ids, stats = METHODS[method](models, prompt, 30, adaptive=rule, draft_len=2, **extra)
        assert ids == expect, prompt
        check_counts(ids, stats)


# ---------------------------------------------------------------------------------------------------------
# Sampling with adaptive stopping: the target's law


L = 3  # the prefill's token, then two tokens that went through a verify step


@pytest.mark.parametrize("method, options, sampling, n", [
    pytest.param("speculative", dict(draft_len=3, adaptive="confidence", confidence=0.45), (1.0, None, None), 2000,
                 id="speculative-confidence"),
    pytest.param("early-exit", dict(draft_len=3, adaptive="confidence", confidence=0.45), (1.0, None, None), 2000,
                 id="early-exit-confidence"),
    # history: after a first guess rejected, the second step drafts 1 instead of 2
    pytest.param("early-exit", dict(draft_len=2, adaptive="history"), (0.8, 4, None), 1500,
                 id="early-exit-history-top-k"),
])
def test_sampling_with_adaptive_stopping_follows_the_targets_law(method, options, sampling, n, monkeypatch):
    """V = 5, first 3 tokens: 125 outcomes; tv_bound(125, n) with delta 1e-6: 0.158 for n = 2000, 0.184 for
    1500. The budget lets the first verify step draft all draft_len guesses (the run keeps one for the target).
    The confidence cases drew 3000 (bound 0.130), half a minute each; 2000 keeps the power to see a draft chain
    that takes q's argmax where it should draw (test_draft_chain.py's negative control, here with the rule on):
    it comes out near 0.20 for both, a correct run near 0.045."""
    stops = []  # every decision of the confidence rule: did it stop the chain?
    real_stop = DraftLength.stop
    monkeypatch.setattr(DraftLength, "stop", lambda self, *a: stops.append(real_stop(self, *a)) or stops[-1])
    target = toy_gpt(0, n_layer=2)
    models = Models(target=target, draft=toy_gpt(50), early_exit=random_adapter(target, 1, scale=0.3))
    prompt = [1, 3]
    seqs = [METHODS[method](models, prompt, options["draft_len"] + 2, temperature=sampling[0], top_k=sampling[1],
                            top_p=sampling[2], seed=s, **options)[0][:L] for s in range(n)]  # (n, L)
    law = exact_law(target, prompt, L, sampling)
    distance, bound = tv(empirical_law(sequence_codes(torch.tensor(seqs), 5), 5**L), law), tv_bound(125, n)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f} (n = {n} draws)"
    if options["adaptive"] == "confidence":  # the rule really cut chains short, and not every time
        assert 0.1 < sum(stops) / len(stops) < 0.9, sum(stops) / len(stops)


# ---------------------------------------------------------------------------------------------------------
# The rules' bookkeeping


def test_history_rule_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    length, ks = DraftLength("history", 4), []
    for drafted, accepted in [(4, 4), (6, 2), (5, 5), (7, 0), (6, 0), (0, 0)]:
        length.update(drafted, accepted)
        ks.append(length.k)
    assert ks == [6, 5, 7, 6, 5, 5]  # a step without guesses (near the budget's end) changes nothing
    capped = DraftLength("history", 2, most=3)
    capped.update(2, 2)
    assert capped.k == 3
    off = DraftLength("off", 4)
    off.update(4, 4)
    assert off.k == 4 and not off.stop(torch.tensor([0.0, 9.0]), 0)


def test_confidence_rule_stops_after_the_first_unconfident_guess():
    length = DraftLength("confidence", 8, threshold=0.5)
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.9, 0.1]])  # the drafter's laws for 4 guesses
    logits = probs.log()
    assert length.cut(logits, [0, 1, 0, 0]) == [0, 1, 0, 0]  # 0.9, 0.8, 0.7, 0.9: all confident
    assert length.cut(logits, [0, 1, 1, 0]) == [0, 1, 1]  # 0.3 < 0.5: the third guess is the last
    assert length.stop(logits[0], 1) and not length.stop(logits[0], 0)
    with pytest.raises(ValueError, match="adaptive"):
        DraftLength("sometimes", 4)
