"""
Generate text with any decoding method and see which tokens each target forward produced.

    python decode.py --method ar --prompt "def fibonacci(n):"
    python decode.py --method list
    echo "import os" | python decode.py --method ar --json
    python decode.py --method speculative --prompts-file prompts.txt --batch-size 8   # one prompt per line
    python decode.py --method eagle --temperature 1 --trace run.html   # every forward's decisions, as a page

The continuation is printed with the tokens of each target forward grouped: in [brackets], or on a terminal
(--color) in colour: green for the guesses the target accepted, then the target's own token on cyan or yellow,
alternating from one forward to the next. A method that produces several tokens per forward shows longer groups.
--trace FILE records every target forward's guesses and how the target judged them (nanospec/trace/record.py): .html is a
page to open in a browser, .json the same for scripts.
"""
import argparse
import json
import os
import re
import sys
import time

if __name__ == "__main__":  # first, before torch loads: Ctrl-C, a closed pipe and the terminal's encoding
    from nanospec.device import plain_exits
    plain_exits()

from nanospec.model.checkpoint import CheckpointError
from nanospec.decoding import MODULES, METHODS, check_method, parts_for
from nanospec.decoding.batched import BATCHED, generate as generate_batch
from nanospec.steps.options import MIN_TEMPERATURE, Sampling, read_options
from nanospec.device import add_runtime_flag, add_threads_flag, check_seed, pick_device, set_threads
from nanospec.bench import calibration
from nanospec.model.load import load_models
from nanospec.fast.runtime import RUNTIMES, prepare

GUESS = "\033[30;42m"  # black on green: a guess the target accepted
OWN = ("\033[30;46m", "\033[30;43m")  # black on cyan, black on yellow: the target's own token, forward by forward
RESET = "\033[0m"
LEGEND = (f"{GUESS}green{RESET}: guesses the target accepted; {OWN[0]}cyan{RESET}/{OWN[1]}yellow{RESET}: the "
          f"target's own token, one per forward")


def method_flags(parser):
    """Each method's OPTIONS become --kebab-case flags; a flag left unset lets the method use its default.
    Returns {option: [methods that take it]}."""
    seen = {}
    for method, module in MODULES.items():
        for name in module.OPTIONS:
            seen.setdefault(name, []).append(method)
    for name, methods in seen.items():
        opt = MODULES[methods[0]].OPTIONS[name]
        # each method's default, where it has one to show: a None (the help says what it stands for) or a switch
        # left off says nothing, and a help that states its default already ("(default 0.5)") is not repeated
        shown = [m for m in methods if MODULES[m].OPTIONS[name].default not in (None, False)]
        defaults = ", ".join(f"{m} {MODULES[m].OPTIONS[name].default}" for m in shown)
        unset = {}  # a None whose help ends "(default: what it stands for)", e.g. --verify's drawn trees: grouped
        for m in methods:
            said = re.search(r"\(default: ([^()]+)\)$", MODULES[m].OPTIONS[name].help)
            if MODULES[m].OPTIONS[name].default is None and said:
                unset.setdefault(said.group(1), []).append(m)
        defaults = "; ".join([defaults] * bool(defaults) + [f"{', '.join(ms)}: {d}" for d, ms in unset.items()])
        text = opt.help
        stated = re.search(r"\(default [^,)]+\)$", text)
        bounds = f"; {opt.low}..{opt.high}" if opt.high is not None else ""
        choices = {}  # the choices, when methods differ in them (--verify): each method's own, not the first's
        for m in methods:
            choices.setdefault(MODULES[m].OPTIONS[name].choices, []).append(m)
        if len(choices) > 1:
            bounds += "; choices: " + "; ".join(f"{', '.join(ms)}: {'|'.join(c)}" for c, ms in choices.items() if c)
        kwargs = {"action": "store_true"} if opt.type is bool else {"type": opt.type}
        if stated:  # "(default 0.5)" -> "(default 0.5; 0.0..1.0)"
            text = text[:-1] + bounds + ")"
        elif defaults or bounds:
            text += f" (default: {defaults}{bounds})" if defaults else f" ({bounds[2:]})"
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            help=f"[{', '.join(methods)}] {text}", **kwargs)
    return seen


