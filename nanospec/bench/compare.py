"""
`make bench`: every decoding method in the registry on the same model, prompts and machine, side by side, in
the format speculative-decoding papers use (Spec-Bench): per method and prompt category, tokens per target
forward and the wall-clock speedup over plain autoregressive decoding (`ar`). Plus what keeps such a table
honest:

    output = ar      greedy outputs must equal `ar`'s token for token (it must be 100% for a lossless method);
                     a mismatch is printed with its first differing position and `ar`'s top-2 logit gap there
    forward cost     a target forward over n new tokens costs more than one over 1 token, so k+1 tokens per
                     forward give less than a (k+1)x speedup: cost(n) / cost(1) for n = 1..64 says how much less
    drafter cost c   each method's drafting seconds per drafter pass, over one target forward over 1 token
    where time goes  per step: drafting, the target's forwards and the rest (the host's work between them)
    host reads       how often a method reads a tensor's value per target forward (on a GPU each read waits)
    host ops         the tensor operations (aten ops) run outside the model calls per target forward, and of
                     those the ones that launch work on a GPU: counted, so the same on any machine
    drafting         per method, the guesses drafted per step, the share of plain steps (no guess), and what a
                     draft-length rule chose (k, tree size) where the method reports it
    speculative      the speedup Leviathan's formula predicts from the measured acceptance rate a and draft cost
                     c, next to the measured one
    runtime          which path the forwards ran (nanospec/fast/runtime.py: eager, or shape-static, replayed from CUDA
                     graphs on CUDA); on CUDA (or with --compare-runtimes) every method runs static, with an eager
                     row "name (eager)" beside it, speedups against the static `ar`, and the forward cost and c
                     both ways
    repetitiveness   how much `ar`'s own output repeats itself: a small model's greedy text falls into loops,
                     where every guessing method looks brilliant. The temperature-1 table is the fairer test.

This file measures; nanospec/bench/report.py writes the Markdown report from the measurements. The methods hold no
timer: the models are wrapped once per runtime path, `runtime.prepare` first, then nanospec/bench/timing.py's Timed
around each part, which adds every call's seconds to drafting or to target forwards.

Timing: batch size 1; one warm-up run per method and temperature, then one untimed run on the first prompt
that counts host reads and ops; then, for each prompt, `ar` and every method back to back (the order rotated from
prompt to prompt), the whole repeated --repeats times; a row on a replayed path (static, graph) first runs each
prompt twice untimed (timing.REPLAY_WARMUPS), so that it replays every forward it times. A method's tokens/s in a
category is its tokens over the sum of its per-prompt median times; speedup = that / ar's. Every method gets the
same seed on a prompt.
Prompts are text (data/prompts.json, cut from the validation files by scripts/make_prompts.py), tokenized here.
A part that will not load, or a method that fails in its warm-up, becomes a "skipped" line with its reason,
and the bench goes on with the rest; a method that fails later is a FAILED row with its reason (and `ar`
failing leaves the speedups n/a), and the report is still written. Ctrl-C writes what was measured so far, marked
partial. Every setting (--out, --prompts, --seed, --threads, ...) is checked before anything is measured.

    python -m nanospec.bench                       # `make bench`: every method, data/prompts.json, out/
    python -m nanospec.bench --quick               # smoke run: 2 prompts per category, 16 tokens
    python -m nanospec.bench --methods speculative,mtp --categories repeat --temperatures 0 --repeats 3
    python -m nanospec.bench --quick --compare-runtimes   # eager beside static on any device (the CUDA default)
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

if __name__ == "__main__":  # first, before torch loads: Ctrl-C, a closed pipe and the terminal's encoding
    from nanospec.device import plain_exits
    plain_exits()

import torch

from nanospec.bench import batch as bench_batch
from nanospec.bench import calibration
from nanospec.bench import report
from nanospec.bench.report import one_line
from nanospec.model.checkpoint import CheckpointError
from nanospec.decoding import MODULES, METHODS, check_method, parts_for
from nanospec.device import MAX_SEED, add_runtime_flag, add_threads_flag, check_seed, pick_device, set_threads
from nanospec.model.load import load_models
from nanospec.bench.timing import (REPLAY_WARMUPS, Ledger, counting_host_reads, counting_ops, fastest, timed,
                                   timed_models)
from nanospec.fast.runtime import RUNTIMES, prepare
from nanospec.tokenizer import write_atomic
from nanospec.rules.verify import sample, warp


T0 = time.perf_counter()


def log(message):  # progress goes to stderr: stdout is the report
    print(f"[{time.perf_counter() - T0:5.0f}s] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nanospec.bench",
                                description="Benchmark every decoding method against ar on the same prompts.")
    p.add_argument("--methods", default="all", help="comma-separated methods, or all (ar always runs: the baseline)")
    p.add_argument("--categories", default="all", help="comma-separated prompt categories, or all")
    p.add_argument("--prompts", default="data/prompts.json", help="prompt file (scripts/make_prompts.py builds it)")
    p.add_argument("--prompts-per-category", type=int, default=None,
                   help="the first N of each category; -1 = all (default 6; 2 with --quick)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated per prompt (default 64; 16 with --quick)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated, each >= 0; 0 = greedy (default 0,1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per prompt and method (median), after warm-up (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompt i is generated with seed + i by every method (0..2**63-1 - prompts)")
    p.add_argument("--ckpt", default="out", help="folder with tokenizer.tiktoken, target.pt and optional parts")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps (default auto)")
    add_threads_flag(p)  # default 1, as decode.py's
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="float64 is slow but rules out near-ties when checking greedy equality (tests)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts per category, 16 tokens (unless "
                   "those flags are given), forward costs for n = 1..8 only")
    add_runtime_flag(p, RUNTIMES, ". On CUDA, auto compares the two (--compare-runtimes)")
    p.add_argument("--compare-runtimes", action="store_true",
                   help="run every method on the static path plus an eager row \"name (eager)\" of each; forward "
                        "costs and drafter costs both ways (the default with --runtime auto on CUDA)")
    p.add_argument("--out", default=None,
                   help="the report is also written here (default bench_results.md; bench_batch.md for a batch table)")
    p.add_argument("--json", default=None,
                   help="the figures' numbers (make figures reads them) are merged into this file (default "
                        "bench_results.json in --out's folder)")
    p.add_argument("--batch-sizes", default=None,
                   help="e.g. 1,2,4,8,16,32: instead of the method table, the batch table (nanospec/bench/batch.py): "
                        "batched ar, speculative and prompt-lookup at each batch size")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = "bench_batch.md" if args.batch_sizes else "bench_results.md"
    if args.json is None:
        args.json = os.path.join(os.path.dirname(args.out), "bench_results.json")
    if args.prompts_per_category is None:  # a batch table takes every prompt: B rows of distinct prompts
        args.prompts_per_category = 2 if args.quick else -1 if args.batch_sizes else 6
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    return args


def check_args(args):
    """One ValueError per bad setting, before anything is loaded. Returns the temperatures as floats."""
    temperatures = []
    for text in args.temperatures.split(","):
        try:
            t = float(text)
        except ValueError:
            raise ValueError(f"--temperatures: {text.strip()!r} is not a number; give e.g. 0,1") from None
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"--temperatures: each must be a finite number >= 0 (0 = greedy), got {text.strip()}")
        temperatures.append(t)
    for flag, value, low in (("--repeats", args.repeats, 1), ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    check_seed(args.seed)
    if args.compare_runtimes and args.runtime == "eager":
        raise ValueError("--compare-runtimes runs the static path beside the eager one; drop --runtime eager")
    if args.prompts_per_category == 0 or args.prompts_per_category < -1:
        raise ValueError(f"--prompts-per-category must be at least 1 (or -1 = all), got {args.prompts_per_category}")
    for flag, path in (("--out", args.out), ("--json", args.json)):
        check_writable(flag, path)
    if args.batch_sizes is not None:
        bench_batch.parse_sizes(args.batch_sizes)
    return temperatures


def check_writable(flag, path):
    """A file the bench may write at the end: a ValueError now, not a traceback after all the measuring."""
    if not path:
        raise ValueError(f"{flag} is empty: give a file name, e.g. {flag} bench_results.md")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder: give a file name in it, e.g. {os.path.join(path, 'bench.md')}")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{flag} {path} is not a regular file (a device?): give a file name")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable: give another file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist or is not writable")
    if flag == "--json" and os.path.isfile(path) and os.path.getsize(path) and not is_bench_json(path):
        raise ValueError(f"--json {path} is not the bench's JSON, which the figures are merged into: it is kept; "
                         f"give another file (or none: bench_results.json beside --out)")
    if flag == "--out" and os.path.isfile(path) and os.path.getsize(path) and not is_bench_report(path):
        raise ValueError(f"--out {path} is not a bench report (its first line is not '# nanospec bench...'): it is "
                         f"kept; give another file")


JSON_KEYS = {"methods", "title", "batch", "batch_title"}  # what write() merges into --json: nothing else is ours


def is_bench_report(path):
    """Does the file at `path` open as a report the bench wrote (report.py's or batch.py's title), one it may
    replace?"""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith("# nanospec bench")
    except (OSError, ValueError):
        return False


def is_bench_json(path):
    """Is the file at `path` a JSON object of the bench's own keys (one it wrote, which it may merge into)?"""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and set(data) <= JSON_KEYS


