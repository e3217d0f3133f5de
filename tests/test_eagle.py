"""`eagle` (a feature-level draft head growing a tree by confidence) against `ar`, and the head itself.

Greedy: token-for-token equality with `ar` on random tiny float64 models with random heads (guesses mostly wrong)
and on a tiny model trained for a second with a head trained on its features (long accepted paths). The tree:
the batched, masked head passes give exactly the tree a slow sequential oracle grows. The head's cache: after
every step it equals a fresh head run over the accepted text with the target's true features. Sampling: the
joint law of the first tokens equals the target's exact law within a stated bound. Training: the loss falls;
a checkpoint round-trips; a missing head is a clear error."""
from dataclasses import asdict

import pytest
import torch

from nanospec.model.checkpoint import save_atomic
from nanospec.model.load import Models, load_eagle
from nanospec.decoding import METHODS, check_method
from nanospec.decoding import eagle as eagle_method
from nanospec.steps import eagle_tree
from nanospec.steps.options import Sampling
from nanospec.steps.run import tensor
from nanospec.model.cache import KVCache
from nanospec.model.gpt import GPTConfig, Output
from nanospec.model.drafters.eagle import Eagle, EagleConfig, eagle_config
from nanospec.training.drafter_losses import eagle_losses
from nanospec.fast.runtime import prepare
from nanospec.rules.tree import draw_rank_paths, frontier_mask, path_to, tree_from_paths
from nanospec.rules.verify import warp
from laws import empirical_law, exact_law, tv, tv_bound
from toys import TOL, random_head, random_ids, shorter_context, slow_tree, tiny_gpt, trained_tiny


def toy_windows(B, T, V, g):
    """The toy language trained_tiny learns: x -> 3x + 1 mod V, one token in eight random."""
    w = torch.empty(B, T, dtype=torch.long)
    w[:, 0] = torch.randint(0, V, (B,), generator=g)
    for t in range(1, T):
        noise = torch.rand(B, generator=g) < 1 / 8
        w[:, t] = torch.where(noise, torch.randint(0, V, (B,), generator=g), (3 * w[:, t - 1] + 1) % V)
    return w