MAX_BATCH = 1024  # rows decoded at once: a KV cache per row, so more would mostly run out of memory
DEFAULT_BATCH = 64  # without --batch-size: 64 rows at a time, whatever the number of prompts (memory stays bounded)
BATCH_OPTIONS = ("draft_len", "max_ngram")  # the method options batched decoding takes
SAMPLING_ONLY = ("top_k", "top_p", "draft_sampling", "verify", "seed")  # flags that change nothing at temperature 0


def as_text(data, what):
    """Bytes (argv's come back with surrogateescape, as typed) -> text, or a one-line ValueError naming `what`:
    bytes that are not UTF-8 would otherwise reach the tokenizer as U+FFFD or lone surrogates, silently. A prompt
    of nothing but whitespace is refused too, the same way everywhere."""
    if isinstance(data, str):
        try:
            data = data.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise ValueError(f"{what} holds a lone surrogate, which is not text: pass UTF-8 text") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): convert it "
                         f"first, e.g. with iconv") from None
    if not text.strip():
        raise ValueError(f"{what} is {'empty' if not text else 'only whitespace'}: give some text")
    return text


def read_prompt(args):
    """The prompt text, from --prompt or standard input (on a terminal, saying so: it waits for Ctrl-D)."""
    if args.prompt:
        return as_text(args.prompt[0], "the prompt")
    if not hasattr(sys.stdin, "buffer"):  # a text stream handed in by a caller
        return as_text(sys.stdin.read(), "the prompt")
    if sys.stdin.isatty():
        print("reading the prompt from standard input: type it, then Ctrl-D (or pass --prompt TEXT)",
              file=sys.stderr, flush=True)
    return as_text(sys.stdin.buffer.read(), "the prompt from standard input")


def read_prompts(args):
    """The prompts of a batch: every --prompt, then each line of --prompts-file (a literal \\n inside a line stands
    for a newline), as (text, where) pairs; `where` names the prompt in errors ('prompt 3 (line 1 of p.txt)'). An
    empty, whitespace-only or non-UTF-8 prompt is a one-line ValueError naming it."""
    given = [(p, f"prompt {i} (--prompt)") for i, p in enumerate(args.prompt or [], 1)]
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, "rb") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror or e}") from None
        given += [(line, f"line {i} of {args.prompts_file}") for i, line in enumerate(lines, 1)]
    if not given:
        raise ValueError("no prompts: give --prompt (several times) or a --prompts-file with one prompt per line")
    prompts = []
    for n, (data, where) in enumerate(given, 1):
        where = f"prompt {n} ({where})" if where.startswith("line") else where
        prompts.append((as_text(data, where).replace("\\n", "\n"), where))
    return prompts


def check_lengths(prompts, tokenizer, block_size):
    """Every prompt's token ids, or a one-line ValueError naming the first that does not fit the context."""
    encoded = []
    for text, where in prompts:
        ids = tokenizer.encode(text)
        if len(ids) >= block_size:
            raise ValueError(f"{where} is {len(ids)} tokens but the model's context is {block_size}: shorten it")
        encoded.append(ids)
    return encoded


def grouped(tokenizer, ids, groups, guesses, colour):
    """The continuation with each target forward's tokens marked: groups[n] tokens came out of forward n, the
    first guesses[n] of them accepted guesses, the rest (0 or 1) the target's own token. [brackets] per forward,
    or colour: the guesses in GUESS, the target's token in OWN, alternating."""
    parts, i = [], 0
    for n, (size, g) in enumerate(zip(groups, guesses)):
        if size == 0:
            continue
        if colour:
            parts += [f"{GUESS}{tokenizer.decode(ids[i:i + g])}{RESET}" if g else "",
                      f"{OWN[n % 2]}{tokenizer.decode(ids[i + g:i + size])}{RESET}" if size > g else ""]
        else:
            parts.append(f"[{tokenizer.decode(ids[i:i + size])}]")
        i += size
    return "".join(parts)


