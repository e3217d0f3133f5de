"""Block verification (verify.block_acceptance, verify_block) and traversal verification, its form for trees of
drawn guesses (verify.traverse_tree, verify_tree_traversal): the target's law, exactly, and at least as many guesses
accepted as the token rules, never fewer.

The proofs are exact enumerations: random context-dependent target and draft laws p(. | prefix), q(. | prefix) on a
vocabulary of 2 or 3 tokens; every draft the drafter can make, with its probability; every outcome of the rule's
own tests, with theirs (`outcomes` runs the walk once per sequence of coin results); each output sequence finished
with the target's own continuation to a fixed length. That law must equal the target's to 1e-12, and the expected
number of accepted guesses must be at least the token rule's, computed the same way. Negative controls: the
broken rules the engines shipped or reviewers asked for (the token rule's residual inside a block, a weight off by
one position, no cap on the weight, a bonus from the target's original row after a rejection, draws shared between
siblings' subtrees), each an edit of the real source, each caught by the same enumeration. Then the samplers against
their exact laws, and the methods end to end with --verify block and --verify traversal."""
import inspect
import itertools
import textwrap

import pytest
import torch

from nanospec.rules import verify
from nanospec.decoding import METHODS
from nanospec.model.load import Models
from nanospec.rules.tree import children, depths, path_to
from nanospec.rules.verify import (block_acceptance, traverse_tree, verify_block,
                             verify_chain_greedy, verify_tree_traversal, without_replacement_proposals)
from laws import (F64, P_BIGRAM, PAPER_P, PAPER_Q, START, V3, bigram_law, block_law, chain_rows, empirical_law,
                  exact_law, finish, gap, method_law, prefix_laws, run_chain, sequence_codes, target_law, tv, tv_bound)
from toys import SAMPLING_MODEL, tiny_gpt

# ---------------------------------------------------------------------------------------------------------
# Block verification of a chain


def test_the_papers_example():
    """p = [1/3, 2/3], q = [2/3, 1/3] at both positions: drafts [0, 1] have weights [1, 1/2, 1], so both are
    always accepted; over every draft, 11/9 accepted per step against the token rule's 10/9."""
    h, _ = block_acceptance(PAPER_P.expand(1, 3, 2), PAPER_Q.expand(1, 2, 2), torch.tensor([[0, 1]]))
    assert h[0, 2].item() == 1.0 and h[0, 0].item() == pytest.approx(1.0, abs=1e-12)
    table = {prefix: (PAPER_P, PAPER_Q) for n in range(3) for prefix in itertools.product(range(2), repeat=n)}
    law, accepted, token_accepted = block_law(block_acceptance, table, 2, 2)
    assert accepted == pytest.approx(11 / 9, abs=1e-12) and token_accepted == pytest.approx(10 / 9, abs=1e-12)
    assert gap(law, target_law(table, 2, 3)) < 1e-12


@pytest.mark.parametrize("V, k", [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)])
def test_block_law_is_the_targets_and_never_accepts_fewer(V, k):
    """Exact enumeration on three random context-dependent (p, q): the law of the first k+1 tokens is the target's,
    and the expected accepted drafts are at least the token rule's, strictly more somewhere once k >= 2."""
    better = 0.0
    for seed in range(3):
        table = prefix_laws(V, k, seed)
        law, accepted, token_accepted = block_law(block_acceptance, table, V, k)
        assert gap(law, target_law(table, V, k + 1)) < 1e-12, (seed, gap(law, target_law(table, V, k + 1)))
        assert accepted >= token_accepted - 1e-12, (seed, accepted, token_accepted)
        better = max(better, accepted - token_accepted)
    assert (better > 1e-3) == (k >= 2), better  # one draft: the block rule is the token rule


