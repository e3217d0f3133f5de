"""The first GPU run's failures (issue 32), each reproduced on the CPU through the emulated replay, and each held
fixed here. The static path on a CPU now replays (graphs.Emulated), so tests/test_runtime.py's method tests
(`test_static_path_gives_the_eager_paths_tokens`, greedy and seeded t=1 / t=0.8, every method) are the
broad net: before the fixes they failed as the H200 did. The tests below pin each cause:

  - greedy output off at token 1 or 2, and `AssertionError: (16, [15, ..])` at rollback when sampling: a Fast
    model's cache moves were recorded under a key without the shapes, so a replayed 1-token step applied the moves
    of whichever shape last ran as Python (test_cache_moves_follow_each_graphs_shapes, with its negative control);
  - `Cannot copy between CPU and CUDA tensors during CUDA graph capture`: the ParallelSpec drafter was given its
    anchors as a Python list (test_the_parallelspec_drafter_is_captured_and_replayed, test_anchors_as_a_list_are_
    refused);
  - `indexSelectSmallIndex: srcIndex < srcSelectDimSize`, a device-side assert: positions past the position table
    reached a kernel (test_a_position_past_the_table_is_a_host_side_error);
  - gpu_check blamed every later static row on one part's failed capture (test_gpu_check.py,
    test_a_static_path_that_differs_or_gives_up_its_graphs_is_named); the bench's report when `ar` failed
    (test_bench*.py)."""
import pytest
import torch

from nanospec.fast import runtime
from nanospec.decoding import METHODS
from nanospec.fast.runtime import Fast, prepare

from toys import all_models, ids, random_head, random_ids, tiny_drafter, tiny_gpt


@pytest.mark.parametrize("method", ["ar", "prompt-lookup", "jacobi", "speculative", "mtp"])
def test_cache_moves_follow_each_graphs_shapes(method, monkeypatch):
    """The methods that failed greedily on the H200, greedy and at t=1, static (replayed) against eager; then the
    negative control: a graph key without the shapes (the bug) is caught on the CPU."""
    models, prompt = all_models(1), random_ids(5, seed=1)
    for temperature in (0.0, 1.0):
        static = METHODS[method](prepare(models, "static")[0], prompt, 30, temperature=temperature, seed=3)[0]
        assert static == METHODS[method](models, prompt, 30, temperature=temperature, seed=3)[0]
    real = runtime.graph_key
    monkeypatch.setattr(runtime, "graph_key", lambda cache, given, kwargs, tensors: real(cache, given, kwargs, ()))
    fresh = all_models(1)  # new wrappers: none of the entries recorded above
    try:
        broken = METHODS[method](prepare(fresh, "static")[0], prompt, 30, temperature=0.0, seed=3)[0]
    except (AssertionError, ValueError):  # one key, two sets of moves (or a cache that drifted past its end)
        assert method != "ar"
        return
    if method == "ar":  # its prompt runs eager (a prefill: runtime.Fast), so every forward a graph replays is one
        # token, and a key without shapes has nothing to confuse (on the H200 the prompt was replayed too)
        assert broken == METHODS[method](fresh, prompt, 30)[0]
        return
    assert broken != METHODS[method](fresh, prompt, 30)[0], "a graph key without shapes went unnoticed"


@torch.inference_mode()
def test_the_parallelspec_drafter_is_captured_and_replayed():
    models = all_models(2)
    wrapped, _ = prepare(models, "static")
    got = METHODS["parallelspec"](wrapped, random_ids(6, seed=2), 30)[0]
    assert got == METHODS["parallelspec"](models, random_ids(6, seed=2), 30)[0]
    drafter = wrapped.parallelspec
    assert drafter.graphs.enabled and drafter.graphs.captured > 0  # no capture given up: it replayed


def test_anchors_as_a_list_are_refused():
    target = tiny_gpt(0)
    drafter = tiny_drafter(target)
    with pytest.raises(TypeError, match="anchors must be a"):
        drafter(target, ids([1, 2, 3]), [2])


@torch.inference_mode()
def test_a_position_past_the_table_is_a_host_side_error():
    """On CUDA an index past wpe is a device-side assert that poisons the process: the model's layout refuses it
    on the host first, as one line, eager and replayed alike (a cache longer than the position table, as a tree's
    room makes; the EAGLE head's positions run one ahead of its slots)."""
    model = tiny_gpt(0, block_size=16)
    for runner in (model, Fast(model)):
        cache = runner.new_cache(max_len=24)
        runner(ids(random_ids(15)), cache=cache)  # positions 0..14: fine
        with pytest.raises(ValueError, match="position 16 is past the model's context of 16 tokens"):
            runner(ids([1, 2]), cache=cache)  # positions 15, 16
    target = tiny_gpt(0, block_size=16)
    head = random_head(target, 0)
    for runner in (head, Fast(head)):
        cache = runner.new_cache(max_len=24)
        features = torch.zeros(1, 15, target.config.n_embd, dtype=torch.float64)
        runner(target, ids(random_ids(14)), features[:, :14], cache=cache)  # positions 1..14
        with pytest.raises(ValueError, match="position 16 is past the model's context of 16 tokens"):
            runner(target, ids([1, 2]), features[:, :2], cache=cache)  # positions 15, 16
