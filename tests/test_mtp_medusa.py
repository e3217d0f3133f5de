"""`mtp` and `medusa` (the model's own MTP heads as drafters) against `ar`, and the tree machinery under them.

Greedy: token-for-token equality with `ar`, on random tiny models (heads mostly wrong: the rejection paths) and
on a tiny model trained in the test for a second (heads mostly right: long accepted paths), over many prompts
and tree shapes. Sampling: the joint law of the first tokens equals the target's exact law within a stated
bound; Medusa's typical acceptance breaks it (negative control). Trees: the builder's layout, and the KV cache
after each tree step equals one recomputed from the accepted text."""
import random
import sys
from pathlib import Path

import pytest
import torch

from nanospec.model.load import Models
from nanospec.decoding import METHODS
from nanospec.steps.run import new_run, tensor
from nanospec.steps.tree_guesses import fill_tree, medusa_tree, parse_tree
from nanospec.steps.verify_step import tree_step
from nanospec.rules.tree import format_tree, leaf_paths, path_to, print_verified_tree, tree_from_paths, tree_positions
from nanospec.rules.verify import sample, warp
from nanospec.fast.runtime import prepare
from laws import exact_law, method_law, tv, tv_bound
from toys import SAMPLING_MODEL, SAMPLING_TREE, TOL, random_ids, random_tree, shorter_context, tiny_gpt, trained_tiny

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import medusa_tree as tree_script  # noqa: E402  (a script, not a package module)


# ---------------------------------------------------------------------------------------------------------
# The tree builder


def test_tree_from_paths_literal():
    # paths given in any order come out sorted by depth then rank, each parent before its children
    parents, nodes = tree_from_paths([(1,), (0, 1), (0,), (0, 0), (0, 0, 0)])
    assert nodes == [(), (0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert parents == [-1, 0, 0, 1, 1, 3]
    assert tree_positions(parents, 10).tolist() == [10, 11, 11, 12, 12, 13]  # prefix + depth
    assert leaf_paths(parents) == [[0, 2], [0, 1, 4], [0, 1, 3, 5]]
    with pytest.raises(ValueError, match="parent"):
        tree_from_paths([(0,), (1, 0)])  # (1,) is missing


def test_medusa_tree_fills_each_node_with_its_heads_guess():
    candidates = torch.tensor([[5, 3, 8], [9, 2, 4], [1, 6, 7]])  # (D=3 heads, K=3) top-3 ids, best first
    tokens, parents = medusa_tree(7, candidates, [(0,), (1,), (2,), (0, 0), (0, 2), (1, 0), (0, 0, 1)])
    assert parents == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert tokens == [7, 5, 3, 8, 9, 4, 9, 6]
    # every root-to-leaf path reads: root, head 1's pick, head 2's pick, ...
    assert [[tokens[n] for n in p] for p in leaf_paths(parents)] == [[7, 8], [7, 5, 4], [7, 3, 9], [7, 5, 9, 6]]


def test_parse_tree_and_its_errors():
    assert parse_tree("1;0;0,0", max_depth=2, vocab_size=11) == [(0,), (1,), (0, 0)]
    assert parse_tree("chain", max_depth=2, vocab_size=11) == [(0,), (0, 0)]  # presets stop at the last head
    for bad, message in [("0;0,0,0", "deeper"), ("0;1,0", "parent"), ("x", "preset"), ("0;20", "vocabulary")]:
        with pytest.raises(ValueError, match=message):
            parse_tree(bad, max_depth=2, vocab_size=11)
    huge = ";".join([str(r) for r in range(8)] + [f"{r},{s}" for r in range(8) for s in range(40)])  # 328 paths
    for bad in ["0;64", huge]:  # a forward over such a tree costs more than it can accept: a clear error
        with pytest.raises(ValueError, match="at most 256 paths with ranks up to 63"):
            parse_tree(bad, max_depth=2, vocab_size=1000)


def test_fill_tree_topk_and_drawn():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0]], dtype=torch.float64))  # (D=2, V)
    paths = [(0,), (1,), (0, 0), (1, 0), (0, 1)]
    tokens, parents, q = fill_tree(7, logits, paths, (1.0, None, None))  # top-k: point masses, no q
    assert (tokens, parents, q) == ([7, 0, 1, 1, 2, 1], [-1, 0, 0, 1, 1, 2], None)
    g = torch.Generator().manual_seed(0)
    first_children = set()  # (node 3, node 5): the first draws below nodes 1 and 2
    for _ in range(20):  # drawn: siblings are distinct draws; every node of a depth draws from that depth's q
        tokens, parents, q = fill_tree(7, logits, paths, (1.0, None, None), drawn=True, generator=g)
        assert parents == [-1, 0, 0, 1, 1, 2] and tokens[1] != tokens[2] and tokens[3] != tokens[4]
        assert 3 not in tokens[1:]  # token 3 has probability 0
        assert torch.equal(q, warp(logits, 1.0)[[0, 1, 1, 1, 1, 1]])  # row u: u's depth's (a leaf's: unused)
        first_children.add((tokens[3], tokens[5]))
    # each node draws its children on its own (a DrawnTree), not one set of draws shared by a depth: the first
    # children of nodes 1 and 2 differ in some tree (if shared they never would; P(equal 20 times) ~ 0.46^20)
    assert any(a != b for a, b in first_children)
    # top-k 1 leaves one token per depth: the ranks beyond it go, with everything below them
    tokens, parents, q = fill_tree(7, logits, paths, (1.0, 1, None), drawn=True, generator=g)
    assert (tokens, parents) == ([7, 0, 1], [-1, 0, 1])
    with pytest.raises(ValueError, match=r"\(0, 0\) too"):  # rank 1 alone: draw 2 checked as if it were draw 1
        fill_tree(7, logits, [(0,), (0, 1)], (1.0, None, None), drawn=True)


