"""
The guesses of a tree: which tokens a drafter puts in a tree shape, for the tree methods (medusa, parallelspec's
tree, eagle's drawn tree). The tree structure itself (parents, the mask, the positions) is nanospec/rules/tree.py; the
verify step over a tree is verify_step.py.

A shape is a list of paths of ranks (tree.tree_from_paths): (1, 0) = the second candidate for the token after
the root, then the first candidate below it.
  medusa_tree      fills a shape from each depth's candidates, best first (Medusa's heads' top-k)
  fill_tree        for drafters whose guess at depth d does not depend on the guesses above it (MTP heads,
                   ParallelSpec's masks): each depth's candidates are its top-k, or drawn as draw_tree draws
  draw_tree        for drafters whose law at a node depends on the tokens above it (EAGLE's head): one drafter
                   pass per level, each node's children drawn from its own q
"""
import torch

from nanospec.rules.tree import children, tree_from_paths
from nanospec.rules.verify import gumbel_top_k, warp

# medusa's default: 4 paths chosen by scripts/medusa_tree.py on the trained model (docs/measurements.md); "large"
# is the best 16 paths of the same measurement.
DEFAULT_TREE = [(0,), (1,), (0, 0), (0, 0, 0)]
TREES = {
    "default": DEFAULT_TREE,
    "large": [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1),
              (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)],
    "chain": [(0,) * d for d in range(1, 9)],  # the top-1 chain: what `mtp` verifies, as a tree
    "wide": [(r,) for r in range(10)],  # head 1's top-10 only: ten guesses for one token
}
# A tree is verified in one forward: more nodes cost more than they can accept.
MAX_PATHS = 256
MAX_RANK = 63


def parse_tree(tree, max_depth, vocab_size):
    """A preset name or "0;0,0;1" -> paths sorted by depth (so any prefix of the list is still a tree), no deeper
    than max_depth (the drafter's heads or masks)."""
    if tree in TREES:  # presets reach as deep as the drafter allows
        paths = [p for p in TREES[tree] if len(p) <= max_depth]
    else:
        try:
            paths = [tuple(int(r) for r in p.split(",")) for p in tree.split(";") if p.strip()]
        except ValueError:
            raise ValueError(f"tree {tree!r} is neither a preset ({', '.join(TREES)}) nor paths like '0;0,0;1'")
    if not paths:
        raise ValueError("the tree needs at least one path, e.g. '0' (head 1's top-1)")
    if max(map(len, paths)) > max_depth:
        raise ValueError(f"tree {tree!r} is deeper than the drafter's {max_depth} guesses per step")
    if max(max(p) for p in paths) >= vocab_size:
        raise ValueError(f"tree {tree!r} asks for a rank beyond the vocabulary ({vocab_size} tokens)")
    if len(paths) > MAX_PATHS or max(max(p) for p in paths) > MAX_RANK:
        raise ValueError(f"tree {tree!r} is too large: at most {MAX_PATHS} paths with ranks up to {MAX_RANK}")
    return tree_from_paths(paths)[1][1:]


def medusa_tree(root, candidates, paths):
    """Fill a path tree with guesses: root token, candidates (D, K) = head d's top-K token ids, best first (a
    tensor or lists). Returns (tokens, parents). A node at depth d with rank r holds candidates[d-1][r].
    Example: root 7, candidates [[5, 3], [9, 2]], paths [(0,), (1,), (0, 0)]
             -> tokens [7, 5, 3, 9], parents [-1, 0, 0, 1]      7 -> 5 -> 9
                                                                  \\-> 3
    """
    # BEGIN SOLUTION ex7
    parents, nodes = tree_from_paths(paths)
    cand = candidates.tolist() if torch.is_tensor(candidates) else candidates
    tokens = [int(root)] + [cand[len(node) - 1][node[-1]] for node in nodes[1:]]
    return tokens, parents
    # END SOLUTION ex7


