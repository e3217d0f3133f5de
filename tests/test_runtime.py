"""The fast runtime (nanospec/fast/runtime.py) against plain PyTorch, its oracle.

  - each Fast model is its plain model: the GPT over chains (a prompt, then 1- and k-token steps, each
    rolled back), trees (explicit positions and tree mask) and early-exit's layer ranges (lower layers running ahead,
    upper ones reading hidden_in); the EAGLE head (a causal refresh, then frontier passes); the ParallelSpec
    drafter (tokens and masks, only the real tokens kept). Outputs AND caches are compared after every call, over
    many calls with the rollbacks and compactions the methods make, so shapes come back and are replayed from
    graphs.Graphs' recordings (on a CPU its emulated replay, which runs none of the forward's Python). float64
    tiny random models: equal to 1e-10;
  - the mask a forward gets (the docstring's example), one recorded entry per number of new tokens whatever the
    cache holds, outputs a method may keep (a later call never rewrites them);
  - the bookkeeping: each new_cache is fresh, on tensors pooled per argument set, `fast` keeps one wrapper per model and
    weights, `prepare` wraps the four cached parts only, a dropped model drops its wrapper, a full cache and a
    bad runtime are one-line errors, and a capture that fails leaves one warning line and a model that runs
    eager from then on, its cache intact;
  - every method on the static path: greedy, `ar`'s tokens; seeded sampling, the eager path's tokens (the same
    code and the same random draws); up to the context's end; and the sampling laws through it of medusa and
    parallelspec with truncated drawn trees (speculative's and early-exit's: test_draft_chain.py; eagle's:
    test_eagle.py; mtp's: test_mtp_medusa.py). The meta-device check of tests/test_device.py runs on both paths.
On a CPU the static path replays its forwards through graphs.Emulated: the same slots, masks and buffers, and
like a CUDA graph it repeats what was recorded without running the forward's Python, so a Python value baked
into a forward fails these tests here as it would on a GPU. The CUDA test at the end runs only on a GPU machine."""
import gc
import random
import weakref
from dataclasses import fields, replace

import pytest
import torch

from nanospec.fast import graphs
from nanospec.decoding import METHODS
from nanospec.decoding.eagle import refresh
from nanospec.model.gpt import Output
from nanospec.model.load import Models
from nanospec.fast.runtime import RUNTIMES, Fast, fast, prepare, runtime_path
from nanospec.rules.tree import frontier_mask, tree_mask, tree_positions
from nanospec.steps.eagle_tree import grow_tree
from laws import exact_law, method_law, parallelspec_sampled_law, tv, tv_bound
from toys import (SAMPLING_MODEL, SAMPLING_TREE, TOL, all_models, ids, parallelspec_sampling_models, random_adapter,
                  random_head, random_ids, tiny_drafter, tiny_gpt)

F64 = torch.float64  # the tiny models' dtype: equal to TOL = 1e-10


def same_output(got, expected):
    """Two forward outputs (model.Output, or a bare tensor) are equal to TOL, field by field (None alike)."""
    pairs = [(got, expected)] if torch.is_tensor(expected) else \
        [(getattr(got, f.name), getattr(expected, f.name)) for f in fields(Output)]
    for a, b in pairs:
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def same_cache(got, expected):
    """Two KV caches hold the same tokens: the same length in every layer, equal keys and values there (the
    slots beyond may differ: rolled-back guesses, the masks' keys, which no one reads)."""
    assert got.layer_lengths == expected.layer_lengths
    for layer, n in enumerate(expected.layer_lengths):
        for a, b in ((got.k, expected.k), (got.v, expected.v)):
            torch.testing.assert_close(a[layer, :, :, :n], b[layer, :, :, :n], atol=TOL, rtol=0)


def prefilled(model, seed, prompt_len):
    """A Fast runner around `model` and two caches, the runner's and the model's, both holding the same random
    prompt (checked equal on the way): where every pattern below starts."""
    runner = Fast(model)
    plain, cache = model.new_cache(), runner.new_cache()
    prompt = ids(random_ids(prompt_len, seed=seed))
    same_output(runner(prompt, cache=cache), model(prompt, cache=plain))
    return runner, plain, cache


