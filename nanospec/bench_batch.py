"""
The bench's batch table: `python -m nanospec.bench --batch-sizes 1,2,4,8,16,32` (`make bench-batch`).

Batched decoding (nanospec/decoding/batched.py) of B prompts at once, for each B: `ar`, `speculative` and
`prompt-lookup`, greedy and at temperature 1. A target forward over B rows costs little more than over one while
the model is bound by its weights and the launch overhead, so batching alone multiplies throughput; speculation
pays for a verify forward over B x (k+1) tokens, which stops being nearly free as B grows. The table says where:

    tokens/s     every row's new tokens over the batch's wall-clock seconds (median of --repeats runs)
    speedup      tokens/s over batched `ar`'s at the same B and temperature
    tok/fwd      tokens per target forward, the mean over rows (what acceptance gives, whatever the cost)
    = ar         greedy rows equal to batched `ar`'s row, token for token
    verify cost  cost(B x (k+1)) / cost(B x 1): a target forward over k+1 new tokens per row against one over 1,
                 both on B rows with ~100 cached tokens each (the fastest of several runs)

The batch of size B is the first B prompts taken in turn from each category (a mix, not B of one kind); when
there are fewer prompts than B they repeat. Each B gets a short untimed warm-up per method. The forwards run
eager (the ragged cache is not shape-static). Results go to the report and to bench_results.json's "batch".
"""
import statistics

import torch

from nanospec import report  # the conditions' lines (machine, model) are the main report's own
from nanospec.decoding.batched import BATCHED, generate
from nanospec.probes import fastest, timed
from nanospec.ragged import RaggedCache, forward, prefill


def parse_sizes(text):
    """'1,2,4' -> [1, 2, 4]; a one-line ValueError for anything else."""
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes: {text!r} is not a list of whole numbers; give e.g. 1,2,4,8") from None
    if any(not 1 <= b <= 1024 for b in sizes):
        raise ValueError(f"--batch-sizes: each must be between 1 and 1024, got {text}")
    return sorted(set(sizes))


def mixed(prompts, B):
    """The first B prompts taken in turn from each category, repeating them when there are fewer than B."""
    by = {}
    for p in prompts:
        by.setdefault(p["category"], []).append(p)
    turns = [p for i in range(max(map(len, by.values()))) for ps in by.values() if i < len(ps) for p in [ps[i]]]
    return [turns[i % len(turns)]["ids"] for i in range(B)]


@torch.inference_mode()
def verify_cost(target, B, k, reps=5, prefix=100):
    """(seconds of one target forward over B x 1 new tokens, cost(B x (k+1)) / that), B rows of `prefix` cached:
    the fastest of `reps` runs of each (probes.fastest)."""
    device = target.wte.weight.device
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (B, prefix + k + 1), generator=gen, device=device)
    cache = RaggedCache(target, B, prefix + k + 1)
    prefill(target, cache, ids[:, :prefix].tolist())  # lengths stay at prefix: each timed forward rewrites the same slots
    one, many = fastest([lambda T=T: forward(target, cache, ids[:, prefix:prefix + T]) for T in (1, k + 1)], reps)
    return one, many / one


def measure(models, methods, prompts, sizes, temperatures, max_new_tokens, repeats, seed, log):
    """{(t, method, B): dict(tokens_per_s, tokens_per_forward, equal)} and {B: verify_cost(...)}."""
    got, costs = {}, {}
    for B in sizes:
        batch = mixed(prompts, B)
        costs[B] = verify_cost(models.target, B, 4)
        for t in temperatures:
            for m in methods:  # warm-up: allocations of this shape, untimed
                generate(models, batch, min(8, max_new_tokens), method=m, temperature=t, seed=seed)
            seconds, runs = {m: [] for m in methods}, {}
            for r in range(repeats):
                for m in methods[r % len(methods):] + methods[:r % len(methods)]:  # the order rotated from run to run
                    runs[m], s = timed(generate, models, batch, max_new_tokens, method=m, temperature=t, seed=seed)
                    seconds[m].append(s)
            for m, (outs, stats) in runs.items():
                got[t, m, B] = dict(tokens_per_s=stats["new_tokens"] / statistics.median(seconds[m]),
                                    tokens_per_forward=stats["tokens_per_forward"],
                                    equal=sum(a == b for a, b in zip(outs, runs["ar"][0])) if t == 0 else None)
            log(f"batch size {B}, temperature {t:g}: done")
    return got, costs


