"""Drawn trees on the device (the static runtime's sampling path for medusa and parallelspec): trees.fill_tree with
on_device keeps the tree's shape whatever the draws, with -1 at every node whose draw rank is beyond its depth's
support (top-k / top-p left q fewer tokens) or sits under such a node, and tree_step runs
verify_tree_without_replacement on the device with valid = tokens >= 0, reading the host once a step.

Skipping an invalid child exactly as an absent one is the whole claim, so it is proven three ways:
  - exactly, by enumeration over every ordered draw at one node (test_verify's node_law and ordered_draws);
  - in law, 1e5 two-level trees drawn by Gumbel-top-k from top-k-truncated bigram laws, through the real walk;
  - end to end, medusa and parallelspec on the static runtime at temperature 1 with top-k 2 and 3 ranks at depth
    1 (one of them never drawn): the first tokens follow the target's exact law.
The first two carry a negative control, the walk that tries the invalid children (no mask), which must fail the
same test. (End to end it cannot: on these tiny models the tokens q leaves out are outside p's top-k too, so the
broken walk never accepts one; the verify-level tests give p the wider support that shows the bias.)
And the shape: fill_tree on the device is fill_tree on the host (which drops those nodes) with the same draws."""
import pytest
import torch

import test_mtp_medusa
import test_parallelspec
from nanospec.decoding.trees import draw_tree, drawn_tree_on_device, fill_tree
from nanospec.parts import Models
from nanospec.tree import children, depths, medusa_tree, tree_from_paths
from nanospec.verify import gumbel_top_k, verify_tree_without_replacement_batched, warp, \
    without_replacement_proposals
from test_model import tiny_gpt
from test_verify import empirical_law, node_law, ordered_draws, tv, tv_bound

F64 = torch.float64


def test_drawn_tree_on_device_literal():
    """The docstring's example: depth 1's q allows 2 tokens, so rank 2 at depth 1 is not drawn (-1)."""
    draws = torch.tensor([[4, 1, 3], [2, 0, 1]])
    tokens, parents = drawn_tree_on_device(7, draws, torch.tensor([2, 5]), [(0,), (1,), (2,), (0, 0), (2, 0)])
    assert (tokens.tolist(), parents) == ([7, 4, 1, -1, 2, -1], [-1, 0, 0, 0, 1, 3])  # (2, 0): under a -1


def slow_fill_tree(root, logits, paths, sampling, generator):
    """fill_tree's drawn tree the obvious way, the oracle: the same draws read to the host, the paths whose
    ranks q cannot give dropped, the rest built by tree.medusa_tree."""
    D, width = max(map(len, paths)), max(max(p) for p in paths) + 1
    q = warp(logits[:D], *sampling)  # (D, V)
    draws = gumbel_top_k(q, width, generator).indices.tolist()  # (D, width)
    support = (q > 0).sum(-1).tolist()
    paths = [p for p in paths if all(r < support[d] for d, r in enumerate(p))]
    tokens, parents = medusa_tree(root, draws, paths)
    return tokens, parents, torch.cat([q, torch.zeros_like(q[:1])])[depths(parents)]


