"""
The verify step, once for a chain of guesses and once for a tree: ONE target forward over the guesses, the rule
of nanospec/rules/verify.py that fits where they came from, and the KV cache cut back to what was accepted.

    chain: cache = [.. prefix ..]; last = 12, drafts [5, 9, 2]; target argmax after 12, 5, 9, 2 = [5, 9, 7, 3]
           -> accept 5, 9; emit [5, 9, 7]; cache = [.. prefix .., 12, 5, 9]; 7 opens the next forward.
    tree:  root "(" with guesses "x" -> ")" and "self" (nanospec/rules/tree.py draws it); argmax after "(" = "x",
           after "x" = ","  -> path ["x"], emit ["x", ","]; the cache keeps "(" and "x" (`compact`).

In a tree forward each node sees the cached prefix and its own ancestors (tree_mask) at position prefix + depth
(tree_positions), so it gets exactly the logits a plain forward along its own root-to-node path would give.

Which rule: the method's --verify names one in options.VERIFY_RULES, the one table of them, which says the function
of nanospec/rules/verify.py that judges a chain, a tree of DRAWN guesses (against the q_draft they came from) or a
tree of guesses not drawn (n-gram copies, top-k, Jacobi iterates: point masses, q = one_hot). Greedy, every rule
is "accept while the guess is the argmax" (verify_chain_greedy, verify_tree_greedy: no law built), as it is, when
sampling, for a chain drawn with the target's own race noise (--draft-sampling coupled: verify_chain_coupled), and a
step with no guesses draws the target's own token, as `ar` does. Both steps take the sampling settings and the
generator that
judge, nothing else of the run (a batch's rows share them).
"""
import torch

from nanospec.rules.tree import tree_mask, tree_positions
from nanospec.rules.verify import (host_path, pick_token, point_mass, sample, verify_chain_coupled,
                                   verify_chain_greedy, verify_tree_greedy, warp)
from nanospec.steps.options import KIND_NAMES, VERIFY_RULES, rule_for, rules_for


def judge_of(rule, kind, instead=None):
    """The function of VERIFY_RULES that judges guesses of `kind` ("chain", "drawn_tree", "fixed_tree") under
    --verify `rule` (None: the default for that kind, options.DEFAULT_RULE), or a one-line ValueError naming the
    rules that do, and `instead`, the option that makes guesses this rule judges, when the method has one
    (eagle's chain: "--tree dynamic")."""
    rule = rule_for(rule, kind)
    judge = getattr(VERIFY_RULES[rule], kind) if rule in VERIFY_RULES else None
    if judge is None:
        raise ValueError(f"--verify {rule} does not judge {KIND_NAMES[kind]}; the rules that do: "
                         f"{', '.join(rules_for(kind))}" + (f"; or {instead}" if instead else ""))
    return judge


def chain_step(sampling, generator, target, cache, last, drafts, q_draft=None, rule="token", noise=None, **forward):
    """One target forward over each row's [last, d1..dk] and the chain rule; the cache then holds each row's
    sequence up to its last accepted draft (`last` included, the new token not yet). One prompt is one row.

    sampling, generator: the law every token follows and the randomness that judges (a batch's rows share them).
    last: B ints, each row's newest emitted token, not yet in the cache; drafts: B lists of guesses for the tokens
    after it (a row's own k_b of them, the shorter rows padded up to K = max k_b); q_draft (B, K, V): the law
    each was drawn from, or None for deterministic guesses; rule: a name in VERIFY_RULES that judges a chain
    ("token", or "block" for one row). noise (B, K+1, V): the race noise coupled guesses were drawn with (one row
    per position: --draft-sampling coupled); they are then judged by verify_chain_coupled, whatever `rule` names.
    forward: more arguments of the target's forward (early-exit's layers, the
    range of blocks to run, and hidden_in). Returns (emitted: B lists, each the row's accepted drafts +
    the target's next token; n: B ints, the drafts accepted; the forward's Output)."""
    judge = judge_of(rule, "chain")
    if not any(drafts):  # no guesses: a plain step, as `ar` takes it (the cache then holds each row's `last`)
        out = target(torch.tensor([[t] for t in last], device=cache.device), cache=cache, **forward)  # (B, 1)
        return [[t] for t in own_token(out.logits[:, 0], sampling, generator)], [0] * len(last), out
    before = cache.row_lengths  # each row's tokens before its `last`
    k_rows = [len(d) for d in drafts]
    K = max(k_rows)
    rows = [[t] + list(d) + [0] * (K - len(d)) for t, d in zip(last, drafts)]  # the shorter rows padded with 0
    ids = torch.tensor(rows, device=cache.device)  # (B, K+1)
    out = target(ids, cache=cache, **forward)
    if sampling.greedy:  # every rule is "accept while the guess is the argmax"
        n, nxt = zip(*[verify_chain_greedy(out.logits[b, :k + 1], drafts[b]) for b, k in enumerate(k_rows)])
    elif noise is not None:  # coupled guesses: "accept while the guess is the target's own draw in its race"
        p_target = warp(out.logits, *sampling)  # (B, K+1, V)
        n, nxt = zip(*[verify_chain_coupled(p_target[b, :k + 1], noise[b, :k + 1], drafts[b])
                       for b, k in enumerate(k_rows)])
    else:
        p_target = warp(out.logits, *sampling)  # (B, K+1, V)
        guesses = ids[:, 1:]  # (B, K)
        if q_draft is None:  # a guess not drawn is a point mass, q = one_hot(x): min(1, p(x)/q(x)) = p(x)
            q_draft = point_mass(guesses, p_target)  # (B, K, V)
        n, nxt = judge(p_target, q_draft, guesses, generator)  # (B,), (B,)
        if min(k_rows) < guesses.size(1):  # padded rows: each keeps at most its own guesses
            assert VERIFY_RULES[rule_for(rule, "chain")].padded, f"the {rule} rule judges a chain whole: pad no row"
            n, nxt = own_guesses(p_target, n, nxt, k_rows, generator)
        n, nxt = torch.stack([n, nxt]).tolist()  # one host read
    cache.rollback_rows([b + 1 + m for b, m in zip(before, n)])  # keep last and the accepted drafts, row by row
    return [list(d[:m]) + [t] for d, m, t in zip(drafts, n, nxt)], list(n), out


