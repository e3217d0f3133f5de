"""
Train everything nanospec decodes with, in stages, each skipped when its output already exists (the stages and
what each writes: nanospec/training/pipeline.py):

    corpus, tokenizer, target, heads, draft, eagle, parallelspec, early_exit

    python train_tiny.py                      # all stages with the default CPU preset (`make train`)
    python train_tiny.py --stage draft        # one stage (its prerequisites run if missing)
    python train_tiny.py --preset gpu         # the deep GPU preset, into out-gpu/ (`make train PRESET=gpu`)
    python train_tiny.py --preset toy --max-iters 20 --out-dir /tmp/toy   # a toy model in seconds

A crash or Ctrl-C loses at most the steps since the last checkpoint: run the same command to resume. A file of a
name it writes that it did not write (your own data/train.txt, out/train.bin, ...) is refused, never replaced.
A reader that goes away (`| head`) stops the printing, not the training.
"""
import argparse
import math
import sys

if __name__ == "__main__":  # first, before torch loads: Ctrl-C ends in one line, a closed pipe stops no training
    from nanospec.device import plain_exits
    plain_exits(keep_going=True)

from nanospec.training.presets import PRESETS
from nanospec.training.pipeline import STAGES, run
from nanospec.training.trainer import PRECISIONS

SEED_LIMIT = 2 ** 63  # torch.manual_seed takes a signed 64-bit integer


def bounded(kind, low, high, meaning):
    """An argparse type: a number of `kind` in [low, high), with a one-line message naming what it means."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (low <= value < high) or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {meaning}")
        return value
    return parse


def build_parser():
    p = argparse.ArgumentParser(description="Train nanospec's corpus, tokenizer, target GPT and draft models.")
    p.error = lambda message: sys.exit(f"error: {message} (see python train_tiny.py --help)")  # one line, no usage
    p.add_argument("--preset", default="tiny", choices=PRESETS,
                   help="model and training sizes (tiny: 2-core CPU, ~10 min; gpu: one H100, ~5 min; toy: tests)")
    p.add_argument("--stage", default="all", choices=["all", *STAGES], help="run one stage (and what it needs) or all")
    p.add_argument("--corpus", default=None, help="UTF-8 text file or folder to train on (default: Python's stdlib source)")
    p.add_argument("--data-dir", default=None,
                   help="where the corpus splits are written (default: data, or data-PRESET for presets but tiny)")
    p.add_argument("--out-dir", default=None,
                   help="where the tokenizer and checkpoints are written (default: out, or out-PRESET for presets "
                        "but tiny)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--max-iters", type=bounded(int, 1, math.inf, "a step count >= 1"), default=None,
                   help="override every trained stage's step count")
    p.add_argument("--max-seconds", type=bounded(float, 0, math.inf, "a finite number of seconds >= 0"),
                   default=None, help="override every trained stage's time budget (0: none, stop after the steps)")
    p.add_argument("--seed", type=bounded(int, 0, SEED_LIMIT, "a seed from 0 to 2**63 - 1"), default=1337,
                   help="seeds initialisation and batch order")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="auto: bf16 autocast where the hardware does it fast (AVX512-BF16/AMX CPUs, recent GPUs), "
                        "else fp32; fp32: always fp32, the reference (what most laptops and VMs train in); "
                        "bf16: always (slow where emulated)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    suffix = "" if args.preset == "tiny" else f"-{args.preset}"  # presets never share a run folder or a corpus
    args.data_dir = args.data_dir or "data" + suffix
    args.out_dir = args.out_dir or "out" + suffix
    run(args)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