def colour_on(args):
    """--color: always, never, or auto: on a terminal, unless NO_COLOR is set (no-color.org) or TERM=dumb."""
    if args.color != "auto":
        return args.color == "always"
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def check_request(args, options):
    """The method, its options (bounds and choices, as generate checks them) and the sampling settings, checked
    before any model is loaded. Returns the method options that were set."""
    check_method(args.method)
    for name, methods in options.items():
        if getattr(args, name) is not None and args.method not in methods:
            raise ValueError(f"--{name.replace('_', '-')} is an option of {', '.join(methods)}, not of {args.method}")
    if args.json and getattr(args, "show_tree", None):
        raise ValueError("--show-tree prints the tree as text, which --json's one JSON object cannot hold: drop one")
    Sampling(args.temperature, args.top_k, args.top_p).check()
    check_seed(args.seed)
    kwargs = {name: getattr(args, name) for name in MODULES[args.method].OPTIONS if getattr(args, name) is not None}
    read_options(MODULES[args.method].OPTIONS, kwargs)
    # One rule for every flag that only matters when sampling: at temperature 0 it is refused, as --confidence
    # without --adaptive confidence is, rather than silently changing nothing.
    given = [n for n in SAMPLING_ONLY if getattr(args, n, None) is not None]
    if args.temperature == 0 and given:
        raise ValueError(f"--{given[0].replace('_', '-')} only matters when sampling: greedy decoding (--temperature "
                         f"0, the default) takes the target's most likely token whatever it says; drop it, or give "
                         f"a --temperature above 0")
    if args.trace is not None:
        if batch_mode(args):
            raise ValueError("--trace records the steps of one prompt's run: give one --prompt (a batch is decoded "
                             "without a trace)")
        from nanospec.trace import record as trace  # only when asked for: decoding without --trace never loads it
        trace.check_path(args.trace)  # before any model is loaded: a bad path costs nothing
    if batch_mode(args):
        if args.method not in BATCHED:
            several = len(args.prompt or []) > 1 or args.prompts_file is not None
            raise ValueError(f"batched decoding (several prompts, --prompts-file or --batch-size) runs "
                             f"{', '.join(BATCHED)}, not {args.method}: "
                             + ("give one --prompt" if several else "drop --batch-size"))
        if args.batch_size is not None and not 1 <= args.batch_size <= MAX_BATCH:
            raise ValueError(f"--batch-size must be in 1..{MAX_BATCH}, got {args.batch_size}")
        other = [n for n in kwargs if n not in BATCH_OPTIONS]
        if other:
            raise ValueError(f"--{other[0].replace('_', '-')} is not an option of batched decoding (it takes "
                             f"{', '.join('--' + n.replace('_', '-') for n in BATCH_OPTIONS)})")
    return kwargs


def batch_mode(args):
    """Several prompts (--prompt more than once, or --prompts-file) or --batch-size: decode them as batches."""
    return args.prompts_file is not None or args.batch_size is not None or len(args.prompt or []) > 1


STOPS = {"context": " (stopped: the model's context is full)", "eot": " (stopped at end-of-text)"}