def fill_tree(root, logits, paths, sampling, drawn=False, generator=None):
    """A Medusa-style tree from a drafter whose guess for the token d after the root does not depend on the guesses
    before it (MTP heads, ParallelSpec's masks): logits (D, V), row d-1 for depth d; paths of ranks as in
    medusa_tree ((1, 0) = depth 1's candidate 1, then depth 2's candidate 0).
      top-k (drawn False): candidate r at depth d is the (r+1)-th most likely token of row d-1; the guesses
              are point masses (q_draft None).
      drawn (drawn True): each node's children are draws WITHOUT replacement from warp(row d) (draw_tree, the
              law the same at every node of a depth), in rank order: a path of rank r needs ranks 0..r-1 beside
              it (a skipped draw would leave its sibling verified against the wrong q); a rank beyond what q
              allows (top-k, top-p) has no draw, and its path is left out, with everything under it.
    Example: root 7, paths [(0,), (1,), (0, 0)], top-2 of row 0 = [5, 3], top-1 of row 1 = [9]
             -> tokens [7, 5, 3, 9], parents [-1, 0, 0, 1], q_draft None. Returns (tokens, parents, q_draft)."""
    if not paths:
        return [int(root)], [-1], None
    D = max(map(len, paths))  # the deepest guess
    width = max(max(p) for p in paths) + 1  # candidates per depth
    if not drawn:
        return (*medusa_tree(root, logits[:D].topk(width, dim=-1).indices, paths), None)  # (D, width) best first
    have = set(paths)
    for p in paths:
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in have:
            raise ValueError(f"with drawn guesses tree path {p} needs {p[:-1] + (p[-1] - 1,)} too: rank r is the "
                             f"(r+1)-th draw, and each node's children must be draws 1..m in order")
    parents, nodes = tree_from_paths(paths)
    q = warp(logits[:D], *sampling)  # (D, V) the law of each depth's guesses, whatever the tokens above them
    q_draft = q[[min(len(node), D - 1) for node in nodes]]  # (N, V) row u: the law of u's children (a leaf: unused)
    draws = gumbel_top_k(q_draft, width, generator)  # (N, width) every node's draws at once, each its own
    ids = torch.where(torch.isfinite(draws.values), draws.indices, -1).tolist()  # -1: q ran out; one read
    tokens = [int(root)] + [ids[parents[u]][node[-1]] for u, node in enumerate(nodes) if u]  # rank r: draw r
    return kept(tokens, parents, q_draft)


def draw_tree(root, paths, q_root, next_q, generator=None):
    """A tree of DRAWN guesses with a shape fixed in advance, for a drafter whose law at a node depends on the
    tokens above it (EAGLE's head; fill_tree's laws depend on the depth only): paths = the shape in draw ranks
    (tree.draw_rank_paths); q_root (V,) the drafter's warped law below the root; next_q(d, level, tokens,
    parents) -> (K, V) its warped laws at the nodes `level` (the drawn nodes of depth d that have children in the
    shape), given tokens (None where not drawn) and the shape's parents: one drafter pass per level, one host read
    per level. Each node's children are draws without replacement from its q, in rank order, independent of every
    other node's (traversal verification needs it); where q allows fewer tokens than the shape has children
    (top-k, top-p), the rest are left out, with everything under them. The shape is fixed before any draw and no drawn
    node is pruned for its value, as verify_tree_without_replacement needs.
    Example: root 7, shape [(0,), (1,), (0, 0)]: draws 5, 3 from q_root; then next_q at node 1 (token 5), draw 9
             -> tokens [7, 5, 3, 9], parents [-1, 0, 0, 1], q_draft rows [q_root, q at 5, 0, 0].
    Returns (tokens, parents, q_draft (N, V): the law each node's children were drawn from)."""
    parents, nodes = tree_from_paths(paths)
    N = len(nodes)
    kids = children(parents)  # kids[u] in rank order = draw order
    tokens = [int(root)] + [None] * (N - 1)  # None: not drawn
    q_draft = q_root.new_zeros(N, q_root.numel())  # (N, V)
    q_draft[0] = q_root
    for d in range(max(map(len, nodes))):
        level = [u for u in range(N) if len(nodes[u]) == d and kids[u] and tokens[u] is not None]
        if not level:
            break
        if d > 0:
            q_draft[level] = next_q(d, level, tokens, parents)  # (K, V)
        width = max(len(kids[u]) for u in level)
        draws = gumbel_top_k(q_draft[level], width, generator)  # (K, width) each node's draws, in order
        ids = torch.where(torch.isfinite(draws.values), draws.indices, -1).tolist()  # -1: q ran out; one read
        for i, u in enumerate(level):
            for r, c in enumerate(kids[u]):
                tokens[c] = ids[i][r] if ids[i][r] >= 0 else None
    return kept(tokens, parents, q_draft)


def kept(tokens, parents, q_draft):
    """The drawn part of a tree: every node whose token and ancestors' tokens were drawn (None or -1: not drawn,
    q ran out), renumbered. Returns (tokens, parents, q_draft rows), as draw_tree."""
    drawn = [True] * len(tokens)
    for u, t in enumerate(tokens):  # parents come before their children
        drawn[u] = t is not None and t >= 0 and (u == 0 or drawn[parents[u]])
    keep = [u for u in range(len(tokens)) if drawn[u]]
    if len(keep) == len(tokens):
        return tokens, parents, q_draft
    index = {u: i for i, u in enumerate(keep)}
    return [tokens[u] for u in keep], [index.get(parents[u], -1) for u in keep], q_draft[keep]
