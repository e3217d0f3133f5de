"""
`mtp`: self-speculation with the model's own multi-token-prediction heads, one chain of guesses per forward.

Head i (1-based) reads the trunk's hidden state at position t and predicts token t+1+i; the main head predicts
t+1. So one forward gives the next token (main head) AND a guess for each of the n tokens after it (heads
1..n, top-1). The next forward feeds [next token, guess 1..n]: the main head's logits at each position verify
the guesses (chain rule, point-mass drafts), and the heads at the last accepted position already give the
next chain of guesses. Drafting costs no forward of its own: the heads are small MLPs on one hidden state.

    forward over [12]         main head -> 5;  heads 1, 2, 3 -> guesses [9, 2, 4]   emit [5]
    forward over [5, 9, 2, 4] main argmax after 5, 9, 2, 4 = [9, 2, 7, 1]           accept 9, 2; emit [9, 2, 7]
                              heads at the position of 2 (which predicted 7) -> the next guesses
    the cache keeps [.., 5, 9, 2]; 7 is fed with its guesses in the next forward.

Greedy: guesses are accepted while they equal the main head's argmax, so the output is `ar`'s token for
token. Sampling: the point-mass rule (accept guess x with probability p(x), else emit a sample of p without
x) keeps the output distribution exactly the target's.

Papers: Stern et al. 2018, Blockwise Parallel Decoding, arXiv 1811.03115; Gloeckle et al. 2024, Better &
Faster Large Language Models via Multi-token Prediction, arXiv 2404.19737.
"""
import torch

from nanospec.decoding.adaptive import ADAPTIVE_OPTIONS, DraftLength
from nanospec.decoding.common import chain_step, check_sampling, start, tensor
from nanospec.verify import sample, warp

NEEDS = ()  # the MTP heads are part of the target
USES = ("heads",)  # heads.pt, the heads retrained alone, replaces the jointly trained ones when present
OPTIONS = {
    "draft_len": (int, None, "tokens to guess per forward: MTP heads to use, 1..n_future (None = all heads)"),
    **ADAPTIVE_OPTIONS,  # confidence: a head's softmax probability of its top-1 guess
}


def head_guesses(target, hidden, k, length):
    """hidden (1, 1, C) the trunk state at one position -> the top-1 guess of heads 1..k (a list), cut after
    the first unconfident head when `length` (adaptive.DraftLength) uses the confidence rule."""
    if k == 0:
        return []
    logits = target.head_logits(hidden, k)[0, :, 0]  # (k, V)
    return length.cut(logits, logits.argmax(-1).tolist())


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None,
             draft_len=None, adaptive="off", confidence=0.5):
    check_sampling(temperature, top_k, top_p)
    target = models.target
    n_future = target.config.n_future
    draft_len = n_future if draft_len is None else draft_len
    if not 1 <= draft_len <= n_future:
        raise ValueError(f"draft_len must be in 1..{n_future} (the model's MTP heads), got {draft_len}")
    run = start(models, prompt_ids, max_new_tokens, seed)
    sampling = (temperature, top_k, top_p)
    length = DraftLength(adaptive, draft_len, confidence, most=n_future)  # k per step: fixed or adaptive
    cache = target.new_cache()

    # prefill: the main head gives the first token, the heads at the last prompt position the first guesses
    out = target(tensor(run.prompt, cache.k.device), cache=cache)
    last = int(sample(warp(out.logits[0, -1], *sampling), run.generator))
    drafts = head_guesses(target, out.hidden[:, -1:], length.k, length)
    done = run.emit([last])
    drafted, accepted = [0] * n_future, [0] * n_future  # per head: guesses verified, guesses accepted
    while not done:
        drafts = drafts[:run.draft_room(len(drafts))]  # near the end of the budget or context, guess fewer
        emitted, n, out = chain_step(run, target, cache, last, drafts, sampling)
        for i in range(len(drafts)):
            drafted[i] += 1
            accepted[i] += i < n
        length.update(len(drafts), n)
        done = run.emit(emitted)
        last = emitted[-1]
        # out.hidden[:, n] is the position of the last accepted token, whose main head chose `last`:
        # its heads guess the tokens after `last`
        drafts = head_guesses(target, out.hidden[:, n:n + 1], length.k, length)
    return run.out, run.stats(drafted=sum(drafted), accepted=sum(accepted),
                              acceptance_rate=sum(accepted) / max(1, sum(drafted)),
                              head_acceptance=[a / d for a, d in zip(accepted, drafted) if d])  # heads used
