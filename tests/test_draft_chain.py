"""A drafter's chain as one function of tensors (nanospec/draft_chain.py, StaticGPT.chain): `speculative`'s k draft
forwards and draws, `early-exit`'s k+1 passes of blocks 1..E with its exit and draws, each run as ONE call of
the static runner's Graphs per step (on CUDA one graph; here, the CPU, the same function on the same buffers).

  - the static chain gives the eager path's ids token for token, greedy (then `ar`'s) and seeded at temperature
    1, with fixed and adaptive draft lengths: both runtimes draw by Gumbel-max from noise drawn outside the chain;
  - gumbel_draw is verify.draw_rows given the same uniforms, and exact on its own (a law test);
  - the chain is called once per step, no draft forward runs outside it, and its entry keeps its buffers'
    addresses from one step (and generation) to the next;
  - the sampling law of the output, through the static chain, is the target's; a broken draw inside the chain
    (the argmax where a draw belongs) fails the same test;
  - the drafter's passes and time are still reported, and each step reads the host once per target forward.
"""
from functools import partial

import pytest
import torch

import test_early_exit_adaptive as ee
import test_speculative
from nanospec import draft_chain
from nanospec.decoding import METHODS
from nanospec.decoding import early_exit as early_exit_module
from nanospec.decoding import speculative as speculative_module
from nanospec.draft_chain import gumbel_draw
from nanospec.graphs import Graphs
from nanospec.parts import Models
from nanospec.static import runtime_model
from nanospec.verify import draw_rows
from test_host_reads import counting_host_reads
from test_model import random_ids, tiny_gpt
from test_verify import empirical_law, sequence_codes, tv, tv_bound


def models_for(seed):
    """A 3-layer target with an early-exit adapter, and a 1-layer draft GPT."""
    target = tiny_gpt(seed, n_layer=3, block_size=64)
    return Models(target=target, draft=tiny_gpt(seed + 10, n_layer=1, n_future=0, block_size=64),
                  early_exit=ee.random_adapter(target, seed))


CASES = [
    ("speculative", {"draft_len": 1}),
    ("speculative", {"draft_len": 3}),
    ("speculative", {"draft_len": 2, "adaptive": "history"}),  # k changes: one chain entry per k
    ("speculative", {"draft_len": 3, "adaptive": "confidence", "confidence": 0.12}),  # forward by forward
    ("early-exit", {"draft_len": 3, "exit_layer": 1}),
    ("early-exit", {"draft_len": 2, "exit_layer": 2, "adaptive": "history"}),
    ("early-exit", {"draft_len": 3, "adaptive": "confidence", "confidence": 0.12}),
]


@pytest.mark.parametrize("sampling", [(0.0, None, None), (1.0, None, None), (0.8, 3, 0.9)])
@pytest.mark.parametrize("method, options", CASES)
def test_static_chain_equals_eager(method, options, sampling):
    temperature, top_k, top_p = sampling
    accepted = 0
    for seed in range(3):
        models, prompt = models_for(seed), random_ids(1 + 3 * seed, seed=seed)
        (ids, stats), (plain_ids, plain_stats) = [
            METHODS[method](models, prompt, 40, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            runtime=r, **options) for r in ("static", "eager")]
        assert ids == plain_ids and len(ids) == 40, seed
        assert stats["accepted_per_step"] == plain_stats["accepted_per_step"]
        assert (stats["runtime"], plain_stats["runtime"]) == ("static", "eager")
        if temperature == 0:
            assert ids == METHODS["ar"](models, prompt, 40)[0], seed
        accepted += stats["accepted"]
    assert accepted > 0


def test_gumbel_draw_is_draw_rows_given_the_same_uniforms():
    q = torch.softmax(torch.randn(6, 9, dtype=torch.float64), -1)  # (6, 9)
    q[2, :4] = 0.0  # excluded tokens are never drawn
    for seed in range(20):
        u = torch.rand(q.shape, generator=torch.Generator().manual_seed(seed), dtype=q.dtype)  # (6, 9)
        drawn = gumbel_draw(q, u)
        assert torch.equal(drawn, draw_rows(q, torch.Generator().manual_seed(seed)))
        assert drawn[2] >= 4
    assert torch.equal(gumbel_draw(q, None), q.argmax(-1))  # no noise: greedy