def test_format_tree_literal():
    text = format_tree([-1, 0, 1, 0], lambda n: ["(", "x", ")", "self"][n], marked={0, 1})
    assert text.splitlines() == ["* (", "    * x", "          )", "      self"]


def test_print_verified_tree_literal(capsys):
    """A top-k tree whose paths skip rank 1 says top-3 (its path's rank), not top-2 (its place among siblings);
    without paths, as for a drawn tree, the place among siblings is the rank."""
    tokens, parents = [7, 5, 3, 9], [-1, 0, 0, 1]  # medusa_tree(7, [[5, 4, 3], [9]], [(0,), (2,), (0, 0)])
    print_verified_tree("medusa step 1", tokens, parents, [1], [5, 8], paths=[(0,), (2,), (0, 0)])
    assert capsys.readouterr().out.splitlines() == [
        "medusa step 1: 3 guesses from the heads; * = kept by the target",
        "* 7  (root: the target's own token)",
        "    * 5  head 1 top-1",
        "          9  head 2 top-1",
        "      3  head 1 top-3",
        "-> accepted 1, emitted 5 8 (the last is the target's own)",
        ""]
    print_verified_tree("eagle step 2", tokens, parents, [], [4], drawn=True, drafter="the head", guess="depth")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eagle step 2: 3 guesses from the head; * = kept by the target"
    assert lines[2:5] == ["      5  depth 1 draw-1", "          9  depth 2 draw-1", "      3  depth 1 draw-2"]


def test_show_tree_prints_the_first_two_trees_with_the_kept_path_marked(capsys):
    models = Models(target=tiny_gpt(1, n_future=2))
    ids, stats = METHODS["medusa"](models, [1, 2, 3], 12, tree="0;1;0,0", show_tree=True)
    text = capsys.readouterr().out
    steps = text.split("medusa step ")[1:]
    assert len(steps) == 2 and "(root: the target's own token)" in text and "head 2 top-1" in text
    for step, emitted in zip(steps, stats["accepted_per_step"][1:]):
        lines = step.splitlines()
        assert len([l for l in lines if l.strip().startswith("* ")]) == emitted  # root + accepted guesses
        assert f"-> accepted {emitted - 1}," in step


