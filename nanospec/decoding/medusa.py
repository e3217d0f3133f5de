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
The default tree was measured on the trained model (scripts/medusa_tree.py), see DEFAULT_TREE.

Papers: Cai et al. 2024, Medusa, arXiv 2401.10774; Stern et al. 2018, Blockwise Parallel Decoding,
arXiv 1811.03115; Gloeckle et al. 2024, Multi-token Prediction, arXiv 2404.19737.
"""
import torch

from nanospec.decoding.common import DRAFT_SAMPLING_OPTIONS, check_sampling, samples_drafts, start, tensor
from nanospec.decoding.tree_step import RULES, fill_tree, tree_step
from nanospec.tokenizer import render
from nanospec.tree import depths, format_tree, tree_from_paths
from nanospec.verify import sample, warp

# Measured by `python scripts/medusa_tree.py` on the 4x192 `make train` model of before 2026-11-23, with its retrained
# heads (heads.pt): it counts, over greedy continuations of 64 validation prompts, how often each path of head ranks
# is fully right (a greedy step accepts exactly the right nodes), then times medusa with the best tree of 4 to 24
# paths against `ar` on 15 other prompts. Tokens per forward predicted by walking the continuations as decoding does:
# 2.26 with these 4 paths, 2.76 with the best 16 ("large"); timed: 2.10 at 0.76x ar, against 2.47 at 0.64x for "large"
# (prefill included). On a CPU a forward's cost grows with its tokens (17 cost 2-3x one), so the small tree is faster;
# where a forward over 17 tokens costs about what one over 1 does (a GPU, a larger model), "large" should be the
# faster. On the thin 8x64 target, 8-24 paths timed 0.06-0.11x faster than these 4 (README).
DEFAULT_TREE = [(0,), (1,), (0, 0), (0, 0, 0)]
TREES = {
    "default": DEFAULT_TREE,
    "large": [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1),
              (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)],  # the best 16 paths, same measurement
    "chain": [(0,) * d for d in range(1, 9)],  # the top-1 chain: what `mtp` verifies, as a tree
    "wide": [(r,) for r in range(10)],  # head 1's top-10 only: ten guesses for one token
}

NEEDS = ()  # the MTP heads are part of the target
USES = ("heads",)  # heads.pt, the heads retrained alone, replaces the jointly trained ones when present
OPTIONS = {
    "tree": (str, "default", "medusa's candidate tree: a preset (default, large, chain, wide) or paths like '0;0,0;1' "
                             "where '0,1' = head 1's top-1 then head 2's top-2"),
    "verify": (str, "point-mass", "medusa's acceptance rule: point-mass (lossless: the tree rule that fits "
                                  "--draft-sampling; greedy match at temperature 0) or typical (Medusa's typical "
                                  "acceptance of the top-k guesses, whatever --draft-sampling says: LOSSY when sampling)"),
    "show_tree": (bool, False, "print medusa's candidate tree for the first two steps, accepted path marked *"),
    **DRAFT_SAMPLING_OPTIONS,
}
MAX_PATHS, MAX_RANK = 256, 63  # a tree is verified in one forward: more nodes cost more than they can accept


def parse_tree(tree, n_future, vocab_size):
    """A preset name or "0;0,0;1" -> paths sorted by depth (so any prefix of the list is still a tree)."""
    if tree in TREES:  # presets reach as deep as the model's heads allow
        paths = [p for p in TREES[tree] if len(p) <= n_future]
    else:
        try:
            paths = [tuple(int(r) for r in p.split(",")) for p in tree.split(";") if p.strip()]
        except ValueError:
            raise ValueError(f"tree {tree!r} is neither a preset ({', '.join(TREES)}) nor paths like '0;0,0;1'")
    if not paths:
        raise ValueError("the tree needs at least one path, e.g. '0' (head 1's top-1)")
    if max(map(len, paths)) > n_future:
        raise ValueError(f"tree {tree!r} is deeper than the model's {n_future} MTP heads")
    if max(max(p) for p in paths) >= vocab_size:
        raise ValueError(f"tree {tree!r} asks for a rank beyond the vocabulary ({vocab_size} tokens)")
    if len(paths) > MAX_PATHS or max(max(p) for p in paths) > MAX_RANK:
        raise ValueError(f"tree {tree!r} is too large: at most {MAX_PATHS} paths with ranks up to {MAX_RANK}")
    return tree_from_paths(paths)[1][1:]


def print_tree(step, tokens, parents, paths, path, emitted, tokenizer, sampled=False):
    """What the heads proposed and what the target kept, for a student to read."""
    nodes, depth = tree_from_paths(paths)[1], depths(parents)  # node -> its path of ranks, as ordered in tokens

    def rank(n):  # drawn children are draws 1, 2, ... in order (fill_tree drops those q cannot give)
        return [c for c in range(1, n + 1) if parents[c] == parents[n]].index(n) if sampled else nodes[n][-1]

    def text(t):
        return f"'{render(tokenizer.decode_bytes([t]))}'" if tokenizer is not None else str(t)

    def label(n):
        if n == 0:
            return f"{text(tokens[0])}  (root: the target's own token)"
        return f"{text(tokens[n])}  head {depth[n]} {'draw' if sampled else 'top'}-{rank(n) + 1}"

    print(f"medusa step {step}: {len(tokens) - 1} guesses from the heads; * = kept by the target")
    print(format_tree(parents, label, marked={0, *path}))
    print(f"-> accepted {len(path)}, emitted {' '.join(map(text, emitted))} (the last is the target's own)\n")


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None,
             tree="default", verify="point-mass", show_tree=False, draft_sampling="sample"):
    check_sampling(temperature, top_k, top_p)
    if verify not in RULES:
        raise ValueError(f"verify must be one of {', '.join(RULES)}, got {verify!r}")
    sampled = samples_drafts(draft_sampling, temperature) and verify == "point-mass"  # typical judges top-k guesses
    target = models.target
    paths = parse_tree(tree, target.config.n_future, target.config.vocab_size)
    depth = max(map(len, paths))
    run = start(models, prompt_ids, max_new_tokens, seed)
    sampling = (temperature, top_k, top_p)
    cache = target.new_cache()

    # prefill: the main head gives the first token (the first root), the heads the first candidates
    out = target(tensor(run.prompt, cache.k.device), cache=cache)
    last = int(sample(warp(out.logits[0, -1], *sampling), run.generator))
    hidden = out.hidden[:, -1:]  # (1, 1, C) trunk state at the position that chose `last`
    done = run.emit([last])
    steps, guesses, accepted = 0, 0, 0
    while not done:
        d = run.draft_room(depth)  # near the end of the budget or context, a shallower tree
        slots = cache.max_len - cache.length - 1  # cache slots left for guesses in this forward
        step_paths = [p for p in paths if len(p) <= d][:slots]
        logits = target.head_logits(hidden, d)[0, :, 0] if d else None  # (d, V) head i's logits for depth i
        tokens, parents, q_draft = fill_tree(last, logits, step_paths, sampling, sampled, run.generator)
        emitted, path, out = tree_step(run, target, cache, tokens, parents, sampling, verify, q_draft=q_draft)
        steps, guesses, accepted = steps + 1, guesses + len(tokens) - 1, accepted + len(path)
        if show_tree and steps <= 2:
            print_tree(steps, tokens, parents, step_paths, path, emitted, models.tokenizer, sampled)
        done = run.emit(emitted)
        last = emitted[-1]
        node = path[-1] if path else 0  # the last accepted node: its main head chose `last`
        hidden = out.hidden[:, node:node + 1]
    return run.out, run.stats(tree_nodes=guesses / max(1, steps), accepted=accepted,
                              accepted_per_tree=accepted / max(1, steps))