# ----------------------------------------------------------------------------- prompts

PROMPT_SHAPE = ('{"prompts": [{"id": "code-01", "category": "code", "lines": ["def f(x):", ...]}, ...]} '
                '(scripts/make_prompts.py writes it)')


def read_prompt_file(path):
    """The prompt file's list of prompts, each checked: a one-line ValueError naming the file and the entry."""
    if os.path.isdir(path):
        raise ValueError(f"--prompts {path} is a folder: give the prompt file, e.g. data/prompts.json")
    if not os.path.exists(path):
        raise ValueError(f"no prompt file {path}: build one with `python scripts/make_prompts.py`")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --prompts {path}: {one_line(e)}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--prompts {path} is not valid JSON ({e}): expected {PROMPT_SHAPE}") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"--prompts {path} holds no list of prompts: expected {PROMPT_SHAPE}")
    ids = set()
    for i, p in enumerate(prompts, 1):
        lines = p.get("lines") if isinstance(p, dict) else None
        if not (isinstance(p, dict) and isinstance(p.get("id"), str) and isinstance(p.get("category"), str)
                and isinstance(lines, list) and all(isinstance(x, str) for x in lines)):
            raise ValueError(f"--prompts {path}: prompt {i} is not an object with a string id, a string category and "
                             f"lines, a list of strings: expected {PROMPT_SHAPE}")
        if not "".join(lines).strip():
            raise ValueError(f"--prompts {path}: prompt {i} ({p['id']}) has no text")
        if p["id"] in ids:
            raise ValueError(f"--prompts {path}: the id {p['id']!r} is used twice (the report tells prompts by id)")
        ids.add(p["id"])
    return prompts


