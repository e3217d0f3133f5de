"""
A trace of one generation: for every target forward, the guesses it checked (a chain, or a tree with its parents),
how the target judged each one (p(x), q(x), the acceptance probability min(1, p/q), the randomness that decided it,
the verdict), the token it emitted and the law that token was drawn from, the KV cache before the forward and after
the rollback, and the running tokens per forward. `decode.py --trace run.html` writes it as a page
(nanospec/trace/page.html, filled with the trace as JSON), `--trace run.json` for scripts.

    with recording(models) as trace:
        ids, stats = METHODS["speculative"](trace.models, prompt_ids, 64, temperature=1.0, seed=0)
    doc = trace.document(models.tokenizer, prompt_ids, ids, stats)
    check(doc)               # -> []: every verdict follows from its recorded randomness and probabilities
    write("run.html", doc)
    traced_run(models, run_method, prompt_ids, "run.html", settings, argv)  # all of that: decode.py, make figures

The trace is a layer, as the bench's timing is (bench/timing.py): no method knows about it. While `recording` is
open, and only then, it wraps from outside:
  - the target (`Traced`, as timing.Timed): each target forward's length and the cache length before it;
  - run.Run.emit and Run.sample: a step ends when the method emits what its forward produced (`emit` counts the
    forwards); a plain step's token comes from `Run.sample` (ar's), or from verify_step's `own_token` (a step of
    a drafting method that checked no guess);
  - chain_step and tree_step, where the methods hold them: the guesses sent, a chain or a tree;
  - the rules verify_step calls (its greedy shortcuts, GREEDY, and those of options.VERIFY_RULES, RULES): each call
    runs inside `capturing`, which records what torch.rand returned (the uniforms the rule drew, not one more) and
    what the rule asked of verify.py's pieces (accept_prob, sample, block_acceptance, traverse_tree): their
    arguments and their answers, as the rule saw them;
  - adaptive.DraftLength: the k each step chose (--adaptive history, confidence, cost, sweep).
When it closes, each is put back as it was: a run outside `recording` runs no line of this file, so tracing off
costs nothing (tests/test_trace.py counts host reads and tensor operations), and the wrappers return exactly what
they wrap, so a traced run draws every token an untraced one draws.

A step of the trace (one target forward; JSON):
    forward, kind         1, 2, ...; "prefill" (the forward that read the prompt), "plain" (ar), "chain", "tree"
    read, cache           tokens the forward read; [cache length before it, after the rollback]
    tokens, parents       the root (the newest token, not yet cached) and the guesses; a chain: [-1, 0, 1, ..]
    guessed, verify       "drawn" (from a drafter's q), "fixed" (copies, top-k, iterates: point masses) or
                          "coupled" (the drafter's winner in the target's own race), None when greedy (every rule
                          then follows the argmax); the method's --verify
    rule                  greedy | coupled | token | block | descend | traversal | typical (see GREEDY, RULES)
    nodes                 one per guess: node, x, depth, p = p(x), q = q(x), accept = min(1, p/q), u (the uniform
                          that decided it) or draw (the target's token that it had to match), verdict "accepted",
                          "rejected" or "unused" (drawn for but never looked at); block: w, h; typical: threshold
    path                  the accepted nodes, root excluded
    law                   the emitted token's law: name, row (its node), top tokens [[id, p]], token, drawn (the
                          token its draw gave), gap (for the chain and tree rules: how far it is from the law the
                          rule should have drawn from)
    order                 traversal only: the nodes tested, [node, weight, u, passed], in the walk's order
    emitted, produced     the tokens kept (all steps' together: the output) and those the step made before a stop
    drafted, adaptive     guesses checked; {rule, k (this step), next, chances (cost)}
    tokens_per_forward    running, after this step
"""
import inspect
import json
import math
import os
import shlex
import sys
from contextlib import contextmanager
from dataclasses import replace

import torch

from nanospec.rules import verify
from nanospec.steps import adaptive, run as run_module, verify_step
from nanospec.steps.run import drafts
from nanospec.steps.options import KINDS, VERIFY_RULES
from nanospec.tokenizer import write_atomic
from nanospec.rules.tree import children, depths, path_to
from nanospec.rules.verify import warp

FORMAT = "nanospec-trace"
VERSION = 1
TOP = 8  # tokens of each law kept
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")
MARK = '<meta name="generator" content="nanospec trace">'  # how a page says it is a trace (never replace others)
EXTENSIONS = (".html", ".json")


# ---------------------------------------------------------------------------------------------------------
# Patching from outside, for the length of a `with`


