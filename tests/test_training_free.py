"""`prompt-lookup`, `jacobi` and `lookahead`: guesses made from the context or from the target's own
earlier outputs, nothing trained, and the output must be the target's.

  - the pieces, literally: the n-gram lookup (no match, a match at the very end, most recent and longest
    first, a one-token context) and the lookahead tree (the docstring's drawn mask, cell for cell);
  - the lookahead mask against the slow path: every window and verification token's logits equal a plain
    forward over the sequence the lookahead layout says it sees (built from the layout, not from the tree);
  - greedy: token for token equal to `ar` on random and trained tiny models, many prompts and options, with
    repetitive prompts where guesses really are accepted (asserted, so the acceptance path is exercised);
  - edge cases: one-token prompts, a pool with no candidates, the context limit and end-of-text falling
    inside an accepted run of guesses;
  - sampling: the empirical joint law of the first 3 tokens matches the target's exact law within
    `tv_bound` (tests/laws.py, delta = 1e-6), and a classic broken rule (resample after a mismatch) fails it.
Tiny float64 models, so argmax ties do not happen.
"""
import random

import pytest
import torch
import torch.nn.functional as F

from nanospec.model.load import Models
from nanospec.decoding import METHODS
from nanospec.decoding.lookahead import build_tree
from nanospec.decoding.prompt_lookup import lookup
from nanospec.rules.tree import path_to, tree_mask, tree_positions
from nanospec.rules.verify import sample
from nanospec.steps.options import VERIFY_RULES
from laws import empirical_law, exact_law, sequence_codes, tv, tv_bound
from toys import full_logits, random_ids, tiny_gpt

TOL = 1e-10
ar = METHODS["ar"]


def check_stats(ids, stats):
    steps = stats["accepted_per_step"]
    assert sum(steps) == stats["new_tokens"] == len(ids)
    assert stats["target_forwards"] == len(steps)
    # every forward after the prefill emits its accepted guesses + 1 token (the last one may be cut short)
    assert stats["accepted"] >= len(ids) - len(steps)


# ---------------------------------------------------------------------------------------------------------
# The pieces, literally


@pytest.mark.parametrize("seq, max_ngram, draft_len, expected", [
    ([7, 1, 2, 3, 9, 4, 1, 2, 3], 3, 4, [9, 4, 1, 2]),  # the docstring's example
    ([5, 6, 5, 6], 2, 4, [5, 6, 5, 6]),  # a match at the very end: the copy runs on into itself
    ([1, 1, 1], 3, 3, [1, 1, 1]),  # overlapping matches: a run of one token continues
    ([1, 2, 5, 1, 2, 6, 1, 2], 2, 1, [6]),  # several matches: the most recent wins
    ([3, 1, 2, 5, 4, 1, 2, 6, 3, 1, 2], 3, 1, [5]),  # a longer match beats a more recent shorter one
    ([1, 2, 3, 4], 3, 5, []),  # no match: no guesses
    ([4], 3, 5, []),  # a one-token context has nothing earlier to match
    ([5, 6, 5, 6], 2, 0, []),  # no room for guesses
])
def test_lookup_literal(seq, max_ngram, draft_len, expected):
    assert lookup(seq, max_ngram, draft_len) == expected


def test_build_tree_literal():
    tokens, parents, where, chain = build_tree(7, [(5, 9), (5, 3)], [[4], [6, 8]])
    assert tokens == [7, 5, 9, 3, 4, 6, 8] and parents == [-1, 0, 1, 1, 0, 0, 4]
    assert where == [[4], [5, 6]] and chain == [0, 4]


def test_lookahead_docstring_mask():
    """W = 3, N = 3, one candidate [c1, c2]: the mask and positions drawn in lookahead.py's docstring."""
    x, c1, c2, a0, a1, b0, b1, b2 = range(8)
    tokens, parents, where, chain = build_tree(x, [(c1, c2)], [[a0, a1], [b0, b1, b2]])
    assert tokens == list(range(8))
    drawn = """
        1 . . . . . . .
        1 1 . . . . . .
        1 1 1 . . . . .
        1 . . 1 . . . .
        1 . . 1 1 . . .
        1 . . . . 1 . .
        1 . . 1 . . 1 .
        1 . . 1 1 . . 1"""
    expected = torch.tensor([[c == "1" for c in row.split()] for row in drawn.strip().splitlines()])
    assert torch.equal(tree_mask(parents, 0), expected)
    assert tree_positions(parents, 10).tolist() == [10, 11, 12, 11, 12, 11, 12, 13]