@pytest.mark.parametrize("sampling", [(1.0, None, None), (1.0, 2, None), (1.0, 1, None), (0.7, None, 0.6)])
def test_fill_tree_on_device_is_fill_tree_on_the_host(sampling):
    """Same generator state, same draws: the device tree with its -1 nodes removed is the oracle's tree, which
    drops them, node for node, with the same q_draft rows, and so is fill_tree's host tree; and there is a -1
    exactly where a rank passes the support."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=F64)  # (D, V)
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]
    for seed in range(10):
        host = slow_fill_tree(7, logits, paths, sampling, torch.Generator().manual_seed(seed))
        got = fill_tree(7, logits, paths, sampling, True, torch.Generator().manual_seed(seed))
        assert got[:2] == host[:2] and torch.equal(got[2], host[2])
        tokens, parents, q_draft = fill_tree(7, logits, paths, sampling, True, torch.Generator().manual_seed(seed),
                                             on_device=True)
        assert torch.is_tensor(tokens) and len(parents) == len(paths) + 1  # every path, whatever the draws
        keep = [u for u, t in enumerate(tokens.tolist()) if t >= 0]
        index = {u: i for i, u in enumerate(keep)}
        assert ([tokens[u].item() for u in keep], [index.get(parents[u], -1) for u in keep]) == host[:2]
        assert torch.equal(q_draft[keep], host[2])
        support = (warp(logits, *sampling) > 0).sum(-1).tolist()  # (D,)
        drawn = [all(r < support[d] for d, r in enumerate(p)) for p in paths]
        assert [t >= 0 for t in tokens[1:].tolist()] == drawn


# ---------------------------------------------------------------------------------------------------------
# Exactly: one node, V = 5, q truncated to 2 tokens, 3 children (the third never drawn)

P_NODE = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.0], dtype=F64)  # the target's law at the node
Q_NODE = torch.tensor([0.7, 0.0, 0.3, 0.0, 0.0], dtype=F64)  # the drafter's, after top-k 2


def masked_node_law(try_invalid):
    """The law the node emits, summed over every ordered draw of 3 children by Gumbel-top-3 from Q_NODE (only 2
    tokens possible: the third child is a token q gives 0, here each of the 3 such tokens in turn, equally: which
    one Gumbel-top-k's -inf ties give does not matter to the valid walk). The walk tries the first two; the third,
    invalid, only if try_invalid (its without-replacement row is then all zeros: accept_prob is 1 where P > 0)."""
    law = torch.zeros(5, dtype=F64)
    tuples, prob = ordered_draws(Q_NODE, 2)  # (T, 2) every ordered pair, with its probability
    for xs, p_xs in zip(tuples.tolist(), prob.tolist()):
        if p_xs == 0:
            continue
        for outside in (1, 3, 4):
            drawn = torch.tensor(xs + [outside])  # (3,) the three ranks, in draw order
            rows = without_replacement_proposals(Q_NODE, drawn)  # (3, V); row 2 is zeros
            m = 3 if try_invalid else 2
            emitted, _ = node_law(P_NODE, rows[:m], drawn[:m])
            law += p_xs / 3 * emitted
    return law


def test_masked_node_law_is_p_exactly():
    """Skipping the never-drawn child, the node emits p exactly; trying it (the negative control), it does not:
    an all-zero proposal row accepts any token the target allows."""
    assert torch.allclose(masked_node_law(try_invalid=False), P_NODE, rtol=0, atol=1e-12)
    assert tv(masked_node_law(try_invalid=True), P_NODE) > 0.05


# ---------------------------------------------------------------------------------------------------------
# In law: 1e5 two-level trees through the real batched walk

V = 5
LOGITS_P = torch.log(torch.tensor([[4, 3, 2, 1, 1], [1, 5, 1, 2, 1], [2, 1, 1, 1, 5], [3, 3, 1, 1, 2],
                                   [1, 1, 4, 2, 2]], dtype=F64))  # (V, V) bigram target: row a = after token a
LOGITS_Q = torch.log(torch.tensor([[1, 4, 3, 1, 1], [2, 3, 5, 1, 1], [1, 3, 1, 1, 4], [4, 1, 1, 3, 1],
                                   [1, 1, 2, 1, 5]], dtype=F64))  # the drafter's, top sets partly different
SAMPLING_Q = (1.0, 2, None)  # top-k 2: every q allows 2 tokens (p all 5: the residual after rejections keeps
# mass on tokens q never drew, which a walk that tries an invalid child accepts outright)
PARENTS = [-1, 0, 0, 0, 1, 1, 1]  # 3 children of the root, 3 under the first: ranks 2 are never drawn
B = 100_000


def drawn_trees(g):
    """B trees of PARENTS' shape, rooted at token 0: each node's children the Gumbel-top-3 of q at its token,
    valid where the draw is finite (its rank < q's support). Returns tokens (B, N), valid (B, N)."""
    q = warp(LOGITS_Q, *SAMPLING_Q)  # (V, V)
    tokens = torch.zeros(B, len(PARENTS), dtype=torch.long)
    valid = torch.ones(B, len(PARENTS), dtype=torch.bool)
    for u, kids in ((0, [1, 2, 3]), (1, [4, 5, 6])):
        top = gumbel_top_k(q[tokens[:, u]], len(kids), g)  # (B, 3)
        tokens[:, kids], valid[:, kids] = top.indices, torch.isfinite(top.values) & valid[:, u:u + 1]
    return tokens, valid


def first_two_law(walk_valid, g):
    """The empirical law of the first two tokens emitted (the second drawn from the target when only one was)."""
    p, q = warp(LOGITS_P, 1.0), warp(LOGITS_Q, *SAMPLING_Q)  # (V, V)
    tokens, valid = drawn_trees(g)
    assert not valid[:, 3].any() and valid[:, 1:3].all()  # the shape really holds a never-drawn rank
    path, nxt = verify_tree_without_replacement_batched(p[tokens], q[tokens], tokens, PARENTS, g,
                                                        valid if walk_valid else None)
    rows = torch.arange(B)
    first = torch.where(path[:, 0] >= 0, tokens[rows, path[:, 0].clamp(min=0)], nxt)
    second = torch.where(path[:, 1] >= 0, tokens[rows, path[:, 1].clamp(min=0)], nxt)
    second = torch.where(path[:, 0] >= 0, second, torch.multinomial(p[first], 1, generator=g)[:, 0])
    assert (path >= 0).any(), "no guess accepted: the test would check only the target's own tokens"
    return empirical_law(first * V + second, V * V), (p[0][:, None] * p).flatten()  # exact P(a, b) = p0(a) p_a(b)


def test_masked_walk_keeps_the_law():
    got, exact = first_two_law(True, torch.Generator().manual_seed(0))
    assert tv(got, exact) < tv_bound(V * V, B)


def test_walk_that_tries_invalid_children_fails():
    """Negative control: the same trees, the walk without its mask (an invalid child is tried, its zero row
    accepts it wherever the target allows it)."""
    got, exact = first_two_law(False, torch.Generator().manual_seed(0))
    assert tv(got, exact) > tv_bound(V * V, B)


# ---------------------------------------------------------------------------------------------------------
# End to end: the static runtime, temperature 1, top-k 2, three ranks at depth 1

TRUNCATED = (1.0, 2, None)


def medusa_law(n):
    models = Models(target=tiny_gpt(3, **test_mtp_medusa.SAMPLING_MODEL))
    law, accepted = test_mtp_medusa.method_law(models, [1, 2], 2, n, "medusa", TRUNCATED, runtime="static",
                                               tree=test_mtp_medusa.SAMPLING_TREE)  # "0;1;2;...": rank 2 at depth 1
    return law, test_mtp_medusa.exact_law(models.target, [1, 2], 2, TRUNCATED), accepted


def parallelspec_law(n):
    models = test_parallelspec.sampling_models()
    law, accepted = test_parallelspec.sampled_law(models, test_parallelspec.PROMPT, 2, n, TRUNCATED,
                                                  runtime="static", tree="0;1;2;0,0;1,0;0,1")
    return law, test_parallelspec.exact_law(models.target, test_parallelspec.PROMPT, 2, TRUNCATED), accepted


@pytest.mark.parametrize("law_of", [medusa_law, parallelspec_law], ids=["medusa", "parallelspec"])
def test_static_drawn_tree_with_truncation_follows_the_target_law(law_of):
    """First 2 tokens, 25 outcomes, n = 1000: tv_bound 0.125 (a correct run comes out near 0.01). Guesses must be
    accepted often, or the test would check only the target's own tokens."""
    n = 1000
    law, exact, accepted = law_of(n)
    assert tv(law, exact) < tv_bound(25, n)
    assert accepted > n / 8, accepted




# ---------------------------------------------------------------------------------------------------------
# EAGLE's drawn tree on the device (trees.draw_tree on_device): a law at each node that depends on its token

DRAW_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0)]


