"""
How often can a guess of token t+2 be accepted at temperature 1 when its drafter cannot see token t+1, the token
sampled just before it? That is the MTP heads' case (`mtp`, `medusa`): head 1 reads the trunk's state at t, and
token t+1 is drawn only afterwards. For contexts from the validation split, with the target itself:

    p1(x)      the target's law of token t+1;  p2(v | x) its law of token t+2 after x (one forward for each of
               the `top` likeliest x, which cover ~95% of p1's mass at t=1 here; p1 is renormalised over them)
    A(q)       the chance that a guess drawn from q is accepted by the chain rule, min(1, p2(v|x) / q(v)), with x
               drawn from p1 first: A(q) = sum_x p1(x) sum_v min(p2(v | x), q(v))

and prints A for three q: the MTP head's own (what `mtp` drafts from), the exact marginal sum_x p1(x) p2(. | x)
(what a head that learnt the target's two-step law perfectly would give), and the best q of all (`best_blind`:
A is concave in q, and its maximum over the simplex is found exactly). No head blind to x can beat the last.

    python scripts/head_bound.py                        # out/, 150 contexts of 100 tokens, the 192 likeliest x
    python scripts/head_bound.py --contexts 40 --top 64 # a quicker, rougher look
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # first, before torch loads: Ctrl-C is one line, `| head -1` a quiet end
    from nanospec.device import plain_exits  # noqa: E402
    plain_exits()
import numpy as np  # noqa: E402
import torch  # noqa: E402


def acceptance(p2, w, q):
    """A(q) = sum_x w(x) sum_v min(p2(v | x), q(v)): p2 (M, V) rows = the law of t+2 after each x, w (M,) the
    chance of each x (summing to 1), q (V,) the drafter's law. [[1, 0], [0, 1]], w [0.5, 0.5], q [0.5, 0.5] -> 0.5."""
    return float((w[:, None] * torch.minimum(p2, q[None])).sum())


def best_blind(p2, w):
    """max over every law q of A(q), and a q that reaches it: p2 (M, V), w (M,) -> (A*, q* (V,)).
    A(q) = sum_v f_v(q(v)), each f_v(c) = sum_x w(x) min(p2(v | x), c) concave and piecewise linear in c: between
    two consecutive values of p2(v | .) its slope is the weight of the rows still above c. So fill q's unit of
    mass into the steepest pieces first, across all v (water-filling: the slopes fall along each v, so taking
    the steepest pieces is taking each v's pieces in order). Example: rows [0.9, 0.1] and [0.1, 0.9], w [0.5,
    0.5]: the pieces (0, 0.1] of both v have slope 1, (0.1, 0.9] slope 0.5 -> q = [0.5, 0.5] (or any q between
    [0.9, 0.1] and [0.1, 0.9]), A* = 0.2 + 0.8 * 0.5 = 0.6."""
    values, order = p2.sort(0)  # (M, V) each v's values of p2 ascending; the rows in that order
    slope = w[order].flip(0).cumsum(0).flip(0)  # (M, V) piece j, up to values[j]: the weight of rows j..M-1
    start = torch.cat([values.new_zeros(1, values.size(1)), values[:-1]], 0)  # (M, V) where piece j starts
    length, slope = (values - start).flatten(), slope.flatten()  # (M*V,)
    steepest = slope.argsort(descending=True)
    before = length[steepest].cumsum(0) - length[steepest]  # mass spent before each piece
    take = (1.0 - before).clamp(min=0).minimum(length[steepest])  # (M*V,) what each piece gets of the unit
    q = torch.zeros_like(length).index_add_(0, steepest, take).view_as(values).sum(0)  # (V,) q* = sum of its pieces
    return float((take * slope[steepest]).sum()), q


@torch.inference_mode()
def bound(target, tokens, contexts, length, top, seed=0):
    """A(head 1), A(marginal), A* (each a list over the contexts) and the share of p1's mass the `top` likeliest x
    cover, for `contexts` windows of `length` tokens drawn from `tokens` (a 1-D array) with `seed`."""
    rng = np.random.default_rng(seed)
    out = {"head": [], "marginal": [], "best": [], "covered": []}
    for _ in range(contexts):
        start = int(rng.integers(0, len(tokens) - length))
        context = torch.tensor(np.asarray(tokens[start:start + length], dtype=np.int64))[None]  # (1, T)
        first = target(context)
        p1 = torch.softmax(first.logits[0, -1].double(), -1)  # (V,) t = 1: the softmax itself
        q = torch.softmax(target.head_logits(first.hidden[:, -1:], 1)[0, 0, 0].double(), -1)  # (V,) head 1's law
        likeliest = p1.topk(min(top, p1.numel()))
        w = likeliest.values / likeliest.values.sum()  # (M,)
        after = torch.cat([context.expand(w.numel(), -1), likeliest.indices[:, None]], 1)  # (M, T+1)
        p2 = torch.softmax(target(after).logits[:, -1].double(), -1)  # (M, V) the law of t+2 after each x
        out["head"].append(acceptance(p2, w, q))
        out["marginal"].append(acceptance(p2, w, (w[:, None] * p2).sum(0)))
        out["best"].append(best_blind(p2, w)[0])
        out["covered"].append(float(likeliest.values.sum()))
    return out


def main():
    parser = argparse.ArgumentParser(description="The chance a guess of token t+2 blind to token t+1 is accepted at "
                                                 "temperature 1: the MTP head's, the marginal's, the best possible.")
    parser.add_argument("--ckpt", default="out", help="folder with target.pt (and heads.pt), tokenizer and val.bin")
    parser.add_argument("--contexts", type=int, default=150, help="windows of the validation split (default 150)")
    parser.add_argument("--length", type=int, default=100, help="tokens per window (default 100, as the prompts)")
    parser.add_argument("--top", type=int, default=192, help="the likeliest tokens t+1 followed (default 192)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = parser.parse_args()
    for name in ("contexts", "length", "top"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name} must be at least 1")
    from nanospec.model.checkpoint import CheckpointError
    from nanospec.model.load import load_models
    torch.set_num_threads(args.threads)
    path = os.path.join(args.ckpt, "val.bin")
    try:
        models = load_models(args.ckpt)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"{e}" if isinstance(e, CheckpointError) else f"{path}: {e}; `make train` writes it")
    config = models.target.config
    if config.n_future == 0:
        sys.exit(f"the target in {args.ckpt} has no MTP heads: nothing to measure")
    if args.length + 1 > config.block_size or len(tokens) <= args.length:
        sys.exit(f"--length {args.length} must leave room for one more token in the target's context of "
                 f"{config.block_size} and fit in {path} ({len(tokens)} tokens)")
    out = bound(models.target, tokens, args.contexts, args.length, args.top, args.seed)
    heads = "heads.pt (retrained alone)" if models.tuned_heads else "the jointly trained heads"
    print(f"{args.contexts} windows of {args.length} tokens from {path}; the {args.top} likeliest tokens t+1 cover "
          f"{np.mean(out['covered']):.1%} of p1; head 1 of {heads}")
    for name, what in (("head", "MTP head 1's law"), ("marginal", "the marginal sum_x p1(x) p2(.|x)"),
                       ("best", "the best law blind to token t+1")):
        v = np.array(out[name])
        print(f"  acceptance at t=1, {what:34s} {v.mean():.3f} +- {1.96 * v.std() / np.sqrt(len(v)):.3f} (95%)")


if __name__ == "__main__":
    main()
