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

from nanospec.model.checkpoint import load_checkpoint, load_weights, save_atomic
from nanospec.training.muon import Muon, hidden_matrices


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
    optimizer: str = "adamw"  # adamw, or muon: Muon for the blocks' matrices (training/muon.py), AdamW for the rest
    muon_lr: float = 0.02  # Muon's peak rate (its updates have unit singular values, so it is not AdamW's scale)
    precision: str = "auto"  # auto: bf16 autocast where the hardware does it fast, else fp32; fp32: never bf16
    # steps the stage reaches in max_seconds on the preset's reference machine with nothing else running (0: not
    # known): a run that gets less than half says it was starved (pipeline.starved_report), instead of silently
    # saving a weaker model
    expected_steps: int = 0


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


class CpuMeter:
    """
    How much CPU a stretch of training got, and how much other processes took meanwhile: Linux's /proc/stat
    counts every core's busy time, and time.process_time() ours. cores: the machine's; own: the cores this
    process kept busy on average; others: those the rest of the machine did. Where /proc/stat is missing (macOS,
    Windows) `others` is None: the run cannot tell why it was slow.
    Example: 2 cores, `python -c "while 1: pass"` beside training -> others ~1.0, own ~1.0 at best.
    """

    def __init__(self):
        self.cores = os.cpu_count() or 1
        self.t0, self.own0, self.busy0 = time.perf_counter(), time.process_time(), self.busy_seconds()

    @staticmethod
    def busy_seconds():
        """Seconds of busy time summed over every core since boot, or None without /proc/stat."""
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is in user)
        return busy / os.sysconf("SC_CLK_TCK")

    def read(self):
        """{"wall", "own", "others", "cores"}: seconds since the start, the cores busy on average (ours, the
        rest's), and the machine's."""
        wall = max(time.perf_counter() - self.t0, 1e-9)
        own = (time.process_time() - self.own0) / wall
        busy = self.busy_seconds()
        others = None if busy is None or self.busy0 is None else max(0.0, (busy - self.busy0) / wall - own)
        return {"wall": wall, "own": own, "others": others, "cores": self.cores}


def threads_for(others, most):
    """The torch threads to train with when other processes keep `others` cores busy, at most `most` (the
    machine's, or what the user set): one thread fewer per busy core. With 2 threads on 2 cores and one core
    busy elsewhere, every operation waits for its slower half; measured on a 2-core EPYC VM, tiny target, fp32:
    1 thread 0.85-1.19 steps/s against 0.16-0.58 with 2 (docs/training.md, "Threads").
    Examples: threads_for(0.05, 2) -> 2; threads_for(1.0, 2) -> 1; threads_for(3.2, 16) -> 13."""
    return max(1, min(most, most - math.ceil(others - 0.25)))


MAX_THREADS = torch.get_num_threads()  # torch's own choice (the cores, or OMP_NUM_THREADS): never more than this
THREAD_CHECK_SECONDS = 10  # how often a CPU run looks at the other processes' load again


def adapt_threads(name, meter):
    """Set torch's threads for the load of the last stretch (meter: a CpuMeter of it); say so when it changes."""
    others = meter.read()["others"]
    if others is None:
        return
    n = threads_for(others, MAX_THREADS)
    if n != torch.get_num_threads():
        print(f"{name}: other processes keep {others:.1f} of {meter.cores} cores busy: training on {n} "
              f"thread{'s' * (n > 1)} (was {torch.get_num_threads()})", flush=True)
        torch.set_num_threads(n)


def resume(name, model, opts, cfg, ckpt_path):
    """Load an unfinished run of this part from ckpt_path into model and opts; return (step, seconds, best) trained
    so far, best being (step, losses, weights) of the best validation so far or None; (0, 0.0, None) when there is
    no run to resume."""
    if not os.path.exists(ckpt_path):
        return 0, 0.0, None
    ckpt = load_checkpoint(ckpt_path)
    if "optimizer" not in ckpt:
        return 0, 0.0, None
    load_weights(ckpt_path, model, ckpt.get("last", ckpt["model"]))  # "model" holds the best weights, "last" ours
    states = ckpt["optimizer"] if isinstance(ckpt["optimizer"], list) else [ckpt["optimizer"]]
    if len(states) != len(opts):
        raise ValueError(f"{ckpt_path} was trained with another optimizer than {cfg.optimizer!r}: "
                         "delete it to retrain, or use another --out-dir")
    for opt, state in zip(opts, states):
        opt.load_state_dict(state)
    best = (ckpt["best"]["step"], ckpt["best"]["losses"], ckpt["model"]) if ckpt.get("best") else None
    print(f"{name}: resuming from {ckpt_path} at step {ckpt['step']} ({ckpt['seconds']:.0f}s trained)")
    return ckpt["step"], ckpt["seconds"], best


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


def shown(losses):
    return " | ".join(f"{k} {v:.3f}" for k, v in losses.items())


