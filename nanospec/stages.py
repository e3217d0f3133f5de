"""
The stages of `make train`, in order, each skipped when its output already exists:

    corpus     data/train.txt, data/val.txt   (Python's own standard library source, split by file)
    tokenizer  out/tokenizer.tiktoken         (byte-level BPE trained on the training split)
    target     out/target.pt                  (the GPT with its MTP heads, trained jointly)
    heads      out/heads.pt                   (the MTP heads retrained on the frozen target's own text)
    draft      out/draft.pt                   (a much smaller GPT on the same tokenizer, for `speculative`)
    eagle      out/eagle.pt                   (EAGLE's one-layer draft head, on the target's features)
    parallelspec out/parallelspec.pt          (ParallelSpec's mask-token drafter: k guesses in one pass)
    early_exit out/early_exit.pt              (adapters that make the target's first layers a draft)

`Context` is what every stage reads (the preset, the folders, the device, the tokenized splits); `run` checks
the folders and runs the stages asked for. train_tiny.py parses the command line and calls `run`; the
drafters' stages live in nanospec/drafters/training.py, the training loop in nanospec/trainer.py.

A run folder is tied to its corpus: out/corpus.json records the corpus it was trained on, and a data folder
that holds another is refused, never overwritten (it may belong to another run).
"""
import datetime
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace

import numpy as np
import torch
from torch.nn import functional as F

from nanospec import corpus
from nanospec.checkpoint import CheckpointError, clean_orphans, gpt_checkpoint, load_checkpoint
from nanospec.device import pick_device
from nanospec.drafters import training
from nanospec.model import GPT
from nanospec.presets import PRESETS
from nanospec.tokenizer import Tokenizer, save_tokenizer, train_bpe
from nanospec.trainer import autocast_dtype, batch_rng, fixed_windows, train, windows


class Context:
    """What the stages read: the command line (`args`), the preset's sizes (`cfg`), the folders, the device, and
    once the tokenizer stage ran, the tokenizer and the token arrays of both splits."""

    def __init__(self, args):
        self.args, self.preset, self.cfg = args, args.preset, PRESETS[args.preset]
        self.data_dir, self.out_dir = args.data_dir, args.out_dir
        self.device = pick_device(args.device)
        self.tokenizer = self.train_tokens = self.val_tokens = None
        self.stage_started = time.perf_counter()  # when the running stage began: its budget counts from here

    def budget(self, key):
        """A stage's wall-clock budget in seconds (0 = none): the preset's, or --max-seconds."""
        return self.args.max_seconds if self.args.max_seconds is not None else self.cfg[key].max_seconds

    def train_cfg(self, key):
        """The stage's TrainConfig, with the command line's overrides. max_seconds is what is LEFT of the stage's
        budget: loading the target, generating data and baseline evaluations count against it too."""
        cfg = self.cfg[key]
        if self.args.max_iters is not None:
            cfg = replace(cfg, max_iters=self.args.max_iters, eval_interval=min(cfg.eval_interval, self.args.max_iters))
        if self.budget(key):
            cfg = replace(cfg, max_seconds=max(1.0, self.budget(key) - (time.perf_counter() - self.stage_started)))
        return replace(cfg, seed=self.args.seed, precision=self.args.precision)


# ---------------------------------------------------------------------------------------------------------
# The corpus and the tokenizer


def corpus_recipe(ctx):
    """What this run asks of the corpus, as data/corpus.json records it; source None: --corpus not given, so
    whatever the data folder holds (the standard library when it is built here)."""
    return {"source": os.path.abspath(ctx.args.corpus) if ctx.args.corpus else None,
            "budget_bytes": ctx.cfg["corpus_bytes"], "tests": ctx.cfg.get("corpus_tests", False)}


def describe(recipe):
    return (f"{recipe['source'] or 'the standard library'}, {recipe['budget_bytes']:,} bytes"
            f"{' with test folders' * bool(recipe['tests'])}")


