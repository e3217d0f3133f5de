"""
Capture and replay: run a function of tensors as a CUDA graph, the one place nanospec does so.

A forward of a tiny model on a GPU costs its host work, not its arithmetic: Python, operator dispatch and a
kernel launch per operation, milliseconds for a few microseconds of kernels. `torch.cuda.CUDAGraph` records the
kernels of one call once and replays them with a single launch. A replay reads and writes the very buffers that
were recorded, so the function is called on *static* buffers: each call copies its inputs into them, replays,
and hands back the same output tensors every time. Shapes are part of the recording, hence one graph per shape
(nanospec/static.py makes a forward's shapes depend only on its number of new tokens).

    graphs = Graphs(capture=True, protect=(cache.k, cache.v))
    logits, = graphs(fn, idx, pos)   # first call with these shapes: just fn(idx, pos)
    logits, = graphs(fn, idx, pos)   # second: static buffers made, warm up, capture, replay
    logits, = graphs(fn, idx, pos)   # later: copy idx, pos into the buffers, replay; the same `logits` tensor

On a CPU (capture=False) the function is simply called, on the same static buffers, so the buffer handling is
the same code on both and the CPU tests exercise it. Capture follows PyTorch's recipe: a few warm-up calls on a
side stream, then `torch.cuda.graph`. Warm-up calls really run, so they may write state the function owns (a
KV cache): `protect` names those tensors, snapshotted before the warm-up and restored after it (capture itself
runs no kernels).

The outputs are overwritten by the next call with the same shapes: clone what must outlive it.
Warm-up calls run with whatever the RNG is, and a replay draws no new numbers: keep sampling out of fn, or pass
its randomness in as an input (nanospec/draft_chain.py draws by Gumbel-max from uniforms made before the call).
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    inputs: list  # static input buffers: each call copies its inputs here
    outputs: tuple = None  # what fn returned on the buffers (a replay rewrites them in place)
    graph: object = None  # the torch.cuda.CUDAGraph, or None: call fn


def copy_into(buffers, tensors):
    """Copy each tensor into its buffer, in place (addresses kept); None stays None."""
    for buf, x in zip(buffers, tensors):
        if buf is not None:
            buf.copy_(x)


def warm_up(fn, inputs, protect=(), runs=3, stream=None):
    """Call fn(*inputs) `runs` times (on `stream` when given, as capture requires), leaving the tensors in
    `protect` as they were: snapshotted before, restored after."""
    saved = [t.clone() for t in protect]
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        for _ in range(runs):
            fn(*inputs)
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    copy_into(protect, saved)


class Graphs:
    """fn(*inputs) -> a tuple of tensors (or None), captured once per key and input shapes, then replayed.

    capture: record CUDA graphs (the inputs must be on a CUDA device) or just call fn (CPU, or to debug);
    protect: tensors fn writes that its warm-up calls must leave untouched (the KV cache)."""

    def __init__(self, capture=False, protect=(), warmup_runs=3):
        if capture and not torch.cuda.is_available():
            raise ValueError("CUDA graphs need a CUDA device; this machine has none")
        self.capture, self.protect, self.warmup_runs = capture, tuple(protect), warmup_runs
        self.entries = {}  # (key, input shapes and dtypes) -> Entry, for those called more than once
        self.seen = set()  # the keys called once so far

    def __call__(self, fn, *inputs, key=()):
        """fn's outputs for `inputs`. `key` names what is not a tensor but changes fn (e.g. the layer range).
        The first call of a key and shapes just calls fn: a one-off shape (a prompt) is worth neither buffers nor
        a graph. The second one makes the buffers and, capturing, records the graph; later ones replay it."""
        full_key = (key, tuple((tuple(x.shape), x.dtype, x.device) for x in inputs))
        entry = self.entries.get(full_key)
        if entry is None:
            if full_key not in self.seen:
                self.seen.add(full_key)
                return tuple(fn(*inputs))
            entry = self.entries[full_key] = Entry(inputs=[x.clone() for x in inputs])
            if self.capture:
                self.record(fn, entry)
        copy_into(entry.inputs, inputs)
        if entry.graph is not None:
            entry.graph.replay()  # one launch: every kernel of fn, on the recorded buffers
        elif entry.outputs is None:
            entry.outputs = tuple(fn(*entry.inputs))
        else:
            copy_into(entry.outputs, fn(*entry.inputs))
        return entry.outputs

    def record(self, fn, entry):
        """Capture fn over the entry's buffers (which hold this call's inputs) into entry.graph."""
        warm_up(fn, entry.inputs, self.protect, self.warmup_runs, torch.cuda.Stream())
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph):
            entry.outputs = tuple(fn(*entry.inputs))  # recorded, not run: replay runs it

    @property
    def captured(self):
        """How many graphs have been recorded (0 when not capturing)."""
        return sum(e.graph is not None for e in self.entries.values())