@contextmanager
def patched(patches):
    """Set each (object, name, replacement) while the block runs; put every original back after, whatever
    happens."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


class Calls:
    """What one rule call drew and asked of verify.py's pieces, in call order: rand (tensors torch.rand returned),
    sample [(probs, drawn)], accept [(p, q, x, accept)], block [((p, q, x), (h, law))], traversal [(tests: (weight,
    passed) per coin, path, law)]."""

    def __init__(self):
        self.rand, self.sample, self.accept, self.block, self.traversal = [], [], [], [], []


@contextmanager
def capturing():
    """Inside the block, torch.rand and verify's sample, accept_prob, block_acceptance and traverse_tree are
    themselves, recorded in the Calls yielded: the same calls, the same answers, no draw of their own."""
    calls = Calls()
    rand = torch.rand
    piece = {name: getattr(verify, name) for name in ("sample", "accept_prob", "block_acceptance", "traverse_tree")}

    def rand_(*args, **kwargs):
        u = rand(*args, **kwargs)
        calls.rand.append(u)
        return u

    def sample_(probs, *args, **kwargs):
        drawn = piece["sample"](probs, *args, **kwargs)
        calls.sample.append((probs, drawn))
        return drawn

    def accept_prob_(p, q, x):
        a = piece["accept_prob"](p, q, x)
        calls.accept.append((p, q, x, a))
        return a

    def block_acceptance_(p, q, x):
        answer = piece["block_acceptance"](p, q, x)
        calls.block.append(((p, q, x), answer))
        return answer

    def traverse_tree_(p, q, tokens, parents, coin):
        tests = []

        def coin_(prob):  # the walk's test of one node: its weight, and whether the rule's uniform passed it
            passed = coin(prob)
            tests.append((float(prob), bool(passed)))
            return passed
        path, law = piece["traverse_tree"](p, q, tokens, parents, coin_)
        calls.traversal.append((tests, path, torch.as_tensor(law)))  # the walk's numpy row, as a tensor
        return path, law

    with patched([(torch, "rand", rand_), (verify, "sample", sample_), (verify, "accept_prob", accept_prob_),
                  (verify, "block_acceptance", block_acceptance_), (verify, "traverse_tree", traverse_tree_)]):
        yield calls


# ---------------------------------------------------------------------------------------------------------
# What each rule did, from its arguments, its answer and the Calls it made. step: the trace's step (a dict).


def num(x, digits=None):
    """A float for JSON: exact (digits None) or rounded to `digits` significant digits; None for nan or inf."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}") if digits else x


def law_of(name, probs, token, drawn=None, row=None, gap=None):
    """The emitted token's law, probs (V,): its TOP most likely tokens and their probabilities."""
    probs = probs.detach().double().reshape(-1)
    top = probs.topk(min(TOP, probs.numel()))
    return {"name": name, "row": row, "top": [[int(i), num(v, 6)] for v, i in zip(top.values, top.indices) if v > 0],
            "token": int(token), "p_token": num(probs[int(token)], 6), "drawn": drawn,
            "gap": None if gap is None else num(gap, 3)}


def capped(a, b):
    """verify.capped_ratio, min(1, a / b) with its convention for b = 0, on two floats."""
    return float(verify.capped_ratio(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))


def gathered(probs, x):
    """probs (..., V) at tokens x (...) -> a flat list of floats."""
    return probs.gather(-1, x.unsqueeze(-1)).reshape(-1).tolist()


def uniforms(calls, n):
    """The first uniforms the rule drew, when they are one tensor of n values (else None: it drew them otherwise)."""
    return calls.rand[0].reshape(-1).tolist() if calls.rand and calls.rand[0].numel() == n else None


def guess(node, x, depth, p, q, accept=None, u=None, draw=None, verdict="unused", **more):
    return {"node": node, "x": int(x), "depth": depth, "p": num(p, 6), "q": num(q, 6), "accept": num(accept) if
            accept is not None else None, "u": num(u) if u is not None else None, "draw": draw, "verdict": verdict,
            **more}


def chain_verdict(i, n):
    """Guess i (0-based) of a chain where the first n were accepted: the ones after the first rejection are
    never looked at."""
    return "accepted" if i < n else "rejected" if i == n else "unused"


def walk_verdicts(parents, path):
    """A tree walked from the root along `path`: at each node it visited, the children before the one it entered
    were rejected (at the node where it stopped: all of them); every other guess was never looked at."""
    verdict = ["unused"] * len(parents)
    visited = [0] + list(path)
    kids = children(parents)
    for i, v in enumerate(visited):
        entered = visited[i + 1] if i + 1 < len(visited) else None
        for c in kids[v]:
            if c == entered:
                verdict[c] = "accepted"
                break
            verdict[c] = "rejected"
    return verdict


def traversal_order(parents, outcomes):
    """The nodes traverse_tree tests, in order, given each test's outcome: down the first untried child while
    there is one; a node with none left is tested; a failed node hands the walk back to its parent, which tries
    its next child. Example: parents [-1, 0, 1, 0], outcomes [False, False, True] -> [2, 1, 3]."""
    kids = children(parents)
    tried, node, order, outcomes = [0] * len(parents), 0, [], iter(outcomes)
    while True:
        if tried[node] < len(kids[node]):
            node = kids[node][tried[node]]
            continue
        passed = None if node == 0 else next(outcomes, None)
        if passed is None:  # the root always passes (and no test is left)
            return order
        order.append(node)
        if passed:
            return order
        tried[parents[node]] += 1
        node = parents[node]