# ---------------------------------------------------------------------------------------------------------
# The lookahead mask against the slow path


@torch.no_grad()
@pytest.mark.parametrize("W, N, G", [(5, 4, 5), (3, 3, 1), (1, 5, 3), (4, 3, 0)])
def test_lookahead_mask_gives_each_node_a_plain_forward_of_its_sequence(W, N, G):
    model = tiny_gpt(W + N + G)
    rng = random.Random(W * 100 + N * 10 + G)
    prefix, root = random_ids(6, seed=W), 3
    levels = [[rng.randrange(11) for _ in range(W - (level == 0))] for level in range(N - 1)]
    grams = [tuple(rng.randrange(3) for _ in range(N - 1)) for _ in range(G)]  # 3 tokens: shared prefixes
    tokens, parents, where, chain = build_tree(root, grams, levels)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache=cache)
    logits = model(torch.tensor([tokens]), pos=tree_positions(parents, len(prefix)), cache=cache,
                   mask=tree_mask(parents, len(prefix))).logits[0]  # (nodes, V), as tree_step runs it

    # What each window node must see, from the layout alone: column i is x, level 0 up to column i, then
    # levels 1..l of column i itself (Fu et al. 2024, the lookahead branch).
    meant = {}
    for i in range(W):
        trajectory = [root] + levels[0][:i]
        meant[chain[i]] = list(trajectory)
        for level in range(1, N - 1):
            trajectory.append(levels[level][i])
            meant[where[level][i]] = list(trajectory)
    # The verification branch: every prefix of every candidate after x, each exactly once.
    branch = [node for node in range(1, len(tokens)) if node not in meant]
    seen = sorted(tuple(tokens[n] for n in path_to(parents, node)) for node in branch)
    assert seen == sorted({(root,) + g[:d] for g in grams for d in range(1, N)})
    for node in branch:
        meant[node] = [tokens[n] for n in path_to(parents, node)]
    assert len(meant) == len(tokens)
    for node, seq in meant.items():
        assert tokens[node] == seq[-1]
        assert torch.allclose(logits[node], full_logits(model, prefix + seq)[-1], atol=TOL), (node, seq)


# ---------------------------------------------------------------------------------------------------------
# Greedy: the same tokens as `ar`


