"""
The verify step every tree method shares (medusa, and the later eagle, parallelspec, lookahead): the tree
analogue of `chain_step` in common.py. However the tree was built, it is `tokens` + `parents` (nanospec/tree.py):
node 0 is the root, the newest emitted token (not yet in the cache), every other node a guess under its parent.

One target forward runs over all N nodes at once; the tree mask lets each node see only the cached prefix and
its own ancestors, and its position id is prefix + depth, so every node gets exactly the logits a plain forward
along its own root-to-node path would give. Then a tree rule picks the accepted path, the cache keeps the
prefix + that path (`compact`), and the emitted tokens are the accepted guesses plus the target's next token.

    cache = [.. prefix ..]   tree: root "(" -> "x" -> ")"     target argmax after "(" is "x", after "x" is ","
                                        \\-> "self"
    -> path [x], emitted ["x", ","], cache = [.. prefix .., "(", "x"]; "," is the next root.

The lossless rule is the tree point-mass rule (verify.verify_tree_point_mass: at each node accept child x with
probability P(x), on rejection remove x from P and try the next sibling). verify.verify_tree_descend computes
the same law the cheap way, "draw y ~ p at the node, step into the child whose token is y, stop when there is none",
which costs one draw per accepted level instead of a few tensor operations per child tried; the tests check
it against verify_tree_point_mass (exactly under greedy, in law when sampling).

When sampling, a drafter with a distribution may instead DRAW its guesses from its own warped q_draft (the
methods' --draft-sampling sample): each node's children are draws without replacement from q at that node, and
the tree is verified with verify.verify_tree_without_replacement, recursive rejection sampling against those q.
The target's law is kept either way; drawn children are accepted far more often when the target's law is flat.
`fill_tree` builds both kinds of tree for drafters that guess every depth at once (medusa, parallelspec).
"""
import torch

from nanospec.decoding.common import tensor
from nanospec.tree import children, depths, medusa_tree, tree_from_paths, tree_mask, tree_positions
from nanospec.verify import (sample_without_replacement, typical_accept, verify_tree_descend, verify_tree_greedy,
                             verify_tree_without_replacement, warp)

RULES = ("point-mass", "typical")  # lossless (greedy = its one-hot case), and Medusa's LOSSY typical acceptance


def tree_step(run, target, cache, tokens, parents, sampling, rule="point-mass", heads=False, q_draft=None):
    """One tree verify step. tokens, parents: the tree (tokens[0] = the root = the last emitted token);
    sampling: (temperature, top_k, top_p); rule: "point-mass" (lossless) or "typical" (lossy, see verify.py);
    q_draft (N, V): for a tree whose children were DRAWN, the law node u's children were drawn from (without
    replacement, in index order); it is then verified with verify_tree_without_replacement (lossless) instead.

    Returns (emitted, path, out): emitted = the accepted guesses + the target's next token; path = the accepted
    node indices (root excluded), so the last accepted node is path[-1] if path else 0; out = the forward's
    Output (out.hidden[:, node] is the trunk state there, for drafting the next tree).
    Afterwards the cache holds the prefix, the root and the accepted guesses; the next token is not in it yet.
    """
    prefix = cache.length
    device = cache.k.device
    out = target(tensor(tokens, device), pos=tree_positions(parents, prefix, device), cache=cache,
                 mask=tree_mask(parents, prefix, device), heads=heads)  # logits (1, N, V)
    if rule not in RULES:
        raise ValueError(f"unknown tree rule {rule!r}; choose one of: {', '.join(RULES)}")
    if sampling[0] == 0:  # greedy: every rule reduces to "follow the argmax"; skip building p
        path, nxt = verify_tree_greedy(out.logits[0], tokens, parents)
    else:
        p_target = warp(out.logits[0], *sampling)  # (N, V): the target's law after each node's own path
        if q_draft is not None:  # drawn children: recursive rejection sampling against the q they came from
            path, nxt = verify_tree_without_replacement(p_target, q_draft, torch.tensor(tokens, device=device), parents,
                                                        run.generator)
        elif rule == "point-mass":
            path, nxt = verify_tree_descend(p_target, tokens, parents, run.generator)
        else:
            path, nxt = typical_accept(p_target, torch.tensor(tokens, device=device), parents, generator=run.generator)
    # the forward wrote all N nodes after the prefix; keep the root and the accepted path, in order
    cache.compact(list(range(prefix)) + [prefix + n for n in [0] + path])
    return [tokens[n] for n in path] + [int(nxt)], path, out


