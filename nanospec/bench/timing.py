"""
What the bench watches from outside the methods: where a generation's time goes, and how often it reads the host.
A decoding method has no timer and no counter in it; the bench wraps the models a method is handed instead.

    Timed     a model part whose calls add their seconds to a Ledger, as "drafting" or "target" (a target
              forward), outermost (around nanospec/fast/runtime.py's Fast, if any): the method calls it as the model
    Ledger    one generation's totals: seconds and calls of each kind; on CUDA each call is bracketed by a pair
              of CUDA events (the kernels are only queued when the call returns), read after one synchronize
    counting_host_reads   counts every read of a tensor's value by Python while it is open
    counting_ops          counts the tensor operations (aten ops) run outside the model calls while it is open:
                          on a GPU, the kernels the host launches between forwards
    timed, fastest        one call's seconds, and the fastest of several runs of each of a few calls
    REPLAY_WARMUPS        the untimed runs of each prompt a row on a replayed path makes before its timed ones

Which calls draft: every call of the draft GPT, the EAGLE head and the ParallelSpec drafter (a drafter pass
each), and every target call through its first blocks only (`drafts`: early-exit's passes). The early-exit
adapter and the target's methods that drafters call outside its forward (BORROWED: `unembed`, for the exit's and
the EAGLE head's logits, and `head_logits`, the MTP heads run alone) add their seconds to drafting but no pass:
they finish the pass before them. Every other target call is a target forward (one that runs the MTP heads too,
`heads=n`, included: their seconds are then the forward's). This is the bench's knowledge of how the
methods use the parts, kept here and not in the models. A call made inside another timed call (the EAGLE head
reading the target's embedding) is its caller's time.

    ledger = Ledger(cuda=False)
    models = timed_models(models, ledger)          # after runtime.prepare: Timed(Fast(model))
    ledger.clear(); METHODS["speculative"](models, ids, 64); ledger.totals()
    -> {"drafting": 0.021, "target": 0.034, "passes": 60, "forwards": 17}   (seconds; calls)
    with counting_ops(ledger) as ops: METHODS["speculative"](models, ids, 48)
    ops.total, ops.launches -> 444, 237   (34.2 and 18.2 per target forward: tests/test_host_ops.py's tiny models)
"""
import random
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanospec.steps.run import drafts

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero")  # host reads of a tensor
aten = torch.ops.aten
# ops that put nothing on a GPU although they make a tensor or write one: a change of metadata in place
# (detach_), memory handed out by the caching allocator and left untouched (empty)
NO_LAUNCH = {aten.detach_.default, aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default}
REPLAY_WARMUPS = 2  # untimed runs of each prompt on a replayed path before its timed ones: a shape is recorded
# at its second sight (fast/graphs.py), and a capture (CUDA's recipe: three warm-up calls, then the recording)
# costs many replays, which a 64-token run cannot pay back but a long generation does; the same seed and prompt
# meet the same shapes, so the timed runs replay every forward they make, as a long run would
BORROWED = ("unembed", "head_logits")  # the target's methods drafters call outside its forward: drafting, no pass


class Ledger:
    """Seconds and calls of one generation, by kind: "drafting" and "target". `clear()` before the run,
    `totals()` after it (on CUDA it waits for the GPU once, then reads every pair of events). Only the outermost
    timed call is timed: one made inside it (a drafter reading the target's embedding) is its caller's time."""

    def __init__(self, cuda=False, clock=time.perf_counter):
        self.cuda, self.clock = cuda, clock  # clock: the host's seconds (a test may pass a fake one)
        self.clear()

    def clear(self):
        self.seconds = {"drafting": 0.0, "target": 0.0}
        self.calls = {"drafting": 0, "target": 0}  # drafter passes, target forwards
        self.events = []  # CUDA: (kind, begin, end) of each call, read by totals()
        self.depth = 0  # timed calls in progress: only the outermost one is timed
        self.starts = []  # the host clock when each target forward began (nanospec/bench/calibration.py times steps)

    @contextmanager
    def timing(self, kind, counts=True):
        """`with ledger.timing("drafting"):` adds the seconds inside to `kind`, and one call when `counts`."""
        if self.depth:  # inside another timed call: its time already
            yield
            return
        self.depth += 1
        self.calls[kind] += counts
        if kind == "target" and counts:
            self.starts.append(self.clock())
        if self.cuda:  # the call only queues kernels: time them on the GPU
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t = self.clock()
        try:
            yield
        finally:
            self.depth -= 1
            if self.cuda:
                end.record()
                self.events.append((kind, begin, end))
            else:
                self.seconds[kind] += self.clock() - t

    def totals(self):
        """{"drafting": s, "target": s, "passes": drafter passes, "forwards": target forwards} of the run."""
        if self.events:
            torch.cuda.synchronize()  # one wait for the whole run
            for kind, begin, end in self.events:
                self.seconds[kind] += begin.elapsed_time(end) / 1000  # ms -> s
            self.events.clear()
        return dict(drafting=self.seconds["drafting"], target=self.seconds["target"],
                    passes=self.calls["drafting"], forwards=self.calls["target"])


