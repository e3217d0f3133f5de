"""
`medusa`: a tree of guesses from the top-k of each MTP head, verified in one target forward.

`mtp` bets on one chain: the top-1 of every head. But a head's second or third choice is often right when its
first is not, so Medusa puts several candidates per head into a tree (a path (i, j) = head 1's top-(i+1), then
head 2's top-(j+1)) and verifies the whole tree in ONE forward with tree attention (each node sees only its
ancestors, nanospec/rules/tree.py). The longest accepted path is kept, the cache compacted to it, and the target's
next token comes from the same forward, as do the heads' guesses for the next tree (at the last accepted node).

    root 5 (the target's token); head 1 top-2 = [9, 3], head 2 top-1 = [2]; tree paths (0,), (1,), (0, 0):
        5 -> 9 -> 2          target argmax after 5 = 3, after 3 = 8
          -> 3               -> 9 rejected, 3 accepted, emit [3, 8]   (mtp's chain [9, 2] would emit [3])

Verification: greedy = accept while a node equals the target's argmax (the output is `ar`'s token for token).
Sampling, lossless either way: with draft_sampling "sample" (default) the candidates of depth d are DRAWN without
replacement from head d's warped q and the tree is checked by recursive rejection sampling against those q
(verify.verify_tree_without_replacement; each node's children drawn on their own from its depth's q,
tree_guesses.fill_tree); with "topk" they are the heads' top-k, checked by the tree point-mass rule. With
verify="typical", Medusa's typical acceptance judges the top-k guesses and is LOSSY: it accepts any plausible
guess, so the output no longer follows the target's law. (A head's q is a marginal over the tokens before its
own: see mtp.py.) With verify="traversal" a drawn tree is judged from its leaves up (verify.verify_tree_traversal):
lossless too.
The heads run inside the verify forward, on every node (target(..., heads=n), as `mtp`'s), and the next
candidates come from those at the node accepted last (none before a step that guesses nothing). The default tree
was measured on the trained model (scripts/medusa_tree.py; tree_guesses.py, docs/measurements.md).

Papers: Cai et al. 2024, Medusa, arXiv 2401.10774; Stern et al. 2018, Blockwise Parallel Decoding,
arXiv 1811.03115; Gloeckle et al. 2024, Multi-token Prediction, arXiv 2404.19737.
"""
import torch

from nanospec.steps.adaptive import PRICED_OPTIONS, draft_length
from nanospec.steps.options import (DRAFT_SAMPLING_OPTION, VERIFY_RULES, Option, Sampling, read_options, rule_for,
                                    verify_option)
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import cache_for, first_token, heads_at, new_run
from nanospec.steps.tree_guesses import TREES, fill_tree, parse_tree  # noqa: F401 (TREES: the presets)
from nanospec.steps.verify_step import tree_step
from nanospec.rules.tree import print_verified_tree

NEEDS = ()  # the MTP heads are part of the target
USES = ("heads",)  # heads.pt, the heads retrained alone, replaces the jointly trained ones when present
OPTIONS = {
    "tree": Option(str, "default", "medusa's candidate tree: a preset (default, large, chain, wide) or paths like "
                                   "'0;0,0;1' where '0,1' = head 1's top-1 then head 2's top-2"),
    **verify_option("drawn_tree", "fixed_tree"),
    "show_tree": Option(bool, False, "print medusa's candidate tree for the first two steps, accepted path marked *"),
    **DRAFT_SAMPLING_OPTION, **PRICED_OPTIONS,  # cost: the tree's first k guesses
}


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    paths = parse_tree(opts.tree, target.config.n_future, target.config.vocab_size)
    depth = max(map(len, paths))
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    # drawn guesses, unless the rule judges only guesses not drawn (typical: the heads' top-k)
    rule = VERIFY_RULES[rule_for(opts.verify, "drawn_tree")]  # --verify, or what judges a drawn tree by default
    drawn = run.sampling.guesses_drawn(opts.draft_sampling) and rule.drawn_tree is not None
    draft_policy = draft_length(opts, len(paths), costs=step_costs(models, __name__, run.sampling, opts))
    cache = cache_for(target, target.config.block_size, len(paths) + 1)  # room for a tree at the context end

    # prefill: the main head gives the first token (the first root), the heads the first candidates
    def heads():  # how many heads the next tree reaches: the depth of its first k paths (by depth)
        return len(paths[draft_policy.k - 1]) if draft_policy.k else 0

    def heads_there(out, node):  # (n, V) those heads' logits at `node` of a forward's Output; None: no guesses next
        return heads_at(target, out, node, heads()) if heads() else None

    last, out = first_token(run, target, cache, draft_policy)  # and all after it, as `ar`, if no draft pays
    head_logits = heads_there(out, -1)  # at the position that chose last
    while not run.done:
        d = run.draft_room(depth)  # near the end of the budget or context, a shallower tree
        step_paths = [p for p in paths if len(p) <= d][:draft_policy.k]  # its first k guesses
        tokens, parents, q_draft = fill_tree(last, head_logits, step_paths, run.sampling, drawn, run.generator)
        emitted, path, out = tree_step(run.sampling, run.generator, target, cache, tokens, parents, q_draft,
                                       opts.verify, heads=heads())  # the heads run in the forward, on every node
        if opts.show_tree and run.target_forwards <= 2:  # the first two trees (the first forward read the prompt)
            print_verified_tree(f"medusa step {run.target_forwards}", tokens, parents, path, emitted, models.tokenizer,
                                drawn, paths=None if drawn else step_paths)
        draft_policy.update(len(tokens) - 1, path)
        run.emit(emitted, drafted=len(tokens) - 1)
        last = emitted[-1]
        node = path[-1] if path else 0  # the last accepted node: its main head chose `last`, its heads guess on
        head_logits = heads_there(out, node)
    stats = run.stats()
    trees = max(1, run.target_forwards - 1)  # the first forward read the prompt
    return run.out, {**stats, "tree_nodes": stats["drafted"] / trees, "accepted_per_tree": stats["accepted"] / trees}
