"""The shape-static forward (nanospec/static.py) against the plain one (GPT.forward + KVCache.update), its oracle:
chain, tree and early-exit layer-range forwards over many steps, with the rollbacks and compactions the methods
make after verifying, give the same logits (fp32, allclose). The mask is checked on the docstring's example, and
a forward's shapes are shown to depend on T alone: one recorded entry per T, whatever the cache's length.
Then the methods wired to it (`ar`, `speculative`) give the plain path's ids with --runtime static: greedy and,
seeded, at temperature 1; and speculative's sampling-law test passes through the static path."""
import gc
import random
from functools import partial

import pytest
import torch

import test_device
import test_speculative
from nanospec.decoding import METHODS
from nanospec.decoding.chain_step import accept_greedy
from nanospec.parts import Models
from nanospec.static import KEPT, RUNTIMES, StaticGPT, runtime_model, runtime_path, static_mask
from nanospec.tree import tree_layout_on_device, tree_mask, tree_positions
from nanospec.verify import verify_chain_greedy, verify_tree_greedy_on_device
from test_model import random_ids, tiny_gpt

ATOL = 1e-5  # fp32: the static path sums over max_len slots, masked ones add exact zeros, so only order differs


def model_pair(seed=0, **kw):
    """An fp32 tiny GPT, a plain cache for the oracle and a StaticGPT on a cache of its own."""
    model = tiny_gpt(seed, vocab_size=13, block_size=64, n_layer=3, **kw).float()
    plain, cache = model.new_cache(), model.new_cache()
    return model, plain, StaticGPT(model, cache), cache


def ids(values):
    return torch.tensor([values], dtype=torch.long)  # (1, T)


def test_mask_of_the_docstring_example():
    chain = static_mask(torch.tensor([2, 3]), torch.ones(2, 2, dtype=torch.bool).tril(), 6)
    assert chain.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    tree = static_mask(torch.tensor([2, 3, 4]), tree_mask([-1, 0, 0], 0), 6)
    assert tree.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]


@pytest.mark.parametrize("seed", range(3))
@torch.inference_mode()
def test_chain_forwards_with_rollbacks(seed):
    model, plain, static, cache = model_pair(seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(13) for _ in range(5)]
    torch.testing.assert_close(static(ids(prompt), cache=cache).logits, model(ids(prompt), cache=plain).logits,
                               atol=ATOL, rtol=0)
    for _ in range(12):  # a verify forward over [last, d1..dk], then roll back to what was "accepted"
        T = rng.randint(1, 5)
        x = ids([rng.randrange(13) for _ in range(T)])
        expected = model(x, cache=plain, heads=True)
        got = static(x, cache=cache, heads=True)
        torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.head_logits, expected.head_logits, atol=ATOL, rtol=0)
        keep = rng.randint(plain.length - T + 1, plain.length)
        plain.rollback(keep)
        cache.rollback(keep)
    assert cache.lengths == plain.lengths


@pytest.mark.parametrize("seed", range(3))
@torch.inference_mode()
def test_tree_forwards_with_compactions(seed):
    model, plain, static, cache = model_pair(seed)
    rng = random.Random(seed)
    prompt = ids([rng.randrange(13) for _ in range(4)])
    model(prompt, cache=plain), static(prompt, cache=cache)
    for _ in range(8):  # a tree verify forward, then keep the prefix + a root-to-node path (tree_step.compact)
        N = rng.randint(1, 7)
        parents = [-1] + [rng.randrange(i) for i in range(1, N)]
        x, n = ids([rng.randrange(13) for _ in range(N)]), plain.length
        pos, mask = tree_positions(parents, n), tree_mask(parents, n)
        expected = model(x, pos=pos, cache=plain, mask=mask)
        got = static(x, pos=pos, cache=cache, mask=mask)
        torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=0)
        node, path = rng.randrange(N), []
        while node >= 0:
            path, node = [node] + path, parents[node]
        keep = list(range(n)) + [n + i for i in path]
        plain.compact(keep)
        cache.compact(keep)


