"""
Batched decoding: B prompts at once, each row accepting its own number of guesses (`ar`, `speculative` and
`prompt-lookup`). A forward over B rows costs little more than over one while a model is bound by its weights and
its launch overhead, so plain batching already multiplies throughput; speculation then has to pay for a verify
forward over B x (k+1) tokens, which stops being free as B grows. That crossover is what the bench's batch table
measures (python -m nanospec.bench --batch-sizes 1,2,4,8,16,32).

Rows fall out of step at once: prompts of different lengths, and each step row b keeps its own n_b guesses. So the
KV cache has a committed length per row (nanospec/ragged.py), and a forward over T new tokens per row writes row
b's at its own slots lengths[b] .. lengths[b] + T - 1, at its own positions, each token attending to its row's slots
up to its own. Rejected guesses stay in their slots, beyond the row's length, until the row's next forward
overwrites them before anyone can see them. Two rows, one verify forward of [last, d1, d2] each:

    row 0: 2 tokens kept -> writes slots 2, 3, 4; accepts 1 guess -> length 2 + 1 + 1 = 4 (slot 4 is stale now)
    row 1: 1 token kept  -> writes slots 1, 2, 3; accepts 2       -> length 1 + 1 + 2 = 4

Rows draft as many guesses as the longest row needs (k rows' drafts padded): a row keeps at most its own k_b, and
when all of its k_b were accepted its next token is a fresh draw from the target's law after them (the rule's
outcome past k_b is dropped: its own randomness, so the row keeps the target's law). A row that ends (end-of-text,
its budget, the context) leaves the batch: its cache rows are dropped. The rule is verify.py's chain rule,
verify_chain over B rows (a draft's q, or point masses for copies), with one generator for the batch:
each row uses its own slice of every draw, so rows are independent and a seeded batch is reproducible.

What others learned: "Batch Speculative Decoding Done Right" (arXiv 2510.22876) on rows whose positions, masks and
caches fell out of step; vLLM keeps a committed length per row and lets rejected slots be overwritten.
"""
import torch

from nanospec.decoding.options import Sampling
from nanospec.decoding.prompt_lookup import lookup
from nanospec.decoding.run import new_run
from nanospec.decoding.speculative import check_draft
from nanospec.ragged import RaggedCache, forward, padded, prefill
from nanospec.verify import point_mass, sample, verify_chain, warp

BATCHED = ("ar", "speculative", "prompt-lookup")


def judge(p_target, drafts, q_draft, k_rows, generator):
    """The chain rule on B rows of K guesses, row b's real guesses its first k_rows[b]: (n (B,), next (B,)). A row
    whose k_b guesses all passed takes a fresh draw from p after them (what the rule did with its padding is its own
    randomness, dropped). p_target (B, K+1, V), drafts (B, K), q_draft (B, K, V) or None (point masses)."""
    if q_draft is None:  # copies are point masses, q = one_hot(x): min(1, p(x)/q(x)) = p(x)
        q_draft = point_mass(drafts, p_target)  # (B, K, V)
    n, nxt = verify_chain(p_target, q_draft, drafts, generator)  # (B,), (B,)
    k_rows = torch.tensor(k_rows, device=n.device)
    cut = n >= k_rows  # (B,) every real guess accepted
    bonus = sample(p_target[torch.arange(len(n), device=n.device), k_rows], generator)  # (B,) the law after them
    return torch.where(cut, k_rows, n), torch.where(cut & (k_rows < drafts.size(1)), bonus, nxt)


def draft_guesses(draft, dcache, runs, K, sampling, generator):
    """The draft GPT reads what each row has not read yet (1 or 2 tokens) and guesses K tokens per row:
    (drafts (B, K), q_draft (B, K, V)). It reads its first K - 1 guesses back, as `speculative` does."""
    if K == 0:  # every row's last token: nothing to guess (and nothing more to read)
        return dcache.lengths.new_zeros(len(runs), 0), None
    unread = [run.seq[n:] for run, n in zip(runs, dcache.lengths.tolist())]
    logits = forward(draft, dcache, padded(unread).to(dcache.lengths.device))  # (B, T, V)
    T = torch.tensor([len(u) for u in unread], device=logits.device)
    logits = logits[torch.arange(len(runs)), T - 1]  # (B, V) after each row's last
    drafts = []  # (B,) each
    q_rows = []  # (B, V) each
    dcache.lengths += T
    for i in range(K):
        q_rows.append(warp(logits, *sampling))  # (B, V)
        drafts.append(logits.argmax(-1) if sampling.greedy else sample(q_rows[-1], generator))  # (B,)
        if i < K - 1:
            logits = forward(draft, dcache, drafts[-1][:, None])[:, -1]  # (B, V)
            dcache.lengths += 1
    return torch.stack(drafts, 1), torch.stack(q_rows, 1)


