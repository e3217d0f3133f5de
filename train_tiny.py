"""
Train everything nanospec decodes with, in stages, each skipped when its output already exists:

    corpus     data/train.txt, data/val.txt   (Python's own standard library source, split by file)
    tokenizer  out/tokenizer.tiktoken         (byte-level BPE trained on the training split)
    target     out/target.pt                  (the GPT with its MTP heads, trained jointly)
    heads      out/heads.pt                   (the MTP heads retrained on the frozen target's own text)
    draft      out/draft.pt                   (a much smaller GPT on the same tokenizer, for `speculative`)
    eagle      out/eagle.pt                   (EAGLE's one-layer draft head, on the target's features)
    parallelspec out/parallelspec.pt          (ParallelSpec's mask-token drafter: k guesses in one pass)
    early_exit out/early_exit.pt              (adapters that make the target's first layers a draft, for `early-exit`)

    python train_tiny.py                      # all stages with the default CPU preset (`make train`)
    python train_tiny.py --stage draft        # one stage (its prerequisites run if missing)
    python train_tiny.py --preset toy --max-iters 20 --out-dir /tmp/toy   # a toy model in seconds

A crash or Ctrl-C loses at most the steps since the last checkpoint: run the same command to resume.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace

import numpy as np
import torch
from torch.nn import functional as F

from nanospec import corpus
from nanospec.checkpoint import CheckpointError, gpt_checkpoint, load_checkpoint
from nanospec.drafters import eagle, early_exit, heads, parallelspec
from nanospec.model import GPT, GPTConfig
from nanospec.tokenizer import Tokenizer, save_tokenizer, train_bpe
from nanospec.device import pick_device
from nanospec.presets import PRESETS
from nanospec.trainer import PRECISIONS, TrainConfig, autocast_dtype, batch_rng, train

def windows(tokens, rng, batch_size, length):
    """Random contiguous windows (batch_size, length) of a token array."""
    starts = rng.integers(0, len(tokens) - length, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64))


def fixed_windows(tokens, n, length):
    """n evenly spaced windows: the same validation batches at every evaluation."""
    starts = np.linspace(0, len(tokens) - length - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64))


def lm_losses(model, w, head_positions=None):
    """w (B, T+1+n_future) windows -> {main, head1..}: cross-entropies of the main head (t+1) and each MTP
    head i (t+1+i). `head_positions` (S,) restricts the heads to some positions, to save time in training."""
    cfg = model.config
    T = w.size(1) - 1 - cfg.n_future
    out = model(w[:, :T])
    V = cfg.vocab_size
    losses = {"main": F.cross_entropy(out.logits.reshape(-1, V), w[:, 1:T + 1].reshape(-1))}
    if cfg.n_future:
        pos = head_positions if head_positions is not None else torch.arange(T)
        head_logits = model.head_logits(out.hidden[:, pos])  # (B, n_future, S, V)
        for i in range(1, cfg.n_future + 1):
            target = w[:, pos + 1 + i]  # (B, S)
            losses[f"head{i}"] = F.cross_entropy(head_logits[:, i - 1].reshape(-1, V), target.reshape(-1))
    return losses


def text_bytes(tokenizer, ids):
    """How many bytes of text the token ids stand for (end-of-text counts as one: a document break)."""
    return sum(1 if t == tokenizer.eot else len(tokenizer.decode_bytes([t])) for t in ids)


def train_gpt(name, ctx, model_cfg, train_cfg, head_weight, head_fraction=0.25):
    """Train one GPT (target or draft) on the corpus, or skip it if its checkpoint is complete.
    Returns the final validation losses (None when skipped); "bpb" is the main head's loss in bits per byte
    of validation text, which compares models across tokenizers."""
    path = os.path.join(ctx.out_dir, f"{name}.pt")
    model_cfg = replace(model_cfg, vocab_size=ctx.tokenizer.vocab_size)
    if os.path.exists(path):
        ckpt = load_checkpoint(path, ctx.tokenizer.identity)
        if ckpt["config"] != asdict(model_cfg):
            raise CheckpointError(f"{path} holds a model of another size than preset {ctx.preset!r}; "
                                  "delete it or use another --out-dir")
        if ckpt.get("done"):
            print(f"{name}: {path} is complete, skipping (delete it to retrain)")
            return None
    torch.manual_seed(train_cfg.seed)
    model = GPT(model_cfg).to(ctx.device)
    print(f"{name}: {model.num_params() / 1e6:.2f}M parameters, {model_cfg}")
    T, nf, B = model_cfg.block_size, model_cfg.n_future, train_cfg.batch_size
    val = fixed_windows(ctx.val_tokens, 4 * B, T + 1 + nf).to(ctx.device)
    val_tokens_per_byte = T * len(val) / text_bytes(ctx.tokenizer, val[:, 1:T + 1].flatten().tolist())

    def loss_fn(model, step):
        rng = batch_rng(train_cfg, step)
        w = windows(ctx.train_tokens, rng, B, T + 1 + nf).to(ctx.device)
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
          lambda: gpt_checkpoint(model, ctx.tokenizer.identity), ctx.device, B * T)


def stage_corpus(ctx):
    meta = os.path.join(ctx.data_dir, "corpus.json")
    if os.path.exists(meta):
        built = json.load(open(meta))
        wanted = os.path.abspath(ctx.args.corpus) if ctx.args.corpus else None
        if wanted is None or built["source"] == wanted:
            print(f"corpus: {ctx.data_dir}/train.txt exists, skipping")
            return
        if os.path.exists(os.path.join(ctx.out_dir, "tokenizer.tiktoken")):
            raise ValueError(f"{ctx.out_dir} was trained on another corpus ({built['source']}): "
                             "pass a new --out-dir and --data-dir for --corpus " + ctx.args.corpus)
    corpus.build_corpus(out_dir=ctx.data_dir, source=ctx.args.corpus, budget_bytes=ctx.cfg["corpus_bytes"])


def stage_tokenizer(ctx):
    path = os.path.join(ctx.out_dir, "tokenizer.tiktoken")
    if os.path.exists(path):
        print(f"tokenizer: {path} exists, skipping")
    else:
        t0 = time.time()
        text = open(os.path.join(ctx.data_dir, "train.txt"), encoding="utf-8").read()
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


def stage_target(ctx):
    return train_gpt("target", ctx, ctx.cfg["target"], ctx.train_cfg("target_train"), ctx.cfg["head_weight"],
                     ctx.cfg["head_fraction"])


def needs_target(ctx):
    """For the stages that learn from the frozen target: train it first if missing (else it is skipped), and
    start this stage's clock afterwards, so that the target's training does not eat the stage's budget."""
    stage_target(ctx)
    ctx.stage_started = time.perf_counter()