def stage_corpus(ctx):
    """Build the splits in --data-dir, or keep those there if they are the corpus this run asks for. A data
    folder that holds another corpus is refused, never overwritten: another run may train on it."""
    meta, wanted = os.path.join(ctx.data_dir, "corpus.json"), corpus_recipe(ctx)
    if os.path.exists(meta):
        have = {key: json.load(open(meta)).get(key, False) for key in wanted}  # older files have no "tests"
        if any(wanted[key] is not None and have[key] != wanted[key] for key in wanted):
            raise ValueError(f"{ctx.data_dir} holds another corpus ({describe(have)}) than this run asks for "
                             f"({describe(wanted)}); it is kept, since another run may use it: pass a new --data-dir")
        print(f"corpus: {ctx.data_dir}/train.txt exists, skipping")
    else:
        corpus.build_corpus(out_dir=ctx.data_dir, source=ctx.args.corpus, budget_bytes=wanted["budget_bytes"],
                            include_tests=wanted["tests"], source_flag="--corpus", budget_flag=None)
    tie_run_to_corpus(ctx, json.load(open(meta)))


def tie_run_to_corpus(ctx, stats):
    """out/corpus.json: the corpus this run folder was trained on. A run trained on one corpus is never
    resumed or extended on another: a data folder rebuilt since is a one-line error."""
    record = os.path.join(ctx.out_dir, "corpus.json")
    if not os.path.exists(record):
        corpus.write_atomic(record, json.dumps(stats, indent=2) + "\n")
    elif json.load(open(record)) != stats:
        raise ValueError(f"{ctx.out_dir} was trained on another corpus than {ctx.data_dir} now holds (see "
                         f"{record}): pass the --data-dir it was trained with, or a new --out-dir")


def stage_tokenizer(ctx):
    path = os.path.join(ctx.out_dir, "tokenizer.tiktoken")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a tokenizer file: remove it (the tokenizer stage writes the file)")
    if os.path.isfile(path):
        print(f"tokenizer: {path} exists, skipping")
    else:
        t0 = time.time()
        text = open(os.path.join(ctx.data_dir, "train.txt"), encoding="utf-8").read()
        text = text[:ctx.cfg.get("tokenizer_chars")]  # a large corpus: a prefix teaches the merges as well
        ranks = train_bpe(text, ctx.cfg["vocab_size"] - 1)  # -1: the end-of-text special takes the last id
        save_tokenizer(ranks, path[:-len(".tiktoken")])
        print(f"tokenizer: {len(ranks)} merges+bytes trained in {time.time() - t0:.1f}s, saved {path}")
    ctx.tokenizer = Tokenizer.load(path)
    splits = {}
    for split in ("train", "val"):
        text = open(os.path.join(ctx.data_dir, f"{split}.txt"), encoding="utf-8").read()
        splits[split] = np.array(ctx.tokenizer.encode_corpus(text), dtype=np.uint16)
    ctx.train_tokens, ctx.val_tokens = splits["train"], splits["val"]
    stats = json.load(open(os.path.join(ctx.data_dir, "corpus.json")))
    corpus.print_stats(stats, {k: len(v) for k, v in splits.items()})
    print(f"tokenizer: vocab {ctx.tokenizer.vocab_size} (incl. end-of-text), listing in {path[:-9]}.vocab")
    check_enough_tokens(ctx, splits)


def check_enough_tokens(ctx, splits):
    """Every stage draws windows of up to block_size + 1 + n_future tokens from each split: refuse a corpus too
    small for them now, rather than fail deep inside a stage."""
    need = max(c.block_size + 1 + c.n_future for c in (ctx.cfg["target"], ctx.cfg["draft"])) + 1
    for split, tokens in splits.items():
        if len(tokens) < need:
            raise ValueError(f"the corpus is too small for preset {ctx.preset!r}: its {split} split has {len(tokens)} "
                             f"tokens and a training window needs {need}; give more text with --corpus "
                             "(some hundreds of KB), or use --preset toy")


# ---------------------------------------------------------------------------------------------------------
# The target and the draft: GPTs trained on the corpus