# ---------------------------------------------------------------------------------------------------------
# Each Fast model is its plain model


@pytest.mark.parametrize("seed", range(3))
@torch.inference_mode()
def test_gpt_chain_forwards_with_rollbacks(seed):
    """What every chain method does: a verify forward over [last, d1..dk], then a rollback to
    what was accepted. T takes the same few values again and again: most calls run on Graphs' buffers."""
    model, rng = tiny_gpt(seed, n_layer=3), random.Random(seed)
    runner, plain, cache = prefilled(model, seed, 5)
    for _ in range(15):
        T = rng.randint(1, 4)
        x = ids([rng.randrange(11) for _ in range(T)])
        same_output(runner(x, cache=cache), model(x, cache=plain))
        same_cache(cache, plain)
        keep = rng.randint(plain.length - T + 1, plain.length)  # the last token and some guesses
        plain.rollback(keep)
        cache.rollback(keep)
    assert runner.graphs.entries  # shapes seen twice went through the buffers


@pytest.mark.parametrize("seed", range(3))
@torch.inference_mode()
def test_gpt_tree_forwards_with_compactions(seed):
    """What every tree method does: a forward over a tree (positions by depth, the tree mask), then compact the
    cache to the prefix, the root and one root-to-node path."""
    model, rng = tiny_gpt(seed), random.Random(seed)
    runner, plain, cache = prefilled(model, seed, 4)
    for _ in range(10):
        N = rng.randint(1, 4)
        parents = [-1] + [rng.randrange(i) for i in range(1, N)]
        x, n = ids([rng.randrange(11) for _ in range(N)]), plain.length
        pos, mask = tree_positions(parents, n), tree_mask(parents, n)
        same_output(runner(x, pos=pos, cache=cache, mask=mask), model(x, pos=pos, cache=plain, mask=mask))
        same_cache(cache, plain)
        node, path = rng.randrange(N), []
        while node >= 0:
            path, node = [node] + path, parents[node]
        keep = list(range(n)) + [n + i for i in path]
        plain.compact(keep)
        cache.compact(keep)
        same_cache(cache, plain)
    assert runner.graphs.entries


@pytest.mark.parametrize("E", [1, 2])
@torch.inference_mode()
def test_gpt_layer_ranges(E):
    """Early exit's pattern: blocks 0..E-1 read one token at a time and run ahead, blocks E..L-1 then read the
    k+1 block-E outputs at once (hidden_in), and every layer rolls back to what was accepted."""
    model, rng = tiny_gpt(E, n_layer=3), random.Random(E)
    runner, plain, cache = prefilled(model, E, 6)
    L = model.config.n_layer
    for _ in range(8):
        n_before, k = plain.length, rng.randint(0, 3)
        lower_plain, lower_fast = [], []
        for _ in range(k + 1):
            x = ids([rng.randrange(11)])
            lower_plain.append(model(x, cache=plain, layers=(0, E)).hidden)
            lower_fast.append(runner(x, cache=cache, layers=(0, E)).hidden)
            same_output(lower_fast[-1], lower_plain[-1])
        assert cache.layer_lengths == plain.layer_lengths  # the lower layers ahead by k + 1:
        assert plain.layer_lengths[0] == plain.layer_lengths[E] + k + 1
        same_cache(cache, plain)
        expected = model(None, cache=plain, layers=(E, L), hidden_in=torch.cat(lower_plain, 1))
        same_output(runner(None, cache=cache, layers=(E, L), hidden_in=torch.cat(lower_fast, 1)), expected)
        same_cache(cache, plain)
        keep = n_before + 1 + rng.randint(0, k)
        plain.rollback(keep)
        cache.rollback(keep)
    assert runner.graphs.entries


