"""Which tokens fill a tree (nanospec/steps/tree_guesses.py): fill_tree (guesses whose law depends on the depth
only: MTP heads, ParallelSpec's masks) and a DrawnTree filled one depth at a time (a law at each node that depends on
the tokens above it: EAGLE's head; toys.draw_tree runs its loop as eagle's does), held to slow host oracles and,
drawn, to the target's law once verified.

  - top-k: fill_tree's candidate r at depth d is the (r+1)-th most likely token of its row (a sort, the oracle);
  - drawn: with the same generator state, fill_tree and draw_tree give the slow oracle's tree node for node, with
    the same q_draft rows, whatever top-k / top-p leave of q: a rank beyond q's support has no draw, and its node
    is left out with everything under it; a shape that skips a rank is a one-line ValueError; one host read per
    level;
  - law: leaving an undrawn node out is exactly what keeps the law. Exactly, by enumeration at one node (laws.py's
    node_law over every ordered draw); and in law, first two tokens of a thousand truncated trees from both
    builders through verify_tree_without_replacement and verify_tree_traversal against a bigram target. The
    negative control keeps the undrawn nodes in the tree (a builder that trusts every draw, even one q could not
    give): its zero proposal row accepts whatever the target allows, and both tests see it.
End to end (medusa, parallelspec and eagle with truncated drawn trees): tests/test_runtime.py, on the static path."""
import pytest
import torch

from nanospec.steps import tree_guesses
from nanospec.steps.options import Sampling
from nanospec.steps.tree_guesses import fill_tree
from nanospec.rules.tree import children, tree_from_paths
from nanospec.rules.verify import (gumbel_top_k, host_path, verify_tree_traversal, verify_tree_without_replacement, warp,
                             without_replacement_proposals)
from nanospec.bench.timing import counting_host_reads
from laws import empirical_law, node_law, ordered_draws, tv, tv_bound
from toys import draw_tree

F64 = torch.float64
V = 5
LOGITS_P = torch.log(torch.tensor([[4, 3, 2, 1, 1], [1, 5, 1, 2, 1], [2, 1, 1, 1, 5], [3, 3, 1, 1, 2],
                                   [1, 1, 4, 2, 2]], dtype=F64))  # (V, V) bigram target: row a = after token a
LOGITS_Q = torch.log(torch.tensor([[1, 4, 3, 1, 1], [2, 3, 5, 1, 1], [1, 3, 1, 1, 4], [4, 1, 1, 3, 1],
                                   [1, 1, 2, 1, 5]], dtype=F64))  # the drafter's, top sets partly different
TRUNCATED = Sampling(1.0, 2, None)  # top-k 2: every q allows 2 tokens, so a rank 2 is never drawn
FILL_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0), (0, 0, 1)]
DRAW_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0)]


# ---------------------------------------------------------------------------------------------------------
# The oracles


def slow_top_tree(root, logits, paths):
    """fill_tree's top-k tree the obvious way: sort each row's tokens, most likely first, and read off ranks."""
    ranked = [sorted(range(len(row)), key=lambda t: -row[t]) for row in logits.tolist()]  # (D, V)
    parents, nodes = tree_from_paths(paths)
    return [root] + [ranked[len(node) - 1][node[-1]] for node in nodes[1:]], parents


def slow_draw_tree(root, paths, q_root, next_q, generator):
    """draw_tree the obvious way: level by level, only the drawn nodes asked for their q, each level's draws read
    to the host; a node gets a draw only if its rank is below its parent q's support (the count of tokens q
    allows); the undrawn are left out at the end."""
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


