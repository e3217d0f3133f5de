"""`speculative` end to end: a draft GPT guesses, the target verifies, and the output must be the target's.

  - greedy: token for token equal to `ar`, for many prompts, draft lengths and model pairs, including a draft
    equal to the target (everything accepted), a useless draft, one-token prompts, and the context limit or
    end-of-text falling inside an accepted run of drafts;
  - sampling: the empirical joint law of the first 3 generated tokens matches the target's exact law, which
    we enumerate by running the target over every prefix, within a total-variation bound derived from the
    number of draws (`tv_bound` in tests/laws.py, delta = 1e-6); a negative control (each guess verified
    against the wrong row of q) must exceed the same bound;
  - a draft equal to the target accepts every guess even when sampling: only possible if the draft cache
    holds exactly the sequence at every step;
  - the stats add up, the seed decides the output, and bad requests are one-line errors.
Tiny float64 models, so argmax ties do not happen and equal distributions are equal to the last bits.
"""
import pytest
import torch

from nanospec.model.load import Models
from nanospec.decoding import METHODS, check_method
from nanospec.decoding import speculative as speculative_module
from nanospec.steps.verify_step import chain_step
from laws import empirical_law, exact_law, sequence_codes, tv, tv_bound
from toys import random_ids, tiny_gpt, toy_gpt

ar, speculative = METHODS["ar"], METHODS["speculative"]


def check_stats(ids, stats, k):
    """The counts every run must satisfy, whatever the draft."""
    steps = stats["accepted_per_step"]
    assert sum(steps) == stats["new_tokens"] == len(ids)
    assert stats["target_forwards"] == len(steps)
    assert all(1 <= n <= k + 1 for n in steps[:-1]) and 0 <= steps[-1] <= k + 1
    assert 0 <= stats["accepted"] <= stats["drafted"] <= k * (len(steps) - 1)
    assert stats["draft_forwards"] == stats["drafted"]
    assert stats["accepted"] <= stats["judged"] <= stats["drafted"]
    assert stats["acceptance_rate"] == stats["accepted"] / max(1, stats["judged"])


# ---------------------------------------------------------------------------------------------------------
# Greedy: the same tokens as `ar`

PROMPTS = [random_ids(n, seed=n) for n in (1, 2, 5, 11, 20)]


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("seed", range(3))
def test_greedy_equals_ar(seed, k):
    target, draft = tiny_gpt(seed), tiny_gpt(seed + 50, n_layer=1, n_future=0)
    for prompt in PROMPTS:
        expected, _ = ar(Models(target=target), prompt, 25)
        ids, stats = speculative(Models(target=target, draft=draft), prompt, 25, draft_len=k)
        assert ids == expected
        check_stats(ids, stats, k)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_equal_to_target_accepts_everything(k):
    target = tiny_gpt(0)
    prompt = random_ids(4)
    steps = 4
    n_new = 1 + steps * (k + 1)  # the prefill's token, then k guesses + 1 bonus per step
    ids, stats = speculative(Models(target=target, draft=target), prompt, n_new, draft_len=k)
    assert ids == ar(Models(target=target), prompt, n_new)[0]
    assert stats["accepted_per_step"] == [1] + [k + 1] * steps
    assert stats["accepted"] == stats["drafted"] == steps * k and stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("k", [1, 4])
def test_terrible_draft_is_still_exact(k):
    target = tiny_gpt(1)
    draft = tiny_gpt(7, n_layer=1, n_future=0)
    draft.lm_head.weight = torch.nn.Parameter(torch.zeros_like(draft.lm_head.weight))  # unties it from wte
    # all logits 0 -> greedy picks token 0 every time: a guess the target rarely agrees with
    for prompt in PROMPTS:
        expected, _ = ar(Models(target=target), prompt, 25)
        ids, stats = speculative(Models(target=target, draft=draft), prompt, 25, draft_len=k)
        assert ids == expected
        check_stats(ids, stats, k)
        # a guess of 0 is accepted exactly when the target's next token is 0 (after accepted 0s)
        assert stats["accepted"] <= expected.count(0)


@pytest.mark.parametrize("prompt_len", range(6, 13))
@pytest.mark.parametrize("draft_kind", ["equal", "other"])
def test_context_limit_inside_an_accepted_run(prompt_len, draft_kind):
    # block_size 16: the sequence fills it at a different offset within a step for each prompt length
    target = tiny_gpt(2, block_size=16)
    draft = target if draft_kind == "equal" else tiny_gpt(52, block_size=16, n_layer=1, n_future=0)
    prompt = random_ids(prompt_len, seed=prompt_len)
    expected, _ = ar(Models(target=target), prompt, 100)
    ids, stats = speculative(Models(target=target, draft=draft), prompt, 100, draft_len=4)
    assert ids == expected and len(ids) == 16 - prompt_len and stats["stop"] == "context"
    check_stats(ids, stats, 4)


@pytest.mark.parametrize("position", range(1, 9))
def test_end_of_text_inside_an_accepted_run(position):
    # with the target as its own draft every step emits k + 1 = 4 tokens, so positions 1..8 fall at every
    # offset inside a step's accepted drafts and at its bonus token
    target = tiny_gpt(3)
    prompt = random_ids(3, seed=3)
    full, _ = ar(Models(target=target), prompt, 30)
    eot = full[position]
    expected, _ = ar(Models(target=target, eot=eot), prompt, 30)
    assert len(expected) <= position  # eot may also occur earlier; then it stops there
    for draft in (target, tiny_gpt(53, n_layer=1, n_future=0)):
        ids, stats = speculative(Models(target=target, draft=draft, eot=eot), prompt, 30, draft_len=3)
        assert ids == expected and stats["stop"] == "eot"
        check_stats(ids, stats, 3)


