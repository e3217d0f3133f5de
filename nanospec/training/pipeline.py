"""
The stages of `make train`, in order, each skipped when its output already exists:

    corpus     data/train.txt, data/val.txt   (Python's own source: the stdlib, for `gpu` also site-packages)
    tokenizer  out/tokenizer.tiktoken         (byte-level BPE trained on (a sample of) the training split)
    tokens     out/train.bin, out/val.bin     (both splits tokenized once, uint16, memory-mapped by training)
    target     out/target.pt                  (the GPT with its MTP heads, trained jointly)
    heads      out/heads.pt                   (the MTP heads retrained on the frozen target's own text)
    draft      out/draft.pt                   (a much smaller GPT for `speculative`, distilled from the target)
    eagle      out/eagle.pt                   (EAGLE's one-layer draft head, on the target's features)
    parallelspec out/parallelspec.pt          (ParallelSpec's mask-token drafter: k guesses in one pass)
    early_exit out/early_exit.pt              (adapters that make the target's first layers a draft)

`Context` is what every stage reads (the preset, the folders, the device, the tokenized splits); `run` checks
the folders, runs the stages asked for, and ends with a summary: each stage's steps against what the preset
reaches on a quiet machine (a starved stage says so), and the target against its draft on the whole
validation split. train_tiny.py parses the command line and calls `run`; the
drafters' stages live in nanospec/training/drafters.py, the training loop in nanospec/training/trainer.py.

A run folder is tied to its corpus: out/corpus.json records the corpus it was trained on, and a data folder
that holds another is refused, never overwritten (it may belong to another run). No stage replaces a file it did
not write: a train.txt, val.txt, corpus.json, tokens.json, train.bin, val.bin or tokenizer.vocab of someone
else's is refused with one line (the records that make files ours are written before the files), and every
other file in the folders (data/prompts.json, notes) is left alone.
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

from nanospec.training import corpus
from nanospec.model.checkpoint import (CheckpointError, clean_orphans, gpt_checkpoint, load_checkpoint, load_gpt,
                                      refuse_another_size)
from nanospec.device import pick_device
from nanospec.training import drafters
from nanospec.model.gpt import GPT
from nanospec.training.presets import PRESETS
from nanospec.tokenizer import Tokenizer, save_tokenizer, train_bpe
from nanospec.training.trainer import autocast_dtype, batch_rng, fixed_windows, train, windows


class Context:
    """What the stages read: the command line (`args`), the preset's sizes (`cfg`), the folders, the device, and
    once the tokenizer stage ran, the tokenizer and the token arrays of both splits."""

    def __init__(self, args):
        self.args, self.preset, self.cfg = args, args.preset, PRESETS[args.preset]
        self.data_dir, self.out_dir = args.data_dir, args.out_dir
        self.device = pick_device(args.device)
        self.tokenizer = self.train_tokens = self.val_tokens = self.corpus_sha256 = None
        self.stage_started = time.perf_counter()  # when the running stage began: its budget counts from here
        self.records = {}  # stage -> what its training reached (trainer.train's record), for the summary

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
        else:  # --max-seconds 0: no budget at all, not the preset's
            cfg = replace(cfg, max_seconds=0.0)
        return replace(cfg, seed=self.args.seed, precision=self.args.precision)


# ---------------------------------------------------------------------------------------------------------
# The corpus and the tokenizer


def corpus_recipe(ctx):
    """What this run asks of the corpus, as data/corpus.json records it; source None: --corpus not given, so
    whatever the data folder holds (the standard library, and site-packages for a preset with corpus_packages,
    when it is built here)."""
    return {"source": os.path.abspath(ctx.args.corpus) if ctx.args.corpus else None,
            "budget_bytes": ctx.cfg["corpus_bytes"], "tests": ctx.cfg.get("corpus_tests", False),
            "packages": bool(ctx.cfg.get("corpus_packages")) and not ctx.args.corpus}


def describe(recipe):
    where = recipe["source"] or ("the standard library and site-packages" if recipe.get("packages")
                                 else "the standard library")
    return f"{where}, {recipe['budget_bytes']:,} bytes{' with test folders' * bool(recipe['tests'])}"


def read_json(path, fix):
    """A JSON file nanospec wrote, or a one-line error naming it and saying what to do (`fix`)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is corrupt ({e}): {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is corrupt (not a JSON object): {fix}")
    return value


def corpus_stats(ctx):
    """data/corpus.json, read with a one-line error when it is damaged or not a record nanospec wrote."""
    path = os.path.join(ctx.data_dir, "corpus.json")
    stats = read_json(path, "delete it and its train.txt and val.txt to rebuild the corpus, or pass another --data-dir")
    if not stats.get("building") and not isinstance(stats.get("bytes"), dict):
        raise ValueError(f"{path} is not a corpus record nanospec wrote (no \"bytes\"): it is kept; move it, or pass "
                         f"another --data-dir")
    return stats


def stage_corpus(ctx):
    """Build the splits in --data-dir, or keep those there if they are the corpus this run asks for. A data
    folder that holds another corpus is refused, never overwritten: another run may train on it; so is a
    train.txt or val.txt nanospec did not write (corpus.check_ours). A corpus whose writing was stopped midway
    (corpus.json still says "building") is built again."""
    meta, wanted = os.path.join(ctx.data_dir, "corpus.json"), corpus_recipe(ctx)
    if os.path.exists(meta) and not corpus_stats(ctx).get("building"):
        stats = corpus_stats(ctx)
        have = {key: stats.get(key, False) for key in wanted}  # older files have no "tests", no "packages"
        if any(wanted[key] is not None and have[key] != wanted[key] for key in wanted):
            raise ValueError(f"{ctx.data_dir} holds another corpus ({describe(have)}) than this run asks for "
                             f"({describe(wanted)}); it is kept, since another run may use it: pass a new --data-dir")
        print(f"corpus: {ctx.data_dir}/train.txt exists, skipping")
    else:
        t0 = time.time()
        stats = corpus.build_corpus(out_dir=ctx.data_dir, source=ctx.args.corpus, budget_bytes=wanted["budget_bytes"],
                                    include_tests=wanted["tests"], source_flag="--corpus", budget_flag=None,
                                    packages=wanted["packages"], dir_flag="--data-dir")
        print(f"corpus: {sum(stats['bytes'].values()) / 1e6:.1f} MB built in {time.time() - t0:.0f}s into "
              f"{ctx.data_dir}/")
    check_corpus_files(ctx, stats)
    tie_run_to_corpus(ctx, stats)


def check_corpus_files(ctx, stats):
    """train.txt and val.txt must still be the text corpus.json describes (their sizes, and their sha256 where it
    records one): an emptied or edited file is named now, not reported as "too small" much later. Sets
    ctx.corpus_sha256, the hash the token files are tied to."""
    paths = [os.path.join(ctx.data_dir, f"{split}.txt") for split in ("train", "val")]
    fix = (f"it was changed since the corpus was built; delete {ctx.data_dir}/corpus.json to rebuild the corpus, "
           "or pass another --data-dir")
    for split, path in zip(("train", "val"), paths):
        size = os.path.getsize(path) if os.path.isfile(path) else None
        expected = stats.get("bytes", {}).get(split)
        if size != expected:
            now = "is missing" if size is None else f"holds {size:,} bytes"
            raise ValueError(f"{path} {now}, but {ctx.data_dir}/corpus.json says {expected:,}: {fix}")
    ctx.corpus_sha256 = corpus.sha256_of(*paths)
    if stats.get("sha256", ctx.corpus_sha256) != ctx.corpus_sha256:
        raise ValueError(f"{paths[0]} or {paths[1]} is not the text {ctx.data_dir}/corpus.json describes (another "
                         f"sha256): {fix}")


def tie_run_to_corpus(ctx, stats):
    """out/corpus.json: the corpus this run folder was trained on. A run trained on one corpus is never
    resumed or extended on another: a data folder rebuilt since is a one-line error."""
    record = os.path.join(ctx.out_dir, "corpus.json")
    if not os.path.exists(record):
        corpus.write_atomic(record, json.dumps(stats, indent=2) + "\n")
    elif read_json(record, f"delete it (it records the corpus {ctx.out_dir} was trained on; the next run "
                           f"rewrites it from {ctx.data_dir}/corpus.json)") != stats:
        raise ValueError(f"{ctx.out_dir} was trained on another corpus than {ctx.data_dir} now holds (see "
                         f"{record}): pass the --data-dir it was trained with, or a new --out-dir")


def tokenizer_sample(path, chars):
    """The text the tokenizer learns from: the whole file, or, when it holds more than `chars` characters,
    TOKENIZER_BLOCKS evenly spaced slices of it (whole lines, joined by EOT so that no merge spans two): a
    sample of every part of a corpus ordered by package, where a prefix would be the standard library only."""
    size = os.path.getsize(path)
    if not chars or size <= chars:
        with open(path, encoding="utf-8") as f:
            return f.read()
    block, pieces = chars // TOKENIZER_BLOCKS, []
    with open(path, "rb") as f:
        for start in np.linspace(0, size - block, TOKENIZER_BLOCKS).astype(np.int64):
            f.seek(int(start))
            lines = f.read(block).decode("utf-8", errors="ignore").split("\n")
            pieces.append("\n".join(lines[1:-1]) + "\n")  # whole lines only: the first and last may be cut
    return corpus.EOT.join(pieces)


TOKENIZER_BLOCKS = 64  # slices of a large training split the tokenizer's sample is made of


def stage_tokenizer(ctx):
    """out/tokenizer.tiktoken: a byte-level BPE trained on the training split (a sample of it, for a large one),
    or the one already there."""
    path = os.path.join(ctx.out_dir, "tokenizer.tiktoken")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a tokenizer file: remove it (the tokenizer stage writes the file)")
    if os.path.isfile(path):
        print(f"tokenizer: {path} exists, skipping")
    else:
        listing = path[:-len(".tiktoken")] + ".vocab"
        if os.path.exists(listing) and not is_our_listing(listing):
            raise ValueError(f"{listing} is not a tokenizer listing nanospec wrote, and training the tokenizer would "
                             f"replace it: move it, or pass another --out-dir")
        t0 = time.time()
        text = tokenizer_sample(os.path.join(ctx.data_dir, "train.txt"), ctx.cfg.get("tokenizer_chars"))
        print(f"tokenizer: training {ctx.cfg['vocab_size'] - 1} merges+bytes on {len(text) / 1e6:.1f}M characters "
              "of the training split", flush=True)
        ranks = train_bpe(text, ctx.cfg["vocab_size"] - 1)  # -1: the end-of-text special takes the last id
        save_tokenizer(ranks, path[:-len(".tiktoken")])
        print(f"tokenizer: {len(ranks)} merges+bytes trained in {time.time() - t0:.1f}s, saved {path}")
    ctx.tokenizer = Tokenizer.load(path)
    if ctx.tokenizer.vocab_size > 2 ** 16:
        raise ValueError(f"{path} has {ctx.tokenizer.vocab_size} tokens; the token files hold uint16 (at most 65536)")
    print(f"tokenizer: vocab {ctx.tokenizer.vocab_size} (incl. end-of-text), listing in {path[:-9]}.vocab")


def is_our_listing(path):
    """Does `path` look like the .vocab that save_tokenizer writes? Every one begins with the 256 single bytes,
    the first line '[\\x00] 0'."""
    try:
        with open(path, "rb") as f:
            return f.read(9) == b"[\\x00] 0\n"
    except OSError:
        return False


def tokenize_file(tokenizer, text_path, bin_path, progress_name):
    """Encode text_path (documents joined by EOT) into bin_path, uint16, block by block (a few hundred MB never
    sit in memory as one string), with a progress line every few seconds. tiktoken encodes a block's documents
    on every core. Returns the number of tokens written."""
    size, n, t0, t_last = os.path.getsize(text_path), 0, time.time(), time.time()
    eot = np.array([tokenizer.eot], dtype=np.uint16)
    tmp = f"{bin_path}.tmp{os.getpid()}"
    with open(text_path, "rb") as src, open(tmp, "wb") as dst:
        rest, first, done = b"", True, 0
        while True:
            block = src.read(TOKENIZE_BLOCK_BYTES)
            data = rest + block
            if block:  # keep the last (maybe partial) document for the next block
                cut = data.rfind(corpus.EOT.encode())
                if cut < 0:
                    rest = data
                    continue
                data, rest = data[:cut], data[cut + len(corpus.EOT):]
            docs = data.decode("utf-8").split(corpus.EOT)
            for ids in tokenizer.enc.encode_ordinary_batch(docs, num_threads=os.cpu_count() or 1):
                if not first:
                    dst.write(eot.tobytes())  # the separator between two documents: one end-of-text token
                dst.write(np.asarray(ids, dtype=np.uint16).tobytes())
                n += len(ids) + (not first)
                first = False
            done += len(data) + len(corpus.EOT)
            if time.time() - t_last > corpus.PROGRESS_SECONDS:
                t_last = time.time()
                print(f"{progress_name}: {min(done, size) / 1e6:.0f} of {size / 1e6:.0f} MB, {n / 1e6:.1f}M tokens "
                      f"({t_last - t0:.0f}s)", flush=True)
            if not block:
                break
    os.replace(tmp, bin_path)
    return n


TOKENIZE_BLOCK_BYTES = 8 << 20  # text encoded per batch: large enough to keep every core busy


def stage_tokens(ctx):
    """out/train.bin, out/val.bin: both splits tokenized once (uint16, as nanoGPT's train.bin), then memory-mapped:
    training reads windows of them at any corpus size. Kept while out/tokens.json says they were made from this
    corpus (its sha256) with this tokenizer."""
    stats = corpus_stats(ctx)
    meta_path = os.path.join(ctx.out_dir, "tokens.json")
    bins = {split: os.path.join(ctx.out_dir, f"{split}.bin") for split in ("train", "val")}
    want = {"tokenizer": ctx.tokenizer.identity, "corpus_sha256": ctx.corpus_sha256}
    meta = read_json(meta_path, "delete it and the .bin files beside it") if os.path.exists(meta_path) else None
    if meta is not None and not set(want) <= set(meta):
        raise ValueError(f"{meta_path} is not the record of token files nanospec writes: it is kept; move it, or "
                         f"pass another --out-dir")
    theirs = [p for p in bins.values() if os.path.exists(p)] if meta is None else []
    if theirs:  # no tokens.json of ours beside them: someone else's files
        raise ValueError(f"{theirs[0]} was not written by nanospec (no tokens.json beside it), and the tokens stage "
                         f"would replace it: move it, or pass another --out-dir")
    meta = meta or {}
    fresh = (all(meta.get(k) == v for k, v in want.items())
             and all(os.path.isfile(p) and os.path.getsize(p) == 2 * meta.get(split, -1) for split, p in bins.items()))
    if fresh:
        print(f"tokens: {ctx.out_dir}/train.bin exists, skipping")
    else:
        # first the record that says these files are ours (without their counts: not fresh), so that a run
        # stopped midway writes them again rather than refusing them as someone else's
        corpus.write_atomic(meta_path, json.dumps(want, indent=2) + "\n")
        t0, counts = time.time(), {}
        for split, path in bins.items():
            counts[split] = tokenize_file(ctx.tokenizer, os.path.join(ctx.data_dir, f"{split}.txt"), path,
                                          f"tokens ({split})")
        print(f"tokens: {sum(counts.values()):,} tokens in {time.time() - t0:.1f}s, saved {bins['train']} and "
              f"{bins['val']}")
        meta = {**want, **counts}
        corpus.write_atomic(meta_path, json.dumps(meta, indent=2) + "\n")
    splits = {split: np.memmap(path, dtype=np.uint16, mode="r") if meta[split] else np.zeros(0, np.uint16)
              for split, path in bins.items()}  # (np.memmap refuses an empty file)
    ctx.train_tokens, ctx.val_tokens = splits["train"], splits["val"]
    corpus.print_stats(stats, {k: len(v) for k, v in splits.items()})
    check_enough_tokens(ctx, splits)
    tc = ctx.cfg["target_train"]
    if tc.expected_steps and len(splits["train"]):
        passes = tc.expected_steps * tc.batch_size * ctx.cfg["target"].block_size / len(splits["train"])
        more = "; past ~4 passes repeated text is worth less than new text: a larger corpus helps" * (passes > 4)
        print(f"tokens: in its budget the target reads about {passes:.1f} passes of the training split "
              f"({tc.expected_steps} steps on the preset's reference machine){more}")


def check_enough_tokens(ctx, splits):
    """Every stage draws windows of up to block_size + 1 + n_future tokens from each split: refuse a corpus too
    small for them now, rather than fail deep inside a stage."""
    need = max(c.block_size + 1 + c.n_future for c in (ctx.cfg["target"], ctx.cfg["draft"])) + 1
    for split, tokens in splits.items():
        if len(tokens) < need:
            fix = ("give more text with --corpus (some hundreds of KB)" if ctx.args.corpus else
                   f"delete {ctx.data_dir}/corpus.json to rebuild the corpus")
            smaller = ", or use --preset toy" if ctx.preset != "toy" else ""
            raise ValueError(f"the corpus is too small for preset {ctx.preset!r}: {ctx.data_dir}/{split}.txt gives "
                             f"{len(tokens)} tokens and a training window needs {need}; {fix}{smaller}")


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
    return int(token_lengths(tokenizer)[np.asarray(ids, dtype=np.int64)].sum())


def token_lengths(tokenizer):
    """(vocab_size,) int64: the bytes each token id stands for (end-of-text: 1), computed once per tokenizer."""
    if getattr(tokenizer, "_lengths", None) is None:
        lengths = [1 if t == tokenizer.eot else len(tokenizer.decode_bytes([t])) for t in range(tokenizer.vocab_size)]
        tokenizer._lengths = np.array(lengths, dtype=np.int64)
    return tokenizer._lengths


def whole_split_bpb(model, tokenizer, tokens, device, batch_size=16, seconds=60.0):
    """
    Bits per byte of the main head on the whole validation split: consecutive windows of block_size tokens, each
    read with the token before it as context, so every token but the first is predicted exactly once. This is
    the figure that compares the target with its draft (the periodic validation reads only 4 batches). It stops
    after `seconds` (a big split on a slow device). Returns (bpb, tokens predicted, whether that is the whole).
    """
    T = model.config.block_size
    n = (len(tokens) - 1) // T  # whole windows; the few tokens past the last are left out
    lengths = token_lengths(tokenizer)
    nats, nbytes, done, t0 = 0.0, 0, 0, time.perf_counter()
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch_size):
            starts = np.arange(i, min(i + batch_size, n)) * T
            w = np.stack([np.asarray(tokens[s:s + T + 1], dtype=np.int64) for s in starts])
            x = torch.from_numpy(w).to(device)
            logits = model(x[:, :-1]).logits.float()
            nats += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
            nbytes += int(lengths[w[:, 1:]].sum())
            done += w[:, 1:].size
            if time.perf_counter() - t0 > seconds:
                break
    return nats / math.log(2) / max(nbytes, 1), done, done == n * T


