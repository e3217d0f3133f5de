"""
The verify step every tree method shares (medusa, eagle, parallelspec's tree, lookahead): the tree analogue of
`chain_step.py`. However the tree was built (trees.py, or a method's own builder), it is `tokens` + `parents`
(nanospec/tree.py, which draws the worked example): node 0 is the root, the newest emitted token (not yet in the
cache), every other node a guess under its parent.

One target forward runs over all N nodes at once; the tree mask lets each node see only the cached prefix and
its own ancestors, and its position id is prefix + depth, so every node gets exactly the logits a plain forward
along its own root-to-node path would give. Then a tree rule picks the accepted path, the cache keeps the
prefix + that path (`compact`), and the emitted tokens are the accepted guesses plus the target's next token.
On tree.py's example (root "(", guesses "x" -> ")" and "self"), target argmax after "(" = "x", after "x" = ",":
path ["x"], emitted ["x", ","]; the cache gains "(" and "x"; "," is the next root.

The rule follows where the guesses came from:
  guesses fixed before the step (top-k, n-grams, Jacobi iterates): the tree point-mass rule, run as
      verify.verify_tree_descend ("draw y ~ p at the node, step into the child holding y"), or
      verify.verify_tree_greedy under greedy (the argmax instead of a draw). Both are the walk verify._descend;
      the tests hold them to the reference rule verify.verify_tree_point_mass and to the exact law.
  guesses DRAWN from the drafter's q_draft (--draft-sampling sample): verify.verify_tree_without_replacement,
      recursive rejection sampling against the q each child was drawn from.
  medusa's --verify typical: verify.typical_accept, LOSSY by design.

On the static runtime (nanospec/static.py) a tree is padded to the method's fixed node budget, so every verify
forward has one shape (one CUDA graph) whatever the tree's size: a padded node is a root of its own (parent -1),
sees only the prefix and itself, no real node sees it, and its rows are cut off before the rule runs. There the
rule runs on the device and the step reads the host once (`read_walk`: the path, its tokens, the next token):
greedy, the argmax walk; drawn children, verify_tree_without_replacement_batched. A drawn tree then keeps its
shape whatever the draws (trees.fill_tree on_device): a node whose rank top-k / top-p left q no token for holds
-1, runs through the forward as token 0, and is skipped by the rule exactly as an absent node (its valid mask).
"""
import torch

from nanospec.static import runtime_model
from nanospec.tree import tree_layout_on_device, tree_mask, tree_positions
from nanospec.verify import (draw_rows, typical_accept, verify_tree_descend, verify_tree_greedy,
                             verify_tree_greedy_on_device, verify_tree_without_replacement,
                             verify_tree_without_replacement_batched, warp)

RULES = ("point-mass", "typical")  # lossless (greedy = its one-hot case), and Medusa's LOSSY typical acceptance


def tree_runtime(model, runtime, budget):
    """runtime_model for a tree method whose trees hold at most `budget` nodes, root included: (forward, cache,
    path, the budget to pad to: None on the eager path, which runs each tree as it is). The cache has room for
    a full padded tree after any prefix the context allows, on both paths (so they build the same trees)."""
    forward, cache, path = runtime_model(model, runtime, max_len=model.config.block_size + budget)
    return forward, cache, path, None if path == "eager" else budget


def tree_step(run, target, cache, tokens, parents, rule="point-mass", heads=False, q_draft=None, budget=None,
              also=None):
    """One tree verify step. tokens, parents: the tree (tokens[0] = the root = the last emitted token);
    rule: "point-mass" (lossless) or "typical" (lossy, see verify.py); q_draft (N, V): for a tree whose children
    were DRAWN, the law node u's children were drawn from (without replacement, in index order); it is then
    verified with verify_tree_without_replacement (lossless) instead. budget: pad the forward to this many
    nodes (see above), or None for exactly the tree. tokens may be a (N,) LongTensor left on the device, with -1
    at a drawn node the drafter could not fill (trees.fill_tree); the rule then runs there too (walk_on_device).

    Returns (emitted, path, out): emitted = the accepted guesses + the target's next token; path = the accepted
    node indices (root excluded), so the last accepted node is path[-1] if path else 0; out = the forward's
    Output (out.hidden[:, node] is the trunk state there, for drafting the next tree). also(out) -> a LongTensor
    (K,) the caller needs on the host: it comes back in the step's read, as a fourth item (a list).
    Afterwards the cache holds the prefix, the root and the accepted guesses; the next token is not in it yet.
    """
    if rule not in RULES:
        raise ValueError(f"unknown tree rule {rule!r}; choose one of: {', '.join(RULES)}")
    prefix, device, N = cache.length, cache.device, len(tokens)
    pad = max(0, min(budget or 0, cache.max_len - prefix) - N)  # padded nodes: roots of their own, never read
    x = torch.as_tensor(tokens, dtype=torch.long, device=device)  # (N,) -1 at a drawn node q could not fill
    if torch.is_tensor(parents):  # a tree shaped on the device (EAGLE's rerank): its mask is built there too
        mask, pos = tree_layout_on_device(torch.cat([parents, parents.new_full((pad,), -1)]), prefix)
    else:
        padded = parents + [-1] * pad  # (N + pad,)
        mask, pos = tree_mask(padded, prefix, device), tree_positions(padded, prefix, device)
    with run.forwarding():
        out = target(torch.cat([x.clamp(min=0), x.new_zeros(pad)])[None],  # a node not drawn runs as token 0
                     pos=pos, cache=cache, mask=mask, heads=heads)  # (1, N+pad, V)
    logits = out.logits[0, :N]  # (N, V) the real nodes
    extra = also(out) if also is not None else x[:0]  # (K,)
    on_device = torch.is_tensor(tokens) or budget is not None  # the static runtime, or tokens left on the device
    if on_device and (run.sampling.greedy or q_draft is not None):  # the rule on the device, then one read
        emitted, path, extra = read_walk(*walk_on_device(run, logits, x, parents, q_draft), x, extra)
    else:
        emitted, path, extra = verify_on_host(run, logits, tokens, parents, rule, q_draft, extra)
    # the forward wrote all N (+ pad) nodes after the prefix; keep the root and the accepted path, in order
    cache.compact(list(range(prefix)) + [prefix + n for n in [0] + path])
    return (emitted, path, out) if also is None else (emitted, path, out, extra)


