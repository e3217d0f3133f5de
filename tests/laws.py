"""The laws the tests hold samplers to, and the statistics that judge them. Not a test file: it holds no tests;
test files import what they need from here (tests/toys.py holds the models).

  - statistics: `tv` between two laws and `tv_bound`, the distance a correct sampler's empirical law
    (`empirical_law`) stays within with probability 1 - DELTA; `sequence_codes` numbers whole sequences;
  - exact laws computed from the implementation's own accept_prob and residual: a node's (`node_law`), every
    ordered draw without replacement (`ordered_draws`), a bigram target's sequences (`bigram_law`);
  - bigram toys that run a rule on 1e5 sequences at once (`run_chain`, `run_tree`, `tree_tv`), and hypothesis's
    pairs (p, q) with the rules' edge cases (`pairs`);
  - block verification's enumeration (`block_law`) on random context-dependent laws (`prefix_laws`);
  - a target's exact law of its first tokens (`exact_law`) and a method's sampled one (`method_law`,
    `parallelspec_sampled_law`).
Everything in float64.
"""
import itertools
import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

from nanospec.decoding import METHODS
from nanospec.rules.tree import depths
from nanospec.rules.verify import accept_prob, host_path, point_mass, residual, sample, verify_chain, warp, \
    without_replacement_proposals

F64 = torch.float64
DELTA = 1e-6  # allowed probability that a correct sampler fails one statistical test
N_DRAWS = 100_000  # draws (or independent sequences) per statistical test
EXACT = settings(max_examples=200, deadline=None)


def dist(values):
    t = torch.tensor(values, dtype=F64)
    return t / t.sum(-1, keepdim=True)


def one_hot(x, V):
    return torch.nn.functional.one_hot(torch.as_tensor(x), V).to(F64)


def verify_chain_point_mass(p_target, drafts, g=None):
    """What chain_step runs for guesses not drawn: the chain rule with q = point_mass(x) = one_hot(x)."""
    return verify_chain(p_target, point_mass(drafts, p_target), drafts, g)


def on_host(result):
    """One chain's (n, next) as ints, or one tree's (path, next) as (a list, an int): what the steps read."""
    first, nxt = result
    return (int(first), int(nxt)) if first.dim() == 0 else host_path(first, nxt)


# ---------------------------------------------------------------------------------------------------------
# Statistics


def tv_bound(n_outcomes, n_draws, delta=DELTA):
    """Distance the empirical law of n_draws i.i.d. draws stays within, with probability >= 1 - delta.

    Bretagnolle-Huber-Carol: for K outcomes, P(sum_i |p_hat_i - p_i| >= t) <= 2^K exp(-n t^2 / 2).
    TV is half that L1 sum, so P(TV >= eps) <= 2^K exp(-2 n eps^2), and solving for eps:
        eps = sqrt((K ln 2 + ln(1/delta)) / (2 n)).
    Example: K = 27 outcomes, n = 1e5 draws, delta = 1e-6 -> eps = 0.0128.
    A correct sampler exceeds it with probability below delta; the seeds are fixed anyway.
    """
    return math.sqrt((n_outcomes * math.log(2) + math.log(1 / delta)) / (2 * n_draws))


def tv(law_a, law_b):
    return 0.5 * (law_a - law_b).abs().sum().item()


def empirical_law(outcomes, n_outcomes):
    """outcomes (n,) integer codes in [0, n_outcomes) -> frequencies (n_outcomes,)."""
    return torch.bincount(outcomes, minlength=n_outcomes).to(F64) / outcomes.numel()


def sequence_codes(seqs, V):
    """seqs (n, L) tokens -> (n,) one integer per sequence, base V (first token most significant)."""
    L = seqs.size(1)
    weights = V ** torch.arange(L - 1, -1, -1)  # (L,)
    return (seqs * weights).sum(-1)


# ---------------------------------------------------------------------------------------------------------
# Exact laws, enumerated from the implementation's own accept_prob and residual


def node_law(P, proposals, xs):
    """Law of the token one node emits (the accepted child's token, or a sample of what is left) when
    children xs, drawn from proposals, are tried in order from target P. Batched over leading dims:
    P (..., V); proposals: one q (..., V) per child; xs: one token tensor (...) per child.
    Returns (law (..., V), total acceptance probability (...))."""
    law = torch.zeros_like(P)
    reach = torch.ones(P.shape[:-1], dtype=P.dtype)  # probability that every earlier child was rejected
    for q, x in zip(proposals, xs):
        a = accept_prob(P, q, x)
        law.scatter_add_(-1, x[..., None], (reach * a)[..., None])
        reach = reach * (1 - a)
        P = residual(P, q)
    return law + reach[..., None] * P, 1 - reach