def train_head(target, steps, seed=0):
    """A head trained on the target's features over the toy language; returns it and its loss per step."""
    torch.manual_seed(seed)
    head = Eagle(eagle_config(target.config)).to(target.wte.weight.dtype).train()  # the standard init
    target.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    g, history = torch.Generator().manual_seed(seed), []
    T, V = min(24, target.config.block_size), target.config.vocab_size
    for _ in range(steps):
        loss = eagle_losses(head, target, toy_windows(16, T, V, g))["total"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    return head.eval(), history


@pytest.fixture(scope="module")
def models():
    random_target = tiny_gpt(1)
    trained = trained_tiny(n_future=2)
    return {"random": Models(target=random_target, eagle=random_head(random_target)),  # EAGLE-1's layer
            "random-mlp": Models(target=random_target, eagle=random_head(random_target, attention=False)),
            "trained": Models(target=trained, eagle=train_head(trained, 60)[0])}  # the default: no attention


# ---------------------------------------------------------------------------------------------------------
# Greedy: exactly `ar`

OPTIONS = [{}, {"tree": "chain", "depth": 5}, {"tree": "dynamic"},  # the default: a chain 2 deep
           {"tree": "dynamic", "depth": 1, "width": 1, "total_tokens": 2},
           {"tree": "dynamic", "depth": 4, "width": 2, "total_tokens": 5},
           {"tree": "dynamic", "depth": 3, "width": 5, "total_tokens": 40}]


@pytest.mark.parametrize("name", ["random", "random-mlp", "trained"])
@pytest.mark.parametrize("options", OPTIONS)
def test_greedy_equals_ar(models, name, options):
    m = models[name]
    accepted = 0
    for seed in range(6):
        prompt = random_ids(1 + 3 * seed, seed=seed)
        expect = METHODS["ar"](m, prompt, 24)[0]
        ids, stats = METHODS["eagle"](m, prompt, 24, **options)
        assert ids == expect, f"prompt {seed}"
        assert sum(stats["accepted_per_step"]) == len(ids) == 24 == stats["new_tokens"]
        accepted += len(ids) - stats["target_forwards"]
    if name == "trained" and options.get("depth", 2) > 1:  # long accepted paths must be exercised too
        assert accepted >= 6 * 24 // 2, accepted


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_stops_at_eot_budget_and_context_like_ar(models, tree):
    m = models["trained"]
    for prompt, n, block in [(random_ids(5), 7, None), (random_ids(5), 1, None), (random_ids(30), 50, 36)]:
        target = m.target if block is None else shorter_context(m.target, block, n_future=2)
        short = Models(target=target, eagle=m.eagle)
        expect, s_ar = METHODS["ar"](short, prompt, n)
        ids, stats = METHODS["eagle"](short, prompt, n, tree=tree)
        assert ids == expect and stats["stop"] == s_ar["stop"]
    full = METHODS["ar"](m, random_ids(4), 20)[0]
    eot = full[9]
    ids, stats = METHODS["eagle"](Models(target=m.target, eagle=m.eagle, eot=eot), random_ids(4), 20, tree=tree)
    assert ids == full[:full.index(eot)] and stats["stop"] == "eot"


# ---------------------------------------------------------------------------------------------------------
# The tree and the head's cache against slow paths


def head_at_root(seed):
    """A random head on a random tiny target, after reading x_1..x_L with the target's true features f_0..f_{L-1}:
    (target, head, seq x_0..x_L (x_L the root), features (L, C), the head's cache, its Output at the root)."""
    target = tiny_gpt(seed)
    head = random_head(target, seed)
    seq = random_ids(4 + seed, seed=seed)
    features = target(tensor(seq[:-1], "cpu")).hidden[0]  # (L, C)
    dcache = head.new_cache()
    return target, head, seq, features, dcache, head(target, tensor(seq[1:], "cpu"), features[None], cache=dcache)


@torch.no_grad()
@pytest.mark.parametrize("seed", range(3))
def test_grow_tree_equals_slow_sequential_oracle(seed):
    target, head, seq, features, dcache, draft = head_at_root(seed)
    for depth, width, total in [(1, 3, 3), (3, 3, 8), (4, 2, 30)]:
        got = eagle_tree.grow_tree(head, target, dcache, seq[-1], draft, depth, width, total)
        assert dcache.length == len(seq) - 1  # the guessed nodes are forgotten
        assert got == slow_tree(head, target, seq[1:], features, seq[-1], depth, width, total)
        tokens, parents = got
        assert len(tokens) == min(total, width + (depth - 1) * width * width + 1)
        assert all(p < i for i, p in enumerate(parents))


def test_draw_rank_paths_and_frontier_mask_literal():
    # reach: (0,) 0.75, (0, 0) 0.56, (1,) 0.19, (0, 1) 0.14, (1, 0) 0.14 (a tie: the smaller path first)
    assert draw_rank_paths(4, depth=2, width=2) == [(0,), (0, 0), (1,), (0, 1)]
    assert draw_rank_paths(5, depth=1, width=3) == [(0,), (1,), (2,)]  # no deeper than 1, no wider than 3
    assert draw_rank_paths(3, depth=5, width=1, accept=0.5) == [(0,), (0, 0), (0, 0, 0)]  # a chain
    fed = {}
    assert frontier_mask(2, fed, [0, 1], [-1, -1, 0]).int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]
    assert frontier_mask(2, fed, [2], [-1, -1, 0]).int().tolist() == [[1, 1, 1, 0, 1]]  # node 2 sees 0 and itself
    assert fed == {0: 0, 1: 1, 2: 2}


