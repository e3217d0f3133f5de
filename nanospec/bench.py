"""
`make bench`: every decoding method in the registry on the same model, prompts and machine, side by side, in
the format speculative-decoding papers use (Spec-Bench): per method and prompt category, tokens per target
forward and the wall-clock speedup over plain autoregressive decoding (`ar`). Plus what keeps such a table
honest:

    output = ar      greedy outputs must equal `ar`'s token for token (it must be 100% for a lossless method);
                     a mismatch is printed with its first differing position and `ar`'s top-2 logit gap there
    forward cost     a target forward over n new tokens costs more than one over 1 token, so k+1 tokens per
                     forward give less than a (k+1)x speedup: cost(n) / cost(1) for n = 1..64 says how much less
    speculative      the speedup Leviathan's formula predicts from the measured acceptance rate a and draft cost
                     c, next to the measured one
    repetitiveness   how much `ar`'s own output repeats itself: a small model's greedy text falls into loops,
                     where every guessing method looks brilliant. The temperature-1 table is the fairer test.

Timing: batch size 1; one warm-up run per method and temperature; then, for each prompt, `ar` and every
method back to back (the order rotated from prompt to prompt), the whole repeated --repeats times. A method's
tokens/s in a category is its tokens over the sum of its per-prompt median times; speedup = that / ar's.
Every method gets the same seed on a prompt. Prompts are text (data/prompts.json, cut from the validation
files by scripts/make_prompts.py), tokenized here.

    python -m nanospec.bench                       # `make bench`: every method, data/prompts.json, out/
    python -m nanospec.bench --quick               # smoke run: 2 prompts per category, 16 tokens
    python -m nanospec.bench --methods speculative,mtp --categories repeat --temperatures 0 --repeats 3
"""
import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time

import torch

from nanospec.checkpoint import CheckpointError
from nanospec.decoding import MODULES, METHODS, check_method, parts_for
from nanospec.parts import load_models
from nanospec.decoding.common import DRAFT_SAMPLING, tensor
from nanospec.device import pick_device
from nanospec.presets import PRESETS
from nanospec.verify import sample, warp


T0 = time.perf_counter()


def log(message):  # progress goes to stderr: stdout is the report
    print(f"[{time.perf_counter() - T0:5.0f}s] {message}", file=sys.stderr, flush=True)


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


def device_name(device):
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else device


def git_commit():
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def preset_of(config):
    """The preset (nanospec/presets.py) whose target has this config, or 'custom'."""
    for name, preset in PRESETS.items():
        if dataclasses.replace(preset["target"], vocab_size=config.vocab_size) == config:
            return name
    return "custom"


def describe(model):
    c = model.config
    return (f"{model.num_params() / 1e6:.2f}M parameters ({c.n_layer} layer{'s' * (c.n_layer > 1)} x {c.n_embd} "
            f"wide, {c.n_head} heads, vocab {c.vocab_size}, context {c.block_size})")


# ----------------------------------------------------------------------------- prompts

def load_prompts(path, categories, per_category):
    """The first per_category prompts of each category in the file (-1: all), as dicts id, category, text."""
    if not os.path.exists(path):
        raise ValueError(f"no prompt file {path}: build one with `python scripts/make_prompts.py`")
    with open(path, encoding="utf-8") as f:
        prompts = json.load(f)["prompts"]
    known = list(dict.fromkeys(p["category"] for p in prompts))
    for c in categories or []:
        if c not in known:
            raise ValueError(f"no category {c!r} in {path}; it has: {', '.join(known)}")
    chosen = []
    for c in categories or known:
        of_c = [p for p in prompts if p["category"] == c]
        chosen += of_c if per_category < 0 else of_c[:per_category]
    return [dict(id=p["id"], category=p["category"], text="\n".join(p["lines"])) for p in chosen]


def tokenize(prompts, tokenizer, max_len):
    """Add each prompt's token ids, keeping its last max_len tokens so that prompt + output fit the context.
    Returns how many prompts were cut."""
    cut = 0
    for p in prompts:
        ids = tokenizer.encode(p["text"])
        cut += len(ids) > max_len
        p["ids"] = ids[-max_len:]
    return cut