def lm_losses(model, w, head_positions=None):
    """w (B, T+1+n_future) windows -> {main, head1..}: cross-entropies of the main head (t+1) and each MTP
    head i (t+1+i). `head_positions` (S,) restricts the heads to some positions, to save time in training."""
    cfg = model.config
    T = w.size(1) - 1 - cfg.n_future
    out = model(w[:, :T])
    V = cfg.vocab_size
    losses = {"main": F.cross_entropy(out.logits.reshape(-1, V), w[:, 1:T + 1].reshape(-1))}
    if cfg.n_future:
        pos = head_positions if head_positions is not None else torch.arange(T, device=w.device)
        head_logits = model.head_logits(out.hidden[:, pos])  # (B, n_future, S, V)
        for i in range(1, cfg.n_future + 1):
            target = w[:, pos + 1 + i]  # (B, S)
            losses[f"head{i}"] = F.cross_entropy(head_logits[:, i - 1].reshape(-1, V), target.reshape(-1))
    return losses


def text_bytes(tokenizer, ids):
    """How many bytes of text the token ids stand for (end-of-text counts as one: a document break)."""
    return sum(1 if t == tokenizer.eot else len(tokenizer.decode_bytes([t])) for t in ids)


def gpt_is_complete(name, path, ctx, model_cfg):
    """True if `path` holds a finished training of this very model (skip it); a file of another size is an error."""
    if not os.path.exists(path):
        return False
    ckpt = load_checkpoint(path, ctx.tokenizer.identity, part=name)
    if ckpt["config"] != asdict(model_cfg):
        raise CheckpointError(f"{path} holds a model of another size than preset {ctx.preset!r}; "
                              "delete it or use another --out-dir")
    if ckpt.get("done"):
        print(f"{name}: {path} is complete, skipping (delete it to retrain)")
    return bool(ckpt.get("done"))


def train_gpt(name, ctx, model_cfg, train_cfg, head_weight, head_fraction=0.25):
    """Train one GPT (target or draft) on the corpus, or skip it if its checkpoint is complete.
    Returns the final validation losses (None when skipped); "bpb" is the main head's loss in bits per byte
    of validation text, which compares models across tokenizers."""
    path = os.path.join(ctx.out_dir, f"{name}.pt")
    model_cfg = replace(model_cfg, vocab_size=ctx.tokenizer.vocab_size)
    if gpt_is_complete(name, path, ctx, model_cfg):
        return None
    torch.manual_seed(train_cfg.seed)
    model = GPT(model_cfg).to(ctx.device)
    print(f"{name}: {model.num_params() / 1e6:.2f}M parameters, {model_cfg}")
    T, nf, B = model_cfg.block_size, model_cfg.n_future, train_cfg.batch_size
    val = fixed_windows(ctx.val_tokens, 4 * B, T + 1 + nf, ctx.device)  # (4B, T+1+nf)
    val_tokens_per_byte = T * len(val) / text_bytes(ctx.tokenizer, val[:, 1:T + 1].flatten().tolist())

    def loss_fn(model, step):
        rng = batch_rng(train_cfg, step)
        w = windows(ctx.train_tokens, rng, B, T + 1 + nf, ctx.device)  # (B, T+1+nf)
        # MTP heads see a random subset of the positions: cheaper, and the gradient is still unbiased
        pos = torch.from_numpy(rng.choice(T, max(1, int(T * head_fraction)), replace=False)).to(ctx.device)
        losses = lm_losses(model, w, pos)
        loss = losses["main"] + sum(head_weight * 0.8 ** (i - 1) * losses[f"head{i}"] for i in range(1, nf + 1))
        return loss, {k: v.item() for k, v in losses.items()}

    def eval_fn(model):
        parts = [lm_losses(model, val[i:i + B]) for i in range(0, len(val), B)]
        losses = {k: sum(p[k].item() for p in parts) / len(parts) for k in parts[0]}
        main = losses.pop("main")
        return {"main": main, "bpb": main / math.log(2) * val_tokens_per_byte, **losses}

    return train(name, model, loss_fn, eval_fn, train_cfg, path,
                 lambda: gpt_checkpoint(model, ctx.tokenizer.identity, part=name), ctx.device, B * T)


def stage_target(ctx):
    return train_gpt("target", ctx, ctx.cfg["target"], ctx.train_cfg("target_train"), ctx.cfg["head_weight"],
                     ctx.cfg["head_fraction"])


def stage_draft(ctx):
    train_gpt("draft", ctx, ctx.cfg["draft"], ctx.train_cfg("draft_train"), 0.0)


