"""
The Markdown report of `make bench` (nanospec/bench/compare.py measures, this module writes): the conditions (machine,
device, model, prompts, settings), a table per temperature (with each row's host reads and host ops per target
forward), the greedy-equality check, how repetitive `ar`'s output is, the cost of a target forward against the
tokens it reads, where a step's time goes, where the drafting went (guesses per step, plain steps, what a
draft-length rule chose), and Leviathan's model of `speculative` set beside the measured speedup.
Everything here reads the measurements; nothing is timed here. A row that failed is a FAILED row with its
reason; where `ar` did not finish, every speedup is n/a; a report cut short by Ctrl-C says so at the top, and a
section whose measurements are missing is left out with a line saying why.

    report.build(measured)   -> the whole report as Markdown text, from a `Measured` record
"""
import dataclasses
import datetime
import os
import platform
import re
import subprocess
from collections import Counter
from dataclasses import dataclass

import torch

from nanospec.bench.timing import REPLAY_WARMUPS
from nanospec.decoding import parts_for
from nanospec.steps.run import acceptance, tensor
from nanospec.training.presets import PRESETS


@dataclass
class Measured:
    """Everything `make bench` measured, as the report reads it (compare.measure fills it in)."""
    args: object  # the parsed command line, its settings resolved (--quick applied)
    command: str  # the flags as typed, for the header
    models: object  # nanospec.model.load.Models
    device: str
    prompts: list  # dicts id, category, text, ids
    categories: list  # in the prompt file's order
    temperatures: list
    names: list  # the methods that ran (ar first)
    rows: dict  # temperature -> {row label: (method, options, runtime path)}, see compare.table_rows
    results: dict  # temperature -> {row label: {prompt id: dict(ids, stats, seconds, timing)}}, see compare.run_all
    notes: list  # "- skipped ..." lines
    failed: dict  # row label -> one-line reason it stopped
    cost: dict  # n -> seconds of one target forward over n new tokens after a cached prefix
    prefix: int  # that prefix's length
    reps: int  # the cost runs (fastest of)
    step: dict  # (is the draft, temperature or None) -> seconds of one forward (None) or decoding step
    c: dict  # method with a trained drafter -> c from its drafting calls, or None if it made none (mtp, medusa)
    seconds: float  # of measurements
    loads: tuple  # load average before and after
    reads: dict = None  # temperature -> {row label: host reads per target forward}, from one untimed run
    ops: dict = None  # temperature -> {row label: (aten ops, kernel launches) per target forward}, the same run
    cost_path: str = "eager"  # the path `cost` and `step` ran: eager, static (replay emulated) or graph (replayed)
    cost_eager: dict = None  # comparing runtimes: `cost` on the eager path (cost_path is then static or graph)
    c_eager: dict = None  # comparing runtimes: c of each drafter from its "(eager)" rows
    partial: str = None  # why the measuring stopped early (Ctrl-C); None for a whole run


# ----------------------------------------------------------------------------- the conditions

def machine():
    """'AMD EPYC, 2 cores' from /proc/cpuinfo where there is one (Linux), else what platform knows."""
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def load_average():
    """The 1-minute load average (runnable processes), or '?' where the OS does not say."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "?"


def one_line(e):
    """An exception as one line, for a FAILED row or a note: its type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def device_name(device):
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else device


def git_commit():
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def preset_of(config):
    """The preset (nanospec/training/presets.py) whose target has this config, or 'custom'."""
    for name, preset in PRESETS.items():
        if dataclasses.replace(preset["target"], vocab_size=config.vocab_size) == config:
            return name
    return "custom"


def describe(model):
    c = model.config
    return (f"{model.num_params() / 1e6:.2f}M parameters ({c.n_layer} layer{'s' * (c.n_layer > 1)} x {c.n_embd} "
            f"wide, {c.n_head} heads, vocab {c.vocab_size}, context {c.block_size})")


# ----------------------------------------------------------------------------- what the figures are made of