def load_prompts(path, categories, per_category):
    """The first per_category prompts of each category in the file (-1: all), as dicts id, category, text."""
    prompts = read_prompt_file(path)
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


# ----------------------------------------------------------------------------- the models

def load_target(ckpt, device):
    """The tokenizer and target alone; a file that is not what it should be is a one-line CheckpointError."""
    try:
        return load_models(ckpt, device, ())
    except (CheckpointError, ValueError):
        raise
    except Exception as e:  # e.g. another part's file copied over target.pt: its weights do not fit a GPT
        raise CheckpointError(f"{os.path.join(ckpt, 'target.pt')} does not load as a target ({one_line(e)}); "
                              "delete it and run `make train`") from None


def load_parts(ckpt, device, parts, dtype):
    """The models with the optional `parts` that load. Returns (models, {part: why it did not load}): a damaged
    optional part is left out, as a missing one is; an unreadable tokenizer or target.pt is an error."""
    broken = {}
    try:
        models = load_models(ckpt, device, parts)
    except Exception:  # which part? the target alone first (its errors are the bench's), then each part
        load_target(ckpt, device)
        for part in parts:
            try:
                load_models(ckpt, device, (part,))
            except Exception as e:
                broken[part] = one_line(e)
        models = load_models(ckpt, device, [p for p in parts if p not in broken])
    if dtype == "float64":
        for f in dataclasses.fields(models):
            if isinstance(getattr(models, f.name), torch.nn.Module):
                setattr(models, f.name, getattr(models, f.name).double())
    return models, broken