def ordered_draws(q, m):
    """Every ordered tuple of m distinct tokens with its probability under m sequential draws without
    replacement from q: (tuples (T, m), probabilities (T,)), computed from without_replacement_proposals."""
    tuples = torch.tensor(list(itertools.permutations(range(q.numel()), m)), dtype=torch.long).reshape(-1, m)
    proposals = without_replacement_proposals(q.expand(len(tuples), -1), tuples)  # (T, m, V)
    return tuples, proposals.gather(-1, tuples[..., None]).squeeze(-1).prod(-1)


def bigram_law(P, start, L):
    """Exact law of L tokens from the bigram table P (V, V) after token `start`, indexed by sequence_codes."""
    V = P.size(0)
    law = torch.zeros(V**L, dtype=F64)
    for seq in itertools.product(range(V), repeat=L):
        prob, prev = 1.0, start
        for x in seq:
            prob, prev = prob * P[prev, x].item(), x
        law[sequence_codes(torch.tensor([seq]), V)] = prob
    return law


# ---------------------------------------------------------------------------------------------------------
# Hypothesis strategies: distributions with zeros, equal pairs, disjoint supports, one-hots, extreme ratios

weight = st.one_of(st.just(0.0), st.just(1e-12), st.just(1.0), st.floats(0.0, 1.0))


@st.composite
def distributions(draw, V, support=None):
    """A distribution over V tokens, nonzero only on `support` (default: anywhere)."""
    support = list(range(V)) if support is None else support
    w = [0.0] * V
    for i in support:
        w[i] = draw(weight)
    if sum(w) == 0:
        w[draw(st.sampled_from(support))] = 1.0
    return dist(w)


@st.composite
def pairs(draw):
    """(p, q) over V = 2..6 of one of several shapes, chosen to hit the rule's edge cases."""
    V = draw(st.integers(2, 6))
    kind = draw(st.sampled_from(["free", "equal", "disjoint", "one_hot_p", "one_hot_q", "extreme"]))
    if kind == "equal":
        p = draw(distributions(V))
        return p, p.clone()
    if kind == "disjoint":
        cut = draw(st.integers(1, V - 1))
        perm = draw(st.permutations(range(V)))
        return draw(distributions(V, perm[:cut])), draw(distributions(V, perm[cut:]))
    if kind == "one_hot_p":
        return one_hot(draw(st.integers(0, V - 1)), V), draw(distributions(V))
    if kind == "one_hot_q":
        return draw(distributions(V)), one_hot(draw(st.integers(0, V - 1)), V)
    if kind == "extreme":  # ratios of 1e-12 and 1e12 side by side
        return dist([1.0, 1e-12] + [0.5] * (V - 2)), dist([1e-12, 1.0] + [0.5] * (V - 2))
    return draw(distributions(V)), draw(distributions(V))


SINGLE_STEP_CASES = {
    "generic": (dist([0.5, 0.3, 0.2, 0.0]), dist([0.1, 0.2, 0.3, 0.4])),
    "q_misses_tokens": (dist([0.4, 0.3, 0.2, 0.1]), dist([0.0, 0.5, 0.5, 0.0])),
    "disjoint": (dist([0.7, 0.3, 0.0, 0.0]), dist([0.0, 0.0, 0.5, 0.5])),
    "equal": (dist([0.25, 0.25, 0.4, 0.1]), dist([0.25, 0.25, 0.4, 0.1])),
    "extreme_ratios": (dist([1.0, 1e-12, 0.5, 0.5]), dist([1e-12, 1.0, 0.5, 0.5])),
}

V10 = 10  # the greedy literals' vocabulary
SEEDS = range(5)  # a greedy answer must not depend on the randomness: each literal runs under these seeds


def greedy_target(argmaxes):
    return one_hot(argmaxes, V10)  # (len, V)


# ---------------------------------------------------------------------------------------------------------
# Statistical tests through the real functions, with toy bigram "models"

V3 = 3
START = 0  # the token before the first emitted one
P_BIGRAM = dist([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]])  # target p(x_t | x_{t-1}), (V, V)
Q_BIGRAM = dist([[0.3, 0.5, 0.2], [0.5, 0.3, 0.2], [0.2, 0.1, 0.7]])  # draft q(x_t | x_{t-1}), (V, V)


def append(out, length, emitted, n_new, active):
    """Write emitted[b, :n_new[b]] into out[b] after its length[b] tokens, for active rows only."""
    pos = torch.arange(emitted.size(1))
    keep = (pos[None] < n_new[:, None]) & active[:, None]  # (n, w)
    rows, j = keep.nonzero(as_tuple=True)
    out[rows, length[rows] + j] = emitted[rows, j]
    length += torch.where(active, n_new, 0)