def slow_fill_tree(root, paths, q, generator):
    """fill_tree's drawn tree the obvious way: node by node in index order (the leaves too: fill_tree draws for
    every node at once, row after row of one generator), width draws of the node's depth's law q[d] (D, V); a
    child of rank r gets draw r if r is below that q's support and its parent was drawn; the undrawn are left out
    at the end. Returns (tokens, parents, q_draft) with q_draft's row u = q at u's depth (the deepest for a leaf)."""
    parents, nodes = tree_from_paths(paths)
    N, kids, D = len(nodes), children(parents), q.size(0)
    width = max(node[-1] for node in nodes[1:]) + 1
    q_draft = torch.stack([q[min(len(node), D - 1)] for node in nodes])  # (N, V)
    tokens = [root] + [-1] * (N - 1)
    for u in range(N):
        draws = gumbel_top_k(q_draft[u], width, generator).indices.tolist()  # (width,)
        for c, x in zip(kids[u][:int((q_draft[u] > 0).sum())], draws):
            tokens[c] = x if tokens[u] >= 0 else -1
    keep = [u for u in range(N) if tokens[u] >= 0]
    index = {u: i for i, u in enumerate(keep)}
    return [tokens[u] for u in keep], [index.get(parents[u], -1) for u in keep], q_draft[keep]


def bigram_next_q(sampling):
    """A drafter whose law below a node is LOGITS_Q's row at the node's token, warped: next_q for draw_tree."""
    def next_q(d, level, tokens, parents):
        return warp(LOGITS_Q[torch.tensor([tokens[u] for u in level])], *sampling)  # (K, V)
    return next_q


def depth_next_q(q):
    """fill_tree's drafter as draw_tree sees it: row d of q (D, V) at every node of depth d."""
    return lambda d, level, tokens, parents: q[d].expand(len(level), -1)  # (K, V)


# ---------------------------------------------------------------------------------------------------------
# fill_tree and draw_tree against the oracles