def chain_greedy(step, a, calls, result):
    """verify_chain_greedy: accept while the guess is the target's argmax, then emit the argmax."""
    logits, drafts = a["logits"], [int(x) for x in a["draft_tokens"]]
    n, nxt = result
    best = logits.argmax(-1).tolist()
    step["nodes"] = [guess(i + 1, x, i + 1, float(x == best[i]), 1.0, float(x == best[i]), draw=best[i],
                           verdict=chain_verdict(i, n)) for i, x in enumerate(drafts)]
    step["path"] = list(range(1, n + 1))
    step["law"] = law_of("argmax", torch.softmax(logits[n].double(), -1), nxt, drawn=best[n], row=n)


def chain_coupled(step, a, calls, result):
    """verify_chain_coupled: each position's race run under the drafter's q (the guess) and the target's p (its
    token); a guess is accepted while it is the target's winner, whose race the token after the last accepted came
    from. q is not kept by the rule: each node shows p(x) and the target's winner."""
    p, noise, drafts = a["p_target"], a["noise"], [int(x) for x in a["draft_tokens"]]
    n, nxt = result
    won = verify.race(p, noise=noise).argmax(-1).tolist()  # the target's winner at each position
    step["nodes"] = [guess(i + 1, x, i + 1, p[i, x], float("nan"), draw=won[i], verdict=chain_verdict(i, n))
                     for i, x in enumerate(drafts)]
    step["path"] = list(range(1, n + 1))
    step["law"] = law_of("race", p[n], nxt, drawn=won[n], row=n)


def chain_token(step, a, calls, result):
    """verify_chain: guess i passes when its uniform is below accept_prob; the token after comes from the residual
    at the first rejection, or from p after the last guess (the bonus)."""
    n, nxt = (int(v.reshape(-1)[0]) for v in result)
    x = a["draft_tokens"].reshape(-1).tolist()
    k = len(x)
    p, q, xs, accept = calls.accept[0]
    p_x, q_x, acc, u = gathered(p, xs), gathered(q, xs), accept.reshape(-1).tolist(), uniforms(calls, k)
    step["nodes"] = [guess(i + 1, x[i], i + 1, p_x[i], q_x[i], acc[i], u[i] if u else None,
                           verdict=chain_verdict(i, n)) for i in range(k)]
    step["path"] = list(range(1, n + 1))
    p_target, q_draft = a["p_target"].flatten(0, -3)[0], a["q_draft"].flatten(0, -3)[0]  # (k+1, V), (k, V): row 0
    should = verify.residual(p_target[n], q_draft[n]) if n < k else p_target[k]  # (V,) residual, or the bonus law
    probs, drawn = calls.sample[-1]
    probs = probs.reshape(-1, probs.size(-1))[0]
    step["law"] = law_of("residual" if n < k else "bonus", probs, nxt, int(drawn.reshape(-1)[0]), n,
                         gap=(probs.double() - should.double()).abs().max())


def chain_block(step, a, calls, result):
    """verify_block: the test of each prefix i, u_i < h_i, the longest that passes wins; its weights w_i."""
    n, nxt = (int(v.reshape(-1)[0]) for v in result)
    (p, q, xs), (h, emit_law) = calls.block[0]
    k = xs.size(-1)
    p_x, q_x, h, u = gathered(p[:, :k], xs), gathered(q, xs), h.reshape(-1).tolist(), uniforms(calls, k + 1)
    w = [1.0]  # the weight of the first i guesses, as block_acceptance defines it (for reading; h decides)
    for i in range(k):
        w.append(capped(w[-1] * p_x[i], q_x[i]))
    step["nodes"] = [guess(i, xs[0, i - 1], i, p_x[i - 1], q_x[i - 1], u=u[i] if u else None, w=num(w[i], 6),
                           h=num(h[i]), verdict="accepted" if i <= n else "rejected") for i in range(1, k + 1)]
    step["path"] = list(range(1, n + 1))
    probs, drawn = calls.sample[-1]
    probs = probs.reshape(-1, probs.size(-1))[0]
    step["law"] = law_of("block residual" if n < k else "bonus", probs, nxt, int(drawn.reshape(-1)[0]), n,
                         gap=(probs.double() - emit_law[0, n].double()).abs().max())