def choose_methods(wanted, models, broken, folder="out"):
    """(the methods that can run, ar first; '- skipped name: why' lines for the others). folder: where the models
    came from, for the command that trains a missing part."""
    names, notes = [], [f"- part {part} left out: {why}" for part, why in broken.items()]
    for name in dict.fromkeys(["ar"] + wanted):
        damaged = [part for part in MODULES[name].NEEDS if part in broken]
        try:
            if damaged:
                raise ValueError(f"its {damaged[0]} part did not load ({broken[damaged[0]]})")
            check_method(name, models, folder)
            names.append(name)
        except ValueError as e:
            notes.append(f"- skipped {name}: {e}")
    return names, notes


def set_up(args):
    """Check the settings, load the models and prompts, and wrap the models once for each runtime path the rows
    run (runtime.prepare, then timing.Timed around each part). Returns a dict of what the measurements need."""
    temperatures = check_args(args)
    set_threads(args.threads)  # checked against the cores first: a huge number crashes torch
    device = pick_device(args.device)
    wanted = list(MODULES) if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    for name in wanted:
        check_method(name)
    categories = None if args.categories == "all" else [c.strip() for c in args.categories.split(",")]
    prompts = load_prompts(args.prompts, categories, args.prompts_per_category)  # before the models: it is quick
    if args.seed + len(prompts) - 1 > MAX_SEED:
        raise ValueError(f"--seed {args.seed}: prompt i runs with seed + i, and {len(prompts)} prompts would pass "
                         f"2**63-1: use a seed up to {MAX_SEED - len(prompts) + 1}")
    models, broken = load_parts(args.ckpt, device, parts_for(["ar"] + wanted), args.dtype)
    names, notes = choose_methods(wanted, models, broken, args.ckpt)
    block = models.target.config.block_size
    if args.max_new_tokens >= block:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {block} tokens")
    cut = tokenize(prompts, models.tokenizer, block - args.max_new_tokens)
    if cut:
        notes.append(f"- {cut} prompt(s) kept only their last {block - args.max_new_tokens} tokens, to fit "
                     f"the context ({block}) with {args.max_new_tokens} new tokens")
    categories = list(dict.fromkeys(q["category"] for q in prompts))
    compare = compares(args, device)
    ledger = Ledger(cuda=device.startswith("cuda"))  # every timed part of every path adds to it
    paths = {}  # path ("eager", "static" or "graph") -> the models its rows run, each part in a Timed
    for runtime in ("static", "eager") if compare else (args.runtime,):
        prepared, path = prepare(models, runtime)
        paths[path] = timed_models(prepared, ledger)
    return dict(device=device, models=models, names=names, notes=notes, prompts=prompts, categories=categories,
                temperatures=temperatures, compare=compare, paths=paths, ledger=ledger)


def compares(args, device):
    """Whether the bench runs eager beside static: when asked (--compare-runtimes), and on CUDA with --runtime
    auto, where the replayed path is the point of the runtime and eager `ar` is what it is measured against."""
    return args.compare_runtimes or (args.runtime == "auto" and device.startswith("cuda"))


# ----------------------------------------------------------------------------- running the methods

def table_rows(names, temperature, paths=("eager",)):
    """The rows of one temperature's table, row label -> (method, options, path): every method with its defaults
    on the first of `paths` (the runtime paths, e.g. ("static", "eager") when comparing), and on each other path
    as a row "name (path)" right after it, so that eager and replayed show side by side. When sampling, also each
    method that has a --draft-sampling switch in its other modes, labelled like "eagle (topk)", so that the ways
    of drafting show side by side (at temperature 0 they are the same thing)."""
    rows = {}
    first, *others = paths
    for name in names:
        rows[name] = (name, {}, first)
        rows.update({f"{name} ({path})": (name, {}, path) for path in others})
        option = MODULES[name].OPTIONS.get("draft_sampling")
        default, modes = (option.default, option.choices) if option else (None, ())
        for mode in modes if temperature > 0 else ():
            if mode != default:
                rows[f"{name} ({mode})"] = (name, {"draft_sampling": mode}, first)
    return rows