def bigram_next_q(sampling):
    """A drafter whose law below a node is LOGITS_Q's row at the node's token, warped: next_q for draw_tree
    (tokens a device tensor, -1 where not drawn) and slow_draw_tree (a list)."""
    def next_q(d, level, tokens, parents):
        at = tokens[level].clamp(min=0) if torch.is_tensor(tokens) else torch.tensor([tokens[u] for u in level])
        return warp(LOGITS_Q[at], *sampling)  # (K, V)
    return next_q


def slow_draw_tree(root, paths, q_root, next_q, generator):
    """draw_tree the obvious way, the oracle: level by level, only the drawn nodes asked for their q, each
    level's draws read to the host (a read per level), the undrawn left out at the end."""
    parents, nodes = tree_from_paths(paths)
    N, kids = len(nodes), children(parents)
    tokens, q_draft = [root] + [-1] * (N - 1), q_root.new_zeros(N, q_root.numel())  # (N, V)
    q_draft[0] = q_root
    for d in range(max(map(len, nodes))):
        level = [u for u in range(N) if len(nodes[u]) == d and tokens[u] >= 0 and kids[u]]
        if not level:
            continue
        if d > 0:
            q_draft[level] = next_q(d, level, tokens, parents)
        draws = gumbel_top_k(q_draft[level], max(len(kids[u]) for u in level), generator).indices.tolist()
        for i, u in enumerate(level):  # where q allows fewer tokens than u has children, the rest stay undrawn
            for c, x in zip(kids[u][:int((q_draft[u] > 0).sum())], draws[i]):
                tokens[c] = x
    keep = [u for u in range(N) if tokens[u] >= 0]
    index = {u: i for i, u in enumerate(keep)}
    return [tokens[u] for u in keep], [index.get(parents[u], -1) for u in keep], q_draft[keep]