@torch.inference_mode()
@pytest.mark.parametrize("attention", [True, False])
def test_eagle_head(attention):
    """The head on its own cache: a causal refresh over the accepted tokens, then frontier passes under tree
    masks with explicit positions (as eagle_tree.expand runs them), then a rollback to the accepted slots. A head
    without attention (the default) places by positions alone: no mask, no slots reach its replay."""
    target = tiny_gpt(1)
    head = random_head(target, 1, attention)
    runner, g = Fast(head), torch.Generator().manual_seed(0)
    plain, cache = head.new_cache(max_len=64), runner.new_cache(max_len=64)
    for step in range(5):
        m = 3 if step == 0 else 1 + step % 2  # the accepted tokens with true features
        tokens, feats = torch.randint(0, 11, (1, m), generator=g), torch.randn(1, m, 16, generator=g, dtype=F64)
        same_output(runner(target, tokens, feats, cache=cache), head(target, tokens, feats, cache=plain))
        same_cache(cache, plain)
        L, fed, parent = plain.length, {}, [-1, -1, 0, 1]
        for frontier, d in (([0, 1], 1), ([2, 3], 2)):  # two passes of a tree 2 deep: nodes 2, 3 under 0, 1
            mask = frontier_mask(L, fed, frontier, parent)
            pos = torch.full((2,), L + d)
            tok, f = torch.randint(0, 11, (1, 2), generator=g), torch.randn(1, 2, 16, generator=g, dtype=F64)
            same_output(runner(target, tok, f, pos=pos, cache=cache, mask=mask),
                        head(target, tok, f, pos=pos, cache=plain, mask=mask))
            same_cache(cache, plain)
        plain.rollback(L)
        cache.rollback(L)
    assert runner.graphs.entries


@torch.inference_mode()
def test_parallelspec_drafter():
    """Passes over the prompt, then over 1..3 new tokens each, with k masks after one or two anchors (indices
    into the new tokens): the same logits, and only the real tokens stay in the cache."""
    target = tiny_gpt(2)
    drafter = tiny_drafter(target, 2)
    runner, g, seen = Fast(drafter), torch.Generator().manual_seed(1), 0
    plain, cache = drafter.new_cache(), runner.new_cache()
    for m in [6, 1, 3, 2, 1, 1, 3, 2, 1]:
        tokens, k = torch.randint(0, 11, (1, m), generator=g), 1 + m % 3
        anchors = torch.tensor(sorted({0, m - 1}))  # the methods' one anchor (the root, the newest token), or two
        same_output(runner(target, tokens, anchors, k, cache=cache), drafter(target, tokens, anchors, k, cache=plain))
        seen += m
        assert cache.layer_lengths == [seen] * len(cache.layer_lengths)  # the masks' keys are forgotten
        same_cache(cache, plain)
    assert runner.graphs.entries


@pytest.mark.parametrize("depth, width, total", [(1, 3, 4), (2, 4, 8), (3, 2, 6), (3, 3, 30)])
@torch.inference_mode()
def test_eagle_grow_tree_through_a_fast_head(depth, width, total):
    """eagle_tree.grow_tree (exercise 9) with a Fast head grows the plain head's tree node for node, and leaves the
    head's cache as it found it (its frontier passes are rolled back)."""
    for seed in range(2):
        target = tiny_gpt(seed)
        head = random_head(target, seed, attention=seed == 0)  # EAGLE-1's layer, then the default without attention
        seq = random_ids(7, seed=seed)
        features = target(ids(seq)).hidden[0, :-1]  # (6, C)
        trees = []
        for model in (head, Fast(head)):
            dcache = model.new_cache(max_len=80)
            draft = refresh(model, target, dcache, seq[1:], features)
            trees.append(grow_tree(model, target, dcache, seq[-1], draft, depth, width, total))
            trees.append(grow_tree(model, target, dcache, seq[-1], draft, depth, width, total))  # shapes again
            assert dcache.length == 6
        assert trees[0] == trees[1] == trees[2] == trees[3]


# ---------------------------------------------------------------------------------------------------------
# What a forward sees, and what it hands back


@torch.inference_mode()
def test_the_mask_and_slots_of_the_docstring_example():
    """max_len 6, 2 tokens cached: a chain of 2 new tokens is written at slots [2, 3] under the causal mask
    padded with False to 6 columns; a tree [-1, 0, 0] at slots [2, 3, 4] under its tree mask, padded alike."""
    model = tiny_gpt(0)
    runner = Fast(model)
    cache = runner.new_cache(max_len=6)
    seen = []
    model.blocks[0].attn.register_forward_pre_hook(lambda module, args: seen.append(args[1]))  # (x, at, layer)
    runner(ids([1, 2]), cache=cache)  # the prompt
    seen.clear()
    runner(ids([3, 4]), cache=cache)
    visible = lambda at: (at.mask[0, 0] == 0).int().tolist()  # noqa: E731 (the mask is additive: 0 or -inf)
    assert visible(seen[0]) == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]] and seen[0].slots.tolist() == [[2, 3]]
    cache.rollback(2)
    seen.clear()
    parents = [-1, 0, 0]
    runner(ids([3, 4, 5]), pos=tree_positions(parents, 2), cache=cache, mask=tree_mask(parents, 2))
    assert visible(seen[0]) == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]
    assert seen[0].slots.tolist() == [[2, 3, 4]]