@pytest.mark.parametrize("E", [1, 2])
@torch.inference_mode()
def test_early_exit_layer_ranges(E):
    """Early exit's pattern: blocks 0..E-1 read one token at a time and run ahead, blocks E..L-1 then read the
    k+1 block-E outputs at once (hidden_in), and every layer rolls back to what was accepted."""
    model, plain, static, cache = model_pair(E)
    rng, L = random.Random(E), model.config.n_layer
    prompt = ids([rng.randrange(13) for _ in range(6)])
    model(prompt, cache=plain), static(prompt, cache=cache)
    for _ in range(6):
        n_before, k = plain.length, rng.randint(0, 3)
        lower_plain, lower_static = [], []
        for _ in range(k + 1):
            x = ids([rng.randrange(13)])
            lower_plain.append(model(x, cache=plain, layers=(0, E)).hidden)
            lower_static.append(static(x, cache=cache, layers=(0, E)).hidden.clone())  # buffers are reused
            torch.testing.assert_close(lower_static[-1], lower_plain[-1], atol=ATOL, rtol=0)
        assert cache.lengths == plain.lengths and plain.lengths[0] == plain.lengths[E] + k + 1
        expected = model(None, cache=plain, layers=(E, L), hidden_in=torch.cat(lower_plain, 1))
        got = static(None, cache=cache, layers=(E, L), hidden_in=torch.cat(lower_static, 1))
        torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=0)
        keep = n_before + 1 + rng.randint(0, k)
        plain.rollback(keep)
        cache.rollback(keep)


@torch.inference_mode()
def test_shapes_depend_on_T_only():
    """Ten one-token forwards at ten cache lengths are one recorded entry (one CUDA graph on a GPU), with the
    same input buffers and the same output tensor from the second on."""
    model, _, static, cache = model_pair()
    static(ids([1, 2, 3]), cache=cache)  # a prompt: called once, so neither buffers nor a graph
    static(ids([0]), cache=cache)  # the first one-token forward: just called too
    outputs = {static(ids([t]), cache=cache).logits.data_ptr() for t in range(1, 10)}
    assert len(outputs) == 1 and cache.length == 13
    assert [k[1][0][0] for k in static.graphs.entries] == [(1, 1)]  # x's shape: one entry, T = 1


def test_bad_uses_are_clear_errors():
    model, plain, static, cache = model_pair()
    with pytest.raises(ValueError, match="the cache it was made with"):
        static(ids([1]), cache=plain)
    with pytest.raises(ValueError, match="mask must be"):
        static(ids([1, 2]), cache=cache, mask=torch.ones(2, 3, dtype=torch.bool))
    cache.advance(62)  # 62 of 64 slots taken: 4 more tokens do not fit
    with pytest.raises(ValueError, match="KV cache full"):
        static(ids([1] * 4), cache=cache)
    with pytest.raises(ValueError, match="runtime must be one of"):
        runtime_model(model, "fast")


def test_runtime_model_keeps_one_static_forward_per_model_role_and_weights():
    """Graphs are captured once per process: the next generation gets the same StaticGPT, its cache emptied; a
    second role (the same model as target and draft) gets its own; moved weights get a new one."""
    model = tiny_gpt(0)
    forward, cache, path = runtime_model(model, "auto")  # the CPU: the plain path, a new cache each time
    assert forward is model and path == "eager" and cache is not runtime_model(model, "eager")[1]
    static, cache, path = runtime_model(model, "static")
    assert isinstance(static, StaticGPT) and path == "static" and static.cache is cache
    with torch.inference_mode():
        static(ids([1, 2, 3]), cache=cache)
    again, cache_again, _ = runtime_model(model, "static")
    assert again is static and cache_again is cache and cache.lengths == [0, 0]
    assert runtime_model(model, "static", role="draft")[0] is not static
    assert runtime_model(model.float(), "static")[0] is not static


# ---------------------------------------------------------------------------------------------------------
# The methods through it: `ar` and `speculative` with --runtime static give the plain path's ids


def generations(method, models, prompt, n, **kw):
    """(ids, stats) of the static runtime and of the plain one, for the same request."""
    return [METHODS[method](models, prompt, n, runtime=r, **kw) for r in ("static", "eager")]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_ar_static_equals_plain(seed, temperature):
    models = Models(target=tiny_gpt(seed))
    (ids, stats), (plain_ids, plain_stats) = generations("ar", models, random_ids(1 + 3 * seed, seed=seed), 30,
                                                         temperature=temperature, seed=seed)
    assert ids == plain_ids and len(ids) == 30
    assert (stats["runtime"], plain_stats["runtime"]) == ("static", "eager")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed, k", [(0, 1), (1, 3), (2, 5)])
def test_speculative_static_equals_plain(seed, k, temperature):
    models = Models(target=tiny_gpt(seed), draft=tiny_gpt(seed + 10, n_layer=1))
    prompt = random_ids(2 + seed, seed=seed)
    (ids, stats), (plain_ids, _) = generations("speculative", models, prompt, 40, temperature=temperature,
                                               seed=seed, draft_len=k)
    assert ids == plain_ids and stats["runtime"] == "static"
    if temperature == 0:
        assert ids == METHODS["ar"](models, prompt, 40)[0]


