"""
`eagle`: a one-layer head on the target's features guesses a chain, or a tree grown by confidence; one forward
checks it. EAGLE-1's draft head with EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2401.15077 and 2406.16858).

The head (nanospec/model/drafters/eagle.py) guesses the target's next *feature* from [token ; feature] and reads it
through the target's own unembedding. Each step of the tree (--tree dynamic):
  1. grow: the head's top `width` tokens after the root are depth 1, scored by log q. Each of depth-1 head
     passes over the frontier (a tree mask) gives every frontier node its top `width` children, scored parent
     score + log q(child); the best `width` of them are the next frontier.
  2. rerank: keep the `total_tokens - 1` best nodes (a score only falls along a path: parents are kept too).
  3. verify: one target forward over the tree (tree_step: lossless).
  4. refresh: the head forgets its guesses and reads the accepted tokens with the target's TRUE features.

    width 2, depth 2, total_tokens 4, root "(":  q after "(": x 0.6, self 0.3 -> scores -0.51, -1.20
    children: after x: ")" 0.9, "," 0.05 -> -0.62, -3.51;  after self: ")" 0.5, "," 0.4 -> -1.89, -2.12
    best 3: x -0.51, ")"|x -0.62, self -1.20 -> tokens ["(", x, self, ")"], parents [-1, 0, 0, 1]
    target argmax after "(" = x, after x = ")", after ")" = ":"  ->  emit [x, ")", ":"] from one forward.
Sampling (--draft-sampling sample, the default), the head DRAWS its guesses from its warped q, verified against q
(verify_tree_without_replacement, or leaves up: --verify traversal); grow_sampled_tree fixes the tree's shape first.
--tree chain, the default: one guess per depth, each drawn from the head's q after the one before (draft_chain):
    root "(": q after "(" -> x; a head pass over x with its f̂ -> q after x -> ")"; one target forward over
    ["(", x, ")"] judges them as a chain (chain_step). On a CPU a tree's extra guesses cost more than they bring
    (docs/benchmark.md); --tree dynamic grows the tree.
--adaptive cost: k + 1 tokens per step, k = 0 (a plain step: the head reads the new tokens when it next drafts)."""
import torch

from nanospec.steps.adaptive import PRICED_OPTIONS, draft_length
from nanospec.steps.draft_chain import draft_chain
from nanospec.steps.options import DRAFT_SAMPLING_OPTION, Option, Sampling, read_options, verify_option
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import cache_for, drafter_of, first_token, new_run, tensor
from nanospec.steps.tree_guesses import DrawnTree
from nanospec.steps.verify_step import chain_step, judge_of, tree_step
from nanospec.model.gpt import Output
from nanospec.rules.tree import draw_rank_paths, frontier_mask, rooted
from nanospec.rules.verify import warp

NEEDS = ("eagle",)
USES = ()  # parts used when present
OPTIONS = {  # the defaults, and ACCEPT_GUESS below: docs/measurements.md (eagle) says where they were measured
    "tree": Option(str, "chain", "the guesses: chain (--depth of them, one per depth: the fastest measured on a CPU) "
                                 "or dynamic (EAGLE-2's tree of --depth, --width, --total-tokens)",
                   choices=("chain", "dynamic")),
    "depth": Option(int, 2, "deepest guess below the root; the head runs this many passes per step", low=1, high=16),
    "width": Option(int, 4, "nodes expanded per level, children per node (EAGLE-2's top_k)", low=1, high=32),
    "total_tokens": Option(int, 8, "tree size per target forward, root included (adaptive: the most)", low=2, high=256),
    **DRAFT_SAMPLING_OPTION, **PRICED_OPTIONS,  # cost: a tree of k guesses, k + 1 tokens
    **verify_option("chain", "drawn_tree"),  # block: a chain judged whole; traversal: a drawn tree from its leaves up
}
ACCEPT_GUESS = 0.75  # shapes the drawn tree: the chance a draw is accepted, about sum(min(p, q)) of a trained head


