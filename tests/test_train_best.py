"""Issue 35: every stage keeps the weights of its best validation (a rising curve ends with them), a resume after
Ctrl-C goes on from the last weights and keeps the best, torch's threads follow the other processes' load, and a
starved stage says so."""
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from nanospec.training import pipeline
from nanospec.training import trainer
from nanospec.model.checkpoint import gpt_checkpoint, load_checkpoint, load_gpt
from nanospec.model.gpt import GPT, GPTConfig
from nanospec.training.presets import PRESETS
from nanospec.training.trainer import TrainConfig, batch_rng, train, windows

TOKENS = np.random.default_rng(0).integers(0, 64, size=600).astype(np.uint16)


def scripted_run(path, curve, stop_at=None, cfg=TrainConfig(max_iters=10, eval_interval=2, batch_size=2,
                                                              warmup_iters=2)):
    """Train a small GPT for cfg.max_iters steps whose validation "loss" at step s is curve[s] (a scripted curve:
    the real loss would fall). Returns (model, {step: weights at that evaluation}, printed lines are the test's)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, n_future=0))
    at = {"step": 0}
    seen = {}

    def loss_fn(m, step):
        if step == stop_at:
            raise KeyboardInterrupt
        at["step"] = step + 1  # the step the next evaluation comes after
        w = windows(TOKENS, batch_rng(cfg, step), 2, 17)
        return F.cross_entropy(m(w[:, :-1]).logits.flatten(0, 1), w[:, 1:].flatten()), {}

    def eval_fn(m):
        seen[at["step"]] = {k: v.clone() for k, v in m.state_dict().items()}
        return {"loss": curve[at["step"]], "other": 0.0}

    train("part", model, loss_fn, eval_fn, cfg, str(path), lambda: gpt_checkpoint(model, "tok", part="target"),
          "cpu", 32)
    return model, seen


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rising_validation_curve_ends_with_the_best_weights(tmp_path, capsys):
    curve = {2: 5.0, 4: 3.0, 6: 2.0, 8: 4.0, 10: 6.0}  # falls to step 6, then rises: overfitting
    model, seen = scripted_run(tmp_path / "part.pt", curve)
    out = capsys.readouterr().out
    assert "validation rose at the end (loss 6.000 at step 10, 2.000 at step 6): keeping the weights of step 6" in out
    assert "done, 10 steps" in out and "kept step 6 (best validation)" in out
    ckpt = load_checkpoint(str(tmp_path / "part.pt"))
    assert ckpt["done"] and ckpt["step"] == 10 and ckpt["best"] == {"step": 6, "losses": {"loss": 2.0, "other": 0.0}}
    assert "last" not in ckpt  # a finished file holds the weights to decode with, not the discarded ones
    assert same(ckpt["model"], seen[6]) and not same(ckpt["model"], seen[10])
    assert same(model.state_dict(), seen[6])  # the model in memory too
    assert same(load_gpt(str(tmp_path / "part.pt"), part="target").state_dict(), seen[6])  # what decoding loads


def test_a_falling_curve_keeps_the_last_weights(tmp_path, capsys):
    model, seen = scripted_run(tmp_path / "part.pt", {2: 5.0, 4: 4.0, 6: 3.0, 8: 2.0, 10: 1.0})
    assert "rose" not in capsys.readouterr().out
    assert load_checkpoint(str(tmp_path / "part.pt"))["best"]["step"] == 10 and same(model.state_dict(), seen[10])


def test_ctrl_c_then_resume_goes_on_from_the_last_weights_and_keeps_the_best(tmp_path, capsys):
    curve = {2: 5.0, 4: 3.0, 6: 4.0, 8: 6.0, 10: 1.0}  # best at step 4 when Ctrl-C comes at step 7; at the end, 10
    unbroken, _ = scripted_run(tmp_path / "a.pt", curve)
    with pytest.raises(SystemExit):
        scripted_run(tmp_path / "b.pt", curve, stop_at=7)
    stopped = load_checkpoint(str(tmp_path / "b.pt"))
    assert stopped["step"] == 7 and stopped["best"]["step"] == 4 and not stopped["done"]
    assert "last" in stopped and not same(stopped["last"], stopped["model"])  # both the best and the current
    resumed, _ = scripted_run(tmp_path / "b.pt", curve)
    assert "resuming from" in capsys.readouterr().out
    assert same(unbroken.state_dict(), resumed.state_dict())  # went on from step 7's weights, not the best's
    curve[10] = 9.0  # and a resume whose end is worse keeps the best from before the interruption
    with pytest.raises(SystemExit):
        scripted_run(tmp_path / "c.pt", curve, stop_at=7)
    _, seen = scripted_run(tmp_path / "c.pt", curve)
    assert load_checkpoint(str(tmp_path / "c.pt"))["best"]["step"] == 4


# ----------------------------------------------------------------------------- threads and starved runs


def test_threads_for_gives_a_thread_up_per_busy_core():
    assert trainer.threads_for(0.0, 2) == 2 and trainer.threads_for(0.1, 2) == 2  # quiet (daemons)
    assert trainer.threads_for(0.3, 2) == 1 and trainer.threads_for(1.0, 2) == 1  # one core busy elsewhere
    assert trainer.threads_for(2.0, 2) == 1  # never none
    assert trainer.threads_for(3.2, 16) == 13 and trainer.threads_for(0.0, 16) == 16


@pytest.mark.skipif(trainer.CpuMeter.busy_seconds() is None, reason="no /proc/stat on this system")
def test_the_cpu_meter_sees_a_busy_process_beside_us():
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.3)
        meter = trainer.CpuMeter()
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass  # our own busy loop: one core
        reading = meter.read()
    finally:
        hog.kill()
        hog.wait()
    assert reading["others"] >= 0.4  # the hog (and whatever else this machine runs), not us
    assert reading["own"] > 0 and reading["cores"] >= 1  # (how much we got depends on the machine's load)


def record(steps, others, cores=2, stage="target"):
    cfg = PRESETS["tiny"][f"{stage}_train"]
    return {"steps": steps, "best_step": steps, "max_iters": cfg.max_iters, "max_seconds": cfg.max_seconds - 1,
            "cpu": {"own": 1.0, "others": others, "cores": cores, "wall": 300.0}}


def ctx(max_seconds=None, max_iters=None):
    return SimpleNamespace(cfg=PRESETS["tiny"], out_dir="out", records={},
                           args=SimpleNamespace(max_seconds=max_seconds, max_iters=max_iters))


def test_a_starved_stage_says_so_and_what_to_do():
    """Issue 35: 132 target steps of ~1100 while another process took a core, and nothing said so."""
    assert pipeline.starved_report(ctx(), "target", record(132, 1.0)) == [
        "warning: target got only 132 steps of the ~1089 a quiet reference machine reaches in its 315s; other "
        "processes kept 1.0 of 2 cores busy: the machine was busy."]
    assert "slower than the preset's reference" in pipeline.starved_report(ctx(), "target", record(132, 0.1))[0]
    assert pipeline.starved_report(ctx(), "target", record(600, 1.0)) == []  # over half: fine
    assert pipeline.starved_report(ctx(max_seconds=30), "target", record(132, 1.0)) == []  # another budget: no reference
    advice = pipeline.starved_advice(ctx(), ["target", "draft"])[0]
    assert "weaker model" in advice and "delete out/*.pt" in advice
    advice = pipeline.starved_advice(ctx(), ["draft", "eagle"])[0]
    assert "accepted less often" in advice and "delete out/draft.pt out/eagle.pt" in advice


def test_the_summary_lists_every_trained_stage():
    c = ctx()
    c.records = {"target": record(1000, 0.0), "draft": record(50, 1.2, stage="draft")}
    c.val_tokens = None
    lines = pipeline.summary(c)
    assert lines[0].startswith("summary:") and "target" in lines[1] and "~1089" in lines[1]
    assert any(line.startswith("warning: draft got only 50 steps of the ~384") for line in lines)
    assert "accepted less often" in lines[-1] and not any("target got" in line for line in lines)
