"""
The verify step, once for a chain of guesses and once for a tree: ONE target forward over the guesses, the rule
of nanospec/rules/verify.py that fits where they came from, and the KV cache cut back to what was accepted.

    chain: cache = [.. prefix ..]; last = 12, drafts [5, 9, 2]; target argmax after 12, 5, 9, 2 = [5, 9, 7, 3]
           -> accept 5, 9; emit [5, 9, 7]; cache = [.. prefix .., 12, 5, 9]; 7 opens the next forward.
    tree:  root "(" with guesses "x" -> ")" and "self" (nanospec/rules/tree.py draws it); argmax after "(" = "x",
           after "x" = ","  -> path ["x"], emit ["x", ","]; the cache keeps "(" and "x" (`compact`).

In a tree forward each node sees the cached prefix and its own ancestors (tree_mask) at position prefix + depth
(tree_positions), so it gets exactly the logits a plain forward along its own root-to-node path would give.

Which rule (the names are options.VERIFY_RULES): greedy, "accept while the guess is the argmax"
(verify_chain_greedy, verify_tree_greedy: no law built). Sampling, guesses DRAWN from a drafter's q_draft are
judged against that q (verify_chain, Leviathan's rule; verify_tree_without_replacement for a tree's siblings drawn
without replacement), and deterministic guesses (n-gram copies, top-k, Jacobi iterates) as point masses, q =
one_hot (verify_chain with verify.point_mass, verify_tree_descend). Those are the "token" rules, which judge one
guess at a time from the root down. The "block" rule judges a chain jointly (verify_block), the "traversal" rule a
drawn tree from its leaves up (verify_tree_traversal): the same law, more guesses accepted. medusa's "typical"
rule (verify.typical_accept) is LOSSY by design.
"""
import torch

from nanospec.steps.options import CHAIN_RULES, TREE_RULES
from nanospec.rules.tree import tree_mask, tree_positions
from nanospec.rules.verify import (host_path, point_mass, sample, typical_accept, verify_block, verify_chain,
                             verify_chain_greedy, verify_tree_descend, verify_tree_greedy, verify_tree_traversal,
                             verify_tree_without_replacement, warp)


def chain_step(run, target, cache, last, drafts, q_draft=None, rule="token", **forward):
    """One target forward over each row's [last, d1..dk] and the chain rule; the cache then holds each row's
    sequence up to its last accepted draft (`last` included, the new token not yet). One prompt is one row.

    last: B ints, each row's newest emitted token, not yet in the cache; drafts: B lists of guesses for the tokens
    after it (a row's own k_b of them, the shorter rows padded up to K = max k_b); q_draft (B, K, V): the law
    each was drawn from, or None for deterministic guesses; rule: "token" or "block" (one row).
    forward: more arguments of the target's forward (early-exit's layers, the range of blocks to run,
    and hidden_in). run: its sampling and generator judge (a batch's rows share them). Returns (emitted: B lists,
    each the row's accepted drafts + the target's next token; n: B ints, the drafts accepted; the forward's
    Output)."""
    if rule not in CHAIN_RULES:
        raise ValueError(f"unknown chain rule {rule!r}; choose one of: {', '.join(CHAIN_RULES)}")
    before = cache.row_lengths  # each row's tokens before its `last`
    k_rows = [len(d) for d in drafts]
    K = max(k_rows)
    rows = [[t] + list(d) + [0] * (K - len(d)) for t, d in zip(last, drafts)]  # the shorter rows padded with 0
    ids = torch.tensor(rows, device=cache.device)  # (B, K+1)
    out = target(ids, cache=cache, **forward)
    if run.sampling.greedy:  # every rule is "accept while the guess is the argmax"
        n, nxt = zip(*[verify_chain_greedy(out.logits[b, :k + 1], drafts[b]) for b, k in enumerate(k_rows)])
    elif K == 0:  # no guesses (a plain step): every rule draws the target's own token from its law, as `ar` does
        n, nxt = [0] * len(rows), sample(warp(out.logits[:, 0], *run.sampling), run.generator).tolist()
    else:
        p_target = warp(out.logits, *run.sampling)  # (B, K+1, V)
        guesses = ids[:, 1:]  # (B, K)
        if q_draft is None:  # a guess not drawn is a point mass, q = one_hot(x): min(1, p(x)/q(x)) = p(x)
            q_draft = point_mass(guesses, p_target)  # (B, K, V)
        judge = verify_block if rule == "block" else verify_chain
        n, nxt = judge(p_target, q_draft, guesses, run.generator)  # (B,), (B,)
        if min(k_rows) < guesses.size(1):  # padded rows: each keeps at most its own guesses
            assert rule == "token", "block verification judges one chain, unpadded"
            n, nxt = own_guesses(p_target, n, nxt, k_rows, run.generator)
        n, nxt = torch.stack([n, nxt]).tolist()  # one host read
    cache.rollback_rows([b + 1 + m for b, m in zip(before, n)])  # keep last and the accepted drafts, row by row
    return [list(d[:m]) + [t] for d, m, t in zip(drafts, n, nxt)], list(n), out