def test_speculative_sampling_law_through_the_static_path(monkeypatch):
    """test_speculative's law test (TV against the exact law of the first 3 tokens) with --runtime static."""
    monkeypatch.setattr(test_speculative, "speculative", partial(METHODS["speculative"], runtime="static"))
    distance, bound = test_speculative.sampled_tv(2, (1.0, None, None), 1500)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f}"


def test_speculative_static_with_the_target_as_its_own_draft():
    """Target and draft are one model: two roles, two caches. Sharing one would break every step."""
    target = tiny_gpt(4)
    ids, stats = METHODS["speculative"](Models(target=target, draft=target), [2, 5], 30, draft_len=3,
                                        runtime="static")
    assert ids == METHODS["ar"](Models(target=target), [2, 5], 30)[0]
    assert stats["accepted"] == stats["drafted"]  # the draft IS the target: every guess is right


@pytest.mark.parametrize("method", ["ar", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_path_makes_every_tensor_on_the_models_device(method, temperature):
    """test_device.py's check (a tensor made without naming a device lands on meta and fails), on the static path."""
    models = Models(target=tiny_gpt(0), draft=tiny_gpt(5, n_layer=1, n_future=0))
    with torch.device("meta"), test_device.on_meta_fails():
        ids, _ = METHODS[method](models, random_ids(6, seed=3), 10, temperature=temperature, seed=0,
                                 runtime="static")
    assert len(ids) == 10


def test_a_dropped_model_drops_its_kept_static_forwards():
    model = tiny_gpt(0)
    runtime_model(model, "static")
    n = len(KEPT)
    del model
    gc.collect()
    assert len(KEPT) == n - 1


def test_accept_greedy_is_verify_chain_greedy_on_the_device():
    logits = torch.full((4, 12), -1.0)
    logits[[0, 1, 2, 3], [5, 9, 7, 3]] = 1.0  # target argmax [5, 9, 7, 3]
    n, nxt = accept_greedy(logits, torch.tensor([5, 9, 2]))  # the docstring's example
    assert (n.item(), nxt.item()) == (2, 7) == verify_chain_greedy(logits, [5, 9, 2])
    g = torch.Generator().manual_seed(0)
    for k in range(6):
        logits = torch.randint(0, 3, (k + 1, 5), generator=g).float()  # many ties: the first maximum wins
        drafts = logits.argmax(-1)[:k].clone()
        if k:
            drafts[torch.randint(0, k, (1,), generator=g)] = torch.randint(0, 5, (1,), generator=g)
        n, nxt = accept_greedy(logits, drafts)
        assert (n.item(), nxt.item()) == verify_chain_greedy(logits, drafts.tolist())


def test_tree_layout_on_device_is_tree_mask_and_tree_positions():
    """EAGLE's reranked tree keeps its parents on the device (drafters/eagle.grow_tree_on_device): its mask and
    positions, built there by squaring the parent relation, are exercise 6's, on random trees with padding nodes
    (roots of their own, as tree_step pads) and on the docstring's example."""
    mask, pos = tree_layout_on_device(torch.tensor([-1, 0, 0, 1]), 2)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert pos.tolist() == [2, 3, 3, 4]
    rng = random.Random(0)
    for _ in range(200):
        N = rng.randint(1, 40)
        parents = [-1] + [rng.randrange(i) if rng.random() < 0.9 else -1 for i in range(1, N)]
        mask, pos = tree_layout_on_device(torch.tensor(parents), n := rng.randint(0, 5))
        assert torch.equal(mask, tree_mask(parents, n)) and torch.equal(pos, tree_positions(parents, n)), parents


def test_the_greedy_walk_takes_parents_on_the_device():
    """verify_tree_greedy_on_device with the parents left on the device walks as with them in a list."""
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(100):
        N = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, N)]
        logits = torch.randint(0, 3, (N, 4), generator=g).float()  # small vocabulary: guesses often match
        tokens = torch.randint(0, 4, (N,), generator=g)
        path, nxt = verify_tree_greedy_on_device(logits, tokens, parents)
        path_t, nxt_t = verify_tree_greedy_on_device(logits, tokens, torch.tensor(parents))
        assert [v for v in path_t.tolist() if v >= 0] == [v for v in path.tolist() if v >= 0]
        assert nxt_t.item() == nxt.item() and path_t.numel() == N - 1


def test_auto_replays_graphs_on_cuda_only():
    """--runtime auto is the graph path on CUDA and plain PyTorch elsewhere; eager is eager everywhere."""
    assert [runtime_path(r, "cuda:0") for r in RUNTIMES] == ["graph", "eager", "graph"]
    assert [runtime_path(r, d) for r in RUNTIMES for d in ("cpu", "meta")] == ["eager"] * 4 + ["static"] * 2
    with pytest.raises(ValueError, match="runtime must be one of"):
        runtime_path("fast", "cpu")