def run_chain(verify, L=4, k=3, n=N_DRAWS, seed=0, greedy_drafts=False):
    """The speculative loop on n independent sequences at once, until each has L tokens.

    Each step: the draft proposes k tokens from Q_BIGRAM (sampled, or its top-1 chain with greedy_drafts),
    the target's distributions come from P_BIGRAM, `verify(p_target (n, k+1, V), q_draft (n, k+1, V),
    drafts (n, k), generator)` returns (n_accepted, next_token) and the emitted tokens are appended.
    q_draft has k+1 rows: the last is the draft's distribution after its last token (only a broken
    verifier uses it). Returns (n, L) tokens.
    """
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, L + k, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), START)
    while (active := length < L).any():
        context = [last]  # the token before each draft position, then the last draft
        for _ in range(k):
            q = Q_BIGRAM[context[-1]]  # (n, V)
            context.append(q.argmax(-1) if greedy_drafts else sample(q, g))
        context = torch.stack(context, 1)  # (n, k+1)
        drafts = context[:, 1:]  # (n, k)
        n_acc, nxt = verify(P_BIGRAM[context], Q_BIGRAM[context], drafts, g)
        emitted = torch.cat([drafts, nxt[:, None]], 1)  # (n, k+1)
        emitted[torch.arange(n), n_acc] = nxt
        append(out, length, emitted, n_acc + 1, active)
        last = torch.where(active, nxt, last)
    return out[:, :L]


# Trees: every node's children are proposed from Q_BIGRAM at the node's token. Depth 2.
PARENTS_SAMPLED = [-1, 0, 0, 1, 1, 2, 2]  # 2 children per node, drawn i.i.d. from q


def build_sampled_tree(root, g):
    """root (n,) -> tokens (n, N): children drawn i.i.d. from q at their parent's token."""
    tokens = torch.zeros(root.size(0), len(PARENTS_SAMPLED), dtype=torch.long)
    tokens[:, 0] = root
    for c in range(1, len(PARENTS_SAMPLED)):
        tokens[:, c] = sample(Q_BIGRAM[tokens[:, PARENTS_SAMPLED[c]]], g)
    return tokens


def run_tree(verify, build, parents, L=3, n=N_DRAWS, seed=0):
    """Tree speculative decoding on n sequences at once, until each has L tokens. Each step builds a tree
    rooted at the last token, gets p_target (n, N, V) and q_draft (n, N, V) from the bigram tables, and
    `verify(p_target, q_draft, tokens, parents, generator)` returns (path (n, D), next_token (n,))."""
    g = torch.Generator().manual_seed(seed)
    D = max(depths(parents))
    out = torch.zeros(n, L + D, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), START)
    while (active := length < L).any():
        tokens = build(last, g)  # (n, N)
        path, nxt = verify(P_BIGRAM[tokens], Q_BIGRAM[tokens], tokens, parents, g)
        n_acc = (path >= 0).sum(-1)  # (n,)
        emitted = torch.cat([tokens.gather(1, path.clamp(min=0)), nxt[:, None]], 1)  # (n, D+1)
        emitted[torch.arange(n), n_acc] = nxt
        append(out, length, emitted, n_acc + 1, active)
        last = torch.where(active, nxt, last)
    return out[:, :L]


def tree_tv(verify, build, parents, L=3, **kw):
    seqs = run_tree(verify, build, parents, L=L, **kw)
    law = empirical_law(sequence_codes(seqs, V3), V3**L)
    return tv(law, bigram_law(P_BIGRAM, START, L)), tv_bound(V3**L, seqs.size(0))


# ---------------------------------------------------------------------------------------------------------
# Block verification's enumeration (tests/test_block_verification.py, exercise 14)


def prefix_laws(V, depth, seed, sharpness=2.0, q_by_depth=False):
    """Random target and draft laws for every prefix up to `depth` tokens: {prefix: (p, q)}, each (V,).
    q_by_depth: the draft's law depends on the prefix's length only (MTP heads, ParallelSpec's masks)."""
    g = torch.Generator().manual_seed(seed)
    out, q_of_depth = {}, {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(V), repeat=n):
            p, q = (torch.softmax(sharpness * torch.randn(V, generator=g, dtype=F64), -1) for _ in range(2))
            out[prefix] = p, q_of_depth.setdefault(n, q) if q_by_depth else q
    return out


def target_law(table, V, L):
    """The target's own law of L tokens: {sequence: probability}."""
    law = {}
    for seq in itertools.product(range(V), repeat=L):
        law[seq] = torch.tensor([table[seq[:i]][0][seq[i]] for i in range(L)], dtype=F64).prod().item()
    return law