# ---------------------------------------------------------------------------------------------------------
# Greedy: exactly `ar`


MODELS = {  # name -> Models; built once
    "random n_future=2": lambda: tiny_gpt(1, n_future=2),
    "random n_future=3": lambda: tiny_gpt(2, n_future=3),
    "trained n_future=3": lambda: trained_tiny(3),
}
CASES = [  # (method, options)
    ("mtp", {}),
    ("mtp", {"draft_len": 1}),
    ("medusa", {}),  # the default tree
    ("medusa", {"tree": "large"}),  # 16 paths, up to 6 children per node
    ("medusa", {"tree": "chain"}),  # a single chain, like mtp
    ("medusa", {"tree": "wide"}),  # depth 1, ten children
    ("medusa", {"tree": "0;1;0,0;0,1;1,0;0,0,0;0,1,0"}),
    ("medusa", {"verify": "typical"}),  # typical acceptance is exact under greedy
    ("mtp", {"adaptive": "sweep"}),  # k moves every few steps: the heads the forward ran are sometimes too few
    ("medusa", {"adaptive": "sweep"}),  # (steps.run.heads_at then runs them at the accepted position)
]


@pytest.fixture(scope="module")
def models():
    return {name: Models(target=build()) for name, build in MODELS.items()}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("method, options", CASES)
def test_greedy_equals_ar(models, model_name, method, options):
    """Four prompts of 1 to 19 tokens per model (there were eight, 1 to 22): the random models' rejections and the
    trained one's long accepted paths (checked below) are met with four."""
    m = models[model_name]
    n_future = m.target.config.n_future
    if options.get("tree", "").count(",") >= 2 and n_future < 3:
        pytest.skip("tree deeper than the model's heads")
    accepted, seeds = 0, range(0, 8, 2)
    for seed in seeds:
        prompt = random_ids(1 + 3 * seed, seed=seed)
        expect = METHODS["ar"](m, prompt, 24)[0]
        ids, stats = METHODS[method](m, prompt, 24, **options)
        assert ids == expect, f"prompt {seed}"
        assert sum(stats["accepted_per_step"]) == len(ids) == 24
        accepted += stats["accepted"]
    if model_name.startswith("trained"):  # the test must exercise long accepted paths, not only rejections
        assert accepted >= len(seeds) * 24 // 3, accepted


@pytest.mark.parametrize("method", ["mtp", "medusa"])
def test_stops_at_eot_budget_and_context_like_ar(models, method):
    m = models["trained n_future=3"]
    for prompt, n, block in [(random_ids(5), 7, None), (random_ids(5), 1, None), (random_ids(30), 50, 36)]:
        target = m.target if block is None else shorter_context(m.target, block, n_future=3)
        short = Models(target=target)
        expect, s_ar = METHODS["ar"](short, prompt, n)
        ids, stats = METHODS[method](short, prompt, n)
        assert ids == expect and stats["stop"] == s_ar["stop"]
    full = METHODS["ar"](m, random_ids(4), 20)[0]
    eot = full[9]
    ids, stats = METHODS[method](Models(target=m.target, eot=eot), random_ids(4), 20)
    assert ids == full[:full.index(eot)] and stats["stop"] == "eot"


# ---------------------------------------------------------------------------------------------------------
# tree_step on its own, with trees no Medusa head would build (duplicate siblings, any shape)


