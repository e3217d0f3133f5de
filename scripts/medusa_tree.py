"""
Measure how well the trained model's MTP heads guess, and choose medusa's default tree from that.

What counts is agreement with what the target itself emits greedily (that is what greedy verification
accepts), not with the validation text. So: take prompts from data/val.txt, let the target continue each one
greedily (`ar`), then run ONE plain forward over prompt + continuation with the heads on. At a position t of
the continuation, head i guesses token t+1+i, and the truth is the continuation's token there: the target's
own greedy choice given everything before it. For each t we record the rank r_i of that token in head i's
logits (0 = its top-1).

  - head i's top-k agreement: P(r_i < k)
  - a tree path (a_1, .., a_d) is fully right at t when r_1 = a_1, .., r_d = a_d. A greedy tree step accepts
    exactly the right nodes (at most one per depth: a head's top-k are distinct tokens), so the expected
    number of accepted guesses per step is the sum, over the tree's paths, of how often each is right. The
    best tree of N paths is therefore the N most often right ones (every prefix of a path is right at least
    as often, so the choice is a tree). That is how Medusa chose its trees, from a calibration set.

Also printed, for reference: each head's agreement with the validation text itself (the training metric).

These expected figures average over every position; real decoding starts its steps more often just after the
heads failed and skips the easy positions inside accepted runs, so the script also walks each continuation as
greedy decoding would (`walk`), which predicts what `make bench` measures. And on a CPU a bigger tree costs more: a
forward over 17 tokens takes 2-3 times one over 1. So the script then runs `medusa` with the best tree of each
size on other validation prompts, interleaved with `ar`, and times it. The default tree is the largest one
within 5% of the fastest (timings wobble that much), not the one with the most tokens per forward.

    python scripts/medusa_tree.py                         # out/, 64 prompts x 64 tokens, trees of 4..24 paths
    python scripts/medusa_tree.py --sizes 4,16 --prompts 32
"""
import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nanospec.model.load import load_models  # noqa: E402
from nanospec.decoding import METHODS  # noqa: E402

K = 10  # ranks counted per head: a tree node never asks for more than head i's top-10


def prompts_from_val(tokenizer, path, n, prompt_len, seed_offset=0):
    """n windows of prompt_len tokens, evenly spaced through the validation split, none crossing a document."""
    ids = tokenizer.encode_corpus(Path(path).read_text(encoding="utf-8"))
    out = []
    for s in torch.linspace(0, len(ids) - prompt_len - 1, n).long().tolist():
        window = ids[s + seed_offset:s + seed_offset + prompt_len]
        if tokenizer.eot not in window and len(window) == prompt_len:
            out.append(window)
    return out


def ranks_of(head_logits, truth):
    """head_logits (n, T, V), truth (n, T) -> (n, T) rank of each true token (0 = top-1)."""
    true_logit = head_logits.gather(-1, truth[..., None])  # (n, T, 1)
    return (head_logits > true_logit).sum(-1)  # (n, T)


@torch.inference_mode()
def measure(models, prompts, new_tokens):
    target = models.target
    nf = target.config.n_future
    paths, greedy_ranks, text_ranks, main_ranks = Counter(), [], [], []
    n_positions = 0
    for prompt in prompts:
        cont = METHODS["ar"](models, prompt, new_tokens)[0]  # the target's own greedy continuation
        seq = torch.tensor([prompt + cont])  # (1, S)
        out = target(seq)
        h = target.head_logits(out.hidden)[0]  # (nf, S, V): head i at t guesses token t+1+i
        P, S = len(prompt), seq.size(1)
        # positions t whose every head's target token lies in the continuation: t >= P-1, t+1+nf < S
        ts = torch.arange(P - 1, S - 1 - nf)
        r = torch.stack([ranks_of(h[i, ts], seq[0, ts + 2 + i]) for i in range(nf)], 1)  # (n_t, nf)
        greedy_ranks.append(r)
        for row in r.tolist():
            for d in range(1, nf + 1):
                if row[d - 1] >= K:
                    break
                paths[tuple(row[:d])] += 1  # this path, and each of its prefixes, was fully right here
        n_positions += len(ts)
        # the training metric: head i at t against the validation text's token t+1+i, inside the prompt
        tf = torch.arange(0, P - 1 - nf)
        text_ranks.append(torch.stack([ranks_of(h[i, tf], seq[0, tf + 2 + i]) for i in range(nf)], 1))
        main_ranks.append(ranks_of(out.logits[0, tf], seq[0, tf + 1]))  # the main head, for comparison
    return paths, greedy_ranks, torch.cat(text_ranks), torch.cat(main_ranks), n_positions


