"""
The fast runtime: one layer around the models, chosen once per run, that no decoding method knows about.

A decoding method calls its models as models: `target(x, cache=cache)`, `eagle(target, tokens, features,
cache=dcache)`, with a cache from `model.new_cache()`. `prepare(models, runtime)` hands it either the models
themselves (eager: plain PyTorch, the oracle) or each one wrapped in a `Fast`, which takes the same call and
returns the same outputs, as fresh tensors the method may keep. What differs is how the forward runs:

  shape-static  Every cached forward places its tokens by tensors and attends under a mask (nanospec/model/cache.py:
                `place`): eager, over the `seen` slots in use alone; under a Fast, over every slot of its cache
                (the same mask padded, the slots past `seen` hidden), so that its shapes depend on B and T alone.
                A Fast computes that Placement on the host and hands its tensors to the forward as inputs.
  replayed      Each shape of a decoding step is then captured once and replayed (nanospec/fast/graphs.py): on
                CUDA as a CUDA graph, one launch instead of a few hundred, which is what a tiny model's forward
                costs on a GPU; on a CPU by graphs.Emulated, which repeats the recorded operations the same way,
                running none of the forward's Python, so that the CPU tests replay what a GPU replays. A prefill
                (a forward into an empty cache: the prompt) runs eager: its length is the prompt's, a one-off.
                The target's methods that drafters call outside its forward (REPLAYED: `unembed`, `head_logits`)
                are replayed the same way, keyed by name.

What a model must offer for this is the contract stated in nanospec/model/cache.py; GPT, the EAGLE head and the
ParallelSpec drafter keep it, and the tests hold each Fast model to the plain one. The cache's lengths stay Python
ints on the host: a forward's moves of them (`advance`) are recorded when its Python runs and applied after each
replay, keyed, like the graph, by the forward's non-tensor arguments and its shapes, so each graph applies the
moves of its own shapes.

--runtime: eager = plain PyTorch everywhere; static = shape-static forwards, replayed from CUDA graphs on CUDA
(on a CPU replayed by the emulation: the path the tests run); auto = static on CUDA, eager elsewhere (on a CPU
the emulated replay saves no launch overhead and costs its own bookkeeping).
"""
import copy
import functools
import sys
import weakref
from dataclasses import fields, is_dataclass, replace

import torch

from nanospec.fast.graphs import CaptureFailed, Graphs
from nanospec.model.cache import KVCache, Placement

RUNTIMES = ("auto", "eager", "static")
REPLAYED = ("unembed", "head_logits")  # the target's methods drafters call outside its forward (an EAGLE head's
# logits, the MTP heads): a few dozen launches each, eager, which a GPU's replay makes one


def runtime_path(runtime, device):
    """Which path `runtime` ("auto", "eager" or "static") takes on `device`: "eager", "static" or "graph"."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    cuda = torch.device(device).type == "cuda"
    if runtime == "eager" or (runtime == "auto" and not cuda):
        return "eager"
    return "graph" if cuda else "static"


class Placed:
    """The cache a replayed forward is handed: `place` gives the Placement the Fast computed before it (the slots
    here, the positions and mask given to the forward), and `advance` is recorded in `moves`, for the Fast to
    apply after the forward (a replay runs no Python). Everything else (length, device, ...) is the real cache's."""

    def __init__(self, cache, slots):
        self.cache, self.slots, self.moves = cache, slots, []

    def place(self, T, pos, mask, *where):
        return Placement(pos, mask, self.slots, self.cache)

    def advance(self, T, layers=None):
        self.moves.append((T, None if layers is None else tuple(layers)))

    def __getattr__(self, name):
        return getattr(self.cache, name)