def tree_decode(target, prompt, n, make_tree, sampling=(0.0, None, None), seed=0, check_cache=False):
    """A bare tree method: each step verifies the tree make_tree(root, rng) with tree_step."""
    run = new_run(Models(target=target), prompt, n, sampling, seed)
    rng = random.Random(seed)
    cache = target.new_cache()
    logits = target(tensor(prompt, "cpu"), cache=cache).logits[0, -1]  # (V,)
    last = int(sample(warp(logits, *sampling), run.generator))
    done = run.emit([last])
    while not done:
        tokens, parents = make_tree(last, rng)
        emitted, path, out = tree_step(run.sampling, run.generator, target, cache, tokens, parents)
        assert emitted[:-1] == [tokens[i] for i in path] and path == path_to(parents, path[-1] if path else 0)[1:]
        done = run.emit(emitted)
        last = emitted[-1]
        if check_cache and not done:  # the cache must be what a fresh forward over the accepted text builds
            accepted = run.seq[:-1]
            fresh = target.new_cache()
            target(tensor(accepted, "cpu"), cache=fresh)
            L = len(accepted)
            assert cache.length == L
            assert torch.allclose(cache.k[..., :L, :], fresh.k[..., :L, :], atol=TOL)
            assert torch.allclose(cache.v[..., :L, :], fresh.v[..., :L, :], atol=TOL)
    return run.out


def random_tree_with_duplicates(vocab):
    def make(root, rng):
        tokens, parents = random_tree(rng.randrange(1, 14), vocab, rng)
        tokens[0] = root
        if len(tokens) > 2:  # a duplicate sibling: the rule must skip it, not accept the token twice
            tokens.append(tokens[1])
            parents.append(parents[1])
        return tokens, parents
    return make


@pytest.mark.parametrize("seed", range(4))
def test_tree_step_greedy_with_any_tree_and_cache_is_recomputation(seed):
    target = tiny_gpt(seed, n_future=2)
    prompt = random_ids(1 + 2 * seed, seed=seed)
    expect = METHODS["ar"](Models(target=target), prompt, 20)[0]
    got = tree_decode(target, prompt, 20, random_tree_with_duplicates(11), seed=seed, check_cache=True)
    assert got == expect


def test_tree_step_accepts_long_paths_and_keeps_the_cache_exact(models):
    m = models["trained n_future=3"]
    prompt = random_ids(6)
    tree = parse_tree("0;1;0,0;1,0;0,0,0", 3, 11)  # small: 6 + 30 tokens + 6 guesses fit the context of 48
    expect = METHODS["ar"](m, prompt, 30)[0]
    ids, stats = METHODS["medusa"](m, prompt, 30, tree="0;1;0,0;1,0;0,0,0")
    assert ids == expect and max(stats["accepted_per_step"]) >= 3
    # the same run stepped by hand, checking the cache after every step
    run = new_run(m, prompt, 30, seed=0)
    target, cache = m.target, m.target.new_cache()
    out = target(tensor(prompt, "cpu"), cache=cache)
    last, hidden = int(out.logits[0, -1].argmax()), out.hidden[:, -1:]
    done = run.emit([last])
    while not done:
        candidates = target.head_logits(hidden)[0, :, 0].topk(2, dim=-1).indices  # (3 heads, top-2)
        tokens, parents = medusa_tree(last, candidates, tree)
        emitted, path, out = tree_step(run.sampling, run.generator, target, cache, tokens, parents)
        done = run.emit(emitted)
        node = path[-1] if path else 0
        last, hidden = emitted[-1], out.hidden[:, node:node + 1]
        if done:  # the budget may have cut the step's tokens; the cache then holds more than the output
            break
        accepted = run.seq[:-1]
        fresh = target.new_cache()
        target(tensor(accepted, "cpu"), cache=fresh)
        assert cache.length == len(accepted)
        assert torch.allclose(cache.k[..., :cache.length, :], fresh.k[..., :cache.length, :], atol=TOL)
    assert run.out == expect


# ---------------------------------------------------------------------------------------------------------
# Sampling: the target's law, exactly