def gpt_is_complete(name, path, ctx, model_cfg):
    """True if `path` holds a finished training of this very model (skip it); a file of another size is an error."""
    if not os.path.exists(path):
        return False
    ckpt = load_checkpoint(path, ctx.tokenizer.identity, part=name)
    refuse_another_size(path, ckpt["config"], asdict(model_cfg), ctx.preset)
    if ckpt.get("done"):
        print(f"{name}: {path} is complete, skipping (delete it to retrain)")
    return bool(ckpt.get("done"))


def train_gpt(name, ctx, model_cfg, train_cfg, head_weight, head_fraction=0.25):
    """Train one GPT (the target) on the corpus, or skip it if its checkpoint is complete.
    Returns the validation losses of the weights kept, the best (None when skipped); "bpb" is the main head's
    loss in bits per byte of validation text, which compares models across tokenizers."""
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
                 lambda: gpt_checkpoint(model, ctx.tokenizer.identity, part=name), ctx.device, B * T,
                 record=ctx.records.setdefault(name, {}), threads="auto")


def stage_target(ctx):
    return train_gpt("target", ctx, ctx.cfg["target"], ctx.train_cfg("target_train"), ctx.cfg["head_weight"],
                     ctx.cfg["head_fraction"])


def after_target(drafter_stage):
    """A stage that learns from the frozen target: train the target first if missing (else it is skipped), then
    start this stage's clock, so that the target's training does not eat the stage's budget."""
    def stage(ctx):
        stage_target(ctx)
        ctx.stage_started = time.perf_counter()
        drafter_stage(ctx)
    stage.__doc__ = drafter_stage.__doc__
    return stage


