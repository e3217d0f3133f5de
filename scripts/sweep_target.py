"""
Sweep the target's shape and training settings, and print what each reaches in bits per byte.

The `tiny` preset was chosen with this script. Every variant trains the target from scratch on the same corpus
and is judged on bits per byte of the validation text, which compares models across vocabularies (a bigger
vocabulary puts more bytes in a token). What matters for `make train` is learning per CPU-second, so the table
gives each run's own training speed beside its result: compare variants at equal wall time, not equal steps.

By default a run trains for --seconds of wall clock, as `make train` does, which is fair on a quiet machine
only: a run that loses the CPU to other work reaches fewer steps. On a busy machine use --steps: a fixed number
of steps, with the learning-rate schedule over them, gives a loss that does not depend on the load (the speed
still does). The load average before and after each run is printed beside it.

    python scripts/sweep_target.py --variants 8x96-muon,tiny --seconds 315    # what make train would reach
    python scripts/sweep_target.py --variants old,8x128-batch8 --steps 900      # the same steps for both
    python scripts/sweep_target.py --table                                      # the table of runs already made

A variant is a set of overrides of the `tiny` preset (`VARIANTS` below); `old` is the preset before the sweep.
Each trains into runs/sweep/<name>/ (a tokenizer of the same vocabulary is copied from an earlier variant); a
finished variant is not retrained, so the table can be built up over several calls.
"""
import argparse
import copy
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_tiny  # noqa: E402
from nanospec.training import pipeline  # noqa: E402
from nanospec.training.presets import PRESETS  # noqa: E402
from nanospec.model.checkpoint import load_checkpoint  # noqa: E402
from nanospec.training.trainer import PRECISIONS  # noqa: E402

# name -> overrides: "target" (GPTConfig fields), "train" (TrainConfig fields of target_train), or preset keys.
# Every variant but the issue-35 ones trains with AdamW's rate of before issue 35 (2e-3; `tiny` now has 2e-2), so
# that each row means what it meant when it was measured.
LR_BEFORE_35 = dict(lr=2e-3, min_lr=2e-4)
OLD = {"target": dict(n_layer=4, n_embd=192), "head_fraction": 1 / 4,
       "train": dict(batch_size=16, optimizer="adamw")}  # the preset before this sweep
BEFORE_35 = {
    "old": OLD,
    "old-heads1/16": {**OLD, "head_fraction": 1 / 16},
    "4x128": {**OLD, "target": dict(n_layer=4, n_embd=128), "head_fraction": 1 / 16},
    "6x128": {**OLD, "target": dict(n_layer=6, n_embd=128), "head_fraction": 1 / 16},
    "8x96": {**OLD, "target": dict(n_layer=8, n_embd=96), "head_fraction": 1 / 16},
    "old-vocab4096": {**OLD, "vocab_size": 4096, "head_fraction": 1 / 16},
    "4x128-batch8": {"target": dict(n_layer=4, n_embd=128), "train": dict(batch_size=8, optimizer="adamw")},
    "8x128-batch8": {"target": dict(n_embd=128), "train": dict(batch_size=8, optimizer="adamw")},
    "8x128-batch8-muon": {"target": dict(n_embd=128), "train": dict(batch_size=8)},
    "8x128-batch8-muon-lr0.04": {"target": dict(n_embd=128), "train": dict(batch_size=8, muon_lr=0.04)},
    "8x96-muon": {"target": dict(n_embd=96)},
    "tiny": {},  # 8x64, batch 16, Muon, heads on 1/16 of the positions: the tiny preset of 2026-11-23
}
VARIANTS = {name: {**v, "train": {**LR_BEFORE_35, **v.get("train", {})}} for name, v in BEFORE_35.items()}
VARIANTS.update({
    # issue 35: AdamW's rate (the tied embedding, norms, MTP heads) from 3x to 20x; Muon's unchanged
    "tiny-lr6e-3": {"train": dict(lr=6e-3, min_lr=6e-4)},
    "tiny-lr1e-2": {"train": dict(lr=1e-2, min_lr=1e-3)},
    "tiny-lr2e-2": {"train": dict(lr=2e-2, min_lr=2e-3)},  # the tiny preset since issue 35
    "tiny-lr4e-2": {"train": dict(lr=4e-2, min_lr=4e-3)},
    "tiny-lr1e-2-muon0.03": {"train": dict(lr=1e-2, min_lr=1e-3, muon_lr=0.03)},
})


def preset_with(overrides):
    cfg = copy.deepcopy(PRESETS["tiny"])
    for key, value in overrides.items():
        if key == "target":
            cfg["target"] = replace(cfg["target"], **value)
        elif key == "train":
            cfg["target_train"] = replace(cfg["target_train"], **value)
        else:
            cfg[key] = value
    return cfg