def test_budget_and_draft_length_longer_than_the_budget():
    target, draft = tiny_gpt(4), tiny_gpt(54, n_layer=1, n_future=0)
    for n_new in (1, 2, 3, 7):
        ids, stats = speculative(Models(target=target, draft=draft), [5], n_new, draft_len=8)
        assert ids == ar(Models(target=target), [5], n_new)[0] and stats["stop"] == "max_new_tokens"
        check_stats(ids, stats, 8)


# ---------------------------------------------------------------------------------------------------------
# Sampling: the law of the output is the target's


L = 3  # judge the first 3 generated tokens: the prefill's token, then tokens that went through verification


def sampled_tv(k, sampling, n, prompt=(1, 3)):
    """TV distance between the law of `speculative`'s first L tokens over n seeded runs and the target's
    exact law, and the bound a correct sampler stays under with probability 1 - 1e-6 (`tv_bound`:
    P(TV > eps) <= 2^K exp(-2 n eps^2) over the K outcomes the target can produce)."""
    target, draft = toy_gpt(0), toy_gpt(50)
    law = exact_law(target, list(prompt), L, sampling)
    models = Models(target=target, draft=draft)
    temperature, top_k, top_p = sampling
    # budget L + k - 1: the step after the prefill can draft all k guesses (the budget keeps one for the
    # target's own token), so the first L tokens always come through a full verify step
    seqs = torch.tensor([speculative(models, list(prompt), L + k - 1, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=s, draft_len=k)[0][:L] for s in range(n)])  # (n, L)
    K = int((law > 0).sum())  # an outcome the target cannot produce only adds to the distance
    return tv(empirical_law(sequence_codes(seqs, 5), 5**L), law), tv_bound(K, n)


# n is set by the time budget (about 2.5 ms a run). What the bounds can see was checked by swapping in the
# broken rules of test_chain_rules.py: a residual not renormalised, a fresh sample of p after a rejection, q rows
# off by one (k = 2) and a bonus drawn from q (k = 1) give TV 0.22-0.44, above every bound here.
@pytest.mark.parametrize("k, sampling, n", [
    (1, (1.0, None, None), 2000),  # the 2nd token is a verified guess, the 3rd the bonus (bound 0.159)
    (2, (1.0, None, None), 3000),  # the 2nd and 3rd tokens come out of one verify step (bound 0.129)
    (3, (0.8, 3, 0.9), 1500),  # temperature, top-k and top-p, the same for target and draft (bound 0.083)
])
def test_sampling_follows_the_targets_law(k, sampling, n):
    distance, bound = sampled_tv(k, sampling, n)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f} ({n} runs)"


def test_misaligned_draft_probabilities_are_caught(monkeypatch):
    """Negative control at the method level: verify each guess against the q of the guess before it (a bug
    the draft loop could make). The same statistic, with only 1000 runs, must exceed its bound."""
    def misaligned(sampling, generator, target, cache, last, drafts, q_draft, *rule, **forward):
        q_wrong = None if q_draft is None else torch.roll(q_draft, 1, 1)  # (1, k, V) row i = q of guess i-1
        return chain_step(sampling, generator, target, cache, last, drafts, q_wrong, *rule, **forward)

    monkeypatch.setattr(speculative_module, "chain_step", misaligned)
    distance, bound = sampled_tv(2, (1.0, None, None), 1000)
    assert distance > bound, f"TV {distance:.4f} <= bound {bound:.4f}: the test cannot see this bug"


def test_draft_equal_to_target_accepts_everything_when_sampling():
    # p and q are then equal to the last bits, so min(1, p/q) = 1 and nothing is rejected. One token of the
    # wrong context in the draft cache would make q differ from p and some guess would be rejected.
    target = toy_gpt(1)
    for seed in range(3):
        ids, stats = speculative(Models(target=target, draft=target), [2], 40, temperature=1.0, seed=seed,
                                 draft_len=3)
        assert stats["acceptance_rate"] == 1.0 and stats["drafted"] > 0
        check_stats(ids, stats, 3)


def test_sampling_is_seeded():
    models = Models(target=toy_gpt(2), draft=toy_gpt(52))
    a = speculative(models, [1, 2], 30, temperature=1.0, seed=7)[0]
    b = speculative(models, [1, 2], 30, temperature=1.0, seed=7)[0]
    c = speculative(models, [1, 2], 30, temperature=1.0, seed=8)[0]
    assert a == b and a != c


# ---------------------------------------------------------------------------------------------------------
# Bad requests


def test_bad_requests_are_clear_errors():
    target = tiny_gpt(0)
    with pytest.raises(ValueError, match="draft_len"):
        speculative(Models(target=target, draft=target), [1], 5, draft_len=0)
    with pytest.raises(ValueError, match="different tokenizers"):
        speculative(Models(target=target, draft=tiny_gpt(1, vocab_size=12)), [1], 5)
    with pytest.raises(ValueError, match="needs the draft model"):
        check_method("speculative", Models(target=target))