def trained_tiny(steps=100, seed=0):
    """A tiny model trained for a few seconds on a toy language (x -> 3x + 1 mod 11, one token in eight
    random). Its greedy output soon follows the map around one of its cycles (0 1 4 2 7, 3 10 9 6 8, or 5):
    structured text that repeats itself, unlike a random model's."""
    torch.manual_seed(seed)
    model = tiny_gpt(seed, n_future=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        w = torch.empty(16, 25, dtype=torch.long)  # (B, T+1) training windows
        w[:, 0] = torch.randint(0, 11, (16,))
        for t in range(1, w.size(1)):
            noise = torch.rand(16) < 1 / 8
            w[:, t] = torch.where(noise, torch.randint(0, 11, (16,)), (3 * w[:, t - 1] + 1) % 11)
        logits = model(w[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


REPETITIVE = [[3, 1, 4, 1, 5] * 3, [2, 7] * 6, [5] * 8, [6, 0, 9, 2, 8, 1] * 2 + [6, 0]]
PROMPTS = [random_ids(n, seed=n) for n in (1, 2, 5, 11, 20)] + REPETITIVE
CASES = [  # (method, options)
    ("prompt-lookup", {}),
    ("prompt-lookup", {"max_ngram": 1, "draft_len": 3}),
    ("prompt-lookup", {"max_ngram": 5, "draft_len": 1}),
    ("jacobi", {}),
    ("jacobi", {"block": 1}),
    ("jacobi", {"block": 3}),
    ("lookahead", {}),
    ("lookahead", {"window": 5, "ngram": 4, "guesses": 5}),
    ("lookahead", {"window": 1, "ngram": 3, "guesses": 1}),
    ("lookahead", {"window": 3, "ngram": 5, "guesses": 0}),  # an empty pool: the window's guesses only
    ("lookahead", {"window": 7, "ngram": 3, "guesses": 8}),
]
MODELS = {"random 0": lambda: tiny_gpt(0), "random 1": lambda: tiny_gpt(1), "trained": trained_tiny}


@pytest.fixture(scope="module")
def references():
    """Each model, and `ar`'s greedy output for every prompt: the reference every method must equal."""
    out = {}
    for name, build in MODELS.items():
        models = Models(target=build())
        out[name] = models, [ar(models, prompt, 24)[0] for prompt in PROMPTS]
    return out


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("method, options", CASES)
def test_greedy_equals_ar(references, model_name, method, options):
    models, expected = references[model_name]
    accepted_on_repeats = []
    for prompt, expect in zip(PROMPTS, expected):
        ids, stats = METHODS[method](models, prompt, 24, **options)
        assert ids == expect, f"prompt {prompt}"
        check_stats(ids, stats)
        if prompt in REPETITIVE:
            accepted_on_repeats.append(stats["accepted"])
        if options.get("guesses") == 0:  # an empty pool: only the window's own chains are checked
            assert stats["pool_size"] == 0 and stats["accepted"] == stats["accepted_window"]
    # Repetitive prompts are where guesses pay: make sure this test ran the acceptance path, not only `ar`.
    assert sum(accepted_on_repeats) > 0
    if method == "prompt-lookup" and options.get("draft_len", 10) > 1:
        assert min(accepted_on_repeats) > 0 and sum(accepted_on_repeats) > 2 * len(REPETITIVE)


def test_trained_model_cycles_and_the_lookup_methods_ride_the_cycle(references):
    """The trained model's greedy text soon repeats itself (a cycle of the map), so prompt lookup and the
    n-gram pool keep finding the continuation: long accepted runs on every prompt, random ones included."""
    models = references["trained"][0]
    for prompt in PROMPTS:
        assert METHODS["prompt-lookup"](models, prompt, 24)[1]["tokens_per_forward"] > 3
        stats = METHODS["lookahead"](models, prompt, 24)[1]
        assert stats["tokens_per_forward"] > 1.8


# ---------------------------------------------------------------------------------------------------------
# Edge cases: context limit and end-of-text inside an accepted run


METHOD_NAMES = ("prompt-lookup", "jacobi", "lookahead")


# (model, prompt length) -> the methods whose last forward accepted guesses that ran into the context limit
LAST_RUN_HITS_THE_LIMIT = {
    ("random 0", 36): {"prompt-lookup", "jacobi"},
    ("random 0", 44): {"prompt-lookup", "jacobi"},
    ("trained", 36): {"prompt-lookup", "lookahead"},
    ("trained", 40): {"prompt-lookup", "lookahead"},
    ("trained", 47): set(),  # room for one token: the prefill's
}


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("model_name, prompt_len", LAST_RUN_HITS_THE_LIMIT)
def test_context_limit_like_ar(references, method, model_name, prompt_len):
    models = references[model_name][0]  # block_size 48
    prompt = ([4, 9, 2] * 16)[:prompt_len]
    expect, ar_stats = ar(models, prompt, 100)
    ids, stats = METHODS[method](models, prompt, 100)
    assert ids == expect and len(ids) == 48 - prompt_len and stats["stop"] == ar_stats["stop"] == "context"
    check_stats(ids, stats)
    if method in LAST_RUN_HITS_THE_LIMIT[model_name, prompt_len]:
        assert stats["accepted_per_step"][-1] > 1


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_end_of_text_inside_an_accepted_run(references, method):
    """Pick as end-of-text a token that first appears in the middle of a forward's accepted run; the method
    must stop right before it, like `ar`, though that forward produced it together with later tokens."""
    for models, _ in references.values():
        for prompt in PROMPTS:
            ids, stats = METHODS[method](models, prompt, 24)
            steps = stats["accepted_per_step"]
            starts = [sum(steps[:i]) for i in range(len(steps))]  # where each forward's tokens begin
            inside = [j for j in range(len(ids)) if j not in starts and ids[j] not in ids[:j]]
            if inside:
                break
        if inside:
            break
    assert inside, "no token first appears inside an accepted run: add a prompt"
    with_eot = Models(target=models.target, eot=ids[inside[0]])
    expect, _ = ar(with_eot, prompt, 24)
    got, stats = METHODS[method](with_eot, prompt, 24)
    assert got == expect == ids[:inside[0]] and stats["stop"] == "eot"


@pytest.mark.parametrize("method, options, message", [
    ("prompt-lookup", {"draft_len": 0}, "draft_len"),
    ("prompt-lookup", {"max_ngram": 0}, "max_ngram"),
    ("jacobi", {"block": 0}, "block"),
    ("lookahead", {"ngram": 2}, "ngram"),
    ("lookahead", {"window": 0}, "window"),
])
def test_bad_options_are_clear_errors(method, options, message):
    with pytest.raises(ValueError, match=message):
        METHODS[method](Models(target=tiny_gpt(0)), [1, 2], 5, **options)


# ---------------------------------------------------------------------------------------------------------
# Sampling: the target's law, exactly


SAMPLING_MODEL = dict(vocab_size=4, n_layer=1, n_embd=8, block_size=32, n_future=0)
SAMPLING_PROMPT = [0, 1, 2, 3, 0, 2, 1, 3, 1, 0, 3, 2, 0, 3]  # each token is followed by several others
L = 3  # judge the first 3 tokens: the prefill's token, then two that went through one verify step


def method_law(models, method, n, sampling, **options):
    # budget L + 1: the step after the prefill may guess two tokens, so tokens 2 and 3 are both verified
    seqs = torch.tensor([METHODS[method](models, SAMPLING_PROMPT, L + 1, temperature=sampling[0],
                                         top_k=sampling[1], top_p=sampling[2], seed=s, **options)[0][:L]
                         for s in range(n)])  # (n, L)
    return empirical_law(sequence_codes(seqs, 4), 4**L)


@pytest.mark.parametrize("method, options, sampling, n", [
    ("prompt-lookup", {"max_ngram": 2}, (1.0, None, None), 1500),
    ("jacobi", {"block": 2}, (0.8, 3, None), 1500),  # warping (temperature, top-k) applies to guesses alike
    ("lookahead", {"window": 3, "ngram": 3, "guesses": 3}, (1.0, None, None), 1500),  # a trie with siblings
    ("lookahead", {}, (1.0, None, 0.9), 1500),  # the defaults, top-p
])
def test_sampling_follows_the_targets_law(method, options, sampling, n):
    """V = 4, 64 outcomes; tv_bound(64, n) = 0.139 for n = 1500 (a correct sampler exceeds it with probability
    1e-6). Every method here checks its guesses with the point-mass rule. The first three drew 2000 (bound
    0.120); 1500 is the draws with which the negative control below shows the test sees a broken rule."""
    models = Models(target=tiny_gpt(3, **SAMPLING_MODEL))
    law = exact_law(models.target, SAMPLING_PROMPT, L, sampling)
    K = int((law > 0).sum())  # outcomes the target can produce (top-k and top-p remove some)
    distance, bound = tv(method_law(models, method, n, sampling, **options), law), tv_bound(K, n)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f} (K = {K} outcomes, n = {n} draws)"


def resample_after_mismatch(p_target, q_draft, draft_tokens, generator=None):
    """A classic BROKEN point-mass rule (q_draft = one_hot(draft_tokens), unused): sample y ~ p; on a mismatch
    emit a FRESH sample of p, which may be the rejected guess again, so a guess x comes out with probability
    p(x) + (1 - p(x)) p(x). One row, as chain_step passes one prompt: p_target (1, k+1, V), draft_tokens (1, k)."""
    p_target = p_target[0]  # (k+1, V)
    for i, x in enumerate(draft_tokens[0].tolist()):
        if sample(p_target[i], generator).item() != x:
            return torch.tensor([i]), sample(p_target[i:i + 1], generator)
    return torch.tensor([draft_tokens.size(1)]), sample(p_target[-1:], generator)


def test_broken_rule_fails_the_sampling_test(monkeypatch):
    """Negative control: the sampling test has the power to see the bias this classic bug causes."""
    monkeypatch.setattr(VERIFY_RULES["token"], "chain", resample_after_mismatch)
    models, n, sampling = Models(target=tiny_gpt(3, **SAMPLING_MODEL)), 1500, (1.0, None, None)
    law = exact_law(models.target, SAMPLING_PROMPT, L, sampling)
    distance = tv(method_law(models, "prompt-lookup", n, sampling, max_ngram=2), law)
    assert distance > tv_bound(64, n), distance


def test_sampling_is_seeded():
    models = Models(target=tiny_gpt(2))
    for method in METHOD_NAMES:
        a = METHODS[method](models, [1, 2, 1, 2], 30, temperature=1.0, seed=7)[0]
        b = METHODS[method](models, [1, 2, 1, 2], 30, temperature=1.0, seed=7)[0]
        c = METHODS[method](models, [1, 2, 1, 2], 30, temperature=1.0, seed=8)[0]
        assert a == b and a != c