def test_grow_tree_worked_example():
    """The docstring's example: logits chosen so q after "(" = {x: 0.6, self: 0.3, ...} and so on."""
    class Head:  # a stand-in head: q depends only on the token fed last
        def __init__(self):
            self.calls = []

        def __call__(self, target, tokens, features, pos=None, cache=None, mask=None):
            q = {0: [0, 0.6, 0.3, 0, 0, 0.1], 1: [0, 0, 0, 0.9, 0.05, 0.04], 2: [0, 0, 0, 0.5, 0.4, 0.1]}
            logits = torch.log(torch.tensor([q[t] for t in tokens[0].tolist()]) + 1e-12)[None]  # (1, T, V)
            if cache is not None:
                cache.advance(tokens.size(1))
            return Output(logits=logits, hidden=torch.zeros(1, tokens.size(1), 4))

    dcache = KVCache(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=16))
    dcache.advance(5)
    head = Head()
    draft = head(None, torch.tensor([[0]]), None)  # tokens: "(" 0, x 1, self 2, ")" 3, "," 4, other 5
    tokens, parents = eagle_tree.grow_tree(head, None, dcache, 0, draft, depth=2, width=2, total_tokens=4)
    assert (tokens, parents) == ([0, 1, 2, 3], [-1, 0, 0, 1])


@pytest.mark.parametrize("name, sampling, tree", [("random", 0.0, "dynamic"), ("random-mlp", 0.0, "dynamic"),
                                                  ("trained", 0.0, "dynamic"),
                                                  ("trained", 1.0, "dynamic"), ("trained", 1.0, "chain"),
                                                  ("trained", 0.0, "chain")])
def test_head_cache_after_each_step_equals_fresh_run_over_accepted_text(models, name, sampling, tree, monkeypatch):
    """After every refresh the head's cache (and its output at the root) must be what a fresh head run over the
    accepted text gives, with the true features of a plain no-cache target forward: no guessed node and no
    predicted feature may survive a step."""
    m = models[name]
    prompt = random_ids(5, seed=3)
    fed, checks = [], []
    real_refresh = eagle_method.refresh

    def checked_refresh(head, target, dcache, tokens, features):
        out = real_refresh(head, target, dcache, tokens, features)
        fed.extend(tokens)
        seq = prompt[:1] + fed  # x_0..x_L: the head holds slots x_1..x_L
        true = target(tensor(seq[:-1], "cpu")).hidden  # (1, L, C) f_0..f_{L-1}, the slow way
        fresh = head.new_cache()
        slow = head(target, tensor(seq[1:], "cpu"), true, cache=fresh)
        L = len(seq) - 1
        assert dcache.length == fresh.length == L
        assert torch.allclose(dcache.k[..., :L, :], fresh.k[..., :L, :], atol=TOL)
        assert torch.allclose(dcache.v[..., :L, :], fresh.v[..., :L, :], atol=TOL)
        assert torch.allclose(out.logits[0, -1], slow.logits[0, -1], atol=TOL)
        checks.append(len(tokens))
        return out

    monkeypatch.setattr(eagle_method, "refresh", checked_refresh)
    ids, stats = METHODS["eagle"](m, prompt, 30, temperature=sampling, seed=0, tree=tree)
    assert fed == prompt[1:] + ids[:len(fed) - len(prompt) + 1]  # the head read exactly the emitted text
    assert len(checks) == stats["target_forwards"] - (stats["stop"] is not None)
    if name == "trained":
        assert max(checks[1:]) >= 3  # refreshed after long accepted paths, not only single tokens


# ---------------------------------------------------------------------------------------------------------
# Sampling: the target's law, exactly


