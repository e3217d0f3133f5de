"""
`speculative`: a small draft GPT guesses k tokens one by one; the target checks all k in ONE forward and
keeps the longest prefix that its rule accepts, plus one token of its own. Lossless, greedy and sampling.

Leviathan et al. 2022, "Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192;
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", arXiv 2302.01318.

One step, k = 3, greedy (the draft's and the target's argmax):
    sequence so far [..., 12]; the draft reads 12 -> 5, then 5 -> 9, then 9 -> 2: drafts [5, 9, 2]
    one target forward over [12, 5, 9, 2] -> argmax after each: [5, 9, 7, 3]
    5 == 5 accept, 9 == 9 accept, 2 != 7 reject -> emit [5, 9, 7]: 3 tokens for 1 target forward.
Sampling: draft token x, drawn from the draft's q, is accepted with probability min(1, p(x)/q(x)); the first
rejected one is replaced by a sample of norm(max(0, p - q)); if all k pass, the target's law after the last
draft gives a bonus token (nanospec/rules/verify.py has the rule and why it reproduces p exactly). Target and
draft are warped with the same temperature / top-k / top-p, so the output follows the warped target.
--verify block judges the k drafts jointly instead (verify.verify_block): same law, more accepted.

Both models keep a KV cache. The target's holds the sequence minus its newest token, which opens the next
verify forward. The draft's lags behind: it has not yet read the token the target just chose (correction or
bonus), nor, after a fully accepted step, d_k (it guessed d_k but never fed it back). So each step first feeds
the draft all it has not read, `seq[length:]`: the newest token; [d_k, bonus] after a fully
accepted step. One forward either way, no extra pass. A plain step (k = 0, the cost rule's choice when no guess
pays) runs no draft at all, so the draft reads the prompt, and whatever plain steps added, when it next guesses.

Cost per step: k draft forwards + 1 target forward for 1..k+1 tokens. If each guess is accepted with
probability a, independently, a step yields (1 - a^(k+1)) / (1 - a) tokens on average. The stats'
`acceptance_rate` (run.py's, as every method's) estimates that a: accepted / judged, where a guess is judged if
every guess before it was accepted (guesses after a rejection are never looked at, so they say nothing about a).
"""
import torch

from nanospec.steps.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.steps.draft_chain import draft_chain
from nanospec.steps.options import Option, Sampling, read_options, verify_option
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import drafter_of, first_token, new_run, tensor
from nanospec.steps.verify_step import chain_step

NEEDS = ("draft",)  # model parts beyond the target
USES = ()  # parts used when present
OPTIONS = {"draft_len": Option(int, 4, "tokens the draft guesses per target forward (k; the most, adaptive)", low=1,
                        high=64),
           **ADAPTIVE_OPTIONS, **verify_option("chain")}


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    draft = drafter_of(models, "draft", features=False)  # a GPT of its own: its width is its own
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    draft_policy = draft_length(opts, opts.draft_len, costs=step_costs(models, __name__, run.sampling, opts))
    target_cache = target.new_cache()
    draft_cache = draft.new_cache()

    first_token(run, target, target_cache, draft_policy)  # seq[-1] opens each verify forward (`ar` if no draft pays)
    while not run.done:
        seq = run.seq
        k = run.draft_room(draft_policy.k)  # fewer guesses near the context end or the token budget
        drafts, q_draft = [[]], None  # k = 0: a plain step, no draft forward
        if k:  # the draft reads what it has not (its first guesses: the prompt and all since; then the newest
            # token, or [d_k, bonus] after a fully accepted step), then guesses: one row, [k ints], (1, k, V)
            x = tensor(seq[draft_cache.length:], draft_cache.device)  # (1, T)
            drafts, q_draft = draft_chain(lambda x: draft(x, cache=draft_cache).logits[:, -1], x, k, run.sampling,
                                          run.generator, draft_policy.stopper)
            k = len(drafts[0])

        # One target forward over [last, d1..dk]; the target cache rolls back to last + accepted drafts.
        [emitted], [n], _ = chain_step(run.sampling, run.generator, target, target_cache, [seq[-1]], drafts,
                                         q_draft, opts.verify)  # one row
        draft_policy.update(k, n)
        # The draft cache read seq and d1..d(k-1). Keep seq + the accepted drafts, as far as it read them:
        # after n == k it lacks d_k, which the next step feeds it with the target's new token.
        draft_cache.rollback(min(draft_cache.length, len(seq) + n))
        run.emit(emitted, drafted=k)

    return run.out, run.stats(draft_forwards=sum(run.drafted_per_step))  # one draft forward per guess
