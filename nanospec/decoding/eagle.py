"""
`eagle`: a one-layer head on the target's features guesses a chain, or a tree grown by confidence; one forward
checks it. EAGLE-1's draft head (by default its layer without attention: cheaper on a CPU) with EAGLE-2's dynamic
tree (Li et al. 2024, arXiv 2401.15077 and 2406.16858).

The head (nanospec/model/drafters/eagle.py) guesses the target's next *feature* from [token ; feature] and reads it
through the target's own unembedding, so one layer drafts well. Each step:
  1. refresh: the head reads the tokens accepted since it last drafted, with the target's TRUE features (the
     default head has no attention and needs only the last; reading all keeps one path for both layers);
  2. draft: --tree chain, the default: one guess per depth (3), each drawn from the head's q after the one before
     (draft_chain; greedy: its argmax); --tree dynamic: EAGLE-2's tree (nanospec/steps/eagle_tree.py);
  3. verify: one target forward over the guesses (chain_step or tree_step: lossless); the head forgets them.

    chain, depth 2, root "(": q after "(" -> x; a head pass over x with its f̂ -> q after x -> ")";
    one target forward over ["(", x, ")"]: target argmax after "(" = x, after x = ")", after ")" = ":"
    -> emit [x, ")", ":"] from one forward.
On a CPU a tree's extra guesses cost more than they bring (docs/benchmark.md): the chain is the default.
--adaptive cost: k + 1 tokens per step, k = 0 (a plain step: the head reads the new tokens when it next drafts)."""
import torch

from nanospec.steps.adaptive import PRICED_OPTIONS, draft_length
from nanospec.steps.draft_chain import draft_chain
from nanospec.steps.eagle_tree import grow_sampled_tree, grow_tree
from nanospec.steps.options import DRAFT_SAMPLING_OPTION, Option, Sampling, read_options, verify_option
from nanospec.steps.pricing import step_costs
from nanospec.steps.run import cache_for, drafter_of, first_token, new_run, tensor
from nanospec.steps.verify_step import chain_step, judge_of, tree_step
from nanospec.model.gpt import Output

NEEDS = ("eagle",)
USES = ()  # parts used when present
DEPTH = {"chain": 3, "dynamic": 2}  # --depth's default for each --tree: the fastest measured on this CPU
OPTIONS = {  # the defaults: docs/measurements.md (eagle) says where they were measured
    "tree": Option(str, "chain", "the guesses: chain (--depth of them, one per depth: the fastest measured on a CPU) "
                                 "or dynamic (EAGLE-2's tree of --depth, --width, --total-tokens)",
                   choices=("chain", "dynamic")),
    "depth": Option(int, None, "deepest guess below the root; the head runs this many passes per step (None = "
                               f"{DEPTH['chain']} for the chain, {DEPTH['dynamic']} for the tree)", low=1, high=16),
    "width": Option(int, 4, "nodes expanded per level, children per node (EAGLE-2's top_k)", low=1, high=32),
    "total_tokens": Option(int, 8, "tree size per target forward, root included (adaptive: the most)", low=2, high=256),
    **DRAFT_SAMPLING_OPTION, **PRICED_OPTIONS,  # cost: a tree of k guesses, k + 1 tokens
    **verify_option("chain", "drawn_tree"),  # block: a chain judged whole; traversal: a drawn tree from its leaves up
}


def refresh(eagle, target, dcache, tokens, features):
    """Feed accepted tokens (m,) with the target's true features before each (m, C) to the head, appended to
    its cache; returns its Output at the last one, which drafts the token after it (logits (1, 1, V))."""
    hidden = eagle(target, tensor(tokens, dcache.device), features[None], cache=dcache, logits=False).hidden
    return Output(logits=target.unembed(hidden[:, -1:]), hidden=hidden[:, -1:])  # only the last


def grow_chain(eagle, target, dcache, head_out, k, sampling, generator):
    """--tree chain: k guesses, one per depth, each drawn from the head's warped q (draft_chain): the first from
    head_out, the head's Output at the root, each later one from a pass over the guess before it, read with the f̂
    that drew it. Returns (guesses, q_draft (1, k, V)); the head's cache is left as it was."""
    L, out = dcache.length, head_out

    def step(x):  # x (1, 1) the newest guess -> the head's logits (1, V) for the token after it
        nonlocal out  # the head's Output at the guess before: its f̂ is what the next pass reads
        out = eagle(target, x, out.hidden[:, -1:], cache=dcache)
        return out.logits[:, -1]

    guesses, q_draft = draft_chain(step, None, k, sampling, generator, first=head_out.logits[:, -1])
    dcache.rollback(L)
    return guesses[0], q_draft


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    opts = read_options(OPTIONS, options)
    target = models.target
    eagle = drafter_of(models, "eagle")
    width = min(opts.width, target.config.vocab_size)  # a node has at most V distinct children
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    chain, depth = opts.tree == "chain", opts.depth or DEPTH[opts.tree]
    drawn = run.sampling.guesses_drawn(opts.draft_sampling)
    if not run.sampling.greedy:  # the rule must judge these guesses (block: a chain; traversal: a drawn tree)
        judge_of(opts.verify, "chain" if chain else "drawn_tree" if drawn else "fixed_tree",
                 f"--tree {'dynamic' if chain else 'chain'}")
    size = depth + 1 if chain else opts.total_tokens  # the most: --adaptive cost chooses k + 1 tokens each step
    draft_policy = draft_length(opts, size - 1, costs=step_costs(models, __name__, run.sampling, opts))
    cache = cache_for(target, target.config.block_size, size)  # room for a whole tree at the context end
    dcache = cache_for(eagle, target.config.block_size, max(depth * width, size))  # and for a grown one

    # prefill: the target reads the prompt and picks the first root; the head has x_1..x_P with f_0..f_{P-1} to read
    last, out = first_token(run, target, cache, draft_policy)  # and all after it, as `ar`, if no draft pays
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
            kept = out.hidden[0, :n + 1]  # (n+1, C) the target's features at the root and the accepted guesses
        else:
            if drawn:  # q_draft (N, V): the laws the drawn children came from
                tokens, parents, q_draft = grow_sampled_tree(eagle, target, dcache, last, head_out, d, width, k + 1,
                                                             run.sampling, run.generator)
            else:  # EAGLE-2's top-k tree: its guesses are point masses
                (tokens, parents), q_draft = grow_tree(eagle, target, dcache, last, head_out, d, width, k + 1), None
            emitted, path, out = tree_step(run.sampling, run.generator, target, cache, tokens, parents, q_draft,
                                           opts.verify)
            kept = out.hidden[0, [0] + path]  # (len(path)+1, C) at the root and the accepted path
        draft_policy.update(len(tokens) - 1, path)
        run.emit(emitted, drafted=len(tokens) - 1)
        last = emitted[-1]  # the head reads the accepted nodes again, with the target's features at the node before
        unread, features = unread + emitted, features + [kept]  # each (emitted: path + last)
    return run.out, run.stats(tree_nodes=sum(run.drafted_per_step) / max(1, run.target_forwards - 1))  # per tree