def own_token(logits, sampling, generator):
    """A plain step's token (no guesses to judge): every rule draws the target's own from its law, as `ar` does
    (greedy: the argmax). logits (B, V), each row's after its newest token -> B ints."""
    return pick_token(logits, *sampling, generator=generator).tolist()


def own_guesses(p_target, n, nxt, k_rows, generator):
    """A row padded past its own k_b guesses keeps at most k_b; when all k_b passed, its next token is a fresh
    draw from p_target after them (what the rule did with the padding is its own randomness, dropped, so the row
    keeps the target's law). p_target (B, K+1, V); n, nxt (B,). Returns the rows' (n, nxt)."""
    k_rows = torch.tensor(k_rows, device=n.device)  # (B,)
    after = sample(p_target[torch.arange(len(n), device=n.device), k_rows], generator)  # (B,) the law after them
    full = n >= k_rows  # (B,) every real guess accepted
    return torch.where(full, k_rows, n), torch.where(full, after, nxt)


def tree_step(sampling, generator, target, cache, tokens, parents, q_draft=None, rule=None, **forward):
    """One target forward over a tree of guesses and the tree rule; the cache then holds the prefix, the root and
    the accepted path.

    sampling, generator: as chain_step's. tokens, parents: the tree (lists; node 0 = the root = the newest
    emitted token, not yet in the cache); q_draft (N, V): for a tree whose children were DRAWN, the law node u's
    children were drawn from (without replacement, in index order), else None; rule: a name in VERIFY_RULES that
    judges such a tree, None: options.DEFAULT_RULE's ("traversal" needs each node's children drawn on their own:
    tree_guesses.DrawnTree). forward: more arguments of the target's forward (medusa's heads).
    Returns (emitted, path, out): emitted = the accepted guesses + the target's next token; path = the accepted
    nodes (root excluded), so the last accepted node is path[-1] if path else 0; out = the forward's Output
    (out.hidden[:, node] is the trunk state there, for drafting the next tree)."""
    tree = len(tokens) > 1  # else the root alone, a plain step: a plain forward, nothing to compact after it
    judge = judge_of(rule, "fixed_tree" if q_draft is None else "drawn_tree") if tree and not sampling.greedy else None
    prefix = cache.length  # the tokens before the root
    device = cache.device
    ids = torch.tensor([tokens], device=device)  # (1, N)
    out = target(ids, pos=tree_positions(parents, prefix, device) if tree else None, cache=cache,
                 mask=tree_mask(parents, prefix, device) if tree else None, **forward)  # logits (1, N, V)
    logits = out.logits[0]  # (N, V)
    if sampling.greedy:  # every rule is "follow the argmax"
        path, nxt = verify_tree_greedy(logits, tokens, parents)
    elif not tree:  # no guesses: a plain step
        path, [nxt] = [], own_token(logits, sampling, generator)
    else:
        p_target = warp(logits, *sampling)  # (N, V)
        if q_draft is None:  # guesses not drawn: point masses
            path, nxt = judge(p_target, tokens, parents, generator=generator)
        else:  # drawn children, judged against the q they came from
            path, nxt = judge(p_target, q_draft, tokens, parents, generator=generator)
        if torch.is_tensor(nxt):  # a rule over leading dimensions answers in tensors
            path, nxt = host_path(path, nxt)  # one host read
    if tree:
        cache.compact(list(range(prefix)) + [prefix + n for n in [0] + path])  # the root, then the accepted path
    return [tokens[n] for n in path] + [nxt], path, out