def tree_greedy(step, a, calls, result):
    """verify_tree_greedy: from the root, step into the child holding the target's argmax."""
    logits, tokens, parents = a["logits"], a["tokens"], [int(v) for v in a["parents"]]
    path, nxt = result
    best, verdict, depth = logits.argmax(-1).tolist(), walk_verdicts(parents, path), depths(parents)
    step["nodes"] = [guess(c, tokens[c], depth[c], float(int(tokens[c]) == best[parents[c]]), 1.0,
                           float(int(tokens[c]) == best[parents[c]]), draw=best[parents[c]], verdict=verdict[c])
                     for c in range(1, len(parents))]
    step["path"] = list(path)
    last = path[-1] if path else 0
    step["law"] = law_of("argmax", torch.softmax(logits[last].double(), -1), nxt, drawn=best[last], row=last)


def tree_descend(step, a, calls, result):
    """verify_tree_descend: y ~ p at each node (one draw per node, all at once); step into the child holding y."""
    p_target, tokens, parents = a["p_target"], a["tokens"], [int(v) for v in a["parents"]]
    path, nxt = result
    probs, draws = calls.sample[0]
    y, verdict, depth = draws.tolist(), walk_verdicts(parents, path), depths(parents)
    p_x = [float(p_target[parents[c], int(tokens[c])]) for c in range(1, len(parents))]
    step["nodes"] = [guess(c, tokens[c], depth[c], p_x[c - 1], 1.0, p_x[c - 1], draw=y[parents[c]],
                           verdict=verdict[c]) for c in range(1, len(parents))]
    step["path"] = list(path)
    last = path[-1] if path else 0
    step["law"] = law_of("p (sample and match)", probs[last], nxt, drawn=y[last], row=last)


def tree_token(step, a, calls, result):
    """verify_tree_without_replacement: every node's children judged at once, rank by rank (row i of its tables:
    the i-th node with children; column j: its j-th child), one uniform each; the walk enters each visited node's
    first accepted child."""
    tokens, parents = a["tokens"], [int(v) for v in a["parents"]]
    path, nxt = result
    path, nxt = [v for v in path.tolist() if v >= 0], int(nxt)
    kids, depth, verdict = children(parents), depths(parents), walk_verdicts(parents, path)
    at = [v for v in range(len(parents)) if kids[v]]
    step["nodes"], step["path"] = [], path
    probs, drawn = calls.sample[-1]  # (N, V) each node's law if the walk stops there, (N,) its draw
    last = path[-1] if path else 0
    should = a["p_target"][last]  # a leaf: the bonus law
    if at:
        P, q, x, accept = calls.accept[0]  # (K, W, V) the law left before child j, (K, W, V), (K, W), (K, W)
        p_x, q_x, acc = (t.reshape(len(at), -1).tolist() for t in (P.gather(-1, x[..., None])[..., 0],
                                                                    q.gather(-1, x[..., None])[..., 0], accept))
        u = uniforms(calls, accept.numel())
        u = None if u is None else [u[i * len(acc[0]):(i + 1) * len(acc[0])] for i in range(len(at))]
        for i, v in enumerate(at):
            # what child j should be judged against: p once children 1..j-1 were rejected, and q without them
            x_v = torch.tensor([int(tokens[c]) for c in kids[v]], device=P.device)
            q_should, p_should = verify.without_replacement_proposals(a["q_draft"][v], x_v), a["p_target"][v]
            for j, c in enumerate(kids[v]):
                gap = max((P[i, j].double() - p_should.double()).abs().max(),
                          (q[i, j].double() - q_should[j].double()).abs().max())
                step["nodes"].append(guess(c, tokens[c], depth[c], p_x[i][j], q_x[i][j], acc[i][j],
                                           u[i][j] if u else None, verdict=verdict[c], gap=num(gap, 3)))
                p_should = verify.residual(p_should, q_should[j])
            if v == last:  # every child rejected: the law left after the last of them
                should = p_should
        step["nodes"].sort(key=lambda g: g["node"])
    step["law"] = law_of("residual" if kids[last] else "bonus", probs[last], nxt, int(drawn[last]), last,
                         gap=(probs[last].double() - should.double()).abs().max())


def tree_traversal(step, a, calls, result):
    """verify_tree_traversal: the walk from the leaves up; each tested node passes when its uniform is below its
    weight w (the chance the output runs through it); the token after comes from the law where the walk stopped,
    by the inverse CDF of the last uniform."""
    p_target, q_draft, tokens, parents = a["p_target"], a["q_draft"], a["tokens"], [int(v) for v in a["parents"]]
    path, nxt = result
    N, depth = len(parents), depths(parents)
    u = uniforms(calls, N + 1)
    tests, _, law = calls.traversal[0]
    tested = traversal_order(parents, [passed for _, passed in tests])
    step["order"] = [[node, num(w), num(u[i]) if u else None, passed]
                     for i, (node, (w, passed)) in enumerate(zip(tested, tests))]
    by_node = {node: (w, ui, passed) for node, w, ui, passed in step["order"]}
    step["nodes"] = []
    for c in range(1, N):
        x, v = int(tokens[c]), parents[c]
        w, ui, passed = by_node.get(c, (None, None, None))
        step["nodes"].append(guess(c, x, depth[c], p_target[v, x], q_draft[v, x], u=ui, w=w,
                                   verdict="accepted" if c in path else "rejected" if passed is False else "unused"))
    step["path"] = list(path)
    drawn = None
    if u:  # traversal's own last step: the token at the last uniform's place in the law's CDF
        cdf = law.cumsum(0)
        drawn = int(torch.searchsorted(cdf, torch.tensor([u[N] * cdf[-1].item()], dtype=cdf.dtype), right=True))
        step["u_token"] = num(u[N])
    step["law"] = law_of("traversal", law, nxt, drawn, path[-1] if path else 0)


