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
draft gives a bonus token (nanospec/verify.py has the rule and why it reproduces p exactly). Target and
draft are warped with the same temperature / top-k / top-p, so the output follows the warped target.

Both models keep a KV cache. The target's holds the sequence minus its newest token, which opens the next
verify forward. The draft's lags behind: it has not yet read the token the target just chose (correction or
bonus), nor, after a fully accepted step, d_k (it guessed d_k but never fed it back). So each step first feeds
the draft all it has not read, `seq[length:]`: the newest token; [d_k, bonus] after a fully
accepted step. One forward either way, no extra pass. (The draft reads the prompt once, before the first step.)

Cost per step: k draft forwards + 1 target forward for 1..k+1 tokens. If each guess is accepted with
probability a, independently, a step yields (1 - a^(k+1)) / (1 - a) tokens on average. The stats'
`acceptance_rate` estimates that a: accepted / judged, where a guess is judged if every guess before it was
accepted (guesses after a rejection are never looked at, so they say nothing about a).

The guesses stay on the device: each draft forward reads the previous one's drawn token there, and the step's
one host read brings back the guesses, the accepted count and the target's token together (chain_step.py). With
--runtime static both models' forwards are shape-static (nanospec/static.py), and the draft's k forwards and k
draws run as one function of tensors, on CUDA one graph replayed per step (nanospec/draft_chain.py).
"""
import torch

from nanospec.decoding.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.decoding.chain_step import chain_step
from nanospec.decoding.options import RUNTIME_OPTION, Option, Sampling, read_options
from nanospec.decoding.run import prefill, start, tensor
from nanospec.draft_chain import chain_noise, draft_chain, run_chain
from nanospec.static import runtime_model

NEEDS = ("draft",)  # model parts beyond the target
USES = ()  # parts used when present
OPTIONS = {"draft_len": Option(int, 4, "tokens the draft guesses per target forward (k)", low=1, high=64),
           **ADAPTIVE_OPTIONS, **RUNTIME_OPTION}


def check_draft(target, draft):
    """A one-line ValueError unless the draft GPT fits the target: same tokenizer, a context at least as long."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft and target use different tokenizers (vocab {draft.config.vocab_size} vs "
                         f"{target.config.vocab_size}): retrain the draft")
    if draft.config.block_size < target.config.block_size:
        raise ValueError(f"the draft's context ({draft.config.block_size}) is shorter than the target's "
                         f"({target.config.block_size}): retrain the draft with the target's block_size")


def draft_guesses(run, draft, cache, x, k, length, model):
    """The draft reads x (1, T) and guesses k tokens autoregressively, each drawn from its warped law:
    (drafts (k,), q_draft (k, V)) on the device, q_draft None when k == 0 (the target then just samples).
    With a fixed k the chain is one function of tensors (on CUDA one graph, draft_chain.run_chain); the
    confidence rule decides on the host after each guess, so it runs forward by forward. Either way the guesses
    and their draws are the same (draft_chain.py): one sampler for both runtimes."""
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=cache.device), None
    stop = length.stop if length.rule == "confidence" else None
    noise = chain_noise(run, k, model)  # (k, V) the draws' randomness, or None (greedy)

    def body(step, x, noise=None):  # k draft forwards over the last guess, k draws
        return draft_chain(lambda x: step(x).logits[0, -1], x, k, run.sampling, noise, stop)

    with run.drafting(0) as timer:
        drafts, q_draft = run_chain(draft, cache, body, x, noise, fed=x.size(1) + k - 1, key=(k, run.sampling),
                                    whole=stop is None)
        timer.passes = len(drafts)
    return drafts, q_draft


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    o = read_options(OPTIONS, options)
    check_draft(models.target, models.draft)
    length = draft_length(o, o.draft_len)  # k per step: draft_len, or adaptive
    run = start(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    target, target_cache, runtime = runtime_model(models.target, o.runtime)  # the model, or its static forwards
    draft, draft_cache, _ = runtime_model(models.draft, o.runtime, role="draft")
    drafted = accepted = judged = draft_forwards = 0

    last, _ = prefill(run, target, target_cache)
    draft(tensor(run.prompt, draft_cache.device), cache=draft_cache)  # the draft reads the prompt too, once
    done = run.emit([last])
    while not done:
        seq = run.seq
        k = run.draft_room(length.k)  # fewer guesses near the context end or the token budget
        x = tensor(seq[draft_cache.length:], draft_cache.device)  # (1, T) what the draft has not read: T = 1 or 2
        drafts, q_draft = draft_guesses(run, draft, draft_cache, x, k, length, models.draft)  # (k,), (k, V)
        k = len(drafts)
        draft_forwards += k

        # One target forward over [last, d1..dk]; the target cache rolls back to last + accepted drafts.
        emitted, n, _ = chain_step(run, target, target_cache, seq[-1], drafts, q_draft=q_draft)
        drafted, accepted, judged = drafted + k, accepted + n, judged + min(n + 1, k)
        length.update(k, n)
        # The draft cache read seq and d1..d(k-1). Keep seq + the accepted drafts, as far as it read them:
        # after n == k it lacks d_k, which the next step feeds it with the target's new token.
        draft_cache.rollback(min(draft_cache.length, len(seq) + n))
        done = run.emit(emitted)

    return run.out, run.stats(drafted=drafted, accepted=accepted, judged=judged,
                              acceptance_rate=accepted / max(1, judged), draft_forwards=draft_forwards,
                              runtime=runtime)
