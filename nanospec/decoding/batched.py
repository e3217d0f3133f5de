"""
Batched decoding: B prompts at once, each row accepting its own number of guesses (`ar`, `speculative` and
`prompt-lookup`). A forward over B rows costs little more than over one while a model is bound by its weights and
its launch overhead, so plain batching already multiplies throughput; speculation then has to pay for a verify
forward over B x (k+1) tokens, which stops being free as B grows. That crossover is what the bench's batch table
measures (python -m nanospec.bench --batch-sizes 1,2,4,8,16,32).

The loop is the single-prompt methods' own steps over B rows: the draft GPT's `draft_chain` and the verify
`chain_step`, on the one KV cache (model/cache.py), whose rows hold their own lengths. Rows fall out of step at
once: prompts of different lengths, and each step row b keeps its own n_b guesses. Row b's tokens then go at its
own slots, at its own positions, and each sees its own row's slots up to its own; a rejected guess stays in its
slot, past the row's length, until the row's next forward writes over it. Two rows, one verify forward of
[last, d1, d2] each:

    row 0: 2 tokens kept -> writes slots 2, 3, 4; accepts 1 guess -> length 2 + 1 + 1 = 4 (slot 4 is stale now)
    row 1: 1 token kept  -> writes slots 1, 2, 3; accepts 2       -> length 1 + 1 + 2 = 4

Rows draft as many guesses as the longest row needs and keep their own k_b (fewer near a row's budget or the
context end, or a shorter copy): chain_step pads them and judges each row on its own guesses only. The draft
GPT reads, in one forward, the tokens the longest-behind row has not read (1 or 2); a row that has read more
reads its last ones again (the same keys, written over). A row that ends (end-of-text, its budget, the context)
leaves the batch: its cache rows are dropped. One generator for the batch: each row uses its own slice of
every draw, so rows are independent and a seeded batch is reproducible. Every step runs on the fast runtime as
on the eager one (the models are called as models).

What others learned: "Batch Speculative Decoding Done Right" (arXiv 2510.22876) on rows whose positions, masks and
caches fell out of step; vLLM keeps a committed length per row and lets rejected slots be overwritten.
"""
import torch

from nanospec.decoding import prompt_lookup, speculative
from nanospec.decoding.prompt_lookup import lookup
from nanospec.rules.verify import sample, warp
from nanospec.steps.draft_chain import draft_chain
from nanospec.steps.options import Sampling, read_options
from nanospec.steps.run import cache_for, drafter_of, new_run
from nanospec.steps.verify_step import chain_step

BATCHED = ("ar", "speculative", "prompt-lookup")


def read_prompts(model, cache, runs):
    """The model reads every row's prompt in one forward, the shorter ones padded at the end; each row then keeps
    its own prompt, not the padding. Returns the logits (B, V) after each row's last prompt token."""
    ends = [len(run.prompt) for run in runs]
    ids = [run.prompt + [0] * (max(ends) - len(run.prompt)) for run in runs]  # the shorter ones padded with 0
    logits = model(torch.tensor(ids, device=cache.device), cache=cache).logits  # (B, P, V)
    cache.rollback_rows(ends)
    return logits[torch.arange(len(runs), device=cache.device), torch.tensor(ends, device=cache.device) - 1]


def draft_rows(draft, cache, rows, k, sampling, generator):
    """The draft GPT guesses k tokens after each row: (drafts: B lists of k ints, q_draft (B, k, V)). It first
    reads the T tokens the longest-behind row has not read (1, or 2 after a fully accepted step); a row that has
    read more reads its last T again."""
    T = max(len(run.seq) - n for run, n in zip(rows, cache.row_lengths))
    cache.rollback_rows([len(run.seq) - T for run in rows])
    x = torch.tensor([run.seq[-T:] for run in rows], device=cache.device)  # (B, T)
    return draft_chain(lambda x: draft(x, cache=cache).logits[:, -1], x, k, sampling, generator)


@torch.inference_mode()
def generate(models, prompts, max_new_tokens, *, method="ar", temperature=0.0, top_k=None, top_p=None, seed=None,
             draft_len=None, max_ngram=None):
    """prompts: B lists of token ids. Returns (ids per row, stats: "rows", each row's run.stats(), and the batch's
    new_tokens, batch_forwards (target forwards over the whole batch), tokens_per_forward (the rows' mean)).
    draft_len: speculative's k, prompt-lookup's longest copy; max_ngram: prompt-lookup's (None: the method's own
    defaults, as one prompt decodes)."""
    if method not in BATCHED:
        raise ValueError(f"batched decoding runs {', '.join(BATCHED)}, not {method!r}")
    if not prompts:
        raise ValueError("no prompts: give at least one")
    own = {"speculative": speculative.OPTIONS, "prompt-lookup": prompt_lookup.OPTIONS}.get(method, {})
    given = {name: v for name, v in (("draft_len", draft_len), ("max_ngram", max_ngram)) if v is not None}
    opts = read_options(own, given)  # the method's defaults, and its bounds checked, as one prompt's are
    k = opts.draft_len if own else 0
    sampling = Sampling(temperature, top_k, top_p).check()
    runs = [new_run(models, p, max_new_tokens, sampling, seed) for p in prompts]  # each row checked and recorded
    generator = runs[0].generator  # one generator for every row, each row its own slice of every draw
    target = models.target
    draft = drafter_of(models, "draft", features=False) if method == "speculative" else None
    block = target.config.block_size  # a verify forward's padded guesses fit at the context end
    cache = cache_for(target, block, k + 1, batch_size=len(runs))
    logits = read_prompts(target, cache, runs)  # (B, V)
    caches = [cache]
    if method == "speculative":
        caches.append(cache_for(draft, block, k + 2, batch_size=len(runs)))
        read_prompts(draft, caches[1], runs)  # the draft reads each prompt once, before the first step
    last = sample(warp(logits, *sampling), generator).tolist()  # each row's first token
    done = [run.emit([t]) for run, t in zip(runs, last)]
    live = runs  # the rows still decoding
    forwards = 1
    while not all(done):
        if any(done):  # finished rows leave the batch and stop costing work
            keep = [b for b, d in enumerate(done) if not d]
            live = [live[b] for b in keep]
            for c in caches:
                c.keep_rows(keep)
        k_rows = [run.draft_room(k) for run in live]  # fewer guesses near a row's budget or the context end
        q_draft = None  # copies (and ar's no guesses) are point masses
        if method == "speculative":
            drafts, q_draft = draft_rows(draft, caches[1], live, max(k_rows), sampling, generator)
            drafts = [d[:kb] for d, kb in zip(drafts, k_rows)]
        elif method == "prompt-lookup":  # each row copies from its own text
            drafts = [lookup(run.seq, opts.max_ngram, kb) for run, kb in zip(live, k_rows)]
        else:  # ar: no guesses
            drafts = [[] for _ in live]
        emitted, n, _ = chain_step(sampling, generator, target, cache, [run.seq[-1] for run in live], drafts, q_draft)
        forwards += 1
        if method == "speculative":  # the draft keeps what it read of each row's accepted guesses
            caches[1].rollback_rows([min(m, len(run.seq) + a) for m, run, a in zip(caches[1].row_lengths, live, n)])
        done = [run.emit(e, len(d)) for run, e, d in zip(live, emitted, drafts)]
    stats = [run.stats() for run in runs]
    return [run.out for run in runs], {"rows": stats, "new_tokens": sum(s["new_tokens"] for s in stats),
                                       "batch_forwards": forwards,
                                       "tokens_per_forward": sum(s["tokens_per_forward"] for s in stats) / len(runs)}
