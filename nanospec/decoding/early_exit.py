"""
`early-exit`: self-speculation with the target's own first layers. The draft is blocks 1..E of the target
plus its final norm and unembedding (through a small trained adapter when the checkpoint has one,
nanospec/drafters/early_exit.py): no second model, nothing extra to keep in memory but the adapter.

The draft shares more than weights with the target: its keys and values in blocks 1..E ARE the target's, for
the same tokens at the same positions. So the lower layers' KV cache is written once, while drafting, and the
verify forward runs only blocks E+1..L, over the block-E outputs the draft already computed (LayerSkip's
"exit query cache"). The lower layers run ahead of the upper ones while drafting (the KV cache counts tokens
per layer) and the verify forward catches them up.

One step, L = 4 layers, E = 2, k = 3, greedy:
    blocks 1-2 read 12 -> exit guesses 5; read 5 -> 9; read 9 -> 2; read 2 (only for the verify pass)
    blocks 3-4 read the four block-2 outputs of [12, 5, 9, 2] -> target argmax after each: [5, 9, 7, 3]
    accept 5, 9; reject 2 -> emit [5, 9, 7]; every layer's cache rolls back to [.., 12, 5, 9]
Per step: k+1 one-token passes through E layers + one pass through L-E layers over k+1 tokens, for 1..k+1
tokens (`ar` pays L layers per token). Sampling uses Leviathan's rule with q_draft = the exit's law, warped
like the target's, so the output follows the (warped) target exactly; greedy output is `ar`'s.

The guesses stay on the device (each one feeds blocks 1..E there), and the step's one host read brings back the
guesses, the accepted count and the target's token (chain_step.verify_on_device). --runtime static runs both
layer ranges shape-static (nanospec/static.py), and the whole draft, k+1 passes of blocks 1..E, k exits and k
draws, as one function of tensors, on CUDA one graph replayed per step (nanospec/draft_chain.py). eager (auto's
path off CUDA) is plain PyTorch throughout.

Papers: Elhoushi et al. 2024, LayerSkip, arXiv 2404.16710; Liu et al. 2024, Kangaroo, arXiv 2404.18911;
Zhang et al. 2023, Draft & Verify, arXiv 2309.08168.
"""
import torch

from nanospec.decoding.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.decoding.chain_step import chain_verify
from nanospec.decoding.options import RUNTIME_OPTION, Option, Sampling, read_options
from nanospec.decoding.run import prefill, start, tensor
from nanospec.drafters.early_exit import exit_logits
from nanospec.draft_chain import chain_noise, draft_chain, run_chain
from nanospec.static import runtime_model

NEEDS = ()
USES = ("early_exit",)  # the trained exit adapters when present, else the plain exit
OPTIONS = {
    "exit_layer": Option(int, None, "blocks the draft runs before exiting, 1..n_layer-1 (None = default_exit_layer)"),
    "draft_len": Option(int, 4, "tokens the draft guesses per target forward (k)", low=1, high=64),
    **ADAPTIVE_OPTIONS,
    **RUNTIME_OPTION,
}


def default_exit_layer(n_layer):
    """The exit used unless --exit-layer says otherwise: an eighth of the target's blocks, at least one. On a CPU
    the draft's cost decides more than its agreement (docs/measurements.md, early-exit)."""
    return max(1, n_layer // 8)


def exit_guesses(run, target, cache, x, k, length, model, adapter, E):
    """Blocks 1..E read x (1, 1), the newest token, and the exit guesses the next token from block E's output, k
    times, each guess read back by blocks 1..E (the next guess and the verify pass need its block-E output).
    Returns (drafts (j,), q_draft (j, V) or None when j == 0, block-E outputs (1, j+1, C)), j = k unless the
    confidence rule stopped early; the lower layers' cache holds j+1 more tokens. With a fixed k all of it is one
    function of tensors (on CUDA one graph: draft_chain.run_chain); the confidence rule decides on the host after
    each guess, so it runs forward by forward. Both runtimes draw alike (draft_chain.py)."""
    if k == 0:  # no guesses: the verify pass still needs the newest token's block-E output
        hidden = target(x, cache=cache, layers=(0, E)).hidden.clone()  # (1, 1, C) the static path rewrites it
        return torch.zeros(0, dtype=torch.long, device=cache.device), None, hidden
    stop = length.stop if length.rule == "confidence" else None
    noise = chain_noise(run, k, model)  # (k, V) the draws' randomness, or None (greedy)

    def body(step, x, noise=None):  # k passes of blocks 1..E and the exit, then blocks 1..E over the last guess
        hidden = []

        def read(x):  # blocks 1..E read x, the exit guesses the next token; (1, 1, C) kept (a copy: see above)
            hidden.append(step(x).hidden.clone())
            return exit_logits(model, adapter, E, hidden[-1])[0, -1]  # (V,)

        drafts, q_draft = draft_chain(read, x, k, run.sampling, noise, stop)
        read_last = step(drafts[-1].view(1, 1)).hidden  # (1, 1, C)
        return drafts, q_draft, torch.cat(hidden + [read_last], dim=1)  # (j,), (j, V), (1, j+1, C)

    with run.drafting(0) as timer:  # the drafter's passes: the exit and blocks 1..E over each guess
        # a captured graph reads the adapter weights it was captured with, where they were: key on their addresses
        weights = () if adapter is None else tuple(p.data_ptr() for p in adapter.exits[E - 1].parameters())
        drafts, q_draft, hidden = run_chain(target, cache, body, x, noise, fed=k + 1, end=E,
                                            key=(k, run.sampling, weights), whole=stop is None)
        timer.passes = len(drafts)
    return drafts, q_draft, hidden


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    o = read_options(OPTIONS, options)
    model, adapter = models.target, models.early_exit
    L = model.config.n_layer
    E = default_exit_layer(L) if o.exit_layer is None else o.exit_layer
    if not 1 <= E < L:
        raise ValueError(f"exit_layer must be in 1..{L - 1} (the target has {L} layers), got {o.exit_layer}")
    length = draft_length(o, o.draft_len)
    run = start(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    target, cache, runtime = runtime_model(model, o.runtime)  # the model, or its static forwards
    drafted = accepted = judged = 0

    last, _ = prefill(run, target, cache)  # the whole target reads the prompt
    done = run.emit([last])
    while not done:
        n_before, k = cache.length, run.draft_room(length.k)  # fewer guesses near the context end or budget
        x = tensor([run.seq[-1]], cache.device)  # (1, 1) the newest token
        drafts, q_rows, hidden = exit_guesses(run, target, cache, x, k, length, model, adapter, E)
        # Verify: blocks E+1..L read the k+1 block-E outputs in one forward; the chain rule on its logits, then
        # every layer's cache rolls back to the newest token + the accepted guesses.
        with run.forwarding():
            out = target(None, cache=cache, layers=(E, L), hidden_in=hidden)  # logits (1, k+1, V)
        emitted, n = chain_verify(run, cache, n_before, out.logits[0], drafts, q_rows)
        # judged: guesses the rule looked at (the accepted ones and the first rejected one), as in speculative
        drafted, accepted, judged = drafted + len(drafts), accepted + n, judged + min(n + 1, len(drafts))
        length.update(len(drafts), n)
        done = run.emit(emitted)

    return run.out, run.stats(drafted=drafted, accepted=accepted, judged=judged,
                              acceptance_rate=accepted / max(1, judged),
                              exit_layer=E, adapter=adapter is not None, runtime=runtime)
