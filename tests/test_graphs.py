"""nanospec/fast/graphs.py on the CPU: the first call of a key and shapes just calls the function; the second makes
the buffers, which keep their addresses and are rewritten in place from then on; one entry per key and shapes
called twice; warm-up calls leave protected state as it was. A capture that fails (forced here) is a one-line
CaptureFailed that restores the protected state and turns the object off (`enabled`).

The emulated replay (graphs.Emulated, what capture means on a CPU) is held to calling the function, and to what a
CUDA graph does that a call does not: a Python value read at capture is repeated by every replay (the wrong
answer, as on a GPU), and reading a value on the host, a value-shaped output or a tensor made from Python data
inside a capture are refused. The CUDA capture itself is tested at the end, on a GPU machine only."""
import pytest
import torch

from nanospec.fast import graphs
from nanospec.fast.graphs import CaptureFailed, Graphs, warm_up


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
    """What the caller must know (nanospec/fast/runtime.py clones for the methods): the next call with the same
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
    """The emulated capture made to fail with a long message, after the function ran (as CUDA's warm-up does):
    CaptureFailed with the first line of the cause, the cache restored, `enabled` False and no entry kept."""
    class NoGraph(graphs.Emulated):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors might be ...")

    monkeypatch.setattr(graphs, "Emulated", NoGraph)
    cache, writes = torch.zeros(4), []

    def step(x, slot):  # writes the cache, like a forward writing its keys
        writes.append(1)
        cache.index_copy_(0, slot, x)
        return (cache * 1,)

    g = Graphs(capture=True)
    seen = g(step, torch.ones(1), torch.tensor([0]), protect=[cache])[0]  # first call: just called
    assert seen.tolist() == [1.0, 0.0, 0.0, 0.0] and g.enabled
    with pytest.raises(CaptureFailed) as error:
        g(step, torch.full((1,), 7.0), torch.tensor([2]), protect=[cache])
    assert str(error.value) == "RuntimeError: operation not permitted when stream is capturing"
    assert len(writes) == 2  # the capture ran, and wrote slot 2 ...
    assert cache.tolist() == [1.0, 0.0, 0.0, 0.0]  # ... which is undone
    assert not g.enabled and not g.entries and g.captured == 0


def attention_like(x, w, slot, cache):
    """Views, in-place writes into a buffer, a functional chain, a softmax and a tuple-returning op (split)."""
    cache.index_copy_(0, slot, x[:, 0])
    a, b = (x @ w).split(2, dim=1)  # (2, 2) each
    y = torch.zeros(2, 4)
    y[:, :2] = a.softmax(-1)  # a Python scalar and views written in place: fine, nothing varies
    y[:, 2:] = b.t().contiguous().t() * cache[:2, None]
    return y.sum(0), cache * 1


def test_emulated_replay_equals_calling_the_function():
    cache, plain = torch.zeros(8), torch.zeros(8)
    w = torch.randn(4, 4)
    g = Graphs(capture=True)

    def step(x, w, slot):
        return attention_like(x, w, slot, cache)

    for i in range(6):  # called once, then captured, then replayed
        x, slot = torch.randn(2, 4), torch.tensor([i, i + 1])
        got = g(step, x, w, slot, protect=[cache])
        want = attention_like(x, w, slot, plain)
        assert all(torch.allclose(a, b) for a, b in zip(got, want)) and torch.equal(cache, plain)
    (entry,) = g.entries.values()
    assert g.captured == 1 and isinstance(entry.graph, graphs.Emulated) and entry.graph.steps


def test_a_python_value_read_at_capture_is_what_every_replay_repeats():
    """The negative control of the stand-in, and the lesson of what a CUDA graph is: a function that reads a
    Python int that grows each call is right when called and wrong when replayed, as it would be on a GPU."""
    step = [0]

    def shifted(x):
        return (x + step[0],)

    called, g = [], Graphs(capture=True)
    for i in range(4):
        step[0] = i
        called.append(g(shifted, torch.zeros(2))[0][0].item())
    assert called == [0.0, 1.0, 1.0, 1.0]  # call, capture at step 1, then replays of step 1's value
    plain = Graphs(capture=False)  # no capture: the function runs each time, and is right
    assert [plain(shifted, torch.zeros(2))[0][0].item() for _ in range(3)] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("fn, refused", [
    (lambda x: (x * x.sum().item(),), "reads a tensor's value on the host"),
    (lambda x: (x * len(x.tolist()),), "reads a tensor's value on the host"),
    (lambda x: (x if x.sum() > 0 else -x,), "reads a tensor's value on the host"),
    (lambda x: (x.nonzero(),), "depends on tensor values"),
    (lambda x: (x[x > 0],), "depends on tensor values"),
    (lambda x: (x[[0, 1]],), "made from Python data"),
    (lambda x: (x + torch.tensor([1.0, 2.0]),), "made from Python data"),
])
def test_the_emulated_capture_refuses_what_cuda_capture_refuses(fn, refused):
    g = Graphs(capture=True)
    g(fn, torch.ones(2))  # the first call just calls: fine
    with pytest.raises(CaptureFailed, match=refused):
        g(fn, torch.ones(2))
    assert not g.enabled


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
