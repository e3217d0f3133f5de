"""
Token trees for verification in one forward pass: the attention mask, the position ids and the root-to-node
paths, built from a parent array.

A tree of N nodes is two lists: `tokens[i]` and `parents[i]` (parents[0] = -1: node 0 is the root, the token
the target already chose; every other node's parent comes before it). Example, 4 nodes:

    tokens  [ "(", "x", ")", "self" ]      root "(" -> "x" -> ")"
    parents [  -1,   0,   1,    0   ]           \\-> "self"
    depth   [   0,   1,   2,    1   ]      -> position ids prefix_len + depth = [p, p+1, p+2, p+1]

    mask over the new tokens (1 = may attend; every node also sees the whole cached prefix):
             (  x  )  self
      (      1  .  .  .
      x      1  1  .  .
      )      1  1  1  .
      self   1  .  .  1

Each node then gets exactly the logits a plain forward along its own root-to-node path would give.
"""
import heapq

import torch


def depths(parents):
    d = []
    for i, par in enumerate(parents):
        assert par < i, "a node's parent must come before it"
        d.append(0 if par < 0 else d[par] + 1)
    return d


def children(parents):
    """children[u] = the nodes whose parent is u, in index order. [-1, 0, 0, 1] -> [[1, 2], [3], [], []]."""
    kids = [[] for _ in parents]
    for c in range(1, len(parents)):
        kids[parents[c]].append(c)
    return kids


