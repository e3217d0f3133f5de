"""
The verify step every chain method shares (prompt-lookup, jacobi, speculative, mtp, early-exit, parallelspec's
chain): one target forward over [last, d1..dk], a chain rule on its logits, and the cache rolled back to what was
accepted. `tree_step.py` is the same step for a tree of guesses.

    cache = [.. prefix ..]; last = 12, drafts [5, 9, 2]; target argmax after 12, 5, 9, 2 = [5, 9, 7, 3]
    -> accept 5, 9; emit [5, 9, 7]; cache = [.. prefix .., 12, 5, 9]; 7 opens the next forward.

The rule follows where the guesses came from: drafts DRAWN from a drafter's q_draft are checked with Leviathan's
rule (verify.verify_chain), deterministic guesses with the point-mass rule (verify.verify_chain_point_mass);
greedy, both reduce to "accept while the guess is the argmax" (verify.verify_chain_greedy, no law built).
Either way a step reads the device once: on a GPU each read waits for every queued kernel. Greedy guesses made
on the host (prompt-lookup's copies) go through verify_chain_greedy, whose one read is the target's argmax;
guesses a drafter left on the device (speculative, jacobi, mtp, early-exit), and every guess when sampling, are
checked there (`verify_on_device`, the batched rules), and the guesses, the accepted count and the next token
come back in one read.
"""
import torch

from nanospec.verify import verify_chain_batched, verify_chain_greedy, verify_chain_point_mass_batched, warp


def chain_step(run, target, cache, last, drafts, q_draft=None, heads=False):
    """One target forward over [last, d1..dk], then `chain_verify`.

    last: the newest emitted token (not yet in the cache); drafts: k guesses for the tokens after it, a list of
    ints or a (k,) LongTensor left on the device (a drafter that samples there); q_draft (k, V): the draft's law
    each guess was drawn from (Leviathan's rule), or None for deterministic guesses (point-mass rule).
    target: the model, or what runs its forwards (nanospec/static.py's StaticGPT). Returns (emitted tokens =
    accepted drafts + the target's next token, n_accepted, the forward's Output). Afterwards the cache holds the
    sequence up to the last accepted draft; the new token is not in it yet.
    """
    n_before = cache.length
    draft_ids = torch.as_tensor(drafts, dtype=torch.long, device=cache.device).reshape(-1)  # (k,)
    x = torch.cat([torch.tensor([last], device=cache.device), draft_ids])[None]  # (1, k+1)
    with run.forwarding():
        out = target(x, cache=cache, heads=heads)  # logits (1, k+1, V)
    emitted, n = chain_verify(run, cache, n_before, out.logits[0], drafts, q_draft)
    return emitted, n, out


def chain_verify(run, cache, n_before, logits, drafts, q_draft=None):
    """The second half of `chain_step`, for a method that runs the verify forward its own way (`early-exit`
    runs only the upper layers): the chain rule on that forward's logits (k+1, V) over [last, d1..dk], then the
    cache rolled back to n_before (its length before last) + last + the accepted drafts.
    Returns (emitted tokens, n_accepted). Either way ONE host read: greedy guesses made on the host (a list) go
    through verify_chain_greedy, whose one read is the argmax; everything else through `verify_on_device`."""
    if run.sampling.greedy and not torch.is_tensor(drafts):  # "accept while guess == argmax"; skip building p
        n, nxt = verify_chain_greedy(logits, list(drafts))
        emitted = list(drafts[:n]) + [nxt]
    else:  # host guesses go to the device (a copy, not a read): the rule runs there, one read brings all back
        draft_ids = torch.as_tensor(drafts, dtype=torch.long, device=logits.device).reshape(-1)  # (k,)
        emitted, n = verify_on_device(run, logits, draft_ids, q_draft)
    cache.rollback(n_before + 1 + n)  # keep last and the accepted drafts
    return emitted, n


def verify_on_device(run, logits, draft_ids, q_draft=None):
    """The same rules for guesses that never left the device, draft_ids (k,): the rule's result stays there
    too (the batched forms, with a batch of 1, draw exactly what verify_chain and verify_chain_point_mass draw),
    and the guesses, the accepted count and the next token come back in ONE read: on a GPU each read waits for
    every queued kernel. Returns (emitted tokens, n_accepted)."""
    if run.sampling.greedy:
        n, nxt = accept_greedy(logits, draft_ids)
    elif q_draft is None:
        n, nxt = verify_chain_point_mass_batched(warp(logits, *run.sampling)[None], draft_ids[None], run.generator)
    else:
        n, nxt = verify_chain_batched(warp(logits, *run.sampling)[None], q_draft[None], draft_ids[None],
                                      run.generator)
    *guesses, n, nxt = torch.cat([draft_ids, n.reshape(1), nxt.reshape(1)]).tolist()  # the one host read
    return guesses[:n] + [nxt], n


def accept_greedy(logits, draft_ids):
    """verify_chain_greedy on the device: logits (k+1, V), draft_ids (k,) -> n_accepted, next token, both 0-d
    LongTensors. draft [5, 9, 2], argmax [5, 9, 7, 3] -> matches [1, 1, 0], running product [1, 1, 0] -> 2; 7."""
    best = logits.argmax(-1)  # (k+1,) first maximum on ties, as warp(logits, 0)
    n = (best[:-1] == draft_ids).long().cumprod(0).sum()  # () the all-matching prefix
    return n, best[n]