def train(name, model, loss_fn, eval_fn, cfg, ckpt_path, ckpt_fields, device, tokens_per_step, record=None,
          threads="fixed"):
    """Train `model` in place; resume from `ckpt_path` if it holds an unfinished run of the same part.
    `ckpt_fields()` returns what the checkpoint stores besides the training state (config, weights, tokenizer).

    The weights kept are those of the best validation (as nanoGPT does): the first figure eval_fn returns is the
    one compared (lower is better); the checkpoint's "model" holds them, and until the run is done "last" holds
    the current weights, which a resume continues from. At the end the model holds the best weights, and the
    returned losses are theirs. `record` (a dict), when given, receives what the run reached: steps, seconds,
    the best step, and the CPU it got (CpuMeter). threads="auto" (make train, on a CPU): every
    THREAD_CHECK_SECONDS, one torch thread fewer per core that other processes keep busy (threads_for); "fixed"
    (tests, which compare runs bit for bit): torch's threads as they are."""
    opts = make_optimizers(model, cfg)
    step, seconds, best = resume(name, model, opts, cfg, ckpt_path)
    amp = autocast_dtype(device, cfg.precision)
    autocast = lambda: torch.autocast(device.split(":")[0], dtype=amp or torch.float32, enabled=amp is not None)
    steps_before = step  # a resumed run: the steps of this call are what its CPU share is measured over

    def keep_if_best(losses):
        """Remember the current weights if their validation is the best so far (ties: the later step)."""
        nonlocal best
        if not losses:
            return  # an eval_fn without figures (tests): the last weights are kept
        key = next(iter(losses))
        if best is None or losses[key] <= best[1][key]:
            best = (step, dict(losses), {k: v.detach().clone() for k, v in model.state_dict().items()})

    def save(done):
        fields = ckpt_fields()
        extra = {}
        if best is not None:
            extra = {"model": best[2], "best": {"step": best[0], "losses": best[1]}}
            if not done and best[0] != step:
                extra["last"] = fields["model"]  # what a resume continues from
        save_atomic({**fields, **extra, "optimizer": [opt.state_dict() for opt in opts], "step": step,
                     "seconds": seconds, "done": done, "train_config": asdict(cfg)}, ckpt_path)

    def evaluate():
        model.eval()
        with torch.no_grad(), autocast():
            losses = eval_fn(model)
        model.train()
        print(f"{name}: step {step} | val " + shown(losses), flush=True)
        return losses

    def time_left():  # of the wall-clock budget, keeping room for the final evaluation and save
        return cfg.max_seconds - seconds - reserve if cfg.max_seconds else float("inf")

    model.train()
    t_last, tok_rate = time.perf_counter(), 0.0
    reserve = 0.0  # how long the last evaluation + save took: the final one must fit in the budget too
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # `kill` and job schedulers: stop as cleanly as on Ctrl-C
    meter = window = CpuMeter()  # the whole run; the stretch since the last look at the load
    adapting = threads == "auto" and device == "cpu"
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
            if adapting and time.perf_counter() - window.t0 > THREAD_CHECK_SECONDS:
                adapt_threads(name, window)
                window = CpuMeter()
            if step % cfg.eval_interval == 0 or time.perf_counter() - t_last > 10 or step == cfg.max_iters:
                t_last = time.perf_counter()
                left = min((cfg.max_iters - step) * dt, time_left())
                print(f"{name}: step {step}/{cfg.max_iters} | loss {loss.item():.3f} | {shown(parts)} | "
                      f"{tok_rate / 1e3:.1f}k tok/s | lr {lr:.1e} | {seconds:.0f}s, ~{max(0, left):.0f}s left", flush=True)
            if step % cfg.eval_interval == 0 and step < cfg.max_iters:
                t_eval = time.perf_counter()
                keep_if_best(evaluate())
                save(done=False)
                reserve = time.perf_counter() - t_eval
                seconds += reserve
    except KeyboardInterrupt:
        save(done=False)
        print(f"\n{name}: interrupted at step {step}; checkpoint saved to {ckpt_path}. Run the same command to resume.")
        raise SystemExit(130)
    cpu = meter.read()
    last = evaluate()
    keep_if_best(last)
    if best is not None and best[0] != step:
        key = next(iter(last))
        print(f"{name}: validation rose at the end ({key} {last[key]:.3f} at step {step}, {best[1][key]:.3f} at step "
              f"{best[0]}): keeping the weights of step {best[0]}", flush=True)
        model.load_state_dict(best[2])
    save(done=True)
    kept = f", kept step {best[0]} (best validation)" if best is not None else ""
    print(f"{name}: done, {step} steps in {seconds:.0f}s{kept}, saved {ckpt_path}")
    if record is not None:
        record.update(steps=step, seconds=seconds, best_step=best[0] if best else step, expected=cfg.expected_steps,
                      max_iters=cfg.max_iters, max_seconds=cfg.max_seconds, steps_this_run=step - steps_before,
                      cpu=cpu, threads=torch.get_num_threads())
    return best[1] if best is not None else last
