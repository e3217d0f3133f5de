"""
`make figures`: the pictures in README.md and docs/, drawn by nanospec's own code from its own runs.

    speculative_step.png  one step of `speculative` on the trained model: the draft's guesses, the target's token
                          after each, which were accepted, and the target's own token
    tree_mask.png         one of medusa's trees of guesses on the trained model, the path the target kept, and the
                          tree's attention mask (nanospec/rules/tree.py)
    bench.png             each method's tokens per target forward and speedup over `ar`, greedy and temperature 1
                          (from the bench's bench_results.json)
    speedup_curves.png    speedup against tokens per forward, each method a point, with the curves a drafter of
                          cost c per guess allows (Leviathan et al.: speedup = tokens per forward / (1 + k c))
    batch.png             batched decoding: tokens/s and speedup over batched `ar` against the batch size, the
                          crossover marked (from the bench's batch table, --batch-sizes)
    trace.png             the trace page (nanospec/trace/record.py) of an `eagle` run at temperature 1 on the trained
                          model, as headless Chromium shows it (nanospec/trace/browser.py; skipped without chromium)

    python -m nanospec.bench.figures                     # out/ and bench_results.json -> runs/figures/ (git ignores it)
    python -m nanospec.bench.figures --out docs/figures  # the README's own (make figures OUT=docs/figures)

matplotlib is the one optional dependency (pip install matplotlib): nothing else in nanospec needs it. A figure
whose input is missing is skipped with a line saying which command makes it. Each PNG is written to a temporary
file and renamed into place, so Ctrl-C never leaves half a picture; a reader that goes away (`| head -1`) stops
the printing, not the drawing. The three figures from the trained model run it on one torch thread (--threads).
"""
import argparse
import json
import os
import sys

if __name__ == "__main__":  # first, before torch loads: Ctrl-C ends in one line, a closed pipe stops no figure
    from nanospec.device import plain_exits
    plain_exits(keep_going=True)

import torch

from nanospec.device import add_threads_flag, set_threads

MISSING = "the figures need matplotlib, which nanospec needs for nothing else: pip install matplotlib"


def pyplot():
    """matplotlib.pyplot without a screen, or a one-line error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"error: {MISSING}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    """Write the figure to `path` whole or not at all: a temporary file beside it, renamed over it."""
    fig.tight_layout()
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}.png"  # .png: savefig picks the format by the name
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        pyplot().close(fig)
    print(f"wrote {path}", flush=True)


def draw_step(path, context, drafts, targets, n_accepted):
    """One speculative step: context (str, the text before), drafts (k strings: the draft's guesses), targets (k+1
    strings: the target's token after the context and after each guess), n_accepted. Three rows of boxes: the
    guesses (green if accepted, red the first rejected, grey after), the target's tokens, what was emitted."""
    plt = pyplot()
    k = len(drafts)
    fig, ax = plt.subplots(figsize=(1.6 * (k + 2), 3.0))
    ax.set_xlim(-1.6, k + 1.2), ax.set_ylim(-0.4, 3.2), ax.axis("off")

    def box(x, y, text, colour):
        ax.text(x, y, repr(text)[1:-1], ha="center", va="center", family="monospace", fontsize=10,
                bbox=dict(boxstyle="round,pad=0.35", fc=colour, ec="black", lw=0.6))

    ax.text(-1.5, 2.6, "draft guesses", fontsize=9, ha="left")
    ax.text(-1.5, 1.6, "target, after each", fontsize=9, ha="left")
    ax.text(-1.5, 0.6, "emitted", fontsize=9, ha="left")
    for i, d in enumerate(drafts):
        box(i + 0.5, 2.3, d, "#9be39b" if i < n_accepted else "#f19a9a" if i == n_accepted else "#dddddd")
    for i, t in enumerate(targets):
        box(i + 0.5, 1.3, t, "#cfe3ff")
    for i, t in enumerate(drafts[:n_accepted] + [targets[n_accepted]]):
        box(i + 0.5, 0.3, t, "#9be39b" if i < n_accepted else "#ffe08a")
    ax.set_title(f"after \"{repr(tail(context))[1:-1]}\"\n{k} guesses, one target forward, {n_accepted} accepted "
                 f"+ the target's own token = {n_accepted + 1} tokens", fontsize=9)
    save(fig, path)


def tail(text, width=60):
    """The end of `text` in at most `width` characters, cut where a reader expects a cut: at a line break, else
    after a space, never inside a word ('...' marks the cut). tail('import os\\ndef main(', 12) -> '...def main('."""
    if len(text) <= width:
        return text
    end = text[-width:]
    for sep in ("\n", " "):
        if sep in end[:-1]:
            return "..." + end[end.index(sep) + 1:]
    return "..." + end


def draw_tree(path, labels, parents, kept, mask):
    """A tree of guesses and its attention mask: labels (N strings), parents (N,), kept (the accepted nodes, root
    included), mask (N, N) bool among the nodes (tree.tree_mask without the prefix)."""
    plt = pyplot()
    from nanospec.rules.tree import children, depths
    kids, depth, y = children(parents), depths(parents), {}

    def place(u):  # leaves top to bottom in depth-first order, a parent at the middle of its children
        for c in kids[u]:
            place(c)
        y[u] = sum(y[c] for c in kids[u]) / len(kids[u]) if kids[u] else float(sum(not kids[v] for v in y))

    place(0)
    order = [u for u in y if not kids[u]]
    fig, (ax, am) = plt.subplots(1, 2, figsize=(10, 0.45 * len(parents) + 1.5),
                                 gridspec_kw=dict(width_ratios=[1.4, 1]))
    for u, p in enumerate(parents):
        if p >= 0:
            ax.plot([depth[p], depth[u]], [y[p], y[u]], color="black" if u in kept else "#bbbbbb", lw=1.5, zorder=1)
    for u, label in enumerate(labels):
        ax.text(depth[u], y[u], repr(label)[1:-1], ha="center", va="center", family="monospace", fontsize=9, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc="#9be39b" if u in kept else "white", ec="black", lw=0.6))
    ax.set_xlim(-0.5, max(depth) + 0.5), ax.set_ylim(len(order), -1), ax.axis("off")
    ax.set_title("guesses (depth = head), the kept path in green", fontsize=9)
    am.imshow(torch.as_tensor(mask).float().numpy(), cmap="Greys", vmin=0, vmax=1.6)
    am.set_xticks(range(len(labels)), [str(u) for u in range(len(labels))], fontsize=7)
    am.set_yticks(range(len(labels)), [f"{u} {repr(label)[1:-1][:8]}" for u, label in enumerate(labels)], fontsize=7)
    am.set_title("attention among the nodes (each also sees the whole prefix)", fontsize=9)
    save(fig, path)