class Timed:
    """A model part called as the model, each call's seconds added to `ledger` as `kind` ("drafting" or
    "target"; counts: whether a call is one drafter pass or target forward). Every other attribute is the
    model's (`config`, `new_cache`, ...), so it can also be the `target` a drafter reads its modules from."""

    def __init__(self, model, ledger, kind, counts=True):
        self.model, self.ledger, self.kind, self.counts = model, ledger, kind, counts

    def __getattr__(self, name):
        value = getattr(self.model, name)
        if self.kind == "target" and name in BORROWED:  # outside its forward: drafting
            return Timed(value, self.ledger, "drafting", counts=False)
        return value

    def kind_of(self, call):
        """A target call that drafts (call: the call's keywords) is drafting; any other, its own kind."""
        return "drafting" if self.kind == "target" and drafts(self.model, **call) else self.kind

    def __call__(self, *args, **kwargs):
        with self.ledger.timing(self.kind_of(kwargs), self.counts):
            return self.model(*args, **kwargs)


def timed_models(models, ledger):
    """`models` (a load.Models, wrapped or not by runtime.prepare) with every part a method calls in Timed."""
    def wrap(part, kind, counts=True):
        model = getattr(models, part)
        return None if model is None else Timed(model, ledger, kind, counts)
    return replace(models, target=wrap("target", "target"), draft=wrap("draft", "drafting"),
                   eagle=wrap("eagle", "drafting"), parallelspec=wrap("parallelspec", "drafting"),
                   early_exit=wrap("early_exit", "drafting", counts=False))


@contextmanager
def counting_host_reads():
    """Inside `with counting_host_reads() as counts:` every host read of a tensor (READS: `.item()`, `.tolist()`,
    `int(t)`, `float(t)`, `if t:`, `t` as an index, `nonzero`) adds one to counts[name]. On a GPU each one waits
    for every kernel queued before it. The patch slows every read: never time inside it."""
    counts = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, read):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return read(*args, **kwargs)
        return wrapper

    for name, read in originals.items():
        setattr(torch.Tensor, name, counted(name, read))
    try:
        yield counts
    finally:
        for name, read in originals.items():
            setattr(torch.Tensor, name, read)


class OpCounter(TorchDispatchMode):
    """See counting_ops: `ops` counts the aten ops outside the model calls by name, `total` all of them,
    `launches` those that put work on the device."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger
        self.ops, self.total, self.launches = Counter(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.ledger.depth:  # inside a model call (or a borrowed target module): the model's own work
            return result
        self.ops[str(func)] += 1
        self.total += 1
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        in_place = func._schema.is_mutable
        aliases = outputs and storages(outputs) <= storages((args, kwargs))  # a view: every result in its inputs
        self.launches += not ((aliases and not in_place) or func in NO_LAUNCH)
        return result


def storages(tree):
    """The addresses of the memory the tensors in a nested argument list live in."""
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


@contextmanager
def counting_ops(ledger):
    """Inside `with counting_ops(ledger) as ops:` every tensor operation (aten op) run outside the model calls
    adds one to ops.total (and to ops.ops[its name], e.g. "aten.add.Tensor"), and to ops.launches when it puts
    work on the device: on a GPU, a kernel launch (or a copy: `.item()` copies to the host), some microseconds of
    the host's time each. The models must be wrapped by timed_models(models, ledger): an op made while
    ledger.depth > 0 belongs to a model call (a forward, a drafter pass, a borrowed head) and is not counted,
    nor is a TorchDispatchMode's inside one (graphs.Emulated: its ops reach this counter at depth > 0).

    Left out of ops.launches: an op that writes nothing and whose results all live in its inputs' memory (a
    view: view, slice, select, unsqueeze, expand, detach; lift_fresh, which wraps a tensor just made from Python
    data; a `.to` or `.contiguous` that changed nothing), and NO_LAUNCH. That is judged from the memory, not
    from `func.is_view`: the schema marks `to`, `contiguous` and `reshape` as views, and they copy when they
    must. The methods run under inference_mode, where the dispatcher hands a composite op (softmax, reshape,
    .item, one_hot) to the counter whole: it counts as one (one_hot launches two on a GPU, zeros and scatter_).
    The ops are those the Python code calls, the same on any machine. Not seen: the copy that takes a tensor made
    from Python data (`torch.tensor(ids, device="cuda")`) to a GPU, made before dispatch."""
    with OpCounter(ledger) as counter:
        yield counter


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call; waits for the GPU, if any, before reading the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - t


def fastest(calls, reps):
    """Seconds of each zero-argument callable: the fastest of reps runs. On a busy machine a run that lost the CPU
    for a scheduler slice (~10 ms) measures the machine, not the model. The calls take turns in a shuffled order
    in each repetition, so that no call is always the one after a slow moment; the first round warms up."""
    times = [[] for _ in calls]
    order = list(range(len(calls)))
    for r in range(reps + 1):
        random.Random(r).shuffle(order)
        for j in order:
            with torch.inference_mode():
                _, seconds = timed(calls[j])
            if r:
                times[j].append(seconds)
    return [min(t) for t in times]
