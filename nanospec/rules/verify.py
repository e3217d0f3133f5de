"""
Verification core: pure functions on probability tensors, no model inside.

Every decoding method turns logits into probabilities with `warp` (the same warping for the target and for
any draft, so losslessness holds with respect to the warped target), draws tokens with `sample`, and checks
guesses with the rules below. Notation: `p_target` is the target's next-token distribution, `q_draft` the
distribution a draft token was drawn from.

Everything rests on one rule (Leviathan et al. 2022, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):
a token x drawn from q is accepted with probability `accept_prob = min(1, p(x)/q(x))`; on rejection the
emitted token is drawn from `residual = norm(max(0, p - q))`. The output then follows p exactly:
    P(out = y) = min(p(y), q(y)) + (1 - sum min(p, q)) * residual(y) = p(y).
The other rules are the same two functions applied differently. What the methods run (nanospec/steps/verify_step.py
picks the one that fits by its --verify name, steps/options.VERIFY_RULES), each held by the tests to the exact law:
  - verify_chain             the rule at each position of a drafted chain, bonus token from p at the end;
                             deterministic drafts (n-gram copies, top-k, Jacobi iterates) go through it as
                             point masses, q = point_mass(x) = one_hot(x): accept_prob = p(x) and the residual is
                             p with x removed (= "sample y ~ p, keep it while it matches")
  - verify_block             the drafted chain judged jointly (block verification): the same law, at least as
                             many drafts accepted in expectation (`--verify block`)
  - verify_tree_descend      a tree of deterministic drafts (Medusa / EAGLE-2 top-k trees, n-grams): the tree
                             point-mass rule as "draw y ~ p at the node, step into the child holding y"
  - verify_tree_without_replacement
                             a tree whose children at each node are draws from q WITHOUT replacement
                             (`gumbel_top_k`; Jeon et al. 2024, arXiv 2402.14160), judged all at once
  - verify_tree_traversal    a drawn tree judged from its leaves up (`--verify traversal`): the same law
  - verify_chain_greedy, verify_tree_greedy
                             the greedy case of the rules above, with no distribution built
  - typical_accept           Medusa's typical acceptance (arXiv 2401.10774); LOSSY, kept as an option and
                             as a negative control for the tests.
The chain rules and the tree rules that return tensors work over leading dimensions, as accept_prob and residual
do: one chain or tree, or B of them (batched decoding), through the same code. The REFERENCE rules, which no method
runs, are nanospec/rules/reference.py: the tests prove them exact and hold the rules above to them.

Greedy decoding is the zero-temperature case: `warp` returns a one-hot distribution at the argmax, and every
rule then reduces to "accept while the guess equals the target's argmax, then emit the argmax".
All randomness comes from the `generator` passed in; nothing here seeds anything.
"""
import functools
from typing import NamedTuple

import numpy as np
import torch
from torch.nn import functional as F

from nanospec.rules.tree import children, depths, path_to


def warp(logits, temperature=0.0, top_k=None, top_p=None):
    """Logits (..., V) -> probabilities (..., V) after temperature, top-k and top-p (in that order).

    temperature == 0 gives a one-hot at the argmax (first index on ties), i.e. greedy decoding.
    top_k keeps the k largest logits (ties with the k-th are all kept); top_p keeps the smallest set of most
    probable tokens whose mass reaches top_p (always at least the most probable one).
    Example: logits [2., 1., 0.], temperature 1, top_k 2 -> softmax([2., 1.]) = [0.731, 0.269, 0.].
    Example: probs [0.5, 0.3, 0.2], top_p 0.6 -> keep [0.5, 0.3] -> [0.625, 0.375, 0.].
    Warping is row by row with no state, so target and draft logits warped with the same settings are
    treated identically, which the losslessness of every rule below relies on.
    """
    if temperature == 0.0:
        return point_mass(logits.argmax(-1), logits)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1) smallest kept logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop_sorted[..., 0] = False  # the most probable token always stays (top_p <= 0 would drop them all)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs, generator=None, noise=None):
    """Draw one token per row from probabilities (..., V) -> LongTensor (...), as a race: every token v gets an
    exponential clock of rate p(v), arrival time E_v / p(v) with E_v ~ Exp(1), and the first to arrive wins, which
    happens with probability p(v). (In logs it is Gumbel-max: -log E_v is Gumbel noise added to log p(v).) A
    one-hot row always gives its hot index, so greedy decoding through `sample` is deterministic; a zero never
    wins (its time is infinite); rows need not sum to exactly 1. Four tensor operations for any number of rows:
    on a CPU about half of torch.multinomial's one row, and no host read (multinomial reads on a GPU).
    noise: the race's log-uniforms (..., V) (`race_noise`), given to run this race with noise another race ran
    with (coupled drafting: the drafter's guess and the target's token race on the same clocks); None: fresh."""
    return race(probs, generator, noise).argmax(-1)