def walk_on_device(run, logits, tokens, parents, q_draft):
    """The lossless tree rules with nothing read: logits (N, V), tokens (N,) on the device, -1 at a node the
    drafter could not fill (trees.fill_tree). Greedy: the argmax walk (verify_tree_greedy_on_device; -1 matches no
    argmax). Drawn children (q_draft (N, V)): recursive rejection sampling over the filled nodes
    (verify_tree_without_replacement_batched, B = 1, valid = tokens >= 0). Returns path (D,) padded with -1 and
    the next token (), on the device."""
    if run.sampling.greedy:
        return verify_tree_greedy_on_device(logits, tokens, parents)
    p_target = warp(logits, *run.sampling)  # (N, V)
    path, nxt = verify_tree_without_replacement_batched(p_target[None], q_draft[None], tokens.clamp(min=0)[None],
                                                        parents, run.generator, (tokens >= 0)[None])  # (1, D), (1,)
    return path[0], nxt[0]


def verify_on_host(run, logits, tokens, parents, rule, q_draft, extra):
    """The tree rules as verify.py writes them, on logits (N, V). What the host needs of the device (tokens and
    parents left there, the point-mass rule's draws, the caller's extra (K,)) comes back in one read.
    Returns (emitted, path, extra as a list)."""
    N, p_target = len(parents), None if run.sampling.greedy else warp(logits, *run.sampling)  # (N, V)
    point_mass = p_target is not None and q_draft is None and rule == "point-mass"
    draws = draw_rows(p_target, run.generator) if point_mass else extra[:0]  # (N,) y at each node (verify_tree_descend)
    on_device = [t for t in (tokens, parents) if torch.is_tensor(t)] + [draws, extra]
    values = torch.cat(on_device).tolist() if sum(t.numel() for t in on_device) else []  # the one read
    if torch.is_tensor(tokens):  # values = [tokens, parents if on the device, draws, extra]
        tokens, values = values[:N], values[N:]
    if torch.is_tensor(parents):
        parents, values = values[:N], values[N:]
    draws, extra = values[:draws.numel()], values[draws.numel():]
    if p_target is None:  # every rule reduces to "follow the argmax"; skip building p
        path, nxt = verify_tree_greedy(logits, tokens, parents)
    elif q_draft is not None:  # drawn children: recursive rejection sampling against the q they came from
        path, nxt = verify_tree_without_replacement(p_target, q_draft, tokens, parents, run.generator)
    elif point_mass:
        path, nxt = verify_tree_descend(p_target, tokens, parents, draws=draws)
    else:
        path, nxt = typical_accept(p_target, tokens, parents, generator=run.generator)
    return [tokens[n] for n in path] + [int(nxt)], path, extra


def read_walk(path, nxt, tokens, extra):
    """ONE host read of what a step whose rule ran on the device needs: path (D,) padded with -1, the next token
    (), tokens (N,) and the caller's `extra` (K,) -> (emitted = the path's tokens + the next token, path as a
    list, extra as a list)."""
    D = path.numel()
    values = torch.cat([path, tokens[path.clamp(min=0)], nxt.view(1), extra]).tolist()  # the one read
    n = sum(v >= 0 for v in values[:D])  # accepted nodes: the path's entries before its -1 padding
    return values[D:D + n] + [values[2 * D]], values[:n], values[2 * D + 1:]