def walk_steps(ranks, tree):
    """Greedy decoding's own steps through one continuation: ranks (n_t, n_future), position by position from
    the last prompt token; tree, a set of rank paths. Step from position t: accept the deepest fully right path
    there (n guesses), emit n + 1 tokens, go on at t + n + 1. Returns the tokens of each step.
    Example: rows [0,0,5] [..] [..] [1,3,0] [..] [4,0,0], tree {(0,), (1,), (0, 0)} -> [3, 2, 1]."""
    rows, t, steps = ranks.tolist(), 0, []
    while t < len(rows):
        n = 0
        while n < len(rows[t]) and tuple(rows[t][:n + 1]) in tree:
            n += 1
        steps.append(n + 1)
        t += n + 1
    return steps


def walk(per_prompt, tree):
    """Tokens per forward that greedy decoding with `tree` would get on these continuations. Unlike the average
    over all positions, this visits positions as decoding does: it skips the ones inside an accepted run (often
    easy ones) and starts a step at every one just after a miss."""
    steps = [n for ranks in per_prompt for n in walk_steps(ranks, tree)]
    return sum(steps) / len(steps)


def time_trees(models, best, sizes, prompts, new_tokens, repeats=3):
    """Decode each prompt with `ar` and with medusa on the best tree of each size, interleaved, after one
    warm-up run; a prompt's time is its fastest of `repeats` runs (the one least disturbed by other work).
    Returns {size or "ar": (tokens per forward, seconds)}."""
    runs = {"ar": lambda p: METHODS["ar"](models, p, new_tokens)}
    for size in sizes:
        tree = ";".join(",".join(map(str, q)) for q in best[:size])
        runs[size] = lambda p, tree=tree: METHODS["medusa"](models, p, new_tokens, tree=tree)
    totals = {key: [0, 0, 0.0] for key in runs}  # tokens, forwards, seconds
    for prompt in prompts:
        times, stats = {key: [] for key in runs}, {}
        for _ in range(repeats + 1):  # the first round warms up
            for key, run in runs.items():
                t = time.perf_counter()
                stats[key] = run(prompt)[1]  # greedy: every run of a prompt gives the same tokens
                times[key].append(time.perf_counter() - t)
        for key in runs:
            totals[key][0] += stats[key]["new_tokens"]
            totals[key][1] += stats[key]["target_forwards"]
            totals[key][2] += min(times[key][1:])
    return {key: (tok / fwd, sec) for key, (tok, fwd, sec) in totals.items()}