# ----------------------------------------------------------------------------- running the methods

def timed(fn, *args, **kwargs):
    """(result, seconds) of one call; waits for the GPU, if any, before reading the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - t


def table_rows(names, temperature):
    """The rows of one temperature's table, row label -> (method, options): every method with its defaults; when
    sampling, also each method that has a --draft-sampling switch in its other mode, labelled like "eagle (topk)",
    so that the two ways of drafting show side by side (at temperature 0 they are the same thing)."""
    rows = {}
    for name in names:
        rows[name] = (name, {})
        default = MODULES[name].OPTIONS.get("draft_sampling", (None, None))[1]
        for mode in DRAFT_SAMPLING if default is not None and temperature > 0 else ():
            if mode != default:
                rows[f"{name} ({mode})"] = (name, {"draft_sampling": mode})
    return rows


def run_all(models, rows, prompts, temperature, max_new_tokens, repeats, seed, failed):
    """results[row][prompt id] = dict(ids, stats, seconds (median over repeats)), rows as table_rows gives them.
    For each prompt and repetition `ar` and every row run back to back, so that a slow minute of the shared
    machine hits all of them alike; the order rotates so that no row always runs first. A row that raises is
    reported in `failed` and left out from then on."""
    names = list(rows)
    results = {name: {} for name in names}
    for i, p in enumerate(prompts):
        times = {name: [] for name in names}
        for r in range(repeats):
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                if name in failed:
                    continue
                method, options = rows[name]
                try:
                    (ids, stats), seconds = timed(METHODS[method], models, p["ids"], max_new_tokens,
                                                  temperature=temperature, seed=seed + i, **options)
                except Exception as e:  # one broken method must not sink the whole table
                    failed[name] = f"{type(e).__name__}: {e} (prompt {p['id']}, temperature {temperature:g})"
                    log(f"FAILED {name}: {failed[name]}")
                    continue
                times[name].append(seconds)
                results[name][p["id"]] = dict(ids=ids, stats=stats)
        for name in names:
            if times[name]:
                results[name][p["id"]]["seconds"] = statistics.median(times[name])
        log(f"temperature {temperature:g}: {p['id']} done ({i + 1}/{len(prompts)})")
    return results


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


# ----------------------------------------------------------------------------- forward cost and Leviathan

def fastest(calls, reps):
    """Seconds of each zero-argument callable: the fastest of reps runs. On a busy machine a run that lost the CPU
    for a scheduler slice (~10 ms) measures the machine, not the model. The calls take turns in a shuffled order
    in each repetition, so that no call is always the one after a slow moment; the first round warms up."""
    times = [[] for _ in calls]
    order = list(range(len(calls)))
    for r in range(reps + 1):
        random.Random(r).shuffle(order)
        for j in order:
            with torch.inference_mode():
                _, seconds = timed(calls[j])
            if r:
                times[j].append(seconds)
    return [min(t) for t in times]


def cached(model, prefix_len, gen):
    """A KV cache of `model` holding prefix_len random tokens (as after a prompt) and 64 more random ids to feed."""
    ids = torch.randint(0, model.config.vocab_size, (1, prefix_len + 64), generator=gen).to(model.wte.weight.device)
    cache = model.new_cache()
    model(ids[:, :prefix_len], cache=cache)
    return cache, ids


@torch.inference_mode()
def step_calls(jobs, prefix_len):
    """A callable for each job (model, n, temperature): one forward of `model` over n new tokens on top of a
    cached prefix of prefix_len tokens, then, unless temperature is None, picking the next token from the
    last position as a decoding step does (warp + sample). `fastest` times them."""
    gen = torch.Generator().manual_seed(0)
    caches = {}
    for model, _, _ in jobs:
        if id(model) not in caches:  # one cache per model, filled once with the same random prefix
            caches[id(model)] = cached(model, prefix_len, gen)

    def call(model, n, temperature):
        cache, ids = caches[id(model)]

        def run():
            cache.rollback(prefix_len)
            one_step(model, ids[:, prefix_len:prefix_len + n], cache, temperature, gen)
        return run
    return [call(*job) for job in jobs]


def one_step(model, x, cache, temperature, generator):
    logits = model(x, cache=cache).logits[0, -1]  # (V,)
    if temperature is not None:
        sample(warp(logits, temperature, None, None), generator)


@torch.inference_mode()
def drafter_passes(models, names, prefix_len):
    """{method: a callable that runs one pass of its drafter}, for the methods in `names` that draft with a
    trained part, each on a cache holding prefix_len random tokens (rolled back after every pass). Against one
    target forward over 1 token this gives c, the drafter's cost ratio in Leviathan et al.'s speedup formula:
    a step that drafts k guesses with k passes costs k c + 1 target forwards."""
    gen = torch.Generator().manual_seed(1)
    target, passes = models.target, {}  # (speculative's draft forward is one of step_calls' jobs already)
    C, device, dtype = target.config.n_embd, target.wte.weight.device, target.wte.weight.dtype
    one = torch.randint(0, target.config.vocab_size, (1, 1), generator=gen).to(device)  # (1, 1) the newest token
    if "early-exit" in names:
        from nanospec.decoding.early_exit import default_exit_layer
        from nanospec.drafters.early_exit import exit_logits
        E = default_exit_layer(target.config.n_layer)
        tcache, _ = cached(target, prefix_len, gen)

        def exit_pass():  # blocks 1..E over one token, then the exit (adapter, final norm, unembedding)
            hidden = target(one, cache=tcache, layers=(0, E)).hidden
            exit_logits(target, models.early_exit, E, hidden)
            tcache.rollback(prefix_len)
        passes["early-exit"] = exit_pass
    hidden = torch.randn(1, 1, C, generator=gen).to(device, dtype)  # (1, 1, C) a trunk state
    for name in ("mtp", "medusa"):
        if name in names and target.config.n_future:
            passes[name] = lambda: target.head_logits(hidden)  # every head once, as a step drafts
    if "eagle" in names and models.eagle is not None:
        ecache = models.eagle.new_cache()
        ids = torch.randint(0, target.config.vocab_size, (1, prefix_len), generator=gen).to(device)
        models.eagle(target, ids, torch.randn(1, prefix_len, C, generator=gen).to(device, dtype), cache=ecache)
        passes["eagle"] = lambda: (models.eagle(target, one, hidden, cache=ecache), ecache.rollback(prefix_len))
    if "parallelspec" in names and models.parallelspec is not None:
        drafter = models.parallelspec
        pcache = drafter.new_cache()
        drafter.draft(target, pcache, list(range(prefix_len)), 1)
        passes["parallelspec"] = lambda: (drafter.draft(target, pcache, [0], drafter.config.n_masks),
                                          pcache.rollback(prefix_len))
    return passes


def acceptance_mle(per_prompt, k, max_new_tokens):
    """Leviathan's per-token acceptance rate a from speculative's steps: each step accepts n of k guesses,
    and n < k means one rejection. Under the model (each guess accepted with probability a, independently),
    the maximum-likelihood a = accepted / (accepted + rejections). The prefill and steps with fewer than k
    guesses (near the token budget, where draft_room shrinks k) are left out. Returns (a, tokens per step)."""
    accepted = rejections = steps = 0
    for stats in per_prompt:
        done = stats["accepted_per_step"][0]  # the prefill forward emits 1 token
        for kept in stats["accepted_per_step"][1:]:
            if max_new_tokens - done - 1 >= k:  # a full step of k guesses
                n = kept - 1  # the guesses it accepted (kept = accepted + the target's own token)
                accepted, rejections, steps = accepted + n, rejections + (n < k), steps + 1
            done += kept
    a = accepted / max(1, accepted + rejections)
    return a, (accepted + steps) / max(1, steps)


def leviathan(a, k, c, verify=1.0):
    """Expected speedup: (1 - a^(k+1)) / (1 - a) tokens per step, for k draft forwards (c each, in target
    forwards) and one target forward over k+1 tokens (`verify`; Leviathan et al. take it as 1)."""
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + verify)


# ----------------------------------------------------------------------------- the report

def table(header, rows):
    """A Markdown table, its columns padded so that it also reads well as plain text."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    # numbers align right (Markdown: "--:"), words left
    right = [all(re.match(r"-?[0-9]", row[i]) for row in cells[1:]) for i in range(len(header))]

    def line(row):
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def totals(results, name, ids):
    """(tokens, target forwards, seconds) of one method over some prompts."""
    runs = [results[name][i] for i in ids if i in results[name]]
    return (sum(r["stats"]["new_tokens"] for r in runs), sum(r["stats"]["target_forwards"] for r in runs),
            sum(r["seconds"] for r in runs))


