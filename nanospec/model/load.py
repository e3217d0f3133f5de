"""
`Models`, the bundle every decoding method receives, and `load_models`, which assembles it from a run folder
written by `make train`:

    out/tokenizer.tiktoken   always
    out/target.pt            always: the model every method must reproduce
    out/heads.pt             "heads": the MTP heads retrained alone, put on the target (mtp, medusa)
    out/draft.pt             "draft": a smaller GPT (speculative)
    out/eagle.pt             "eagle": the EAGLE head (eagle)
    out/parallelspec.pt      "parallelspec": the mask-token drafter (parallelspec)
    out/early_exit.pt        "early_exit": the exit adapters (early-exit)

Only the parts asked for are read, so a broken eagle.pt cannot stop `decode.py --method ar`. Every drafter
must have been trained on this very target.pt (its fingerprint is in the file), else a one-line error says
which stage to rerun. Each decoding
module says which parts it needs (NEEDS) and which it uses when present (USES); `decoding.parts_for` turns a
list of methods into the parts to load. nanospec/model/checkpoint.py reads single files and knows no drafter; this
module is the one place that knows them all.
"""
import os
from dataclasses import dataclass

import torch

from nanospec.model.checkpoint import (CheckpointError, check_target, load_checkpoint, load_gpt, load_module,
                                       load_weights, target_fingerprint)
from nanospec.model.drafters.eagle import Eagle, EagleConfig
from nanospec.model.drafters.early_exit import ExitAdapter
from nanospec.model.drafters.parallelspec import ParallelSpec, ParallelSpecConfig
from nanospec.model.gpt import GPT, GPTConfig
from nanospec.tokenizer import Tokenizer


@dataclass
class Models:
    """Everything a decoding method may use. Methods take what they need and say so if a part is missing."""
    target: GPT  # the model whose output every method must reproduce; carries the MTP heads
    tokenizer: Tokenizer = None  # for display and end-of-text; tests with random models may leave it out
    draft: GPT = None  # a smaller GPT on the same tokenizer, for `speculative`
    eagle: torch.nn.Module = None  # feature-level draft head, for `eagle`
    parallelspec: torch.nn.Module = None  # mask-token parallel drafter, for `parallelspec`
    early_exit: torch.nn.Module = None  # adapters that make the target's first layers a draft, for `early-exit`
    eot: int = None  # end-of-text id: generation stops there (None: never stops early)
    tuned_heads: bool = False  # True when heads.pt (the heads-only phase) replaced the jointly trained MTP heads
    step_costs: dict = None  # the seconds of a step with k guesses, per method: what --adaptive cost prices with
    #                          (nanospec/bench/calibration.py measures them on this machine; None: not measured)


def load_eagle(path, tokenizer_identity=None, device="cpu", target_id=None):
    """The bare EAGLE head from eagle.pt; every call then takes the target it was trained on (target_id: that
    target's fingerprint, checked when given)."""
    # an eagle.pt from before a field of EagleConfig has none: its head was trained as the heads were then, with
    # attention (EAGLE-1's block), the exact GELU, position embeddings and RMS-normed features
    before = {"attention": True, "gelu": "none", "positions": True, "feature_norm": "rms"}
    return load_module(path, tokenizer_identity, device, lambda cfg: Eagle(EagleConfig(**{**before, **cfg})),
                       "eagle", target_id)


def load_parallelspec(path, tokenizer_identity=None, device="cpu", target_id=None):
    """The drafter from parallelspec.pt (target_id: the fingerprint of the target it must have learnt from)."""
    return load_module(path, tokenizer_identity, device, lambda cfg: ParallelSpec(ParallelSpecConfig(**cfg)),
                       "parallelspec", target_id)


def load_early_exit(path, tokenizer_identity=None, device="cpu", target_id=None):
    """The adapters from early_exit.pt; `exit_logits` applies them on the target they were trained on (target_id:
    that target's fingerprint, checked when given)."""
    return load_module(path, tokenizer_identity, device, lambda cfg: ExitAdapter(GPTConfig(**cfg)), "early_exit",
                       target_id)


def load_heads(path, target, tokenizer_identity=None, target_id=None):
    """Put the MTP heads from heads.pt on `target` (in place), after checking they were trained for it (target_id:
    its fingerprint, computed here when not given)."""
    ckpt = load_checkpoint(path, tokenizer_identity, part="heads")
    check_target(path, ckpt, target_id or target_fingerprint(target), "heads")
    load_weights(path, target.heads, ckpt["model"])
    return target


# optional drafter -> how to read its file, `<part>.pt` beside target.pt: (path, tokenizer, device, target_id)
LOADERS = {
    "eagle": load_eagle,
    "parallelspec": load_parallelspec,
    "early_exit": load_early_exit,
}
PARTS = ("heads", "draft", *LOADERS)  # every optional part, in the order `make train` trains them


def load_models(ckpt_dir, device="cpu", parts=None):
    """The tokenizer, the target and the optional `parts` found in a run folder (None: every part present).
    A part asked for but absent is simply left None (the method then says which stage to run); a part present
    but unreadable is a CheckpointError."""
    parts = PARTS if parts is None else tuple(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown model part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    tok_path = os.path.join(ckpt_dir, "tokenizer.tiktoken")
    if not os.path.isfile(tok_path):
        what = "a folder, not a tokenizer file" if os.path.isdir(tok_path) else "missing"
        raise CheckpointError(f"{tok_path} is {what}: run `make train` (or pass --ckpt FOLDER)")
    try:
        tokenizer = Tokenizer.load(tok_path)
    except ValueError as e:  # a corrupt file: the message says so and what to do
        raise CheckpointError(str(e)) from None
    target = load_gpt(os.path.join(ckpt_dir, "target.pt"), tokenizer.identity, device, part="target")
    target_id = target_fingerprint(target) if set(parts) - {"draft"} else None  # before heads.pt changes it
    models = Models(target=target, tokenizer=tokenizer, eot=tokenizer.eot)
    path = os.path.join(ckpt_dir, "heads.pt")
    if "heads" in parts and os.path.exists(path):  # the retrained MTP heads replace the joint ones
        load_heads(path, target, tokenizer.identity, target_id)
        models.tuned_heads = True
    path = os.path.join(ckpt_dir, "draft.pt")
    if "draft" in parts and os.path.exists(path):  # a GPT of its own: it never reads the target
        models.draft = load_gpt(path, tokenizer.identity, device, part="draft")
    for part, load in LOADERS.items():
        path = os.path.join(ckpt_dir, f"{part}.pt")
        if part in parts and os.path.exists(path):
            setattr(models, part, load(path, tokenizer.identity, device, target_id))
    return models
