"""
`parallelspec`: a trained drafter guesses k tokens in ONE pass (k mask tokens after the context), the target
verifies them in one forward.

A drafter that guesses autoregressively pays k small passes per step, one after the other; ParallelSpec's
drafter (nanospec/drafters/parallelspec.py) reads the new tokens and k learned mask tokens and predicts all k
guesses at once: mask j guesses the token j after the root. The drafter keeps its own cache of the context, so
a step's drafter pass reads only the tokens emitted since the last step plus the k masks (which it then drops).

    root 7 (the target's token); drafter pass over [7, M1, M2, M3] -> guesses [5, 9, 2]
    target forward over [7, 5, 9, 2]: argmax after 7, 5, 9, 2 = [5, 9, 4, 1] -> accept 5, 9; emit [5, 9, 4]
    next drafter pass reads [5, 9, 4, M1, M2, M3]

By default the top candidates of each mask fill a small Medusa-style tree (nanospec/tree.py) instead of one
chain, verified with tree attention (nanospec/decoding/verify_step.py); still one drafter pass per step. A mask's
second or third choice is often right when its first is not (docs/measurements.md, parallelspec). The two modes
are two step functions, `chain_step_guesses` and `tree_step_guesses`; the loop around them is shared.
Greedy output is `ar`'s token for token. Sampling follows the target's law exactly in both modes of
draft_sampling: "sample" (default) DRAWS mask j's guess from its warped law q_j (a tree: draws without
replacement per depth, tree_guesses.fill_tree) and verifies by rejection sampling against q (verify_chain, or
verify_tree_without_replacement); "topk" takes each mask's top candidates and verifies them as point masses.
Mask j never sees the guesses before it, so q_j is a marginal over them; mtp.py says why that stays lossless.
--verify block (a chain) and traversal (a drawn tree) judge the guesses jointly: the same law, more accepted.

Paper: Xiao et al. 2024, ParallelSpec: Parallel Drafter for Efficient Speculative Decoding, arXiv 2410.05589.
"""
import torch

from nanospec.decoding.adaptive import ADAPTIVE_OPTIONS, draft_length
from nanospec.decoding.options import DRAFT_SAMPLING_OPTION, Option, Sampling, read_options
from nanospec.decoding.run import prefill, start, tensor
from nanospec.decoding.tree_guesses import fill_tree, parse_tree
from nanospec.decoding.verify_step import chain_step, tree_step
from nanospec.verify import sample, warp

# Paths of ranks: (1, 0) = mask 1's second choice, then mask 2's first. Top-3 for the next token, then a chain.
SMALL_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]

VERIFY_RULES = ("token", "block", "traversal")  # block judges a chain jointly, traversal a drawn tree from its leaves
NEEDS = ("parallelspec",)
USES = ()  # parts used when present
OPTIONS = {
    "draft_len": Option(int, None, "tokens to guess per step: mask tokens to use, 1..the drafter's n_masks "
                                   "(None = all)"),
    "tree": Option(str, None, "parallelspec's guesses: small (8: top-3 for the next token, then mostly a chain), "
                              "chain (each mask's top-1), a medusa preset (default, wide) or paths like '0;1;0,0' "
                              "(None = small, or chain with --adaptive)"),
    **ADAPTIVE_OPTIONS,  # chain only; confidence: a mask's probability of its guess
    **DRAFT_SAMPLING_OPTION,
    "verify": Option(str, "token", "how the target judges the guesses when sampling: token = one at a time, from "
                                   "the root down; block = a chain jointly (--tree chain); traversal = a drawn tree "
                                   "from its leaves up (the same law, more accepted)", choices=VERIFY_RULES),
}


def tree_paths(tree, k, vocab_size):
    """The tree option -> candidate paths no deeper than k, sorted by depth; None for a plain chain."""
    if tree == "chain":
        return None
    if tree == "small":
        return [p for p in SMALL_TREE if len(p) <= k]
    return parse_tree(tree, k, vocab_size)


