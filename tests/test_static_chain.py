"""The chain methods on the static runtime (nanospec/static.py): `prompt-lookup`, `jacobi`, `mtp` and `early-exit`
with --runtime static give the plain path's ids token for token, greedy (and then `ar`'s) and, seeded, at
temperature 1; with their adaptive rules; up to the context limit, where the verify width shrinks step by step.
mtp's sampling-law test passes through the static path, and the static path makes every tensor on the model's
device. On a CPU the static path calls its forwards instead of replaying graphs: the same buffers, masks and
slots, so these tests hold the code a GPU replays to its oracle."""
from functools import partial

import pytest
import torch

import test_device
import test_mtp_medusa
from nanospec.decoding import METHODS
from nanospec.parts import Models
from nanospec.static import runtime_model
from test_early_exit_adaptive import random_adapter
from test_model import random_ids, tiny_gpt

CASES = [
    ("prompt-lookup", {}),
    ("prompt-lookup", {"adaptive": "history", "draft_len": 3}),
    ("jacobi", {}),
    ("jacobi", {"block": 3}),
    ("mtp", {}),
    ("mtp", {"draft_sampling": "topk", "draft_len": 2}),
    ("mtp", {"adaptive": "confidence", "confidence": 0.12}),  # vocab 11: cuts some chains, not all
    ("early-exit", {}),
    ("early-exit", {"exit_layer": 2, "adaptive": "confidence", "confidence": 0.12}),
    ("early-exit", {"adaptive": "history", "draft_len": 2}),
]
RUNTIMES = ("static", "eager")


def chain_models(seed):
    """A tiny random target with 3 layers and 3 MTP heads, and an early-exit adapter for it."""
    target = tiny_gpt(seed, n_layer=3, n_future=3, block_size=64)
    return Models(target=target, early_exit=random_adapter(target, seed))


def generations(method, models, prompt, n, **kw):
    """[(ids, stats) of the static runtime, (ids, stats) of the plain one] for the same request."""
    return [METHODS[method](models, prompt, n, runtime=r, **kw) for r in RUNTIMES]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method, options", CASES)
def test_static_equals_plain(method, options, temperature):
    accepted = 0
    for seed in range(3):
        models = chain_models(seed)
        prompt = random_ids(2 + 3 * seed, seed=seed)
        (ids, stats), (plain_ids, plain_stats) = generations(method, models, prompt, 40, temperature=temperature,
                                                             seed=seed, **options)
        assert ids == plain_ids and len(ids) == 40, seed
        assert (stats["runtime"], plain_stats["runtime"]) == RUNTIMES
        assert stats["accepted_per_step"] == plain_stats["accepted_per_step"]
        if temperature == 0:
            assert ids == METHODS["ar"](models, prompt, 40)[0], seed
        accepted += stats["accepted"]
    assert accepted > 0  # guesses were kept: the rollbacks past a partly accepted chain were exercised


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["prompt-lookup", "jacobi", "mtp", "early-exit"])
def test_static_runs_to_the_context_limit_like_plain(method, temperature):
    """Near the context end every method guesses fewer tokens: a new verify width (a new shape) each step."""
    target = tiny_gpt(7, n_layer=3, n_future=3, block_size=24)
    models = Models(target=target, early_exit=random_adapter(target, 7))
    (ids, stats), (plain_ids, _) = generations(method, models, random_ids(9, seed=7), 100,
                                               temperature=temperature, seed=7)
    assert ids == plain_ids and stats["stop"] == "context" and len(ids) == 24 - 9


def test_the_static_forwards_are_kept_across_generations():
    """A second generation reuses the first one's StaticGPT (on a GPU, its captured graphs) and its cache,
    emptied; early-exit's draft (lower range and exit, k = 4 guesses) is one chain entry reading the newest
    token (1, 1), whatever the cache's length."""
    models = chain_models(0)
    first = METHODS["early-exit"](models, [1, 2, 3], 30, runtime="static", exit_layer=1)
    static, cache, _ = runtime_model(models.target, "static")
    entries = dict(static.graphs.entries)
    lower = [key for key in entries if key[0][:3] == ("chain", 1, 4)]  # ("chain", E, k, ...)
    assert [key[1][1][0] for key in lower] == [(1, 1)]  # inputs: the first free slot (1,), the newest token (1, 1)
    assert METHODS["early-exit"](models, [1, 2, 3], 30, runtime="static", exit_layer=1)[0] == first[0]
    assert all(static.graphs.entries[key] is entry for key, entry in entries.items())  # same buffers


def test_mtp_sampling_law_through_the_static_path(monkeypatch):
    """test_mtp_medusa's law test (TV against the exact law of the first 2 tokens) with --runtime static, where
    the heads run inside the verify forward."""
    monkeypatch.setitem(METHODS, "mtp", partial(METHODS["mtp"], runtime="static"))
    test_mtp_medusa.test_sampling_follows_the_target_law("mtp", "sample", 2, (0.8, 4, None), 1500)


@pytest.mark.parametrize("method", ["prompt-lookup", "jacobi", "mtp", "early-exit"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_path_makes_every_tensor_on_the_models_device(method, temperature):
    """test_device.py's check (a tensor made without naming a device lands on meta and fails), on the static path."""
    models = chain_models(0)
    for seed in range(2):
        with torch.device("meta"), test_device.on_meta_fails():
            ids, _ = METHODS[method](models, random_ids(6, seed=3), 10, temperature=temperature, seed=seed,
                                     runtime="static")
        assert len(ids) == 10
