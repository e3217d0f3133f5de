"""
Capture and replay: run a function of tensors as a CUDA graph, the one place nanospec does so.

A forward of a tiny model on a GPU costs its host work, not its arithmetic: Python, operator dispatch and a
kernel launch per operation, milliseconds for a few microseconds of kernels. `torch.cuda.CUDAGraph` records the
kernels of one call once and replays them with a single launch. A replay reads and writes the very buffers that
were recorded, so the function is called on *static* buffers: each call copies its inputs into them, replays,
and hands back the same output tensors every time. Shapes are part of the recording, hence one graph per shape
(nanospec/runtime.py makes a forward's shapes depend only on its number of new tokens).

    graphs = Graphs(capture=True)
    logits, = graphs(fn, idx, pos, protect=(cache.k, cache.v))   # first call with these shapes: just fn(idx, pos)
    logits, = graphs(fn, idx, pos, protect=(cache.k, cache.v))   # second: buffers made, warm up, capture, replay
    logits, = graphs(fn, idx, pos, protect=(cache.k, cache.v))   # later: copy into the buffers, replay

On a CPU (capture=False) the function is simply called, on the same static buffers, so the buffer handling is
the same code on both and the CPU tests exercise it. Capture follows PyTorch's recipe: a few warm-up calls on a
side stream, then `torch.cuda.graph`. Warm-up calls really run, so they may write state the function owns (a
KV cache): `protect` names those tensors, snapshotted before the warm-up and restored after it (capture itself
runs no kernels).

The outputs are overwritten by the next call with the same shapes: clone what must outlive it (nanospec/runtime.py
does, for the methods). A replay draws no random numbers: nanospec captures model forwards only, never sampling.
If a capture fails, `CaptureFailed` says why and `enabled` turns False: the caller goes on without graphs.
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


class CaptureFailed(Exception):
    """A CUDA graph could not be recorded; the message says why."""


class Graphs:
    """fn(*inputs) -> a tuple of tensors (or None), captured once per key and input shapes, then replayed.

    capture: record CUDA graphs (the inputs must be on a CUDA device) or just call fn (CPU, or to debug)."""

    def __init__(self, capture=False, warmup_runs=3):
        if capture and not torch.cuda.is_available():
            raise ValueError("CUDA graphs need a CUDA device; this machine has none")
        self.capture, self.warmup_runs, self.enabled = capture, warmup_runs, True
        self.entries = {}  # (key, input shapes and dtypes) -> Entry, for those called more than once
        self.seen = set()  # the keys called once so far

    def __call__(self, fn, *inputs, key=(), protect=()):
        """fn's outputs for `inputs`. `key` names what is not a tensor but changes fn (e.g. the layer range);
        protect: tensors fn writes that warm-up calls must leave untouched (the KV cache).
        The first call of a key and shapes just calls fn: a one-off shape (a prompt) is worth neither buffers nor
        a graph. The second one makes the buffers and, capturing, records the graph; later ones replay it."""
        full_key = (key, tuple((tuple(x.shape), x.dtype, x.device) for x in inputs))
        entry = self.entries.get(full_key)
        if entry is None:
            if full_key not in self.seen:
                self.seen.add(full_key)
                return tuple(fn(*inputs))
            entry = Entry(inputs=[x.clone() for x in inputs])
            if self.capture:
                self.record(fn, entry, protect)
            self.entries[full_key] = entry
        copy_into(entry.inputs, inputs)
        if entry.graph is not None:
            entry.graph.replay()  # one launch: every kernel of fn, on the recorded buffers
        elif entry.outputs is None:
            entry.outputs = tuple(fn(*entry.inputs))
        else:
            copy_into(entry.outputs, fn(*entry.inputs))
        return entry.outputs

    def record(self, fn, entry, protect=()):
        """Capture fn over the entry's buffers (which hold this call's inputs) into entry.graph. Any failure is a
        CaptureFailed, after which this object captures nothing more (`enabled` is False)."""
        saved = [t.clone() for t in protect]
        try:
            warm_up(fn, entry.inputs, protect, self.warmup_runs, torch.cuda.Stream())
            entry.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(entry.graph):
                entry.outputs = tuple(fn(*entry.inputs))  # recorded, not run: replay runs it
        except Exception as e:  # anything the capture trips on: the caller goes on eager
            self.enabled = False
            copy_into(protect, saved)
            raise CaptureFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    @property
    def captured(self):
        """How many graphs have been recorded (0 when not capturing)."""
        return sum(e.graph is not None for e in self.entries.values())
