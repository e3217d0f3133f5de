"""
Checkpoints: one file per trained part (`target.pt`, `draft.pt`, and later drafters) in one run folder, next
to the tokenizer they were trained with (`tokenizer.tiktoken`). This module reads and writes single files and
knows no drafter; nanospec/model/load.py assembles the parts a decoding method needs.

Each file holds the part's name and config, its weights, the identity (sha256) of the tokenizer, what training
needs to resume (optimizer state, step, seconds trained), for a drafter the fingerprint of the target it learnt
from, and a checksum of all that. Writes are atomic: write a temporary file, then rename it over the old one, so
a crash or Ctrl-C mid-write leaves the previous checkpoint intact (and `clean_orphans` removes the temporary
file a kill left behind). Loading uses `torch.load(weights_only=True)`: a checkpoint is data, never code; it
checks the checksum, the part, the tokenizer and the target, each with a one-line error naming the file.
"""
import glob
import hashlib
import os
import re
from dataclasses import asdict

import torch

from nanospec.model.gpt import GPT, GPTConfig


class CheckpointError(Exception):
    """A missing, corrupt or mismatched checkpoint; the message says what to do."""


def checksum(ckpt):
    """sha256 of everything a checkpoint dict holds but its own "checksum": every key, every value, and every
    tensor's dtype, shape and bytes. A flipped bit in the weights changes it; so does an edited config."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, dict):
            for key in sorted(x, key=str):
                h.update(repr(key).encode())
                feed(x[key])
        elif isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            for item in x:
                feed(item)
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy())  # the raw bytes, whatever the dtype (bf16 included)
        else:
            h.update(repr(x).encode())

    feed({k: v for k, v in ckpt.items() if k != "checksum"})
    return h.hexdigest()


def save_atomic(obj, path):
    """Write a checkpoint dict with its checksum: to a temporary file first, then renamed over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({**obj, "checksum": checksum(obj)}, tmp)
    os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the new one


def clean_orphans(folder):
    """Delete the temporary files (`NAME.pt.tmpPID`, and the token files' `NAME.bin.tmpPID`) that a save killed
    midway left in `folder`, those of processes no longer running. Returns their paths."""
    removed = []
    for tmp in sorted(glob.glob(os.path.join(glob.escape(folder), "*.pt.tmp*")) +
                      glob.glob(os.path.join(glob.escape(folder), "*.bin.tmp*"))):
        pid = re.fullmatch(r".*\.(?:pt|bin)\.tmp(\d+)", tmp)
        if pid is None or pid_alive(int(pid.group(1))):
            continue
        os.remove(tmp)
        removed.append(tmp)
    return removed


