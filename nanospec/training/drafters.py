"""
The training stages of the drafters that learn from the frozen target: heads, draft, eagle, parallelspec, early_exit.

Every one follows the same skeleton, `train_drafter`:

    load out/target.pt, frozen, and its fingerprint
    skip if out/<name>.pt is complete and was trained for this config and this very target
    seed, build the drafter, draw fixed validation windows
    train (nanospec/training/trainer.py): each step draws random windows from the step's generator
    save out/<name>.pt with the config, the weights, the tokenizer's identity and the target's fingerprint

What differs is a `Recipe`: the drafter's config and module, its losses (nanospec/training/drafter_losses.py; the MTP
heads' in heads.py), and the length of its windows. Only
training imports this module: decoding reads the drafters through nanospec/model/load.py and never loads the trainer.
Why each recipe is what it is (the measurements behind it): docs/training-notes.md.
"""
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch

from nanospec.model.checkpoint import drafter_is_complete, frozen_target, load_checkpoint, refuse_another_size
from nanospec.model.gpt import GPT
from nanospec.training import heads
from nanospec.model.drafters.eagle import Eagle, eagle_config
from nanospec.model.drafters.early_exit import ExitAdapter
from nanospec.training.drafter_losses import draft_losses, eagle_losses, exit_losses, mask_losses
from nanospec.model.drafters.parallelspec import ParallelSpec, ParallelSpecConfig
from nanospec.training.trainer import batch_rng, fixed_windows, train, windows


@dataclass
class Recipe:
    """What one drafter's stage trains; `train_drafter` does the rest."""
    config: object  # the drafter's config (a dataclass): stored in its checkpoint, a changed one retrains it
    make: Callable  # () -> the module to train, called right after seeding (its init depends on --seed only)
    losses: Callable  # (module, w, rng) -> {"loss": what to minimise, others: shown}; rng is None in evaluation
    window: int  # tokens per training window
    n_val: int = 2  # validation windows, in training batches
    baseline: tuple = None  # (label, module): evaluated before training and printed, as the figure to beat
    sample: Callable = None  # (step) -> (w, rng): the step's batch, when it is not plain windows (heads)
    validation: Callable = None  # (batch_size) -> val: the validation batches, when not plain windows (heads)


def mean_losses(losses, module, val, batch_size):
    """Each figure of `losses(module, w, None)` averaged over the validation batches."""
    parts = [losses(module, val[i:i + batch_size], None) for i in range(0, len(val), batch_size)]
    return {k: sum(p[k].item() for p in parts) / len(parts) for k in parts[0]}


def train_drafter(ctx, name, recipe_of):
    """The stage `name` of train_tiny.py: train out/<name>.pt on out/target.pt, frozen, or skip it if it is
    complete and was trained on this very target (a file for another target or size is trained anew).
    recipe_of(ctx, target) -> the Recipe, or None when there is nothing to train."""
    t0, path = time.time(), os.path.join(ctx.out_dir, f"{name}.pt")
    target, target_id = frozen_target(name, ctx.out_dir, ctx.tokenizer.identity, ctx.device)
    recipe = recipe_of(ctx, target)
    if recipe is None or drafter_is_complete(name, path, ctx.tokenizer.identity, asdict(recipe.config), target_id):
        return
    train_cfg = ctx.train_cfg(f"{name}_train")
    torch.manual_seed(train_cfg.seed)
    module = recipe.make().to(ctx.device)
    B, L = train_cfg.batch_size, recipe.window
    n_params = sum(p.numel() for p in module.parameters())
    print(f"{name}: {n_params / 1e6:.2f}M parameters (the frozen target's not counted), windows of {L} tokens")

    def sample(step):
        rng = batch_rng(train_cfg, step)
        return windows(ctx.train_tokens, rng, B, L, ctx.device), rng

    sample = recipe.sample or sample
    val = (recipe.validation(B) if recipe.validation
           else fixed_windows(ctx.val_tokens, recipe.n_val * B, L, ctx.device))  # (n_val * B, L)

    def loss_fn(model, step):
        w, rng = sample(step)
        losses = recipe.losses(model, w, rng)
        return losses.pop("loss"), {k: v.item() for k, v in losses.items()}

    def eval_fn(model):
        return mean_losses(recipe.losses, model, val, B)

    if recipe.baseline is not None:
        label, before = recipe.baseline
        with torch.no_grad():
            print(f"{name}: {label} val | " + " | ".join(f"{k} {v:.3f}" for k, v in eval_fn(before).items()))
    train(name, module, loss_fn, eval_fn, train_cfg, path,
          lambda: {"part": name, "config": asdict(recipe.config), "model": module.state_dict(),
                   "tokenizer": ctx.tokenizer.identity, "target": target_id},
          ctx.device, B * L, record=getattr(ctx, "records", {}).setdefault(name, {}), threads="auto")
    print(f"{name}: stage took {time.time() - t0:.0f}s (loading the target and evaluations included)")