def finish(law, seq, prob, table, V, L):
    """Add to `law` the sequences that start with `seq` (prob), finished with the target's continuation to L."""
    if len(seq) == L:
        law[seq] = law.get(seq, 0.0) + prob
        return
    for z in range(V):
        finish(law, seq + (z,), prob * table[seq][0][z].item(), table, V, L)


def gap(law, reference):
    return max(abs(law.get(s, 0.0) - p) for s, p in reference.items())


PAPER_P, PAPER_Q = torch.tensor([1 / 3, 2 / 3], dtype=F64), torch.tensor([2 / 3, 1 / 3], dtype=F64)


def chain_rows(table, drafts):
    """p_target (1, k+1, V) and q_draft (1, k, V) along a chain of drafts."""
    k = len(drafts)
    p = torch.stack([table[tuple(drafts[:i])][0] for i in range(k + 1)])[None]
    q = torch.stack([table[tuple(drafts[:i])][1] for i in range(k)])[None]
    return p, q


def block_law(rule, table, V, k):
    """(law of the first k+1 tokens, expected accepted drafts, the token rule's expected accepted) of one block
    step by `rule` (block_acceptance or an edit of it), every draft enumerated."""
    law, accepted, token_accepted = {}, 0.0, 0.0
    for drafts in itertools.product(range(V), repeat=k):
        p, q = chain_rows(table, drafts)
        p_draft = torch.tensor([q[0, i, x] for i, x in enumerate(drafts)], dtype=F64).prod().item()
        h, emit = rule(p, q, torch.tensor([drafts]))
        h, emit = h[0], emit[0]
        reach = 1.0
        for i in range(k):  # the token rule: accept draft i with min(1, p/q) while all before it were accepted
            reach *= min(1.0, (p[0, i, drafts[i]] / q[0, i, drafts[i]]).item())
            token_accepted += p_draft * reach
        for j in range(k + 1):  # stop after j drafts: test j passes, every longer one failed (h_0 = 1)
            stop = (h[j] if j else 1.0) * torch.prod(1 - h[j + 1:]).item()
            accepted += p_draft * stop * j
            for y in range(V):
                finish(law, tuple(drafts[:j]) + (y,), p_draft * stop * emit[j, y].item(), table, V, k + 1)
    return law, accepted, token_accepted


# ---------------------------------------------------------------------------------------------------------
# The methods: a target's exact law of its first tokens, and a method's sampled one


@torch.no_grad()
def exact_law(target, prompt, L, sampling):
    """The target's law of its next L tokens after `prompt`, (V**L,) indexed by the base-V code of the
    sequence (like `sequence_codes`): one batched forward over every possible continuation, no cache, no
    method, the warped conditionals multiplied."""
    V = target.config.vocab_size
    conts = torch.cartesian_prod(*[torch.arange(V)] * L).reshape(-1, L)  # (V**L, L) every continuation
    x = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)  # (V**L, P+L)
    P = len(prompt)
    p = warp(target(x).logits[:, P - 1:P + L - 1], *sampling)  # (V**L, L, V) p(x_{P+i} | x_<P+i)
    return p.gather(-1, conts[..., None]).squeeze(-1).prod(-1)  # (V**L,) product of the L conditionals


def method_law(models, prompt, L, n, method, sampling, **options):
    """Empirical law of the first L tokens over n seeded runs, and the guesses accepted in all. The budget is
    L + 1 so that the first step after the prefill may guess L - 1 tokens deep (a method never guesses past its
    budget)."""
    V = models.target.config.vocab_size
    codes, accepted = [], 0
    for seed in range(n):
        ids, stats = METHODS[method](models, prompt, L + 1, temperature=sampling[0], top_k=sampling[1],
                                     top_p=sampling[2], seed=seed, **options)
        codes.append(sum(t * V ** (L - 1 - i) for i, t in enumerate(ids[:L])))
        accepted += stats["new_tokens"] - stats["target_forwards"]  # every forward emits 1 + its accepted guesses
    return empirical_law(torch.tensor(codes), V ** L), accepted


def parallelspec_sampled_law(models, prompt, L, n, sampling, **options):
    """`parallelspec`'s empirical law of the first L tokens of n seeded runs, and the guesses accepted in all
    (its stats' count). The budget is L + 1, so the first step after the prefill verifies L - 1 guesses
    (x2..xL) and may add the bonus token."""
    V = models.target.config.vocab_size
    seqs, accepted = [], 0
    for seed in range(n):
        ids, stats = METHODS["parallelspec"](models, prompt, L + 1, temperature=sampling[0], top_k=sampling[1],
                                             top_p=sampling[2], seed=seed, **options)
        seqs.append(ids[:L])
        accepted += stats["accepted"]
    return empirical_law(sequence_codes(torch.tensor(seqs), V), V ** L), accepted
