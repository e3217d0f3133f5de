"""
`make gpu-check`: does every method run on this GPU? On CUDA, with the trained checkpoints in out/:

    1. every method at greedy, at temperature 1, and at temperature 0.7 with top-p 0.9, on a few prompts and
       seeds (which path a run takes, and so which tensors it makes, varies with the seed);
    2. every method's greedy output equal to `ar`'s, token for token (every method is lossless with its default
       options; fp32 by default, as the README's figures);
    3. batched decoding (`ar`, `speculative`, `prompt-lookup` on the prompts as one batch, rows "batch: name"): every
       setting runs, and greedy each row equals `ar` run on that prompt alone;
    4. the bench's `--quick` run to completion: no method failed or skipped;
    5. (--runtime static, the default) the static path against eager: every method runs every setting again on
       the models runtime.prepare(models, "static") wraps (a row "name (static)": forwards replayed from CUDA
       graphs on CUDA, from their emulation, graphs.Emulated, on a CPU), no capture may fail (a failed one
       makes that model run eager from then on), and its greedy output equals its own eager output token for
       token; the other rows run on the eager models, and the quick bench compares the two paths
       (--compare-runtimes).

As it goes it says what it does, on standard error: a line per method and path, each setting's verdict added
as it finishes, and the bench's own progress. Then it prints a grid (method x setting: ok or FAIL), one line
per failure, and a last line with the count; the exit status is 0 when everything passed. On a CPU it runs on
one torch thread (--threads N to change): a model this size gains nothing from more, and on a machine where
anything else runs the threads wait on each other (two busy cores made the check take over 20 minutes with
torch's default of two threads, about one and a half with one). Without a GPU it says so in one line and runs the same checks on the
CPU, where the static path's replays are emulated: what a CUDA graph would freeze, the emulation freezes too, so
a Python value baked into a forward fails here as it would on a GPU (the tests run it on toy checkpoints).

    python -m nanospec.gpu_check                                  # `make gpu-check`: CUDA (else the CPU), out/
    python -m nanospec.gpu_check --device cpu --ckpt /tmp/run/out --dtype float64
    python -m nanospec.gpu_check --runtime eager                  # the eager path only, no comparison
"""
import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time

if __name__ == "__main__":  # first, before torch loads: Ctrl-C and a closed pipe end it in one line or quietly
    from nanospec.device import plain_exits
    plain_exits()

import torch

from nanospec.bench import compare as bench
from nanospec.model.checkpoint import CheckpointError
from nanospec.decoding import MODULES, METHODS, check_method, parts_for
from nanospec.decoding.batched import BATCHED, generate as generate_batch
from nanospec.device import add_threads_flag, pick_device, set_threads
from nanospec.model.load import PARTS
from nanospec.fast.runtime import Fast, prepare

