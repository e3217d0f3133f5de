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
token. Sampling (temperature > 0), three ways, each keeping the output's law exactly the target's:
  draft_sampling "coupled" (default): one race per position (verify.race_noise: a random clock per token), the
      target's token there is the winner under p and guess i is the winner under head i's q; a guess is accepted
      while it is that token (verify_chain_coupled: greedy's rule on the winners, so a sampled step costs the host
      what a greedy one does; accepted a little less often than Leviathan's rule, 0.33 against 0.38 for head 1).
  draft_sampling "sample": guess i is DRAWN from head i's warped law q_i and the chain is verified with
      Leviathan's rule (verify_chain): accept with min(1, p_i(x)/q_i(x)), else a sample of norm(max(0, p_i - q_i)).
  draft_sampling "topk": guess i is head i's top-1, a point mass: accepted with probability p_i(x), which is
      small when the target's law is flat, however good the head (the chance p gives ANY single token).
What a head's q is: head i reads the state at the position that chose `last` and never sees `last` or the
guesses before its own, so q_i is the head's law for that token MARGINALISED over the tokens in between, while
p_i is conditioned on them. The rule stays lossless all the same: each guess is drawn from exactly the q it is
verified against, given the guesses before it, because that q does not depend on them (they are independent
draws). What the marginal costs is acceptance: the accept rate sum(min(p_i, q_i)) falls with the distance
between the conditional p_i and the marginal q_i, which grows with i (docs/measurements.md, mtp).

The heads run inside the verify forward (target(..., heads=k): on every position, unembedded with the main head
at once), and the next guesses come from those at the last accepted position; none before a plain step.

Papers: Stern et al. 2018, Blockwise Parallel Decoding, arXiv 1811.03115; Gloeckle et al. 2024, Better &
Faster Large Language Models via Multi-token Prediction, arXiv 2404.19737.
"""
import torch

from nanospec.steps.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.rules.verify import race_noise
from nanospec.steps.draft_chain import chain_at_once
from nanospec.steps.options import COUPLED_DRAFT_SAMPLING_OPTION, Option, Sampling, read_options, verify_option
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import first_token, heads_at, new_run
from nanospec.steps.verify_step import chain_step

NEEDS = ()  # the MTP heads are part of the target
USES = ("heads",)  # heads.pt, the heads retrained alone, replaces the jointly trained ones when present
OPTIONS = {
    "draft_len": Option(int, None, "tokens to guess per forward: MTP heads to use, 1..n_future (None = all heads)"),
    **ADAPTIVE_OPTIONS,  # confidence: a head's softmax probability of its guess
    **COUPLED_DRAFT_SAMPLING_OPTION, **verify_option("chain"),
}


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    model = models.target
    n_future = model.config.n_future
    k = n_future if opts.draft_len is None else opts.draft_len
    if not 1 <= k <= n_future:
        raise ValueError(f"draft_len must be in 1..{n_future} (the model's MTP heads), got {opts.draft_len}")
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    costs = step_costs(models, __name__, run.sampling, opts)
    draft_policy = draft_length(opts, k, most=n_future, costs=costs)  # k per step: fixed or adaptive
    drawn = run.sampling.guesses_drawn(opts.draft_sampling)  # else each head's top-1, or
    coupled = run.sampling.guesses_coupled(opts.draft_sampling)  # the heads run in the target's own races
    if coupled and opts.verify != "token":
        raise ValueError(f"--verify {opts.verify} judges guesses drawn from the heads' q (--draft-sampling sample or "
                         "topk); coupled guesses have their own rule: leave --verify out")
    cache = model.new_cache()

    def guesses_at(out, n):  # the next step's k guesses from the heads at position n of `out`, the forward's
        # Output, their q_draft (1, k, V) and, coupled, the races of the k + 1 positions after `last` (1, k+1, V);
        # none before a plain step (k = 0)
        if not draft_policy.k:
            return [], None, None
        head_logits = heads_at(model, out, n, draft_policy.k)  # (k, V)
        noise = race_noise((1, draft_policy.k + 1, head_logits.size(-1)), run.generator, head_logits.dtype,
                           head_logits.device) if coupled else None
        return (*chain_at_once(head_logits, draft_policy, run.sampling, drawn, run.generator,
                               None if noise is None else noise[0]), noise)

    # prefill: the main head gives the first token, the heads at the last prompt position the first guesses
    last, out = first_token(run, model, cache, draft_policy)  # and all after it, as `ar`, if no draft pays
    drafts, q_draft, noise = guesses_at(out, -1)
    drafted = [0] * n_future  # per head: guesses verified
    accepted = [0] * n_future  # per head: guesses accepted
    while not run.done:
        drafts = drafts[:run.draft_room(len(drafts))]  # near the end of the budget or context, guess fewer
        q_draft = q_draft[:, :len(drafts)] if q_draft is not None and drafts else None
        [emitted], [n], out = chain_step(run.sampling, run.generator, model, cache, [last], [drafts], q_draft,
                                         opts.verify, noise, heads=draft_policy.k)  # one row; heads: see below
        for i in range(len(drafts)):
            drafted[i] += 1
            accepted[i] += i < n
        draft_policy.update(len(drafts), n)
        run.emit(emitted, drafted=len(drafts))
        last = emitted[-1]
        # position n is the last accepted token's, whose main head chose `last`: its heads guess the tokens after
        # (the forward ran this step's k of them on every position: the next step's k, unless the rule moved it)
        drafts, q_draft, noise = guesses_at(out, n)
    return run.out, run.stats(head_acceptance=[a / d for a, d in zip(accepted, drafted) if d])  # heads used