# Run in this order by `--stage all`. corpus, tokenizer and tokens always run (skipped when present).
STAGES = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "tokens": stage_tokens, "target": stage_target,
          "heads": after_target(drafters.train_heads), "draft": after_target(drafters.train_draft),
          "eagle": after_target(drafters.train_eagle), "parallelspec": after_target(drafters.train_parallelspec),
          "early_exit": after_target(drafters.train_early_exit)}

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
    if not any(name in TRAINED for name in stages):
        return f"plan: {', '.join(stages)} only, no model trained"
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
    adapting = " (fewer while other processes keep cores busy)" if ctx.device == "cpu" else ""
    print(f"preset {args.preset} | device {ctx.device} | torch {torch.__version__} | threads "
          f"{torch.get_num_threads()}{adapting} | precision {args.precision}: {'bf16 autocast' if amp else 'fp32'}")
    t0 = time.time()
    wanted = list(dict.fromkeys(list(STAGES) if args.stage == "all" else ["corpus", "tokenizer", "tokens", args.stage]))
    print(plan(ctx, wanted) + gpu_note(ctx))
    for name in wanted:
        ctx.stage_started = time.perf_counter()
        try:
            STAGES[name](ctx)
        except NotImplementedError as e:  # a course handout with this stage's function still blank
            print(f"{name}: skipped, it calls a function not written yet ({e or 'NotImplementedError'})")
    print(f"all done in {time.time() - t0:.0f}s")
    for line in summary(ctx):
        print(line)


