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
there are fewer prompts than B they repeat. Each B gets a short untimed warm-up per method. The forwards run on
the models as given (the bench's --runtime). Results go to the report and to bench_results.json's "batch".
A method that fails at a batch size is a FAILED cell with its reason (n/a speedups where `ar` failed), and the
others go on; Ctrl-C keeps the batch sizes that finished, in a table marked partial.
"""
import statistics

import torch

from nanospec.bench import report  # the conditions' lines (machine, model) are the main report's own
from nanospec.bench.report import one_line
from nanospec.decoding.batched import BATCHED, generate
from nanospec.bench.timing import fastest, timed
from nanospec.fast.runtime import prepare


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
    the fastest of `reps` runs of each (timing.fastest)."""
    device = target.wte.weight.device
    prefix = min(prefix, target.config.block_size - k - 1)  # a short context holds fewer
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (B, prefix + k + 1), generator=gen, device=device)
    cache = target.new_cache(batch_size=B, max_len=prefix + k + 1)
    target(ids[:, :prefix], cache=cache)

    def forward(T):  # over every slot, as a batch's rows are (out of step, they only make their slots apart)
        cache.rollback(prefix)  # every timed forward rewrites the same slots
        target(ids[:, prefix:prefix + T], cache=cache)

    one, many = fastest([lambda T=T: forward(T) for T in (1, k + 1)], reps)
    return one, many / one


def measure(models, methods, prompts, sizes, temperatures, max_new_tokens, repeats, seed, log, got, costs):
    """Fills got[(t, method, B)] = dict(tokens_per_s, tokens_per_forward, equal), or dict(failed=its reason), and
    costs[B] = verify_cost(...), in place: a Ctrl-C keeps the batch sizes that finished. Returns those sizes."""
    done = []
    for B in sizes:
        batch = mixed(prompts, B)
        try:
            costs[B] = verify_cost(models.target, B, 4)
        except Exception as e:  # noqa: BLE001 - the table stands without it
            costs[B] = one_line(e)
        for t in temperatures:
            seconds, runs = {m: [] for m in methods}, {}
            for m in methods:
                try:  # warm-up: allocations of this shape, untimed
                    generate(models, batch, min(8, max_new_tokens), method=m, temperature=t, seed=seed)
                except Exception as e:  # noqa: BLE001 - one broken method must not sink the table
                    got[t, m, B] = dict(failed=one_line(e))
            live = [m for m in methods if (t, m, B) not in got]
            for r in range(repeats):
                for m in live[r % max(1, len(live)):] + live[:r % max(1, len(live))]:  # the order rotated
                    if (t, m, B) in got:
                        continue
                    try:
                        runs[m], s = timed(generate, models, batch, max_new_tokens, method=m, temperature=t, seed=seed)
                    except Exception as e:  # noqa: BLE001
                        got[t, m, B] = dict(failed=one_line(e))
                        log(f"FAILED {m} at batch size {B}, temperature {t:g}: {got[t, m, B]['failed']}")
                        continue
                    seconds[m].append(s)
            ar = runs.get("ar") if (t, "ar", B) not in got else None
            for m, (outs, stats) in runs.items():
                if (t, m, B) in got:
                    continue
                got[t, m, B] = dict(tokens_per_s=stats["new_tokens"] / statistics.median(seconds[m]),
                                    tokens_per_forward=stats["tokens_per_forward"],
                                    equal=sum(a == b for a, b in zip(outs, ar[0])) if t == 0 and ar else None)
            log(f"batch size {B}, temperature {t:g}: done")
        done.append(B)
    return done


def setting(t):
    return "greedy" if t == 0 else f"t={t:g}"


def speedup(got, t, m, B):
    """tokens/s over batched ar's at the same B and t, or None where either failed."""
    g, ar = got[t, m, B], got[t, "ar", B]
    return None if "failed" in g or "failed" in ar else g["tokens_per_s"] / ar["tokens_per_s"]