def chain_step_guesses(run, target, cache, last, guesses, length, drawn, rule):
    """Chain mode: each mask's top-1, or a draw from its warped q (drawn), cut at the first unconfident one
    (--adaptive confidence), verified by chain_step. guesses (d, V): the drafter's logits.
    Returns (emitted, guesses verified, guesses accepted)."""
    q_draft = warp(guesses, *run.sampling) if drawn else None  # (d, V)
    picks = sample(q_draft, run.generator) if drawn else guesses.argmax(-1)  # (d,)
    drafts = length.cut(guesses, picks.tolist())  # all d, unless unsure (confidence)
    q_draft = q_draft[:len(drafts)] if drawn else None
    emitted, n, _ = chain_step(run, target, cache, last, drafts, q_draft, rule)
    length.update(len(drafts), n)
    return emitted, len(drafts), n


def tree_step_guesses(run, target, cache, last, guesses, paths, drawn, rule):
    """Tree mode: each mask's top candidates (or draws), Medusa-style (mask j's candidates sit at depth j),
    verified by tree_step. guesses (d, V): the drafter's logits. Returns (emitted, guesses verified, accepted)."""
    slots = cache.max_len - cache.length - 1  # cache slots left for guesses in this forward
    step_paths = [p for p in paths if len(p) <= guesses.size(0)][:slots]
    tokens, parents, q_draft = fill_tree(last, guesses, step_paths, run.sampling, drawn, run.generator)
    emitted, path, _ = tree_step(run, target, cache, tokens, parents, q_draft, rule)
    return emitted, len(tokens) - 1, len(path)


def check_drafter(target, drafter):
    """A one-line ValueError unless the drafter is there and fits the target."""
    if drafter is None:
        raise ValueError("parallelspec needs the parallelspec drafter: run `python train_tiny.py --stage parallelspec`")
    if (drafter.config.n_embd, drafter.config.vocab_size) != (target.config.n_embd, target.config.vocab_size):
        raise ValueError("the parallelspec drafter was trained for another target: retrain it "
                         "(delete its checkpoint and run `python train_tiny.py --stage parallelspec`)")


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    o = read_options(OPTIONS, options)
    target, drafter = models.target, models.parallelspec
    check_drafter(target, drafter)
    n_masks = drafter.config.n_masks
    k = n_masks if o.draft_len is None else o.draft_len
    if not 1 <= k <= n_masks:
        raise ValueError(f"draft_len must be in 1..{n_masks} (the drafter's mask tokens), got {o.draft_len}")
    paths = tree_paths(o.tree or ("chain" if o.adaptive != "off" else "small"), k, target.config.vocab_size)
    if o.verify == "block" and paths is not None:
        raise ValueError("--verify block judges a chain of guesses: add --tree chain (for a tree: --verify traversal)")
    if o.verify == "traversal" and paths is None:
        raise ValueError("--verify traversal judges a tree of guesses: drop --tree chain (for a chain: --verify block)")
    if paths is not None and o.adaptive != "off":
        raise ValueError("--adaptive sets the length of a chain: use it with --tree chain")
    length = draft_length(o, k, most=n_masks)  # guesses per step: k, or adaptive
    run = start(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    drawn = run.sampling.draws(o.draft_sampling)
    cache = target.new_cache(max_len=target.config.block_size + 1 + (n_masks if paths is None else len(paths)))
    draft_cache = drafter.new_cache()

    # prefill: the target gives the first token (the first root); the drafter's first pass reads the prompt too
    last, _ = prefill(run, target, cache)
    new_tokens = run.prompt + [last]  # what the drafter has not read yet, ending with the root
    done = run.emit([last])
    drafted, accepted = 0, 0
    while not done:
        d = run.draft_room(length.k)  # near the end of the budget or context, guess fewer
        if d == 0:  # one token left to emit: nothing to guess (and this is the last step)
            run.emit(chain_step(run, target, cache, last, [])[0])
            break
        # one drafter pass over the new tokens (1, T) and d masks after the root, the last of them
        ids, root = tensor(new_tokens, draft_cache.device), tensor([len(new_tokens) - 1], draft_cache.device)[0]
        guesses = drafter(target, ids, root, d, cache=draft_cache)[0, 0]  # (d, V) logits
        if paths is None:
            emitted, m, n = chain_step_guesses(run, target, cache, last, guesses, length, drawn, o.verify)
        else:
            emitted, m, n = tree_step_guesses(run, target, cache, last, guesses, paths, drawn, o.verify)
        drafted, accepted = drafted + m, accepted + n
        done = run.emit(emitted)
        last, new_tokens = emitted[-1], emitted  # the accepted guesses and the new root: the drafter's next read
    return run.out, run.stats(drafted=drafted, accepted=accepted, acceptance_rate=accepted / max(1, drafted))
