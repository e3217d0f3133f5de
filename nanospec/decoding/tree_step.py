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
"""
import torch

from nanospec.decoding.common import tensor
from nanospec.tree import tree_mask, tree_positions
from nanospec.verify import typical_accept, verify_tree_descend, verify_tree_greedy, warp

RULES = ("point-mass", "typical")  # lossless (greedy = its one-hot case), and Medusa's LOSSY typical acceptance


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
    if rule not in RULES:
        raise ValueError(f"unknown tree rule {rule!r}; choose one of: {', '.join(RULES)}")
    if sampling[0] == 0:  # greedy: every rule reduces to "follow the argmax"; skip building p
        path, nxt = verify_tree_greedy(out.logits[0], tokens, parents)
    else:
        p_target = warp(out.logits[0], *sampling)  # (N, V): the target's law after each node's own path
        if rule == "point-mass":
            path, nxt = verify_tree_descend(p_target, tokens, parents, run.generator)
        else:
            path, nxt = typical_accept(p_target, torch.tensor(tokens), parents, generator=run.generator)
    # the forward wrote all N nodes after the prefix; keep the root and the accepted path, in order
    cache.compact(list(range(prefix)) + [prefix + n for n in [0] + path])
    return [tokens[n] for n in path] + [int(nxt)], path, out
