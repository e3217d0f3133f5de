"""
`lookahead`: Jacobi iteration that keeps its trajectories as guesses. Each forward does two jobs at once:
  - the lookahead branch, a window of W columns and N-1 levels, takes one Jacobi step; every column's trajectory
    ends in a fresh n-gram (a start token and the N-1 tokens Jacobi says follow it), pooled under its first token;
  - the verification branch checks up to G pooled n-grams whose first token is the newest token.
The pool also learns the n-grams of the prompt and of the generated text (a nanospec addition: text repeats
itself, the insight of `prompt-lookup`). Nothing is trained. Lossless, greedy and sampling.
Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", arXiv 2402.02057.

The whole forward is one token tree (nanospec/rules/tree.py): every node sees the cached prefix and its ancestors, at
position prefix + depth. Root = x, the newest token; then the trie of the candidate n-grams; then the window,
where x and level 0 form a chain (the current Jacobi iterate) and level l of column i hangs under level l-1 of
column i (level 1 under the chain's column i). For W = 3, N = 3, one candidate n-gram [c1, c2], x at position t:

    node    x  c1 c2 a0 a1 b0 b1 b2   position     window (columns 0 1 2):
    x       1  .  .  .  .  .  .  .      t           chain:   x  a0  a1        (x, then level 0)
    c1      1  1  .  .  .  .  .  .      t+1         level 1: b0 b1  b2
    c2      1  1  1  .  .  .  .  .      t+2
    a0      1  .  .  1  .  .  .  .      t+1         b2 sees x, a0, a1, itself: the sequence x a0 a1 b2.
    a1      1  .  .  1  1  .  .  .      t+2         Its argmax n2 is a guess for position t+4, and
    b0      1  .  .  .  .  1  .  .      t+1         (a1, b2, n2) goes into the pool under the key a1.
    b1      1  .  .  1  .  .  1  .      t+2
    b2      1  .  .  1  1  .  .  1      t+3

After the forward the window moves one Jacobi step: level 0 := level 1 without its first column, each level moves
down one, the top level := the argmaxes at the old top level. Any window is a valid guess, never "wrong".
Every node is a guess fixed before the step draws anything (the Jacobi iterates take the argmax even when
sampling), so `tree_step`'s point-mass rule checks the whole tree, losslessly. The trie comes first in node order,
so it wins over a window node holding the same token; the window's chains are extra guesses at no extra cost.
A forward holds at most `tree_size` tokens (18 by default: docs/measurements.md).
"""
import random

import torch

from nanospec.steps.adaptive import PRICED_OPTIONS, draft_length
from nanospec.steps.options import Option, Sampling, read_options
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import cache_for, first_token, new_run
from nanospec.steps.verify_step import tree_step

NEEDS = ()  # model parts beyond the target
USES = ()  # parts used when present
OPTIONS = {
    "window": Option(int, 3, "W: Jacobi window columns, each yielding one new n-gram per forward", low=1, high=64),
    "ngram": Option(int, 4, "N: n-gram size; the window has N-1 levels and a guess covers N-1 tokens", low=3, high=16),
    "guesses": Option(int, 3, "G: n-grams kept per key in the pool and verified per forward (0: none)", low=0, high=64),
    **PRICED_OPTIONS}  # cost: the whole tree or a plain step, whichever pays


def tree_size(W, N, G):
    """Tokens in one forward: the window, N-1 levels of W (the root is the chain's column 0), and G n-grams of N-1."""
    return (W + G) * (N - 1)


def remember(pool, key, gram, guesses):
    """Add an n-gram (a tuple of N-1 tokens) under its key token, newest last, at most `guesses` per key."""
    # BEGIN SOLUTION ex10
    grams = pool.setdefault(key, [])
    if gram in grams:
        grams.remove(gram)
    grams.append(gram)
    del grams[:len(grams) - guesses]
    # END SOLUTION ex10


def learn(pool, seq, new, N, guesses):
    """Remember every n-gram of `seq` that ends in its last `new` tokens, under its first token.
    [4, 7, 4, 8], new 1, N 3 -> (7, 4, 8): pool[7] gets (4, 8)."""
    # BEGIN SOLUTION ex10
    for j in range(max(0, len(seq) - new - N + 1), len(seq) - N + 1):
        remember(pool, seq[j], tuple(seq[j + 1:j + N]), guesses)
    # END SOLUTION ex10