def edited(function, old, new):
    """`function` with `old` (there exactly once in its source) replaced by `new`: a wrong rule made from the
    real one, so the control tracks the code it tests."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"the edit {old!r} no longer applies to {function.__name__}"
    scope = dict(vars(verify))
    exec(compile(source.replace(old, new), f"<edited {function.__name__}>", "exec"), scope)
    return scope[function.__name__]


UNCAPPED_WEIGHT = "w.append(torch.where(q_x[:, i] > 0, w[-1] * p_x[:, i] / q_x[:, i], (w[-1] * p_x[:, i] > 0) * 1.0))"
BROKEN_BLOCKS = {
    # the token rule's residual max(p - q, 0) at the stopping point, not the block's max(w p - q, 0)
    "token residual": ("excess = (w[:, :k, None] * p_target[:, :k] - q_draft)", "excess = (p_target[:, :k] - q_draft)"),
    # each position's test built from the next position's weight
    "weight off by one": ("fail = mass + 1 - w[:, :k]", "fail = mass + 1 - w[:, 1:]"),
    # the weight as a plain cumulative ratio (q(x) = 0 as verify.capped_ratio has it), never capped at 1
    "no cap": ("w.append(capped_ratio(w[-1] * p_x[:, i], q_x[:, i]))", UNCAPPED_WEIGHT),
}


@pytest.mark.parametrize("name", BROKEN_BLOCKS)
def test_the_enumeration_catches_a_broken_block_rule(name):
    broken = edited(block_acceptance, *BROKEN_BLOCKS[name])
    worst = max(gap(block_law(broken, table, 3, 2)[0], target_law(table, 3, 3))
                for table in (prefix_laws(3, 2, seed) for seed in range(3)))
    assert worst > 1e-3, f"{name}: law within {worst:.2g} of the target's, the enumeration cannot see it"


def test_greedy_block_is_the_argmax_match():
    """One-hot p and q (greedy): accept while the draft is the argmax, like verify_chain_greedy."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(5, 4, generator=g, dtype=F64)  # (k+1, V)
        best = logits.argmax(-1)
        drafts = torch.where(torch.rand(4, generator=g) < 0.7, best[:4], torch.randint(0, 4, (4,), generator=g))
        p = torch.nn.functional.one_hot(best, 4).to(F64)
        q = torch.nn.functional.one_hot(drafts, 4).to(F64)
        assert tuple(int(v) for v in verify_block(p, q, drafts, g)) == verify_chain_greedy(logits, drafts.tolist())


def test_the_sampler_follows_its_exact_probabilities():
    """verify_block on 200000 copies of one step against the law block_acceptance gives (bound from
    tv_bound over the (k+1) * V outcomes (n_accepted, next token), failure probability 1e-6)."""
    table = prefix_laws(3, 2, 1)
    drafts = (0, 2)
    p, q = chain_rows(table, drafts)
    h, emit = (t[0] for t in block_acceptance(p, q, torch.tensor([drafts])))
    exact = torch.stack([(h[j] if j else 1.0) * torch.prod(1 - h[j + 1:]) * emit[j] for j in range(3)]).flatten()
    n = 200_000
    acc, nxt = verify_block(p.expand(n, -1, -1), q.expand(n, -1, -1), torch.tensor([drafts] * n),
                                    torch.Generator().manual_seed(0))
    assert tv(empirical_law(acc * 3 + nxt, 9), exact) < tv_bound(9, n)


def test_a_block_verified_chain_loop_keeps_the_law():
    """tests/laws.py's speculative loop (run_chain: bigram target and draft, 4 tokens) with the block rule; and
    the same statistic sees the token rule's residual inside a block."""
    def block(p_target, q_draft, drafts, g):
        return verify_block(p_target, q_draft[:, :-1], drafts, g)

    seqs = run_chain(block, L=4, k=3, n=60_000)
    law = empirical_law(sequence_codes(seqs, V3), V3 ** 4)
    assert tv(law, bigram_law(P_BIGRAM, START, 4)) < tv_bound(V3 ** 4, 60_000)
    broken = edited(block_acceptance, *BROKEN_BLOCKS["token residual"])

    def broken_block(p_target, q_draft, drafts, g):
        h, emit = broken(p_target, q_draft[:, :-1], drafts)
        u = torch.rand(h.shape, generator=g, dtype=h.dtype)
        n = torch.where((u < h) | (torch.arange(h.size(1)) == 0), torch.arange(h.size(1)), 0).max(-1).values
        return n, verify.sample(emit[torch.arange(len(n)), n], g)

    seqs = run_chain(broken_block, L=4, k=3, n=60_000)
    law = empirical_law(sequence_codes(seqs, V3), V3 ** 4)
    assert tv(law, bigram_law(P_BIGRAM, START, 4)) > tv_bound(V3 ** 4, 60_000)


# ---------------------------------------------------------------------------------------------------------
# Traversal verification of a tree of drawn guesses


def outcomes(walk):
    """Every way walk(coin) can go, with its probability: [(probability, result)], coin(prob) being True with
    probability prob. The walk is rerun once per sequence of coin results."""
    done, todo = [], [()]
    while todo:
        script, taken = todo.pop(), []

        def coin(prob):
            if len(taken) == len(script):
                raise LookupError  # a coin beyond the script: branch on it
            taken.append(prob if script[len(taken)] else 1 - prob)
            return script[len(taken) - 1]

        try:
            result = walk(coin)
        except LookupError:
            todo += [script + (True,), script + (False,)]
            continue
        done.append((torch.tensor(taken, dtype=F64).prod().item(), result))
    return done