def draw_bench(path, rows, title):
    """rows: {method: {"greedy": (tokens per forward, speedup), "t=1": (...)}}: grouped bars, one panel each."""
    plt = pyplot()
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (i, what) in zip(axes, enumerate(["tokens per target forward", "speedup over ar (wall clock)"])):
        for j, setting in enumerate(["greedy", "t=1"]):
            values = [rows[n].get(setting, (0, 0))[i] for n in names]
            ax.bar([x + 0.4 * j - 0.2 for x in range(len(names))], values, 0.4, label=setting,
                   color=["#4c72b0", "#dd8452"][j])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        ax.set_title(what, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def draw_curves(path, points, k=4, title=""):
    """points: [(method, setting, tokens per forward, speedup)]. With k guesses per forward and a drafter costing c
    target forwards per guess, a step costs 1 + k c forwards (verify forwards of k+1 tokens costing as much as one
    of 1, a tiny model's case), so speedup = tokens per forward / (1 + k c): one curve per c."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tpf = torch.linspace(1, max([3.0] + [p[2] + 0.3 for p in points]), 50)
    for c in (0.0, 0.05, 0.1, 0.25, 0.5):
        ax.plot(tpf, tpf / (1 + k * c), color="#999999", lw=0.8)
        ax.text(float(tpf[-1]), float(tpf[-1]) / (1 + k * c), f" c={c:g}", fontsize=7, va="center", color="#666666")
    for method, setting, x, s in points:
        ax.scatter(x, s, marker="o" if setting == "greedy" else "^", color="#4c72b0" if setting == "greedy" else
                   "#dd8452", zorder=3)
        ax.annotate(method, (x, s), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("tokens per target forward"), ax.set_ylabel("speedup over ar")
    ax.set_title(f"{title}\nlines: speedup = tokens per forward / (1 + {k} c), c = a guess's cost in target forwards "
                 f"(o greedy, ^ temperature 1)", fontsize=8)
    save(fig, path)


def draw_batch(path, table, title):
    """table: {setting: {method: {batch size: (tokens/s, speedup over batched ar)}}}: throughput and speedup against
    the batch size, one line per method and setting, the batch size where each falls below `ar` marked."""
    plt = pyplot()
    fig, (ax, sx) = plt.subplots(1, 2, figsize=(11, 4))
    for setting, methods in table.items():
        for method, by_B in methods.items():
            B = sorted(by_B, key=int)
            style = "-" if setting == "greedy" else "--"
            ax.plot([int(b) for b in B], [by_B[b][0] for b in B], style, marker="o", label=f"{method} ({setting})")
            if method == "ar":
                continue
            sx.plot([int(b) for b in B], [by_B[b][1] for b in B], style, marker="o", label=f"{method} ({setting})")
            below = [int(b) for b in B if by_B[b][1] < 1.0]
            if below:
                sx.axvline(below[0], color="#cc0000", lw=0.6, ls=":")
    for a, what in ((ax, "tokens/s, all rows"), (sx, "speedup over batched ar (dotted: first B below 1)")):
        a.set_xscale("log", base=2), a.set_xlabel("batch size B"), a.set_title(what, fontsize=10), a.legend(fontsize=7)
    sx.axhline(1.0, color="black", lw=0.8)
    fig.suptitle(title, fontsize=9)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# The figures from the trained model's own runs


STEP_PROMPTS = ["import os\nimport sys\n\n\ndef main(", "    def __init__(self, name):\n        self.name =",
                "for i in range(len(", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                "    def __repr__(self):\n        return"]


@torch.inference_mode()
def step_figure(models, path, k=4):
    """One greedy step of `speculative`, computed with the method's own pieces, after the first of STEP_PROMPTS
    whose step accepts the most guesses short of all k (a step that shows both an acceptance and a rejection)."""
    from nanospec.steps.draft_chain import draft_chain
    from nanospec.steps.options import Sampling
    from nanospec.rules.verify import verify_chain_greedy
    tok, steps = models.tokenizer, []
    for prompt in STEP_PROMPTS:
        ids, dcache = tok.encode(prompt), models.draft.new_cache()
        [drafts], _ = draft_chain(lambda x: models.draft(x, cache=dcache).logits[:, -1], torch.tensor([ids]), k,
                                  Sampling())
        logits = models.target(torch.tensor([ids + drafts])).logits[0, len(ids) - 1:]  # (k+1, V)
        n, _ = verify_chain_greedy(logits, drafts)
        steps.append((n if n < k else -1, prompt, drafts, logits.argmax(-1).tolist()))
    n, prompt, drafts, best = max(steps, key=lambda s: s[0])
    draw_step(path, prompt, [tok.decode([d]) for d in drafts], [tok.decode([t]) for t in best], max(n, 0))


@torch.inference_mode()
def tree_figure(models, path, prompt="import os\n\n\ndef read(path):\n    with open(path) as f:\n        return"):
    """One of medusa's default trees after `prompt`, verified greedily by the target."""
    from nanospec.steps.options import Sampling
    from nanospec.steps.tree_guesses import TREES, fill_tree
    from nanospec.rules.tree import tree_mask, tree_positions
    from nanospec.rules.verify import verify_tree_greedy
    tok, ids, target = models.tokenizer, models.tokenizer.encode(prompt), models.target
    out = target(torch.tensor([ids]))
    root = int(out.logits[0, -1].argmax())
    paths = [p for p in TREES["large"] if len(p) <= target.config.n_future]
    tokens, parents, _ = fill_tree(root, target.head_logits(out.hidden[:, -1:])[0, :, 0], paths, Sampling())
    P = len(ids)
    tree_out = target(torch.tensor([ids + tokens]), pos=torch.cat([torch.arange(P), tree_positions(parents, P)]),
                      mask=torch.cat([torch.cat([torch.ones(P, P).tril().bool(), torch.zeros(P, len(tokens)).bool()], 1),
                                      tree_mask(parents, P)], 0))
    kept, _ = verify_tree_greedy(tree_out.logits[0, P:], tokens, parents)
    draw_tree(path, [tok.decode([t]) for t in tokens], parents, {0, *kept}, tree_mask(parents, 0))


TRACE_RUN = {"method": "eagle", "temperature": 1.0, "seed": 0, "max_new_tokens": 64, "prompt": "def fibonacci(n):",
             "options": {"tree": "dynamic", "adaptive": "off", "verify": "token"}}
# a tree (at t=1 eagle's default is a chain), every step drafting (on a CPU at t=1 the cost rule takes plain steps
# often), judged child by child (--verify token): the picture shows p(x), q(x), each uniform and the residual


@torch.inference_mode()
def trace_figure(models, path, run=TRACE_RUN):
    """The page `python decode.py --method eagle --temperature 1 --seed 0 --max-new-tokens 64 --prompt
    "def fibonacci(n):" --tree dynamic --adaptive off --verify token --trace run.html` writes, at the step with the
    most judged guesses among those that both accept and reject one, in a 1400 x 1150 window of headless Chromium."""
    import tempfile
    from nanospec.trace import browser
    from nanospec.trace import record as trace
    from nanospec.decoding import METHODS
    if browser.find() is None:
        print(f"skipped trace.png: no chromium ({browser.INSTALL})", file=sys.stderr)
        return
    prompt = models.tokenizer.encode(run["prompt"])
    argv = ["--method", run["method"], "--temperature", f"{run['temperature']:g}", "--seed", str(run["seed"]),
            "--max-new-tokens", str(run["max_new_tokens"]), "--prompt", run["prompt"]]
    for name, value in run["options"].items():
        argv += [f"--{name.replace('_', '-')}", str(value)]

    def run_method(used):  # used: the recording's wrappers around the models
        return METHODS[run["method"]](used, prompt, run["max_new_tokens"], temperature=run["temperature"],
                                      seed=run["seed"], **run["options"])
    with tempfile.TemporaryDirectory() as folder:
        page = os.path.join(folder, "run.html")
        _, _, doc, _ = trace.traced_run(models, run_method, prompt, page, {**run, "runtime": "eager"},
                                        argv + ["--trace", "run.html"])
        verdicts = [{g["verdict"] for g in s.get("nodes", [])} for s in doc["steps"]]
        mixed = [i for i, v in enumerate(verdicts) if {"accepted", "rejected"} <= v] or [0]
        shown = max(mixed, key=lambda i: sum(g["verdict"] != "unused" for g in doc["steps"][i].get("nodes", [])))
        console = browser.screenshot(f"{page}#step={shown + 1}", path, size=(1400, 1150))
    if console:
        print(f"trace.png: the page printed to the console: {console[0]}", file=sys.stderr)
    print(f"wrote {path}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Draw the figures of README.md and docs/ from nanospec's own runs.")
    p.add_argument("--ckpt", default="out", help="the trained run folder (make train)")
    p.add_argument("--results", default="bench_results.json", help="the bench's results (make bench)")
    p.add_argument("--out", default=os.path.join("runs", "figures"),
                   help="where the PNGs go (default runs/figures, which git ignores; docs/figures: the README's)")
    add_threads_flag(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    pyplot()  # fail early, in one line, without matplotlib
    try:
        set_threads(args.threads)
        os.makedirs(args.out, exist_ok=True)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: --out {args.out}: cannot make that folder ({e.strerror})") from None
    print(f"figures: from {args.ckpt} and {args.results}, into {args.out}", flush=True)
    try:
        from nanospec.model.load import load_models
        models = load_models(args.ckpt, "cpu", ("draft", "heads"))
        step_figure(models, os.path.join(args.out, "speculative_step.png"))
        tree_figure(models, os.path.join(args.out, "tree_mask.png"))
    except Exception as e:  # noqa: BLE001 (any unreadable run folder: say so, draw the rest)
        print(f"skipped the step and tree figures: {type(e).__name__}: {e} (run `make train`)", file=sys.stderr)
    try:
        from nanospec.model.load import load_models
        trace_figure(load_models(args.ckpt, "cpu", ("eagle",)), os.path.join(args.out, "trace.png"))
    except Exception as e:  # noqa: BLE001 (no eagle.pt, or chromium failed: say so, draw the rest)
        print(f"skipped trace.png: {type(e).__name__}: {e} (run `make train`)", file=sys.stderr)
    if not os.path.exists(args.results):
        print(f"skipped the bench figures: no {args.results} (run `make bench`)", file=sys.stderr)
        return
    try:
        with open(args.results, encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --results {args.results} is not the bench's JSON ({e}): run `make bench` "
                         "again") from None
    title = results.get("title", "")
    if results.get("methods"):
        draw_bench(os.path.join(args.out, "bench.png"), results["methods"], title)
        points = [(m, s, *v) for m, by in results["methods"].items() for s, v in by.items() if m != "ar"]
        draw_curves(os.path.join(args.out, "speedup_curves.png"), points, title=title)
    if results.get("batch"):
        draw_batch(os.path.join(args.out, "batch.png"), results["batch"], results.get("batch_title", title))
    else:
        print("skipped batch.png: the results hold no batch table (python -m nanospec.bench --batch-sizes 1,2,4,8)",
              file=sys.stderr)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