def build_tree(root, grams, levels):
    """One tree for the whole forward: root, the trie of candidate n-grams, then the window.

    grams: candidate continuations of root, tried in this order; levels: the window, levels[0] has W-1 tokens
    (columns 1..W-1 of the chain; column 0 is the root), levels[1..] W tokens each.
    Returns tokens, parents, where, chain: where[l] = the nodes of levels[l], in order; chain[i] = the node
    at column i of the chain (chain[0] = the root).
    Example: root 7, grams [(5, 9), (5, 3)], levels [[4], [6, 8]] -> tokens [7, 5, 9, 3, 4, 6, 8],
    parents [-1, 0, 1, 1, 0, 0, 4] (trie 7 -> 5 -> {9, 3}; chain 7 -> 4; level 1: 6 under 7, 8 under 4).
    """
    # BEGIN SOLUTION ex10
    tokens = [root]
    parents = [-1]
    trie = {}  # (node, token) -> the child holding it

    def add(tok, parent):
        tokens.append(tok)
        parents.append(parent)
        return len(tokens) - 1

    for gram in grams:
        node = 0
        for tok in gram:
            if (node, tok) not in trie:  # shared prefixes share nodes: each guess is checked once
                trie[node, tok] = add(tok, node)
            node = trie[node, tok]
    chain = [0]  # the chain: root, then level 0, column i+1 under column i
    for tok in levels[0] if levels else []:
        chain.append(add(tok, chain[-1]))
    where = [chain[1:]]
    below = chain
    for level in levels[1:]:  # level l, column i hangs under level l-1 (level 1: the chain), column i
        below = [add(tok, below[i]) for i, tok in enumerate(level)]
        where.append(below)
    return tokens, parents, where, chain
    # END SOLUTION ex10


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    W = opts.window  # the paper's names: W columns, N-grams, G guesses
    N = opts.ngram
    G = opts.guesses
    target = models.target
    size = tree_size(W, N, G)
    if size > target.config.block_size:
        raise ValueError(f"lookahead's forward of {size} tokens ((W + G)(N - 1), --window {W} --ngram {N} --guesses "
                         f"{G}) exceeds the model's context of {target.config.block_size}: lower them")
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    costs = step_costs(models, __name__, run.sampling, opts)
    draft_policy = draft_length(opts, size - 1, costs=costs, menu=(0, size - 1))  # cost: all or nothing
    cache = cache_for(target, target.config.block_size, size)  # room for a whole forward at the context end
    pool = {}  # key token -> list of (N-1)-tuples that followed it, newest last
    learn(pool, run.prompt, len(run.prompt), N, G)
    rng = random.Random(0)  # the first window: random prompt tokens; a private RNG leaves the sampling stream alone
    levels = [[rng.choice(run.prompt) for _ in range(W - (l == 0))] for l in range(N - 1)]
    accepted_window = step = 0  # step: Jacobi steps of the window so far

    first_token(run, target, cache, draft_policy)  # seq[-1] is each tree's root (`ar` if no draft pays)
    while not run.done:
        root = run.seq[-1]
        depth = run.draft_room(min(N - 1, draft_policy.k))  # shorter near the context end or budget; 0: a plain step
        grams = [g[:depth] for g in reversed(pool.get(root, []))]  # newest first: tried first
        use_window = depth > 0 and W + N - 3 <= run.room()  # its deepest node's position must exist (context end)
        tokens, parents, where, chain = build_tree(root, grams, levels if use_window else [])
        # One target forward over the tree; the cache keeps the root and the accepted path.
        emitted, path, out = tree_step(run.sampling, run.generator, target, cache, tokens, parents)
        if use_window:  # one Jacobi step of the window, and its fresh n-grams into the pool
            new = out.logits[0, where[-1]].argmax(-1).tolist()  # (W,) the top level's argmax: guesses for t+N-1+i
            if step >= N - 2:  # the first N-2 steps only fill the levels with real Jacobi outputs: no pooling yet
                for i in range(W):
                    remember(pool, tokens[chain[i]], tuple(lv[i] for lv in levels[1:]) + (new[i],), G)
            levels = [levels[1][1:]] + levels[2:] + [new]
            step += 1
        draft_policy.update(len(tokens) - 1, path)
        run.emit(emitted, drafted=len(tokens) - 1)
        if path and path[0] >= len(tokens) - sum(map(len, where)):  # the accepted path runs through the window
            accepted_window += run.guesses_per_step[-1]  # its guesses the run kept
        learn(pool, run.seq, len(emitted), N, G)  # the text itself: the newest n-grams, tried first
    return run.out, run.stats(accepted_window=accepted_window, pool_size=sum(map(len, pool.values())))