def fill_tree(root, logits, paths, sampling, sampled=False, generator=None):
    """A Medusa-style tree from a drafter whose guess for the token d after the root does not depend on the guesses
    before it (MTP heads, ParallelSpec's masks): logits (D, V), row d-1 for depth d; paths of ranks as in
    tree.medusa_tree ((1, 0) = depth 1's candidate 1, then depth 2's candidate 0).
      topk    (sampled False): candidate r at depth d is the (r+1)-th most likely token of row d-1; the guesses
              are point masses (q_draft None).
      sample  (sampled True): candidate r at depth d is the (r+1)-th of draws WITHOUT replacement from
              warp(row d-1), one set of draws per depth, shared by every node at that depth. Each node's
              children are then draws 0..m-1 from the law q_draft (N, V) gives for it, in draw order. Sharing
              is fine: row d's draws do not depend on the tokens above them, and whichever parent is accepted
              finds a fresh draw below it. A path of rank r needs ranks 0..r-1 beside it (a skipped draw would
              leave its sibling verified against the wrong q), and ranks beyond q's support are dropped.
    Example: root 7, paths [(0,), (1,), (0, 0)], top-2 of row 0 = [5, 3], top-1 of row 1 = [9]
             -> tokens [7, 5, 3, 9], parents [-1, 0, 0, 1], q_draft None.
    Returns (tokens, parents, q_draft)."""
    if not paths:
        return [int(root)], [-1], None
    D, width = max(map(len, paths)), max(max(p) for p in paths) + 1
    if not sampled:
        tokens, parents = medusa_tree(root, logits[:D].topk(width, dim=-1).indices, paths)
        return tokens, parents, None
    have = set(paths)
    for p in paths:
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in have:
            raise ValueError(f"with sampled drafts tree path {p} needs {p[:-1] + (p[-1] - 1,)} too: rank r is the "
                             f"(r+1)-th draw, and each node's children must be draws 1..m in order")
    q = warp(logits[:D], *sampling)  # (D, V) the law each depth's candidates are drawn from
    support = (q > 0).sum(-1).tolist()  # top-k / top-p may leave fewer tokens than the tree has ranks
    paths = [p for p in paths if all(r < support[d] for d, r in enumerate(p))]
    drawn = [sample_without_replacement(q[d], min(width, support[d]), generator).tolist() for d in range(D)]
    tokens, parents = medusa_tree(root, drawn, paths)
    q_rows = torch.cat([q, torch.zeros_like(q[:1])])  # (D+1, V): a node at depth d draws from row d; D: none
    return tokens, parents, q_rows[depths(parents)]


def draw_tree(root, paths, q_root, next_q, generator=None):
    """A tree of DRAWN guesses with a shape fixed in advance, for a drafter whose law at a node depends on the
    tokens above it (EAGLE's head): paths = the shape in draw ranks, as tree_from_paths takes them
    (tree.draw_rank_paths); q_root (V,) the drafter's warped law below the root; next_q(d, level, tokens,
    parents) -> (K, V) its warped laws at the nodes `level` (indices into the shape, all at depth d, every
    token above them drawn): one drafter pass per level. Each node's children are draws without replacement
    from its q, in rank order; where q allows fewer tokens than the shape has children, the rest are left out.
    The shape is fixed before any draw and no drawn node is pruned, as verify_tree_without_replacement needs.
    Returns (tokens, parents, q_draft (N, V): the law each node's children were drawn from)."""
    parents, nodes = tree_from_paths(paths)
    N, kids = len(nodes), children(parents)  # kids[u] in rank order = draw order
    tokens = [int(root)] + [-1] * (N - 1)  # -1: not drawn
    q_draft = q_root.new_zeros(N, q_root.numel())  # (N, V)
    q_draft[0] = q_root
    for d in range(max(map(len, nodes))):
        level = [u for u in range(N) if len(nodes[u]) == d and tokens[u] >= 0 and kids[u]]
        if d > 0 and level:
            q_draft[level] = next_q(d, level, tokens, parents)
        for u in level:
            m = min(len(kids[u]), int((q_draft[u] > 0).sum()))
            for c, x in zip(kids[u], sample_without_replacement(q_draft[u], m, generator).tolist()):
                tokens[c] = x
    keep = [u for u in range(N) if tokens[u] >= 0]
    index = {u: i for i, u in enumerate(keep)}
    return [tokens[u] for u in keep], [index.get(parents[u], -1) for u in keep], q_draft[keep]