@pytest.mark.parametrize("draft_sampling, sampling, n, width, runtime, tree, verify", [
    # drawn tree: shape 5 nodes deep 2; warping must reach q and p
    ("sample", (0.9, 4, None), 1000, 2, "eager", "dynamic", None),
    # the static runtime (models wrapped by runtime.prepare): width 3 under top-k 2 leaves every node's third
    # draw undrawn (q has two tokens), so tree_guesses.DrawnTree must leave it out of the tree
    ("sample", (1.0, 2, None), 1000, 3, "static", "dynamic", None),
    ("topk", (1.0, None, None), 1000, 2, "static", "dynamic", None),  # EAGLE-2's reranked tree, point-mass rule
    # the chain, the default when sampling: drawn guesses under the token rule and block verification, and the
    # head's top-1 guesses (point masses)
    ("sample", (0.9, 4, None), 1000, 1, "eager", "chain", None),
    ("sample", (1.0, None, None), 1000, 1, "static", "chain", "block"),
    ("topk", (1.0, None, None), 1000, 1, "eager", "chain", None),
])
def test_sampling_follows_the_target_law(draft_sampling, sampling, n, width, runtime, tree, verify):
    """The first 2 tokens of 4 (so the first tree is 2 deep and both can come from it), V = 5: 25 outcomes.
    A correct sampler's empirical law is within tv_bound(25, n) of the exact law with probability 1 - 1e-6:
    0.125 for n = 1000 (a correct run comes out near 0.06). The head is trained on this target, so most draws
    accept a guess. The first case drew 1500 (bound 0.102); at 1000, a tree whose children are q's top-k taken
    as draws (no Gumbel noise) still comes out near 0.7. The top-k tree runs on the static path only:
    test_runtime.py holds that path to the eager path's tokens (the same draws), so the same case on the eager
    path, once here too, drew the same 1000 samples again. The chain drafts 2 guesses here (depth 2), one per depth."""
    target = tiny_gpt(3, vocab_size=5, n_future=0, n_layer=1, n_embd=8, block_size=16)
    models, prompt = Models(target=target, eagle=train_head(target, 30, seed=3)[0]), [1, 2]
    models = prepare(models, runtime)[0]
    codes, accepted = [], 0
    for seed in range(n):
        ids, stats = METHODS["eagle"](models, prompt, 4, temperature=sampling[0], top_k=sampling[1], seed=seed,
                                      depth=2, width=width, total_tokens=6, draft_sampling=draft_sampling, tree=tree,
                                      verify=verify)
        codes.append(ids[0] * 5 + ids[1])
        accepted += stats["accepted_per_step"][1] > 1
    law = empirical_law(torch.tensor(codes), 25)
    assert tv(law, exact_law(target, prompt, 2, sampling)) < tv_bound(25, n)
    assert accepted > n / (6 if draft_sampling == "topk" and width == 1 else 3)  # the guesses, not only the
    # target's own tokens, made the law (one top-1 guess, a point mass, passes with p(x) alone: ~0.2 here)


@torch.no_grad()
@pytest.mark.parametrize("seed", range(2))
def test_grow_sampled_tree_draws_from_the_slow_oracles_q(seed):
    """Every node of the drawn tree has the shape's place (tree.draw_rank_paths), and the law its children were
    drawn from is the head's warped q after the node's own path of DRAWN tokens, as a plain head forward without
    cache or mask gives it; the children are distinct tokens q allows, and the head's cache is left as it was."""
    target, head, seq, features, dcache, draft = head_at_root(seed)
    sampling, g = (0.9, 6, None), torch.Generator().manual_seed(seed)
    tokens, parents, q_draft = eagle_tree.grow_sampled_tree(head, target, dcache, seq[-1], draft, 3, 3, 9,
                                                              sampling, g)
    assert dcache.length == len(seq) - 1
    assert parents == tree_from_paths(draw_rank_paths(8, 3, 3, eagle_tree.ACCEPT_GUESS))[0]
    for u in range(len(tokens)):
        children = [c for c in range(len(tokens)) if parents[c] == u]
        if not children:
            continue
        path = [c for c in path_to(parents, u)[1:]]  # nodes below the root down to u
        x, f = list(seq[1:]), [features]
        for c in path:  # the slow way: the head re-reads the whole path, each node with its parent's f̂
            h = head(target, tensor(x, "cpu"), torch.cat(f, 0)[None]).hidden[0, -1:]
            x, f = x + [tokens[c]], f + [h]
        q = warp(head(target, tensor(x, "cpu"), torch.cat(f, 0)[None]).logits[0, -1], *sampling)
        assert torch.allclose(q_draft[u], q, atol=TOL)
        drawn = [tokens[c] for c in children]
        assert len(set(drawn)) == len(drawn) and all(q[t] > 0 for t in drawn)