def tree_typical(step, a, calls, result):
    """typical_accept (LOSSY): a guess passes when p(x) exceeds its parent's threshold, min(posterior_threshold,
    posterior_alpha * exp(-H(p))); no uniform; the deepest path of passing guesses is kept."""
    p_target, tokens, parents = a["p_target"], a["tokens"], [int(v) for v in a["parents"]]
    entropy = torch.special.entr(p_target).sum(-1)  # (N,) as the rule computes it
    threshold = torch.clamp(a["posterior_alpha"] * torch.exp(-entropy), max=a["posterior_threshold"]).tolist()
    path, nxt = result
    path = [v for v in path.reshape(-1).tolist() if v >= 0]
    depth = depths(parents)
    step["nodes"] = []
    for c in range(1, len(parents)):
        x, v = int(tokens[c]), parents[c]
        p = float(p_target[v, x])
        step["nodes"].append(guess(c, x, depth[c], p, 1.0, threshold=num(threshold[v]), passed=p > threshold[v],
                                   verdict="accepted" if c in path else "rejected" if p <= threshold[v] else "unused"))
    step["path"], step["lossy"] = path, True
    probs, drawn = calls.sample[-1]
    last = path[-1] if path else 0
    step["law"] = law_of("p", probs.reshape(-1, probs.size(-1))[0], int(nxt.reshape(-1)[0]),
                         int(drawn.reshape(-1)[0]), last)


GREEDY = {  # verify_step's greedy shortcuts, by name -> (the trace's name for the rule, what it recorded)
    "verify_chain_greedy": ("greedy", chain_greedy),
    "verify_chain_coupled": ("coupled", chain_coupled),  # sampling, but greedy's rule on the races' winners
    "verify_tree_greedy": ("greedy", tree_greedy),
}
RULES = {  # (a rule of options.VERIFY_RULES, the guesses it judged) -> (the trace's name for it, what it recorded)
    ("token", "chain"): ("token", chain_token),
    ("block", "chain"): ("block", chain_block),
    ("token", "fixed_tree"): ("descend", tree_descend),
    ("token", "drawn_tree"): ("token", tree_token),
    ("traversal", "drawn_tree"): ("traversal", tree_traversal),
    ("typical", "fixed_tree"): ("typical", tree_typical),
}


# ---------------------------------------------------------------------------------------------------------
# The recorder


def holders(function):
    """Where nanospec holds `function`, as (object, name) pairs: its module and the modules that imported it by name
    (the methods import chain_step and tree_step), and the rules of options.VERIFY_RULES that run it."""
    modules = [(module, function.__name__) for module in list(sys.modules.values())
               if getattr(module, "__name__", "").startswith("nanospec")
               and getattr(module, function.__name__, None) is function]
    return modules + [(rule, kind) for rule in VERIFY_RULES.values() for kind in KINDS
                      if getattr(rule, kind) is function]


class Traced:
    """The target, each forward of it noted in the trace (tokens read, the cache length before), as timing.Timed
    notes its seconds. A call that drafts (early-exit's first layers: run.drafts) is not a target forward. Every
    other attribute is the target's."""

    def __init__(self, model, trace):
        self.model, self.trace = model, trace

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, idx, **kwargs):
        if not drafts(self.model, **kwargs):
            self.trace.forward(idx, kwargs.get("cache"))
        return self.model(idx, **kwargs)


def cached(cache):
    """The tokens every layer of the cache holds (early-exit's first layers run ahead of the others)."""
    return None if cache is None else cache.length


