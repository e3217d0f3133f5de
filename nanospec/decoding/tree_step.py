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
probability P(x), on rejection remove x from P and try the next sibling). `descend` below computes the same
law the cheap way, "draw y ~ p at the node, step into the child whose token is y, stop when there is none",
which costs one draw per accepted level instead of a few tensor operations per child tried; the tests check
it against verify_tree_point_mass (exactly under greedy, in law when sampling).
"""
import torch

from nanospec.decoding.common import tensor
from nanospec.tree import tree_mask, tree_positions
from nanospec.verify import sample, typical_accept, warp

RULES = ("point-mass", "typical")  # lossless (greedy = its one-hot case), and Medusa's LOSSY typical acceptance


def descend(p_target, tokens, parents, generator=None):
    """The tree point-mass rule as sample-and-match. p_target (N, V): the target's law after each node.

    At node u draw y ~ p_u; if a child of u holds y, step into it (the first such child: a duplicate sibling
    never wins) and repeat there; else stop and emit y. Child x is entered with probability p_u(x) and, when
    none is, y follows p_u without the children's tokens: exactly verify_tree_point_mass's law. (The draw y
    is both the test and the emitted token; drawing a FRESH token after a mismatch would be biased.)
    Greedy: p is one-hot, y is the argmax. Returns (path: accepted node indices, root excluded; next_token).
    Example: tokens [0, 5, 8, 9], parents [-1, 0, 0, 1], greedy argmax after nodes 0..3 = [8, 1, 7, 4]
    -> y = 8 at the root: node 2; no child of node 2 holds y = 7 -> ([2], 7).
    """
    child = {}  # (parent, token) -> the first child holding it
    for c in range(len(parents) - 1, 0, -1):
        child[(parents[c], int(tokens[c]))] = c
    node, path = 0, []
    while True:
        y = int(sample(p_target[node], generator))  # the draw is both the test and, at the end, the output
        if (node, y) not in child:
            return path, y
        node = child[(node, y)]
        path.append(node)


def tree_step(run, target, cache, tokens, parents, sampling, rule="point-mass", heads=False):
    """One tree verify step. tokens, parents: the tree (tokens[0] = the root = the last emitted token);
    sampling: (temperature, top_k, top_p); rule: "point-mass" (lossless) or "typical" (lossy, see verify.py).

    Returns (emitted, path, out): emitted = the accepted guesses + the target's next token; path = the accepted
    node indices (root excluded), so the last accepted node is path[-1] if path else 0; out = the forward's
    Output (out.hidden[:, node] is the trunk state there, for drafting the next tree).
    Afterwards the cache holds the prefix, the root and the accepted guesses; the next token is not in it yet.
    """
    prefix = cache.length
    device = cache.k.device
    out = target(tensor(tokens, device), pos=tree_positions(parents, prefix, device), cache=cache,
                 mask=tree_mask(parents, prefix, device), heads=heads)  # logits (1, N, V)
    p_target = warp(out.logits[0], *sampling)  # (N, V): the target's law after each node's own path
    if rule == "point-mass":
        path, nxt = descend(p_target, tokens, parents, run.generator)
    elif rule == "typical":
        path, nxt = typical_accept(p_target, torch.tensor(tokens), parents, generator=run.generator)
    else:
        raise ValueError(f"unknown tree rule {rule!r}; choose one of: {', '.join(RULES)}")
    # the forward wrote all N nodes after the prefix; keep the root and the accepted path, in order
    cache.compact(list(range(prefix)) + [prefix + n for n in [0] + path])
    return [tokens[n] for n in path] + [int(nxt)], path, out