@torch.inference_mode()
def test_shapes_depend_on_T_only():
    """Ten one-token forwards at ten cache lengths are one recorded entry (one CUDA graph on a GPU): the
    prompt and the first one-token forward are just called, every later one runs on the entry's buffers."""
    runner = Fast(tiny_gpt(0))
    cache = runner.new_cache()
    runner(ids([1, 2, 3]), cache=cache)
    for t in range(10):
        runner(ids([t]), cache=cache)
    assert cache.length == 13 and len(runner.graphs.entries) == 1
    (entry,) = runner.graphs.entries.values()
    assert [tuple(x.shape) for x in entry.inputs] == [(1, 1), (1, 1, 1, 48), (1, 1), (1, 1)]  # pos, mask, slots, ids


@torch.inference_mode()
def test_a_prompt_runs_eager():
    """A prefill (a forward into an empty cache) is never recorded: its length is the prompt's, a one-off, and a
    bench that runs the same prompts again would otherwise capture a graph per prompt length. The same prompt three
    times (a new cache each) leaves no entry and nothing seen, with the plain model's outputs and cache; the step
    after it is a shape like any other (seen, then recorded)."""
    model = tiny_gpt(0)
    runner = Fast(model)
    for _ in range(3):
        cache, plain = runner.new_cache(), model.new_cache()
        same_output(runner(ids([1, 2, 3]), cache=cache), model(ids([1, 2, 3]), cache=plain))
        same_cache(cache, plain)
    assert not runner.graphs.entries and not runner.graphs.seen
    for t in (4, 5):
        same_output(runner(ids([t]), cache=cache), model(ids([t]), cache=plain))
    assert len(runner.graphs.seen) == 1 and len(runner.graphs.entries) == 1