class Trace:
    """One generation's steps, recorded while `recording` is open; `models` is what the method must be given."""

    def __init__(self, models):
        self.models = replace(models, target=Traced(models.target, self))
        self.steps, self.step, self.cache = [], {}, None

    def forward(self, idx, cache):
        self.step["forwards"] = self.step.get("forwards", 0) + 1
        self.step["read"], self.step["cache_before"], self.cache = int(idx.size(-1)), cached(cache), cache

    def close(self, run, produced, drafted, kept):
        """Run.emit was called: the step of this forward is complete."""
        step, self.step = self.step, {}
        step.setdefault("kind", "prefill" if not self.steps else "plain")
        before = step.pop("cache_before", None)
        step.update(forward=run.target_forwards, cache=[before, cached(self.cache)], emitted=[int(t) for t in kept],
                    produced=[int(t) for t in produced], drafted=int(drafted),
                    tokens_per_forward=num(len(run.out) / run.target_forwards, 4))
        self.steps.append(step)

    def patches(self):
        """(object, name, wrapper) for every place the trace records from."""
        trace = self
        emit, run_sample = run_module.Run.emit, run_module.Run.sample
        update = adaptive.DraftLength.update

        def emit_(run, tokens, drafted=0):
            before = len(run.out)
            done = emit(run, tokens, drafted)
            trace.close(run, tokens, drafted, run.out[before:])
            return done

        def sample_(run, logits):  # a plain step's token (ar, and every method's first): the target's law
            token = run_sample(run, logits)
            greedy = run.sampling.greedy
            probs = torch.softmax(logits.double(), -1) if greedy else warp(logits, *run.sampling)
            trace.step["law"] = law_of("argmax" if greedy else "p", probs, token, drawn=token)
            return token

        def update_(policy, drafted, accepted):
            k = policy.k
            update(policy, drafted, accepted)
            if policy.rule != "off":
                trace.step["adaptive"] = {"rule": policy.rule, "k": k, "next": policy.k}
                if policy.rule == "cost":
                    trace.step["adaptive"]["chances"] = [num(c, 3) for c in policy.price.chances()]

        own_token = verify_step.own_token

        def own_token_(logits, sampling, generator):  # a drafting method's plain step (no guesses): the target's
            tokens = own_token(logits, sampling, generator)  # own token, from logits (1, V), as Run.sample's
            greedy = sampling.greedy
            probs = torch.softmax(logits[0].double(), -1) if greedy else warp(logits[0], *sampling)
            trace.step["law"] = law_of("argmax" if greedy else "p", probs, tokens[0], drawn=tokens[0])
            return tokens

        patches = [(run_module.Run, "emit", emit_), (run_module.Run, "sample", sample_),
                   (adaptive.DraftLength, "update", update_), (verify_step, "own_token", own_token_)]
        for name, (rule, record) in GREEDY.items():
            patches.append((verify_step, name, self.judged(getattr(verify_step, name), rule, record)))
        for (name, kind), (rule, record) in RULES.items():
            patches.append((VERIFY_RULES[name], kind, self.judged(getattr(VERIFY_RULES[name], kind), rule, record)))
        for name, kind in (("chain_step", "chain"), ("tree_step", "tree")):
            step = getattr(verify_step, name)
            wrapper = self.sent(step, kind)
            patches += [(holder, attribute, wrapper) for holder, attribute in holders(step)]
        return patches

    def sent(self, step_function, kind):
        """chain_step or tree_step, noting the guesses the method sends (one row)."""
        signature = inspect.signature(step_function)

        def wrapper(*args, **kwargs):
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            if kind == "chain" and len(a["last"]) == 1:
                tokens = [int(a["last"][0])] + [int(t) for t in a["drafts"][0]]
                self.step.update(kind="chain", tokens=tokens, parents=list(range(-1, len(tokens) - 1)))
            elif kind == "tree":
                self.step.update(kind="tree", tokens=[int(t) for t in a["tokens"]],
                                 parents=[int(v) for v in a["parents"]])
            guessed = (None if a["sampling"].greedy else "coupled" if a.get("noise") is not None  # greedy: every
                       else "fixed" if a["q_draft"] is None else "drawn")
            self.step.update(guessed=guessed, verify=a["rule"])  # rule follows the argmax, however they were made
            return step_function(*args, **kwargs)
        return wrapper

    def judged(self, rule_function, rule, record):
        """A rule of verify_step, run inside `capturing`, then what it did recorded into the step."""
        signature = inspect.signature(rule_function)

        def wrapper(*args, **kwargs):
            with capturing() as calls:
                result = rule_function(*args, **kwargs)
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            self.step["rule"] = rule
            try:
                record(self.step, a.arguments, calls, result)
            except Exception as e:  # noqa: BLE001 (a rule that draws or answers otherwise, a student's own:
                self.step["unrecorded"] = f"{type(e).__name__}: {e}"  # said in the trace, never a crash)
            return result
        return wrapper

    def document(self, tokenizer, prompt_ids, ids, stats, settings=None):
        """The trace as one JSON-able dict: the settings, the prompt, the output, the run's stats, the text of every
        token it names, the steps, and `problems` (check's answer)."""
        decode = tokenizer.decode if tokenizer is not None else lambda t: "".join(f"<{v}>" for v in t)
        used = set(prompt_ids) | set(ids)
        for s in self.steps:
            g = min(len(s.get("path", [])), len(s["emitted"]))  # the accepted guesses it kept, then its own token
            s["text"] = [decode(s["emitted"][:g]), decode(s["emitted"][g:])]
            used |= set(s.get("tokens", [])) | set(s["produced"]) | {t for t, _ in s.get("law", {}).get("top", [])}
            used |= {g["draw"] for g in s.get("nodes", []) if g["draw"] is not None}
        doc = {"format": FORMAT, "version": VERSION, "settings": settings or {}, "prompt": decode(list(prompt_ids)),
               "ids": [int(t) for t in ids], "stats": stats, "vocab": {str(t): decode([t]) for t in sorted(used)},
               "steps": self.steps}
        doc["problems"] = check(doc)
        return doc


