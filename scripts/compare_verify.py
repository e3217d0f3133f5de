"""
Token-wise against joint verification on the trained model: for every method that drafts from a q, the same
prompts and seeds verified with the token rule and with block verification (chains) or traversal verification
(drawn trees), at the temperatures given. Prints a Markdown table: tokens per target forward and wall-clock
speedup over `ar` in the same run, for each rule, and the gain of the joint rule. `--compare shape` sets eagle's
tree against its chain the same way (greedy too: there the two differ), `--compare depth` its chain (3 deep) against
one of 2 or 4 and against block verification.

    python scripts/compare_verify.py                         # out/, temperatures 1 and 0.7, 3 prompts per category
    python scripts/compare_verify.py --temperatures 1 --prompts-per-category 6 --repeats 3
    python scripts/compare_verify.py --temperatures 1 --prompts-per-category 6 --adaptive cost   # the default rule
    python scripts/compare_verify.py --compare shape --temperatures 0,1 --prompts-per-category 6 --repeats 3
    python scripts/compare_verify.py --compare depth --temperatures 0,1 --prompts-per-category 6 --repeats 3 \
        --adaptive cost

Greedy decoding is left out of the rules' comparison: both rules are then "accept while the guess is the argmax".
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # first, before torch loads: Ctrl-C is one line, `| head -1` a quiet end
    from nanospec.device import plain_exits  # noqa: E402
    plain_exits()
import torch  # noqa: E402

from nanospec.bench import calibration  # noqa: E402
from nanospec.bench.compare import load_prompts, timed, tokenize  # noqa: E402
from nanospec.decoding import METHODS, check_method, parts_for  # noqa: E402
from nanospec.model.load import load_models  # noqa: E402

# (row label, method, token-rule options, joint-rule options)
RULES = [
    ("speculative", "speculative", {}, {"verify": "block"}),
    ("mtp", "mtp", {}, {"verify": "block"}),
    ("early-exit", "early-exit", {}, {"verify": "block"}),
    ("parallelspec (chain)", "parallelspec", {"tree": "chain"}, {"tree": "chain", "verify": "block"}),
    ("medusa (tree)", "medusa", {"verify": "token"}, {"verify": "traversal"}),  # a drawn tree's default: traversal
    ("eagle (chain)", "eagle", {"tree": "chain"}, {"tree": "chain", "verify": "block"}),  # its default when sampling
    ("eagle (tree)", "eagle", {"tree": "dynamic", "verify": "token"}, {"tree": "dynamic", "verify": "traversal"}),
    ("parallelspec (tree)", "parallelspec", {"verify": "token"}, {"verify": "traversal"}),
]
# --compare shape: (row label, method, one shape's options, the other's)
SHAPES = [
    ("eagle", "eagle", {"tree": "dynamic"}, {"tree": "chain"}),  # the defaults: depth 2 (the tree: width 4, 8 tokens)
    ("eagle, depth 3", "eagle", {"tree": "dynamic", "depth": 3}, {"tree": "chain", "depth": 3}),
    ("eagle, depth 4", "eagle", {"tree": "dynamic", "depth": 4}, {"tree": "chain", "depth": 4}),
]
# --compare depth: eagle's default chain (3 deep, the token rule) against 2 and 4 deep and block verification
DEPTHS = [  # eagle's default chain is 3 deep (decoding/eagle.py, DEPTH)
    ("eagle, depth 2", "eagle", {"tree": "chain"}, {"tree": "chain", "depth": 2}),
    ("eagle, depth 4", "eagle", {"tree": "chain"}, {"tree": "chain", "depth": 4}),
    ("eagle, block", "eagle", {"tree": "chain"}, {"tree": "chain", "verify": "block"}),
]
PAIRS = {"verify": RULES, "shape": SHAPES, "depth": DEPTHS}


def label(options):
    """A row's options as the table shows them: {"tree": "chain", "verify": "block"} -> "tree chain, verify block"."""
    return ", ".join(f"{k} {v}" for k, v in options.items() if k != "adaptive") or "defaults"


def run(models, method, options, prompts, temperature, n, seed, repeats):
    """(new tokens, target forwards, seconds: the sum over prompts of each prompt's median) of one row."""
    tokens = forwards = seconds = 0
    for i, p in enumerate(prompts):
        times = []
        for _ in range(repeats):
            (ids, stats), s = timed(METHODS[method], models, p["ids"], n, temperature=temperature, seed=seed + i,
                                    **options)
            times.append(s)
        tokens, forwards, seconds = tokens + stats["new_tokens"], forwards + stats["target_forwards"], \
            seconds + statistics.median(times)
    return tokens, forwards, seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--ckpt", default="out")
    p.add_argument("--temperatures", default="1,0.7")
    p.add_argument("--prompts", default="data/prompts.json")
    p.add_argument("--prompts-per-category", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", default="verify", choices=list(PAIRS),
                   help="verify (default): the token rule against the joint one; shape: eagle's tree against its "
                        "chain; depth: eagle's chain (3 deep) against one of 2 or 4 and against block verification")
    p.add_argument("--adaptive", default="off", choices=["off", "cost"],
                   help="off (default): every step drafts the method's whole default; cost: each method's default "
                        "rule, priced by this machine's calibration (kept in CKPT/calibration.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = sorted({method for _, method, _, _ in PAIRS[args.compare]})
    try:
        models = load_models(args.ckpt, "cpu", parts_for(names))
        pairs = [pair for pair in PAIRS[args.compare] if not check_method(pair[1], models)]
        prompts = load_prompts(args.prompts, None, args.prompts_per_category)
        tokenize(prompts, models.tokenizer, models.target.config.block_size - args.max_new_tokens)
        temperatures = [float(t) for t in args.temperatures.split(",")]
        pairs = [(label, method, {**a, "adaptive": args.adaptive}, {**b, "adaptive": args.adaptive})
                 for label, method, a, b in pairs]
        if args.adaptive == "cost":  # the step costs each row's rule prices with: measured once, then kept
            calibration.attach(models, args.ckpt, [(method, t, options) for t in temperatures
                                                   for _, method, *both in pairs for options in both], log=print)
    except ValueError as e:
        sys.exit(f"error: {e}")
    for method in names:  # warm-up: the first calls pay for allocations
        METHODS[method](models, prompts[0]["ids"], 8, temperature=1.0, seed=0)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, seeds {args.seed}+i, 1 thread, "
          f"{args.repeats} repeat(s), fp32, CPU, --adaptive {args.adaptive}\n")
    for t in temperatures:
        ar = run(models, "ar", {}, prompts, t, args.max_new_tokens, args.seed, args.repeats)
        ar_speed = ar[0] / ar[2]
        print(f"temperature {t:g}: ar {ar_speed:.0f} tokens/s\n")
        print("| method | first | tok/fwd | speedup | second | tok/fwd | speedup | gain tok/fwd |")
        print("|---|---|--:|--:|---|--:|--:|--:|")
        for row, method, first, second in pairs:
            a = run(models, method, first, prompts, t, args.max_new_tokens, args.seed, args.repeats)
            b = run(models, method, second, prompts, t, args.max_new_tokens, args.seed, args.repeats)
            print(f"| {row} | {label(first)} | {a[0] / a[1]:.3f} | {a[0] / a[2] / ar_speed:.2f}x | {label(second)} | "
                  f"{b[0] / b[1]:.3f} | {b[0] / b[2] / ar_speed:.2f}x | {(b[0] / b[1]) / (a[0] / a[1]) - 1:+.1%} |")
        print()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # here, not at exit: a reader that closed the pipe ends it quietly (plain_exits)
