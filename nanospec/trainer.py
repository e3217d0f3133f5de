"""
One training loop for every trained part (target, draft, drafters): AdamW, linear warmup then cosine decay,
periodic validation, a progress line, atomic checkpoints, resume, and a clean stop on Ctrl-C.

The part-specific bits come in as two functions: `loss_fn(model, step) -> (loss, {name: value})` draws its own
batch for that step and returns the loss to minimise, and `eval_fn(model) -> {name: val loss}`.

Schedule: progress = max(step / max_iters, seconds / max_seconds), so a run that hits its time budget first
still decays its learning rate to the end instead of stopping at full speed. `seconds` is wall-clock time of
the whole loop, evaluations and checkpoint saves included, and the loop stops early enough for the final
evaluation and save to fit: max_seconds bounds the call, not just the optimizer steps.
"""
import math
import os
import signal
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch

from nanospec.checkpoint import load_checkpoint, load_weights, save_atomic
from nanospec.muon import Muon, hidden_matrices


@dataclass
class TrainConfig:
    max_iters: int = 800  # optimizer steps; the main knob of training time
    max_seconds: float = 0.0  # also stop (and finish the schedule) after this many wall-clock seconds; 0 = none
    batch_size: int = 16  # sequences per step
    lr: float = 2e-3  # peak learning rate; tiny models take large rates
    min_lr: float = 2e-4  # the cosine ends here, a tenth of the peak
    warmup_iters: int = 40  # linear warmup avoids early divergence with a large rate
    weight_decay: float = 0.1  # AdamW decay on matrices only (not norms, biases, embeddings' positions)
    grad_clip: float = 1.0  # clip the global gradient norm: one bad batch cannot wreck the run
    eval_interval: int = 100  # steps between validation runs (also a checkpoint each time)
    seed: int = 1337  # seeds init and batches: the same command gives the same model
    optimizer: str = "adamw"  # adamw, or muon: Muon for the blocks' matrices (nanospec/muon.py), AdamW for the rest
    muon_lr: float = 0.02  # Muon's peak rate (its updates have unit singular values, so it is not AdamW's scale)
    precision: str = "auto"  # auto: bf16 autocast where the hardware does it fast, else fp32; fp32: never bf16


PRECISIONS = ("auto", "fp32", "bf16")


def fast_bf16(device):
    """Does this device run bfloat16 matmuls fast? Recent GPUs and CPUs with AVX512-BF16 or AMX do (about 2x
    fp32 on such a CPU); other CPUs (most laptops and VMs) emulate it, slower than fp32."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    if device == "cpu":
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def autocast_dtype(device, precision="auto"):
    """The autocast dtype of training: bfloat16 with precision "bf16", or "auto" where the hardware does it fast;
    None (plain fp32) otherwise. Weights and optimizer state stay fp32 either way; only matmuls run in bf16.
    fp32 is the reference: what most machines train in, and what every figure in README.md and docs/ names."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16" or (precision == "auto" and fast_bf16(device)):
        return torch.bfloat16
    return None


def make_optimizers(model, cfg):
    """AdamW for everything; or, with cfg.optimizer "muon", Muon for the blocks' hidden matrices and AdamW for
    the rest. Each param group's "lr_scale" is its peak rate over cfg.lr: the one schedule scales every group."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    to_muon = hidden_matrices(model) if cfg.optimizer == "muon" else set()
    adam = [(n, p) for n, p in named if n not in to_muon]
    groups = [{"params": [p for _, p in adam if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
              {"params": [p for _, p in adam if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0}]
    opts = [torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))]
    if to_muon:
        opts.append(Muon([{"params": [p for n, p in named if n in to_muon], "lr_scale": cfg.muon_lr / cfg.lr}],
                         lr=cfg.muon_lr))
    return opts


def lr_at(cfg, step, progress):
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def batch_rng(cfg, step):
    """The batch of step s depends only on (seed, s): a resumed run sees the same data as an unbroken one."""
    return np.random.default_rng([cfg.seed, step])


def windows(tokens, rng, batch_size, length, device="cpu"):
    """Random contiguous windows (batch_size, length) of a token array, on `device`. Every trained part draws
    its batches here, from the step's generator (`batch_rng`)."""
    starts = rng.integers(0, len(tokens) - length, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)).to(device)


def fixed_windows(tokens, n, length, device="cpu"):
    """n evenly spaced windows (n, length): the same validation batches at every evaluation."""
    starts = np.linspace(0, len(tokens) - length - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)).to(device)


def stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def resume(name, model, opts, cfg, ckpt_path):
    """Load an unfinished run of this part from ckpt_path into model and opts; return (step, seconds) trained
    so far, (0, 0.0) when there is none."""
    if not os.path.exists(ckpt_path):
        return 0, 0.0
    ckpt = load_checkpoint(ckpt_path)
    if "optimizer" not in ckpt:
        return 0, 0.0
    load_weights(ckpt_path, model, ckpt["model"])
    states = ckpt["optimizer"] if isinstance(ckpt["optimizer"], list) else [ckpt["optimizer"]]
    if len(states) != len(opts):
        raise ValueError(f"{ckpt_path} was trained with another optimizer than {cfg.optimizer!r}: "
                         "delete it to retrain, or use another --out-dir")
    for opt, state in zip(opts, states):
        opt.load_state_dict(state)
    print(f"{name}: resuming from {ckpt_path} at step {ckpt['step']} ({ckpt['seconds']:.0f}s trained)")
    return ckpt["step"], ckpt["seconds"]


def optimizer_step(model, opts, loss, lr, cfg):
    """Backward, clip, and one step of every optimizer at learning rate lr (each group at its own scale)."""
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def train(name, model, loss_fn, eval_fn, cfg, ckpt_path, ckpt_fields, device, tokens_per_step):
    """Train `model` in place; resume from `ckpt_path` if it holds an unfinished run of the same part.
    `ckpt_fields()` returns what the checkpoint stores besides the training state (config, weights, tokenizer)."""
    opts = make_optimizers(model, cfg)
    step, seconds = resume(name, model, opts, cfg, ckpt_path)
    amp = autocast_dtype(device, cfg.precision)
    autocast = lambda: torch.autocast(device.split(":")[0], dtype=amp or torch.float32, enabled=amp is not None)

    def save(done):
        save_atomic({**ckpt_fields(), "optimizer": [opt.state_dict() for opt in opts], "step": step,
                     "seconds": seconds, "done": done, "train_config": asdict(cfg)}, ckpt_path)

    def evaluate():
        model.eval()
        with torch.no_grad(), autocast():
            losses = eval_fn(model)
        model.train()
        print(f"{name}: step {step} | val " + " | ".join(f"{k} {v:.3f}" for k, v in losses.items()), flush=True)
        return losses

    def time_left():  # of the wall-clock budget, keeping room for the final evaluation and save
        return cfg.max_seconds - seconds - reserve if cfg.max_seconds else float("inf")

    model.train()
    t_last, tok_rate = time.perf_counter(), 0.0
    reserve = 0.0  # how long the last evaluation + save took: the final one must fit in the budget too
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # `kill` and job schedulers: stop as cleanly as on Ctrl-C
    try:
        while step < cfg.max_iters and time_left() > 0:
            t0 = time.perf_counter()
            progress = max(step / cfg.max_iters, seconds / (seconds + time_left()) if cfg.max_seconds else 0.0)
            lr = lr_at(cfg, step, progress)
            with autocast():
                loss, parts = loss_fn(model, step)
            optimizer_step(model, opts, loss, lr, cfg)
            step += 1
            dt = time.perf_counter() - t0
            seconds += dt
            tok_rate = 0.9 * tok_rate + 0.1 * tokens_per_step / dt if tok_rate else tokens_per_step / dt
            if step % cfg.eval_interval == 0 or time.perf_counter() - t_last > 10 or step == cfg.max_iters:
                t_last = time.perf_counter()
                left = min((cfg.max_iters - step) * dt, time_left())
                shown = " | ".join(f"{k} {v:.3f}" for k, v in parts.items())
                print(f"{name}: step {step}/{cfg.max_iters} | loss {loss.item():.3f} | {shown} | "
                      f"{tok_rate / 1e3:.1f}k tok/s | lr {lr:.1e} | {seconds:.0f}s, ~{max(0, left):.0f}s left", flush=True)
            if step % cfg.eval_interval == 0 and step < cfg.max_iters:
                t_eval = time.perf_counter()
                evaluate()
                save(done=False)
                reserve = time.perf_counter() - t_eval
                seconds += reserve
    except KeyboardInterrupt:
        save(done=False)
        print(f"\n{name}: interrupted at step {step}; checkpoint saved to {ckpt_path}. Run the same command to resume.")
        raise SystemExit(130)
    losses = evaluate()
    save(done=True)
    print(f"{name}: done, {step} steps in {seconds:.0f}s, saved {ckpt_path}")
    return losses
