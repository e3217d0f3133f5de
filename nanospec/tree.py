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
import torch


def depths(parents):
    d = []
    for i, par in enumerate(parents):
        assert par < i, "a node's parent must come before it"
        d.append(0 if par < 0 else d[par] + 1)
    return d


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


def tree_positions(parents, prefix_len, device="cpu"):
    """(N,) position ids: prefix_len + depth."""
    # BEGIN SOLUTION ex6
    return torch.tensor(depths(parents), dtype=torch.long, device=device) + prefix_len
    # END SOLUTION ex6


# ---------------------------------------------------------------------------------------------------------
# Building trees. Medusa-style trees come from a fixed list of paths filled with each head's top-k guesses;
# other drafters (EAGLE, lookahead) build tokens + parents their own way. `leaf_paths` and `format_tree` work
# on any tree.


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


def medusa_tree(root, candidates, paths):
    """Fill a path tree with guesses: root token, candidates (D, K) = head d's top-K token ids, best first.
    Returns (tokens, parents). A node at depth d with rank r holds candidates[d-1, r].
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
    children = [[] for _ in parents]
    for n, p in enumerate(parents):
        if p >= 0:
            children[p].append(n)
    lines, stack = [], [(0, 0)]
    while stack:  # depth-first, children in index order
        node, depth = stack.pop()
        lines.append("    " * depth + ("* " if node in marked else "  ") + label(node))
        stack.extend((c, depth + 1) for c in reversed(children[node]))
    return "\n".join(lines)