def table_rows(got, costs, methods, sizes, temperatures):
    """The report's rows: B, setting, then per method tokens/s (speedup, tok/fwd, = ar), then the verify cost."""
    rows = []
    for B in sizes:
        for t in temperatures:
            cells = [B, setting(t)]
            for m in methods:
                g = got[t, m, B]
                if "failed" in g:
                    cells.append(f"FAILED: {g['failed'][:60]}")
                    continue
                x = speedup(got, t, m, B)
                equal = f", {g['equal']}/{B} = ar" if g["equal"] is not None and m != "ar" else ""
                cells.append(f"{g['tokens_per_s']:.0f} ({'n/a' if x is None else f'{x:.2f}x'}, "
                             f"{g['tokens_per_forward']:.2f} tok/fwd{equal})")
            cost = costs[B]
            rows.append(cells + [cost if isinstance(cost, str) else f"{cost[0] * 1e3:.2f} ms, {cost[1]:.2f}"])
    return rows


def results(got, methods, sizes, temperatures):
    """bench_results.json's "batch": {setting: {method: {B: [tokens/s, speedup over batched ar]}}}, where both
    ran."""
    return {setting(t): {m: {str(B): [got[t, m, B]["tokens_per_s"], speedup(got, t, m, B)] for B in sizes
                             if speedup(got, t, m, B) is not None}
                         for m in methods} for t in temperatures}


def crossover(got, methods, sizes, temperatures):
    """Lines saying, per method and setting, the first B where it falls below batched ar (or that it never does)."""
    lines = []
    for t in temperatures:
        for m in methods[1:]:
            measured = [B for B in sizes if speedup(got, t, m, B) is not None]  # where it and ar both ran
            below = [B for B in measured if speedup(got, t, m, B) < 1]
            lines.append(f"- {m}, {setting(t)}: " + (f"below batched ar from B = {below[0]}" if below else
                                                      f"at or above batched ar up to B = {measured[-1]}" if measured
                                                      else "no speedup measured (see the FAILED cells)"))
    return lines


def run(args, setup, log):
    """Measure and write up the batch table. Returns (Markdown text, bench_results.json's "batch", its title, why
    it is partial or None); the text is None if Ctrl-C came before the first batch size finished."""
    sizes, temperatures = parse_sizes(args.batch_sizes), setup["temperatures"]
    models, path = prepare(setup["models"], args.runtime)  # eager, or static (replayed) forwards
    methods = [m for m in BATCHED if m in setup["names"]]  # ar always; the others where their parts loaded
    got, costs, partial = {}, {}, None
    try:
        done = measure(models, methods, setup["prompts"], sizes, temperatures, args.max_new_tokens, args.repeats,
                       args.seed, log, got, costs)
    except KeyboardInterrupt:
        done = [B for B in sizes if all((t, m, B) in got for t in temperatures for m in methods)]
        partial = f"interrupted (Ctrl-C); the table holds the batch sizes that finished ({len(done)} of {len(sizes)})"
        if not done:
            return None, None, None, partial
    machine = f"{report.machine()}; device {report.device_name(setup['device'])}; torch {torch.__version__}"
    header = ["B", "setting"] + [f"{m}: tokens/s (speedup, tok/fwd)" for m in methods] + ["verify cost: B x 1, ratio"]
    text = "\n".join([
        f"# nanospec bench: batched decoding{' (partial)' if partial else ''}", "",
        *([f"- PARTIAL: {partial}"] if partial else []),
        f"- machine: {machine}", f"- model: {args.ckpt}/: target {report.describe(models.target)}; {args.dtype}",
        f"- prompts: {args.prompts}, batches mixed across categories ({len(setup['prompts'])} prompts); "
        f"{args.max_new_tokens} new tokens per row; {args.repeats} timed run(s), median; seed {args.seed}; "
        f"runtime {path}",
        "- speculative drafts k = 4 with the draft GPT, prompt-lookup copies up to 4 tokens (3-gram match); "
        "verify cost = a target forward over B x 5 new tokens / one over B x 1", "",
        report.table(header, table_rows(got, costs, methods, done, temperatures)), ""]
        + crossover(got, methods, done, temperatures))
    title = f"batched decoding, {args.max_new_tokens} new tokens per row ({machine})"
    return text + "\n", results(got, methods, done, temperatures), title, partial