def pid_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists (another user's), or we cannot tell: keep its file
    return True


def load_checkpoint(path, tokenizer_identity=None, part=None):
    """Read a checkpoint dict; one-line errors for missing, corrupt (checksum) and mismatched files.
    part: the part the file must hold ("target", "eagle", ...), checked when the file names its own."""
    if not os.path.isfile(path):
        what = "a folder, not a checkpoint" if os.path.isdir(path) else "missing"
        raise CheckpointError(f"{path} is {what}: run `make train` (or `python train_tiny.py`) first")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, not a torch file, or one that holds code
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it and run `make train`")
    if not isinstance(ckpt, dict) or "config" not in ckpt or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a nanospec checkpoint; delete it and run `make train`")
    if "checksum" in ckpt and ckpt["checksum"] != checksum(ckpt):  # (files of older versions have none)
        raise CheckpointError(f"{path} is damaged (its checksum does not match its contents): delete it and "
                              "run `make train` again")
    if part is not None and ckpt.get("part", part) != part:
        raise CheckpointError(f"{path} holds the {ckpt['part']} part, not the {part}: put the right file there, or "
                              f"delete it and run `python train_tiny.py --stage {part}`")
    if tokenizer_identity is not None and ckpt.get("tokenizer") != tokenizer_identity:
        raise CheckpointError(f"{path} was trained with a different tokenizer than the one beside it; "
                              "retrain it (delete it and run `make train`) or use the matching --ckpt folder")
    return ckpt


def train_hint(part, folder="out"):
    """What to run when the run folder `folder` lacks `part`: the stage that trains it, into that very folder.
    train_hint("eagle") -> 'run `python train_tiny.py --stage eagle`'; train_hint("eagle", "runs/a") -> 'run
    `python train_tiny.py --stage eagle --out-dir runs/a` (with the --preset and --data-dir runs/a was trained
    with)'."""
    folder = os.path.normpath(folder)
    if folder == "out":  # the default run folder: the default command
        return f"run `python train_tiny.py --stage {part}`"
    return (f"run `python train_tiny.py --stage {part} --out-dir {folder}` (with the --preset and --data-dir "
            f"{folder} was trained with)")


def check_target(path, ckpt, target_id, stage):
    """A drafter is only good for the target it learnt from: refuse one whose fingerprint is another's."""
    if target_id is not None and ckpt.get("target") != target_id:
        raise CheckpointError(f"{path} was trained for another target.pt: retrain it with `python train_tiny.py "
                              f"--stage {stage}` (or `make train`), or delete it")


def load_weights(path, module, state):
    """module.load_state_dict(state), with a one-line error when the weights do not fit the module."""
    try:
        module.load_state_dict(state)
    except RuntimeError:
        raise CheckpointError(f"{path}: its weights do not fit its config (another part, or an edited file): "
                              "delete it and run `make train` again") from None


def gpt_checkpoint(model, tokenizer_identity, **extra):
    return {"config": asdict(model.config), "model": model.state_dict(), "tokenizer": tokenizer_identity, **extra}


def load_module(path, tokenizer_identity, device, build, part=None, target_id=None):
    """Rebuild a trained part: `build(config dict)` makes the module, then its weights are loaded. A drafter's
    file must have been trained on the target whose fingerprint is target_id (when given)."""
    ckpt = load_checkpoint(path, tokenizer_identity, part)
    check_target(path, ckpt, target_id, part)
    try:
        module = build(ckpt["config"])
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:  # unknown fields, impossible sizes
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path} holds a config that makes no model ({reason}); delete it and run "
                              "`make train` again") from None
    load_weights(path, module, ckpt["model"])
    return module.to(device).eval()


def load_gpt(path, tokenizer_identity=None, device="cpu", part=None):
    """A GPT (the target, or the draft when part="draft") from its checkpoint."""
    return load_module(path, tokenizer_identity, device, lambda cfg: GPT(GPTConfig(**cfg)), part)


def fingerprint(state):
    """A short hash of some weights (a state dict: name -> tensor), names included: 16 hex digits."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def target_fingerprint(target):
    """A short hash of the target's weights: a drafter trained on one target is no good for a retrained one."""
    return fingerprint(target.state_dict())


def frozen_target(name, out_dir, tokenizer_identity, device):
    """For the stage `name` that trains a part on out_dir/target.pt: that target, frozen, and its fingerprint."""
    path = os.path.join(out_dir, "target.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"the {name} stage learns from {path}: run `python train_tiny.py --stage target` first")
    target = load_gpt(path, tokenizer_identity, device, part="target").requires_grad_(False)
    return target, target_fingerprint(target)


def refuse_another_size(path, config, want, preset):
    """A checkpoint at `path` whose config is not `want` (the preset's): someone's model of another size, left as it
    is with a one-line error. The target's stage and the draft's refuse such a file (any draft GPT still drafts)."""
    if config != want:
        raise CheckpointError(f"{path} holds a model of another size than preset {preset!r}; delete it or use "
                              "another --out-dir")


def drafter_is_complete(name, path, tokenizer_identity, config, target_id):
    """What a drafter's training stage does with the checkpoint already at `path`: True (skip the stage) if it
    is complete and was trained for this config and this very target; False (train) otherwise. A file trained
    for another target or size is deleted first, since it is useless; an unfinished one is left to resume."""
    if not os.path.exists(path):
        return False
    ckpt = load_checkpoint(path, tokenizer_identity)
    if ckpt["config"] != config or ckpt.get("target") != target_id:
        print(f"{name}: {path} was trained for another target.pt, another config (its size, layer, activation or "
              "norm) or without the target (a draft.pt from before it was distilled); training it anew")
        os.remove(path)
        return False
    if ckpt.get("done"):
        print(f"{name}: {path} is complete, skipping (delete it to retrain)")
        return True
    return False
