"""
Trees of guesses from a drafter, for the tree methods (medusa, parallelspec's tree, eagle's drawn tree): the
preset tree shapes, the parser of --tree, and the two ways to fill a shape with tokens. Verifying a tree is
`tree_step.py`; the tree itself (tokens + parents, the mask, the positions) is nanospec/tree.py.

A shape is a list of paths of ranks (tree.tree_from_paths): (1, 0) = the second candidate for the token after
the root, then the first candidate below it.
  fill_tree  for drafters whose guess at depth d does not depend on the guesses above it (MTP heads, ParallelSpec's
             masks): the candidates of each depth are its top-k, or draws without replacement from its q.
  draw_tree  for drafters whose law at a node depends on the tokens above it (EAGLE's head): one drafter pass
             per level, each node's children drawn from its own q.
"""
import torch

from nanospec.tree import children, depths, medusa_tree, tree_from_paths
from nanospec.verify import gumbel_top_k, warp

# medusa's default: 4 paths chosen by scripts/medusa_tree.py on the trained model (docs/measurements.md has the
# figures); "large" is the best 16 paths of the same measurement.
DEFAULT_TREE = [(0,), (1,), (0, 0), (0, 0, 0)]
TREES = {
    "default": DEFAULT_TREE,
    "large": [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1),
              (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)],
    "chain": [(0,) * d for d in range(1, 9)],  # the top-1 chain: what `mtp` verifies, as a tree
    "wide": [(r,) for r in range(10)],  # head 1's top-10 only: ten guesses for one token
}
MAX_PATHS, MAX_RANK = 256, 63  # a tree is verified in one forward: more nodes cost more than they can accept


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


def fill_tree(root, logits, paths, sampling, drawn=False, generator=None, on_device=False):
    """A Medusa-style tree from a drafter whose guess for the token d after the root does not depend on the guesses
    before it (MTP heads, ParallelSpec's masks): logits (D, V), row d-1 for depth d; paths of ranks as in
    tree.medusa_tree ((1, 0) = depth 1's candidate 1, then depth 2's candidate 0).
      top-k (drawn False): candidate r at depth d is the (r+1)-th most likely token of row d-1; the guesses
              are point masses (q_draft None).
      drawn (drawn True): candidate r at depth d is the (r+1)-th of draws WITHOUT replacement from
              warp(row d-1), one set of draws per depth, shared by every node at that depth. Each node's
              children are then draws 0..m-1 from the law q_draft (N, V) gives for it, in draw order. Sharing
              is fine: row d's draws do not depend on the tokens above them, and whichever parent is accepted
              finds a fresh draw below it. A path of rank r needs ranks 0..r-1 beside it (a skipped draw would
              leave its sibling verified against the wrong q), and ranks beyond q's support are left undrawn
              (-1), as is everything under them.
    Example: root 7, paths [(0,), (1,), (0, 0)], top-2 of row 0 = [5, 3], top-1 of row 1 = [9]
             -> tokens [7, 5, 3, 9], parents [-1, 0, 0, 1], q_draft None.
    on_device (the static runtime): tokens come back as a (N,) LongTensor on the device, with no host read, and
    the tree keeps its shape (every path) whatever the draws: the verify never tries a -1 node
    (verify_tree_without_replacement's valid mask; tree_step reads it off the tokens). Otherwise a list, the
    undrawn nodes dropped (`drop_undrawn`). Returns (tokens, parents, q_draft)."""
    if not paths:
        return [int(root)], [-1], None
    D, width = max(map(len, paths)), max(max(p) for p in paths) + 1
    if not drawn:
        top = logits[:D].topk(width, dim=-1).indices  # (D, width) each depth's candidates, best first
        tokens, parents = top_tree_on_device(root, top, paths) if on_device else medusa_tree(root, top, paths)
        return tokens, parents, None
    have = set(paths)
    for p in paths:
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in have:
            raise ValueError(f"with drawn guesses tree path {p} needs {p[:-1] + (p[-1] - 1,)} too: rank r is the "
                             f"(r+1)-th draw, and each node's children must be draws 1..m in order")
    q = warp(logits[:D], *sampling)  # (D, V) the law each depth's candidates are drawn from
    draws = gumbel_top_k(q, width, generator).indices  # (D, width) each row's draws without replacement, in order
    tokens, parents = drawn_tree_on_device(root, draws, (q > 0).sum(-1), paths)  # -1 where q ran out
    q_rows = torch.cat([q, torch.zeros_like(q[:1])])  # (D+1, V): a node at depth d draws from row d; D: none
    tree = tokens, parents, q_rows[depths(parents)]
    return tree if on_device else drop_undrawn(*tree)


