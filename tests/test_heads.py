"""The heads-only phase (nanospec/training/heads.py): the batched rollouts are the target's own greedy text, the
loss matches a slow position-by-position version, a few steps raise the heads' agreement, and the stage and
loader handle heads.pt like every other trained part (skip, retrain for a new target, clear errors)."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanospec.model.checkpoint import CheckpointError, gpt_checkpoint, load_checkpoint, save_atomic
from nanospec.model.load import Models, load_heads, load_models
from nanospec.decoding import METHODS
from nanospec.training.heads import head_losses, rollouts
from nanospec.training.drafters import train_heads as train_stage
from nanospec.training.trainer import TrainConfig
from toys import random_ids, tiny_gpt


def test_rollouts_are_the_targets_greedy_text_row_by_row():
    target = tiny_gpt(3, vocab_size=23)
    prompts = torch.tensor([random_ids(5, vocab=23, seed=s) for s in range(6)])  # (6, 5)
    seq = rollouts(target, prompts, 9)
    assert seq.shape == (6, 14) and torch.equal(seq[:, :5], prompts)
    for row in range(6):
        ar = METHODS["ar"](Models(target=target), prompts[row].tolist(), 9)[0]
        assert seq[row, 5:].tolist() == ar


def test_head_losses_match_a_slow_position_by_position_loss():
    """Head i at t must learn token t+1+i; an off-by-one there would train every head for the wrong token.
    The slow version runs one plain forward per prefix."""
    target = tiny_gpt(1, vocab_size=13, n_future=3)
    seq = torch.tensor([random_ids(12, vocab=13, seed=4), random_ids(12, vocab=13, seed=5)])  # (2, 12)
    fast = head_losses(target.heads, target, seq)
    for i in (1, 2, 3):
        ce, agree, n = 0.0, 0, 0
        for b in range(2):
            for t in range(11 - i):  # token t+1+i must exist
                head = target.head_logits(target(seq[b:b + 1, :t + 1]).hidden[:, -1:])[0, i - 1, 0]  # (V,)
                truth = seq[b, t + 1 + i]
                ce -= torch.log_softmax(head, -1)[truth].item()
                agree += int(head.argmax() == truth)
                n += 1
        assert fast[f"head{i}"].item() == pytest.approx(ce / n, rel=1e-9)
        assert fast[f"agree{i}"].item() == pytest.approx(agree / n)
    assert fast["total"].item() == pytest.approx(sum(fast[f"head{i}"].item() for i in (1, 2, 3)))


def test_a_few_steps_raise_the_heads_agreement_with_the_target():
    target = tiny_gpt(2, vocab_size=13, n_future=2)
    target.requires_grad_(False)
    target.heads.requires_grad_(True)
    seq = rollouts(target, torch.tensor([random_ids(4, vocab=13, seed=s) for s in range(8)]), 28)  # (8, 32)
    opt = torch.optim.Adam(target.heads.parameters(), lr=1e-2)
    before = head_losses(target.heads, target, seq)
    for _ in range(60):
        loss = head_losses(target.heads, target, seq)["total"]
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = head_losses(target.heads, target, seq)
    assert after["total"] < before["total"]
    for i in (1, 2):  # (a random model's greedy text soon repeats one token: easy to learn, once trained)
        assert after[f"agree{i}"] > max(0.8, before[f"agree{i}"] + 0.3), (before, after)
    assert not any(p.grad is not None for p in target.blocks.parameters())  # the trunk stays frozen


def test_stage_trains_skips_retrains_and_the_loader_puts_the_heads_on(tmp_path, capsys):
    def save_target(seed):
        model = tiny_gpt(seed, vocab_size=13, block_size=16).float()
        save_atomic(gpt_checkpoint(model, "tok", done=True), tmp_path / "target.pt")
        return model

    tokens = np.array(random_ids(400, vocab=13, seed=1), dtype=np.uint16)
    ctx = SimpleNamespace(out_dir=str(tmp_path), device="cpu", tokenizer=SimpleNamespace(identity="tok"),
                          train_tokens=tokens, val_tokens=tokens[:100],
                          train_cfg=lambda key: TrainConfig(max_iters=3, batch_size=2, eval_interval=3, warmup_iters=1))
    joint = save_target(0)
    train_stage(ctx)
    first = load_checkpoint(str(tmp_path / "heads.pt"), "tok")
    assert first["done"] and first["step"] == 3 and set(first["model"]) == set(joint.heads.state_dict())
    train_stage(ctx)
    assert "complete, skipping" in capsys.readouterr().out

    target = tiny_gpt(0, vocab_size=13, block_size=16).float()
    load_heads(str(tmp_path / "heads.pt"), target, "tok")
    for name, p in target.heads.state_dict().items():
        assert torch.equal(p, first["model"][name])
    assert not torch.equal(target.heads[0].mlp.c_fc.weight, joint.heads[0].mlp.c_fc.weight)  # it trained

    save_target(1)  # the target was retrained: the old heads are stale, a clear error until retrained
    with pytest.raises(CheckpointError, match="another target.pt.*make train"):
        load_heads(str(tmp_path / "heads.pt"), tiny_gpt(1, vocab_size=13, block_size=16).float(), "tok")
    train_stage(ctx)
    assert "another target.pt" in capsys.readouterr().out
    assert load_checkpoint(str(tmp_path / "heads.pt"), "tok")["target"] != first["target"]


def test_load_models_uses_heads_pt_when_present(tmp_path):
    import train_tiny
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        body = "".join(f"    y{j} = g(y{j - 1}, {i})\n" for j in range(1, 25))
        (src / f"m{i}.py").write_text(f"def h_{i}(y0):\n{body}    return y24\n")
    out = tmp_path / "out"
    train_tiny.main(["--preset", "toy", "--corpus", str(src), "--data-dir", str(tmp_path / "data"),
                     "--out-dir", str(out), "--max-iters", "4", "--stage", "heads"])
    tuned = load_models(str(out))
    assert tuned.tuned_heads
    os.rename(out / "heads.pt", tmp_path / "heads.pt")
    joint = load_models(str(out))
    assert not joint.tuned_heads
    assert not torch.equal(tuned.target.heads[0].mlp.c_proj.weight, joint.target.heads[0].mlp.c_proj.weight)
    for name, p in joint.target.state_dict().items():  # everything but the heads is target.pt's
        if not name.startswith("heads."):
            assert torch.equal(p, tuned.target.state_dict()[name])
    prompt = random_ids(6, vocab=tuned.target.config.vocab_size)
    assert METHODS["medusa"](tuned, prompt, 12)[0] == METHODS["ar"](tuned, prompt, 12)[0]


def test_a_stage_without_target_pt_is_a_clear_error(tmp_path):
    ctx = SimpleNamespace(out_dir=str(tmp_path), device="cpu", tokenizer=SimpleNamespace(identity="tok"))
    with pytest.raises(CheckpointError, match="heads stage learns from .*target.pt.*--stage target"):
        train_stage(ctx)