def path_to(parents, node):
    """Node indices from the root down to `node`, inclusive. [-1, 0, 1, 0], 2 -> [0, 1, 2]."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_mask(parents, prefix_len, device="cpu"):
    """(N, prefix_len + N) bool: each node sees the prefix, its ancestors and itself."""
    # BEGIN SOLUTION ex6
    N = len(parents)
    rows = []  # rows[i][j]: node j is node i or one of its ancestors (built in Python: N is small)
    for i, par in enumerate(parents):
        row = list(rows[par]) if par >= 0 else [False] * N  # a parent's row already holds all its ancestors
        row[i] = True
        rows.append(row)
    prefix = torch.ones(N, prefix_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, torch.tensor(rows, dtype=torch.bool, device=device)], dim=1)
    # END SOLUTION ex6


def frontier_mask(prefix_len, fed, frontier, parent, device="cpu"):
    """The mask of one drafter pass over `frontier`, the newest nodes of a tree the drafter grows pass by pass in
    its own cache (EAGLE's head): the cache holds prefix_len slots, then the nodes fed at earlier passes, node c
    at slot prefix_len + fed[c]. Each frontier node sees the prefix, its fed ancestors and itself; parent[c] < 0
    ends the walk up. The frontier's slots are added to `fed`. Returns (K, prefix_len + F + K) bool (F fed before).
    Example: prefix 2, fed {}, frontier [0, 1] -> [[1, 1, 1, 0], [1, 1, 0, 1]]; then fed {0: 0, 1: 1},
    frontier [2] with parent[2] = 0 -> [[1, 1, 1, 0, 1]]."""
    # BEGIN SOLUTION ex9
    F, K = len(fed), len(frontier)
    rows, cols = [], []
    for i, c in enumerate(frontier):
        fed[c] = F + i
        while c >= 0:  # c, then its ancestors, all fed by now
            rows.append(i)
            cols.append(prefix_len + fed[c])
            c = parent[c]
    mask = torch.zeros(K, prefix_len + F + K, dtype=torch.bool, device=device)
    mask[:, :prefix_len] = True
    mask[rows, cols] = True
    return mask
    # END SOLUTION ex9


def rooted(root, tokens, parents, keep):
    """The tree of `root` and the candidates `keep` of a tree a drafter grew (indices into tokens and parents, in
    order, each one's parent kept before it; parent -1 = the root), as (tokens, parents) with the root at node 0,
    the way tree_step takes a tree. Example: root 7, tokens [5, 3, 9], parents [-1, -1, 0], keep [0, 2]
    -> [7, 5, 9], [-1, 0, 1]."""
    node = {c: i + 1 for i, c in enumerate(keep)}  # candidate c is node i + 1 of the tree
    return [root] + [tokens[c] for c in keep], [-1] + [node.get(parents[c], 0) for c in keep]


def tree_positions(parents, prefix_len, device="cpu"):
    """(N,) position ids: prefix_len + depth."""
    # BEGIN SOLUTION ex6
    return torch.tensor(depths(parents), dtype=torch.long, device=device) + prefix_len
    # END SOLUTION ex6


# ---------------------------------------------------------------------------------------------------------
# Shapes from paths of ranks (Medusa's "medusa_choices", and the shape of a tree of drawn guesses; filling one
# with guesses is steps/tree_guesses.py), and views of any tree: its root-to-leaf paths and printouts.


def tree_from_paths(paths):
    """The layout of a Medusa-style tree: candidate paths -> (parents, nodes).

    A path (i, j, ...) names the node reached by taking head 1's top-(i+1) guess, then head 2's top-(j+1), ...
    (Medusa's "medusa_choices"). Node 0 is the root (); the other nodes are the paths sorted by depth, then
    by rank, so every parent comes before its children. Every prefix of a path must be a path too.
    Example: [(1,), (0, 0), (0,)] -> nodes [(), (0,), (1,), (0, 0)], parents [-1, 0, 0, 1].
    """
    # BEGIN SOLUTION ex7
    nodes = [()] + sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    index = {node: i for i, node in enumerate(nodes)}
    parents = [-1]
    for node in nodes[1:]:
        if not node or min(node) < 0:
            raise ValueError(f"a tree path is a non-empty list of ranks >= 0, got {node}")
        if node[:-1] not in index:
            raise ValueError(f"tree path {node} needs its parent path {node[:-1]} in the tree too")
        parents.append(index[node[:-1]])
    return parents, nodes
    # END SOLUTION ex7


def draw_rank_paths(n, depth, width, accept=0.75):
    """The n nodes of a tree of DRAWN guesses most likely to be reached, as paths of draw ranks for
    tree_from_paths: (0, 1) = the first draw below the root, then the second draw below that one.

    If each draw is accepted with probability `accept`, draw r (0-based) of a node is the one accepted with
    probability accept * (1 - accept)^r (the r before it rejected), and a node is reached with the product of
    these along its path. Best first, at most `width` children per node and `depth` levels. The shape depends
    on ranks only, never on the tokens drawn, so it is fixed before drawing, as verifying drawn children
    needs (verify.verify_tree_without_replacement).
    Example: n 4, depth 2, width 2, accept 0.75: (0,) 0.75, (0, 0) 0.56, (1,) 0.19, (0, 1) 0.14 -> those four."""
    heap, paths = [(-accept, (0,))], []  # (minus the chance of reaching it, path): heapq pops the smallest
    while heap and len(paths) < n:
        minus_reach, path = heapq.heappop(heap)
        paths.append(path)
        if path[-1] + 1 < width:  # the next draw beside it: reached when this one is rejected
            heapq.heappush(heap, (minus_reach * (1 - accept), path[:-1] + (path[-1] + 1,)))
        if len(path) < depth:  # the first draw below it
            heapq.heappush(heap, (minus_reach * accept, path + (0,)))
    return paths


def leaf_paths(parents):
    """Every root-to-leaf path as node indices (Medusa's retrieve_indices, without the padding).
    [-1, 0, 0, 1] -> [[0, 1, 3], [0, 2]]. Each path is one sequence the tree verifies at once."""
    has_child = set(p for p in parents if p >= 0)
    return [path_to(parents, n) for n in range(len(parents)) if n not in has_child]


def format_tree(parents, label, marked=()):
    """The tree as indented text, one node per line, children under their parent; `label(node)` gives the
    text of a node, nodes in `marked` get a '*'. Example, parents [-1, 0, 1, 0], marked {0, 1}:
        * '('
            * 'x'
                  ')'
              'self'
    """
    kids = children(parents)
    lines, stack = [], [(0, 0)]
    while stack:  # depth-first, children in index order
        node, depth = stack.pop()
        lines.append("    " * depth + ("* " if node in marked else "  ") + label(node))
        stack.extend((c, depth + 1) for c in reversed(kids[node]))
    return "\n".join(lines)


def print_verified_tree(title, tokens, parents, path, emitted, tokenizer=None, drawn=False, paths=None,
                        drafter="the heads", guess="head"):
    """One verified step of a tree method, for a student to read (decode.py --show-tree): the guesses of
    `drafter` as a tree, the root and the accepted `path` marked *, then what the step emitted. A guess reads
    `head 2 top-1`: the `guess` word and its depth (medusa's head d guesses depth d), then its rank among the
    candidates below its parent (`draw-1`: drawn first). Ranks come from `paths` when the tree is exactly their
    shape (tree_from_paths: a top-k tree, whose paths may skip a rank), else from each node's place among its
    siblings (drawn children come in draw order; a drawn tree lacks the paths q could not fill)."""
    depth = depths(parents)
    if paths is not None:
        ranks = [node[-1] if node else 0 for node in tree_from_paths(paths)[1]]
    else:
        ranks = [0] * len(parents)
        for kids in children(parents):
            for r, c in enumerate(kids):
                ranks[c] = r

    def text(t):
        return f"'{tokenizer.show(t)}'" if tokenizer is not None else str(t)

    def label(n):
        if n == 0:
            return f"{text(tokens[0])}  (root: the target's own token)"
        return f"{text(tokens[n])}  {guess} {depth[n]} {'draw' if drawn else 'top'}-{ranks[n] + 1}"

    print(f"{title}: {len(tokens) - 1} guesses from {drafter}; * = kept by the target")
    print(format_tree(parents, label, marked={0, *path}))
    print(f"-> accepted {len(path)}, emitted {' '.join(map(text, emitted))} (the last is the target's own)\n")