def warm_up(paths, rows, prompt_ids, max_new_tokens, notes, ckpt=None):
    """One short run of every row at every temperature, on its path's models (`paths`: path -> models): the
    first calls pay for allocations, kernel choices and graph captures, which the timings must not. A row whose
    method prices its steps (--adaptive cost) first gets its step costs (nanospec/bench/calibration.py: read from
    ckpt/calibration.json, or measured there once). A row that fails here is dropped everywhere, with a
    '- skipped' line in `notes`; `ar` failing is an error (it is every speedup's baseline)."""
    dropped = {}
    for t, rows_t in rows.items():
        for label, (method, options, path) in rows_t.items():
            if label in dropped:
                continue
            try:
                calibration.attach(paths[path], ckpt, [(method, t, options)], path, log=log)
                METHODS[method](paths[path], prompt_ids, min(8, max_new_tokens), temperature=t, seed=0, **options)
            except Exception as e:  # one broken method must not sink the whole table
                if label == "ar":
                    raise ValueError(f"ar, the baseline, fails: {one_line(e)}") from None
                dropped[label] = f"failed in its warm-up at temperature {t:g}: {one_line(e)}"
                log(f"skipped {label}: {dropped[label]}")
    notes += [f"- skipped {label}: {why}" for label, why in dropped.items()]
    return {t: {label: row for label, row in rows_t.items() if label not in dropped} for t, rows_t in rows.items()}


def count_host_work(paths, ledger, rows, prompt, temperature, max_new_tokens, seed, failed, reads, ops):
    """reads[row label] = host reads per target forward, ops[row label] = (aten ops, kernel launches) per target
    forward outside the model calls, from one untimed run of each row on `prompt` (timing.counting_host_reads
    patches every read and timing.counting_ops watches every op, which slows both: never inside a timed run;
    `ledger` is the one the Timed parts of `paths` share: it tells the model calls' ops apart). A row that
    raises is reported in `failed`."""
    for label, (method, options, path) in rows.items():
        if label in failed:
            continue
        try:
            with counting_host_reads() as counts, counting_ops(ledger) as counter:
                _, stats = METHODS[method](paths[path], prompt["ids"], max_new_tokens, temperature=temperature,
                                           seed=seed, **options)
        except Exception as e:
            failed[label] = (f"{one_line(e)} (prompt {prompt['id']}, temperature {temperature:g}, counting reads "
                             "and ops)")
            log(f"FAILED {label}: {failed[label]}")
            continue
        forwards = stats["target_forwards"]
        reads[label] = sum(counts.values()) / forwards
        ops[label] = (counter.total / forwards, counter.launches / forwards)


def run_all(paths, ledger, rows, prompts, temperature, max_new_tokens, repeats, seed, failed, results, finished):
    """results[row][prompt id] = dict(ids, stats, seconds (median over repeats), timing), filled in place (a Ctrl-C
    keeps what was measured), rows as table_rows gives them, each run on its path's models; each prompt's id is
    appended to `finished` once every row has run it. timing (the last repetition's): its wall seconds, and what the
    Timed parts added to the ledger: drafting and target-forward seconds, drafter passes, target forwards.
    For each prompt and repetition `ar` and every row run back to back, so that a slow minute of the shared
    machine hits all of them alike; the order rotates so that no row always runs first. A row on a replayed path
    (static, graph) first runs each prompt REPLAY_WARMUPS times untimed. A row that raises is reported in `failed`
    and left out from then on."""
    names = list(rows)
    for name in names:
        results.setdefault(name, {})

    def run(name, i, p, clock=timed):  # clock(fn, ...) of one row on prompt i (timed: ((ids, stats), seconds)),
        # or None once its failure is filed
        method, options, path = rows[name]
        try:
            return clock(METHODS[method], paths[path], p["ids"], max_new_tokens, temperature=temperature,
                         seed=seed + i, **options)
        except Exception as e:  # one broken method must not sink the whole table
            failed[name] = f"{one_line(e)} (prompt {p['id']}, temperature {temperature:g})"
            log(f"FAILED {name}: {failed[name]}")

    for i, p in enumerate(prompts):
        times = {name: [] for name in names}
        for name in (n for n in names if rows[n][2] != "eager"):  # a replayed path: untimed runs first
            for _ in range(REPLAY_WARMUPS):
                if name not in failed:
                    run(name, i, p, clock=lambda fn, *args, **kwargs: fn(*args, **kwargs))
        for r in range(repeats):
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                if name in failed:
                    continue
                ledger.clear()
                got = run(name, i, p)
                if got is None:
                    continue
                (ids, stats), seconds = got
                times[name].append(seconds)
                results[name][p["id"]] = dict(ids=ids, stats=stats, timing=dict(wall=seconds, **ledger.totals()))
        for name in names:
            if times[name] and name not in failed:
                results[name][p["id"]]["seconds"] = statistics.median(times[name])
        finished.append(p["id"])
        log(f"temperature {temperature:g}: {p['id']} done ({i + 1}/{len(prompts)})")
    return results