@contextmanager
def recording(models):
    """`with recording(models) as trace:` run a method on trace.models; trace.steps holds its steps after."""
    if getattr(run_module.Run.emit, "__qualname__", "").startswith("Trace."):
        raise RuntimeError("a trace is already recording: one generation at a time")
    trace = Trace(models)
    with patched(trace.patches()):
        yield trace


def traced_run(models, run_method, prompt_ids, path, settings, argv):
    """One run recorded and written to `path` (.html or .json): what `decode.py --trace` and `make figures`'
    trace.png both do. `run_method(models) -> (ids, stats)` runs the method on the models it is given (the traced
    ones); `settings` are what the page shows of the run, to which the command line that repeats it is added:
    'python decode.py ' and `argv`, each argument quoted for a shell. Returns (ids, stats, the trace, bytes
    written)."""
    with recording(models) as trace:
        ids, stats = run_method(trace.models)
    command = "python decode.py " + shlex.join(argv)
    doc = trace.document(models.tokenizer, prompt_ids, ids, stats, {**settings, "command": command})
    return ids, stats, doc, write(path, doc)


# ---------------------------------------------------------------------------------------------------------
# Checking a trace: does every verdict follow from its randomness and probabilities?


def check(doc):
    """What in the trace does not add up, as lines ([] when all does). For every step: one target forward; the tokens
    it produced are its accepted guesses, then the token its law gave; the cache after holds the cache before plus
    the root and the accepted guesses (plain steps: what the forward read); the accepted guesses form a path from
    the root. For every judged guess, its rule's verdict: a uniform u accepts when u < accept, and accept =
    min(1, p/q) (token rule, a chain or a tree); a draw (greedy's argmax, sample and match) accepts the guess that
    holds it and the token emitted is the draw where the walk stopped; block: the longest prefix whose test u < h
    passes; traversal: each tested node passes when u < w, and the path ends where a test passed; typical: every
    kept guess is above its threshold. The law the chain and tree rules drew the token from is the one the rule
    prescribes (gap). And all steps together: the output, and the run's target forwards."""
    problems = []
    for s in doc["steps"]:
        at = f"step {s['forward']}"
        if s.get("forwards") != 1:
            problems.append(f"{at}: {s.get('forwards', 0)} target forwards in one step")
        if "unrecorded" in s:
            problems.append(f"{at}: the rule's decisions could not be read ({s['unrecorded']})")
            continue
        produced, law, before_after = s["produced"], s.get("law"), s["cache"]
        if produced[:len(s["emitted"])] != s["emitted"]:
            problems.append(f"{at}: kept {s['emitted']}, which is not the start of what it produced, {produced}")
        if law is None or law["token"] != produced[-1]:
            problems.append(f"{at}: its last token {produced[-1]} is not the one its law gave")
        elif law.get("drawn") is not None and law["drawn"] != law["token"]:
            problems.append(f"{at}: emitted {law['token']} where the law's draw gave {law['drawn']}")
        if law and law.get("gap") is not None and law["gap"] > 1e-5:
            problems.append(f"{at}: the token was drawn from a law {law['gap']:.3g} away from the {law['name']}")
        if "rule" not in s:
            if before_after[1] != before_after[0] + s["read"]:
                problems.append(f"{at}: the cache went {before_after[0]} -> {before_after[1]} over {s['read']} tokens")
            continue
        tokens, parents, path = s["tokens"], s["parents"], s["path"]
        if path and path_to(parents, path[-1])[1:] != path:
            problems.append(f"{at}: the accepted nodes {path} are not a path from the root")
        if produced[:-1] != [tokens[c] for c in path]:
            problems.append(f"{at}: produced {produced[:-1]} before its own token, not the accepted guesses "
                            f"{[tokens[c] for c in path]}")
        if before_after[1] != before_after[0] + 1 + len(path):
            problems.append(f"{at}: the cache went {before_after[0]} -> {before_after[1]}, not to the root and "
                            f"{len(path)} accepted guesses")
        problems += [f"{at}, guess {line}" for line in verdict_problems(s)]
    out = [t for s in doc["steps"] for t in s["emitted"]]
    if out != doc["ids"]:
        problems.append(f"the steps emitted {len(out)} tokens that are not the output's {len(doc['ids'])}")
    if len(doc["steps"]) != doc["stats"].get("target_forwards"):
        problems.append(f"{len(doc['steps'])} steps for {doc['stats'].get('target_forwards')} target forwards")
    return problems