def stage_heads(ctx):
    needs_target(ctx)  # the heads learn from the target's own text
    heads.train_stage(ctx)  # nanospec/drafters/heads.py


def stage_draft(ctx):
    train_gpt("draft", ctx, ctx.cfg["draft"], ctx.train_cfg("draft_train"), 0.0)


def stage_eagle(ctx):
    needs_target(ctx)  # the head learns from the target's features
    eagle.train_stage(ctx)  # nanospec/drafters/eagle.py


def stage_parallelspec(ctx):
    needs_target(ctx)  # the drafter is distilled from the target
    parallelspec.train_stage(ctx)  # nanospec/drafters/parallelspec.py


def stage_early_exit(ctx):
    needs_target(ctx)  # the adapters are distilled from the target
    early_exit.train_stage(ctx)  # nanospec/drafters/early_exit.py


# Run in this order by `--stage all`. corpus and tokenizer always run (cheap, skipped when present).
STAGES = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "target": stage_target, "heads": stage_heads,
          "draft": stage_draft,
          "eagle": stage_eagle, "parallelspec": stage_parallelspec, "early_exit": stage_early_exit}


# The trained stages: checkpoint file and TrainConfig key of each, for the plan printed at the start.
TRAINED = {"target": "target_train", "heads": "heads_train", "draft": "draft_train", "eagle": "eagle_train",
           "parallelspec": "parallelspec_train", "early_exit": "early_exit_train"}


class Context:
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


def build_parser():
    p = argparse.ArgumentParser(description="Train nanospec's corpus, tokenizer, target GPT and draft models.")
    p.add_argument("--preset", default="tiny", choices=PRESETS, help="model and training sizes (tiny: 2-core CPU, ~9 min)")
    p.add_argument("--stage", default="all", choices=["all", *STAGES], help="run one stage (and what it needs) or all")
    p.add_argument("--corpus", default=None, help="UTF-8 text file or folder to train on (default: Python's stdlib source)")
    p.add_argument("--data-dir", default="data", help="where the corpus splits are written")
    p.add_argument("--out-dir", default="out", help="where the tokenizer and checkpoints are written")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--max-iters", type=int, default=None, help="override every trained stage's step count")
    p.add_argument("--max-seconds", type=float, default=None, help="override every trained stage's time budget")
    p.add_argument("--seed", type=int, default=1337, help="seeds initialisation and batch order")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="auto: bf16 autocast where the hardware does it fast (AVX512-BF16/AMX CPUs, recent GPUs), "
                        "else fp32; fp32: always fp32, the reference (what most laptops and VMs train in); "
                        "bf16: always (slow where emulated)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.max_iters is not None and args.max_iters < 1:
            raise ValueError("--max-iters must be at least 1")
        ctx = Context(args)
        os.makedirs(args.out_dir, exist_ok=True)
        torch.set_float32_matmul_precision("high")
        amp = autocast_dtype(ctx.device, args.precision)
        print(f"preset {args.preset} | device {ctx.device} | torch {torch.__version__} | threads "
              f"{torch.get_num_threads()} | precision {args.precision}: {'bf16 autocast' if amp else 'fp32'}")
        t0 = time.time()
        wanted = list(dict.fromkeys(list(STAGES) if args.stage == "all" else ["corpus", "tokenizer", args.stage]))
        print(plan(ctx, wanted))
        for name in wanted:
            ctx.stage_started = time.perf_counter()
            try:
                STAGES[name](ctx)
            except NotImplementedError as e:  # a course handout with this stage's function still blank
                print(f"{name}: skipped, it calls a function not written yet ({e or 'NotImplementedError'})")
        print(f"all done in {time.time() - t0:.0f}s")
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