def method_rows(results, names, prompts, categories, greedy, failed):
    """One row per method: per category 'speedup (tokens/forward)', then the totals over every prompt."""
    groups = [(c, [p["id"] for p in prompts if p["category"] == c]) for c in categories]
    groups.append(("all", [p["id"] for p in prompts]))
    rows, summary = [], {}
    for name in names:
        if name in failed:
            continue
        cells, summary[name] = [], {}
        for group, ids in groups:
            tokens, forwards, seconds = totals(results, name, ids)
            ar_tokens, _, ar_seconds = totals(results, "ar", ids)
            speedup = (tokens / seconds) / (ar_tokens / ar_seconds)
            summary[name][group] = dict(tokens_per_forward=tokens / forwards, tokens_per_s=tokens / seconds,
                                        speedup=speedup)
            if group != "all":
                cells.append(f"{speedup:.2f}x ({tokens / forwards:.2f})")
        s = summary[name]["all"]
        accepted = round(s["tokens_per_forward"] - 1, 2) + 0.0  # + 0.0: no "-0.00" (ar stopped by end-of-text)
        row = [name, *cells, f"{s['tokens_per_forward']:.2f}", f"{accepted:.2f}", f"{s['tokens_per_s']:.1f}",
               f"{s['speedup']:.2f}x"]
        if greedy:
            equal = sum(results[name][p["id"]]["ids"] == results["ar"][p["id"]]["ids"] for p in prompts)
            summary[name]["equal"] = equal
            row.append(f"{equal}/{len(prompts)}" + ("" if equal == len(prompts) else " !"))
        rows.append(row)
    return rows, summary