@pytest.mark.parametrize("method, draft_sampling, L, sampling, n, runtime", [
    ("medusa", "sample", 3, (0.9, None, 0.9), 1500, "eager"),  # top-p leaves some depths fewer tokens than ranks
    ("medusa", "topk", 3, (1.0, None, None), 1500, "eager"),
    ("mtp", "sample", 2, (0.8, 4, None), 1500, "static"),  # warping (temperature, top-k) must reach q and p alike
    ("mtp", "topk", 2, (0.8, 4, None), 800, "eager"),
    ("mtp", "coupled", 3, (0.9, None, 0.9), 1500, "eager"),  # the default: one race per position, drafter and target
    ("mtp", "coupled", 2, (0.8, 4, None), 1500, "static"),
])
def test_sampling_follows_the_target_law(method, draft_sampling, L, sampling, n, runtime):
    """First L tokens, V = 5: 5**L outcomes. With n draws, a correct sampler's empirical law is within
    tv_bound(5**L, n) of the exact law with probability 1 - 1e-6: 0.182 for 125 outcomes and n = 1500; 0.102
    for 25 outcomes and n = 1500, 0.140 for n = 800. (medusa's drawn tree drew 2500, bound 0.141: at 1500 a
    correct run comes out near 0.10 and typical acceptance near 0.96, and a subtler bias, draws with half the
    Gumbel noise, stays under both bounds alike.) (Lossless verification itself is tested far
    more tightly in test_chain_rules.py and test_tree_rules.py; this checks that the methods wire it up right: drawing, warping, tree, cache,
    bonus token.) Both kinds of guesses must be accepted often, or the test would check only the target's tokens.
    mtp's sampled guesses run on the static path (runtime.prepare's models, forwards replayed), which
    test_runtime.py holds to the eager path's tokens: one law test for both (medusa's on the static path:
    test_runtime.py's truncated drawn trees)."""
    models = Models(target=tiny_gpt(3, **SAMPLING_MODEL))
    prompt = [1, 2]
    options = {"tree": SAMPLING_TREE} if method == "medusa" else {}
    law, accepted = method_law(prepare(models, runtime)[0], prompt, L, n, method, sampling,
                               draft_sampling=draft_sampling, **options)
    assert tv(law, exact_law(models.target, prompt, L, sampling)) < tv_bound(5 ** L, n)
    assert accepted > n / 8, accepted


def test_coupled_guesses_in_one_race_for_every_position_are_lossy(monkeypatch):
    """Negative control for coupled drafting: every position must get a race of its own. With one race run at
    every position of a step (the noise of the first repeated), the target's tokens there come out of the same
    clocks, so they agree far more often than its law says: the law test above sees it."""
    import nanospec.decoding.mtp as mtp_module
    real = mtp_module.race_noise

    def one_race(shape, *args):
        noise = real(shape, *args)
        return noise[:, :1].expand_as(noise).contiguous()  # (1, k+1, V): position 0's race everywhere
    monkeypatch.setattr(mtp_module, "race_noise", one_race)
    models = Models(target=tiny_gpt(3, **SAMPLING_MODEL))
    law, _ = method_law(models, [1, 2], 3, 1500, "mtp", (0.9, None, 0.9), draft_sampling="coupled")
    assert tv(law, exact_law(models.target, [1, 2], 3, (0.9, None, 0.9))) > tv_bound(5 ** 3, 1500)


def test_typical_acceptance_is_lossy():
    """Negative control: the test above has the power to see a biased rule. Medusa's typical acceptance takes
    any guess the target finds plausible; on this near-uniform tiny model that is every guess, so the second
    token is whatever the heads ranked first, where the target would spread it over all 5."""
    models = Models(target=tiny_gpt(3, **SAMPLING_MODEL))
    n, sampling = 1000, (1.0, None, None)
    law, _ = method_law(models, [1, 2], 2, n, "medusa", sampling, tree=SAMPLING_TREE, verify="typical")
    exact = exact_law(models.target, [1, 2], 2, sampling)
    assert tv(law, exact) > tv_bound(25, n)  # 0.125; it comes out near 0.7


# ---------------------------------------------------------------------------------------------------------
# scripts/medusa_tree.py: its prediction of greedy decoding's steps is what medusa does


