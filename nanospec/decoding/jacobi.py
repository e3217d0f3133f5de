"""
`jacobi`: guess a whole block of future tokens, then let one forward improve every guess at once. Greedy
decoding is a fixed point: y_i = argmax p(. | prefix, y_1..y_{i-1}) for all i. Jacobi iteration solves it
like a linear system: feed the current guesses, take each position's argmax as its new guess, repeat. Each
forward fixes at least one more token (the first argmax only depends on the prefix), and the guesses that
already equal the target's argmax are committed at once. Nothing is trained. Lossless, greedy and sampling.

Santilli et al. 2023, "Accelerating Transformer Inference for Translation via Parallel Decoding",
arXiv 2305.10427; Song et al. 2021, "Accelerating Feedforward Computation via Parallel Nonlinear Equation
Solving", arXiv 2002.03629.

One step, block 4, greedy; the sequence ends in 12, the current guesses (the iterate) are [5, 9, 2, 2]:
    one target forward over [12, 5, 9, 2, 2] -> argmax after each: [5, 9, 7, 3, 6]
    5 == 5 accept, 9 == 9 accept, 2 != 7 reject -> emit [5, 9, 7]
    the argmaxes after the rejected guesses, [3, 6], are the next iterate, padded to 4: [3, 6, 6, 6].
The accepted guesses plus the target's own token are the committed prefix, and the same forward yields the
next iterate: every argmax past the commit point (Jacobi's update, for the positions still open).

The rule. Committing "the guesses equal to the argmax" is the chain point-mass rule in its greedy form, so
sampling uses that rule on the iterate (nanospec/rules/verify.py, verify_chain with q = point_mass(x)): guess x
is accepted with probability p(x); on rejection the emitted token is a sample of p with x removed. The iterate
is fixed by what earlier steps produced, before this step draws anything, which is all the rule needs to
reproduce p exactly. Under sampling the next iterate still takes each position's argmax: the most likely token
is the guess the rule accepts most often.

Honest expectation: on real models plain Jacobi commits little more than one token per forward (the CLLM
paper, arXiv 2403.00835, puts its speedup near 1.05x), because a guess is computed from the guesses before
it, which the same step may reject: a correction travels one position per forward. It pays when the text
is settling into a loop, as a tiny model's greedy text often does. `lookahead` keeps the trajectories as
n-gram guesses instead, which is what makes them pay more often.
"""
import torch

from nanospec.steps.adaptive import PRICED_OPTIONS, draft_length
from nanospec.steps.options import Option, Sampling, read_options
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import first_token, new_run
from nanospec.steps.verify_step import chain_step

NEEDS = ()  # model parts beyond the target
USES = ()  # parts used when present
OPTIONS = {"block": Option(int, 8, "future tokens guessed and refined in parallel per target forward (the most, "
                                   "adaptive)", low=1, high=64), **PRICED_OPTIONS}


def pad(iterate, last, k):
    """The iterate cut or padded to k guesses by repeating its last one (`last`, the newest token, when it is
    empty): [3, 6], k 4 -> [3, 6, 6, 6]; [], last 12, k 3 -> [12, 12, 12]."""
    return (iterate + [iterate[-1] if iterate else last] * k)[:k]


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    draft_policy = draft_length(opts, opts.block, costs=step_costs(models, __name__, run.sampling, opts))
    target = models.target
    cache = target.new_cache()

    first_token(run, target, cache, draft_policy)  # seq[-1] opens each verify forward (`ar` if no draft pays)
    iterate = []  # no guesses yet: the first block pads
    while not run.done:
        last = run.seq[-1]
        k = run.draft_room(draft_policy.k)  # a shorter block near the context end or the token budget
        iterate = pad(iterate, last, k)  # (k,)
        # One target forward over [last, y1..yk] checks the iterate; the cache keeps last + accepted guesses.
        [emitted], [n], out = chain_step(run.sampling, run.generator, target, cache, [last], [iterate])  # one row
        # Row j of the logits predicts the token after y_j. Rows past the commit point (n + 1 tokens) are the
        # refined guesses for the tokens after the emitted ones.
        iterate = out.logits[0, n + 1:].argmax(-1).tolist() if k else []  # k - n tokens: the next iterate
        draft_policy.update(k, n)
        run.emit(emitted, drafted=k)

    return run.out, run.stats(block=opts.block)
