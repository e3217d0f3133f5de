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
differ in their guesses, `mask_chain` (for chain_step) and `mask_tree` (for tree_step); the loop is shared.
Greedy output is `ar`'s token for token. Sampling follows the target's law exactly in both modes of
draft_sampling: "sample" (default) DRAWS mask j's guess from its warped law q_j (a tree: draws without
replacement per depth, tree_guesses.fill_tree) and verifies by rejection sampling against q (verify_chain, or
verify_tree_without_replacement); "topk" takes each mask's top candidates and verifies them as point masses.
Mask j never sees the guesses before it, so q_j is a marginal over them; mtp.py says why that stays lossless.
--verify block (a chain) and traversal (a drawn tree) judge the guesses jointly: the same law, more accepted.

Paper: Xiao et al. 2024, ParallelSpec: Parallel Drafter for Efficient Speculative Decoding, arXiv 2410.05589.
"""
import torch

from nanospec.steps.adaptive import ADAPTIVE_OPTIONS, draft_length, step_costs
from nanospec.steps.options import DRAFT_SAMPLING_OPTION, Option, Sampling, read_options, verify_option
from nanospec.steps.run import first_token, new_run, tensor
from nanospec.steps.tree_guesses import fill_tree, parse_tree
from nanospec.steps.verify_step import chain_step, tree_step
from nanospec.rules.verify import sample, warp

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
    **verify_option("token", "block", "traversal"),  # block: with --tree chain; traversal: a drawn tree
}


def tree_paths(tree, k, vocab_size):
    """The tree option -> candidate paths no deeper than k, sorted by depth; None for a plain chain."""
    if tree == "chain":
        return None
    if tree == "small":
        return [p for p in SMALL_TREE if len(p) <= k]
    return parse_tree(tree, k, vocab_size)


def mask_chain(run, mask_logits, draft_policy, drawn):
    """Chain mode's guesses: each mask's top-1, or a draw from its warped q (drawn), cut at the first unconfident
    one (--adaptive confidence). mask_logits (d, V): the drafter's. Returns (drafts: j ints, q_draft (1, j, V),
    the one row chain_step judges, or None)."""
    q_draft = warp(mask_logits, *run.sampling) if drawn else None  # (d, V)
    picks = sample(q_draft, run.generator) if drawn else mask_logits.argmax(-1)  # (d,)
    drafts = draft_policy.cut(mask_logits, picks.tolist())  # all d, unless unsure (confidence)
    return drafts, q_draft[None, :len(drafts)] if drawn else None


def mask_tree(run, cache, last, mask_logits, paths, drawn):
    """Tree mode's guesses: each mask's top candidates (or draws), Medusa-style (mask j's candidates sit at depth
    j), under the root `last`. mask_logits (d, V): the drafter's. Returns (tokens, parents, q_draft (N, V) or
    None), as tree_guesses.fill_tree."""
    slots = cache.max_len - cache.length - 1  # cache slots left for guesses in this forward
    step_paths = [p for p in paths if len(p) <= mask_logits.size(0)][:slots]
    return fill_tree(last, mask_logits, step_paths, run.sampling, drawn, run.generator)


def check_drafter(target, drafter):
    """A one-line ValueError unless the drafter is there and fits the target."""
    if drafter is None:
        raise ValueError("parallelspec needs the parallelspec drafter: run `python train_tiny.py --stage parallelspec`")
    if (drafter.config.n_embd, drafter.config.vocab_size) != (target.config.n_embd, target.config.vocab_size):
        raise ValueError("the parallelspec drafter was trained for another target: retrain it "
                         "(delete its checkpoint and run `python train_tiny.py --stage parallelspec`)")


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    drafter = models.parallelspec
    check_drafter(target, drafter)
    n_masks = drafter.config.n_masks
    k = n_masks if opts.draft_len is None else opts.draft_len
    if not 1 <= k <= n_masks:
        raise ValueError(f"draft_len must be in 1..{n_masks} (the drafter's mask tokens), got {opts.draft_len}")
    by_length = opts.adaptive in ("history", "confidence")  # rules for the length of a chain
    paths = tree_paths(opts.tree or ("chain" if by_length else "small"), k, target.config.vocab_size)
    if opts.verify == "block" and paths is not None:
        raise ValueError("--verify block judges a chain of guesses: add --tree chain (for a tree: --verify traversal)")
    if opts.verify == "traversal" and paths is None:
        raise ValueError("--verify traversal judges a tree of guesses: drop --tree chain (for a chain: --verify block)")
    if paths is not None and by_length:
        raise ValueError(f"--adaptive {opts.adaptive} sets the length of a chain: use it with --tree chain")
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    most = n_masks if paths is None else len(paths)  # a chain's masks, or a tree's guesses
    draft_policy = draft_length(opts, k if paths is None else most, most, step_costs(models, __name__, run.sampling,
                                                                                     opts))
    drawn = run.sampling.guesses_drawn(opts.draft_sampling)
    cache = target.new_cache(max_len=target.config.block_size + 1 + (n_masks if paths is None else len(paths)))
    draft_cache = drafter.new_cache()

    # prefill: the target gives the first token (the first root); the drafter's first pass reads the prompt too
    last, _ = first_token(run, target, cache)
    new_tokens = run.prompt + [last]  # what the drafter has not read yet, ending with the root
    done = run.emit([last])
    while not done:
        step_paths = None if paths is None else paths[:draft_policy.k]  # a tree: its first k guesses
        d = run.draft_room(draft_policy.k if paths is None else max(map(len, step_paths), default=0))
        if d:  # one drafter pass over the tokens it has not read (1, T) and d masks after the root, the last of them
            ids = tensor(new_tokens, draft_cache.device)  # (1, T)
            root = tensor([len(new_tokens) - 1], draft_cache.device)[0]  # (1,) the root's index in ids
            mask_logits = drafter(target, ids, root, d, cache=draft_cache)[0, 0]  # (d, V)
            new_tokens = []
        if paths is None:  # a chain of guesses (none: a plain step)
            drafts, q_draft = mask_chain(run, mask_logits, draft_policy, drawn) if d else ([], None)
            [emitted], [accepted], _ = chain_step(run, target, cache, [last], [drafts], q_draft, opts.verify)
            drafted = len(drafts)
        else:  # a tree of guesses
            tokens, parents, q_draft = mask_tree(run, cache, last, mask_logits, step_paths, drawn) if d else \
                ([last], [-1], None)
            emitted, accepted, _ = tree_step(run, target, cache, tokens, parents, q_draft, opts.verify)
            drafted = len(tokens) - 1
        draft_policy.update(drafted, accepted)
        done = run.emit(emitted, drafted)
        new_tokens += emitted  # the accepted guesses and the new root: the drafter's next read
        last = emitted[-1]
    return run.out, run.stats()