class Fast:
    """A model whose cached forwards run shape-static, replayed from graphs (CUDA graphs on CUDA, graphs.Emulated
    on a CPU) when capture is True, or just called on the static buffers when it is False (to debug).
    Called like the model; every other attribute is the model's. `new_cache` hands each caller an empty cache of
    its own, as the model's does, on pooled tensors: a graph replays on the buffers it was captured with. The
    model's methods in REPLAYED (no cache: their shapes are their input's) are replayed too."""

    inside = 0  # how deep the running code is in the Python of a Fast forward's graph call (the process's one count)

    def __init__(self, model, capture=True):
        self.model, self.capture = model, capture
        self.graphs = Graphs(capture)
        self.caches = {}  # new_cache's arguments -> [[a cache holding pooled tensors, a weak reference to the
        # cache last handed out on them], ...]
        self.made = {}  # graph key (with shapes) -> (the cache moves its forward makes, Placed.moves; its
        # output's class), recorded when the forward's Python runs: a replay runs none

    def __getattr__(self, name):
        value = getattr(self.model, name)
        return functools.partial(self.replayed, name) if name in REPLAYED else value

    def replayed(self, name, *args):
        """model.<name>(*args) for a method in REPLAYED, replayed per shape from graphs as a forward is (a key
        of its own: the name, the arguments that are not tensors, the shapes), its output a fresh tensor. Inside
        another model's recorded forward (the EAGLE head unembeds through the target) it just runs: its operations
        are that forward's."""
        method = getattr(self.model, name)
        if Fast.inside or not self.graphs.enabled:
            return method(*args)
        tensors = [a for a in args if torch.is_tensor(a)]

        def fn(*tensors):
            it = iter(tensors)
            return (method(*[next(it) if torch.is_tensor(a) else a for a in args]),)
        try:
            (out,) = self.graphs(fn, *tensors, key=(name, tuple(None if torch.is_tensor(a) else a for a in args)))
        except CaptureFailed as e:
            self.gave_up(e)
            return method(*args)
        return out.clone()

    def gave_up(self, error):
        """Say, once per failed capture, that this model runs eager from here (graphs.enabled is now False)."""
        print(f"warning: CUDA graph capture failed ({error}); the {self.model.__class__.__name__}'s forwards run "
              f"eager from here", file=sys.stderr)

    def new_cache(self, *args, **kwargs):
        """An empty cache, as model.new_cache(*args, **kwargs) makes, that no other live cache shares tensors with.
        A graph replays on the tensors it was captured with, so the tensors are pooled per set of arguments: they go
        to the next caller once the cache last handed out on them is gone (its generation ended), every slot free
        (stale keys are masked); a cache asked for while that one is still held gets tensors of its own."""
        pool = self.caches.setdefault((args, tuple(sorted(kwargs.items()))), [])
        free = next((entry for entry in pool if entry[1]() is None), None)  # its last cache is gone
        if free is None:
            free = [self.model.new_cache(*args, **kwargs), None]
            pool.append(free)
        cache = copy.copy(free[0])  # the pooled tensors, lengths of its own
        cache.forget()
        free[1] = weakref.ref(cache)
        return cache

    def __call__(self, *args, cache=None, pos=None, mask=None, **kwargs):
        if not isinstance(cache, KVCache) or not self.graphs.enabled or not any(cache.layer_lengths):  # no cache
            # (training, the slow oracle), capture failed, or a prefill: the cache is empty, so this is a prompt,
            # whose shape is a one-off no graph would pay back (serving engines also replay their decoding steps
            # alone); its keys and values land in the same slots either way
            return self.model(*args, cache=cache, pos=pos, mask=mask, **kwargs)
        at = self.model.place(*args, cache=cache, pos=pos, mask=mask, **kwargs)  # on the host, as tensors
        given = list(args) + list(kwargs.values())
        tensors = [a for a in given if torch.is_tensor(a)]  # the graph's inputs
        placed = (at.pos, at.mask, at.slots)  # at.mask (.., T, S): the shapes depend on B and T alone; a model
        # that attends to nothing (an EAGLE head without attention) places by positions alone: no mask, no slots
        placed_in = [t for t in placed if t is not None]
        key = graph_key(cache, given, kwargs, (*placed_in, *tensors))

        def fn(*inputs):  # tensors in, tensors out: what a graph of this key records
            it = iter(inputs)
            pos, mask, slots = (None if t is None else next(it) for t in placed)
            filled = [next(it) if torch.is_tensor(a) else a for a in given]
            view = Placed(cache, slots)
            out = self.model(*filled[:len(args)], cache=view, pos=pos, mask=mask,
                             **dict(zip(kwargs, filled[len(args):])))
            made = view.moves, type(out) if is_dataclass(out) else None
            assert self.made.setdefault(key, made) == made, f"one key, two sets of cache moves: {key}"
            return flatten(out)

        try:
            Fast.inside += 1  # fn's Python (first sight, warm-up, capture) may call another Fast: it just runs
            outputs = self.graphs(fn, *placed_in, *tensors, key=key, protect=(cache.k, cache.v))
        except CaptureFailed as e:
            self.gave_up(e)
            return self.model(*args, cache=cache, pos=pos, mask=mask, **kwargs)
        finally:
            Fast.inside -= 1
        moves, kind = self.made[key]
        for T_moved, layers in moves:
            cache.advance(T_moved, layers)
        return unflatten(kind, outputs)