def refresh(eagle, target, dcache, tokens, features):
    """Feed accepted tokens (m,) with the target's true features before each (m, C) to the head, appended to
    its cache; returns its Output at the last one, which drafts the token after it (logits (1, 1, V))."""
    hidden = eagle(target, tensor(tokens, dcache.device), features[None], cache=dcache, logits=False).hidden
    return Output(logits=target.unembed(hidden[:, -1:]), hidden=hidden[:, -1:])  # only the last


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


def grow_chain(eagle, target, dcache, head_out, k, sampling, generator):
    """--tree chain: k guesses, one per depth, each drawn from the head's warped q (draft_chain): the first from
    head_out, the head's Output at the root, each later one from a pass over the guess before it, read with the f̂
    that drew it. Returns (guesses, q_draft (1, k, V)); the head's cache is left as it was."""
    L, at = dcache.length, [head_out]

    def step(x):  # x (1, 1) the newest guess -> the head's logits (1, V) for the token after it
        at[0] = eagle(target, x, at[0].hidden[:, -1:], cache=dcache)
        return at[0].logits[:, -1]

    guesses, q_draft = draft_chain(step, None, k, sampling, generator, first=head_out.logits[:, -1])
    dcache.rollback(L)
    return guesses[0], q_draft


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


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    eagle = drafter_of(models, "eagle")
    width = min(opts.width, target.config.vocab_size)  # a node has at most V distinct children
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    chain, depth = opts.tree == "chain", opts.depth
    drawn = run.sampling.guesses_drawn(opts.draft_sampling)
    if not run.sampling.greedy:  # the rule must judge these guesses (block: a chain; traversal: a drawn tree)
        judge_of(opts.verify, "chain" if chain else "drawn_tree" if drawn else "fixed_tree",
                 f"--tree {'dynamic' if chain else 'chain'}")
    size = depth + 1 if chain else opts.total_tokens  # the most: --adaptive cost chooses k + 1 tokens each step
    draft_policy = draft_length(opts, size - 1, costs=step_costs(models, __name__, run.sampling, opts))
    cache = cache_for(target, target.config.block_size, size)  # room for a whole tree at the context end
    dcache = cache_for(eagle, target.config.block_size, max(depth * width, size))  # and for a grown one

    # prefill: the target reads the prompt and picks the first root; the head has x_1..x_P with f_0..f_{P-1} to read
    last, out = first_token(run, target, cache)
    unread, features, head_out = run.prompt[1:] + [last], [out.hidden[0]], None  # unread, and f before each
    while not run.done:
        k = draft_policy.k  # guesses, k + 1 tokens, as deep as the budget, context and k allow: d
        if k:  # the head reads what it has not (a plain step leaves it to the next draft): its Output at the root
            head_out, unread, features = refresh(eagle, target, dcache, unread, torch.cat(features)), [], []
        d = run.draft_room(min(depth, k))
        if chain:  # a chain of d guesses; top-k ones (drawn greedy) are point masses
            guesses, q_draft = grow_chain(eagle, target, dcache, head_out, d, run.sampling if drawn else Sampling(),
                                          run.generator) if d else ([], None)
            [emitted], [n], out = chain_step(run.sampling, run.generator, target, cache, [last], [guesses],
                                             q_draft if drawn else None, opts.verify)
            tokens, path = [last] + guesses, list(range(1, n + 1))  # as a tree: the root, then the chain
        else:
            if drawn:  # q_draft (N, V): the laws the drawn children came from
                tokens, parents, q_draft = grow_sampled_tree(eagle, target, dcache, last, head_out, d, width, k + 1,
                                                             run.sampling, run.generator)
            else:  # EAGLE-2's top-k tree: its guesses are point masses
                (tokens, parents), q_draft = grow_tree(eagle, target, dcache, last, head_out, d, width, k + 1), None
            emitted, path, out = tree_step(run.sampling, run.generator, target, cache, tokens, parents, q_draft,
                                           opts.verify)
        draft_policy.update(len(tokens) - 1, path)
        run.emit(emitted, drafted=len(tokens) - 1)
        last = emitted[-1]  # the head reads the accepted nodes again, with the target's features at the node before
        unread, features = unread + emitted, features + [out.hidden[0, [0] + path]]  # each (emitted: path + last)
    return run.out, run.stats(tree_nodes=sum(run.drafted_per_step) / max(1, run.target_forwards - 1))  # per tree
