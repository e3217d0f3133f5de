"""
`prompt-lookup`: the draft is a copy of the context. Find the last few tokens of the sequence earlier in the
sequence and guess that what followed them then follows them now; the target checks the guess in ONE
forward. Nothing is trained, and text that repeats its own material (code that reuses names, a summary
that quotes its source, a model stuck in a loop) is where it shines. Lossless, greedy and sampling.

Saxena 2023, "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding (no paper; the idea is
the "copy" draft of Yang et al. 2023, "Inference with Reference", arXiv 2304.04487).

One step, max_ngram 3, draft_len 4, greedy:
    sequence [7, 1, 2, 3, 9, 4, 1, 2, 3]: the tail [1, 2, 3] also sits at index 1, followed by [9, 4, 1, 2]
    drafts [9, 4, 1, 2]; one target forward over [3, 9, 4, 1, 2] -> argmax after each: [9, 4, 8, 5, 6]
    9 == 9 accept, 4 == 4 accept, 1 != 8 reject -> emit [9, 4, 8]: 3 tokens for 1 target forward.
The tail is tried at n = max_ngram, then shorter; among several matches the most recent wins (the nearest
repeat is the likeliest to continue). A match so recent that its continuation runs into the present keeps
copying its own copy, as LZ77 does: in [5, 6, 5, 6] the tail [5, 6] at index 0 is followed by [5, 6], then by
the copy itself, so draft_len 4 guesses [5, 6, 5, 6] rather than stopping after two. No match: no guesses,
the forward is a plain `ar` step.

The guesses are deterministic (no draft distribution q), so they are checked with the point-mass rule
(nanospec/rules/verify.py: accept guess x with probability p(x); on rejection sample p with x removed), which is
"accept while the guess equals the target's argmax" when greedy. Cost per step: one target forward over
1 + k tokens, plus a scan of the context in Python (the sequence lives on the host, where the scan is cheap).
"""
import torch

from nanospec.steps.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.steps.options import Option, Sampling, read_options
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import first_token, new_run
from nanospec.steps.verify_step import chain_step

NEEDS = ()  # model parts beyond the target
USES = ()  # parts used when present
OPTIONS = {
    "max_ngram": Option(int, 3, "longest tail of the context looked up in the earlier context (n-gram size)",
                        low=1, high=64),
    "draft_len": Option(int, 10, "tokens copied after a match and checked per target forward (k)", low=1, high=64),
    "adaptive": ADAPTIVE_OPTIONS["adaptive"],  # only `history` applies: a copy has no probabilities to be sure of
}


def lookup(seq, max_ngram, draft_len):
    """The tokens that followed the most recent earlier occurrence of the longest matching tail of `seq`.

    [7, 1, 2, 3, 9, 4, 1, 2, 3], 3, 4 -> [9, 4, 1, 2];  [5, 6, 5, 6], 2, 4 -> [5, 6, 5, 6];  no match -> [].
    """
    # BEGIN SOLUTION ex1
    if draft_len < 1:
        return []
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):  # start of a candidate match, most recent first
            if seq[i:i + n] == tail:
                copy = list(seq)
                for j in range(i + n, i + n + draft_len):  # j < len(copy) always: copying may overlap the copy
                    copy.append(copy[j])
                return copy[len(seq):]
    return []
    # END SOLUTION ex1


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    if opts.adaptive == "confidence":
        raise ValueError("prompt-lookup's guesses are copies with no probabilities: use --adaptive history")
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    draft_policy = draft_length(opts, opts.draft_len, costs=step_costs(models, __name__, run.sampling, opts))
    target = models.target
    cache = target.new_cache()

    first_token(run, target, cache, draft_policy)  # seq[-1] opens each verify forward (`ar` if no draft pays)
    while not run.done:
        seq = run.seq
        drafts = lookup(seq, opts.max_ngram, run.draft_room(draft_policy.k))  # fewer near the context end or budget
        # One target forward over [last, d1..dk]; the cache keeps last + the accepted drafts.
        [emitted], [n], _ = chain_step(run.sampling, run.generator, target, cache, [seq[-1]], [drafts])  # one row
        draft_policy.update(len(drafts), n)
        run.emit(emitted, drafted=len(drafts))

    return run.out, run.stats()