def mismatches(results, names, prompts, models, tokenizer):
    """Lines describing each greedy output that differs from ar's."""
    lines = []
    by_id = {p["id"]: p for p in prompts}
    for name in names:
        for pid, r in results[name].items():
            want = results["ar"][pid]["ids"]
            i = first_difference(r["ids"], want)
            if i is None:
                continue
            ar_tok = repr(tokenizer.decode(want[i:i + 1])) if i < len(want) else "(end)"
            got_tok = repr(tokenizer.decode(r["ids"][i:i + 1])) if i < len(r["ids"]) else "(end)"
            gap = top2_gap(models.target, by_id[pid]["ids"] + want[:i])
            lines.append(f"- MISMATCH {name} on {pid}: first difference at output token {i}: ar {ar_tok}, "
                         f"{name} {got_tok}; ar's top-2 logit gap there {gap:.2g}"
                         + (" (a near-tie: float rounding can flip it)" if gap < 1e-4 else ""))
    return lines


def bar_chart(summary, names, width=40):
    """Plain-text bars of each method's overall speedup; '|' marks 1.0x (ar)."""
    top = max(max(s["all"]["speedup"] for s in summary.values()), 1.0)
    scale = width / top
    one = round(scale)
    lines, pad = [], max(map(len, names))
    for name in names:
        if name not in summary:
            continue
        s = summary[name]["all"]["speedup"]
        bar = list("#" * round(s * scale) + " " * max(0, width - round(s * scale)))
        bar[one - 1] = "|"
        lines.append(f"  {name:{pad}s} {''.join(bar)} {s:.2f}x")
    return lines