def top_tree_on_device(root, candidates, paths):
    """tree.medusa_tree with the tokens left on the device: candidates (D, K) -> ((N,) LongTensor, parents).
    Node of path (.., r) at depth d holds candidates[d-1, r], gathered there."""
    parents, nodes = tree_from_paths(paths)
    device = candidates.device
    at = torch.tensor([[len(n) - 1, n[-1]] for n in nodes[1:]], dtype=torch.long, device=device)  # (N-1, 2)
    root = torch.tensor([int(root)], dtype=torch.long, device=device)  # (1,)
    return torch.cat([root, candidates[at[:, 0], at[:, 1]]]), parents


def drawn_tree_on_device(root, draws, support, paths):
    """top_tree_on_device for drawn candidates, with -1 at the nodes q could not fill: draws (D, K) each depth's
    draws in order, support (D,) how many tokens each depth's q allows. The node of path (r_1, .., r_d) holds
    draws[d-1, r_d] if every r_i < support[i-1], else -1 (its own draw, or one above it, does not exist).
    Example: paths [(0,), (1,), (2,), (0, 0)], draws [[4, 1, 3], [2, ...]], support [2, 5] -> [root, 4, 1, -1, 2]."""
    tokens, parents = top_tree_on_device(root, draws, paths)
    nodes, D = tree_from_paths(paths)[1], draws.size(0)
    ranks = torch.tensor([list(n) + [0] * (D - len(n)) for n in nodes], dtype=torch.long, device=draws.device)  # (N, D)
    drawn = (ranks < support).all(-1)  # (N,) rank 0 pads a short path: every q allows at least one token
    return torch.where(drawn, tokens, -1), parents


def draw_tree(root, paths, q_root, next_q, generator=None, on_device=False):
    """A tree of DRAWN guesses with a shape fixed in advance, for a drafter whose law at a node depends on the
    tokens above it (EAGLE's head): paths = the shape in draw ranks, as tree_from_paths takes them
    (tree.draw_rank_paths); q_root (V,) the drafter's warped law below the root; next_q(d, level, tokens,
    parents) -> (K, V) its warped laws at the nodes `level` (every node of the shape at depth d that has
    children), given tokens (N,), a device tensor with -1 where not drawn (embed tokens.clamp(min=0): the law at
    such a node is never used): one drafter pass per level, no host read. Each node's children are draws without
    replacement from its q, in rank order; where q allows fewer tokens than the shape has children (top-k,
    top-p), the rest stay -1, as does everything under them. The shape is fixed before any draw and no drawn
    node is pruned, as verify_tree_without_replacement needs.
    on_device: the whole shape comes back, tokens a (N,) LongTensor with its -1 nodes, which the verify skips
    (tree_step reads valid = tokens >= 0); else `drop_undrawn`'s host tree. Returns (tokens, parents, q_draft
    (N, V): the law each node's children were drawn from)."""
    parents, nodes = tree_from_paths(paths)
    N, kids, device = len(nodes), children(parents), q_root.device  # kids[u] in rank order = draw order
    tokens = torch.full((N,), -1, dtype=torch.long, device=device)  # (N,) -1: not drawn (yet)
    tokens[0] = root  # an int, or a () tensor on the device (copied there, not read)
    q_draft = q_root.new_zeros(N, q_root.numel())  # (N, V)
    q_draft[0] = q_root
    for d in range(max(map(len, nodes))):
        level = [u for u in range(N) if len(nodes[u]) == d and kids[u]]  # fixed by the shape, not by the draws
        if not level:
            continue
        if d > 0:
            q_draft[level] = next_q(d, level, tokens, parents)
        width = max(len(kids[u]) for u in level)
        draws = gumbel_top_k(q_draft[level], width, generator).indices  # (K, width) each node's draws, in order
        # every child of the level at once: its parent's row i in `level`, its rank r among the parent's children
        child, i, r = zip(*[(c, i, r) for i, u in enumerate(level) for r, c in enumerate(kids[u])])
        child, i, r = (torch.tensor(v, dtype=torch.long, device=device) for v in (child, i, r))
        support = (q_draft[level] > 0).sum(-1)  # (K,) how many tokens each parent's q allows
        filled = (r < support[i]) & (tokens[torch.tensor(level, device=device)[i]] >= 0)  # (children,)
        tokens[child] = torch.where(filled, draws[i, r], -1)
    return (tokens, parents, q_draft) if on_device else drop_undrawn(tokens, parents, q_draft)


def drop_undrawn(tokens, parents, q_draft):
    """A drawn tree with its shape kept (tokens (N,) on the device, -1 where not drawn) -> the tree of its drawn
    nodes on the host, in one read: (tokens, parents renumbered, q_draft rows kept). A drawn node's parent is
    drawn too, so the kept nodes still form a tree. [7, 4, -1, 2], parents [-1, 0, 0, 1] -> [7, 4, 2], [-1, 0, 1]."""
    values = tokens.tolist()  # the one read
    keep = [u for u, t in enumerate(values) if t >= 0]
    index = {u: i for i, u in enumerate(keep)}
    return [values[u] for u in keep], [index.get(parents[u], -1) for u in keep], q_draft[keep]
