"""
Reference rules: slow oracles that no decoding method runs. The tests prove them exact (on 1e5 rows at once, by
exact enumeration) and hold the rules of nanospec/rules/verify.py to them, as micrograd checks its fast path against a
slow one.

  verify_tree_point_mass   the tree point-mass rule written as rejections, q = one_hot(x) at every child: what
                           verify.verify_tree_descend computes by "draw y ~ p, step into the child holding y"
  verify_tree_sampled      a tree whose children are i.i.d. samples from q (SpecInfer, arXiv 2305.09781); no
                           method draws with replacement (a drawn tree's children are distinct: verify.py's
                           verify_tree_without_replacement)

Both are `walk_tree` below with the law each child was drawn from, over leading dimensions: one tree, or B trees
of one shape. walk_tree is the obvious walk, one child slot at a time, and independent of verify.py's tree rules:
verify.verify_tree_without_replacement (which judges every node's children at once) is held to it by the tests.
It shares only the two pieces every rule is made of, verify.accept_prob and verify.residual, which exercise 3's
tests prove exact on their own.
"""
import torch

from nanospec.rules.verify import accept_prob, point_mass, residual, sample, tree_lists


def verify_tree_point_mass(p_target, tokens, parents, generator=None):
    """Lossless verification of a tree of deterministic drafts (top-k trees: Medusa, EAGLE-2/3), as rejections.

    tokens (..., N) (a list for one tree), parents (N,) with parents[0] == -1: node 0 is the root, a fixed token.
    p_target (..., N, V): the target's distribution of the NEXT token after each node.
    At node u: P = p_target[u]; for each child c in index order accept with prob P[x_c] / sum(P) (q = one_hot(x_c):
    min(1, P(x_c)/q(x_c)) = P(x_c)); on rejection set P[x_c] = 0 and renormalise (a duplicate token then has
    P = 0 and is skipped). Descend into an accepted child; if none is accepted, emit a sample from P. This is the
    chain's point-mass rule at every node, and it is the same as "draw y ~ p_u, descend if y is a child": the
    total acceptance at u is the sum of its children's p. Returns path (..., D) padded with -1 (the accepted
    nodes, root excluded, in order) and next_token (...).
    Example (greedy): tokens [0, 5, 8, 9, 7], parents [-1, 0, 0, 1, 1], target argmax after nodes
    0..4 = [8, 1, 7, 4, 2] -> node 1 (5) rejected, node 2 (8) accepted, it has no children -> path [2], next 7.
    """
    tokens = torch.as_tensor(tokens, device=p_target.device).expand(p_target.shape[:-1])  # (..., N)
    return walk_tree(p_target, point_mass(tokens, p_target), tokens, parents, generator)  # a guess: q = one_hot


def verify_tree_sampled(p_target, q_draft, tokens, parents, generator=None):
    """Lossless verification of a tree whose children were drawn i.i.d. from q at their parent (with
    replacement): SpecInfer's multi-step speculative sampling, i.e. recursive rejection sampling.

    p_target, q_draft (..., N, V): the target's next-token distribution after each node, and the draft
    distribution node u's children were drawn from. tokens (..., N), parents (N,) as in verify_tree_point_mass.
    At node u: P = p_target[u]; for each child c in order accept with prob min(1, P(x_c) / q_u(x_c)); on
    rejection P = norm(max(0, P - q_u)). If none is accepted, emit a sample from P.
    Only valid when the children really are samples of q_u: for top-k children use verify_tree_point_mass
    (feeding a top-k tree here with the draft's softmax as q biases the output).
    Example: p_0 = [0.2, 0.8], q_0 = [0.6, 0.4], two children both token 0: the first is accepted with prob 1/3;
    after a rejection P = [0, 1], so the second has prob 0 and the emitted token is 1.
    Returns path (..., D) padded with -1 and next_token (...), as verify_tree_point_mass.
    """
    tokens = torch.as_tensor(tokens, device=p_target.device).expand(p_target.shape[:-1])  # (..., N)
    parent = torch.tensor([0] + [int(v) for v in parents][1:], device=p_target.device)  # (N,) the root's: unused
    return walk_tree(p_target, q_draft[..., parent, :], tokens, parents, generator)  # child c: its parent's q


def walk_tree(p_target, q_child, tokens, parents, generator=None):
    """The walk of the lossless tree rules, root down, on one tree or B trees of one shape.

    p_target (..., N, V): the target's law after each node; q_child (..., N, V): row c is the q child c's token was
    drawn from (point_mass(tokens, p) for guesses; row 0, the root, unused); tokens (..., N); parents (N,).
    At each node, from P = p_target[node]: try the children in index order, accepting child c with
    accept_prob(P, q_c, x_c) = min(1, P(x_c) / q_c(x_c)); after a rejection P <- residual(P, q_c). Descend into
    an accepted child; when none is accepted (or at a leaf) emit a sample of P.
    Returns path (..., D) with -1 after the last accepted node (D = the tree's depth), next_token (...).
    """
    lead, (N, V) = p_target.shape[:-2], p_target.shape[-2:]
    p_target = p_target.reshape(-1, N, V)  # (B, N, V): the trees in a row
    q_child = q_child.reshape(-1, N, V)  # (B, N, V)
    tokens = tokens.reshape(-1, N)  # (B, N)
    B, device = p_target.size(0), p_target.device
    parents, kids, depth = tree_lists(parents)
    D, width = max(depth), max(len(ch) for ch in kids)
    # child_table[u, j] = j-th child of node u, -1 if u has fewer children
    child_table = torch.full((N, width), -1, dtype=torch.long, device=device)  # (N, width)
    for u, ch in enumerate(kids):
        child_table[u, : len(ch)] = torch.tensor(ch, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)
    node = torch.zeros(B, dtype=torch.long, device=device)  # (B,) where each tree's walk stands
    alive = torch.ones(B, dtype=torch.bool, device=device)  # (B,) still descending
    P = p_target[:, 0]  # (B, V) what the next token must follow, given the rejections so far
    path = torch.full((B, D), -1, dtype=torch.long, device=device)  # (B, D)
    for d in range(D):
        chosen = torch.full((B,), -1, dtype=torch.long, device=device)  # (B,) accepted child, -1 if none yet
        for j in range(width):
            child = child_table[node, j]  # (B,)
            c = child.clamp(min=0)
            trying = alive & (child >= 0) & (chosen < 0)
            x = tokens[rows, c]  # (B,)
            q = q_child[rows, c]  # (B, V)
            u = torch.rand(B, generator=generator, dtype=p_target.dtype, device=device)  # (B,)
            ok = u < accept_prob(P, q, x)
            chosen = torch.where(trying & ok, child, chosen)
            P = torch.where((trying & ~ok)[:, None], residual(P, q), P)
        alive = chosen >= 0
        path[:, d] = chosen  # all D levels run, stopped walks too (their draws unused): no host read per level
        node = torch.where(alive, chosen, node)
        P = torch.where(alive[:, None], p_target[rows, node], P)
    return path.reshape(*lead, D), sample(P, generator).reshape(lead)