def report_header(args, argv, models, device, prompts, categories, temperatures, seconds, loads, c):
    lens = [len(q["ids"]) for q in prompts]
    command = " ".join(argv if argv is not None else sys.argv[1:])
    draft = f"; draft {describe(models.draft)}" if models.draft is not None else ""
    if models.target.config.n_future:
        draft += "; MTP heads " + ("retrained alone (heads.pt)" if models.tuned_heads else "as trained with the target")
    return [f"# nanospec bench, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
            f"- machine: {machine()}; device: {device_name(device)}; torch {torch.__version__}; "
            f"Python {platform.python_version()}; commit {git_commit()}",
            f"- model: {args.ckpt}/ (preset {preset_of(models.target.config)}): target {describe(models.target)}"
            f"{draft}; {args.dtype}",
            f"- prompts: {args.prompts}, {len(prompts)} ({', '.join(categories)}; up to {args.prompts_per_category} "
            f"each), {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f})",
            f"- settings: {args.max_new_tokens} new tokens per prompt, batch size 1, temperatures "
            f"{', '.join(f'{t:g}' for t in temperatures)}, {args.repeats} timed run(s) per prompt and method after "
            f"a warm-up, seed {args.seed} + prompt index, each method with its default options",
            "- drafter cost c = one drafter pass / one target forward over 1 token (fastest of the cost runs): "
            + (", ".join(f"{name} {ratio:.2f}" for name, ratio in c.items()) or "no trained drafter"),
            f"- command: python -m nanospec.bench {command}".rstrip(),
            f"- time: {seconds:.0f}s of measurements; load average (1 min) before {loads[0]}, after {loads[1]} "
            f"(other work on the machine makes every timing noisy)", ""]


def repetition_section(results, prompts, categories, temperatures):
    rows = []
    for c in categories:
        row = [c]
        for t in temperatures:
            own = seen = total = 0
            for q in (q for q in prompts if q["category"] == c):
                o, s, n = ngram_repeats(q["ids"], results[t]["ar"][q["id"]]["ids"])
                own, seen, total = own + o, seen + s, total + n
            row += [f"{own / max(1, total):.0%}", f"{seen / max(1, total):.0%}"]
        rows.append(row)
    header = ["category"] + [f"{'greedy' if t == 0 else f't={t:g}'}: {what}" for t in temperatures
                             for what in ("repeats own 4-grams", "4-grams in prompt or earlier")]
    return ["## How repetitive ar's output is", "", table(header, rows), "",
            "Share of the output's token 4-grams that already occurred earlier in the output (a loop), and "
            "earlier in prompt + output (what a copying draft can find). High values flatter every method.", ""]


def cost_section(cost, prefix, reps):
    rows = [[f"{n0}-{n0 + 7}"] + [f"{cost[n] / cost[1]:.2f}" for n in range(n0, n0 + 8) if n in cost]
            for n0 in range(1, max(cost) + 1, 8)]
    return ["## Cost of one target forward over n new tokens, relative to n = 1", "",
            table(["n", *[f"+{i}" for i in range(8)]], rows), "",
            f"cost(1) = {cost[1] * 1e3:.2f} ms: one target forward over 1 token after a {prefix}-token cached "
            f"prefix (fastest of {reps} runs). Row '9-16', column '+3' is n = 12. A method that produces t tokens per "
            f"forward while verifying n positions gains at most about t / (cost(n)/cost(1)), before its own "
            f"drafting overhead: that is why speedups fall short of tokens/forward.", ""]


