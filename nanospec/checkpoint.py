"""
Checkpoints: one file per trained part (`target.pt`, `draft.pt`, and later drafters) in one run folder, next
to the tokenizer they were trained with (`tokenizer.tiktoken`). This module reads and writes single files and
knows no drafter; nanospec/parts.py assembles the parts a decoding method needs.

Each file holds the part's config, its weights, the identity (sha256) of the tokenizer, and what training needs
to resume (optimizer state, step, seconds trained). Writes are atomic: write a temporary file, then rename it
over the old one, so a crash or Ctrl-C mid-write leaves the previous checkpoint intact. Loading uses
`torch.load(weights_only=True)`: a checkpoint is data, never code.
"""
import hashlib
import os
from dataclasses import asdict

import torch

from nanospec.model import GPT, GPTConfig


class CheckpointError(Exception):
    """A missing, corrupt or mismatched checkpoint; the message says what to do."""


def save_atomic(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the new one


def load_checkpoint(path, tokenizer_identity=None):
    """Read a checkpoint dict; clear errors for missing, corrupt and mismatched files."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: run `make train` (or `python train_tiny.py`) first")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, not a torch file, or one that holds code
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it and run `make train`")
    if not isinstance(ckpt, dict) or "config" not in ckpt or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a nanospec checkpoint; delete it and run `make train`")
    if tokenizer_identity is not None and ckpt.get("tokenizer") != tokenizer_identity:
        raise CheckpointError(f"{path} was trained with a different tokenizer than the one beside it; "
                              "retrain it (delete it and run `make train`) or use the matching --ckpt folder")
    return ckpt


def gpt_checkpoint(model, tokenizer_identity, **extra):
    return {"config": asdict(model.config), "model": model.state_dict(), "tokenizer": tokenizer_identity, **extra}


def load_module(path, tokenizer_identity, device, build):
    """Rebuild a trained part: `build(config dict)` makes the module, then its weights are loaded."""
    ckpt = load_checkpoint(path, tokenizer_identity)
    module = build(ckpt["config"])
    module.load_state_dict(ckpt["model"])
    return module.to(device).eval()


def load_gpt(path, tokenizer_identity=None, device="cpu"):
    return load_module(path, tokenizer_identity, device, lambda cfg: GPT(GPTConfig(**cfg)))


def target_fingerprint(target):
    """A short hash of the target's weights: a drafter trained on one target is no good for a retrained one."""
    h = hashlib.sha256()
    for name, t in sorted(target.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def frozen_target(name, out_dir, tokenizer_identity, device):
    """For the stage `name` that trains a part on out_dir/target.pt: that target, frozen, and its fingerprint."""
    path = os.path.join(out_dir, "target.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"the {name} stage learns from {path}: run `python train_tiny.py --stage target` first")
    target = load_gpt(path, tokenizer_identity, device).requires_grad_(False)
    return target, target_fingerprint(target)


def drafter_is_complete(name, path, tokenizer_identity, config, target_id):
    """What a drafter's training stage does with the checkpoint already at `path`: True (skip the stage) if it
    is complete and was trained for this config and this very target; False (train) otherwise. A file trained
    for another target or size is deleted first, since it is useless; an unfinished one is left to resume."""
    if not os.path.exists(path):
        return False
    ckpt = load_checkpoint(path, tokenizer_identity)
    if ckpt["config"] != config or ckpt.get("target") != target_id:
        print(f"{name}: {path} was trained for another target.pt or size; training it anew")
        os.remove(path)
        return False
    if ckpt.get("done"):
        print(f"{name}: {path} is complete, skipping (delete it to retrain)")
        return True
    return False