def first_difference(a, b):
    """Index of the first position where the lists differ (the shorter length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(target, ids):
    """How far apart the target's two best next-token logits are after `ids` (a full forward, no cache):
    a gap near float rounding (1e-5) means a near-tie that a batched forward may break the other way."""
    logits = target(tensor(ids, target.wte.weight.device)).logits[0, -1]  # (V,)
    top = logits.topk(2).values
    return float(top[0] - top[1])


def ngram_repeats(context, out, n=4):
    """(4-grams of `out` seen earlier in `out`, seen earlier in context + out, all 4-grams of `out`).
    Empty context, out [1, 2, 3, 4, 1, 2, 3, 4, 1] -> 1234 2341 3412 4123 1234 2341 -> (2, 2, 6)."""
    seq = list(context) + list(out)
    in_out, in_seq = set(), set()  # 4-grams so far: of the output, of the whole sequence
    own = seen = total = 0
    for i in range(len(seq) - n + 1):
        g = tuple(seq[i:i + n])
        if i >= len(context):  # a 4-gram of the output
            own, seen, total = own + (g in in_out), seen + (g in in_seq), total + 1
            in_out.add(g)
        in_seq.add(g)
    return own, seen, total


def acceptance_mle(per_prompt):
    """Leviathan's per-token acceptance rate a from speculative's runs: the runs' own estimate (run.acceptance,
    accepted / judged, the maximum-likelihood a), pooled over the runs. Returns (a, tokens per step that drafted,
    the d of every step but the prefill). Example: drafted [0, 2, 0, 2, 2], guesses accepted [0, 2, 0, 0, 1] ->
    a = 3/5 (2 + 0 + 1 accepted, 2 rejections), 6/3 tokens per drafting step (the accepted ones and the target's)."""
    accepted = judged = steps = 0
    ks = []
    for stats in per_prompt:
        a, j = acceptance(stats["guesses_per_step"], stats["drafted_per_step"])
        accepted, judged = accepted + a, judged + j
        ks += stats["drafted_per_step"][1:]
        steps += sum(1 for d in stats["drafted_per_step"][1:] if d)
    return accepted / max(1, judged), (accepted + steps) / max(1, steps), ks


def expected_tokens(a, k):
    """Leviathan et al.'s expected tokens per step, k guesses each accepted with chance a: the accepted ones and the
    target's, (1 - a^(k+1)) / (1 - a); k + 1 where a = 1 (the limit). a 0.5, k 1 -> 1.5; a 0 -> 1."""
    return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def leviathan(a, k, c, verify=1.0):
    """Expected speedup: expected_tokens(a, k) per step, for k draft forwards (c each, in target forwards) and one
    target forward over k+1 tokens (`verify`; Leviathan et al. take it as 1)."""
    return expected_tokens(a, k) / (k * c + verify)


# ----------------------------------------------------------------------------- tables

def table(header, rows):
    """A Markdown table, its columns padded so that it also reads well as plain text."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    # numbers align right (Markdown: "--:"), words left
    right = [all(re.match(r"-?[0-9]", row[i]) or row[i] in ("-", "n/a") for row in cells[1:])
             and any(re.match(r"-?[0-9]", row[i]) for row in cells[1:]) for i in range(len(header))]

    def line(row):
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def totals(results, name, ids):
    """(tokens, target forwards, seconds) of one method over some prompts."""
    runs = [results[name][i] for i in ids if i in results[name]]
    return (sum(r["stats"]["new_tokens"] for r in runs), sum(r["stats"]["target_forwards"] for r in runs),
            sum(r["seconds"] for r in runs))


def complete(results, name, prompts):
    """Did row `name` finish every prompt (a timed result with its median seconds)? A row that failed did not."""
    return all("seconds" in results.get(name, {}).get(p["id"], {}) for p in prompts)


def failed_row(name, why, width, greedy):
    """A row that did not finish: FAILED and its reason (cut to a line's worth: the notes above hold it whole)."""
    why = why if len(why) <= 50 else why[:49] + "…"
    return [name, f"FAILED: {why}"] + ["-"] * (width - 2 + greedy)


def method_rows(results, names, prompts, categories, greedy, failed, reads=None, ops=None):
    """One row per method: per category 'speedup (tokens/forward)', then the totals over every prompt, the host
    reads per target forward (`reads`: row -> reads) and the host's ops per target forward as 'all (launches)'
    (`ops`: row -> (all, launches)), '-' where missing. A row that did not finish is a FAILED row with its reason;
    where `ar` did not finish, speedups are n/a (summary: None)."""
    groups = [(c, [p["id"] for p in prompts if p["category"] == c]) for c in categories]
    groups.append(("all", [p["id"] for p in prompts]))
    baseline = complete(results, "ar", prompts)
    rows, summary = [], {}
    for name in names:
        if not complete(results, name, prompts):
            rows.append(failed_row(name, failed.get(name, "did not finish"), len(categories) + 7, greedy))
            continue
        cells, summary[name] = [], {}
        for group, ids in groups:
            tokens, forwards, seconds = totals(results, name, ids)
            speedup = None
            if baseline:
                ar_tokens, _, ar_seconds = totals(results, "ar", ids)
                speedup = (tokens / seconds) / (ar_tokens / ar_seconds)
            summary[name][group] = dict(tokens_per_forward=tokens / forwards, tokens_per_s=tokens / seconds,
                                        speedup=speedup)
            if group != "all":
                cells.append(f"{times(speedup)} ({tokens / forwards:.2f})")
        s = summary[name]["all"]
        accepted = round(s["tokens_per_forward"] - 1, 2) + 0.0  # + 0.0: no "-0.00" (ar stopped by end-of-text)
        read, op = (reads or {}).get(name), (ops or {}).get(name)
        row = [name, *cells, f"{s['tokens_per_forward']:.2f}", f"{accepted:.2f}", f"{s['tokens_per_s']:.1f}",
               times(s["speedup"]), "-" if read is None else f"{read:.2f}",
               "-" if op is None else f"{op[0]:.0f} ({op[1]:.0f})"]
        if greedy and baseline:
            equal = sum(results[name][p["id"]]["ids"] == results["ar"][p["id"]]["ids"] for p in prompts)
            summary[name]["equal"] = equal
            row.append(f"{equal}/{len(prompts)}" + ("" if equal == len(prompts) else " !"))
        elif greedy:
            row.append("n/a")
        rows.append(row)
    return rows, summary


def times(speedup):
    """A speedup as '1.23x', or 'n/a' where there is no baseline to divide by."""
    return "n/a" if speedup is None else f"{speedup:.2f}x"


def mismatches(results, names, prompts, models):
    """Lines describing each greedy output that differs from ar's (rows that finished, where ar did)."""
    lines = []
    by_id = {p["id"]: p for p in prompts}
    if not complete(results, "ar", prompts):
        return ["ar did not finish: no output here is checked against it."]
    for name in (n for n in names if complete(results, n, prompts)):
        for pid, r in results[name].items():
            want = results["ar"][pid]["ids"]
            i = first_difference(r["ids"], want)
            if i is None:
                continue
            ar_tok = repr(models.tokenizer.decode(want[i:i + 1])) if i < len(want) else "(end)"
            got_tok = repr(models.tokenizer.decode(r["ids"][i:i + 1])) if i < len(r["ids"]) else "(end)"
            gap = top2_gap(models.target, by_id[pid]["ids"] + want[:i])
            lines.append(f"- MISMATCH {name} on {pid}: first difference at output token {i}: ar {ar_tok}, "
                         f"{name} {got_tok}; ar's top-2 logit gap there {gap:.2g}"
                         + (" (a near-tie: float rounding can flip it)" if gap < 1e-4 else ""))
    return lines


def bar_chart(summary, names, width=40):
    """Plain-text bars of each method's overall speedup; '|' marks 1.0x (ar)."""
    speedups = {name: s["all"]["speedup"] for name, s in summary.items() if s["all"]["speedup"] is not None}
    if not speedups:
        return ["  (no speedups: ar did not finish)"]
    top = max(max(speedups.values()), 1.0)
    scale = width / top
    one = round(scale)
    lines, pad = [], max(map(len, names))
    for name in names:
        if name not in speedups:
            continue
        s = speedups[name]
        bar = list("#" * round(s * scale) + " " * max(0, width - round(s * scale)))
        bar[one - 1] = "|"
        lines.append(f"  {name:{pad}s} {''.join(bar)} {s:.2f}x")
    return lines


# ----------------------------------------------------------------------------- the sections

PATHS = {"eager": "eager (plain PyTorch)", "static": "static (shape-static forwards, replay emulated on the CPU)",
         "graph": "graph (shape-static forwards replayed from CUDA graphs)"}


def row_paths(m):
    """{row label: the runtime path its runs took (compare.table_rows: the models runtime.prepare wrapped for it)},
    over every temperature."""
    return {label: path for t in m.temperatures for label, (_, _, path) in m.rows[t].items()}


def runtime_line(m):
    """Which path the forwards ran: one line, each path with its rows when they differ."""
    by_path = {}
    for label, path in row_paths(m).items():
        by_path.setdefault(path, []).append(label)
    if len(by_path) == 1:
        (path,) = by_path
        which = f"{PATHS.get(path, path)} for every row"
    else:
        which = "; ".join(f"{PATHS.get(p, p)}: {', '.join(labels)}" for p, labels in by_path.items())
    compare = " (comparing static with eager: each \"name (eager)\" row is that method on the eager path)"
    return (f"- runtime: --runtime {m.args.runtime}{compare if m.cost_eager else ''}; the forwards ran {which}; "
            f"forward costs below: {m.cost_path}" + (" and eager" if m.cost_eager else ""))

def replayed_warmups(m):
    """What the settings line adds when rows ran on a replayed path: their untimed runs of each prompt."""
    if all(path == "eager" for path in row_paths(m).values()):
        return ""
    return (f" (a row on a replayed path: after {REPLAY_WARMUPS} untimed runs of each prompt, so that its timed runs "
            "replay every shape they meet, as a long generation would, rather than capture it)")


def drafter_costs_text(c, eager):
    """The header's drafter costs: c (method -> c on the table's path, None where it made no drafter pass) and,
    comparing runtimes, eager (the same on the eager path). Each path prices its steps with its own calibration,
    so one may draft where the other takes plain steps: {"eagle": None}, {"eagle": 0.38} -> "eagle no pass
    (eager 0.38)"."""
    measured = ", ".join(f"{name} {'no pass' if cost is None else f'{cost:.2f}'}"
                         + (f" (eager {eager[name]:.2f})" if eager.get(name) else "")
                         for name, cost in c.items() if cost is not None or eager.get(name))
    heads = [name for name, cost in c.items() if cost is None and "heads" in parts_for([name])]
    idle = [name for name, cost in c.items() if cost is None and not eager.get(name) and name not in heads]
    costs = [measured] if measured else []
    costs += [f"{', '.join(heads)}: the target's own heads (run in its verify forward, their seconds the forward's; "
              "run alone, drafting with no drafter pass)"] if heads else []
    costs += [f"{', '.join(idle)}: made no drafter pass"] if idle else []
    return "; ".join(costs) or "no method with a trained drafter ran"


def header(m):
    """The conditions every figure below depends on: machine, model, prompts, settings, drafter costs."""
    args, models = m.args, m.models
    lens = [len(q["ids"]) for q in m.prompts]
    draft = f"; draft {describe(models.draft)}" if models.draft is not None else ""
    if models.target.config.n_future:
        draft += "; MTP heads " + ("retrained alone (heads.pt)" if models.tuned_heads else "as trained with the target")
    costs = drafter_costs_text(m.c, m.c_eager or {})
    if m.cost is None:
        costs = "not measured (the forward costs were not timed)"
    partial = [f"- PARTIAL: {m.partial}; this report holds what finished: {len(m.prompts)} prompt(s), temperature(s) "
               f"{', '.join(f'{t:g}' for t in m.temperatures)}", ""] if m.partial else []
    return [f"# nanospec bench{' (partial)' if m.partial else ''}, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
            *partial,
            f"- machine: {machine()}; device: {device_name(m.device)}; torch {torch.__version__}; "
            f"Python {platform.python_version()}; commit {git_commit()}",
            f"- model: {args.ckpt}/ (preset {preset_of(models.target.config)}): target {describe(models.target)}"
            f"{draft}; {args.dtype}",
            f"- prompts: {args.prompts}, {len(m.prompts)} ({', '.join(m.categories)}; up to "
            f"{args.prompts_per_category} each), {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f})",
            f"- settings: {args.max_new_tokens} new tokens per prompt, batch size 1, temperatures "
            f"{', '.join(f'{t:g}' for t in m.temperatures)}, {args.repeats} timed run(s) per prompt and method "
            f"after a warm-up{replayed_warmups(m)}, seed {args.seed} + prompt index, each method with its default "
            "options",
            "- drafter cost c = drafting seconds per drafter pass (the drafter's calls, timed by wrapping the models, "
            "over its timed runs) / one target forward over 1 token (fastest of the cost runs), each on its own path"
            + (" (timed on the GPU by CUDA events)" if m.device.startswith("cuda") else "") + ": " + costs,
            runtime_line(m),
            f"- command: python -m nanospec.bench {m.command}".rstrip(),
            f"- time: {m.seconds:.0f}s of measurements; load average (1 min) before {m.loads[0]}, after "
            f"{m.loads[1]} (other work on the machine makes every timing noisy)", ""]


def temperature_section(m, t):
    """One temperature's table (and, greedy, the equality check). Returns (lines, {row: summary})."""
    greedy = t == 0
    cells, summary = method_rows(m.results[t], list(m.rows[t]), m.prompts, m.categories, greedy, m.failed,
                                 (m.reads or {}).get(t), (m.ops or {}).get(t))
    head = (["method", *[f"{c}: speedup (tok/fwd)" for c in m.categories], "tokens/forward", "accepted/step",
             "tokens/s", "speedup", "host reads/forward", "host ops/forward"] + (["output = ar"] if greedy else []))
    out = [f"## {'greedy (temperature 0)' if greedy else f'temperature {t:g}'}", "", table(head, cells), ""]
    if "ar (eager)" in summary and summary["ar (eager)"]["all"]["speedup"]:
        ratio = 1 / summary["ar (eager)"]["all"]["speedup"]
        out += [f"Every speedup here is against ar on the {m.cost_path} path ({PATHS.get(m.cost_path, m.cost_path)}), "
                f"which runs {ratio:.2f}x as fast as eager ar (\"ar (eager)\"): a row \"name (eager)\" is that "
                f"method on the eager path (--runtime eager).", ""]
    if any("draft_sampling" in options for _, options, _ in m.rows[t].values()):
        out += ["A row \"method (topk)\" or \"method (sample)\" is that method with --draft-sampling set the other "
                "way: its guesses are the drafter's top-k (verified as point masses) or draws from its q.", ""]
    if greedy:
        bad = mismatches(m.results[t], list(m.rows[t]), m.prompts, m.models)
        out += (bad or ["Every greedy output equals ar's token for token."]) + [""]
    return out, summary


def repetition_section(m):
    rows = []
    for c in m.categories:
        row = [c]
        for t in m.temperatures:
            own = seen = total = 0
            for q in (q for q in m.prompts if q["category"] == c and q["id"] in m.results[t].get("ar", {})):
                o, s, n = ngram_repeats(q["ids"], m.results[t]["ar"][q["id"]]["ids"])
                own, seen, total = own + o, seen + s, total + n
            row += [f"{own / total:.0%}", f"{seen / total:.0%}"] if total else ["-", "-"]  # "-": no ar output
        rows.append(row)
    head = ["category"] + [f"{'greedy' if t == 0 else f't={t:g}'}: {what}" for t in m.temperatures
                           for what in ("repeats own 4-grams", "4-grams in prompt or earlier")]
    return ["## How repetitive ar's output is", "", table(head, rows), "",
            "Share of the output's token 4-grams that already occurred earlier in the output (a loop), and "
            "earlier in prompt + output (what a copying draft can find). High values flatter every method.", ""]


def cost_section(m):
    """cost(n)/cost(1) on the rows' path; comparing runtimes, the eager costs too, and each path's cost(1)."""
    both = [(m.cost_path, m.cost)] + ([("eager", m.cost_eager)] if m.cost_eager else [])
    out = [f"## Cost of one target forward over n new tokens, relative to n = 1 ({' and '.join(p for p, _ in both)})",
           ""]
    for path, cost in both:
        rows = [[f"{n0}-{n0 + 7}"] + [f"{cost[n] / cost[1]:.2f}" for n in range(n0, n0 + 8) if n in cost]
                for n0 in range(1, max(cost) + 1, 8)]
        out += ([f"{PATHS.get(path, path)}: cost(1) = {cost[1] * 1e3:.3f} ms", ""] if m.cost_eager else [])
        out += [table(["n", *[f"+{i}" for i in range(8)]], rows), ""]
    if m.cost_eager:
        out += [f"The same forward costs {m.cost_eager[1] / m.cost[1]:.2f}x as much eager as {m.cost_path} over 1 "
                f"token, {m.cost_eager[max(m.cost)] / m.cost[max(m.cost)]:.2f}x over {max(m.cost)}.", ""]
    return out + [
        f"cost(1) = {m.cost[1] * 1e3:.2f} ms: one target forward over 1 token after a {m.prefix}-token cached "
        f"prefix (fastest of {m.reps} runs). Row '9-16', column '+3' is n = 12. A method that produces t tokens "
        f"per forward while verifying n positions gains at most about t / (cost(n)/cost(1)), before its own "
        f"drafting overhead: that is why speedups fall short of tokens/forward.", ""]


def split_section(m):
    """Where a step's time goes, per method and temperature: milliseconds per target forward spent drafting (the
    drafters' calls), in the target's forwards (prefill and verify) and in the rest, the host's work between them
    (building trees, the verify rules, Python), each prompt's last timed run as the bench's Timed parts saw it."""
    rows = []
    for t in m.temperatures:
        for name in (n for n in m.rows[t] if complete(m.results[t], n, m.prompts)):
            runs = [r["timing"] for r in m.results[t][name].values()]
            forwards = sum(r["stats"]["target_forwards"] for r in m.results[t][name].values())
            wall, draft, target = (sum(r[key] for r in runs) * 1e3 / forwards
                                   for key in ("wall", "drafting", "target"))
            rows.append([f"{t:g}", name, f"{wall:.3f}", f"{draft:.3f}", f"{target:.3f}", f"{wall - draft - target:.3f}",
                         f"{(wall - draft - target) / wall:.0%}"])
    head = ["temperature", "method", "ms per target forward", "drafting", "target forwards", "the rest", "rest share"]
    return ["## Where a step's time goes", "", table(head, rows), "",
            "Milliseconds per target forward (a step), summed over every prompt's generation: drafting (every "
            "call of a drafter, timed by wrapping the models: the draft GPT, the EAGLE head, the ParallelSpec "
            "drafter, early-exit's passes through the target's first layers and its exit head, the MTP heads "
            "when mtp and medusa run them alone), the target's forwards (prefill and verify; with the MTP heads "
            "they ran, `heads=n`) and the rest, the host's work between them (building trees, the verify rules, "
            "Python). On a GPU the calls are timed by CUDA events, so a forward that waits for the host to launch its "
            "kernels counts that wait.", ""]


def chosen(steps, most=6):
    """How many guesses the steps checked, as 'value xsteps' by value: [2, 0, 2, 4] -> '0 x1, 2 x2, 4 x1' (the
    draft length a rule chose, clamped near the end); past `most` values, the most frequent and '+n more'."""
    counts = Counter(steps)
    shown = sorted(counts.most_common(most))  # by value
    more = f", +{len(counts) - most} more" if len(counts) > most else ""
    return ", ".join(f"{v} x{n}" for v, n in shown) + more


def drafting_section(m):
    """Where the drafting went, per method and temperature: the guesses each target forward checked
    (stats["drafted_per_step"], its first entry the prefill, left out), how many steps drafted nothing (a plain
    step), and how often each number of guesses was checked (what --adaptive cost chose, step by step)."""
    rows = []
    for t in m.temperatures:
        for name in (n for n in m.rows[t] if n != "ar" and complete(m.results[t], n, m.prompts)):
            steps = [d for r in m.results[t][name].values() for d in r["stats"].get("drafted_per_step", [])[1:]]
            rows.append([f"{t:g}", name, f"{sum(steps) / len(steps):.2f}" if steps else "-",
                         f"{sum(d == 0 for d in steps) / len(steps):.0%}" if steps else "-", chosen(steps) or "-"])
    head = ["temperature", "method", "guesses/step", "plain steps", "guesses checked (value x steps)"]
    return ["## Where the drafting went", "", table(head, rows),
            "", "guesses/step: the guesses each target forward checked, on average over every prompt's steps (the "
            "prefill left out); plain steps: the share of steps that checked none, a plain `ar` step (no match "
            "found, no room left, or, under --adaptive cost, no draft worth its cost on this machine); guesses "
            "checked: how many steps checked each number of guesses (a tree: its nodes below the root), what the "
            "cost rule chose step by step.", ""]


def leviathan_section(m, summaries):
    """Leviathan's predicted speedup for `speculative` from its measured acceptance rate, next to the measured
    one, for the k each step checked (the cost rule chooses it; 0 is a plain step, 1 token for 1 forward).
    m.step[(is_draft, temperature)]: seconds of one forward (temperature None) or decoding step."""
    cost, step = m.cost, m.step
    c_forward = step[True, None] / cost[1]
    rows = []
    for t in m.temperatures:
        c_step = step[True, t] / step[False, t]
        for group in m.categories + ["all"]:
            ids = [q["id"] for q in m.prompts if group in ("all", q["category"])]
            runs = [m.results[t]["speculative"][i]["stats"] for i in ids]
            a, per_step, ks = acceptance_mle(runs)
            drafted = [k for k in ks if k] or [0]
            predicted = sum(expected_tokens(a, k) for k in drafted) / len(drafted)
            speedups = [sum(leviathan(a, k, c, verify(k)) * (k * c + verify(k)) for k in ks)
                        / max(1e-9, sum(k * c + verify(k) for k in ks)) for c, verify in
                        ((c_forward, lambda k: 1.0), (c_step, lambda k: cost[min(k + 1, max(cost))] / cost[1]))]
            rows.append([f"{t:g}", group, f"{sum(ks) / max(1, len(ks)):.2f}", f"{a:.2f}", f"{predicted:.2f}",
                         f"{per_step:.2f}", f"{speedups[0]:.2f}x", f"{c_step:.2f}", f"{speedups[1]:.2f}x",
                         f"{summaries[t]['speculative'][group]['speedup']:.2f}x"])
    head = ["temperature", "category", "k per step", "a", "tokens/drafting step predicted", "measured",
            "speedup predicted (Leviathan)", "c_step", "predicted (c_step, verify cost)", "measured"]
    return [f"## speculative: predicted against measured (the k each step checked; c_forward = bare draft "
            f"forward / bare target forward = {c_forward:.2f}, {m.cost_path}; the header's c is the draft's whole "
            "pass in decoding)", "", table(head, rows), "",
            "k per step: the guesses each step checked, on average (the cost rule chooses them; 0 is a plain "
            "step). a: acceptance rate per draft token (maximum likelihood from the steps that drafted). Predicted "
            "tokens per drafting step: (1 - a^(k+1)) / (1 - a), averaged over those steps. Leviathan et al.'s "
            "speedup: the predicted tokens over the cost, k c + 1 per step (c = c_forward, the ratio of bare "
            "forwards over 1 token), summed over every step (a plain step: 1 token for 1). The next prediction "
            "prices what the formula leaves out: c_step is the ratio of whole decoding steps (forward + warp + "
            "sample: per token, the draft pays the same Python and sampling overhead as the target), and the "
            "verify forward over k+1 tokens costs cost(k+1)/cost(1), not 1. Neither counts the prefill.", ""]


def build(m):
    """The whole report, as Markdown text. Returns (text, summaries: temperature -> {row: figures})."""
    out = header(m)
    out += m.notes + [f"- FAILED {name}: {why}" for name, why in m.failed.items()]
    out += [""] if m.notes or m.failed else []
    summaries = {}
    for t in m.temperatures:
        lines, summaries[t] = temperature_section(m, t)
        out += lines
    out += ["Cells: wall-clock speedup over ar (tokens per target forward). Times are whole generate() calls, "
            "prefill included; tokens/forward counts the prefill forward (1 token); accepted/step = "
            "tokens/forward - 1.", "",
            "host reads/forward: how often Python reads a tensor's value (.item(), .tolist(), int(t), ...) per "
            "target forward, counted on one extra, untimed run of the first prompt. On a GPU each read waits for "
            "every kernel queued before it, so the host cannot queue the next forward (or graph replay) while it "
            "decides: `ar` reads 1 (its token), a chain method at most 2 (its guesses, then the verdict), a tree "
            "method a few more, per level of the tree it grows (tests/test_host_reads.py bounds each).", "",
            "host ops/forward: the tensor operations (aten ops) the host runs outside the model calls per target "
            "forward (warping, drawing, the verify rules, building trees), counted on the same run; in brackets "
            "those that put work on a device, leaving out views and other ops that only make a tensor's metadata. "
            "On a GPU each of those is a kernel launch, some microseconds of the host's time; counted, not timed, "
            "the figure is the same on any machine (tests/test_host_ops.py holds a sampled step to twice the "
            "greedy count + 60).", ""]
    out += repetition_section(m)
    out += cost_section(m) if m.cost else ["## Cost of one target forward over n new tokens", "",
                                          "Not measured: the bench stopped before timing the forward costs.", ""]
    out += split_section(m)
    out += drafting_section(m)
    if m.cost and all(summaries[t].get("speculative", {}).get("all", {}).get("speedup") for t in m.temperatures):
        out += leviathan_section(m, summaries)
    chart = []
    for t in m.temperatures:
        chart += [f"speedup over ar, all categories, {'greedy' if t == 0 else f'temperature {t:g}'} ('|' = 1.0x)"]
        chart += bar_chart(summaries[t], list(m.rows[t])) + [""]
    out += ["## Speedups", "", "```", *chart, "```", ""]
    return "\n".join(out), summaries