def pick_token(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    """The target's own token from its logits (..., V) -> LongTensor (...): a draw (`sample`) from warp(logits, ...),
    or, greedy, the argmax itself, which is what drawing from warp's one-hot gives, without building it (a plain
    step, `ar`'s or a method's, then costs one operation). Called pick_token(logits, *sampling, generator=g)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    return sample(warp(logits, temperature, top_k, top_p), generator)


def race(probs, generator=None, noise=None):
    """The race of `sample` and `gumbel_top_k`, probs (..., V) -> (..., V): minus each token's arrival time,
    log(u) / p = -E / p for E = -log(u) ~ Exp(1), u uniform in [0, 1) drawn fresh per entry (or noise = log(u)
    given), so the LARGEST arrives first. A token of probability 0 (or with u = 0) gets -inf: it never arrives."""
    if noise is None:
        noise = race_noise(probs.shape, generator, probs.dtype, probs.device)
    return noise / probs


def race_noise(shape, generator=None, dtype=torch.float32, device="cpu"):
    """A race's randomness, log(u) for u uniform in [0, 1) per entry, (...) = shape: drawn once, it can run two
    races (`sample(q, noise=n)` and `sample(p, noise=n)`: see verify_chain_coupled)."""
    return torch.rand(shape, generator=generator, dtype=dtype, device=device).log_()


def sample_without_replacement(probs, k, generator=None):
    """Draw k distinct tokens per row, one after another: the first from probs, the second from probs with the
    first removed and renormalised, and so on. probs (..., V) -> LongTensor (..., k), in the order drawn.

    Gumbel-top-k (Kool et al. 2019, arXiv 1903.06059): add independent Gumbel(0, 1) noise to every log-probability
    and take the k largest. The largest is a sample of probs (the Gumbel-max trick); given it, the rest are the
    same trick on the remaining tokens, so the k largest, in order, are k sequential draws without replacement.
    All k cost one noise draw per token instead of k rounds of sampling and renormalising.
    Example: probs [0.5, 0.3, 0.2], k = 2 -> [0, 1] with probability 0.5 * 0.3/0.5 = 0.3, [1, 0] with 0.3 * 0.5/0.7.
    Every row needs at least k tokens of nonzero probability (a ValueError otherwise): a token of probability 0
    is never drawn.
    """
    top = gumbel_top_k(probs, k, generator)
    if not torch.isfinite(top.values).all():  # a token of probability 0 never arrives: -inf
        raise ValueError(f"cannot draw {k} distinct tokens from a distribution with fewer than {k} possible ones")
    return top.indices


def gumbel_top_k(probs, k, generator=None):
    """`sample_without_replacement`'s draws without its check (no host read): the k first arrivals of `sample`'s
    race (= the k largest of log probs + Gumbel noise), as (values: minus their arrival times, indices) (..., k),
    in the order they arrived. Where a row has fewer than k possible tokens, the values past them are -inf and their
    indices meaningless: the caller drops them (tree_guesses.DrawnTree keeps the finite ones)."""
    return race(probs, generator).topk(k, dim=-1)


# ---------------------------------------------------------------------------------------------------------
# The two pieces every lossless rule is made of.


def capped_ratio(a, b):
    """min(1, a / b) for tensors a, b >= 0: the chance that an `a` the draft gave `b` is accepted (a = p(x), or
    w p(x) for block and traversal verification's weighted p). The convention for b = q(x) = 0, written here once:
    a token the draft could not have produced counts as accepted if a > 0, refused if a = 0. It never happens when
    x really was drawn from q, and it keeps every rule free of 0/0. Example: [0.2, 0.5, 0.0] over [0.6, 0.0, 0.0] ->
    [1/3, 1, 0]. On two floats (traverse_tree's walk on the host) the same, as a float."""
    if isinstance(b, float):
        return min(a / b, 1.0) if b > 0 else float(a > 0)
    return (a / b).nan_to_num(nan=0.0).clamp(max=1.0)  # a / 0 = inf -> 1 (accepted); 0 / 0 = nan -> 0


def accept_prob(p, q, x):
    """Probability of accepting token x drawn from q when the target is p: min(1, p(x) / q(x)).

    p, q (..., V); x (...) LongTensor -> (...). Example: p = [0.2, 0.8], q = [0.6, 0.4]:
    x = 0 -> 0.2/0.6 = 1/3; x = 1 -> min(1, 2) = 1. Summed over x ~ q this is sum(min(p, q)).
    A token the draft could not have produced (q(x) = 0) counts as accepted if p(x) > 0 (capped_ratio).
    """
    # BEGIN SOLUTION ex3
    x = x.unsqueeze(-1)  # (..., 1)
    return capped_ratio(p.gather(-1, x), q.gather(-1, x)).squeeze(-1)  # (...) min(1, p(x) / q(x))
    # END SOLUTION ex3


def residual(p, q):
    """Where to draw from after a rejection: norm(max(0, p - q)), row by row. p, q (..., V) -> (..., V).

    Example: p = [0.2, 0.8], q = [0.6, 0.4] -> max(0, p - q) = [0, 0.4] -> [0, 1].
    It holds exactly the mass p has and q lacks. When that mass is 0 (p <= q everywhere, i.e. p == q) a
    rejection cannot happen, since every accept_prob is 1; we return p rather than divide by zero.
    A point-mass draft q = one_hot(x) gives p with x zeroed and renormalised; q = 0 gives p itself.
    """
    # BEGIN SOLUTION ex3
    excess = (p - q).clamp(min=0)  # (..., V)
    mass = excess.sum(-1, keepdim=True)  # (..., 1)
    return torch.where(mass > 0, excess / mass, p)  # where the mass is 0, excess / mass is nan and unused
    # END SOLUTION ex3


# ---------------------------------------------------------------------------------------------------------
# Chains: one drafted token per position. Every rule works over leading dimensions, as accept_prob and residual
# do: p_target (..., k+1, V) is one chain, or B of them, with no wrapper in between.


def point_mass(x, p):
    """The q of a deterministic guess (an n-gram copy, a top-k token, a Jacobi iterate): q = one_hot(x), in p's
    vocabulary and dtype. x (...) -> (..., V). Under it accept_prob(p, q, x) = min(1, p(x)/1) = p(x), and
    residual(p, q) is p with x removed: "draw y ~ p, keep the guess while y == x". Example: x = 1, V = 3 ->
    [0., 1., 0.]. (A scatter, not torch.nn.functional.one_hot, which reads x's largest value on the host.)"""
    return p.new_zeros(*x.shape, p.size(-1)).scatter_(-1, x.unsqueeze(-1), 1.0)  # (..., V)


def verify_chain(p_target, q_draft, draft_tokens, generator=None):
    """Speculative sampling over a chain of k drafts (Leviathan et al. 2022; Chen et al. 2023), on one chain or
    on B independent chains at once.

    p_target (..., k+1, V): target probs at each draft position plus the bonus position.
    q_draft (..., k, V): the draft's probs the tokens were sampled from (point_mass(x, p) for deterministic
    guesses). draft_tokens (..., k) LongTensor.
    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of
    norm(max(0, p_i - q_i)); if all k are accepted emit a bonus sample from p_target[k].
    Returns (n_accepted, next_token), LongTensors (...): the emitted tokens are draft_tokens[:n_accepted] +
    [next_token]. No host read: the caller reads them once (verify_step.chain_step).
    Example (greedy, p and q one-hot): draft [5, 9, 2], target argmax [5, 9, 7, 3] -> (2, 7), emit [5, 9, 7].
    Example (sampling): p_0 = [0.2, 0.8], q_0 = [0.6, 0.4], draft [0, ...]: accept with prob 1/3; else emit
    a sample of norm([0, 0.4]) = token 1.
    """
    # BEGIN SOLUTION ex4
    k = draft_tokens.size(-1)
    # one uniform per position, compared with that position's acceptance probability
    u = torch.rand(draft_tokens.shape, generator=generator, dtype=p_target.dtype, device=p_target.device)  # (..., k)
    accepted = u < accept_prob(p_target[..., :k, :], q_draft, draft_tokens)  # (..., k)
    n_accepted = accepted.long().cumprod(-1).sum(-1)  # (...) length of the all-accepted prefix
    # The next token comes from residual(p_i, q_i) at the first rejection i, or from p_k (the bonus) when all
    # k were accepted. A zero row of q at the bonus position makes this one formula: residual(p, 0) = p.
    q_padded = F.pad(q_draft, (0, 0, 0, 1))  # (..., k+1, V) a zero row after the k
    at = n_accepted[..., None, None].expand(*n_accepted.shape, 1, p_target.size(-1))  # (..., 1, V) that row
    p_at = p_target.gather(-2, at)[..., 0, :]  # (..., V) the row of the first rejection, or of the bonus
    q_at = q_padded.gather(-2, at)[..., 0, :]  # (..., V)
    return n_accepted, sample(residual(p_at, q_at), generator)
    # END SOLUTION ex4


def verify_chain_greedy(logits, draft_tokens):
    """The greedy case of the chain rules, the fast way: one argmax, no distributions built.

    logits (k+1, V); draft_tokens (k,). Accept while each guess equals the target's argmax, then emit the
    argmax after the last accepted guess. It gives exactly what verify_chain(warp(logits, 0), q, ...) gives on
    one-hot p and any q the guesses could come from (the tests check it), about 20x cheaper, which matters on a
    CPU where a tiny model's forward takes a millisecond.
    draft [5, 9, 2], argmax [5, 9, 7, 3] -> (2, 7).
    """
    # BEGIN SOLUTION ex2
    best = logits.argmax(-1).tolist()  # same tie-break as warp(logits, 0): the first maximum
    n = 0
    while n < len(draft_tokens) and int(draft_tokens[n]) == best[n]:
        n += 1
    return n, best[n]
    # END SOLUTION ex2


def verify_chain_coupled(p_target, noise, draft_tokens):
    """A chain drawn with the target's own randomness (coupled drafting; Daliri, Musco and Suresh 2024, "Coupling
    without Communication and Drafter-Invariant Speculative Decoding", arXiv 2408.07978): the token at each position
    is the winner of ONE race, noise[i] (`race_noise`), and the drafter drew guess i by running its q in that race,
    sample(q_i, noise=noise[i]). The target's token there is sample(p_i, noise=noise[i]), a draw from p_i since the
    race's noise is fresh (no token before position i depended on it); a guess is accepted while it IS that token.
    So the rule is the greedy one on the two races' winners, with no distribution built and nothing drawn here.
    p_target (k+1, V), noise (k+1, V), draft_tokens (k,) -> (n accepted, the next token), ints.
    Example: p_0 = [0.2, 0.8], q_0 = [0.6, 0.4], noise_0 = log [0.5, 0.6]: the draft's race -> times [1.16, 1.28]
    (E / q), guess 0; the target's -> [3.47, 0.64], token 1: rejected, emit 1.
    It accepts less than Leviathan's rule (P(same winner) <= sum(min(p, q)); here 0.33 against 0.38 for the MTP
    heads' first guess at t=1, docs/benchmark.md), and costs the host no more than greedy decoding: when
    sampling, every sampled rule's work (accept_prob, a uniform per guess, the residual and its draw) is gone."""
    return verify_chain_greedy(race(p_target, noise=noise), draft_tokens)  # the winners: argmax of -E / p


# ---------------------------------------------------------------------------------------------------------
# Block verification: the whole chain judged jointly (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami and Suresh,
# "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444, ICLR 2025).


def block_acceptance(p_target, q_draft, draft_tokens):
    """What block verification decides with, on B chains: p_target (B, k+1, V), q_draft (B, k, V), draft_tokens
    (B, k) -> h (B, k+1), the chance of stopping after i accepted drafts once every longer prefix has failed, and
    the law (B, k+1, V) of the token emitted there.

    The weight of the first i drafts, w_0 = 1, w_i = min(w_{i-1} p_i(x_i) / q_i(x_i), 1), is the chance the
    output runs through them. Every position is tested, the longest prefix that passes wins: w_k for all k, then
    for i < k, with the excess mass R_i = sum(max(w_i p_i - q_i, 0)) that the drafts after i could not carry,
    h_i = R_i / (R_i + 1 - w_i), and the emitted token follows norm(max(w_i p_i - q_i, 0)): the token rule's
    residual with p weighted by the block's w_i (h_0 = 1: the empty prefix always passes). After all k: p_k.
    Example, the paper's: p = [1/3, 2/3] and q = [2/3, 1/3] at every position, drafts [0, 1]: w = [1, 1/2, 1],
    so both are accepted every time, where the token rule keeps token 0 only half the time.
    Greedy (one-hot p and q) it is "accept while the draft is the argmax", as the token rule."""
    # BEGIN SOLUTION ex14
    B, k = draft_tokens.size(0), draft_tokens.size(1)
    p_x = p_target[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # (B, k) p_i(x_i)
    q_x = q_draft.gather(-1, draft_tokens[..., None])[..., 0]  # (B, k) q_i(x_i)
    w = [p_target.new_ones(B)]  # (B,) w_0
    for i in range(k):
        w.append(capped_ratio(w[-1] * p_x[:, i], q_x[:, i]))  # (B,) min(w_{i-1} p_i(x_i) / q_i(x_i), 1)
    w = torch.stack(w, 1)  # (B, k+1)
    excess = (w[:, :k, None] * p_target[:, :k] - q_draft).clamp(min=0)  # (B, k, V)
    mass = excess.sum(-1)  # (B, k) R_i
    fail = mass + 1 - w[:, :k]  # (B, k) the chance every longer prefix fails, given the first i drafts
    h = torch.cat([torch.where(fail > 0, mass / fail.clamp(min=1e-30), 1.0), w[:, k:]], 1)  # (B, k+1)
    left = torch.where(mass[..., None] > 0, excess / mass[..., None].clamp(min=1e-30), p_target[:, :k])  # (B, k, V)
    return h, torch.cat([left, p_target[:, k:]], 1)
    # END SOLUTION ex14


def verify_block(p_target, q_draft, draft_tokens, generator=None):
    """Block verification of a chain of k drafts, each drawn from q_draft given the ones before it: the same
    inputs and outputs as `verify_chain` (one chain or B, over leading dimensions), the output law the same (the
    target's), and in expectation at least as many drafts accepted, often more (the paper proves it optimal among
    rules that see only the chain's own probabilities). p = [1/3, 2/3], q = [2/3, 1/3] at both of k = 2
    positions: 10/9 drafts accepted per step with verify_chain, 11/9 with this rule. One uniform per position; no
    early exit: the longest prefix whose test passes is kept. Returns (n_accepted, next_token), LongTensors (...)."""
    lead, k = draft_tokens.shape[:-1], draft_tokens.size(-1)
    B, V = lead.numel(), p_target.size(-1)  # B chains in a row
    h, emit_law = block_acceptance(p_target.reshape(B, k + 1, V), q_draft.reshape(B, k, V),
                                   draft_tokens.reshape(B, k))  # (B, k+1), (B, k+1, V)
    u = torch.rand(h.shape, generator=generator, dtype=h.dtype, device=h.device)  # (B, k+1)
    length = torch.arange(k + 1, device=h.device)  # (k+1,) the prefix each test stands for
    passed = (u < h) | (length == 0)  # (B, k+1) the empty prefix always passes
    n = torch.where(passed, length, 0).max(-1).values  # (B,) the longest that passed
    next_token = sample(emit_law[torch.arange(B, device=h.device), n], generator)  # (B,)
    return n.reshape(lead), next_token.reshape(lead)


# ---------------------------------------------------------------------------------------------------------
# Trees (nanospec/rules/tree.py): node 0 is the root, a token already fixed; every other node is a drafted token under
# its parent, and every parent comes before its children. The rules that return tensors work over leading
# dimensions (one tree, or B trees of one shape); tree_step reads their answer once with `host_path`.


def tree_lists(parents):
    """parents (N,) -> (parents as a list, children[u] in index order, depth[u]), checked.
    Example: [-1, 0, 0, 1] -> ([-1, 0, 0, 1], [[1, 2], [3], [], []], [0, 1, 1, 2])."""
    parents = [int(v) for v in parents]
    if parents[0] != -1 or min(parents[1:], default=0) < 0:
        raise ValueError(f"parents[0] must be -1 (the root) and only there, got {parents}")
    depth = depths(parents)  # checks that every parent comes before its children
    return parents, children(parents), depth


class TreeTables(NamedTuple):
    """The index tensors a tree rule needs of a tree's shape, built once per shape (`tree_tables`), so that a step
    over a tree of the same shape makes none from Python lists. Example: parents [-1, 0, 0, 1] ->
    at [0, 1] (the nodes with children), child [[1, 2], [3, 4]] (each one's children in order, padded with N = 4),
    child_or_root [[1, 2], [3, 0]], absent [[F, F], [F, T]] (K, W, 1), ancestors [[-1, -1], [1, -1], [2, -1],
    [1, 3]] (each node's path below the root, padded with -1), nodes [0, 1, 2, 3]."""
    at: torch.Tensor  # (K,) the nodes with children
    child: torch.Tensor  # (K, W) their children in order; N where a node has fewer than W
    child_or_root: torch.Tensor  # (K, W) the same, padded with 0: an index that exists, for gathering tokens
    absent: torch.Tensor  # (K, W, 1) bool: no child there
    ancestors: torch.Tensor  # (N, D) the path from the root to each node, root excluded, padded with -1
    nodes: torch.Tensor  # (N,) 0..N-1


@functools.lru_cache(maxsize=64)
def tree_tables(parents, device):
    """TreeTables of the tree `parents` (a tuple) on `device`; None when no node has children."""
    parents, kids, depth = tree_lists(parents)
    N, at = len(parents), [u for u in range(len(parents)) if kids[u]]
    if not at:
        return None
    W, D = max(len(kids[u]) for u in at), max(depth)
    child = [kids[u] + [N] * (W - len(kids[u])) for u in at]
    ancestors = [(path_to(parents, n)[1:] + [-1] * D)[:D] for n in range(N)]
    tensor = functools.partial(torch.tensor, device=device)
    child = tensor(child)
    return TreeTables(tensor(at), child, child % N, child[..., None] == N, tensor(ancestors),
                      torch.arange(N, device=device))


def host_path(path, next_token):
    """One tree's answer, path (D,) padded with -1 and next_token (), -> (path as a list without the padding,
    next token as an int), in ONE host read: on a GPU each read waits for every queued kernel."""
    *path, nxt = torch.cat([path, next_token.reshape(1)]).tolist()
    return [v for v in path if v >= 0], nxt


def verify_tree_descend(p_target, tokens, parents, generator=None):
    """The tree point-mass rule as sample-and-match, what tree_step runs for guesses not drawn (top-k trees:
    Medusa, EAGLE-2; n-grams; Jacobi windows). p_target (N, V): the target's law after each node.

    A guess is a point mass, q = one_hot(x), so the walk's min(1, P(x)/q(x)) = P(x) and the residual is P with
    x removed (reference.verify_tree_point_mass runs exactly that). The same law, drawn at once: at node
    u draw y ~ p_u; if a child of u holds y, step into it (the first such child: a duplicate sibling never wins)
    and repeat there; else stop and emit y. Child x is entered with probability p_u(x) and, when none is, y
    follows p_u without the children's tokens. (The draw y is both the test and the emitted token; drawing a
    FRESH token after a mismatch would be biased.) Greedy: p is one-hot, y is the argmax.
    Returns (path: accepted node indices, root excluded; next_token). Every node's y is drawn at once, before
    the walk, and read in one transfer: a node the walk never reaches leaves its draw unused, and each visited
    node's y is still a fresh draw of its own p_u.
    Example: tokens [0, 5, 8, 9], parents [-1, 0, 0, 1], greedy argmax after nodes 0..3 = [8, 1, 7, 4]
    -> y = 8 at the root: node 2; no child of node 2 holds y = 7 -> ([2], 7).
    """
    draws = sample(p_target, generator).tolist()  # (N,) y at every node, one read
    return _descend(tokens, parents, draws.__getitem__)  # the draw is both the test and, at the end, the output


def verify_tree_greedy(logits, tokens, parents):
    """The greedy case of the tree rules, the fast way: one argmax over all nodes, then the same descent as
    verify_tree_descend with y = the argmax (what sampling a one-hot row gives). logits (N, V). It returns what
    verify_tree_descend(warp(logits, 0), ...) and reference.verify_tree_point_mass return under greedy (the
    tests check it) without building N one-hot rows or drawing from them: on a CPU that is a third of a tiny
    model's step.
    Example: tokens [0, 5, 8, 9], parents [-1, 0, 0, 1], argmax after nodes 0..3 = [8, 1, 7, 4] -> ([2], 7).
    """
    best = logits.argmax(-1).tolist()  # same tie-break as warp(logits, 0): the first maximum
    return _descend(tokens, parents, best.__getitem__)


def _descend(tokens, parents, pick):
    """The walk both rules above share: at node u take y = pick(u); step into the first child of u holding y
    and repeat, or stop. Returns (path: entered nodes, root excluded; y at the last node)."""
    # BEGIN SOLUTION ex8
    child = {}  # (parent, token) -> the first child holding it
    for c in range(len(parents) - 1, 0, -1):
        child[(parents[c], int(tokens[c]))] = c
    node, path = 0, []
    while True:
        y = pick(node)
        if (node, y) not in child:
            return path, y
        node = child[(node, y)]
        path.append(node)
    # END SOLUTION ex8


def without_replacement_proposals(q, drawn):
    """The law each of k draws without replacement came from: q (..., V), drawn (..., k) -> (..., k, V), where row j
    is q with drawn[..., :j] removed and renormalised. What `verify_tree_without_replacement` checks each child
    against. Example: q [0.5, 0.3, 0.2], drawn [0, 2] -> [[0.5, 0.3, 0.2], [0, 0.6, 0.4]].
    A row with nothing left (all of q's tokens already drawn) is all zeros: no real draw comes from it."""
    # BEGIN SOLUTION ex13
    hot = point_mass(drawn, q)  # (..., k, V) row j: one_hot(drawn[j])
    drawn_before = hot.cumsum(-2) > hot  # (..., k, V) True where a token was drawn before draw j
    kept = torch.where(drawn_before, 0.0, q.unsqueeze(-2))  # (..., k, V)
    mass = kept.sum(-1, keepdim=True)  # (..., k, 1)
    return (kept / mass).nan_to_num(nan=0.0)  # a row with nothing left: 0 / 0 -> 0
    # END SOLUTION ex13


def verify_tree_without_replacement(p_target, q_draft, tokens, parents, generator=None):
    """Lossless verification of a tree whose children at each node were drawn from q WITHOUT replacement:
    recursive rejection sampling over distinct drafts (Jeon et al. 2024, Recursive Speculative Decoding,
    arXiv 2402.14160). What the sampling modes of medusa, eagle and parallelspec run, through tree_step.

    p_target, q_draft (..., N, V): the target's next-token law after each node, and the law q_u node u's children
    were drawn from (`gumbel_top_k`'s draws, children in draw order = index order). tokens (..., N) (a list
    for one tree), parents (N,). At node u, from P = p_target[u], for its children x_1, x_2, ... in order:
      child j was drawn from q_j = q_u without x_1..x_{j-1}, renormalised (`without_replacement_proposals`);
      accept it with probability min(1, P(x_j) / q_j(x_j)) and descend into it;
      on rejection P <- norm(max(0, P - q_j)), which zeroes P(x_j) (a rejection needs P(x_j) < q_j(x_j)).
    If no child is accepted, emit a sample of P.
    Example: P = [0.6, 0.3, 0.1], q_u = [0.2, 0.2, 0.6], children [2, 0]: x_1 = 2 is accepted with prob
    0.1/0.6 = 1/6; else P = norm([0.4, 0.1, 0]) = [0.8, 0.2, 0], and x_2 = 0 comes from q_2 = [0.5, 0.5, 0]:
    accepted with prob min(1, 0.8/0.5) = 1. (Drawn with replacement, the second child could repeat token 2,
    which P no longer allows: distinct children waste no draft on a rejected token.)

    Why the output follows p_u exactly, and the four conditions a drafter must meet for it to hold (children
    drawn in verification order from the q they are checked against, a number fixed in advance, none pruned or
    reordered for its own value): docs/verify.md.
    How it is computed, with few tensor operations whatever the tree (each is a kernel launch on a GPU): the walk
    only ever needs, at each node u, the accept probability of its j-th child given that children 1..j-1 were
    rejected, and the law P left after all of them were. Those depend on u's own row alone, so they are computed for
    every node at once, sibling rank by sibling rank (W ranks for nodes of at most W children); every uniform and
    every node's emitted token is drawn at once too; then the walk follows, from the root, each node's first
    accepted child. A node the walk never reaches leaves its draws unused, and each node the walk visits uses only
    its own: the same law as judging one child at a time (reference.verify_tree_sampled's walk), which the
    tests check exactly.
    Returns path (..., D) padded with -1 (the accepted nodes, root excluded), next_token (...).
    """
    lead, (N, V), device = p_target.shape[:-2], p_target.shape[-2:], p_target.device
    tree = tree_tables(tuple(int(v) for v in parents), device)
    if tree is None:  # the root alone: its token follows p
        return torch.full((*lead, 0), -1, device=device), sample(p_target[..., 0, :], generator)
    x = torch.as_tensor(tokens, device=device).expand(*lead, N)[..., tree.child_or_root]  # (..., K, W) children's
    q = without_replacement_proposals(q_draft[..., tree.at, :], x).masked_fill_(tree.absent, 0.0)  # (..., K, W, V)
    P = [p_target[..., tree.at, :]]  # (..., K, V) each: every node's target law before its child j is tried
    for q_j in q.unbind(-2):  # rank j of every node at once: what is left once child j is rejected
        P.append(residual(P[-1], q_j))  # (an absent child's q is 0, and residual(P, 0) = P)
    accept = accept_prob(torch.stack(P[:-1], -2), q, x)  # (..., K, W) child j's chance, children 1..j-1 rejected
    u = torch.rand(accept.shape, generator=generator, dtype=accept.dtype, device=device)  # (..., K, W)
    emit = sample(p_target.index_copy(-2, tree.at, P[-1]), generator)  # (..., N) a node's token, if the walk stops
    # Each node's next node: its first accepted child (children come in index order), or itself when none is.
    first = torch.where(u < accept, tree.child, N).amin(-1)  # (..., K), N: none (an absent child is N)
    nxt = tree.nodes.expand(*lead, N).index_copy(-1, tree.at, torch.where(first < N, first, tree.at))  # (..., N)
    node = torch.zeros((*lead, 1), dtype=torch.long, device=device)  # (..., 1) where each walk stands
    for _ in range(tree.ancestors.size(-1)):  # the walk: D steps along the accepted children (a node where the
        node = nxt.gather(-1, node)  # walk stopped points at itself)
    return tree.ancestors[node[..., 0]], emit.gather(-1, node)[..., 0]


def traverse_tree(p_target, q_draft, tokens, parents, coin):
    """Traversal verification's walk over one tree whose children at each node u were drawn WITHOUT replacement
    from q_draft[u], in index order, each node's independently of every other node's; its randomness is coin(prob)
    -> True with probability prob. p_target, q_draft (N, V) on the host (numpy arrays, or CPU tensors; the walk
    works on float64 numpy copies: it is scalar work, where numpy's indexing costs a tenth of a torch op); tokens,
    parents (N,) lists. Returns (path: the accepted nodes, root excluded; the law (V,) of the token emitted after the
    last of them, a numpy row).

    The walk goes leaves first, in post-order (the first child's subtree, then the second's, ...), and judges each
    node by the whole path above it: its weight w_c = min(w_u P_u(x_c) / Q_u(x_c), 1), the chance the output runs
    through c (w_root = 1), from its parent's current target law P_u and proposal Q_u. A node with no child left
    passes with probability w_c: the path to it is accepted and the next token follows P_c. When it fails, its
    parent u tries its next child with what the failed one could not carry: the excess R = sum(max(w_u P_u - Q_u,
    0)), w_u <- R / (R + 1 - w_u), P_u <- norm(max(w_u P_u - Q_u, 0)), Q_u <- Q_u without x_c (the next sibling's
    law); with no child left, u itself is judged next. The root always passes.
    On a chain this is block verification (`block_acceptance`); on a tree of depth 1 it is
    verify_tree_without_replacement. Example: p = [1/3, 2/3], q = [2/3, 1/3] at every node, a chain root -> 0 -> 1:
    w = 1/2 at node 1 and 1 at node 2, which passes every time (the top-down rule rejects token 0 half the time)."""
    parents, kids, _ = tree_lists(parents)
    P, Q = (np.asarray(t).astype(np.float64) for t in (p_target, q_draft))  # (N, V) copies, updated as children fail
    w, tried = [1.0] + [0.0] * (len(parents) - 1), [0] * len(parents)  # weights; children tried so far
    node, path = 0, []
    while True:
        if tried[node] < len(kids[node]):  # down into the next untried child
            c = kids[node][tried[node]]
            w[c] = capped_ratio(w[node] * P[node, tokens[c]], Q[node, tokens[c]])
            node, path = c, path + [c]
        elif node == 0 or coin(w[node]):  # no child left to try: the node passes with probability w
            return path, P[node]
        else:  # it failed: its parent goes on with the mass it could not carry
            u, x = parents[node], tokens[node]
            excess = np.maximum(w[u] * P[u] - Q[u], 0.0)  # (V,)
            R = excess.sum()
            w[u] = R / (R + 1 - w[u]) if R + 1 - w[u] > 0 else 1.0
            P[u] = excess / R if R > 0 else P[u]
            Q[u, x] = 0.0
            Q[u] /= max(Q[u].sum(), 1e-30)
            tried[u] += 1
            node, path = u, path[:-1]


def verify_tree_traversal(p_target, q_draft, tokens, parents, generator=None):
    """Traversal verification (Weng et al. 2025, "Traversal Verification for Speculative Tree Decoding", arXiv
    2505.12398) of a tree of drawn guesses: `traverse_tree` with coins from `generator`, then the next token.
    Lossless, like verify_tree_without_replacement (same inputs, same outputs), and it can keep a path whose first
    token the top-down rule would have rejected. Each node's children must be drawn independently of every other
    node's (tree_guesses.DrawnTree): the walk judges several siblings' subtrees, and draws shared between them
    would make the later ones depend on the earlier ones' failure. The walk runs on the host over float64 copies
    of the tree's rows, one read for them and the uniforms. Returns (path, next_token)."""
    (N, V), tokens = p_target.shape, [int(t) for t in tokens]
    u = torch.rand(N + 1, generator=generator, dtype=p_target.dtype, device=p_target.device)  # N tests, one draw
    host = torch.cat([p_target.flatten(), q_draft.flatten(), u]).cpu().numpy()  # the one read (the walk: float64)
    P, Q, u = host[:N * V].reshape(N, V), host[N * V:2 * N * V].reshape(N, V), host[2 * N * V:].tolist()
    coins = iter(u)
    path, law = traverse_tree(P, Q, tokens, parents, lambda prob: next(coins) < prob)
    cdf = law.cumsum()  # the next token by inverse CDF from the last uniform: the first where cdf > u * total
    return path, int(np.searchsorted(cdf, u[N] * cdf[-1], side="right"))


def typical_accept(p_target, tokens, parents, posterior_threshold=0.09, posterior_alpha=0.3, generator=None):
    """Medusa's typical acceptance (Cai et al. 2024). LOSSY BY DESIGN: the output does NOT follow p_target.

    It accepts any "plausible" draft without a random test: child x of node u is accepted when
    p_u(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_u))). It follows the longest path of accepted
    nodes (ties: highest sum of log p along the path), then emits a sample from p at the last accepted node.
    Example: p_root = [0.5, 0.3, 0.2] (threshold min(0.09, 0.3 e^-1.03) = 0.09), one child with token 2:
    0.2 > 0.09, so token 2 is emitted every time, where p gives it 20%. Greedy (one-hot p) stays exact:
    the threshold is 0.09 and only the argmax passes. Kept as an option for medusa and as a negative control.
    p_target (..., N, V), tokens (..., N) (a list for one tree), parents (N,) as in verify_tree_without_replacement.
    Returns path (..., D) padded with -1, next_token (...).
    """
    lead, (N, V) = p_target.shape[:-2], p_target.shape[-2:]
    tokens = torch.as_tensor(tokens, device=p_target.device).expand(*lead, N).reshape(-1, N)  # (B, N)
    p_target = p_target.reshape(-1, N, V)  # (B, N, V): the trees in a row
    B, device = p_target.size(0), p_target.device
    parents, _, depth = tree_lists(parents)
    entropy = torch.special.entr(p_target).sum(-1)  # (B, N) H(p_u), with 0 log 0 = 0
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # (B, N)
    par = torch.tensor(parents[1:], dtype=torch.long, device=device)  # (N-1,) parent of nodes 1..N-1
    p_tok = p_target[:, par].gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, N-1) p_parent(own token)
    ok = p_tok > threshold[:, par]  # (B, N-1) each node judged alone
    # a node is reached if it and all its ancestors pass; score = sum of log p along its path
    reached = torch.ones(B, N, dtype=torch.bool, device=device)  # (B, N)
    score = torch.zeros(B, N, dtype=p_target.dtype, device=device)  # (B, N)
    for c in range(1, N):  # parents come before their children
        reached[:, c] = reached[:, parents[c]] & ok[:, c - 1]
        score[:, c] = score[:, parents[c]] + torch.log(p_tok[:, c - 1])
    # the deepest reached node wins, ties broken by the higher score (then the lower index)
    depth_t = torch.tensor(depth, device=device)  # (N,)
    best_depth = torch.where(reached, depth_t, -1).max(-1, keepdim=True).values  # (B, 1)
    finalists = reached & (depth_t == best_depth)  # (B, N)
    best = torch.where(finalists, score, float("-inf")).argmax(-1)  # (B,)
    # path to each node, root excluded, padded with -1: ancestors[n] = [.., parent, n]
    D = max(depth)
    ancestors = torch.full((N, D), -1, dtype=torch.long, device=device)  # (N, D)
    for n in range(1, N):
        ancestors[n, :depth[n]] = torch.tensor(path_to(parents, n)[1:], dtype=torch.long, device=device)
    next_token = sample(p_target[torch.arange(B, device=device), best], generator)  # (B,)
    return ancestors[best].reshape(*lead, D), next_token.reshape(lead)