def decode_batches(args, kwargs, models, path, prompts, encoded):
    """Decode the prompts in batches of --batch-size (default DEFAULT_BATCH); print each row's text (or, --json,
    one JSON object per row: JSON lines), then each batch's figures."""
    size = args.batch_size or DEFAULT_BATCH
    for first in range(0, len(prompts), size):
        chunk, ids_in = prompts[first:first + size], encoded[first:first + size]
        t0 = time.perf_counter()  # timed from outside: the methods hold no clock
        ids, stats = generate_batch(models, ids_in, args.max_new_tokens, method=args.method,
                                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                    seed=args.seed, **kwargs)
        stats["wall_time"] = time.perf_counter() - t0
        for i, ((prompt, where), row, row_stats) in enumerate(zip(chunk, ids, stats["rows"]), first + 1):
            if args.json:
                print(json.dumps({"method": args.method, "row": i, "prompt": prompt, "ids": row,
                                  "text": models.tokenizer.decode(row), "runtime": path, "stats": row_stats}))
                continue
            text = grouped(models.tokenizer, row, row_stats["accepted_per_step"], row_stats["guesses_per_step"],
                           colour_on(args))
            print(f"--- row {i}: {row_stats['new_tokens']} tokens, {row_stats['tokens_per_forward']:.2f} tokens/forward"
                  f"{STOPS.get(row_stats['stop'], '')}\n{prompt}{text}")
        if not args.json:
            print(f"\n=== {args.method}, batch of {len(chunk)}: {stats['new_tokens']} tokens, "
                  f"{stats['batch_forwards']} batched forwards, {stats['tokens_per_forward']:.2f} tokens/forward per "
                  f"row, {stats['wall_time']:.2f}s ({stats['new_tokens'] / max(stats['wall_time'], 1e-9):.1f} "
                  f"tokens/s) [runtime {path}]\n")


def parse_args(argv=None):
    """The flags (the methods' own from their option tables, method_flags) -> (args, the methods' options)."""
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--method", default="ar", help="decoding method, or 'list' to list them (default ar)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (default: read standard input); give it several times to decode a batch")
    p.add_argument("--prompts-file", default=None, help="a batch of prompts, one per line (\\n inside a line: a newline)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"rows decoded at once, 1..{MAX_BATCH} (default {DEFAULT_BATCH}); ar, speculative and "
                        "prompt-lookup only")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"0 = greedy (default); >= {MIN_TEMPERATURE} samples (smaller ones overflow: refused)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this much mass")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for sampling, 0..2**63-1 (same seed, same output; each seed its own)")
    p.add_argument("--ckpt", default="out",
                   help="folder with tokenizer.tiktoken and target.pt from `make train` (default out)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or mps")
    add_threads_flag(p)
    add_runtime_flag(p, RUNTIMES)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on one line instead (a batch: one per row, JSON lines; --method list: "
                        "the methods)")
    p.add_argument("--color", default="auto", choices=("auto", "always", "never"),
                   help="mark accepted guesses and the target's own tokens in colour: auto (default) = on a terminal, "
                        "unless NO_COLOR is set or TERM=dumb; else [brackets] per forward")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="record every target forward: the guesses, p(x) and q(x), the uniform drawn against "
                        "min(1, p/q), the verdict, the token emitted and its law, the KV cache (nanospec/trace/record.py); "
                        "FILE.html: a page to open in a browser, FILE.json: the same for scripts. One prompt; "
                        "an existing file that is not a trace is never replaced")
    options = method_flags(p)
    args = p.parse_args(argv)
    args.changed = [a.option_strings[0] for a in p._actions  # the flags given other than at their defaults
                    if a.option_strings and a.dest != "help" and getattr(args, a.dest) != a.default]
    return args, options


def tell(line):
    """A note about what decode.py is doing (calibrating): standard error, so that --json output stays one object."""
    print(line, file=sys.stderr, flush=True)


def summary(module):
    """A method's first sentence, whole: '`ar`: plain autoregressive decoding, ...' -> 'plain autoregressive
    decoding, one token per target forward.' (its docstring's first lines, joined)."""
    paragraph = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    return re.sub(r"^`[^`]+`:\s*", "", sentence)


