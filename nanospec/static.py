"""
Shape-static forwards: the same GPT, run so that a forward's shapes depend only on T, its number of new tokens.

The plain forward (GPT.forward with KVCache.update) attends over the cache's first `length` slots, so its
shapes follow a Python int that grows every step: every step is a new computation, which a CUDA graph
(nanospec/graphs.py) cannot replay. Here, as in gpt-fast, a forward over T new tokens
  - writes their keys and values at `slots` (T,), a LongTensor on the device (KVCache.write, index_copy_),
  - attends over all max_len slots under a (T, max_len) mask built on the device from `slots` and `attend`
    (T, T), which new token may see which (causal for a chain, ancestors for a tree, nanospec/tree.py),
  - reads its position ids from `pos` (T,), a tensor too.
Slots past the new ones may hold keys of rolled-back guesses; the mask hides them, so rollback and compact stay
what they are, moves of `lengths` (KVCache).

Example, max_len 6, the cache holds 2 tokens:
    chain of 2 at slots [2, 3], pos [2, 3]        tree parents [-1, 0, 0] at slots [2, 3, 4], pos [2, 3, 3]
    slot:   0 1 2 3 4 5                           slot:    0 1 2 3 4 5
    new 0   1 1 1 . . .                           node 0   1 1 1 . . .
    new 1   1 1 1 1 . .                           node 1   1 1 1 1 . .
                                                  node 2   1 1 1 . 1 .

`StaticGPT` is called exactly like the model on one cache (model(idx, pos, cache, mask, heads, layers, hidden_in)),
so a method swaps it in for its forwards and reads the same; `runtime_model` picks the path and hands out the
cache. GPT.forward stays the oracle: tests/test_static.py holds this path to it.
"""
import weakref

import torch

from nanospec.graphs import Graphs
from nanospec.model import Output

# auto: static (graphs replayed) on CUDA, where a forward's cost is its host overhead; eager elsewhere (on a CPU
# the static path saves no overhead and attends over every slot). eager: plain PyTorch, the oracle, everywhere.
# static: shape-static everywhere, graphs on CUDA (the CPU runs the same code without capture: the tests' path).
RUNTIMES = ("auto", "eager", "static")


def static_mask(slots, attend, max_len):
    """(T, max_len) bool, True = may attend: every slot before slots[0] (the cached prefix), and slot slots[j]
    where attend[:, j] (T, T) says so. Built on the device: no Python int from the cache enters it."""
    T = slots.size(0)
    key = torch.arange(max_len, device=slots.device)  # (S,)
    mask = (key < slots[0]).expand(T, max_len).clone()  # (T, S) the prefix
    return mask.index_copy_(1, slots, attend)  # column slots[j] := attend[:, j]


def forward(model, cache, x, pos, slots, attend, heads=False, layers=None):
    """One static forward of `model` over T new tokens; the cache's `lengths` are left to the caller.

    x: token ids (B, T), or for a layer range starting above 0 the output (B, T, C) of the block before it;
    pos (T,) position ids; slots (T,) where the new keys/values go; attend (T, T) bool among the new tokens;
    layers (start, end) as in GPT.forward. Returns (logits, hidden, head_logits), None where not computed."""
    start, end = layers if layers is not None else (0, model.config.n_layer)
    mask = static_mask(slots, attend, cache.max_len)  # (T, max_len)
    if start == 0:
        x = model.drop(model.wte(x) + model.wpe(pos))  # (B, T, C)
    for i in range(start, end):
        x = model.blocks[i](x, mask, cache, i, slots)
    if end < model.config.n_layer:
        return None, x, None
    logits = model.lm_head(model.ln_f(x))  # (B, T, V)
    return logits, x, model.head_logits(x) if heads else None


