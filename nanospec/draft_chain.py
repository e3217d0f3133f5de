"""
A drafter's chain of guesses as one function of tensors: k drafter forwards, each reading the guess before it,
and k draws, with no host read in between. `speculative` (the draft GPT) and `early-exit` (the target's first
layers and its exit) draft this way.

    draft reads [12] -> law q1, draws 5; reads [5] -> q2, draws 9; reads [9] -> q3, draws 2
    -> drafts [5, 9, 2] (k,) and q_draft [q1, q2, q3] (k, V), both left on the device

On the static runtime (nanospec/static.py) the whole chain is ONE call of nanospec/graphs.py's Graphs: on CUDA
one graph replayed per step instead of k forwards' worth of kernels launched from Python (StaticGPT.chain). On
the eager runtime the same loop runs on the plain model: the oracle the static chain is tested against.

A replayed graph cannot ask the host's RNG for numbers, so the chain takes its randomness as an input: uniforms
`noise` (k, V), drawn from the run's generator before the call (`chain_noise`), and each draw is Gumbel-max,
argmax(log q + Gumbel(u)), an exact draw from q (the same draw as verify.draw_rows, whose noise is made inside).
Both runtimes draw this way, so a seeded run gives the same tokens on either. Greedy needs no noise: the argmax.

A drafter that decides on the host after each guess (--adaptive confidence) cannot run as one graph: `run_chain`
with whole=False runs the same loop forward by forward, stopping where `stop` says.
"""
import torch

from nanospec.static import StaticGPT
from nanospec.verify import gumbel_top_k, warp


def chain_noise(run, k, model):
    """The randomness of k draws from `model`'s laws: uniforms (k, V) from the run's generator, in the model's
    dtype and on its device, or None when greedy (no draw)."""
    if run.sampling.greedy:
        return None
    w = model.wte.weight  # (V, C)
    return torch.rand((k, w.size(0)), generator=run.generator, dtype=w.dtype, device=w.device)  # (k, V)


def gumbel_draw(q_draft, u):
    """One token per row of q_draft (..., V), a draw from it given uniforms u (..., V): the argmax of log q plus
    Gumbel(0, 1) noise -log(-log u). verify.draw_rows draws the same from the same uniforms (tests hold them
    equal). u None: the argmax (greedy: q is one-hot). Returns a LongTensor (...)."""
    if u is None:
        return q_draft.argmax(-1)
    return gumbel_top_k(q_draft, 1, u=u).indices[..., 0]  # log 0 = -inf: a token q excludes never wins


def draft_chain(step, x, k, sampling, noise=None, stop=None):
    """k guesses, each fed back: step(x) -> the drafter's logits (V,) for the token after x, x (1, T) token ids
    (T = 1 after the first); warp(logits, *sampling) is the law q each guess is drawn from, with row i of noise
    (k, V) (None: greedy). stop(logits, guess) -> True ends the chain early (a host decision: never inside a
    graph). Returns drafts (j,) LongTensor and q_draft (j, V), j = k unless stopped."""
    drafts, q_rows = [], []
    for i in range(k):
        logits = step(x)  # (V,)
        q_rows.append(warp(logits, *sampling))  # (V,) Leviathan's rule needs the law each guess came from
        drafts.append(gumbel_draw(q_rows[-1], None if noise is None else noise[i]))  # () on the device
        x = drafts[-1].view(1, 1)  # (1, 1) the next forward reads it there
        if stop is not None and stop(logits, drafts[-1]):
            break
    return torch.stack(drafts), torch.stack(q_rows)  # (j,), (j, V)


def run_chain(drafter, cache, body, x, noise, *, fed, key=(), end=None, whole=True):
    """body(step, x, noise) -> a tuple of tensors: a chain of drafter forwards, step(x) being the Output of blocks
    0..end-1 (default all) over token ids x (1, T), writing their keys to `cache` and advancing it.

    drafter: the model (eager: body just runs), or a StaticGPT, which with whole=True runs body as ONE function of
    tensors, captured per key and shapes on CUDA (StaticGPT.chain); `fed` is then how many tokens body's steps
    read in all and `key` every setting body closes over (k, the sampling, ...). whole=False: one static forward
    per step (a body that decides on the host between them). noise: (k, V) uniforms or None (greedy)."""
    layers = None if end is None else (0, end)
    if isinstance(drafter, StaticGPT) and whole:
        return drafter.chain(body, x, noise, fed=fed, key=key, end=end)
    return tuple(body(lambda x: drafter(x, cache=cache, layers=layers), x, noise))
