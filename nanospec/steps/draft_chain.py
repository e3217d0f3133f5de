"""
A drafter's chain of guesses. `draft_chain`, for the methods that draft autoregressively (`speculative`: the draft
GPT; `early-exit`: the target's first layers and its exit): each guess is drawn from the drafter's warped law q
and fed back to the drafter before the next one. `chain_at_once`, for drafters that guess every position in one
pass (`mtp`'s heads, `parallelspec`'s masks): guess i never sees the guesses before it.

    draft reads [12] -> law q1, draws 5; reads [5] -> q2, draws 9; reads [9] -> q3, draws 2
    -> drafts [[5, 9, 2]] and q_draft [[q1, q2, q3]] (1, 3, V): Leviathan's rule needs the law each guess came from

The guesses stay on the device while the chain runs (each forward reads the previous draw there) and come back to
the host in one read at the end. Greedy, the guess is the argmax and no q is built.
"""
import torch

from nanospec.rules.verify import sample, warp


def draft_chain(step, x, k, sampling, generator=None, stop=None, first=None):
    """k guesses per row, each fed back: step(x) -> the drafter's logits (B, V) for the token after x, x (B, T)
    token ids (T = 1 after the first guess; one prompt is one row); each guess is drawn from q = warp(logits,
    *sampling) with `generator`. stop(logits, guess) -> True ends the chain after that guess (one row:
    adaptive.DraftLength.stopper, --adaptive confidence). first: the logits (B, V) of the first guess when the
    drafter already gave them (eagle's head, after reading the accepted tokens): step then runs from the second on.
    Returns (drafts: B lists of j ints, q_draft (B, j, V)), j = k unless stopped; greedy, q_draft is None: every
    rule then judges by the target's argmax alone (steps/verify_step.py), and a one-hot q would cost two tensor
    operations a guess for nothing."""
    if k == 0:
        return [[] for _ in range(x.size(0) if first is None else first.size(0))], None
    drafts = []  # (B,) each, on the device
    q_rows = []  # (B, V) each
    for i in range(k):
        logits = first if i == 0 and first is not None else step(x)  # (B, V)
        if sampling.greedy:
            drafts.append(logits.argmax(-1))  # (B,) on the device
        else:
            q_rows.append(warp(logits, *sampling))  # (B, V)
            drafts.append(sample(q_rows[-1], generator))  # (B,) on the device
        x = drafts[-1][:, None]  # (B, 1) the next forward reads it there
        if stop is not None and stop(logits[0], drafts[-1][0]):
            break
    q_draft = torch.stack(q_rows, 1) if q_rows else None  # (B, j, V)
    return torch.stack(drafts, 1).tolist(), q_draft  # one host read: the guesses (B, j)


def chain_at_once(logits, draft_policy, sampling, drawn=False, generator=None, noise=None):
    """The chain of a drafter that guesses every position at once: logits (k, V), row i for guess i+1. The guesses
    are each row's top-1 (q_draft None: point masses), or when `drawn`, draws from each row's warped law q_draft
    (warped like the target's p), or, given `noise` (k+1 or more rows, verify.race_noise: --draft-sampling coupled),
    each row's winner in the race of its position, the one the target's token will win (q_draft None: the coupled
    rule needs none); cut after the first unconfident one (draft_policy.cut, --adaptive confidence).
    Returns (guesses: j ints, q_draft (1, j, V) or None): one row, as chain_step takes it."""
    if noise is not None:
        return draft_policy.cut(logits, sample(warp(logits, *sampling), noise=noise[:len(logits)]).tolist()), None
    if not drawn:
        return draft_policy.cut(logits, logits.argmax(-1).tolist()), None
    q_draft = warp(logits, *sampling)  # (k, V)
    guesses = draft_policy.cut(logits, sample(q_draft, generator).tolist())  # k ints, or fewer (confidence)
    return guesses, q_draft[None, :len(guesses)]