def verdict_problems(s):
    """check's rule-specific part for one step: the guesses whose verdict does not follow."""
    rule, path, problems = s["rule"], set(s["path"]), []
    for g in s["nodes"]:
        node, verdict = g["node"], g["verdict"]
        if (verdict == "accepted") != (node in path):
            problems.append(f"{node}: marked {verdict} but {'on' if node in path else 'off'} the path")
        if verdict == "unused":
            continue
        if (g.get("gap") or 0) > 1e-5:
            problems.append(f"{node}: judged against a p or q {g['gap']:.3g} away from what is left of them once the "
                            f"children before it were rejected")
        if rule == "token" and g["u"] is not None:
            p, q, a = g["p"], g["q"], g["accept"]
            should = capped(p, q)
            if abs(a - should) > 1e-4 * max(should, 1e-3):
                problems.append(f"{node}: accept {a:.6g} is not min(1, p/q) = min(1, {p:.6g}/{q:.6g})")
            if (g["u"] < a) != (verdict == "accepted"):
                problems.append(f"{node}: u = {g['u']:.6g} against accept {a:.6g}, yet {verdict}")
        elif rule in ("greedy", "descend", "coupled"):
            if (g["x"] == g["draw"]) != (verdict == "accepted"):
                problems.append(f"{node}: token {g['x']} against the target's {g['draw']}, yet {verdict}")
        elif rule == "block" and g["u"] is not None:
            if g["u"] < g["h"] and node > len(path):
                problems.append(f"{node}: its prefix passed (u {g['u']:.6g} < h {g['h']:.6g}) but a shorter one won")
        elif rule == "typical" and verdict == "accepted" and not g["passed"]:
            problems.append(f"{node}: kept with p {g['p']:.6g} under its threshold {g['threshold']:.6g}")
    if rule == "block" and len(path) and s["nodes"][len(path) - 1]["u"] is not None:
        g = s["nodes"][len(path) - 1]
        if not g["u"] < g["h"]:
            problems.append(f"{g['node']}: kept with u {g['u']:.6g} >= h {g['h']:.6g}, its prefix's test failed")
    if rule == "traversal":
        order = s["order"]
        for node, w, u, passed in order:
            if u is not None and (u < w) != passed:
                problems.append(f"{node}: tested u = {u:.6g} against w = {w:.6g}, yet "
                                f"{'passed' if passed else 'failed'}")
        end = order[-1][0] if order and order[-1][3] else 0
        if path_to(s["parents"], end)[1:] != s["path"]:
            problems.append(f"{end}: the walk passed there, but the path kept is {s['path']}")
    return problems


# ---------------------------------------------------------------------------------------------------------
# Files: where a trace may go, and writing it


def check_path(path):
    """A one-line ValueError unless `path` can take a trace: its name ends in .html (a page) or .json, it is not a
    folder, its folder exists and can be written, and a file already there is a trace (any other file is never
    replaced)."""
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        raise ValueError(f"--trace {path} is a folder: give a file name ending in .html (a page) or .json")
    if ext not in EXTENSIONS:
        raise ValueError(f"--trace {path}: a trace is written as .html (a page to open in a browser) or .json (for "
                         f"scripts), not {repr(ext) if ext else 'a name without an extension'}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"--trace {path}: {folder} {what}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--trace {path}: cannot write there (permission denied)")
    if os.path.exists(path) and not is_trace(path):
        raise ValueError(f"--trace {path} exists and is not a nanospec trace: left as it is; choose another name")


def is_trace(path):
    """Is the file at `path` a trace this module wrote (a page with MARK, or JSON of FORMAT)?"""
    try:
        with open(path, "rb") as f:
            if path.lower().endswith(".html"):
                return MARK.encode() in f.read(4096)
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def as_json(doc):
    """The trace as compact JSON; a float that is not finite (a stat the run divided by zero) becomes null, which
    every JSON reader takes (NaN is not JSON)."""
    def finite(x):
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x
    return json.dumps(finite(doc), separators=(",", ":"), allow_nan=False)


def page(doc):
    """The self-contained page: page.html with the trace in its data block. The JSON is escaped so that no
    '<' (hence no '</script>') can appear in it."""
    with open(PAGE, encoding="utf-8") as f:
        template = f.read()
    data = as_json(doc)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return template.replace("__TRACE_JSON__", data)


def write(path, doc):
    """Write the trace to `path` (.html: the page; .json: the document), whole or not at all. Returns the bytes
    written; a one-line ValueError when the file cannot be written."""
    data = page(doc) if path.lower().endswith(".html") else as_json(doc)
    try:
        write_atomic(path, data)
    except OSError as e:
        raise ValueError(f"cannot write the trace to {path}: {e.strerror or e}") from None
    return len(data.encode("utf-8"))