# ---------------------------------------------------------------------------------------------------------
# The recipes: recipe(ctx, target) -> Recipe, for the frozen target


def draft_config(ctx):
    """The preset's draft shape (far smaller than the target) on this run's tokenizer."""
    return replace(ctx.cfg["draft"], vocab_size=ctx.tokenizer.vocab_size)


def draft_recipe(ctx, target):
    """`speculative`'s draft: a GPT of draft_config distilled to the target's next-token law over windows that fill
    its context (drafter_losses.draft_losses)."""
    cfg = draft_config(ctx)

    def losses(draft, w, rng):  # w (B, T)
        out = draft_losses(draft, target, w)
        return {"loss": out.pop("kl"), **out}

    return Recipe(cfg, lambda: GPT(cfg), losses, window=cfg.block_size)


def eagle_recipe(ctx, target):
    """The EAGLE head, teacher-forced on the target's true features (nanospec/model/drafters/eagle.py); its loss is
    FEATURE_WEIGHT * feature + DIST_WEIGHT * dist, over windows that fill the target's context."""
    cfg = eagle_config(target.config)

    def losses(head, w, rng):  # w (B, T+1)
        out = eagle_losses(head, target, w)
        return {"loss": out.pop("total"), **out}

    return Recipe(cfg, lambda: Eagle(cfg), losses, window=cfg.block_size)


