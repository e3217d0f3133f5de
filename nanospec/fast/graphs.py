"""
Capture and replay: run a function of tensors as a CUDA graph (or, on a CPU, as its emulation), the one place
nanospec does so.

A forward of a tiny model on a GPU costs its host work, not its arithmetic: Python, operator dispatch and a
kernel launch per operation, milliseconds for a few microseconds of kernels. `torch.cuda.CUDAGraph` records the
kernels of one call once and replays them with a single launch. A replay reads and writes the very buffers that
were recorded, so the function is called on *static* buffers: each call copies its inputs into them, replays,
and hands back the same output tensors every time. Shapes are part of the recording, hence one graph per shape
(a cached forward's shapes depend only on its rows and its number of new tokens: nanospec/model/cache.py).

    graphs = Graphs(capture=True)
    logits, = graphs(fn, idx, pos, protect=(cache.k, cache.v))   # first call with these shapes: just fn(idx, pos)
    logits, = graphs(fn, idx, pos, protect=(cache.k, cache.v))   # second: buffers made, warm up, capture, replay
    logits, = graphs(fn, idx, pos, protect=(cache.k, cache.v))   # later: copy into the buffers, replay

What a graph is, and so what a replay does NOT do: it runs none of fn's Python. Every Python value fn read while
it was recorded (an int that grows each step, a list of indices, an `if` on a tensor) is frozen into the kernels'
arguments, and the replay repeats them whatever the inputs are now. That is the whole contract: anything that
changes between calls must come in as a tensor input. CUDA refuses at capture what it cannot freeze: reading a
tensor's value on the host (`.item()`, `.tolist()`, `if t:`, `nonzero`) and copying a host tensor to the device.

On a CPU there are no CUDA graphs, so `Emulated` plays one: at capture it runs fn under a TorchDispatchMode,
which sees every tensor operation (aten op) fn makes, and records each with its tensors by identity and its
Python values as they were; a replay re-runs only those operations on the same tensors, writing each result
into the tensor the recording holds, and runs no Python of fn. It refuses what CUDA capture refuses: a read of a
value on the host, an output whose shape depends on values, and a tensor made from Python data inside the
capture (on CUDA, that is a copy from the host). So the CPU tests of the fast path replay, and a baked-in value
gives the same wrong answer here as on a GPU (tests/test_graphs.py shows both).

Warm-up calls (CUDA's recipe: a few calls on a side stream, then `torch.cuda.graph`) and the emulated capture
really run, so they may write state fn owns (a KV cache): `protect` names those tensors, snapshotted before and
restored after, so that the replay that follows writes them once. The outputs are overwritten by the next call
with the same shapes: clone what must outlive it (nanospec/fast/runtime.py does, for the methods). nanospec captures
model forwards only, never sampling. If a capture fails, `CaptureFailed` says why and `enabled` turns False: the
caller goes on without graphs.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# ops whose output's shape depends on the values in a tensor: a graph cannot hold them (CUDA syncs to size them)
VALUE_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                aten.unique_consecutive.default, aten.repeat_interleave.Tensor}


@dataclass
class Entry:
    inputs: list  # static input buffers: each call copies its inputs here
    outputs: tuple = None  # what fn returned on the buffers (a replay rewrites them in place)
    graph: object = None  # the torch.cuda.CUDAGraph or Emulated graph, or None: call fn


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
    """A CUDA graph (or its emulation) could not be recorded; the message says why."""


class Refused(RuntimeError):
    """What a capture cannot record (raised by the Emulated recorder, as CUDA raises at capture)."""


def storages(tree):
    """The addresses of the memory the tensors in a nested argument list live in."""
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class Emulated(TorchDispatchMode):
    """A CUDA graph played on any device: `with graph: fn(*inputs)` records, `graph.replay()` repeats.

    Each recorded step is (op, args, kwargs, result, fresh): fresh says whether the result is new memory (a
    functional op: replay copies its new value into the recorded result, so later steps, which hold that very
    tensor, read it) or memory of its inputs (a view: nothing to redo; an in-place op: redo it)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def __enter__(self):  # .tolist() and .numpy() read a CPU tensor's memory without an aten op: refused by hand
        def refuse(tensor, *args, **kwargs):
            raise Refused("Tensor.tolist/numpy reads a tensor's value on the host inside a capture")
        self.kept = torch.Tensor.tolist, torch.Tensor.numpy
        torch.Tensor.tolist = torch.Tensor.numpy = refuse
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self.kept
        return super().__exit__(*exc)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op in VALUE_SHAPED or (op is aten.index.Tensor and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])):
            raise Refused(f"{op} inside a capture: its output's shape depends on tensor values (a host read)")
        if op is aten.lift_fresh.default and args[0].dim() > 0:
            raise Refused("a tensor made from Python data inside a capture (on CUDA: a copy from the host "
                          "while capturing): make it before, and pass it in as an input")
        result = op(*args, **kwargs)
        if any(isinstance(r, (bool, int, float, complex)) for r in tree_leaves(result)):
            raise Refused(f"{op} reads a tensor's value on the host inside a capture (.item(), .tolist(), if t:); "
                          "a replay would repeat the value read at capture")
        mutates = op._schema.is_mutable
        fresh = not mutates and not (storages(result) & storages((args, kwargs)))
        if mutates or fresh:  # a pure view needs no replay: it keeps looking at the same memory
            self.steps.append((op, args, kwargs, result, fresh))
        return result

    @torch.inference_mode()  # the recorded tensors may be inference tensors (captured under inference_mode)
    def replay(self):
        for op, args, kwargs, result, fresh in self.steps:
            new = op(*args, **kwargs)
            if fresh:
                for old, value in zip(tree_leaves(result), tree_leaves(new)):
                    if isinstance(old, torch.Tensor):
                        old.copy_(value)