def copied_guesses(runs, k_rows, max_ngram):
    """prompt-lookup's guesses for B rows, row b copying at most k_rows[b] tokens from its own text:
    (drafts (B, K), padded; k_rows, each row's real guesses)."""
    copies = [lookup(run.seq, max_ngram, k) if k else [] for run, k in zip(runs, k_rows)]
    k_rows = [len(c) for c in copies]
    if max(k_rows) == 0:
        return torch.zeros(len(runs), 0, dtype=torch.long, device=runs[0].generator.device), k_rows  # (B, 0)
    return padded(copies).to(runs[0].generator.device), k_rows  # (B, K)


@torch.inference_mode()
def generate(models, prompts, max_new_tokens, *, method="ar", temperature=0.0, top_k=None, top_p=None, seed=None,
             draft_len=4, max_ngram=3):
    """prompts: B lists of token ids. Returns (ids per row, stats: "rows", each row's run.stats(), and the batch's
    new_tokens, batch_forwards (target forwards over the whole batch), tokens_per_forward (the rows' mean)).
    draft_len: speculative's k, prompt-lookup's longest copy; max_ngram: prompt-lookup's."""
    if method not in BATCHED:
        raise ValueError(f"batched decoding runs {', '.join(BATCHED)}, not {method!r}")
    if not prompts:
        raise ValueError("no prompts: give at least one")
    sampling = Sampling(temperature, top_k, top_p).check()
    runs = [new_run(models, p, max_new_tokens, sampling, seed) for p in prompts]  # each row checked and recorded
    target = models.target
    draft = models.draft
    B = len(runs)
    generator = runs[0].generator  # one generator: each row its own slice
    device = generator.device
    k = draft_len if method != "ar" else 0
    cache = RaggedCache(target, B, target.config.block_size + k + 1)  # room for padded guesses at the context end
    logits = prefill(target, cache, [r.prompt for r in runs])  # (B, V) after each prompt
    last = sample(warp(logits, *sampling), generator)  # (B,) each row's first token
    caches = [cache]
    if method == "speculative":
        check_draft(target, draft)
        caches.append(RaggedCache(draft, B, target.config.block_size + k + 2))
        prefill(draft, caches[1], [r.prompt for r in runs])  # the draft reads each prompt once, before the first step
    active = list(range(B))  # the rows still decoding
    forwards = 1
    done = [run.emit([t]) for run, t in zip(runs, last.tolist())]
    while not all(done):
        if any(done):  # finished rows leave the batch and stop costing work
            keep = torch.tensor([i for i, d in enumerate(done) if not d], device=device)
            active = [active[i] for i in keep.tolist()]
            last = last[keep]
            for c in caches:
                c.keep_rows(keep)
        live = [runs[b] for b in active]
        k_rows = [run.draft_room(k) for run in live]  # fewer guesses near a row's budget or the context end
        if method == "speculative":
            drafts, q_draft = draft_guesses(draft, caches[1], live, max(k_rows), sampling, generator)
        else:  # ar: no guesses; prompt-lookup: each row copies from its own text
            drafts, k_rows = copied_guesses(live, k_rows, max_ngram)  # ar's k_rows are all 0
            q_draft = None
        logits = forward(target, cache, torch.cat([last[:, None], drafts], 1))  # (B, K+1, V): one verify forward
        n, last = judge(warp(logits, *sampling), drafts, q_draft, k_rows, generator)  # (B,), (B,)
        forwards += 1
        cache.lengths += 1 + n  # each row keeps its last token and its accepted guesses
        if method == "speculative":  # the draft read seq and K-1 guesses: it keeps what it read of the accepted
            seq = torch.tensor([len(r.seq) for r in live], device=device)
            caches[1].lengths = torch.minimum(caches[1].lengths, seq + n)
        rows = torch.cat([drafts, n[:, None], last[:, None]], 1).tolist()  # one read: guesses, counts, next tokens
        done = [run.emit(row[:row[-2]] + [row[-1]], kb) for run, row, kb in zip(live, rows, k_rows)]
    stats = [run.stats() for run in runs]
    return [run.out for run in runs], {"rows": stats, "new_tokens": sum(s["new_tokens"] for s in stats),
                                       "batch_forwards": forwards,
                                       "tokens_per_forward": sum(s["tokens_per_forward"] for s in stats) / B}
