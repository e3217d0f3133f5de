"""nanospec/graphs.py on the CPU: the first call of a key and shapes just calls the function; the second makes
the buffers, which keep their addresses and are rewritten in place from then on; one entry per key and shapes
called twice; warm-up calls leave protected state as it was. A capture that fails (forced here on the CPU) is a
one-line CaptureFailed that restores the protected state and turns the object off (`enabled`). The capture
itself needs CUDA: its test is skipped here and runs on a GPU machine."""
import pytest
import torch

from nanospec.graphs import CaptureFailed, Graphs, warm_up


def affine(x, w):
    """A function of tensors with two outputs, one of them None (like a layer range's missing logits)."""
    return x @ w + 1, None


def test_passthrough_equals_calling_the_function():
    graphs = Graphs()
    w = torch.randn(4, 3)
    for _ in range(3):
        x = torch.randn(2, 4)
        y, none = graphs(affine, x, w)
        assert none is None
        assert torch.equal(y, affine(x, w)[0])


def test_first_call_is_plain_then_buffers_keep_their_addresses():
    graphs = Graphs()
    w = torch.randn(4, 3)
    graphs(affine, torch.randn(2, 4), w)  # the first call of a shape just calls the function
    assert not graphs.entries
    second = graphs(affine, torch.randn(2, 4), w)[0]  # the second makes the buffers
    (entry,) = graphs.entries.values()
    inputs = [t.data_ptr() for t in entry.inputs]
    for _ in range(3):
        x = torch.randn(2, 4)
        y = graphs(affine, x, w)[0]
        assert y is second and y.data_ptr() == second.data_ptr()  # the same output tensor, rewritten in place
        assert torch.equal(y, affine(x, w)[0])
        assert [t.data_ptr() for t in entry.inputs] == inputs and torch.equal(entry.inputs[0], x)
    assert graphs.captured == 0


def test_outputs_are_reused_so_keep_a_clone():
    """What the caller must know (nanospec/runtime.py clones for the methods): the next call with the same
    shapes rewrites the output it handed back."""
    graphs = Graphs()
    w = torch.eye(4, 3)
    graphs(affine, torch.zeros(2, 4), w)
    kept = graphs(affine, torch.zeros(2, 4), w)[0]
    copy = kept.clone()
    graphs(affine, torch.ones(2, 4), w)
    assert not torch.equal(kept, copy) and torch.equal(kept, affine(torch.ones(2, 4), w)[0])


def test_one_entry_per_key_and_shape():
    graphs = Graphs()
    w = torch.randn(4, 3)
    calls = [(torch.ones(2, 4), ()), (torch.ones(5, 4), ()), (torch.ones(2, 4), "other")]
    for x, key in calls + calls:  # each twice: the second call of each makes its entry
        graphs(affine, x, w, key=key)
    graphs(affine, torch.ones(7, 4), w)  # once only: no entry
    assert len(graphs.entries) == 3 and len(graphs.seen) == 4
    assert torch.equal(graphs(affine, torch.ones(2, 4), w)[0], graphs(affine, torch.ones(2, 4), w, key="other")[0])


def test_warm_up_leaves_protected_state_untouched():
    cache = torch.arange(6.0)
    calls = []

    def writes_the_cache(x):
        calls.append(1)
        cache.add_(x)
        return (cache * 2,)

    warm_up(writes_the_cache, [torch.ones(6)], protect=[cache], runs=3)
    assert len(calls) == 3 and cache.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_failed_capture_is_one_line_and_turns_graphs_off(monkeypatch):
    """Forced on the CPU: capture on, torch.cuda.CUDAGraph failing with a long message. The second call (the
    one that captures) runs the warm-up, which writes the protected cache, then fails: CaptureFailed with the
    first line of the cause, the cache restored, `enabled` False and no entry kept. The caller goes on eager."""
    def no_graph():
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors might be ...")

    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)  # warm up on the current stream: no CUDA here
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graph)
    cache, writes = torch.zeros(4), []

    def step(x, slot):  # writes the cache, like a forward writing its keys
        writes.append(1)
        cache.index_copy_(0, slot, x)
        return (cache * 1,)

    graphs = Graphs()
    graphs.capture = True  # Graphs(capture=True) itself refuses a machine without CUDA
    seen = graphs(step, torch.ones(1), torch.tensor([0]), protect=[cache])[0]  # first call: just called
    assert seen.tolist() == [1.0, 0.0, 0.0, 0.0] and graphs.enabled
    with pytest.raises(CaptureFailed) as error:
        graphs(step, torch.full((1,), 7.0), torch.tensor([2]), protect=[cache])
    assert str(error.value) == "RuntimeError: operation not permitted when stream is capturing"
    assert len(writes) == 1 + graphs.warmup_runs  # the warm-up ran, and wrote slot 2 ...
    assert cache.tolist() == [1.0, 0.0, 0.0, 0.0]  # ... which is undone
    assert not graphs.enabled and not graphs.entries and graphs.captured == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_capture_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Graphs(capture=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capture_replays_and_protects_state():
    cache = torch.zeros(8, device="cuda")
    w = torch.randn(4, 3, device="cuda")

    def step(x, slot):  # writes the cache, like a forward writing its keys
        cache.index_copy_(0, slot, x[:1, 0])
        return affine(x, w)[0], cache * 1

    graphs = Graphs(capture=True)
    for i in range(4):  # called once, then captured, then replayed
        x = torch.randn(2, 4, device="cuda")
        y, seen = graphs(step, x, torch.tensor([i], device="cuda"), protect=[cache])
        torch.testing.assert_close(y, affine(x, w)[0])
        assert torch.count_nonzero(seen).item() == i + 1  # warm-up wrote nothing the replay did not
    assert graphs.captured == 1 and graphs.enabled