def run_variant(name, args):
    out_dir = os.path.join(args.runs, name)
    result_path = os.path.join(out_dir, "result.json")
    if os.path.exists(result_path):
        return json.load(open(result_path))
    cfg = preset_with(VARIANTS[name])
    targv = ["--out-dir", out_dir, "--data-dir", args.data_dir, "--precision", args.precision]
    ns = train_tiny.build_parser().parse_args(targv)
    ctx = pipeline.Context(ns)
    ctx.cfg = cfg
    os.makedirs(out_dir, exist_ok=True)
    # a tokenizer of the same vocabulary trained by an earlier variant is the same file: copy it
    for other in os.listdir(args.runs):
        tok = os.path.join(args.runs, other, "tokenizer.tiktoken")
        other_result = os.path.join(args.runs, other, "result.json")
        if (other != name and os.path.exists(other_result) and os.path.exists(tok)
                and json.load(open(other_result))["vocab"] == cfg["vocab_size"]
                and not os.path.exists(os.path.join(out_dir, "tokenizer.tiktoken"))):
            for path in (tok, tok[:-len(".tiktoken")] + ".vocab"):
                shutil.copy(path, out_dir)
    pipeline.stage_corpus(ctx)
    pipeline.stage_tokenizer(ctx)
    pipeline.stage_tokens(ctx)
    tc = cfg["target_train"]
    if args.steps:  # a fixed number of steps, the schedule over them: the loss does not depend on the load
        cfg["target_train"] = replace(tc, max_iters=args.steps, max_seconds=0.0, eval_interval=max(args.steps // 3, 1))
    else:  # what make train does (max_iters out of the way): fair on a quiet machine only
        cfg["target_train"] = replace(tc, max_iters=100_000, max_seconds=args.seconds or tc.max_seconds)
    load_before = os.getloadavg()[0]
    ctx.stage_started = t0 = time.perf_counter()
    losses = pipeline.stage_target(ctx)
    wall = time.perf_counter() - t0
    ckpt = load_checkpoint(os.path.join(out_dir, "target.pt"))
    t, tc = cfg["target"], cfg["target_train"]
    result = dict(name=name, shape=f"{t.n_layer}x{t.n_embd} h{t.n_head}", vocab=cfg["vocab_size"],
                  context=t.block_size, batch=tc.batch_size, optimizer=tc.optimizer, head_fraction=cfg["head_fraction"],
                  params=sum(v.numel() for k, v in ckpt["model"].items() if k != "wpe.weight" and k != "lm_head.weight"),
                  steps=ckpt["step"], tokens=ckpt["step"] * tc.batch_size * t.block_size, seconds=ckpt["seconds"],
                  bpb=losses["bpb"], nats=losses["main"], wall=wall, precision=args.precision,
                  load=f"{load_before:.1f}/{os.getloadavg()[0]:.1f}")
    json.dump(result, open(result_path, "w"))
    return result


def table(results):
    lines = ["| variant | shape | vocab | batch x context | optimizer | heads' positions | params | steps | tokens "
             "| tokens/s (run) | val bits/byte | val nats/token | wall | load before/after |", "|" + "---|" * 14]
    for r in results:
        lines.append(f"| {r['name']} | {r['shape']} | {r['vocab']} | {r['batch']} x {r['context']} | "
                     f"{r['optimizer']} | 1/{1 / r['head_fraction']:.0f} | {r['params'] / 1e6:.2f}M | {r['steps']} | "
                     f"{r['tokens'] / 1e6:.2f}M | {r['tokens'] / r['seconds'] / 1e3:.1f}k | {r['bpb']:.3f} | "
                     f"{r['nats']:.3f} | {r['wall']:.0f}s | {r['load']} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--variants", default="all", help=f"comma-separated, or all: {', '.join(VARIANTS)}")
    p.add_argument("--seconds", type=float, default=None,
                   help="wall-clock budget of each run, as make train gives it (default: the preset's target budget)")
    p.add_argument("--steps", type=int, default=0,
                   help="train each variant for this many steps instead: fair on a busy machine too")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="fp32 is the reference")
    p.add_argument("--runs", default="runs/sweep", help="one folder per variant")
    p.add_argument("--data-dir", default="data", help="the corpus (built by the first run if missing)")
    p.add_argument("--table", action="store_true", help="only print the table of the runs already made")
    args = p.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            sys.exit(f"error: unknown variant {name!r}; the variants are {', '.join(VARIANTS)}")
    os.makedirs(args.runs, exist_ok=True)
    results = []
    for name in names:
        done = os.path.exists(os.path.join(args.runs, name, "result.json"))
        if args.table and not done:
            continue
        results.append(run_variant(name, args))
        print(table(results[-1:]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
