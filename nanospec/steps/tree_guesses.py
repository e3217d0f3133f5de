"""
The guesses of a tree: which tokens a drafter puts in a tree shape, for the tree methods (medusa, parallelspec's
tree, eagle's drawn tree). The tree structure itself (parents, the mask, the positions) is nanospec/rules/tree.py; the
verify step over a tree is verify_step.py.

A shape is a list of paths of ranks (tree.tree_from_paths): (1, 0) = the second candidate for the token after
the root, then the first candidate below it.
  medusa_tree      fills a shape from each depth's candidates, best first (Medusa's heads' top-k)
  fill_tree        for drafters whose guess at depth d does not depend on the guesses above it (MTP heads,
                   ParallelSpec's masks): each depth's candidates are its top-k, or drawn as a DrawnTree
  DrawnTree        a shape filled with draws, each node's children drawn from its own q: all at once (fill_tree),
                   or one depth at a time by a drafter whose law at a node depends on the tokens above it (EAGLE's
                   head: its loop is eagle_tree.grow_sampled_tree)
"""
import torch

from nanospec.rules.tree import rooted, tree_from_paths
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
    before it (MTP heads, ParallelSpec's masks): logits (D, V), row d-1 for depth d (None with no paths); paths of
    ranks as in medusa_tree ((1, 0) = depth 1's candidate 1, then depth 2's candidate 0).
      top-k (drawn False): candidate r at depth d is the (r+1)-th most likely token of row d-1; the guesses
              are point masses (q_draft None).
      drawn (drawn True): each node's children are draws WITHOUT replacement from warp(row d) (a DrawnTree,
              the law the same at every node of a depth), in rank order: a path of rank r needs ranks 0..r-1 beside
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
    tree = DrawnTree(paths)
    q = warp(logits[:D], *sampling)  # (D, V) the law of each depth's guesses, whatever the tokens above them
    rows = [0] + [min(d, D - 1) for d in tree.depth]  # (N,) row u: the law of u's children (a leaf's: unused)
    tree.draw(list(range(-1, len(tree.depth))), q[rows], generator)  # every node's draws at once, each its own
    return tree.result(root)


class DrawnTree:
    """A tree of DRAWN guesses whose shape is fixed before any draw (paths of draw ranks, tree.draw_rank_paths), as
    verify_tree_without_replacement needs: no drawn node is pruned for its value. Each node's children are draws
    without replacement from the law q given for it, in rank order, independent of every other node's (traversal
    verification needs it). Where q allows fewer tokens than the shape has children (top-k, top-p), the rest are
    left undrawn, and out of the tree with everything under them.
    Its nodes are numbered as a drafter grows them (eagle_tree's grow_tree and expand): candidates 0.., the shape's
    nodes in order, parent -1 = the root. A drafter whose law at a node depends on the tokens above it (EAGLE's
    head) draws one depth at a time, in its own loop:
        tree = DrawnTree(paths)
        level = tree.draw([-1], q_root[None], generator)     # the root's children
        while level:                                         # its laws at the drawn nodes of the next depth
            level = tree.draw(level, drafter's q at level (K, V), generator)
        tokens, parents, q_draft = tree.result(root)
    Example: shape [(0,), (1,), (0, 0)]: draws 5, 3 below root 7; then q at candidate 0 (token 5) draws 9
             -> tokens [7, 5, 3, 9], parents [-1, 0, 0, 1], q_draft rows [q_root, q at 5, 0, 0]."""

    def __init__(self, paths):
        parents, nodes = tree_from_paths(paths)  # node u of the shape is candidate u - 1
        self.parents = [p - 1 for p in parents[1:]]  # each candidate's parent, -1: the root
        self.depth = [len(node) for node in nodes[1:]]  # each candidate's depth below the root
        self.tokens = [None] * len(self.parents)  # None: not drawn
        self.kids = {c: [] for c in range(-1, len(self.parents))}  # in rank order = draw order
        for c, p in enumerate(self.parents):
            self.kids[p].append(c)
        self.laws = {}  # candidate (-1: the root) -> the law (V,) its children were drawn from, once given

    def draw(self, level, q, generator=None):
        """Draw the children of the candidates `level` (-1: the root) from their laws q (K, V): one gumbel_top_k
        for all of them, one host read. Returns the next level: the drawn children that have children."""
        self.laws.update(zip(level, q))  # row views, no copy
        draws = gumbel_top_k(q, max(len(self.kids[c]) for c in level), generator)  # (K, width) in draw order
        ids = draws.indices.masked_fill(draws.values == float("-inf"), -1).tolist()  # -1: q ran out; one read
        for i, c in enumerate(level):
            for r, child in enumerate(self.kids[c]):
                self.tokens[child] = ids[i][r] if ids[i][r] >= 0 else None
        return [child for c in level for child in self.kids[c] if self.tokens[child] is not None and self.kids[child]]

    def result(self, root):
        """The drawn part, root at node 0: (tokens, parents, q_draft (N, V), row u = the law u's children were drawn
        from, zeros for a leaf), every node whose token and ancestors' tokens were drawn."""
        keep, drawn = [], {-1}
        for c, t in enumerate(self.tokens):  # parents come before their children
            if t is not None and self.parents[c] in drawn:
                keep.append(c)
                drawn.add(c)
        none = torch.zeros_like(self.laws[-1])  # (V,) a leaf's row: no child drawn from it
        return (*rooted(int(root), self.tokens, self.parents, keep),
                torch.stack([self.laws.get(c, none) for c in [-1] + keep]))
