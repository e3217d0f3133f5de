"""
A drafter's chain of guesses, for the methods that draft autoregressively (`speculative`: the draft GPT;
`early-exit`: the target's first layers and its exit): each guess is drawn from the drafter's warped law q and fed
back to the drafter before the next one.

    draft reads [12] -> law q1, draws 5; reads [5] -> q2, draws 9; reads [9] -> q3, draws 2
    -> drafts [5, 9, 2] and q_draft [q1, q2, q3] (3, V): Leviathan's rule needs the law each guess came from

The guesses stay on the device while the chain runs (each forward reads the previous draw there) and come back to
the host in one read at the end. Greedy, q is one-hot and the draw is the argmax.
"""
import torch

from nanospec.verify import sample, warp


def draft_chain(step, x, k, sampling, generator=None, stop=None):
    """k guesses, each fed back: step(x) -> the drafter's logits (V,) for the token after x, x (1, T) token ids
    (T = 1 after the first guess); each guess is drawn from q = warp(logits, *sampling) with `generator`.
    stop(logits, guess) -> True ends the chain after that guess (adaptive.DraftLength.stop: --adaptive confidence).
    Returns (drafts: a list of j ints, q_draft (j, V)), j = k unless stopped."""
    if k == 0:
        return [], None
    drafts = []  # () each, on the device
    q_rows = []  # (V,) each
    for _ in range(k):
        logits = step(x)  # (V,)
        q_rows.append(warp(logits, *sampling))  # (V,)
        drafts.append(logits.argmax() if sampling.greedy else sample(q_rows[-1], generator))  # () on the device
        x = drafts[-1].view(1, 1)  # (1, 1) the next forward reads it there
        if stop is not None and stop(logits, drafts[-1]):
            break
    return torch.stack(drafts).tolist(), torch.stack(q_rows)  # one host read: the guesses