def early_exit_recipe(ctx, target):
    """One adapter per exit layer, distilled to the target's next-token law (nanospec/model/drafters/early_exit.py)."""
    T = min(128, target.config.block_size)  # short windows: an exit needs little context

    def losses(adapter, w, rng):  # w (B, T)
        # training: a random half of the positions (the V-wide unembedding dominates the cost; unbiased)
        pos = None if rng is None else torch.from_numpy(rng.choice(T, T // 2, replace=False)).to(w.device)
        out = exit_losses(adapter, target, w, pos)
        return {"loss": sum(v for k, v in out.items() if k.startswith("exit")), **out}

    return Recipe(target.config, lambda: ExitAdapter(target.config), losses, window=T,
                  baseline=("plain exit (no adapter)", None))


def parallelspec_recipe(ctx, target):
    """The mask-token drafter, distilled from the target's greedy choices (nanospec/model/drafters/parallelspec.py)."""
    tc = target.config
    cfg = ParallelSpecConfig(vocab_size=tc.vocab_size, block_size=tc.block_size, n_embd=tc.n_embd, n_head=tc.n_head,
                             **ctx.cfg.get("parallelspec", {}))  # a preset may resize the drafter
    k = cfg.n_masks
    T = min(128, cfg.block_size - k)  # real tokens per window; the window holds k more for the labels
    G = T // 2  # anchors per window: each adds k masks, so the drafter reads T + G*k tokens

    def losses(drafter, w, rng):  # w (B, T+k)
        if rng is None:  # evaluation: the same anchors every time
            anchors = torch.arange(0, T, 2, device=w.device)  # (G,)
        else:
            anchors = torch.from_numpy(np.sort(rng.choice(T, G, replace=False))).to(w.device)  # (G,)
        return mask_losses(drafter, target, w, anchors)

    return Recipe(cfg, lambda: ParallelSpec(cfg), losses, window=T + k, n_val=4)


def heads_recipe(ctx, target):
    """The target's MTP heads retrained on its own greedy text (nanospec/training/heads.py); None when the
    target has no heads. The batches are rollouts, generated a pool at a time, not windows of the corpus."""
    if not target.config.n_future:
        print("heads: the target has no MTP heads (n_future = 0), skipping")
        return None
    T, train_cfg = target.config.block_size, ctx.train_cfg("heads_train")
    B = train_cfg.batch_size
    P = min(heads.PROMPT_LEN, T // 2)  # the prompt of each rollout; the target writes the other T - P tokens
    per_pool = max(1, heads.POOL // B)  # batches in one pool of rollouts
    pool = {}  # the current pool: {index: (per_pool * B, T) rollouts}

    def sample(step):
        k = step // (heads.EPOCHS * per_pool)  # rollouts depend on (seed, k) only: a resume sees the same
        if k not in pool:
            pool.clear()
            rng = np.random.default_rng([train_cfg.seed, k])
            pool[k] = heads.rollouts(target, windows(ctx.train_tokens, rng, per_pool * B, P, ctx.device), T - P)
        j = step % per_pool
        return pool[k][j * B:(j + 1) * B], None

    def validation(batch_size):
        t_val = time.time()
        val = heads.rollouts(target, fixed_windows(ctx.val_tokens, 2 * batch_size, P, ctx.device), T - P)
        print(f"heads: {2 * batch_size} greedy rollouts of validation prompts in {time.time() - t_val:.0f}s")
        return val  # (2B, T)

    def losses(module, seq, rng):
        out = heads.head_losses(module, target, seq)
        return {"loss": out.pop("total"), **out}

    trained = target.heads.requires_grad_(True)  # the only trained part; the rest of the target stays frozen
    return Recipe(target.config, lambda: trained, losses, window=T, sample=sample, validation=validation,
                  baseline=("jointly trained heads on them", trained))


# ---------------------------------------------------------------------------------------------------------
# The stages, as train_tiny.py runs them (nanospec/training/pipeline.py trains the target first if it is missing)


def train_heads(ctx):
    """Stage "heads": out/heads.pt, the MTP heads retrained on the frozen target's own text."""
    train_drafter(ctx, "heads", heads_recipe)


def train_draft(ctx):
    """Stage "draft": out/draft.pt, the small GPT of `speculative`, distilled from the frozen target. A draft.pt of
    another size is refused, not replaced: unlike the other drafters' files, any draft GPT on this tokenizer still
    drafts for any target (someone's own, perhaps); one of this size trained before (on the corpus, or for another
    target) is trained anew, as train_drafter does."""
    path = os.path.join(ctx.out_dir, "draft.pt")
    if os.path.exists(path):
        refuse_another_size(path, load_checkpoint(path, ctx.tokenizer.identity, part="draft")["config"],
                            asdict(draft_config(ctx)), ctx.preset)
    train_drafter(ctx, "draft", draft_recipe)


def train_eagle(ctx):
    """Stage "eagle": out/eagle.pt, EAGLE's one-layer head on the frozen target's features."""
    train_drafter(ctx, "eagle", eagle_recipe)


def train_parallelspec(ctx):
    """Stage "parallelspec": out/parallelspec.pt, the drafter of k guesses in one pass."""
    train_drafter(ctx, "parallelspec", parallelspec_recipe)


def train_early_exit(ctx):
    """Stage "early_exit": out/early_exit.pt, the adapters that make the target's first layers a draft."""
    train_drafter(ctx, "early_exit", early_exit_recipe)