def test_gumbel_draw_follows_its_law():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    n = 20000
    u = torch.rand(n, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # (n, 5)
    counts = torch.bincount(gumbel_draw(q.expand(n, 5), u), minlength=5).double() / n
    assert tv(counts, q) < tv_bound(4, n)


def count_chains(monkeypatch, module):
    """While a generation runs: how many draft chains ran (draft_chain calls), and for each chain call of a Graphs
    (key ("chain", end, k, ...), input shapes, its outputs' addresses)."""
    seen = {"chains": 0, "graph_calls": []}
    real_chain, real_graphs = module.draft_chain, Graphs.__call__

    def chain(*a, **kw):
        seen["chains"] += 1
        return real_chain(*a, **kw)

    def graphs_call(self, fn, *inputs, key=()):
        out = real_graphs(self, fn, *inputs, key=key)
        if key and key[0] == "chain":
            seen["graph_calls"].append((key, [tuple(x.shape) for x in inputs], [t.data_ptr() for t in out]))
        return out

    monkeypatch.setattr(module, "draft_chain", chain)
    monkeypatch.setattr(Graphs, "__call__", graphs_call)
    return seen


def addresses(graph_calls):
    """{(key, shapes): [outputs' addresses of each call]}"""
    by_entry = {}
    for key, shapes, ptrs in graph_calls:
        by_entry.setdefault((key, str(shapes)), []).append(ptrs)
    return by_entry


@pytest.mark.parametrize("method, module", [("speculative", speculative_module), ("early-exit", early_exit_module)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_chain_call_per_step_on_buffers_that_keep_their_addresses(method, module, temperature, monkeypatch):
    models = models_for(0)
    seen = count_chains(monkeypatch, module)
    ids, stats = METHODS[method](models, [1, 2, 3], 30, temperature=temperature, seed=0, runtime="static",
                                 draft_len=3)
    steps = len(stats["accepted_per_step"]) - 1  # verify steps (the first forward is the prefill)
    ks = [key[2] for key, _, _ in seen["graph_calls"]]
    assert seen["chains"] == len(ks) >= steps - 1  # one chain per step (the last may have no room to guess)
    assert sum(ks) == stats["drafted"] == stats["drafter_passes"]  # every guess was drawn inside a chain
    first = addresses(seen["graph_calls"])
    assert max(len(calls) for calls in first.values()) >= 3
    for calls in first.values():  # from a shape's second call on, the same output buffers
        assert all(ptrs == calls[1] for ptrs in calls[1:])
    # a second generation finds the same entries and buffers
    role = "draft" if method == "speculative" else "target"
    runner = runtime_model(getattr(models, role), "static", role=role)[0]
    entries = {key: entry for key, entry in runner.graphs.entries.items() if key[0][0] == "chain"}
    del seen["graph_calls"][:]
    METHODS[method](models, [1, 2, 3], 30, temperature=temperature, seed=1, runtime="static", draft_len=3)
    assert entries and all(runner.graphs.entries[key] is entry for key, entry in entries.items())
    for entry, calls in addresses(seen["graph_calls"]).items():
        if len(first.get(entry, [])) > 1:
            assert all(ptrs == first[entry][1] for ptrs in calls)


def test_speculative_static_drafts_only_through_the_chain(monkeypatch):
    """Outside the chain the static draft runs one forward per generation: the prompt."""
    models = models_for(1)
    draft = runtime_model(models.draft, "static", role="draft")[0]
    forwards = []
    real = type(draft).__call__
    monkeypatch.setattr(type(draft), "__call__", lambda self, *a, **kw: forwards.append(self) or real(self, *a, **kw))
    METHODS["speculative"](models, [1, 2], 30, temperature=1.0, seed=0, runtime="static")
    assert forwards.count(draft) == 1


@pytest.mark.parametrize("method", ["speculative", "early-exit"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_host_read_per_target_forward(method, temperature):
    models = models_for(2)
    for options in ({"draft_len": 4}, {"draft_len": 2, "adaptive": "history"}):
        with counting_host_reads() as counts:
            ids, stats = METHODS[method](models, random_ids(5, seed=2), 40, temperature=temperature, seed=0,
                                         runtime="static", **options)
        assert sum(counts.values()) <= stats["target_forwards"], counts
        assert stats["drafter_passes"] == stats["drafted"] and stats["draft_time"] > 0


# ---------------------------------------------------------------------------------------------------------
# The law of the output through the static chain


def test_an_argmax_inside_the_chain_is_caught(monkeypatch):
    """Negative control: the chain takes the argmax of q where it should draw from it (q_draft then lies about
    where the guesses came from). test_speculative's law statistic (the one test_static.py passes through the
    static path), with 1000 runs, must exceed its bound."""
    monkeypatch.setattr(draft_chain, "gumbel_draw", lambda q_draft, u: q_draft.argmax(-1))
    monkeypatch.setattr(test_speculative, "speculative", partial(METHODS["speculative"], runtime="static"))
    distance, bound = test_speculative.sampled_tv(2, (1.0, None, None), 1000)
    assert distance > bound, f"TV {distance:.4f} <= bound {bound:.4f}: the test cannot see this bug"


def test_early_exit_sampling_law_through_the_static_chain():
    """test_early_exit_adaptive's law test with a fixed k (the whole draft one chain) on the static runtime, with
    top-k and top-p (tv_bound(125, 1500) = 0.184)."""
    target = ee.toy_gpt(0, n_layer=2)
    models = Models(target=target, early_exit=ee.random_adapter(target, 1, scale=0.3))
    prompt, n, (temperature, top_k, top_p) = [1, 3], 1500, (0.8, 3, 0.9)
    seqs = torch.tensor([METHODS["early-exit"](models, prompt, 4, temperature=temperature, top_k=top_k, top_p=top_p,
                                               seed=s, draft_len=2, runtime="static")[0][:ee.L]
                         for s in range(n)])  # (n, L); budget 4: the first verify step drafts both guesses
    sampling = (temperature, top_k, top_p)
    law = ee.exact_law(target, prompt, ee.L, sampling)
    distance, bound = tv(empirical_law(sequence_codes(seqs, 5), 5**ee.L), law), tv_bound(125, n)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f}"