@torch.no_grad()
@pytest.mark.parametrize("seed", range(2))
def test_grow_chain_draws_each_guess_from_the_slow_oracles_q(seed):
    """--tree chain: guess i is drawn from the head's warped q after the path of guesses before it, each read with
    the f̂ the head predicted at the one before (a plain head forward without cache gives it); the head's cache is
    left as it was."""
    target, head, seq, features, dcache, draft = head_at_root(seed)
    sampling, g = Sampling(0.9, 6, None), torch.Generator().manual_seed(seed)
    guesses, q_draft = eagle_method.grow_chain(head, target, dcache, draft, 3, sampling, g)
    assert dcache.length == len(seq) - 1 and len(guesses) == 3 and q_draft.shape == (1, 3, target.config.vocab_size)
    x, f = list(seq[1:]), [features]
    for i, guess in enumerate(guesses):  # the slow way: the head re-reads the whole path, each guess with its f̂
        out = head(target, tensor(x, "cpu"), torch.cat(f, 0)[None])
        q = warp(out.logits[0, -1], *sampling)
        assert torch.allclose(q_draft[0, i], q, atol=TOL) and q[guess] > 0
        x, f = x + [guess], f + [out.hidden[0, -1:]]


def test_absurd_trees_are_clear_errors_not_hangs(models):
    m, prompt = models["random"], random_ids(3)
    for options, message in [(dict(width=100000), "width must be in 1..32"), (dict(depth=0), "depth must be in 1..16"),
                             (dict(total_tokens=1), "total_tokens must be in 2..256"),
                             (dict(draft_sampling="beam"), "draft_sampling must be one of topk, sample"),
                             (dict(tree="chain", verify="traversal"), "not judge a chain.*--tree dynamic"),
                             (dict(tree="wide"), "tree must be one of chain, dynamic")]:
        with pytest.raises(ValueError, match=message):
            METHODS["eagle"](m, prompt, 5, temperature=1.0, **options)


# ---------------------------------------------------------------------------------------------------------
# Training, checkpoint, errors


def test_training_loss_decreases(models):
    _, history = train_head(models["trained"].target, 40, seed=1)
    # the untrained head's loss (~9) falls to ~2.5; the first steps' average (~4.9) was a thin margin to halve
    assert sum(history[-5:]) / 5 < 0.4 * history[0], history