def test_walk_steps_literal():
    rows = torch.tensor([[0, 0, 5], [9, 9, 9], [9, 9, 9], [1, 3, 0], [9, 9, 9], [4, 0, 0]])
    assert tree_script.walk_steps(rows, {(0,), (1,), (0, 0)}) == [3, 2, 1]
    assert tree_script.walk([rows], {(0,), (1,), (0, 0)}) == 2.0


@pytest.mark.parametrize("tree", ["0;1;0,0;0,0,0", "0;1;2;0,0;0,1;1,0;0,0,0"])
def test_walk_predicts_medusas_own_steps(models, tree):
    """The ranks come from one plain forward over prompt + ar's continuation; medusa runs its own tree forwards.
    Their steps agree wherever medusa's tree is not cut short by the end of the budget. The random model's
    heads are right now and then, so steps of every length occur and a walk off by a position would show."""
    m = models["random n_future=3"]
    paths = set(parse_tree(tree, 3, 11))
    n_new, seen = 30, []
    prompts = [random_ids(4 + s, seed=s) for s in range(6)]
    _, per_prompt, _, _, _ = tree_script.measure(m, prompts, n_new)
    for prompt, ranks in zip(prompts, per_prompt):
        predicted = tree_script.walk_steps(ranks, paths)
        stats = METHODS["medusa"](m, prompt, n_new, tree=tree)[1]
        steps = stats["accepted_per_step"][1:]  # [0] is the prefill's one token
        full = [s for i, s in enumerate(predicted) if sum(predicted[:i]) + 1 + 3 < n_new]  # full depth left
        assert steps[:len(full)] == full
        seen += full
    assert {1, 2, 3} <= set(seen)


# ---------------------------------------------------------------------------------------------------------
# The heads run inside the verify forward


def test_a_forward_asked_for_heads_gives_the_same_logits_and_the_heads_own():
    model = tiny_gpt(2, n_future=3)
    ids = torch.tensor([random_ids(9, seed=1)])
    plain = model(ids)
    for n in (1, 2, 3):
        out = model(ids, heads=n)
        assert out.head_logits.shape == (1, n, 9, 11)
        torch.testing.assert_close(out.logits, plain.logits)  # the main head's logits are unchanged
        torch.testing.assert_close(out.head_logits, model.head_logits(plain.hidden, n))  # the heads' own
    assert plain.head_logits is None and model(ids, layers=(0, 1)).head_logits is None  # not asked; stops early


class CountingHeads:
    """A target whose separate head_logits calls are counted (the forward's own heads are not)."""

    def __init__(self, target):
        self.target, self.calls = target, 0

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)

    def head_logits(self, *args):
        self.calls += 1
        return self.target.head_logits(*args)

    def __getattr__(self, name):
        return getattr(self.target, name)


@pytest.mark.parametrize("method, options", [("mtp", {"adaptive": "off"}), ("mtp", {"adaptive": "off", "draft_len": 1}),
                                             ("medusa", {"adaptive": "off"})])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_next_guesses_come_from_the_heads_the_verify_forward_ran(models, method, options, temperature):
    """With k fixed, the heads are called on their own once (after the prompt's forward, which runs no heads);
    every later step's guesses come from the verify forward's (target(..., heads=k)). The tokens are those of a run
    whose heads are all called on their own (the forward asked for none)."""
    m = models["trained n_future=3"]
    counting = CountingHeads(m.target)
    prompt = random_ids(6, seed=3)
    ids, stats = METHODS[method](Models(target=counting), prompt, 24, temperature=temperature, seed=5, **options)
    assert counting.calls == 1 and stats["target_forwards"] > 3

    class NoHeads(CountingHeads):  # the forward ignores `heads`: every guess from a call of its own
        def __call__(self, *args, heads=0, **kwargs):
            return self.target(*args, **kwargs)
    separate = NoHeads(m.target)
    assert METHODS[method](Models(target=separate), prompt, 24, temperature=temperature, seed=5, **options)[0] == ids
    assert separate.calls == stats["target_forwards"]  # one per forward: after the prompt and after each step