# (column label, sampling keywords every method's generate takes)
SETTINGS = (
    ("greedy", dict(temperature=0.0)),
    ("t=1", dict(temperature=1.0)),
    ("t=0.7 top-p=0.9", dict(temperature=0.7, top_p=0.9)),
)
PROMPTS = ("def fibonacci(n):\n    ", "import os\n\n\nclass Reader:\n    \"\"\"Read a file", "The value of x is")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Run every method at greedy and sampled settings on a GPU, check "
                                            "greedy outputs against ar's, and run the quick bench.")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, mps, or cpu (the same checks, for tests)")
    add_threads_flag(p)
    p.add_argument("--ckpt", default="out", help="folder with the trained checkpoints (`make train` writes out/)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="float64 rules out near-ties of an untrained toy model (tests)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per run (default 32)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per prompt and setting (default 3)")
    p.add_argument("--prompts", default="data/prompts.json", help="the bench's prompt file")
    p.add_argument("--runtime", default="static", choices=["static", "eager"],
                   help="static (default): also run every method on the static path (runtime.prepare) and "
                        "compare it with eager; eager: the eager path only")
    args = p.parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--seeds", args.seeds)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    return args


def no_gpu(device):
    """The one line to print when the device asked for is not here, or None when it is."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return ("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): the same checks on the CPU, "
                "CUDA-graph replay emulated")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return "gpu-check: no MPS device here: the same checks on the CPU, CUDA-graph replay emulated"
    return None


# a method's other way of drafting that its defaults no longer run, checked as a row of its own
VARIANTS = {"eagle --tree dynamic": ("eagle", {"tree": "dynamic"})}  # EAGLE-2's tree (the default: a chain)


def rows_of(name, runtime):
    """The grid's rows for one method, label -> the runtime path it runs: the method itself (eager) and, when
    runtime is static, "name (static)"."""
    return {name: "eager", **({f"{name} (static)": "static"} if runtime == "static" else {})}


def paths_of(models, args):
    """{"eager": the models, "static": runtime.prepare(models, "static")'s (with --runtime static)}, and the
    line to report for every static row when that path is not the one this device should take, or None."""
    paths = {"eager": models}
    if args.runtime != "static":
        return paths, None
    paths["static"], path = prepare(models, "static")
    replayed = "graph" if args.device.startswith("cuda") else "static"  # CUDA graphs, or their emulation
    return paths, None if path == replayed else f"runtime.prepare took the {path} path, not {replayed}"


def progress(text, end="\n"):
    """What the check is doing, on standard error (standard output is the report), at once."""
    print(text, end=end, file=sys.stderr, flush=True)


def checked_row(label, check):
    """One row of the grid, said as it goes: 'gpu-check: eager (static): greedy ok, t=1 FAIL, ... (3.1 s)'.
    check(setting, sampling) -> None or the failure. Returns {setting: None or the failure}."""
    t0, row = time.perf_counter(), {}
    progress(f"gpu-check: {label}:", end="")
    for i, (setting, sampling) in enumerate(SETTINGS):
        row[setting] = check(setting, sampling)
        progress(f"{',' * (i > 0)} {setting} {'FAIL' if row[setting] else 'ok'}", end="")
    progress(f" ({time.perf_counter() - t0:.1f} s)")
    return row


def run_methods(models, args):
    """grid[row][setting] = None (passed) or the first failure, as one line; rows as rows_of gives them. Each row
    is said on standard error as it runs (checked_row)."""
    encoded = [models.tokenizer.encode(text) for text in PROMPTS]
    reference = {}  # (prompt index, seed) -> ar's greedy output
    paths, wrong_path = paths_of(models, args)
    grid = {}
    variants = [(row, (name, options)) for row, (name, options) in VARIANTS.items() if name in MODULES]
    for row, (name, options) in [*((n, (n, {})) for n in MODULES), *variants]:  # ar first: the reference
        rows = rows_of(row, args.runtime)
        try:
            check_method(name, models, args.ckpt)  # a missing part: the command trains it into this very folder
        except ValueError as e:
            grid.update({label: {s: f"cannot run: {e}" for s, _ in SETTINGS} for label in rows})
            progress(f"gpu-check: {name}: cannot run: {e}")
            continue
        eager = {}  # (prompt index, seed) -> this method's greedy output on the eager path
        for label, path in rows.items():
            static = path == "static"
            grid[label] = checked_row(label, lambda s, sampling: wrong_path if static and wrong_path else
                                      first_failure(name, paths[path], encoded, {**sampling, **options}, args,
                                                    eager if static else reference, None if static else eager))
    for name in [n for n in BATCHED if n in MODULES]:  # after ar: its outputs are the reference
        eager = {}
        for label, path in rows_of(f"batch: {name}", args.runtime).items():
            grid[label] = checked_row(label, lambda s, sampling: wrong_path if path == "static" and wrong_path else
                                      first_batch_failure(name, paths[path], encoded, sampling, args,
                                                          *((eager, None) if path == "static" else (reference, eager))))
    return grid


def first_batch_failure(name, models, encoded, sampling, args, reference, record=None):
    """first_failure for batched decoding: every prompt as one batch, once per seed; greedy, row i must equal
    reference[(i, seed)] (ar alone on prompt i; on the static path, the eager batch's row, which the eager run
    kept in `record`)."""
    for seed in range(args.seeds):
        try:
            rows, _ = generate_batch(models, encoded, args.max_new_tokens, method=name, seed=seed, **sampling)
        except Exception as e:
            return f"seed {seed}: {bench.one_line(e)}"
        if given_up(models, name):
            return f"seed {seed}: the {', '.join(given_up(models, name))}'s graph capture failed: it ran eager"
        for i, out in enumerate(rows if sampling["temperature"] == 0 else []):
            if record is not None:
                record[(i, seed)] = out
            if out != reference[(i, seed)]:
                return f"seed {seed}: greedy row {i} differs from {'ar alone' if record is not None else 'eager'}"
    return None


def given_up(models, name):
    """The wrapped parts method `name` runs whose graphs were given up (a capture failed: runtime.Fast then runs
    them eager). Only its own parts: one method's failed capture is not another's."""
    return [part for part in ("target", *parts_for([name])) if isinstance(getattr(models, part, None), Fast)
            and not getattr(models, part).graphs.enabled]


def first_failure(name, models, encoded, sampling, args, reference, record=None):
    """Run one method on `models` (eager, or runtime.prepare's) with `sampling` over every prompt and seed; the
    first error, failed capture or greedy mismatch, or None. reference: (prompt index, seed) -> the greedy
    output to equal (ar's; a static run's: the same method's eager output); a key it lacks is set by this run.
    record: where to keep this run's greedy outputs (an eager run's, for its static row)."""
    static = isinstance(models.target, Fast)
    against = "eager's" if static else "ar's"
    for i, ids in enumerate(encoded):
        for seed in range(args.seeds):
            try:
                out, _ = METHODS[name](models, ids, args.max_new_tokens, seed=seed, **sampling)
            except Exception as e:
                return f"prompt {i}, seed {seed}: {bench.one_line(e)}"
            if given_up(models, name):
                return (f"prompt {i}, seed {seed}: the {', '.join(given_up(models, name))}'s graph capture failed: "
                        f"it ran eager")
            if sampling["temperature"] == 0:
                want = reference.setdefault((i, seed), out)  # ar runs first and sets it
                if record is not None:
                    record[(i, seed)] = out
                if out != want:
                    at = next((j for j, (a, b) in enumerate(zip(out, want)) if a != b), min(len(out), len(want)))
                    where = " on the static path" if static else ""
                    return f"prompt {i}, seed {seed}: greedy output{where} differs from {against} at token {at}"
    return None


class Prefixed:
    """A text stream that writes each line to `stream` after `prefix`: the bench's progress, said as its own."""

    def __init__(self, stream, prefix):
        self.stream, self.prefix, self.start = stream, prefix, True

    def write(self, text):
        for piece in re.split(r"(?<=\n)", text):
            if piece:
                self.stream.write(self.prefix * self.start + piece)
                self.start = piece.endswith("\n")
        self.stream.flush()
        return len(text)

    def flush(self):
        self.stream.flush()


def run_bench(args):
    """The bench's --quick run on this device, its progress lines passed on to standard error. Returns None when
    it completed with every method, else why not."""
    progress("gpu-check: bench --quick: every method on the quick prompts, against ar")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:  # its report and JSON: not kept
        argv = ["--quick", "--device", args.device, "--ckpt", args.ckpt, "--dtype", args.dtype, "--prompts",
                args.prompts, "--out", os.path.join(folder, "bench_results.md"), "--threads", str(args.threads)]
        argv += ["--compare-runtimes"] if args.runtime == "static" else []
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(Prefixed(sys.stderr,
                                                                                                "  bench ")):
                got = bench.main(argv)
        except SystemExit as e:
            return f"stopped: {e.code}"
        except Exception as e:
            return f"crashed: {bench.one_line(e)}"
    problems = [line[2:] for line in got["skipped"] if line.startswith("- skipped")]
    problems += [f"FAILED {name}: {why}" for name, why in got["failed"].items()]
    return "; ".join(problems) or None


DEVICES = re.compile(r"cpu|mps|cuda(:\d+)?")


def main(argv=None):
    args = parse_args(argv)
    if not DEVICES.fullmatch(args.device):
        print(f"gpu-check: unknown --device {args.device!r}: use cuda (the default), cuda:N, mps or cpu")
        return 1
    why = no_gpu(args.device)
    if why:
        print(why)
        args.device = "cpu"
    try:
        pick_device(args.device)  # cuda:N with fewer GPUs: one line
        threads = set_threads(args.threads)
    except ValueError as e:
        print(f"gpu-check: {e}")
        return 1
    if not all(os.path.exists(os.path.join(args.ckpt, f)) for f in ("tokenizer.tiktoken", "target.pt")):
        print(f"gpu-check: no trained checkpoints in {args.ckpt}/: run `make train` first (or pass --ckpt FOLDER)")
        return 1
    progress(f"gpu-check: loading {args.ckpt}/ on {args.device}" + (f", {threads} torch thread{'s' * (threads > 1)}"
                                                                    if args.device == "cpu" else ""))
    try:
        models, broken = bench.load_parts(args.ckpt, args.device, PARTS, args.dtype)
    except (CheckpointError, ValueError) as e:
        print(f"gpu-check: {e}")
        return 1
    grid = run_methods(models, args)
    failures = [f"part {part}: {reason}" for part, reason in broken.items()]
    failures += [f"{name} at {label}: {why}" for name, row in grid.items() for label, why in row.items() if why]
    print(f"gpu-check on {bench.report.device_name(args.device)} ({args.dtype}, torch {torch.__version__}): every "
          f"method x setting, {len(PROMPTS)} prompts x {args.seeds} seeds, {args.max_new_tokens} tokens"
          + ("; \"name (static)\": replayed (CUDA graphs on CUDA, emulated on a CPU), greedy against its eager output"
             if args.runtime == "static" else ""))
    print(bench.report.table(["method", *[label for label, _ in SETTINGS]],
                             [[name, *["FAIL" if row[label] else "ok" for label, _ in SETTINGS]]
                              for name, row in grid.items()]))
    bench_problem = run_bench(args)
    print(f"bench --quick: {'FAIL: ' + bench_problem if bench_problem else 'ok, every method ran'}")
    failures += [f"bench --quick: {bench_problem}"] if bench_problem else []
    for line in failures:
        print(f"FAIL {line}")
    checks = len(grid) * len(SETTINGS) + 1
    print(f"gpu-check: {len(failures)} failure(s)" if failures else f"gpu-check: all {checks} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # here, not at exit: a reader that closed the pipe ends it quietly (plain_exits)
    sys.exit(code)
