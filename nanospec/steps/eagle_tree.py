"""
EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2406.16858): `eagle --tree dynamic` grows its guesses as a tree, by the
head's confidence (nanospec/decoding/eagle.py runs it; its default is a chain). The head (nanospec/model/drafters/
eagle.py) guesses the target's next feature and reads it through the target's unembedding; each step:
  1. grow: the head's top `width` tokens after the root are depth 1, scored by log q. Each of depth-1 head
     passes over the frontier (a tree mask) gives every frontier node its top `width` children, scored parent
     score + log q(child); the best `width` of them are the next frontier.
  2. rerank: keep the `total_tokens - 1` best nodes (a score only falls along a path: parents are kept too).
  3. verify: one target forward over the tree (verify_step.tree_step: lossless).
  4. refresh: the head forgets its guesses and reads the accepted tokens with the target's TRUE features.

    width 2, depth 2, total_tokens 4, root "(":  q after "(": x 0.6, self 0.3 -> scores -0.51, -1.20
    children: after x: ")" 0.9, "," 0.05 -> -0.62, -3.51;  after self: ")" 0.5, "," 0.4 -> -1.89, -2.12
    best 3: x -0.51, ")"|x -0.62, self -1.20 -> tokens ["(", x, self, ")"], parents [-1, 0, 0, 1]
    target argmax after "(" = x, after x = ")", after ")" = ":"  ->  emit [x, ")", ":"] from one forward.
Sampling (--draft-sampling sample, the default), the head DRAWS its guesses from its warped q, verified against q
(verify_tree_without_replacement, or leaves up: --verify traversal); grow_sampled_tree fixes the tree's shape first.
  grow_tree          EAGLE-2's tree of the head's top-k (exercise 9, with `expand` and rules/tree.py's frontier_mask)
  grow_sampled_tree  the tree of drawn guesses: a shape by draw rank, filled one depth at a time (DrawnTree)
"""
import torch

from nanospec.rules.tree import draw_rank_paths, frontier_mask, rooted
from nanospec.rules.verify import warp
from nanospec.steps.run import tensor
from nanospec.steps.tree_guesses import DrawnTree

ACCEPT_GUESS = 0.75  # shapes the drawn tree: the chance a draw is accepted, about sum(min(p, q)) of a trained head
# (docs/measurements.md, eagle)


def expand(eagle, target, dcache, L, d, frontier, cand_tok, cand_parent, fed, feats):
    """One head pass over `frontier`, candidates at depth d (indices into cand_tok / cand_parent; parent -1 = the
    root), each seeing the L accepted slots, its ancestors fed at earlier passes (slots in `fed`) and itself;
    feats (1, K, C) = each one's parent's f̂. Returns the head's Output (1, K, ...)."""
    # BEGIN SOLUTION ex9
    device = dcache.device
    mask = frontier_mask(L, fed, frontier, cand_parent, device)  # (K, L + fed + K)
    pos = torch.full((len(frontier),), L + d, device=device)  # a depth-d node sits d after the root
    return eagle(target, tensor([cand_tok[c] for c in frontier], device), feats, pos=pos, cache=dcache, mask=mask)
    # END SOLUTION ex9


def grow_tree(eagle, target, dcache, root, head_out, depth, width, total_tokens):
    """EAGLE-2's tree from the head's Output `head_out` at the root's slot (hidden, logits (1, T, C / V), the last
    position counts). Returns (tokens, parents) with the root at node 0; the head's cache is left as it was."""
    # BEGIN SOLUTION ex9
    if depth < 1 or total_tokens < 2:
        return [root], [-1]
    L = dcache.length  # the head's slots end at the root, which sits at position L
    score, tok = torch.log_softmax(head_out.logits[0, -1], -1).topk(width)  # (K,) depth-1 scores and tokens
    # every candidate: its token, its parent candidate (-1 = the root), its score = sum of log q on its path
    cand_tok = tok.tolist()
    cand_parent = [-1] * width
    cand_score = score.tolist()
    frontier = list(range(width))  # candidates to expand next
    feats = head_out.hidden[:, -1:].expand(1, width, -1)  # (1, K, C) what each frontier node reads: parent's f̂
    fed = {}  # candidate -> its slot among the nodes fed to the head (after the L prefix slots)
    for d in range(1, depth):
        out = expand(eagle, target, dcache, L, d, frontier, cand_tok, cand_parent, fed, feats)
        logq = torch.log_softmax(out.logits[0], -1)  # (K, V)
        s, t = logq.topk(width, dim=-1)  # (K, K) each frontier node's best children
        s = (s + torch.tensor([cand_score[c] for c in frontier], dtype=s.dtype, device=s.device)[:, None]).flatten()
        base = len(cand_tok)
        cand_tok += t.flatten().tolist()
        cand_parent += [c for c in frontier for _ in range(width)]
        cand_score += s.tolist()
        best = s.topk(width).indices  # (K,) confidence expansion: the best width of the width^2 children
        frontier = [base + b for b in best.tolist()]
        feats = out.hidden[:, best // width]  # (1, K, C) each new frontier node reads its parent's f̂
    dcache.rollback(L)
    # rerank: the best nodes overall; ties go to the older node, so a parent always precedes its child
    keep = sorted(sorted(range(len(cand_tok)), key=lambda c: (-cand_score[c], c))[:total_tokens - 1])
    return rooted(root, cand_tok, cand_parent, keep)
    # END SOLUTION ex9


def grow_sampled_tree(eagle, target, dcache, root, head_out, depth, width, total_tokens, sampling, generator):
    """The tree of DRAWN guesses (--draft-sampling sample): a shape of total_tokens - 1 nodes by draw rank, fixed
    first (tree.draw_rank_paths), filled one depth at a time (tree_guesses.DrawnTree): the root's children from the
    head's q at the root, then one head pass over each depth's drawn nodes (grow_tree's `expand`) gives their q.
    Returns (tokens, parents, q_draft (N, V)), the head's cache as it was."""
    if depth < 1 or total_tokens < 2:
        return [root], [-1], None
    L = dcache.length  # the head's slots end at the root
    tree = DrawnTree(draw_rank_paths(total_tokens - 1, depth, width, ACCEPT_GUESS))
    level = tree.draw([-1], warp(head_out.logits[:, -1], *sampling), generator)  # the root's children
    f_hat, fed = {-1: head_out.hidden[0, -1]}, {}  # candidate -> the head's predicted feature there; as grow_tree
    for d in range(1, depth):
        if not level:
            break
        feats = torch.stack([f_hat[tree.parents[c]] for c in level])[None]  # (1, K, C) each one's parent's f̂
        out = expand(eagle, target, dcache, L, d, level, tree.tokens, tree.parents, fed, feats)
        f_hat.update(zip(level, out.hidden[0]))
        level = tree.draw(level, warp(out.logits[0], *sampling), generator)  # (K, V) their children's law
    dcache.rollback(L)
    return tree.result(root)