def setting(t):
    return "greedy" if t == 0 else f"t={t:g}"


def table_rows(got, costs, methods, sizes, temperatures):
    """The report's rows: B, setting, then per method tokens/s (speedup, tok/fwd, = ar), then the verify cost."""
    rows = []
    for B in sizes:
        for t in temperatures:
            ar = got[t, "ar", B]["tokens_per_s"]
            cells = [B, setting(t)]
            for m in methods:
                g = got[t, m, B]
                equal = f", {g['equal']}/{B} = ar" if g["equal"] is not None and m != "ar" else ""
                cells.append(f"{g['tokens_per_s']:.0f} ({g['tokens_per_s'] / ar:.2f}x, {g['tokens_per_forward']:.2f} "
                             f"tok/fwd{equal})")
            rows.append(cells + [f"{costs[B][0] * 1e3:.2f} ms, {costs[B][1]:.2f}"])
    return rows


def results(got, methods, sizes, temperatures):
    """bench_results.json's "batch": {setting: {method: {B: [tokens/s, speedup over batched ar]}}}."""
    return {setting(t): {m: {str(B): [got[t, m, B]["tokens_per_s"],
                                      got[t, m, B]["tokens_per_s"] / got[t, "ar", B]["tokens_per_s"]] for B in sizes}
                         for m in methods} for t in temperatures}


def crossover(got, methods, sizes, temperatures):
    """Lines saying, per method and setting, the first B where it falls below batched ar (or that it never does)."""
    lines = []
    for t in temperatures:
        for m in methods[1:]:
            below = [B for B in sizes if got[t, m, B]["tokens_per_s"] < got[t, "ar", B]["tokens_per_s"]]
            lines.append(f"- {m}, {setting(t)}: " + (f"below batched ar from B = {below[0]}" if below else
                                                      f"at or above batched ar up to B = {sizes[-1]}"))
    return lines


def run(args, setup, log):
    """Measure and write up the batch table. Returns (Markdown text, bench_results.json's "batch", its title)."""
    sizes, temperatures, models = parse_sizes(args.batch_sizes), setup["temperatures"], setup["models"]
    methods = [m for m in BATCHED if m in setup["names"]]  # ar always; the others where their parts loaded
    got, costs = measure(models, methods, setup["prompts"], sizes, temperatures, args.max_new_tokens, args.repeats,
                         args.seed, log)
    machine = f"{report.machine()}; device {report.device_name(setup['device'])}; torch {torch.__version__}"
    header = ["B", "setting"] + [f"{m}: tokens/s (speedup, tok/fwd)" for m in methods] + ["verify cost: B x 1, ratio"]
    text = "\n".join([
        "# nanospec bench: batched decoding", "",
        f"- machine: {machine}", f"- model: {args.ckpt}/: target {report.describe(models.target)}; {args.dtype}",
        f"- prompts: {args.prompts}, batches mixed across categories ({len(setup['prompts'])} prompts); "
        f"{args.max_new_tokens} new tokens per row; {args.repeats} timed run(s), median; seed {args.seed}; eager",
        "- speculative drafts k = 4 with the draft GPT, prompt-lookup copies up to 4 tokens (3-gram match); "
        "verify cost = a target forward over B x 5 new tokens / one over B x 1", "",
        report.table(header, table_rows(got, costs, methods, sizes, temperatures)), ""]
        + crossover(got, methods, sizes, temperatures))
    title = f"batched decoding, {args.max_new_tokens} new tokens per row ({machine})"
    return text + "\n", results(got, methods, sizes, temperatures), title