# ---------------------------------------------------------------------------------------------------------
# The summary: what each stage reached, and the target against its draft


def summary(ctx):
    """The lines that end a run that trained something: each stage's steps against what the preset reaches on
    its reference machine, a plain warning for each stage that got less than half, and the target against the
    draft on the whole validation split."""
    lines = []
    trained = {name: r for name, r in ctx.records.items() if r}
    if trained:
        lines.append("summary: steps trained (on the preset's quiet reference machine) | best validation at | CPU "
                     "cores ours / other processes'")
    for name, r in trained.items():
        expected = expected_steps(ctx, name, r)
        others = "?" if r["cpu"]["others"] is None else f"{r['cpu']['others']:.1f}"
        lines.append(f"  {name:12s} {r['steps']:6d} steps ({f'~{expected}' if expected else 'no reference'}) | "
                     f"step {r['best_step']} | {r['cpu']['own']:.1f} / {others}")
    starved = [name for name, r in trained.items() if starved_report(ctx, name, r)]
    for name in starved:
        lines += starved_report(ctx, name, trained[name])
    if starved:
        lines += starved_advice(ctx, starved)
    lines += target_against_draft(ctx)
    return lines


def expected_steps(ctx, name, r):
    """What the preset's reference machine reaches in this stage, or None when it does not apply: no figure in
    the preset, or a budget changed by --max-seconds / --max-iters."""
    cfg = ctx.cfg[TRAINED[name]]
    if not cfg.expected_steps or r["max_iters"] != cfg.max_iters or r["max_seconds"] > cfg.max_seconds + 1e-6:
        return None
    if ctx.args.max_seconds is not None or ctx.args.max_iters is not None:
        return None
    return min(cfg.expected_steps, cfg.max_iters)