def leviathan_section(results, summaries, prompts, categories, temperatures, cost, step, max_new_tokens):
    """Leviathan's predicted speedup for `speculative` from its measured acceptance rate, next to the measured
    one. step[(is_draft, temperature)]: seconds of one forward (temperature None) or decoding step."""
    k = MODULES["speculative"].OPTIONS["draft_len"][1]
    c_forward = step[True, None] / cost[1]
    verify = cost[min(k + 1, max(cost))] / cost[1]
    rows = []
    for t in temperatures:
        c_step = step[True, t] / step[False, t]
        for group in categories + ["all"]:
            ids = [q["id"] for q in prompts if group in ("all", q["category"])]
            a, per_step = acceptance_mle([results[t]["speculative"][i]["stats"] for i in ids], k, max_new_tokens)
            predicted_tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
            rows.append([f"{t:g}", group, f"{a:.2f}", f"{predicted_tokens:.2f}", f"{per_step:.2f}",
                         f"{leviathan(a, k, c_forward):.2f}x", f"{c_step:.2f}",
                         f"{leviathan(a, k, c_step, verify):.2f}x",
                         f"{summaries[t]['speculative'][group]['speedup']:.2f}x"])
    header = ["temperature", "category", "a", "tokens/step predicted", "measured", "speedup predicted (Leviathan)",
              "c_step", "predicted (c_step, verify cost)", "measured"]
    return [f"## speculative: predicted against measured (k = {k}, c = draft/target forward time = {c_forward:.2f})",
            "", table(header, rows), "",
            "a: acceptance rate per draft token (maximum likelihood from the accepted counts). Predicted "
            "tokens/step: (1 - a^(k+1)) / (1 - a). Leviathan et al.'s speedup: that / (k c + 1), with c the "
            "ratio of bare forwards over 1 token. The next prediction prices what the formula leaves out: "
            "c_step is the ratio of whole decoding steps (forward + warp + sample: per token, the draft pays "
            f"the same Python and sampling overhead as the target), and the verify forward over k+1 tokens "
            f"costs cost({k + 1})/cost(1) = {verify:.2f}, not 1. Neither counts the prefill.", ""]