def test_draw_tree_is_the_slow_oracles_without_truncation():
    """Same generator state, same draws: draw_tree's tree, on the device and on the host, is the slow oracle's."""
    sampling = (1.0, None, None)
    for seed in range(5):
        host = slow_draw_tree(0, DRAW_PATHS, warp(LOGITS_Q[0], *sampling), bigram_next_q(sampling),
                              torch.Generator().manual_seed(seed))
        for on_device in (True, False):
            tokens, parents, q_draft = draw_tree(0, DRAW_PATHS, warp(LOGITS_Q[0], *sampling), bigram_next_q(sampling),
                                                 torch.Generator().manual_seed(seed), on_device=on_device)
            assert (tokens.tolist() if on_device else tokens, parents) == host[:2]
            torch.testing.assert_close(q_draft, host[2], rtol=0, atol=0)


def test_draw_tree_on_device_reads_nothing_and_marks_what_q_cannot_give():
    """top-k 2: rank 2 is never drawn, nor anything under it; siblings are distinct and within their q."""
    from test_host_reads import counting_host_reads
    q = warp(LOGITS_Q, *SAMPLING_Q)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        with counting_host_reads() as counts:
            tokens, parents, q_draft = draw_tree(torch.tensor(0), DRAW_PATHS, q[0], bigram_next_q(SAMPLING_Q), g,
                                                 on_device=True)
        assert not counts
        tokens = tokens.tolist()
        nodes = tree_from_paths(DRAW_PATHS)[1]  # node -> its path of ranks
        for c in range(1, len(tokens)):
            u = parents[c]
            assert (tokens[c] >= 0) == (all(r < 2 for r in nodes[c]))
            if tokens[c] >= 0:
                assert q[tokens[u], tokens[c]] > 0 and torch.equal(q_draft[u], q[tokens[u]])
        assert tokens[1] != tokens[2] and tokens[4] != tokens[5]


def test_draw_tree_on_device_keeps_the_law():
    """5,000 trees of DRAW_PATHS' shape drawn on the device with q truncated (top-k 2), verified together by the
    masked walk against the untruncated bigram target: the first two tokens follow its law (tv_bound(25, n))."""
    n, g = 5_000, torch.Generator().manual_seed(1)
    p, q = warp(LOGITS_P, 1.0), warp(LOGITS_Q, *SAMPLING_Q)
    trees = [draw_tree(0, DRAW_PATHS, q[0], bigram_next_q(SAMPLING_Q), g, on_device=True) for _ in range(n)]
    tokens, q_draft = torch.stack([t[0] for t in trees]), torch.stack([t[2] for t in trees])  # (n, N), (n, N, V)
    path, nxt = verify_tree_without_replacement_batched(p[tokens.clamp(min=0)], q_draft, tokens.clamp(min=0),
                                                        trees[0][1], g, tokens >= 0)
    rows = torch.arange(n)
    first = torch.where(path[:, 0] >= 0, tokens[rows, path[:, 0].clamp(min=0)], nxt)
    second = torch.where(path[:, 1] >= 0, tokens[rows, path[:, 1].clamp(min=0)], nxt)
    second = torch.where(path[:, 0] >= 0, second, torch.multinomial(p[first], 1, generator=g)[:, 0])
    assert (path[:, 1] >= 0).float().mean() > 0.1  # the second level is reached often
    assert tv(empirical_law(first * V + second, V * V), (p[0][:, None] * p).flatten()) < tv_bound(V * V, n)