def after_target(drafter_stage):
    """A stage that learns from the frozen target: train the target first if missing (else it is skipped), then
    start this stage's clock, so that the target's training does not eat the stage's budget."""
    def stage(ctx):
        stage_target(ctx)
        ctx.stage_started = time.perf_counter()
        drafter_stage(ctx)
    stage.__doc__ = drafter_stage.__doc__
    return stage


# Run in this order by `--stage all`. corpus and tokenizer always run (cheap, skipped when present).
STAGES = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "target": stage_target,
          "heads": after_target(training.train_heads), "draft": stage_draft,
          "eagle": after_target(training.train_eagle), "parallelspec": after_target(training.train_parallelspec),
          "early_exit": after_target(training.train_early_exit)}

# The trained stages: the TrainConfig key of each, for the plan printed at the start.
TRAINED = {name: f"{name}_train" for name in ("target", "heads", "draft", "eagle", "parallelspec", "early_exit")}


# ---------------------------------------------------------------------------------------------------------
# Running the stages


def plan(ctx, stages):
    """The budgets of the stages that will train (those without a complete checkpoint) and when all should end."""
    budgets = {}
    for name in stages:
        path = os.path.join(ctx.out_dir, f"{name}.pt")
        if name in TRAINED and not (os.path.exists(path) and load_checkpoint(path).get("done")):
            budgets[name] = ctx.budget(TRAINED[name])
    if not budgets:
        return "plan: every checkpoint is complete, nothing to train"
    if not all(budgets.values()):
        return "plan: " + ", ".join(budgets) + " (no time budget: they stop after their step counts)"
    total = sum(budgets.values())
    end = datetime.datetime.now() + datetime.timedelta(seconds=total)
    return (f"plan: {' + '.join(f'{name} {s:.0f}s' for name, s in budgets.items())} = {total / 60:.1f} min of "
            f"training; expected end {end:%H:%M:%S} (corpus, tokenizer and loading add a few seconds)")


def gpu_note(ctx):
    """On a machine with a GPU, the default (CPU-sized) run says that a preset made for the GPU exists."""
    if ctx.preset == "tiny" and torch.cuda.is_available():
        return " | a GPU is here: `make train PRESET=gpu` trains the deep preset made for one (into out-gpu/)"
    return ""


def writable_folder(path, flag):
    """Create `path` if needed and check that files can be written there, before any training: a read-only
    folder found at the first save would lose everything trained up to it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path} is not a writable folder ({e.strerror or type(e).__name__}): "
                         f"pass another {flag}") from None


def run(args):
    """Run the stages `args.stage` asks for (train_tiny.py's options), with one-line errors."""
    try:
        run_stages(args)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # outside a training loop (those save and stop with their own message)
        print("\ninterrupted; nothing half-written is kept: run the same command to go on", file=sys.stderr)
        raise SystemExit(130)


def run_stages(args):
    ctx = Context(args)
    writable_folder(args.out_dir, "--out-dir")
    if not os.path.exists(os.path.join(args.data_dir, "corpus.json")):  # a built corpus is only read
        writable_folder(args.data_dir, "--data-dir")
    for tmp in clean_orphans(args.out_dir):
        print(f"removed {tmp}, left by a save that was killed midway")
    torch.set_float32_matmul_precision("high")
    amp = autocast_dtype(ctx.device, args.precision)
    print(f"preset {args.preset} | device {ctx.device} | torch {torch.__version__} | threads "
          f"{torch.get_num_threads()} | precision {args.precision}: {'bf16 autocast' if amp else 'fp32'}")
    t0 = time.time()
    wanted = list(dict.fromkeys(list(STAGES) if args.stage == "all" else ["corpus", "tokenizer", args.stage]))
    print(plan(ctx, wanted) + gpu_note(ctx))
    for name in wanted:
        ctx.stage_started = time.perf_counter()
        try:
            STAGES[name](ctx)
        except NotImplementedError as e:  # a course handout with this stage's function still blank
            print(f"{name}: skipped, it calls a function not written yet ({e or 'NotImplementedError'})")
    print(f"all done in {time.time() - t0:.0f}s")