def main(argv=None):
    p = argparse.ArgumentParser(description="Benchmark every decoding method against ar on the same prompts.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default="all", help="comma-separated methods, or all (ar always runs: the baseline)")
    p.add_argument("--categories", default="all", help="comma-separated prompt categories, or all")
    p.add_argument("--prompts", default="data/prompts.json", help="prompt file (scripts/make_prompts.py builds it)")
    p.add_argument("--prompts-per-category", type=int, default=6, help="the first N of each category; -1 = all")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method (median), after warm-up")
    p.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed + i by every method")
    p.add_argument("--ckpt", default="out", help="folder with tokenizer.tiktoken, target.pt and optional parts")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads, 0 = torch's default (one per core). Batch-1 decoding of a tiny model "
                        "gains little from more, and on a busy machine threads stall waiting for each other")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="float64 is slow but rules out near-ties when checking greedy equality (tests)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 prompts per category, 16 tokens, forward costs for n = 1..8 only")
    p.add_argument("--out", default="bench_results.md", help="the report is also written here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts_per_category, args.max_new_tokens = 2, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
        device = pick_device(args.device)
        wanted = list(MODULES) if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
        for name in wanted:
            if name not in MODULES:
                raise ValueError(f"unknown method {name!r}; choose from: {', '.join(MODULES)}")
        models = load_models(args.ckpt, device, parts_for(["ar"] + wanted))
        if args.dtype == "float64":
            for f in dataclasses.fields(models):
                part = getattr(models, f.name)
                if isinstance(part, torch.nn.Module):
                    setattr(models, f.name, part.double())
        names, notes = [], []
        for name in dict.fromkeys(["ar"] + wanted):
            try:
                check_method(name, models)
                names.append(name)
            except ValueError as e:
                notes.append(f"- skipped {name}: {e}")
        categories = None if args.categories == "all" else [c.strip() for c in args.categories.split(",")]
        prompts = load_prompts(args.prompts, categories, args.prompts_per_category)
        categories = list(dict.fromkeys(q["category"] for q in prompts))
        block = models.target.config.block_size
        if args.max_new_tokens >= block:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                             f"model's context of {block} tokens")
        cut = tokenize(prompts, models.tokenizer, block - args.max_new_tokens)
        if cut:
            notes.append(f"- {cut} prompt(s) kept only their last {block - args.max_new_tokens} tokens, to fit "
                         f"the context ({block}) with {args.max_new_tokens} new tokens")
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    for line in notes:
        log(line[2:])

    # Warm-up: the first calls pay for allocations and kernel choices; keep them out of the timings.
    rows = {t: table_rows(names, t) for t in temperatures}
    for t in temperatures:
        for method, options in rows[t].values():
            METHODS[method](models, prompts[0]["ids"], min(8, args.max_new_tokens), temperature=t, seed=0, **options)
    failed, results = {}, {}
    t_start, load_before = time.perf_counter(), load_average()
    for t in temperatures:
        results[t] = run_all(models, rows[t], prompts, t, args.max_new_tokens, args.repeats, args.seed, failed)

    # Forward cost against n, on top of a ~100-token cached prefix (as after a prompt); and, for Leviathan's c,
    # the draft's forward and decoding step (forward + warp + sample) against the target's, timed in turns.
    sizes = list(range(1, 9 if args.quick else 65))
    prefix = min(100, block - max(sizes))
    reps = 3 if args.quick else 21
    jobs = [(models.target, n, None) for n in sizes]
    if "speculative" in names:
        jobs += [(m, 1, t) for t in temperatures for m in (models.target, models.draft)] + [(models.draft, 1, None)]
    log("timing target forwards over n = 1..%d tokens" % max(sizes))
    passes = drafter_passes(models, names, prefix)  # c of every trained drafter, timed in the same turns
    seconds = fastest(step_calls(jobs, prefix) + list(passes.values()), reps)
    c = {name: s / seconds[0] for name, s in zip(passes, seconds[len(jobs):])}
    seconds = seconds[:len(jobs)]
    cost = dict(zip(sizes, seconds))
    step = {(job[0] is models.draft, job[2]): s for job, s in zip(jobs[len(sizes):], seconds[len(sizes):])}
    if (True, None) in step:  # the draft GPT's bare forward over 1 token
        c = {"speculative": step[True, None] / cost[1], **c}
    loads = (load_before, load_average())

    out = report_header(args, argv, models, device, prompts, categories, temperatures,
                        time.perf_counter() - t_start, loads, c)
    out += notes + [f"- FAILED {name}: {why}" for name, why in failed.items()] + ([""] if notes or failed else [])
    summaries = {}
    for t in temperatures:
        greedy = t == 0
        cells, summaries[t] = method_rows(results[t], list(rows[t]), prompts, categories, greedy, failed)
        header = (["method", *[f"{c}: speedup (tok/fwd)" for c in categories], "tokens/forward", "accepted/step",
                   "tokens/s", "speedup"] + (["output = ar"] if greedy else []))
        out += [f"## {'greedy (temperature 0)' if greedy else f'temperature {t:g}'}", "", table(header, cells), ""]
        if len(rows[t]) > len(names):
            out += ["A row \"method (topk)\" or \"method (sample)\" is that method with --draft-sampling set the other "
                    "way: its guesses are the drafter's top-k (verified as point masses) or draws from its q.", ""]
        if greedy:
            bad = mismatches(results[t], [n for n in names if n not in failed], prompts, models, models.tokenizer)
            out += (bad or ["Every greedy output equals ar's token for token."]) + [""]
    out += ["Cells: wall-clock speedup over ar (tokens per target forward). Times are whole generate() calls, "
            "prefill included; tokens/forward counts the prefill forward (1 token); accepted/step = "
            "tokens/forward - 1.", ""]
    out += repetition_section(results, prompts, categories, temperatures)
    out += cost_section(cost, prefix, reps)
    if "speculative" in names and "speculative" not in failed:
        out += leviathan_section(results, summaries, prompts, categories, temperatures, cost, step,
                                 args.max_new_tokens)
    chart = []
    for t in temperatures:
        chart += [f"speedup over ar, all categories, {'greedy' if t == 0 else f'temperature {t:g}'} ('|' = 1.0x)"]
        chart += bar_chart(summaries[t], list(rows[t])) + [""]
    out += ["## Speedups", "", "```", *chart, "```", ""]

    report = "\n".join(out)
    print(report)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(report)
    log(f"wrote {args.out}")
    return dict(summaries=summaries, skipped=notes, failed=failed, report=report)


if __name__ == "__main__":
    main()