# ----------------------------------------------------------------------------- forward cost and drafter cost

def cached(model, prefix_len, gen):
    """A KV cache of `model` (as runtime.prepare wrapped it, or not) holding prefix_len random tokens (as after a
    prompt) and 64 more random ids to feed, (1, prefix_len + 64), made on the model's device with `gen` (a
    generator on that device). Returns (cache, ids)."""
    device = model.wte.weight.device
    ids = torch.randint(0, model.config.vocab_size, (1, prefix_len + 64), generator=gen, device=device)
    cache = model.new_cache()
    model(ids[:, :prefix_len], cache=cache)
    return cache, ids


@torch.inference_mode()
def step_calls(jobs, prefix_len):
    """A callable for each job (model, n, temperature): one forward of `model` over n new tokens on top of a
    cached prefix of prefix_len tokens, then, unless temperature is None, picking the next token from the
    last position as a decoding step does (warp + sample). `fastest` times them. Every tensor and generator
    is made on the model's device (a CPU generator cannot sample CUDA probabilities)."""
    gens, caches = {}, {}
    for model, _, _ in jobs:
        if id(model) not in caches:  # one cache per model, filled once with random tokens of its own seed
            device = model.wte.weight.device
            gens[id(model)] = torch.Generator(device=device).manual_seed(0)
            caches[id(model)] = cached(model, prefix_len, gens[id(model)])

    def call(model, n, temperature):
        cache, ids = caches[id(model)]

        def run():
            cache.rollback(prefix_len)
            logits = model(ids[:, prefix_len:prefix_len + n], cache=cache).logits[0, -1]  # (V,)
            if temperature is not None:
                sample(warp(logits, temperature, None, None), gens[id(model)])
        return run
    return [call(*job) for job in jobs]


def forward_costs(models, names, temperatures, quick, runtime="auto"):
    """Target forward cost against n, on top of a ~100-token cached prefix (as after a prompt); and, for
    Leviathan's model of `speculative`, the draft's forward and decoding step (forward + warp + sample) against
    the target's, timed in turns. The models run as runtime.prepare(models, runtime) wraps them (static:
    replayed from CUDA graphs on CUDA, from the second call of a shape on). Returns (cost {n: seconds}, step
    {(is draft, temperature or None): seconds}, prefix length, repetitions, the path: eager, static or graph)."""
    models, path = prepare(models, runtime)
    sizes = list(range(1, 9 if quick else 65))
    prefix = min(100, models.target.config.block_size - max(sizes))
    reps = 3 if quick else 21  # the first timed round of a static shape captures its graph: min() leaves it out
    jobs = [(models.target, n, None) for n in sizes]
    if "speculative" in names:
        jobs += [(m, 1, t) for t in temperatures for m in (models.target, models.draft)] + [(models.draft, 1, None)]
    calls = step_calls(jobs, prefix)
    log(f"timing target forwards over n = 1..{max(sizes)} tokens ({path})")
    seconds = fastest(calls, reps)
    cost = dict(zip(sizes, seconds))
    step = {(job[0] is models.draft, job[2]): s for job, s in zip(jobs[len(sizes):], seconds[len(sizes):])}
    return cost, step, prefix, reps, path