def ordered_draws(q, m):
    """Every ordered tuple of m distinct tokens drawn without replacement from q, with its probability."""
    for xs in itertools.permutations(range(q.numel()), m):
        prob, left = 1.0, 1.0
        for x in xs:
            prob, left = prob * q[x].item() / left if left > 0 else 0.0, left - q[x].item()
        if prob > 0:
            yield xs, prob


def drawn_trees(table, parents, shared=False):
    """Every tree of guesses a drafter draws in the shape `parents` (each node's children without replacement
    from q at its prefix, independently of every other node's), with its probability: [(tokens, prob)].
    shared: every node of a depth takes the draws of that depth's first node, as medusa's trees once did."""
    kids, depth = children(parents), depths(parents)
    trees = [([0] * len(parents), 1.0)]
    for u in [u for u in range(len(parents)) if kids[u]]:
        first = next(v for v in range(len(parents)) if kids[v] and depth[v] == depth[u])
        grown = []
        for tokens, prob in trees:
            if shared and first != u:  # the same tokens below u as below the first node of its depth
                t = list(tokens)
                for c, c_first in zip(kids[u], kids[first]):
                    t[c] = tokens[c_first]
                grown.append((t, prob))
                continue
            prefix = tuple(tokens[n] for n in path_to(parents, u)[1:])
            for xs, p_draws in ordered_draws(table[prefix][1], len(kids[u])):
                t = list(tokens)
                for c, x in zip(kids[u], xs):
                    t[c] = x
                grown.append((t, prob * p_draws))
        trees = grown
    return trees


def tree_rows(table, tokens, parents):
    prefixes = [tuple(tokens[n] for n in path_to(parents, v)[1:]) for v in range(len(parents))]
    return (torch.stack([table[s][0] for s in prefixes]), torch.stack([table[s][1] for s in prefixes]))


def top_down_accepted(P, Q, tokens, parents):
    """The expected accepted nodes of verify_tree_without_replacement (root down), computed exactly."""
    kids = children(parents)

    def below(u, target):
        expected, reach = 0.0, 1.0
        proposals = without_replacement_proposals(Q[u], torch.tensor([tokens[c] for c in kids[u]])) if kids[u] else []
        for c, q in zip(kids[u], proposals):
            x = tokens[c]
            a = min(1.0, (target[x] / q[x]).item())
            expected += reach * a * (1 + below(c, P[c]))
            reach *= 1 - a
            excess = (target - q).clamp(min=0)
            target = excess / excess.sum() if excess.sum() > 0 else target
        return expected

    return below(0, P[0])


def traversal_law(walk, table, parents, V, shared=False):
    """(law of the first depth+1 tokens, expected accepted, the top-down rule's expected accepted)."""
    L = max(depths(parents)) + 1
    law, accepted, top_down = {}, 0.0, 0.0
    for tokens, p_tree in drawn_trees(table, parents, shared):
        P, Q = tree_rows(table, tokens, parents)
        top_down += p_tree * top_down_accepted(P, Q, tokens, parents)
        for p_walk, (path, emit) in outcomes(lambda coin: walk(P, Q, tokens, parents, coin)):
            accepted += p_tree * p_walk * len(path)
            for y in range(V):
                finish(law, tuple(tokens[n] for n in path) + (y,), p_tree * p_walk * emit[y].item(), table, V, L)
    return law, accepted, top_down


SHAPES = {"chain": [-1, 0, 1], "two children": [-1, 0, 0], "one deep": [-1, 0, 0, 1],
          "two deep": [-1, 0, 0, 1, 2], "a fork below": [-1, 0, 1, 1]}


@pytest.mark.parametrize("shape", SHAPES)
def test_traversal_law_is_the_targets_and_never_accepts_fewer(shape):
    """Exact enumeration, V = 3, three random (p, q): the law is the target's, and the expected accepted nodes
    are at least the root-down rule's (verify_tree_without_replacement), the same when the tree is one level."""
    parents = SHAPES[shape]
    for seed in range(3):
        table = prefix_laws(3, max(depths(parents)) + 1, seed)
        law, accepted, top_down = traversal_law(traverse_tree, table, parents, 3)
        assert gap(law, target_law(table, 3, max(depths(parents)) + 1)) < 1e-12
        assert accepted >= top_down - 1e-12, (seed, accepted, top_down)
        if max(depths(parents)) == 1:
            assert accepted == pytest.approx(top_down, abs=1e-12)


