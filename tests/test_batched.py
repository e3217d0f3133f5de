"""Batched decoding (nanospec/decoding/batched.py: draft_chain and chain_step over B rows of one KVCache): B prompts
at once, each row its own number of accepted guesses.

  - greedy: every row equals `ar` run on that prompt alone, token for token, for B in {1, 2, 5, 8}, prompts of
    different lengths, rows that finish at different times (end-of-text, the context end), on the eager and the
    static runtime (replayed: graphs captured); a negative control (every row written at one row's length, the
    classic padding bug) breaks it;
  - sampling: the rows of one batch are independent draws, so a batch of many rows of one prompt gives the law of
    its first L tokens; it must match the target's exact law within tv_bound (tests/laws.py, delta 1e-6), for
    two prompts of different lengths in the same batch, for `ar`, `speculative` and `prompt-lookup` (whose rows
    copy guesses of different lengths); the negative control (a row that accepted all its k_b guesses taking the
    rule's token from past its padding instead of a fresh draw) must exceed the bound;
  - a seeded batch is reproducible; bad requests are one-line errors.
"""
import copy

import pytest
import torch

from nanospec.decoding import METHODS
from nanospec.decoding import batched
from nanospec.steps import verify_step
from nanospec.decoding.batched import generate
from nanospec.model.cache import KVCache, Placement, additive
from nanospec.model.load import Models
from nanospec.fast.runtime import prepare
from laws import empirical_law, exact_law, sequence_codes, tv, tv_bound
from toys import random_ids, tiny_gpt, toy_gpt

PROMPTS = [random_ids(n, seed=n) for n in (3, 8, 5, 12, 1, 20, 7, 9)]


def varied(seed, base=None, noise=0.5):
    """A tiny GPT whose greedy text wanders (a random untied unembedding of std 1: a tiny random GPT's own loops
    on one token), or a noisy copy of `base` (a draft that agrees with it often, not always)."""
    model = tiny_gpt(seed, n_layer=2, block_size=48) if base is None else copy.deepcopy(base)
    w = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    model.lm_head.weight = torch.nn.Parameter(w if base is None else base.lm_head.weight + noise * w)
    return model


@pytest.fixture(scope="module")
def models():
    target = varied(0)
    return Models(target=target, draft=varied(1, target))


def alone(models, prompt, n):
    return METHODS["ar"](models, prompt, n)[0]


@pytest.mark.parametrize("B", [1, 2, 5, 8])
@pytest.mark.parametrize("method", batched.BATCHED)
def test_every_row_equals_ar_alone(models, method, B):
    ids, stats = generate(models, PROMPTS[:B], 24, method=method)
    assert ids == [alone(models, p, 24) for p in PROMPTS[:B]]
    assert stats["new_tokens"] == 24 * B and len(stats["rows"]) == B
    if method != "ar" and B > 1:  # guesses were accepted: fewer batched forwards than tokens per row
        assert stats["batch_forwards"] < 24


@pytest.mark.parametrize("method", batched.BATCHED)
def test_a_batch_of_one_is_the_method_itself_when_sampling_too(models, method):
    """One row runs the single-prompt method's steps with its draws in the same order: the same tokens from the
    same seed, at t=1 as greedy."""
    for seed in range(3):
        options = {} if method == "ar" else {"draft_len": 3}
        one, _ = generate(models, [PROMPTS[3]], 20, method=method, temperature=1.0, seed=seed, **options)
        assert one[0] == METHODS[method](models, PROMPTS[3], 20, temperature=1.0, seed=seed, **options)[0]


@pytest.mark.parametrize("method", batched.BATCHED)
def test_rows_that_finish_early(models, method):
    """End-of-text: each row stops at its own eot (a token its greedy text reaches at a different step); the
    context: a 44-token prompt in a 48-token context stops after 4 tokens while the others go on."""
    prompts = [random_ids(44, seed=1)] + PROMPTS[:4]
    full = [alone(models, p, 24) for p in prompts]
    eot = next(t for i, t in enumerate(full[2]) if i >= 3 and t not in full[2][:i] + full[0])  # ends row 2, not 0
    with_eot = Models(target=models.target, draft=models.draft, eot=eot)
    ids, stats = generate(with_eot, prompts, 24, method=method)
    assert ids == [alone(with_eot, p, 24) for p in prompts]
    stops = [s["stop"] for s in stats["rows"]]
    assert {"context", "eot"} <= set(stops) and len({len(row) for row in ids}) >= 3, (stops, [len(r) for r in ids])


def test_the_static_runtime_runs_the_same(models):
    fast = prepare(models, "static")[0]
    for method in batched.BATCHED:
        for _ in range(2):  # the second batch replays the graphs the first captured, on the same cache memory
            assert generate(fast, PROMPTS[:5], 16, method=method)[0] == generate(models, PROMPTS[:5], 16,
                                                                                 method=method)[0]
    assert fast.target.graphs.captured > 0 and fast.draft.graphs.captured > 0


