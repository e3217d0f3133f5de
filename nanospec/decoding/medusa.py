"""
`medusa`: a tree of guesses from the top-k of each MTP head, verified in one target forward.

`mtp` bets on one chain: the top-1 of every head. But a head's second or third choice is often right when its
first is not, so Medusa puts several candidates per head into a tree (a path (i, j) = head 1's top-(i+1), then
head 2's top-(j+1)) and verifies the whole tree in ONE forward with tree attention (each node sees only its
ancestors, nanospec/tree.py). The longest accepted path is kept, the cache compacted to it, and the target's
next token comes from the same forward, as do the heads' guesses for the next tree (at the last accepted node).

    root 5 (the target's token); head 1 top-2 = [9, 3], head 2 top-1 = [2]; tree paths (0,), (1,), (0, 0):
        5 -> 9 -> 2          target argmax after 5 = 3, after 3 = 8
          -> 3               -> 9 rejected, 3 accepted, emit [3, 8]   (mtp's chain [9, 2] would emit [3])

Verification: greedy = accept while a node equals the target's argmax (the output is `ar`'s token for token).
Sampling, lossless either way: with draft_sampling "sample" (default) the candidates of depth d are DRAWN without
replacement from head d's warped q and the tree is checked by recursive rejection sampling against those q
(verify.verify_tree_without_replacement; one set of draws per depth, tree_step.fill_tree says why that is
fine); with "topk" they are the heads' top-k, checked by the tree point-mass rule. With verify="typical",
Medusa's typical acceptance judges the top-k guesses and is LOSSY: it accepts any plausible guess, so the
output no longer follows the target's law. (A head's q is a marginal over the tokens before its own: see mtp.py.)
The default tree was measured on the trained model (scripts/medusa_tree.py; trees.py, docs/measurements.md).
--runtime static: the target's forwards shape-static (nanospec/static.py), every tree padded to the preset's
node count (tree_step.py), the heads run inside it; a step reads the host once (the accepted path), greedy or
sampling (a drawn tree keeps its shape and the rule runs on the device: trees.fill_tree, tree_step.walk_on_device).

Papers: Cai et al. 2024, Medusa, arXiv 2401.10774; Stern et al. 2018, Blockwise Parallel Decoding,
arXiv 1811.03115; Gloeckle et al. 2024, Multi-token Prediction, arXiv 2404.19737.
"""
import torch

from nanospec.decoding.options import DRAFT_SAMPLING_OPTION, RUNTIME_OPTION, Option, Sampling, read_options
from nanospec.decoding.run import prefill, start
from nanospec.decoding.tree_step import RULES, tree_runtime, tree_step
from nanospec.decoding.trees import TREES, fill_tree, parse_tree  # noqa: F401 (TREES: the presets, read by the course)
from nanospec.tokenizer import render
from nanospec.tree import depths, format_tree, tree_from_paths

NEEDS = ()  # the MTP heads are part of the target
USES = ("heads",)  # heads.pt, the heads retrained alone, replaces the jointly trained ones when present
OPTIONS = {
    "tree": Option(str, "default", "medusa's candidate tree: a preset (default, large, chain, wide) or paths like "
                                   "'0;0,0;1' where '0,1' = head 1's top-1 then head 2's top-2"),
    "verify": Option(str, "point-mass", "medusa's acceptance rule: point-mass (lossless: the tree rule that fits "
                                        "--draft-sampling; greedy match at temperature 0) or typical (Medusa's "
                                        "typical acceptance of the top-k guesses, whatever --draft-sampling says: "
                                        "LOSSY when sampling)", choices=RULES),
    "show_tree": Option(bool, False, "print medusa's candidate tree for the first two steps, accepted path marked *"),
    **DRAFT_SAMPLING_OPTION, **RUNTIME_OPTION,
}


def print_tree(step, tokens, parents, paths, path, emitted, tokenizer, drawn=False):
    """What the heads proposed and what the target kept, for a student to read."""
    nodes, depth = tree_from_paths(paths)[1], depths(parents)  # node -> its path of ranks, as ordered in tokens
    tokens = tokens.tolist() if torch.is_tensor(tokens) else tokens  # (the static runtime leaves them on the device)

    def rank(n):  # drawn children are draws 1, 2, ... in order (on the eager path fill_tree drops those q cannot give)
        return [c for c in range(1, n + 1) if parents[c] == parents[n]].index(n) if drawn else nodes[n][-1]

    def text(t):  # -1: a drawn node top-k / top-p left q no token for (the static runtime keeps the tree's shape)
        if t < 0:
            return "(not drawn)"
        return f"'{render(tokenizer.decode_bytes([t]))}'" if tokenizer is not None else str(t)

    def label(n):
        if n == 0:
            return f"{text(tokens[0])}  (root: the target's own token)"
        return f"{text(tokens[n])}  head {depth[n]} {'draw' if drawn else 'top'}-{rank(n) + 1}"

    print(f"medusa step {step}: {len(tokens) - 1} guesses from the heads; * = kept by the target")
    print(format_tree(parents, label, marked={0, *path}))
    print(f"-> accepted {len(path)}, emitted {' '.join(map(text, emitted))} (the last is the target's own)\n")


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    o = read_options(OPTIONS, options)
    target = models.target
    paths = parse_tree(o.tree, target.config.n_future, target.config.vocab_size)
    depth = max(map(len, paths))
    run = start(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    drawn = run.sampling.draws(o.draft_sampling) and o.verify == "point-mass"  # typical judges top-k guesses
    forward, cache, runtime, budget = tree_runtime(target, o.runtime, len(paths) + 1)  # forward: the trunk's
    heads = budget is not None  # static: the verify forward runs the heads too, at every node (one graph on CUDA)

    # prefill: the main head gives the first token (the first root), the heads the first candidates
    last, out = prefill(run, forward, cache)
    hidden = out.hidden[:, -1:].clone()  # (1, 1, C) trunk state at the position that chose `last`
    head_logits = None  # (n_future, V) the heads there, when the verify forward ran them
    done = run.emit([last])
    steps, guesses, accepted = 0, 0, 0
    while not done:
        d = run.draft_room(depth)  # near the end of the budget or context, a shallower tree
        slots = cache.max_len - cache.length - 1  # cache slots left for guesses in this forward
        step_paths = [p for p in paths if len(p) <= d][:slots]
        with run.drafting():  # one drafter pass: the heads over one trunk state, then the tree from their laws
            logits = ((target.head_logits(hidden, d)[0, :, 0] if head_logits is None else head_logits[:d])
                      if d else None)  # (d, V) head i's logits at depth i
            tokens, parents, q_draft = fill_tree(last, logits, step_paths, run.sampling, drawn, run.generator,
                                                 on_device=budget is not None)  # static: tokens stay there
        emitted, path, out = tree_step(run, forward, cache, tokens, parents, o.verify, heads, q_draft, budget)
        steps, guesses, accepted = steps + 1, guesses + len(tokens) - 1, accepted + len(path)
        if o.show_tree and steps <= 2:
            print_tree(steps, tokens, parents, step_paths, path, emitted, models.tokenizer, drawn)
        done = run.emit(emitted)
        last = emitted[-1]
        node = path[-1] if path else 0  # the last accepted node: its main head chose `last`
        hidden = out.hidden[:, node:node + 1].clone()  # a static forward's output is rewritten by the next
        head_logits = out.head_logits[0, :, node].clone() if heads else None
    return run.out, run.stats(tree_nodes=guesses / max(1, steps), accepted=accepted,
                              accepted_per_tree=accepted / max(1, steps), runtime=runtime)