def starved_report(ctx, name, r):
    """One warning line when a stage got less than half of the steps the preset's reference machine reaches, with
    why: the other processes' load, or a slower machine. [] when it got enough (or there is no reference)."""
    expected = expected_steps(ctx, name, r)
    if not expected or r["steps"] >= expected / 2:
        return []
    others = r["cpu"]["others"]
    if others is not None and others >= 0.5:
        why = f"other processes kept {others:.1f} of {r['cpu'].get('cores', os.cpu_count())} cores busy: the machine was busy"
    elif others is not None:
        why = "nothing else was busy: this machine is slower than the preset's reference"
    else:
        why = "this system does not say whether other processes were busy"
    return [f"warning: {name} got only {r['steps']} steps of the ~{expected} a quiet reference machine reaches in its "
            f"{ctx.cfg[TRAINED[name]].max_seconds:.0f}s; {why}."]


def starved_advice(ctx, starved):
    """What starved stages mean for decoding, and what to do, said once after their warnings."""
    if "target" in starved:
        return [f"  A starved target is a weaker model, and every drafter learns from it: acceptance and the bench's "
                f"speed-ups fall short of docs/training.md's. To retrain when the machine is quiet: delete "
                f"{ctx.out_dir}/*.pt, then run the same command."]
    files = " ".join(f"{ctx.out_dir}/{name}.pt" for name in starved)
    return [f"  A starved drafter guesses worse: its guesses are accepted less often than docs/training.md's. To "
            f"retrain when the machine is quiet: delete {files}, then run the same command."]


def target_against_draft(ctx):
    """The target and the draft on the whole validation split (bits per byte), when this run trained either."""
    if not ({"target", "draft"} & set(ctx.records)) or ctx.val_tokens is None:
        return []
    paths = {name: os.path.join(ctx.out_dir, f"{name}.pt") for name in ("target", "draft")}
    if not all(os.path.exists(p) and load_checkpoint(p).get("done") for p in paths.values()):
        return []
    figures = {}
    for name, path in paths.items():
        model = load_gpt(path, ctx.tokenizer.identity, ctx.device, part=name)
        figures[name] = whole_split_bpb(model, ctx.tokenizer, ctx.val_tokens, ctx.device)
    (t_bpb, n, complete), (d_bpb, _, _) = figures["target"], figures["draft"]
    whole = ("whole validation split" if complete else
             "first tokens of the validation split (the whole would take too long here)")
    verdict = (f"the target is {d_bpb - t_bpb:.3f} better" if t_bpb < d_bpb else
               f"the target is NOT better than its draft ({t_bpb - d_bpb:.3f} worse): speculation gains little")
    return [f"target against draft on the {whole} ({n:,} tokens): {t_bpb:.3f} against {d_bpb:.3f} bits per byte; "
            f"{verdict}"]