def own_guesses(p_target, n, nxt, k_rows, generator):
    """A row padded past its own k_b guesses keeps at most k_b; when all k_b passed, its next token is a fresh
    draw from p_target after them (what the rule did with the padding is its own randomness, dropped, so the row
    keeps the target's law). p_target (B, K+1, V); n, nxt (B,). Returns the rows' (n, nxt)."""
    k_rows = torch.tensor(k_rows, device=n.device)  # (B,)
    after = sample(p_target[torch.arange(len(n), device=n.device), k_rows], generator)  # (B,) the law after them
    full = n >= k_rows  # (B,) every real guess accepted
    return torch.where(full, k_rows, n), torch.where(full, after, nxt)


def tree_step(run, target, cache, tokens, parents, q_draft=None, rule="token"):
    """One target forward over a tree of guesses and the tree rule; the cache then holds the prefix, the root and
    the accepted path.

    tokens, parents: the tree (lists; node 0 = the root = the newest emitted token, not yet in the cache);
    q_draft (N, V): for a tree whose children were DRAWN, the law node u's children were drawn from (without
    replacement, in index order), else None; rule: "token", "traversal" (drawn guesses, each node's drawn
    independently: tree_guesses.draw_tree) or "typical" (guesses not drawn).
    Returns (emitted, path, out): emitted = the accepted guesses + the target's next token; path = the accepted
    nodes (root excluded), so the last accepted node is path[-1] if path else 0; out = the forward's Output
    (out.hidden[:, node] is the trunk state there, for drafting the next tree)."""
    if rule not in TREE_RULES:
        raise ValueError(f"unknown tree rule {rule!r}; choose one of: {', '.join(TREE_RULES)}")
    if rule == "traversal" and q_draft is None and len(tokens) > 1 and not run.sampling.greedy:
        raise ValueError("traversal verification judges drawn guesses: use --draft-sampling sample")
    prefix = cache.length  # the tokens before the root
    device = cache.device
    ids = torch.tensor([tokens], device=device)  # (1, N)
    tree = len(tokens) > 1  # else the root alone, a plain step: a plain forward, nothing to compact after it
    out = target(ids, pos=tree_positions(parents, prefix, device) if tree else None, cache=cache,
                 mask=tree_mask(parents, prefix, device) if tree else None)  # logits (1, N, V)
    logits = out.logits[0]  # (N, V)
    if run.sampling.greedy:  # every rule is "follow the argmax"
        path, nxt = verify_tree_greedy(logits, tokens, parents)
    elif q_draft is not None and rule == "traversal":  # drawn children, judged from the leaves up
        path, nxt = verify_tree_traversal(warp(logits, *run.sampling), q_draft, tokens, parents, run.generator)
    elif q_draft is not None and tree:  # drawn children, judged root down against the q they came from
        judged = verify_tree_without_replacement(warp(logits, *run.sampling), q_draft, tokens, parents, run.generator)
        path, nxt = host_path(*judged)  # one host read
    elif rule == "typical":
        path, nxt = host_path(*typical_accept(warp(logits, *run.sampling), tokens, parents, generator=run.generator))
    else:  # guesses not drawn: point masses, q = one_hot, judged as "draw y ~ p, step into the child holding y"
        path, nxt = verify_tree_descend(warp(logits, *run.sampling), tokens, parents, run.generator)
    if tree:
        cache.compact(list(range(prefix)) + [prefix + n for n in [0] + path])  # the root, then the accepted path
    return [tokens[n] for n in path] + [nxt], path, out
