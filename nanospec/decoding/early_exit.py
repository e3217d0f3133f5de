"""
`early-exit`: self-speculation with the target's own first layers. The draft is blocks 1..E of the target
plus its final norm and unembedding (through a small trained adapter when the checkpoint has one,
nanospec/model/drafters/early_exit.py): no second model, nothing extra to keep in memory but the adapter.

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

Papers: Elhoushi et al. 2024, LayerSkip, arXiv 2404.16710; Liu et al. 2024, Kangaroo, arXiv 2404.18911;
Zhang et al. 2023, Draft & Verify, arXiv 2309.08168.
"""
import torch

from nanospec.steps.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.steps.draft_chain import draft_chain
from nanospec.steps.options import Option, Sampling, read_options, verify_option
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import first_token, new_run, tensor
from nanospec.steps.verify_step import chain_step
from nanospec.model.drafters.early_exit import exit_logits

NEEDS = ()
USES = ("early_exit",)  # the trained exit adapters when present, else the plain exit
OPTIONS = {
    "exit_layer": Option(int, None, "blocks the draft runs before exiting, 1..n_layer-1 (None = default_exit_layer)"),
    "draft_len": Option(int, 4, "tokens the draft guesses per target forward (k; the most, adaptive)", low=1,
                        high=64),
    **ADAPTIVE_OPTIONS, **verify_option("chain"),
}


def default_exit_layer(n_layer):
    """The exit used unless --exit-layer says otherwise: an eighth of the target's blocks, at least one. On a CPU
    the draft's cost decides more than its agreement (docs/measurements.md, early-exit)."""
    return max(1, n_layer // 8)


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    adapter = models.early_exit
    L = target.config.n_layer
    E = default_exit_layer(L) if opts.exit_layer is None else opts.exit_layer
    if not 1 <= E < L:
        raise ValueError(f"exit_layer must be in 1..{L - 1} (the target has {L} layers), got {opts.exit_layer}")
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    draft_policy = draft_length(opts, opts.draft_len, costs=step_costs(models, __name__, run.sampling, opts))
    cache = target.new_cache()

    def lower(x):  # blocks 1..E read token ids x (1, 1); their output (1, 1, C) is kept for the verify forward
        hidden.append(target(x, cache=cache, layers=(0, E)).hidden)
        return exit_logits(target, adapter, E, hidden[-1])[:, -1]  # (1, V) the exit's guess of the next token

    last, _ = first_token(run, target, cache, draft_policy)  # the whole target reads the prompt (`ar` if no draft pays)
    while not run.done:
        k = run.draft_room(draft_policy.k)  # fewer guesses near the context end or budget
        drafts, q_draft, upper = [[]], None, {}  # k = 0: a plain step, one forward through every block
        if k:  # Draft: blocks 1..E read the newest token, the exit guesses, each guess read back by blocks 1..E
            hidden = []  # (1, 1, C) block E's output for the newest token and each guess (the verify reads them)
            drafts, q_draft = draft_chain(lower, tensor([last], cache.device), k, run.sampling, run.generator,
                                          draft_policy.stopper)
            x = tensor(drafts[0][-1:], cache.device)  # (1, 1) d_k, never read back: the lower cache runs ahead
            hidden.append(target(x, cache=cache, layers=(0, E)).hidden)  # (1, 1, C)
            upper = dict(layers=(E, L), hidden_in=torch.cat(hidden, 1))  # (1, k+1, C): blocks E+1..L verify
        # The chain rule on the verify forward's logits; every layer's cache rolls back to the newest token + the
        # accepted guesses.
        [emitted], [n], _ = chain_step(run.sampling, run.generator, target, cache, [last], drafts, q_draft,
                                       opts.verify, **upper)  # one row
        draft_policy.update(len(drafts[0]), n)
        run.emit(emitted, drafted=len(drafts[0]))
        last = emitted[-1]

    return run.out, run.stats(exit_layer=E, adapter=adapter is not None)