def test_fill_tree_top_k_literal_and_against_a_sort():
    """The docstring's example, then random rows: candidate r at depth d is row d-1's (r+1)-th best token."""
    logits = torch.full((2, 12), -5.0, dtype=F64)
    logits[0, [5, 3]], logits[1, 9] = torch.tensor([2.0, 1.0], dtype=F64), 3.0  # top-2 of row 0 = [5, 3]
    assert fill_tree(7, logits, [(0,), (1,), (0, 0)], Sampling(1.0)) == ([7, 5, 3, 9], [-1, 0, 0, 1], None)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        logits = torch.randn(3, 6, generator=g, dtype=F64)  # (D, V)
        assert fill_tree(7, logits, FILL_PATHS, Sampling(1.0)) == (*slow_top_tree(7, logits, FILL_PATHS), None)
    assert fill_tree(7, logits, [], Sampling(1.0), drawn=True) == ([7], [-1], None)


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, 2), Sampling(1.0, 1), Sampling(0.7, None, 0.6)])
def test_drawn_fill_tree_is_the_oracles(sampling):
    """Same generator state, same draws: fill_tree's drawn tree is the slow oracle's (the depth's law at every
    node, drawn node by node), node for node and row for row; and a node is in it exactly when every rank on its path is below the
    support of its depth's q (top-k 1 leaves only the chain of first draws)."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=F64)  # (D, V)
    q = warp(logits, *sampling)  # (D, V)
    support = (q > 0).sum(-1).tolist()  # (D,) tokens each depth's q allows
    kept = [()] + [p for p in FILL_PATHS if all(r < support[d] for d, r in enumerate(p))]
    for seed in range(10):
        expected = slow_fill_tree(7, FILL_PATHS, q, torch.Generator().manual_seed(seed))
        tokens, parents, q_draft = fill_tree(7, logits, FILL_PATHS, sampling, True, torch.Generator().manual_seed(seed))
        assert (tokens, parents) == expected[:2] and torch.equal(q_draft, expected[2])
        assert parents == tree_from_paths(kept[1:])[0]  # the shape: the paths q can give, whatever was drawn
        for u in range(1, len(tokens)):  # siblings distinct, each a token its q allows
            sibling_tokens = [tokens[c] for c in range(1, len(tokens)) if parents[c] == parents[u]]
            assert len(set(sibling_tokens)) == len(sibling_tokens) and q_draft[parents[u], tokens[u]] > 0


@pytest.mark.parametrize("sampling", [Sampling(1.0), TRUNCATED, Sampling(0.9, None, 0.7)])
def test_draw_tree_is_the_oracles(sampling):
    q_root = warp(LOGITS_Q[0], *sampling)
    for seed in range(10):
        expected = slow_draw_tree(0, DRAW_PATHS, q_root, bigram_next_q(sampling), torch.Generator().manual_seed(seed))
        tokens, parents, q_draft = draw_tree(0, DRAW_PATHS, q_root, bigram_next_q(sampling),
                                             torch.Generator().manual_seed(seed))
        assert (tokens, parents) == expected[:2]
        torch.testing.assert_close(q_draft, expected[2], rtol=0, atol=0)


def test_draw_tree_under_top_k_2_leaves_out_rank_2_and_what_is_under_it():
    """Every q allows 2 tokens: the shape's rank-2 nodes are never drawn; the rest always are, each node's
    children distinct tokens its own q allows, and q_draft[u] the drafter's law at u's token."""
    q = warp(LOGITS_Q, *TRUNCATED)  # (V, V)
    g = torch.Generator().manual_seed(0)
    drawn_shape = tree_from_paths([p for p in DRAW_PATHS if 2 not in p])[0]
    for _ in range(20):
        tokens, parents, q_draft = draw_tree(0, DRAW_PATHS, q[0], bigram_next_q(TRUNCATED), g)
        assert parents == drawn_shape
        for u, t in enumerate(tokens):
            kids = [tokens[c] for c in range(len(tokens)) if parents[c] == u]
            if kids:  # (a leaf's row stays zero: nothing was drawn from it)
                assert torch.equal(q_draft[u], q[t])
                assert len(set(kids)) == len(kids) and all(q[t, x] > 0 for x in kids)


def test_drawn_ranks_must_come_in_order():
    """Rank r is the (r+1)-th draw: a shape with rank 2 but not rank 1 beside it would verify the draw after a
    skipped one against the wrong q. (Top-k candidates have no such order: any ranks will do.)"""
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    for paths, missing in [([(0,), (2,)], r"\(1,\)"), ([(0,), (0, 1)], r"\(0, 0\)")]:
        with pytest.raises(ValueError, match=f"needs {missing} too"):
            fill_tree(7, logits, paths, Sampling(1.0), drawn=True)
        tokens, parents, _ = fill_tree(7, logits, paths, Sampling(1.0))
        assert len(tokens) == 3


def test_one_host_read_per_level():
    """draw_tree reads each level's draws once (the drafter's own passes aside); fill_tree, whose laws do not depend
    on the tokens above, reads its drawn tree once in all, as its top-k tree."""
    q = warp(LOGITS_Q, *TRUNCATED)
    cases = [(lambda g: draw_tree(0, DRAW_PATHS, q[0], depth_next_q(q), g), 3),  # 3 levels with children
             (lambda g: fill_tree(0, LOGITS_Q[:3], FILL_PATHS, TRUNCATED, True, g), 1),
             (lambda g: fill_tree(0, LOGITS_Q[:3], FILL_PATHS, TRUNCATED, False, g), 1)]
    for build, reads in cases:
        with counting_host_reads() as counts:
            build(torch.Generator().manual_seed(0))
        assert sum(counts.values()) == reads, counts


# ---------------------------------------------------------------------------------------------------------
# Exactly: one node, q truncated to 2 tokens, 3 children in the shape (the third never drawn)

P_NODE = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.0], dtype=F64)  # the target's law at the node
Q_NODE = torch.tensor([0.7, 0.0, 0.3, 0.0, 0.0], dtype=F64)  # the drafter's, after top-k 2


def node_law_with_the_third_child(kept):
    """The law the node emits, summed over every ordered draw of the two children q can give. The shape's third
    child has no draw: left out (kept False), the walk tries the two drawn children; kept (the negative control)
    it holds some token q gives 0, each of the three in turn, equally likely, tried against its proposal row,
    which is all zeros (nothing left to draw): accept_prob is 1 wherever P > 0."""
    law = torch.zeros(5, dtype=F64)
    tuples, prob = ordered_draws(Q_NODE, 2)  # (T, 2) every ordered pair, with its probability
    for xs, p_xs in zip(tuples.tolist(), prob.tolist()):
        if p_xs == 0:
            continue
        for outside in (1, 3, 4):
            drawn = torch.tensor(xs + [outside])  # (3,) in draw order
            rows = without_replacement_proposals(Q_NODE, drawn)  # (3, V); row 2 is zeros
            m = 3 if kept else 2
            law += p_xs / 3 * node_law(P_NODE, rows[:m], drawn[:m])[0]
    return law


def test_leaving_the_undrawn_child_out_keeps_p_exactly():
    assert torch.allclose(node_law_with_the_third_child(kept=False), P_NODE, rtol=0, atol=1e-12)
    assert tv(node_law_with_the_third_child(kept=True), P_NODE) > 0.05  # the negative control


# ---------------------------------------------------------------------------------------------------------
# In law: truncated trees from both builders, verified, against a bigram target

P = warp(LOGITS_P, 1.0)  # (V, V) the target's law after each token: all 5 tokens possible, q allows 2
RULES = {"without-replacement": lambda *args: host_path(*verify_tree_without_replacement(*args)),  # tree_step's read
         "traversal": verify_tree_traversal}


def build(builder, g):
    """One truncated tree rooted at token 0: fill_tree's (depth laws = LOGITS_Q rows 0, 1, 2) or draw_tree's."""
    if builder == "fill":
        return fill_tree(0, LOGITS_Q[:3], FILL_PATHS, TRUNCATED, True, g)
    return draw_tree(0, DRAW_PATHS, warp(LOGITS_Q[0], *TRUNCATED), bigram_next_q(TRUNCATED), g)


def first_two_law(builder, rule, n, seed=0):
    """The empirical law of the first two tokens emitted after root 0 (25 outcomes): the accepted path's first two,
    else the target's next token (and a fresh draw of the target after it when nothing was accepted). Also
    returns how often a guess was accepted."""
    g, codes, accepted = torch.Generator().manual_seed(seed), [], 0
    for _ in range(n):
        tokens, parents, q_draft = build(builder, g)
        path, nxt = RULES[rule](P[tokens], q_draft, tokens, parents, g)  # p_target (N, V): P at each node's token
        emitted = [tokens[u] for u in path] + [nxt]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(P[emitted[0]], 1, generator=g)))
        codes.append(emitted[0] * V + emitted[1])
        accepted += bool(path)
    return empirical_law(torch.tensor(codes), V * V), accepted / n


EXACT = (P[0][:, None] * P).flatten()  # (25,) P(a, b) = p(a | 0) p(b | a)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("builder", ["fill", "draw"])
def test_truncated_drawn_trees_keep_the_law(builder, rule):
    """n = 1000: tv_bound(25, 1000) = 0.125; a correct run comes out near half of it. About 45% of the trees
    have a guess accepted. (It drew 1500, bound 0.102: the builder that keeps undrawn nodes, below, comes out
    near 0.35 and 0.7, far above either bound, at a third of that.)"""
    n = 1000
    law, accepted = first_two_law(builder, rule, n)
    assert tv(law, EXACT) < tv_bound(V * V, n)
    assert accepted > 0.3, accepted  # the guesses, not only the target's own tokens, made the law


def keeps_undrawn_nodes(probs, k, generator=None):
    """gumbel_top_k as a builder that trusts every draw would see it: the ranks past q's support look drawn."""
    top = gumbel_top_k(probs, k, generator)
    return torch.return_types.topk((top.values.nan_to_num(neginf=0.0), top.indices))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("builder", ["fill", "draw"])
def test_a_builder_that_keeps_undrawn_nodes_is_caught(builder, rule, monkeypatch):
    """Negative control: the same trees with their undrawn nodes kept. n = 500: bound 0.177; this comes out
    near 0.35 root down and 0.7 leaves up."""
    monkeypatch.setattr(tree_guesses, "gumbel_top_k", keeps_undrawn_nodes)
    n = 500
    tokens, _, _ = build(builder, torch.Generator().manual_seed(0))
    assert len(tokens) == len((FILL_PATHS if builder == "fill" else DRAW_PATHS)) + 1  # every node kept
    law, _ = first_two_law(builder, rule, n)
    assert tv(law, EXACT) > tv_bound(V * V, n)
