"""
The verify step every chain method shares (prompt-lookup, jacobi, speculative, mtp, early-exit, parallelspec's
chain): one target forward over [last, d1..dk], a chain rule on its logits, and the cache rolled back to what was
accepted. `tree_step.py` is the same step for a tree of guesses.

    cache = [.. prefix ..]; last = 12, drafts [5, 9, 2]; target argmax after 12, 5, 9, 2 = [5, 9, 7, 3]
    -> accept 5, 9; emit [5, 9, 7]; cache = [.. prefix .., 12, 5, 9]; 7 opens the next forward.

The rule follows where the guesses came from: drafts DRAWN from a drafter's q_draft are checked with Leviathan's
rule (verify.verify_chain), deterministic guesses with the point-mass rule (verify.verify_chain_point_mass);
greedy, both reduce to "accept while the guess is the argmax" (verify.verify_chain_greedy, no law built).
"""
import torch

from nanospec.decoding.run import tensor
from nanospec.verify import verify_chain, verify_chain_greedy, verify_chain_point_mass, warp


def chain_step(run, target, cache, last, drafts, q_draft=None, heads=False):
    """One target forward over [last, d1..dk], then `chain_verify`.

    last: the newest emitted token (not yet in the cache); drafts: k guesses for the tokens after it;
    q_draft (k, V): the draft's law each guess was drawn from (Leviathan's rule), or None for deterministic
    guesses (point-mass rule). Returns (emitted tokens = accepted drafts + the target's next token, n_accepted,
    the forward's Output). Afterwards the cache holds the sequence up to the last accepted draft; the new token
    is not in it yet.
    """
    n_before = cache.length
    out = target(tensor([last] + list(drafts), cache.device), cache=cache, heads=heads)  # logits (1, k+1, V)
    emitted, n = chain_verify(run, cache, n_before, out.logits[0], drafts, q_draft)
    return emitted, n, out


def chain_verify(run, cache, n_before, logits, drafts, q_draft=None):
    """The second half of `chain_step`, for a method that runs the verify forward its own way (`early-exit`
    runs only the upper layers): the chain rule on that forward's logits (k+1, V) over [last, d1..dk], then the
    cache rolled back to n_before (its length before last) + last + the accepted drafts.
    Returns (emitted tokens, n_accepted)."""
    draft_ids = torch.tensor(list(drafts), dtype=torch.long, device=logits.device)  # (k,)
    if run.sampling.greedy:  # both rules reduce to "accept while guess == argmax"; skip building p
        n, nxt = verify_chain_greedy(logits, draft_ids)
    elif q_draft is None:
        n, nxt = verify_chain_point_mass(warp(logits, *run.sampling), draft_ids, run.generator)
    else:  # warp(logits): the target's law (k+1, V) after last, d1, ..., dk
        n, nxt = verify_chain(warp(logits, *run.sampling), q_draft, draft_ids, run.generator)
    cache.rollback(n_before + 1 + n)  # keep last and the accepted drafts
    return list(drafts[:n]) + [int(nxt)], n