def test_on_a_chain_traversal_is_block_verification():
    """A chain of k drafts: the chance of stopping after j is the same under both rules, for every draft."""
    table = prefix_laws(3, 3, 4)
    parents = [-1, 0, 1, 2]
    for drafts in itertools.product(range(3), repeat=3):
        p, q = chain_rows(table, drafts)
        h, _ = block_acceptance(p, q, torch.tensor([drafts]))
        # floats, not tensors: pytest.approx compares numbers (pytest 9.2 refuses a list holding a tensor)
        stop = [(h[0, j].item() if j else 1.0) * torch.prod(1 - h[0, j + 1:]).item() for j in range(4)]
        walked = [0.0] * 4
        P, Q = tree_rows(table, [0, *drafts], parents)
        for prob, (path, _) in outcomes(lambda coin: traverse_tree(P, Q, [0, *drafts], parents, coin)):
            walked[len(path)] += prob
        assert walked == pytest.approx(stop, abs=1e-12)


BROKEN_WALKS = {
    # after the rejections below it, the bonus drawn from the node's original target row
    "bonus from the original row": ("return path, P[node]", "return path, p_target[node]"),
    # the parent's new weight from the rejected token's proposal mass, 1 - Q(x), instead of the failure chance
    "weight from 1 - Q(x)": ("w[u] = R / (R + 1 - w[u]) if R + 1 - w[u] > 0 else 1.0",
                             "w[u] = min(R / (1 - Q[u, x].item()), 1.0) if Q[u, x] < 1 else 1.0"),
}


@pytest.mark.parametrize("name", BROKEN_WALKS)
def test_the_enumeration_catches_a_broken_walk(name):
    broken = edited(traverse_tree, *BROKEN_WALKS[name])
    parents = SHAPES["one deep"]
    worst = max(gap(traversal_law(broken, table, parents, 3)[0], target_law(table, 3, 3))
                for table in (prefix_laws(3, 3, seed) for seed in range(3)))
    assert worst > 1e-3, f"{name}: law within {worst:.2g} of the target's"


def test_draws_shared_between_subtrees_break_the_law():
    """Why traversal needs each node's children drawn on their own (tree_guesses.DrawnTree): with medusa's old
    trees, whose nodes of one depth shared one set of draws, the second sibling's subtree is tried after the
    first's failed with the same tokens, and the law is off."""
    parents = [-1, 0, 0, 1, 2]
    tables = [prefix_laws(3, 3, seed, q_by_depth=True) for seed in range(3)]
    assert max(gap(traversal_law(traverse_tree, t, parents, 3)[0], target_law(t, 3, 3)) for t in tables) < 1e-12
    worst = max(gap(traversal_law(traverse_tree, t, parents, 3, shared=True)[0], target_law(t, 3, 3)) for t in tables)
    assert worst > 1e-3, worst


def test_the_tree_sampler_follows_its_exact_law():
    """verify_tree_traversal (uniforms from the generator, the next token by inverse CDF) against the enumerated
    law of (path, next token) for one drawn tree, 40000 runs."""
    table, parents = prefix_laws(3, 3, 2), SHAPES["two deep"]
    tokens, _ = drawn_trees(table, parents)[5]
    P, Q = tree_rows(table, tokens, parents)
    keys, exact = {}, {}
    for prob, (path, emit) in outcomes(lambda coin: traverse_tree(P, Q, tokens, parents, coin)):
        for y in range(3):
            i = keys.setdefault((tuple(path), y), len(keys))
            exact[i] = exact.get(i, 0.0) + prob * emit[y].item()
    g, n = torch.Generator().manual_seed(0), 40_000
    codes = []
    for _ in range(n):
        path, y = verify_tree_traversal(P, Q, tokens, parents, g)
        codes.append(keys[(tuple(path), y)])
    law = torch.tensor([exact[i] for i in range(len(keys))], dtype=F64)
    assert tv(empirical_law(torch.tensor(codes), len(keys)), law) < tv_bound(len(keys), n)


# ---------------------------------------------------------------------------------------------------------
# The methods, end to end: the first L tokens follow the target's law with --verify block / traversal


@pytest.mark.parametrize("method, options, L, n", [
    ("mtp", {"verify": "block", "draft_sampling": "sample"}, 3, 1500),
    ("mtp", {"verify": "block", "draft_sampling": "topk"}, 2, 800),
    ("medusa", {"verify": "traversal", "tree": "0;1;0,0;1,0"}, 3, 1500),
])
def test_methods_keep_the_law_with_the_joint_rules(method, options, L, n):
    """As test_mtp_medusa.py's law test (V = 5, first L tokens, bound tv_bound(5**L, n) at 1e-6), with the joint
    rules; the guesses must be accepted often enough for the rule to matter."""
    models = Models(target=tiny_gpt(3, **SAMPLING_MODEL))
    prompt, sampling = [1, 2], (1.0, None, None)
    law, accepted = method_law(models, prompt, L, n, method, sampling, **options)
    assert tv(law, exact_law(models.target, prompt, L, sampling)) < tv_bound(5 ** L, n)
    assert accepted > n / 8, accepted
