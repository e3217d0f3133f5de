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
chain, verified with tree attention (nanospec/decoding/tree_step.py); still one drafter pass per step. On the
4x192 tiny preset (8 validation prompts, greedy) the chain emits 2.25 tokens per target forward and SMALL_TREE, 8
guesses, 2.81: a mask's second or third choice is often right when its first is not.
Greedy output is `ar`'s token for token. Sampling follows the target's law exactly in both modes of
draft_sampling: "sample" (default) DRAWS mask j's guess from its warped law q_j (a tree: draws without
replacement per depth, tree_step.fill_tree) and verifies by rejection sampling against q (verify_chain, or
verify_tree_without_replacement); "topk" takes each mask's top candidates and verifies them as point masses.
Mask j never sees the guesses before it, so q_j is a marginal over them; mtp.py says why that stays lossless.

Paper: Xiao et al. 2024, ParallelSpec: Parallel Drafter for Efficient Speculative Decoding, arXiv 2410.05589.
"""
import torch

from nanospec.decoding.adaptive import ADAPTIVE_OPTIONS, DraftLength
from nanospec.decoding.common import DRAFT_SAMPLING_OPTIONS, chain_step, check_sampling, samples_drafts, start, tensor
from nanospec.decoding.medusa import parse_tree
from nanospec.decoding.tree_step import fill_tree, tree_step
from nanospec.verify import sample, warp

# Paths of ranks: (1, 0) = mask 1's second choice, then mask 2's first. Top-3 for the next token, then a chain.
SMALL_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]

NEEDS = ("parallelspec",)
USES = ()  # parts used when present
OPTIONS = {
    "draft_len": (int, None, "tokens to guess per step: mask tokens to use, 1..the drafter's n_masks (None = all)"),
    "tree": (str, None, "parallelspec's guesses: small (8: top-3 for the next token, then mostly a chain), chain "
                        "(each mask's top-1), a medusa preset (default, wide) or paths like '0;1;0,0' "
                        "(None = small, or chain with --adaptive)"),
    **ADAPTIVE_OPTIONS,  # chain only; confidence: a mask's probability of its guess
    **DRAFT_SAMPLING_OPTIONS,
}


def tree_paths(tree, k, vocab_size):
    """The tree option -> candidate paths no deeper than k, sorted by depth; None for a plain chain."""
    if tree == "chain":
        return None
    if tree == "small":
        return [p for p in SMALL_TREE if len(p) <= k]
    return parse_tree(tree, k, vocab_size)


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None,
             draft_len=None, tree=None, adaptive="off", confidence=0.5, draft_sampling="sample"):
    check_sampling(temperature, top_k, top_p)
    sampled = samples_drafts(draft_sampling, temperature)
    target, drafter = models.target, models.parallelspec
    if drafter is None:
        raise ValueError("parallelspec needs the parallelspec drafter: run `python train_tiny.py --stage parallelspec`")
    if (drafter.config.n_embd, drafter.config.vocab_size) != (target.config.n_embd, target.config.vocab_size):
        raise ValueError("the parallelspec drafter was trained for another target: retrain it "
                         "(delete its checkpoint and run `python train_tiny.py --stage parallelspec`)")
    n_masks = drafter.config.n_masks
    k = n_masks if draft_len is None else draft_len
    if not 1 <= k <= n_masks:
        raise ValueError(f"draft_len must be in 1..{n_masks} (the drafter's mask tokens), got {draft_len}")
    paths = tree_paths(tree or ("chain" if adaptive != "off" else "small"), k, target.config.vocab_size)
    if paths is not None and adaptive != "off":
        raise ValueError("--adaptive sets the length of a chain: use it with --tree chain")
    length = DraftLength(adaptive, k, confidence, most=n_masks)  # guesses per step: k, or adaptive
    run = start(models, prompt_ids, max_new_tokens, seed)
    sampling = (temperature, top_k, top_p)
    cache, draft_cache = target.new_cache(), drafter.new_cache()

    # prefill: the target gives the first token (the first root); the drafter's first pass reads the prompt too
    out = target(tensor(run.prompt, cache.k.device), cache=cache)
    last = int(sample(warp(out.logits[0, -1], *sampling), run.generator))
    new_tokens = run.prompt + [last]  # what the drafter has not read yet, ending with the root
    done = run.emit([last])
    passes, drafted, accepted = 0, 0, 0
    while not done:
        d = run.draft_room(length.k)  # near the end of the budget or context, guess fewer
        if d == 0:  # one token left to emit: nothing to guess (and this is the last step)
            emitted, _, _ = chain_step(run, target, cache, last, [], sampling)
            run.emit(emitted)
            break
        with run.drafting():
            guesses = drafter.draft(target, draft_cache, new_tokens, d)  # (d, V): one pass, d guesses
        passes += 1
        if paths is None:  # chain: each mask's top-1, or a draw from its warped q
            q_draft = warp(guesses, *sampling) if sampled else None  # (d, V)
            picks = sample(q_draft, run.generator) if sampled else guesses.argmax(-1)  # (d,)
            drafts = length.cut(guesses, picks.tolist())  # all d, unless unsure (confidence)
            q_draft = q_draft[:len(drafts)] if sampled else None
            emitted, n, _ = chain_step(run, target, cache, last, drafts, sampling, q_draft)
            drafted, accepted = drafted + len(drafts), accepted + n
            length.update(len(drafts), n)
        else:  # tree: each mask's top candidates, Medusa-style (mask j's candidates sit at depth j)
            slots = cache.max_len - cache.length - 1  # cache slots left for guesses in this forward
            step_paths = [p for p in paths if len(p) <= d][:slots]
            tokens, parents, q_draft = fill_tree(last, guesses, step_paths, sampling, sampled, run.generator)
            emitted, path, _ = tree_step(run, target, cache, tokens, parents, sampling, q_draft=q_draft)
            drafted, accepted = drafted + len(tokens) - 1, accepted + len(path)
        done = run.emit(emitted)
        last, new_tokens = emitted[-1], emitted  # the accepted guesses and the new root: the drafter's next read
    return run.out, run.stats(drafter_passes=passes, drafted=drafted, accepted=accepted,
                              acceptance_rate=accepted / max(1, drafted), draft_time=run.draft_time)