def test_rows_out_of_step_are_caught(models, monkeypatch):
    """Negative control: every row written at the longest row's length (positions and slots shared, as a padded
    batch without per-row lengths would do): the greedy equality above must fail."""
    right = KVCache.place

    def shared(cache, T, *args):  # every row at the longest row's slots and positions, under its causal mask
        at = right(cache, T, *args)
        slots = at.slots.max(0, keepdim=True).values.expand(cache.k.size(1), T)  # (B, T)
        mask = additive(torch.arange(cache.max_len) <= slots[..., None], at.mask.dtype)[:, None]  # (B, 1, T, S)
        return Placement(slots, mask, slots, cache)

    monkeypatch.setattr(KVCache, "place", shared)
    ids, _ = generate(models, PROMPTS[:4], 12, method="ar")
    assert ids != [alone(models, p, 12) for p in PROMPTS[:4]]


# ---------------------------------------------------------------------------------------------------------
# Sampling: each row keeps the target's law


L = 3  # the first 3 tokens of each row: 5**3 outcomes


def row_laws(models, method, n, **options):
    """Two prompts of different lengths, n rows each, interleaved in one batch: the empirical law of each prompt's
    rows' first L tokens, and the target's exact law after it."""
    prompts = [[1, 3], [4, 0, 2, 2, 1]]
    ids, stats = generate(models, [prompts[i % 2] for i in range(2 * n)], L + 3, method=method, temperature=1.0,
                          seed=0, **options)
    out = []
    for j, prompt in enumerate(prompts):
        seqs = torch.tensor([row[:L] for row in ids[j::2]])  # (n, L)
        out.append((empirical_law(sequence_codes(seqs, 5), 5 ** L), exact_law(models.target, prompt, L, (1.0, None,
                                                                                                          None))))
    return out, stats


@pytest.mark.parametrize("method, options", [("ar", {}), ("speculative", {"draft_len": 3}),
                                             ("prompt-lookup", {"draft_len": 3, "max_ngram": 1})])
def test_each_row_keeps_the_targets_law(method, options):
    """2 x 3000 rows; bound tv_bound(125, 3000) = 0.129. prompt-lookup with 1-grams on a 5-token vocabulary finds
    a copy almost every step, of a length that differs from row to row."""
    models = Models(target=toy_gpt(0), draft=toy_gpt(50))
    laws, stats = row_laws(models, method, 3000, **options)
    for law, exact in laws:
        assert tv(law, exact) < tv_bound(5 ** L, 3000)
    accepted = sum(row["new_tokens"] - row["target_forwards"] for row in stats["rows"])  # guesses kept, all rows
    assert method == "ar" or accepted > 6000 / 4, "guesses must be accepted, or only the target's tokens are judged"


def test_a_bonus_from_past_the_padding_is_caught(monkeypatch):
    """Negative control: a row whose k_b real guesses all passed keeps the rule's next token, drawn after the
    padding guesses (another context), instead of a fresh draw from the target after its own k_b."""
    def broken(p_target, n, nxt, k_rows, generator):
        return torch.minimum(n, torch.tensor(k_rows)), nxt

    monkeypatch.setattr(verify_step, "own_guesses", broken)
    laws, _ = row_laws(Models(target=toy_gpt(0)), "prompt-lookup", 3000, draft_len=3, max_ngram=1)
    assert max(tv(law, exact) for law, exact in laws) > tv_bound(5 ** L, 3000)


def test_a_seeded_batch_is_reproducible(models):
    one = generate(models, PROMPTS[:4], 16, method="speculative", temperature=1.0, seed=7)[0]
    assert one == generate(models, PROMPTS[:4], 16, method="speculative", temperature=1.0, seed=7)[0]
    assert one != generate(models, PROMPTS[:4], 16, method="speculative", temperature=1.0, seed=8)[0]


@pytest.mark.parametrize("prompts, method, match", [
    ([], "ar", "no prompts"),
    ([[1, 2], []], "ar", "prompt is empty"),
    ([[1] * 48], "ar", "context is 48"),
    ([[1, 2]], "medusa", "batched decoding runs"),
])
def test_bad_requests_are_one_line_errors(models, prompts, method, match):
    with pytest.raises(ValueError, match=match):
        generate(models, prompts, 4, method=method)


@pytest.mark.parametrize("method, options, match", [
    ("speculative", {"draft_len": 0}, r"draft_len must be in 1\.\.64"),
    ("prompt-lookup", {"max_ngram": 0}, r"max_ngram must be in"),
    ("speculative", {"max_ngram": 2}, r"unknown option\(s\) max_ngram"),
    ("ar", {"draft_len": 2}, r"unknown option\(s\) draft_len"),
])
def test_method_options_are_checked_as_one_prompts_are(models, method, options, match):
    """Before: the batch read draft_len and max_ngram as given, a 0 or an option the method does not take
    included (a draft_len of 0 drafted nothing and said nothing)."""
    with pytest.raises(ValueError, match=match):
        generate(models, [[1, 2]], 4, method=method, **options)
