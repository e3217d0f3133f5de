"""The draft GPT of `speculative` is distilled from the frozen target (nanospec/training/drafters.py, draft_recipe;
drafter_losses.draft_losses): what it minimises, and that its stage trains it on this very target."""
import copy
import os

import torch

from nanospec.model.checkpoint import load_checkpoint, target_fingerprint
from nanospec.model.gpt import GPT, GPTConfig
from nanospec.model.load import load_models
from nanospec.training.drafter_losses import draft_losses

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, n_future=0)


def test_the_losses_vanish_for_a_draft_that_is_the_target():
    torch.manual_seed(0)
    target = GPT(CFG).eval()
    w = torch.randint(0, 64, (3, 32))
    same = draft_losses(copy.deepcopy(target), target, w)
    assert abs(same["kl"].item()) < 1e-5 and abs(same["accept"].item() - 1) < 1e-5 and same["agree"].item() == 1.0
    other = draft_losses(GPT(CFG).eval(), target, w)  # another random GPT: a law of its own
    assert other["kl"].item() > 1e-3 and other["accept"].item() < 0.99


def test_accept_is_the_chance_a_drawn_guess_is_kept():
    """accept = sum(min(p, q)) averaged over the positions, the acceptance rate of Leviathan's rule at t=1."""
    torch.manual_seed(1)
    target, draft = GPT(CFG).eval(), GPT(CFG).eval()
    w = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        p, q = torch.softmax(target(w).logits, -1), torch.softmax(draft(w).logits, -1)
    expected = torch.minimum(p, q).sum(-1).mean().item()
    assert abs(draft_losses(draft, target, w)["accept"].item() - expected) < 1e-5


def test_only_the_draft_learns():
    torch.manual_seed(2)
    target, draft = GPT(CFG).eval(), GPT(CFG)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft_losses(draft, target, torch.randint(0, 64, (2, 32)))["kl"].backward()
    assert all(p.grad is None for p in target.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_the_draft_stage_trains_on_this_very_target(toy_run):
    """The toy run's draft.pt records the fingerprint of the target it was distilled from, as every drafter
    stage's checkpoint does, and decodes as `speculative`'s draft."""
    ckpt = load_checkpoint(os.path.join(toy_run, "draft.pt"))
    models = load_models(str(toy_run), parts=["draft"])
    assert ckpt["part"] == "draft" and ckpt["done"]
    assert ckpt["target"] == target_fingerprint(models.target)
    assert models.draft.config.n_layer < models.target.config.n_layer


def test_a_draft_from_before_distillation_still_decodes_and_is_retrained(tmp_path, capsys):
    """A draft.pt of the corpus-trained stage (no target fingerprint) still loads as `speculative`'s draft (any
    draft keeps the output exact), but `make train` trains it anew, distilled, and says why."""
    from dataclasses import asdict

    from nanospec.model.checkpoint import drafter_is_complete, gpt_checkpoint, load_gpt, save_atomic
    path = tmp_path / "draft.pt"
    draft = GPT(CFG)
    save_atomic({**gpt_checkpoint(draft, None, part="draft"), "done": True}, str(path))
    assert load_gpt(str(path), part="draft").config == CFG  # what load_models reads for `speculative`
    assert drafter_is_complete("draft", str(path), None, asdict(CFG), "0123456789abcdef") is False
    assert not path.exists() and "without the target" in capsys.readouterr().out


def test_a_draft_of_another_size_is_refused_not_replaced(tmp_path):
    """Any draft GPT on this tokenizer drafts for any target, so a draft.pt of another size (someone's own) is left as
    it is, with a one-line error, as before the draft was distilled; one of this size goes on to training."""
    from types import SimpleNamespace

    import pytest

    from nanospec.model.checkpoint import CheckpointError, gpt_checkpoint, save_atomic
    from nanospec.training.drafters import train_draft
    path = tmp_path / "draft.pt"
    ctx = SimpleNamespace(out_dir=str(tmp_path), tokenizer=SimpleNamespace(identity=None, vocab_size=64),
                          device="cpu", cfg={"draft": CFG}, preset="toy")
    bigger = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, n_future=0)
    save_atomic({**gpt_checkpoint(GPT(bigger), None, part="draft"), "done": True}, str(path))
    with pytest.raises(CheckpointError, match="another size than preset 'toy'"):
        train_draft(ctx)
    assert path.exists()
    save_atomic({**gpt_checkpoint(GPT(CFG), None, part="draft"), "done": True}, str(path))
    with pytest.raises(CheckpointError, match="target.pt"):  # this size: on to the stage, which needs the target
        train_draft(ctx)
