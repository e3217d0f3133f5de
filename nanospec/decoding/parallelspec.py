"""
`parallelspec`: a trained drafter guesses k tokens in ONE pass (k mask tokens after the context), the target
verifies them in one forward.

A drafter that guesses autoregressively pays k small passes per step, one after the other; ParallelSpec's
drafter (nanospec/model/drafters/parallelspec.py) reads the new tokens and k learned mask tokens and predicts all k
guesses at once: mask j guesses the token j after the root. The drafter keeps its own cache of the context, so
a step's drafter pass reads only the tokens emitted since the last step plus the k masks (which it then drops).

    root 7 (the target's token); drafter pass over [7, M1, M2, M3] -> guesses [5, 9, 2]
    target forward over [7, 5, 9, 2]: argmax after 7, 5, 9, 2 = [5, 9, 4, 1] -> accept 5, 9; emit [5, 9, 4]
    next drafter pass reads [5, 9, 4, M1, M2, M3]

By default the top candidates of each mask fill a small Medusa-style tree (nanospec/rules/tree.py) instead of one
chain, verified with tree attention (nanospec/steps/verify_step.py); still one drafter pass per step. A mask's
second or third choice is often right when its first is not (docs/measurements.md, parallelspec). The two modes
differ in their guesses (draft_chain.chain_at_once for chain_step, as mtp's heads; tree_guesses.fill_tree for
tree_step, as medusa's); the loop is shared.
Greedy output is `ar`'s token for token. Sampling follows the target's law exactly in both modes of
draft_sampling: "sample" (default) DRAWS mask j's guess from its warped law q_j (a tree: draws without
replacement per depth, tree_guesses.fill_tree) and verifies by rejection sampling against q (verify_chain, or
verify_tree_without_replacement); "topk" takes each mask's top candidates and verifies them as point masses.
Mask j never sees the guesses before it, so q_j is a marginal over them; mtp.py says why that stays lossless.
--verify block (a chain) and traversal (a drawn tree) judge the guesses jointly: the same law, more accepted.

Paper: Xiao et al. 2024, ParallelSpec: Parallel Drafter for Efficient Speculative Decoding, arXiv 2410.05589.
"""
import torch

from nanospec.steps.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.steps.draft_chain import chain_at_once
from nanospec.steps.options import DRAFT_SAMPLING_OPTION, Option, Sampling, read_options, verify_option
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import cache_for, drafter_of, first_token, new_run, tensor
from nanospec.steps.tree_guesses import fill_tree, parse_tree
from nanospec.steps.verify_step import chain_step, judge_of, tree_step

# Paths of ranks: (1, 0) = mask 1's second choice, then mask 2's first. Top-3 for the next token, then a chain.
SMALL_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]

NEEDS = ("parallelspec",)
USES = ()  # parts used when present
OPTIONS = {
    "draft_len": Option(int, None, "tokens to guess per step: mask tokens to use, 1..the drafter's n_masks "
                                   "(None = all)"),
    "tree": Option(str, None, "parallelspec's guesses: small (8: top-3 for the next token, then mostly a chain), "
                              "chain (each mask's top-1), a medusa preset (default, wide) or paths like '0;1;0,0' "
                              "(None = small, or chain with --adaptive history or confidence)"),
    **ADAPTIVE_OPTIONS,  # history, confidence (a mask's probability of its guess): a chain; cost: a tree's first k
    **DRAFT_SAMPLING_OPTION,
    **verify_option("chain", "drawn_tree"),  # block: with --tree chain; traversal: a drawn tree
}


def tree_paths(tree, k, vocab_size):
    """The tree option -> candidate paths no deeper than k, sorted by depth; None for a plain chain."""
    if tree == "chain":
        return None
    if tree == "small":
        return [p for p in SMALL_TREE if len(p) <= k]
    return parse_tree(tree, k, vocab_size)


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    drafter = drafter_of(models, "parallelspec")
    n_masks = drafter.config.n_masks
    k = n_masks if opts.draft_len is None else opts.draft_len
    if not 1 <= k <= n_masks:
        raise ValueError(f"draft_len must be in 1..{n_masks} (the drafter's mask tokens), got {opts.draft_len}")
    by_length = opts.adaptive in ("history", "confidence")  # rules for the length of a chain
    paths = tree_paths(opts.tree or ("chain" if by_length else "small"), k, target.config.vocab_size)
    if paths is not None and by_length:
        raise ValueError(f"--adaptive {opts.adaptive} sets the length of a chain: use it with --tree chain")
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    drawn = run.sampling.guesses_drawn(opts.draft_sampling)
    if not run.sampling.greedy:  # the rule must judge these guesses (block: a chain; traversal: a drawn tree)
        judge_of(opts.verify, "chain" if paths is None else "drawn_tree" if drawn else "fixed_tree",
                 "--tree small" if paths is None else "--tree chain")
    most = n_masks if paths is None else len(paths)  # a chain's masks, or a tree's guesses
    costs = step_costs(models, __name__, run.sampling, opts)
    draft_policy = draft_length(opts, k if paths is None else most, most, costs)
    cache = cache_for(target, target.config.block_size, 1 + most)  # room for a step's guesses at the context end
    draft_cache = drafter.new_cache()

    # prefill: the target gives the first token (the first root); the drafter's first pass reads the prompt too
    last, _ = first_token(run, target, cache, draft_policy)  # and all after it, as `ar`, if no draft pays
    new_tokens = run.prompt + [last]  # what the drafter has not read yet, ending with the root
    mask_logits = None  # (d, V) the drafter's, once it has made a pass
    while not run.done:
        step_paths = None if paths is None else paths[:draft_policy.k]  # a tree: its first k guesses
        d = run.draft_room(draft_policy.k if paths is None else max(map(len, step_paths), default=0))
        if d:  # one drafter pass over the tokens it has not read (1, T) and d masks after the root, the last of them
            ids = tensor(new_tokens, draft_cache.device)  # (1, T)
            root = tensor([len(new_tokens) - 1], draft_cache.device)[0]  # (1,) the root's index in ids
            mask_logits = drafter(target, ids, root, d, cache=draft_cache)[0, 0]  # (d, V)
            new_tokens = []
        if paths is None:  # a chain of guesses (none: a plain step)
            drafts, q_draft = [], None
            if d:
                drafts, q_draft = chain_at_once(mask_logits, draft_policy, run.sampling, drawn, run.generator)
            [emitted], [accepted], _ = chain_step(run.sampling, run.generator, target, cache, [last], [drafts],
                                                  q_draft, opts.verify)
            drafted = len(drafts)
        else:  # a tree of guesses, mask j's candidates at depth j (none: a plain step)
            step_paths = [p for p in step_paths if len(p) <= d]
            tokens, parents, q_draft = fill_tree(last, mask_logits, step_paths, run.sampling, drawn, run.generator)
            emitted, accepted, _ = tree_step(run.sampling, run.generator, target, cache, tokens, parents, q_draft,
                                             opts.verify)
            drafted = len(tokens) - 1
        draft_policy.update(drafted, accepted)
        run.emit(emitted, drafted)
        new_tokens += emitted  # the accepted guesses and the new root: the drafter's next read
        last = emitted[-1]
    return run.out, run.stats()