def test_checkpoint_round_trip_and_missing_head_error(models, tmp_path):
    m = models["trained"]
    path = tmp_path / "eagle.pt"
    save_atomic({"config": asdict(m.eagle.config), "model": m.eagle.state_dict(), "tokenizer": "tok"}, path)
    assert "wte.weight" not in m.eagle.state_dict()  # the target's embedding and head are not copied
    head = load_eagle(str(path), "tok").double()  # loads as float32, the training dtype
    for p, q in zip(head.parameters(), m.eagle.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    prompt = random_ids(3)
    assert METHODS["eagle"](Models(target=m.target, eagle=head), prompt, 12)[0] == METHODS["ar"](m, prompt, 12)[0]
    with pytest.raises(ValueError, match="python train_tiny.py --stage eagle"):
        check_method("eagle", Models(target=m.target))
    with pytest.raises(ValueError, match="depth"):
        METHODS["eagle"](m, prompt, 5, depth=0)


def test_a_head_without_attention_reads_each_token_alone(models):
    """The default head (config.attention False): its guess of f_{t+1} comes from (x_{t+1}, f_t) alone, whatever the
    head read before; EAGLE-1's layer (attention) sees the tokens before through its cache."""
    target = models["random"].target
    x, f = tensor(random_ids(6, seed=1), "cpu"), torch.randn(1, 6, target.config.n_embd, dtype=torch.float64)
    for attention in (False, True):
        head = random_head(target, 2, attention=attention).double()
        alone = head(target, x[:, -1:], f[:, -1:], pos=torch.tensor([6])).hidden  # (1, 1, C)
        after = head(target, x, f).hidden[:, -1:]  # the same token at the same position, after five others
        assert torch.allclose(alone, after, atol=1e-12) != attention, attention
    assert not hasattr(random_head(target, attention=False).block, "attn")  # no attention weights either


def test_an_eagle_pt_from_before_the_head_options_loads_as_it_was_trained(models, tmp_path):
    """eagle.pt files written before EagleConfig's own fields hold EAGLE-1's block, with the exact GELU, position
    embeddings and RMS-normed features: they load as such (the head computes what it computed then), decode = `ar`."""
    m = models["random"]
    target, config = m.target, asdict(m.eagle.config)
    for field in ("attention", "gelu", "positions", "feature_norm"):
        del config[field]
    save_atomic({"config": config, "model": m.eagle.state_dict(), "tokenizer": "tok"}, tmp_path / "eagle.pt")
    head = load_eagle(str(tmp_path / "eagle.pt"), "tok").double()
    assert (head.config.attention, head.config.gelu, head.config.positions, head.config.feature_norm) == (
        True, "none", True, "rms")
    x, f = tensor(random_ids(6, seed=3), "cpu"), 3 * torch.randn(1, 6, target.config.n_embd, dtype=torch.float64)
    for then, same in ((dict(gelu="none", positions=True, feature_norm="rms"), True), ({}, False)):  # then; now
        twin = Eagle(EagleConfig(**config, attention=True, **then)).double()
        twin.load_state_dict(m.eagle.state_dict())
        assert torch.allclose(head(target, x, f).logits, twin(target, x, f).logits, atol=1e-12) == same, then
    prompt = random_ids(3)
    assert METHODS["eagle"](Models(target=target, eagle=head), prompt, 12)[0] == METHODS["ar"](m, prompt, 12)[0]
    with pytest.raises(ValueError, match="feature_norm must be one of layer, rms"):
        Eagle(EagleConfig(**config, feature_norm="batch"))


def test_train_stage_trains_skips_and_retrains_for_a_new_target(tmp_path, capsys):
    """train_tiny.py's stage on a toy run folder: it trains, skips a complete head, and trains anew when
    target.pt changed since (a head fitted to another target's features is useless)."""
    from types import SimpleNamespace

    import numpy as np

    from nanospec.model.checkpoint import gpt_checkpoint, load_checkpoint
    from nanospec.training.drafters import train_eagle as train_stage
    from nanospec.training.trainer import TrainConfig

    def save_target(seed):
        save_atomic(gpt_checkpoint(tiny_gpt(seed, block_size=16).float(), "tok", done=True), tmp_path / "target.pt")

    tokens = np.array(random_ids(400, seed=1), dtype=np.uint16)
    ctx = SimpleNamespace(out_dir=str(tmp_path), device="cpu", tokenizer=SimpleNamespace(identity="tok"),
                          train_tokens=tokens, val_tokens=tokens[:100],
                          train_cfg=lambda key: TrainConfig(max_iters=3, batch_size=2, eval_interval=3, warmup_iters=1))
    save_target(0)
    train_stage(ctx)
    first = load_checkpoint(str(tmp_path / "eagle.pt"), "tok")
    assert first["done"] and first["step"] == 3 and "wte.weight" not in first["model"]
    train_stage(ctx)
    assert "complete, skipping" in capsys.readouterr().out
    save_target(1)  # the target was retrained
    train_stage(ctx)
    assert "another target.pt" in capsys.readouterr().out
    assert load_checkpoint(str(tmp_path / "eagle.pt"), "tok")["target"] != first["target"]