def drafter_costs(results, names, cost_1, suffix=""):
    """{method: c} for every method that drafts with a trained part: its drafting seconds per drafter pass, as
    the Timed parts measured them, summed over its timed runs at every temperature (the rows labelled name +
    suffix, e.g. " (eager)"), over one target forward over 1 token (cost_1 seconds, on the same path); None for a
    method that made no drafter pass (mtp and medusa: their heads are the target's; or every step was plain)."""
    c = {}
    for name in (n for n in names if parts_for([n])):
        runs = [r["timing"] for by_prompt in results.values() for r in by_prompt.get(name + suffix, {}).values()]
        seconds, passes = sum(r["drafting"] for r in runs), sum(r["passes"] for r in runs)
        c[name] = seconds / passes / cost_1 if passes else None
    return c


# ----------------------------------------------------------------------------- the whole bench

def costs(models, names, temperatures, args, paths):
    """The forward costs (forward_costs) on each runtime path the rows ran, the table's own first. Returns
    {"": (cost, step, prefix, reps, path)} plus " (eager)": the same on the eager path, when comparing."""
    first, *others = paths
    got = {"": forward_costs(models, names, temperatures, args.quick, "eager" if first == "eager" else "static")}
    if others:
        got[" (eager)"] = forward_costs(models, names, temperatures, args.quick, "eager")
    return got


def measure(args, argv, setup, rows):
    """Count each row's host reads and ops, time every row at every temperature, then the forward costs;
    everything the report reads, as a Measured. Ctrl-C stops the measuring: the Measured then holds what finished
    (see finished_part) and says why it is partial; forward costs that fail (or were never reached) are left out."""
    names, temperatures, paths = setup["names"], setup["temperatures"], setup["paths"]
    failed, results, reads, ops, finished = {}, {}, {}, {}, {}
    t_start, load_before = time.perf_counter(), report.load_average()
    partial, by_path = None, None
    try:
        for t in temperatures:
            results[t], reads[t], ops[t], finished[t] = {}, {}, {}, []
            count_host_work(paths, setup["ledger"], rows[t], setup["prompts"][0], t, args.max_new_tokens, args.seed,
                            failed, reads[t], ops[t])
            run_all(paths, setup["ledger"], rows[t], setup["prompts"], t, args.max_new_tokens, args.repeats,
                    args.seed, failed, results[t], finished[t])
        try:
            by_path = costs(setup["models"], names, temperatures, args, list(paths))
        except Exception as e:  # noqa: BLE001 - the table stands without them
            setup["notes"].append(f"- forward costs not measured: {one_line(e)}")
            log(f"forward costs not measured: {one_line(e)}")
    except KeyboardInterrupt:
        partial = f"interrupted (Ctrl-C) after {time.perf_counter() - t_start:.0f}s of measurements"
    temperatures, prompts = finished_part(temperatures, setup["prompts"], finished)
    results = {t: {label: {p["id"]: by_prompt[p["id"]] for p in prompts if p["id"] in by_prompt}
                   for label, by_prompt in results[t].items()} for t in temperatures}
    cost, step, prefix, reps, path = by_path[""] if by_path else (None, None, None, None, None)
    eager = (by_path or {}).get(" (eager)")
    return report.Measured(
        args=args, command=" ".join(argv if argv is not None else sys.argv[1:]), models=setup["models"],
        device=setup["device"], prompts=prompts, categories=list(dict.fromkeys(q["category"] for q in prompts)),
        temperatures=temperatures, names=names, rows={t: rows[t] for t in temperatures}, results=results,
        notes=setup["notes"], failed=failed, cost=cost, prefix=prefix, reps=reps, step=step,
        c=drafter_costs(results, names, cost[1]) if cost else {}, seconds=time.perf_counter() - t_start,
        loads=(load_before, report.load_average()), reads={t: reads[t] for t in temperatures},
        ops={t: ops[t] for t in temperatures},
        cost_path=path or "eager", cost_eager=eager and eager[0],
        c_eager=eager and drafter_costs(results, names, eager[0][1], " (eager)"), partial=partial)