class StaticGPT:
    """A GPT's forwards on one cache, shape-static and, on CUDA, replayed from graphs (one per T, layer range and
    heads; a shape seen only once, like a prompt's, is never captured). Called like the model; the Output's
    tensors are overwritten by the next call of the same shape (clone what must outlive it)."""

    def __init__(self, model, cache, capture=False):
        self.model, self.cache = model, cache
        self.graphs = Graphs(capture, protect=(cache.k, cache.v))

    def __call__(self, idx, pos=None, cache=None, mask=None, heads=False, layers=None, hidden_in=None):
        if cache is not self.cache:
            raise ValueError("a StaticGPT runs on the cache it was made with")
        start, end = layers if layers is not None else (0, self.model.config.n_layer)
        x = hidden_in if start > 0 else idx  # (B, T) ids or (B, T, C) hidden states
        T, n = x.size(1), cache.lengths[start]
        if n + T > cache.max_len:
            raise ValueError(f"KV cache full: {n + T} tokens > {cache.max_len}; shorten the prompt or the generation")
        if mask is not None and tuple(mask.shape) != (T, n + T):
            raise ValueError(f"mask must be (T, cached + T) = ({T}, {n + T}), got {tuple(mask.shape)}")
        slots = torch.arange(n, n + T, device=cache.device)  # (T,)
        pos = slots if pos is None else pos.reshape(T)  # (T,) a chain's positions are its slots
        attend = (torch.ones(T, T, dtype=torch.bool, device=cache.device).tril() if mask is None
                  else mask[:, n:])  # (T, T) among the new tokens

        def fn(x, pos, slots, attend):  # what the graph of this key records: tensors in, tensors out
            return forward(self.model, cache, x, pos, slots, attend, heads, (start, end))

        logits, hidden, head_logits = self.graphs(fn, x, pos, slots, attend, key=(start, end, heads))
        cache.advance(T, range(start, end))
        return Output(logits=logits, hidden=hidden, head_logits=head_logits)

    def chain(self, body, x, noise=None, *, fed, key=(), end=None):
        """A chain of forwards and what lies between them as ONE function of tensors, one graph per key and shapes
        on CUDA (nanospec/draft_chain.py: a drafter's k guesses in one launch). body(step, x, noise) -> a tuple of
        tensors, where step(x) is the static forward (an Output) of blocks 0..end-1 over token ids x (1, T) at
        the T slots after the previous step's, the first at the cache's length: slots and positions are counted
        on the device (`chained`), so a replay finds them without Python. noise (k, V) or None, x (1, T): the
        inputs; key: every setting body closes over; fed: the tokens body's steps read in all, by which the
        cache's lengths advance afterwards. The returned tensors are rewritten by the next call of this key."""
        cache, end = self.cache, end or self.model.config.n_layer
        n = cache.lengths[0]
        if n + fed > cache.max_len:
            raise ValueError(f"KV cache full: {n + fed} tokens > {cache.max_len}; shorten the prompt or the generation")
        first = torch.full((1,), n, dtype=torch.long, device=cache.device)  # (1,) the first free slot

        def fn(first, x, *noise):  # what the graph records: tensors in, tensors out
            return tuple(body(chained(self.model, cache, first, end), x, *noise))

        out = self.graphs(fn, first, x, *([] if noise is None else [noise]), key=("chain", end, *key))
        cache.advance(fed, range(end))
        return out


def chained(model, cache, first, end):
    """step(x): the static forward (an Output) of blocks 0..end-1 over token ids x (1, T) at the T slots after the
    previous step's, the first step's at first (1,). Slots, positions and masks are tensors made on the device:
    a chain of steps is a function of tensors, which a graph can replay. The cache's lengths are not touched."""
    free = [first]  # (1,) the next free slot

    def step(x):
        T = x.size(1)
        slots = free[0] + torch.arange(T, device=first.device)  # (T,) a chain's positions are its slots
        free[0] = slots[-1:] + 1
        attend = torch.ones(T, T, dtype=torch.bool, device=first.device).tril()  # (T, T) causal among the new
        logits, hidden, _ = forward(model, cache, x, slots, slots, attend, layers=(0, end))
        return Output(logits=logits, hidden=hidden)

    return step


# Static runners (StaticGPT, drafters/eagle.StaticEagle, drafters/parallelspec.StaticParallelSpec) kept from one
# generation to the next, so each shape is captured once per process, not once per generation (a capture costs a
# few forwards). Keyed per model and by where its weights live: moving a model (.to, .half) makes new weights,
# which old graphs would not read. A kept runner refers to its model through a weak proxy, so dropping the model
# drops its graphs too.
KEPT = weakref.WeakKeyDictionary()  # model -> {key: static runner}


def kept(model, key, make):
    """The static runner kept for `model` under `key`, made by make(a weak proxy of model) the first time, with
    its cache emptied for a new generation (every slot free: stale ones are masked)."""
    runners = KEPT.setdefault(model, {})
    if key not in runners:
        runners[key] = make(weakref.proxy(model))
    runner = runners[key]
    runner.cache.lengths = [0] * len(runner.cache.lengths)
    return runner


def padded_mask(mask, max_len):
    """A (T, n) attention mask over n slots -> (T, max_len), False past n: a static forward attends to every slot
    of its cache, so its mask's shape depends on T alone."""
    full = torch.zeros(mask.size(0), max_len, dtype=torch.bool, device=mask.device)
    full[:, :mask.size(1)] = mask
    return full


def runtime_model(model, runtime="auto", role="target", max_len=None):
    """An empty KV cache for `model` and what runs its forwards on it: (forward, cache, path), path "eager"
    (forward = the model itself, the oracle), "static" (a StaticGPT that just calls its function: the CPU,
    to test it) or "graph" (a StaticGPT replaying CUDA graphs). runtime: "auto" (graph on CUDA, else eager),
    "eager" or "static" (graph on CUDA). role: a name per model a method runs (target, draft); max_len: the
    cache's slots (default the model's context; a tree method adds room for its padded tree)."""
    w = model.wte.weight
    path = runtime_path(runtime, w.device)
    if path == "eager":
        return model, model.new_cache(max_len=max_len), "eager"
    static = kept(model, (role, w.data_ptr(), w.dtype, max_len),
                  lambda proxy: StaticGPT(proxy, model.new_cache(max_len=max_len), capture=path == "graph"))
    return static, static.cache, path


def runtime_path(runtime, device):
    """Which path `runtime` ("auto", "eager" or "static") takes on `device`: "eager", "static" or "graph"."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    cuda = torch.device(device).type == "cuda"
    if runtime == "eager" or (runtime == "auto" and not cuda):
        return "eager"
    return "graph" if cuda else "static"