def list_methods(args):
    """--method list: each method, what it needs beyond the target, and its first sentence (--json: as JSON)."""
    extra = [flag for flag in args.changed if flag not in ("--method", "--json", "--color")]
    if extra:
        raise ValueError(f"--method list lists the methods and takes no other flag but --json: drop {extra[0]}")
    methods = [{"name": name, "needs": list(module.NEEDS), "uses": list(module.USES), "summary": summary(module)}
               for name, module in MODULES.items()]
    if args.json:
        print(json.dumps({"methods": methods}))
        return
    for m in methods:
        needs = f" [needs {', '.join(m['needs'])}]" if m["needs"] else ""
        print(f"{m['name']:14s} {m['summary']}{needs}")


def main(argv=None):
    args, options = parse_args(argv)
    try:
        if args.method == "list":
            return list_methods(args)
        kwargs = check_request(args, options)  # everything that needs no model, before loading one
        set_threads(args.threads)
        batch = batch_mode(args)
        prompts = read_prompts(args) if batch else [(read_prompt(args), "the prompt")]
        models = load_models(args.ckpt, pick_device(args.device), parts_for([args.method]))  # only what it uses
        check_method(args.method, models, args.ckpt)  # a missing part: the command trains it into that folder
        encoded = check_lengths(prompts, models.tokenizer, models.target.config.block_size)
        models, path = prepare(models, args.runtime)  # the speed layer, chosen once: the method never knows
        if not batch:  # --adaptive cost prices its steps with this machine's step times: measured once, kept
            calibration.attach(models, args.ckpt, [(args.method, args.temperature, kwargs)], path, log=tell)
        if batch:
            return decode_batches(args, kwargs, models, path, prompts, encoded)
        prompt = prompts[0][0]

        def run_method(used):  # used: the models, or (--trace) the recording's wrappers around them
            t0 = time.perf_counter()  # timed from outside: the methods hold no clock
            ids, stats = METHODS[args.method](used, encoded[0], args.max_new_tokens, temperature=args.temperature,
                                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, **kwargs)
            stats["wall_time"] = time.perf_counter() - t0
            return ids, stats
        if args.trace is None:
            ids, stats = run_method(models)
        else:  # a layer around the models and the rules while the method runs (nanospec/trace/record.py)
            from nanospec.trace import record as trace
            settings = {"method": args.method, "temperature": args.temperature, "top_k": args.top_k,
                        "top_p": args.top_p, "seed": args.seed, "options": kwargs, "runtime": path,
                        "max_new_tokens": args.max_new_tokens}
            ids, stats, doc, size = trace.traced_run(models, run_method, encoded[0], args.trace, settings,
                                                     sys.argv[1:] if argv is None else argv)
            problems = f"; {len(doc['problems'])} decisions do not add up (see the page)" if doc["problems"] else ""
            tell(f"trace: {len(doc['steps'])} target forwards into {args.trace} ({size / 1024:.0f} KB){problems}")
    except (ValueError, CheckpointError) as e:
        sys.exit(f"error: {e}")

    text = models.tokenizer.decode(ids)
    if args.json:
        print(json.dumps({"method": args.method, "prompt": prompt, "ids": ids, "text": text, "runtime": path,
                          "stats": stats}))
        return
    colour = colour_on(args)
    print(prompt + grouped(models.tokenizer, ids, stats["accepted_per_step"], stats["guesses_per_step"], colour))
    if colour:
        print(LEGEND)
    note = STOPS.get(stats["stop"], "")
    if stats.get("no_draft_pays"):  # the cost rule priced every draft above a plain step on this machine
        note += " [no draft pays here: `ar`'s plain steps; --adaptive off drafts anyway]"
    note += f" [runtime {path}]"  # which forwards ran: eager PyTorch, static, or static replayed from CUDA graphs
    if args.trace is not None:
        note += " [traced: the time includes the recording]"
    print(f"\n--- {args.method}: {stats['new_tokens']} tokens, {stats['target_forwards']} target forwards, "
          f"{stats['tokens_per_forward']:.2f} tokens/forward, {stats['wall_time']:.2f}s "
          f"({stats['new_tokens'] / max(stats['wall_time'], 1e-9):.1f} tokens/s){note}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # here, not at exit: a reader that closed the pipe ends it quietly (plain_exits)