def show(tree):
    tree = sorted(tree, key=lambda q: (len(q), q))
    return ("[" + ", ".join("(" + ", ".join(map(str, q)) + ("," if len(q) == 1 else "") + ")" for q in tree) + "]"
            + "\n  as a --tree string: " + ";".join(",".join(map(str, q)) for q in tree))


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--ckpt", default="out", help="folder with target.pt and tokenizer.tiktoken")
    p.add_argument("--val", default="data/val.txt", help="validation text the prompts come from")
    p.add_argument("--prompts", type=int, default=64, help="number of prompts to count ranks on")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated after each prompt")
    p.add_argument("--sizes", default="4,6,8,12,16,24",
                   help="tree sizes (paths) to time, '' = none; fewer than 4 paths is a chain, which is `mtp`")
    p.add_argument("--time-prompts", type=int, default=16, help="other validation prompts to time the trees on")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    models = load_models(args.ckpt)
    print("MTP heads: " + ("from heads.pt (the heads-only phase)" if models.tuned_heads else "jointly trained"))
    prompts = prompts_from_val(models.tokenizer, args.val, args.prompts, args.prompt_len)
    paths, per_prompt, text_ranks, main_ranks, n = measure(models, prompts, args.new_tokens)
    ranks = torch.cat(per_prompt)
    print(f"{len(prompts)} prompts of {args.prompt_len} tokens from {args.val}, {args.new_tokens} greedy tokens "
          f"each: {n} positions ({time.perf_counter() - t0:.0f}s)\n")
    print("head  agrees with the target's greedy choice   | with the validation text")
    print("      top-1   top-5   top-10  (chain: top-1 of all heads so far)")
    chain = torch.ones(len(ranks), dtype=torch.bool)
    for i in range(ranks.size(1)):
        chain &= ranks[:, i] == 0
        g, t = ranks[:, i], text_ranks[:, i]
        print(f"{i + 1:4d}  {(g < 1).double().mean():.3f}   {(g < 5).double().mean():.3f}   {(g < 10).double().mean():.3f}"
              f"   ({chain.double().mean():.3f})           | top-1 {(t < 1).double().mean():.3f}, "
              f"top-5 {(t < 5).double().mean():.3f}")
    print(f"main head (token t+1) against the validation text: top-1 {(main_ranks < 1).double().mean():.3f}, "
          f"top-5 {(main_ranks < 5).double().mean():.3f}")
    mtp_tpf = 1 + (ranks == 0).long().cumprod(1).sum(1).double().mean()  # 1 + top-1 guesses right in a row
    chain = {(0,) * d for d in range(1, ranks.size(1) + 1)}
    print(f"\nmtp (top-1 chain of {ranks.size(1)}): tokens per forward {mtp_tpf:.2f} averaged over positions, "
          f"{walk(per_prompt, chain):.2f} walking as decoding does")
    best = [path for path, _ in sorted(paths.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))]
    print("\nbest trees: paths -> tokens per forward (greedy), averaged over positions | walking as decoding does")
    total = 0.0
    for j, path in enumerate(best[:64], 1):
        total += paths[path] / n
        if j in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            print(f"  {j:3d} -> {1 + total:.3f} | {walk(per_prompt, set(best[:j])):.3f}")
    print(f"\nthe best tree of 16 paths: {show(best[:16])}")
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    if not sizes:
        return
    # timing prompts: windows between the calibration ones, so no prompt is counted and timed both
    held_out = prompts_from_val(models.tokenizer, args.val, args.time_prompts, args.prompt_len,
                                seed_offset=args.prompt_len // 2 + 1)
    print(f"\ntiming medusa with each tree on {len(held_out)} other prompts ({args.new_tokens} tokens, 1 thread):")
    timed = time_trees(models, best, sizes, held_out, args.new_tokens)
    ar_seconds = timed.pop("ar")[1]
    for size, (tpf, sec) in timed.items():
        print(f"  {size:3d} paths: {tpf:.2f} tokens/forward, {ar_seconds / sec:.2f}x ar")
    # timings on a shared machine wobble by about 5%: among the trees that fast, take the one that guesses most
    quickest = min(sec for _, sec in timed.values())
    chosen = max(size for size, (_, sec) in timed.items() if sec <= 1.05 * quickest)
    print(f"\nthe largest tree within 5% of the fastest, for DEFAULT_TREE in nanospec/steps/tree_guesses.py "
          f"({chosen} paths): {show(best[:chosen])}")


if __name__ == "__main__":
    main()