@torch.inference_mode()
def test_the_heads_and_the_unembedding_are_replayed():
    """head_logits and unembed, which drafters call outside the target's forward (runtime.REPLAYED), replay per
    shape on a Fast: an entry each for (name, n) once seen twice, every output the model's and fresh (a kept one
    survives the next call). Inside another Fast's forward (the EAGLE head unembeds through the target) they just
    run, as part of that forward: the target records nothing there."""
    model = tiny_gpt(0)
    runner = Fast(model)
    hidden = [torch.randn(1, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    kept = [runner.head_logits(h, 2) for h in hidden]
    for h, got in zip(hidden, kept):
        assert torch.equal(got, model.head_logits(h, 2))
        assert torch.equal(runner.unembed(h), model.unembed(h))
    one_head = runner.head_logits(hidden[0], 1)
    assert torch.equal(one_head, model.head_logits(hidden[0], 1)) and one_head.shape[1] == 1
    assert sorted(key[0][0] for key in runner.graphs.entries) == ["head_logits", "unembed"]
    assert len(runner.graphs.seen) == 3  # head_logits with n = 2 and n = 1, unembed
    head = Fast(random_head(model))  # its forward calls runner.unembed while its graph records
    cache = head.new_cache()
    features = torch.randn(1, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    entries, seen = dict(runner.graphs.entries), set(runner.graphs.seen)
    head(runner, ids([1, 2, 3]), features, cache=cache)  # the prompt: eager, through runner.unembed (3 positions)
    for _ in range(2):  # 2 positions: seen, then recorded, by the head alone
        head(runner, ids([1, 2]), features[:, :2], cache=cache)
    assert head.graphs.entries and runner.graphs.entries == entries and runner.graphs.seen == seen | {
        (("unembed", (None,)), (((1, 3, 16), torch.float64, torch.device("cpu")),))}


@torch.inference_mode()
def test_outputs_are_fresh():
    """A method may keep a forward's output: the next call of the same shape, which rewrites the entry's output
    buffers, leaves the kept tensors as they were."""
    runner = Fast(tiny_gpt(0))
    cache = runner.new_cache()
    runner(ids([1, 2, 3]), cache=cache)
    kept = [runner(ids([t]), cache=cache) for t in range(4)]
    copies = [Output(o.logits.clone(), o.hidden.clone()) for o in kept]
    runner(ids([5]), cache=cache)
    for out, copy in zip(kept, copies):
        same_output(out, copy)
    assert len({out.logits.data_ptr() for out in kept}) == 4
    assert not torch.equal(kept[2].logits, kept[3].logits)  # different tokens: not one buffer seen four times


# ---------------------------------------------------------------------------------------------------------
# Bookkeeping: caches, wrappers, errors


def test_each_new_cache_is_fresh_on_pooled_tensors():
    """As eager, each new_cache is empty and shares tensors with no live cache; a graph replays on the tensors it
    was captured with, though, so once a cache is gone (its generation ended) the next one gets its tensors again,
    emptied (the stale keys are masked); other arguments, other tensors."""
    runner = Fast(tiny_gpt(0))
    cache = runner.new_cache()
    with torch.inference_mode():
        runner(ids([1, 2, 3]), cache=cache)
    assert cache.layer_lengths == [3, 3]
    second = runner.new_cache()  # asked for while the first is held: tensors of its own
    assert second is not cache and second.k is not cache.k
    assert second.layer_lengths == [0, 0] and cache.layer_lengths == [3, 3]
    pooled = cache.k
    del cache, second
    again = runner.new_cache()
    assert again.k is pooled and again.layer_lengths == [0, 0]
    other = runner.new_cache(max_len=20)
    assert other.k is not pooled and other.max_len == 20


def test_fast_keeps_one_wrapper_per_model_and_weights():
    model = tiny_gpt(0)
    runner = fast(model, "static")
    assert isinstance(runner, Fast) and runner.model is model and runner.capture
    assert fast(model, "static") is runner  # the next generation finds its entries (its graphs on a GPU)
    assert runner.config is model.config and runner.wte is model.wte  # every other attribute is the model's
    assert fast(model, "eager") is model and fast(None, "static") is None
    model.float()  # new weights: old graphs would read the old ones
    moved = fast(model, "static")
    assert moved is not runner and moved.model is model and fast(model, "static") is moved


def test_prepare_wraps_the_cached_parts_only():
    target = tiny_gpt(0, n_layer=3)
    models = Models(target=target, draft=tiny_gpt(5, n_layer=1), eagle=random_head(target),
                    parallelspec=tiny_drafter(target), early_exit=random_adapter(target))
    wrapped, path = prepare(models, "static")
    assert path == "static"
    for part in ("target", "draft", "eagle", "parallelspec"):
        assert isinstance(getattr(wrapped, part), Fast) and getattr(wrapped, part).model is getattr(models, part)
    assert wrapped.early_exit is models.early_exit  # reads one position, keeps no cache: runs as it is
    assert prepare(models, "static")[0].target is wrapped.target
    assert prepare(Models(target=target), "static")[0].draft is None
    for runtime in ("eager", "auto"):  # auto on a CPU: plain PyTorch
        assert prepare(models, runtime) == (models, "eager")


def test_runtime_path_is_graph_on_cuda_only():
    """auto replays graphs on CUDA and runs plain PyTorch elsewhere; eager is eager everywhere; static is the
    graph path on CUDA and shape-static forwards replayed by the emulation elsewhere."""
    assert RUNTIMES == ("auto", "eager", "static")
    assert [runtime_path(r, "cuda:0") for r in RUNTIMES] == ["graph", "eager", "graph"]
    assert [runtime_path(r, d) for r in RUNTIMES for d in ("cpu", "meta")] == ["eager"] * 4 + ["static"] * 2
    with pytest.raises(ValueError, match="runtime must be one of auto, eager, static, got 'fast'"):
        runtime_path("fast", "cpu")


@torch.inference_mode()
def test_a_full_cache_is_a_one_line_error():
    runner = Fast(tiny_gpt(0))
    cache = runner.new_cache(max_len=8)
    runner(ids([1] * 6), cache=cache)
    with pytest.raises(ValueError, match=r"KV cache full: 10 tokens > 8; shorten") as error:
        runner(ids([1] * 4), cache=cache)
    assert "\n" not in str(error.value) and cache.layer_lengths == [6, 6]


def test_a_dropped_model_drops_its_wrapper():
    """The wrapper is kept on the model itself, so dropping the model drops it (and, on a GPU, its graphs)."""
    target = tiny_gpt(0)
    models = Models(target=target, eagle=random_head(target))
    target = None
    wrapped, _ = prepare(models, "static")
    METHODS["eagle"](wrapped, [1, 2, 3], 10)
    refs = [weakref.ref(models.target), weakref.ref(models.eagle), weakref.ref(wrapped.eagle)]
    models = wrapped = None
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_failed_capture_warns_once_and_runs_eager(monkeypatch, capsys):
    """A capture can fail (an operation CUDA graphs do not allow). Here the emulated capture is made to fail:
    the call that tried still returns the right output, one warning line goes to stderr, the model runs eager
    from then on, and the cache is as the plain one."""
    class NoGraph(graphs.Emulated):
        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing\n(the rest of a long message)")

    monkeypatch.setattr(graphs, "Emulated", NoGraph)
    model = tiny_gpt(0)
    runner = Fast(model)
    plain, cache = model.new_cache(), runner.new_cache()
    with torch.inference_mode():
        for t, x in enumerate([[1, 2, 3], [4], [5], [6], [7, 8], [7, 8]]):  # [5]: T = 1 seen twice, capture
            same_output(runner(ids(x), cache=cache), model(ids(x), cache=plain))
            same_cache(cache, plain)
            assert runner.graphs.enabled == (t < 2)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["warning: CUDA graph capture failed (RuntimeError: operation not permitted when stream is "
                     "capturing); the GPT's forwards run eager from here"]
    assert not runner.graphs.entries  # the entry that failed was not kept


# ---------------------------------------------------------------------------------------------------------
# Every method on the static path: ar's tokens greedy, the eager path's tokens when sampling


CASES = [
    ("ar", {}),
    ("prompt-lookup", {}),
    ("prompt-lookup", {"adaptive": "history", "draft_len": 3}),
    ("jacobi", {}),
    ("jacobi", {"block": 3}),
    ("lookahead", {}),
    ("lookahead", {"window": 2, "ngram": 3, "guesses": 2}),
    ("speculative", {"draft_len": 1}),
    ("speculative", {"draft_len": 3}),
    ("speculative", {"draft_len": 2, "adaptive": "history"}),  # k changes from step to step: a shape per k
    ("speculative", {"draft_len": 3, "adaptive": "confidence", "confidence": 0.12}),  # vocab 11: cuts some chains
    ("speculative", {"draft_len": 3, "verify": "block"}),
    ("mtp", {}),
    ("mtp", {"draft_sampling": "topk", "draft_len": 2}),
    ("mtp", {"adaptive": "confidence", "confidence": 0.12}),
    ("mtp", {"verify": "block", "draft_sampling": "sample"}), ("mtp", {"draft_sampling": "sample"}),
    ("medusa", {}),
    ("medusa", {"tree": "large", "draft_sampling": "topk"}),
    ("medusa", {"verify": "typical"}),
    ("medusa", {"verify": "traversal"}),
    ("eagle", {}),
    ("eagle", {"tree": "dynamic"}),
    ("eagle", {"tree": "dynamic", "depth": 3, "width": 2, "total_tokens": 6, "draft_sampling": "topk"}),
    ("eagle", {"tree": "dynamic", "verify": "traversal"}),
    ("eagle", {"verify": "block", "depth": 3}),
    ("parallelspec", {}),
    ("parallelspec", {"verify": "traversal"}),
    ("parallelspec", {"tree": "chain"}),
    ("parallelspec", {"tree": "chain", "verify": "block"}),
    ("early-exit", {}),
    ("early-exit", {"draft_len": 3, "exit_layer": 1}),
    ("early-exit", {"exit_layer": 2, "adaptive": "confidence", "confidence": 0.12}),
    ("early-exit", {"adaptive": "history", "draft_len": 2}),
    ("early-exit", {"verify": "block"}),
]
SAMPLINGS = {"greedy": (0.0, None, None), "t1": (1.0, None, None), "t0.8-k3-p0.9": (0.8, 3, 0.9)}


def covering_set(cases):
    """(case number, method, options, the sampled setting) for each case, the two sampled settings taking turns
    within each method so that every method meets both. They differ only in warp, which runs in the method,
    outside every forward the static path replays: what a case proves at one it proves at the other. (Every case
    at every setting, three seeds each, took four times as long and proved nothing more.)"""
    params, turn = [], {}
    for case, (method, options) in enumerate(cases):
        sampled = ("t1", "t0.8-k3-p0.9")[turn.setdefault(method, 0) % 2]
        turn[method] += 1
        name = f"{method}-{'-'.join(map(str, options.values())) or 'default'}"
        params.append(pytest.param(case, method, options, sampled, id=f"{name}-greedy-{sampled}"))
    return params


def both_paths(method, models, prompt, n, sampling, **options):
    """[(ids, stats) on the static path, (ids, stats) on the eager one] for the same request."""
    temperature, top_k, top_p = sampling
    return [METHODS[method](prepare(models, runtime)[0], prompt, n, temperature=temperature, top_k=top_k,
                            top_p=top_p, **options) for runtime in ("static", "eager")]


@pytest.mark.parametrize("case, method, options, sampled", covering_set(CASES))
def test_static_path_gives_the_eager_paths_tokens(case, method, options, sampled):
    """Greedy and at one sampled setting, each run on its own models and prompt: the seeds take turns over 0..2
    from case to case, the sampled run one seed ahead of the greedy one."""
    accepted = 0
    for sampling, seed in (("greedy", case % 3), (sampled, (case + 1) % 3)):
        models, prompt = all_models(seed), random_ids(2 + 3 * seed, seed=seed)
        (got, stats), (expected, plain_stats) = both_paths(method, models, prompt, 40, SAMPLINGS[sampling],
                                                           seed=seed, **options)
        assert got == expected and len(got) == 40, sampling
        assert stats["accepted_per_step"] == plain_stats["accepted_per_step"]  # the same guesses were made
        if sampling == "greedy" and options.get("verify") != "typical":
            assert got == METHODS["ar"](models, prompt, 40)[0]
        accepted += stats["new_tokens"] - stats["target_forwards"]
    assert accepted > 0 or method == "ar", "no guess kept: the rollbacks past accepted guesses never ran"


@pytest.mark.parametrize("options", [{}, {"tree": "dynamic"}, {"tree": "dynamic", "draft_sampling": "topk"}])
def test_static_path_with_a_head_without_attention(options):
    """The default EAGLE head has no attention (the random heads of the other cases have): its forwards are placed
    by positions alone, replayed on the static path as they run eagerly, chain and trees."""
    accepted = 0
    for sampling, seed in (("greedy", 0), ("t1", 1)):
        models = all_models(seed)
        models = replace(models, eagle=random_head(models.target, seed, attention=False))
        (got, stats), (expected, plain_stats) = both_paths("eagle", models, random_ids(5, seed=seed), 40,
                                                           SAMPLINGS[sampling], seed=seed, **options)
        assert got == expected and stats["accepted_per_step"] == plain_stats["accepted_per_step"], sampling
        accepted += stats["new_tokens"] - stats["target_forwards"]
    assert accepted > 0, "no guess kept: the rollbacks past accepted guesses never ran"


@pytest.mark.parametrize("sampling", ["greedy", "t1"])
@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_static_path_runs_to_the_context_limit_like_eager(method, sampling):
    """Near the context's end every method guesses fewer tokens: a new shape each step, until it stops."""
    models = all_models(7, block_size=24)
    (got, stats), (expected, _) = both_paths(method, models, random_ids(9, seed=7), 100, SAMPLINGS[sampling],
                                             seed=7)
    assert got == expected and stats["stop"] == "context" and len(got) == 24 - 9


def test_speculative_with_the_target_as_its_own_draft():
    """Target and draft are one model: on the static path it must still keep two caches, one per role (sharing
    one would break every step). The draft IS the target, so every guess is right."""
    target = tiny_gpt(4)
    models, _ = prepare(Models(target=target, draft=target), "static")
    got, stats = METHODS["speculative"](models, [2, 5], 30, draft_len=3)
    assert got == METHODS["ar"](Models(target=target), [2, 5], 30)[0]
    assert stats["accepted"] == stats["drafted"]


def test_a_second_generation_reuses_the_first_ones_entries():
    """prepare hands the next generation the same Fast models, their caches emptied, their recorded entries (a
    GPU's graphs) kept: the same entries, the same tokens."""
    models = all_models(0)
    for method, part, options in [("early-exit", "target", {"exit_layer": 1}), ("eagle", "eagle", {}),
                                  ("parallelspec", "parallelspec", {})]:
        wrapped, _ = prepare(models, "static")
        first = METHODS[method](wrapped, [1, 2, 3], 30, **options)[0]
        runner = getattr(wrapped, part)
        entries = dict(runner.graphs.entries)
        pooled = {key: [id(entry[0].k) for entry in pool] for key, pool in runner.caches.items()}
        assert entries and pooled
        wrapped, _ = prepare(models, "static")
        assert getattr(wrapped, part) is runner
        assert METHODS[method](wrapped, [1, 2, 3], 30, **options)[0] == first
        assert all(runner.graphs.entries[key] is entry for key, entry in entries.items())
        assert {key: [id(entry[0].k) for entry in pool] for key, pool in runner.caches.items()} == pooled  # the same tensors


# ---------------------------------------------------------------------------------------------------------
# Sampling laws through the static path (first tokens against the target's exact law, tv_bound with delta 1e-6)

TRUNCATED = (1.0, 2, None)  # top-k 2: a tree with 3 ranks at depth 1 has a node q never draws


def medusa_law(n):
    models = Models(target=tiny_gpt(3, **SAMPLING_MODEL))
    law, accepted = method_law(prepare(models, "static")[0], [1, 2], 2, n, "medusa", TRUNCATED,
                               tree=SAMPLING_TREE)  # "0;1;2;...": rank 2 at depth 1
    return law, exact_law(models.target, [1, 2], 2, TRUNCATED), accepted


def parallelspec_law(n):
    models, prompt = parallelspec_sampling_models(), [1, 3, 2]  # test_parallelspec.py's
    law, accepted = parallelspec_sampled_law(prepare(models, "static")[0], prompt, 2, n, TRUNCATED,
                                             tree="0;1;2;0,0;1,0;0,1")
    return law, exact_law(models.target, prompt, 2, TRUNCATED), accepted


@pytest.mark.parametrize("law_of", [medusa_law, parallelspec_law], ids=["medusa", "parallelspec"])
def test_drawn_tree_with_truncation_law(law_of):
    """Drawn trees whose shape asks for more draws than q allows: fill_tree leaves those nodes out. First 2
    tokens, 25 outcomes, n = 1000: bound 0.125 (a correct run comes out near 0.02). Guesses must be accepted
    often, or the test would check only the target's own tokens."""
    n = 1000
    law, exact, accepted = law_of(n)
    assert tv(law, exact) < tv_bound(25, n)
    assert accepted > n / 8, accepted


# ---------------------------------------------------------------------------------------------------------
# On a GPU: the graph path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", list(METHODS))
def test_graph_path_gives_the_eager_paths_tokens_on_cuda(method):
    """auto on CUDA replays captured graphs: greedy, ar's tokens; seeded at t=1, the eager path's (both on the
    GPU); and graphs were really captured."""
    models = all_models(0)
    for part in ("target", "draft", "eagle", "parallelspec", "early_exit"):
        setattr(models, part, getattr(models, part).cuda())
    wrapped, path = prepare(models, "auto")
    assert path == "graph"
    prompt = random_ids(5, seed=1)
    reference = METHODS["ar"](models, prompt, 40)[0]
    for temperature in (0.0, 1.0):
        got = METHODS[method](wrapped, prompt, 40, temperature=temperature, seed=0)[0]
        assert got == (reference if temperature == 0 else METHODS[method](models, prompt, 40, temperature=1.0,
                                                                          seed=0)[0])
    assert wrapped.target.graphs.captured > 0