def graph_key(cache, given, kwargs, tensors):
    """What names one graph of a Fast model: the memory of the cache it writes and its shape (a batch that drops
    its finished rows keeps writing the same memory, rows 0..B'-1: KVCache.keep_rows), every argument that is not
    a tensor (the layer range, k, the target), the keywords given, and the tensors' shapes. The cache moves
    recorded for a graph are the ones its Python made for this key, so the shapes must be in it: a 1-token step
    and a 4-token verify move the cache by 1 and 4, and a replay runs no Python to tell them apart."""
    return (cache.k.data_ptr(), tuple(cache.k.shape), tuple(None if torch.is_tensor(a) else freeze(a) for a in given),
            tuple(kwargs), tuple(tuple(t.shape) for t in tensors))


def freeze(value):
    """A graph key part from a non-tensor argument: lists become tuples, anything else is kept (by identity
    for a module, e.g. the target an EAGLE head reads through)."""
    return tuple(value) if isinstance(value, list) else value


def flatten(out):
    """A forward's output as a tuple of tensors (None kept): a dataclass (model.Output) by its fields, a tensor
    as itself."""
    return tuple(getattr(out, f.name) for f in fields(out)) if is_dataclass(out) else (out,)


def unflatten(kind, outputs):
    """flatten's inverse, each tensor cloned (a replay rewrites the graph's outputs in place): kind is the
    output's dataclass, or None for a bare tensor."""
    outputs = [None if t is None else t.clone() for t in outputs]
    return outputs[0] if kind is None else kind(*outputs)


def fast(model, path, role="target"):
    """`model` for a runtime path: itself on "eager", else its Fast wrapper, kept on the model from one run to the
    next (each shape is captured once per process, and dropping the model drops its graphs). Keyed by the role it
    plays (a model that is both target and draft needs two caches at once, so two wrappers) and by where the
    weights live: moving a model (.to, .half) makes new weights, which old graphs would not read."""
    if model is None or path == "eager":
        return model
    w = next(model.parameters())
    runners = model.__dict__.setdefault("_fast", {})  # {(path, role, its weights' address, dtype): its Fast}
    key = (path, role, w.data_ptr(), w.dtype)
    if key not in runners:
        runners[key] = Fast(model, capture=True)
    return runners[key]


def prepare(models, runtime="auto"):
    """The models a method runs, as `runtime` asks, and the path taken: (models, "eager" | "static" | "graph").
    The target, the draft GPT, the EAGLE head and the ParallelSpec drafter are wrapped; the exit adapters read one
    position and keep no cache, so they run as they are."""
    path = runtime_path(runtime, models.target.wte.weight.device)
    wrapped = {part: fast(getattr(models, part), path, part) for part in ("target", "draft", "eagle", "parallelspec")}
    return replace(models, **wrapped), path