class Graphs:
    """fn(*inputs) -> a tuple of tensors (or None), captured once per key and input shapes, then replayed.

    capture: record graphs, then replay them (CUDA graphs for CUDA inputs, Emulated elsewhere), or just call fn
    on the static buffers (capture=False: to debug)."""

    def __init__(self, capture=False, warmup_runs=3):
        self.capture, self.warmup_runs, self.enabled = capture, warmup_runs, True
        self.entries = {}  # (key, input shapes and dtypes) -> Entry, for those called more than once
        self.seen = set()  # the keys called once so far

    def __call__(self, fn, *inputs, key=(), protect=()):
        """fn's outputs for `inputs`. `key` names what is not a tensor but changes fn (e.g. the layer range);
        protect: tensors fn writes that warm-up calls must leave untouched (the KV cache).
        The first call of a key and shapes just calls fn: a one-off shape (a draft catching up on a run of plain
        steps, say; runtime.Fast keeps prompts away) is worth neither buffers nor a graph. The second one makes
        the buffers and, capturing, records the graph; later ones replay it."""
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
            entry.graph.replay()  # every operation of fn, on the recorded buffers: on CUDA one launch
        elif entry.outputs is None:
            entry.outputs = tuple(fn(*entry.inputs))
        else:
            copy_into(entry.outputs, fn(*entry.inputs))
        return entry.outputs

    def record(self, fn, entry, protect=()):
        """Capture fn over the entry's buffers (which hold this call's inputs) into entry.graph. Any failure is a
        CaptureFailed, after which this object captures nothing more (`enabled` is False)."""
        saved = [t.clone() for t in protect]
        cuda = entry.inputs[0].is_cuda
        try:
            if cuda:
                warm_up(fn, entry.inputs, protect, self.warmup_runs, torch.cuda.Stream())
                entry.graph = torch.cuda.CUDAGraph()
            else:
                entry.graph = Emulated()
            with torch.cuda.graph(entry.graph) if cuda else entry.graph:
                entry.outputs = tuple(fn(*entry.inputs))  # on CUDA recorded, not run: replay runs it
            copy_into(protect, saved)  # the emulation ran it: the replay that follows writes the state once
        except Exception as e:  # anything the capture trips on: the caller goes on eager
            self.enabled, entry.graph = False, None
            copy_into(protect, saved)
            raise CaptureFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    @property
    def captured(self):
        """How many graphs have been recorded (0 when not capturing)."""
        return sum(e.graph is not None for e in self.entries.values())