def finished_part(temperatures, prompts, finished):
    """What a report can stand on after a Ctrl-C: every temperature whose prompts all finished; if not even the
    first did, the prompts it finished. Returns (temperatures, prompts)."""
    done = [t for t in temperatures if len(finished.get(t, ())) == len(prompts)]
    if done:
        return done, prompts
    first = finished.get(temperatures[0], [])
    return ([temperatures[0]], [p for p in prompts if p["id"] in first]) if first else ([], [])


def write(args, text, quiet=False, **figures):
    """Write the report to --out and merge `figures` into --json (make figures reads it: a batch run keeps the
    method table's numbers, and the other way round), then print it: the files first, so that a reader who
    closes the pipe early (`make bench | head`) loses nothing. A file that cannot be written is a one-line error
    after the report is printed."""
    problem = None
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            with open(args.json, encoding="utf-8") as f:
                old = json.load(f)
            old = old if isinstance(old, dict) else {}
        except (OSError, ValueError):  # none yet, or not ours: start afresh
            old = {}
        write_atomic(args.json, json.dumps({**old, **figures}, indent=1))
        if not quiet:  # after a Ctrl-C, one line says it all (main's last)
            log(f"wrote {args.out} and {args.json}")
    except OSError as e:
        problem = f"error: could not write the report ({one_line(e)}); it is printed above"
    print(text)
    sys.stdout.flush()
    if problem:
        sys.exit(problem)
    return figures


def main(argv=None):
    args = parse_args(argv)
    try:
        setup = set_up(args)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    names, prompts, paths = setup["names"], setup["prompts"], list(setup["paths"])
    log(f"settings: {len(prompts)} prompts ({args.prompts_per_category} per category), {args.max_new_tokens} new "
        f"tokens, temperatures {args.temperatures}, {args.repeats} repeat(s), device {setup['device']}, "
        f"{args.dtype}, {torch.get_num_threads()} thread(s), runtime {args.runtime} ({' and '.join(paths)} path"
        f"{'s' * (len(paths) > 1)}), methods {', '.join(names)}")
    for line in setup["notes"]:
        log(line[2:])
    if args.batch_sizes is not None:
        text, batch, title, partial = bench_batch.run(args, setup, log)
        if text is None:
            return interrupted("interrupted (Ctrl-C) before the first batch size finished: no report written")
        got = write(args, text, quiet=bool(partial), batch=batch, batch_title=title)
        return interrupted(f"{partial}: wrote the partial batch table ({args.out})") if partial else got
    try:
        rows = warm_up(setup["paths"], {t: table_rows(names, t, paths) for t in setup["temperatures"]},
                       prompts[0]["ids"], args.max_new_tokens, setup["notes"], args.ckpt)
    except ValueError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        return interrupted("interrupted (Ctrl-C) in the warm-up, before anything was measured: no report written")
    setup["names"] = [n for n in names if all(n in rows_t for rows_t in rows.values())]
    measured = measure(args, argv, setup, rows)
    if not measured.temperatures:
        return interrupted(f"{measured.partial}, before the first prompt finished: no report written")
    text, summaries = report.build(measured)
    figures = {name: {("greedy" if t == 0 else f"t={t:g}"): [s[name]["all"]["tokens_per_forward"],
                                                            s[name]["all"]["speedup"]]
                      for t, s in summaries.items() if name in s and s[name]["all"]["speedup"] is not None}
               for name in setup["names"]}
    write(args, text, quiet=bool(measured.partial), methods={name: by for name, by in figures.items() if by},
          title=f"{report.machine()}; {args.max_new_tokens} new tokens, batch size 1")
    if measured.partial:
        return interrupted(f"{measured.partial}: wrote the partial report ({args.out})")
    return dict(summaries=summaries, skipped=setup["notes"], failed=measured.failed, report=text,
                results=measured.results, reads=measured.reads, ops=measured.ops)


def interrupted(line):
    """Ctrl-C: one line, and the exit status a shell expects of it (128 + SIGINT)."""
    log(line)
    sys.exit(130)


if __name__ == "__main__":
    main()
