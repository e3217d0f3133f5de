"""Muon (nanospec/training/muon.py): the Newton-Schulz iteration against the SVD it approximates, a Muon step that trains,
and the split of parameters between Muon and AdamW that the trainer makes."""
import pytest
import torch

from nanospec.model.gpt import GPT, GPTConfig
from nanospec.training.muon import Muon, hidden_matrices, orthogonalize
from nanospec.training.trainer import TrainConfig, make_optimizers


def test_worked_example_of_the_docstring():
    out = orthogonalize(torch.tensor([[3.0, 0.0], [0.0, 0.01]]))
    assert torch.allclose(out, torch.tensor([[0.70, 0.0], [0.0, 1.16]]), atol=0.01)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_orthogonalize_is_close_to_u_vt_of_the_svd(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(g, full_matrices=False)
    slow = U @ Vh  # the exact answer, the slow way
    fast = orthogonalize(g)
    assert fast.shape == g.shape
    s = torch.linalg.svdvals(fast)
    assert 0.6 < s.min() and s.max() < 1.25  # every direction about unit size (exactly 1 would be slow)
    cosine = (fast * slow).sum() / (fast.norm() * slow.norm())
    assert cosine > 0.97
    assert (orthogonalize(g.T) - fast.T).abs().max() < 1e-9  # a tall matrix is iterated as its transpose


def test_muon_fits_a_badly_conditioned_linear_map():
    torch.manual_seed(0)
    target = torch.randn(16, 16) @ torch.diag(torch.logspace(0, -2, 16))  # badly conditioned
    x = torch.randn(256, 16)
    w = torch.nn.Parameter(torch.zeros(16, 16))
    opt = Muon([w], lr=0.05)
    first = None
    for step in range(200):
        loss = ((x @ w.T - x @ target.T) ** 2).mean()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        w.grad = None
    assert loss.item() < 0.01 * first


def test_trainer_gives_the_blocks_matrices_to_muon_and_the_rest_to_adamw():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, n_future=1))
    names = hidden_matrices(model)
    assert names and all(n.startswith("blocks.") for n in names)
    assert not any("wte" in n or "lm_head" in n or "heads" in n for n in names)
    adamw, = make_optimizers(model, TrainConfig())
    assert sum(len(g["params"]) for g in adamw.param_groups) == len(list(model.parameters()))
    adamw, muon = make_optimizers(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02))
    assert isinstance(muon, Muon) and len(muon.param_groups[0]["params"]) == len(names)
    assert muon.param_groups[0]["lr_scale"] == pytest.approx(20.0)
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert len(in_adamw) + len(names) == len(list(model.parameters()))
    assert not in_adamw & {id(p) for p in muon.param_groups[0]["params"]}


def test_resuming_with_another_optimizer_is_a_clear_error(tmp_path):
    """A half-trained checkpoint keeps its optimizers' state: resuming it under another optimizer must stop
    with a message, not load AdamW's moments into Muon (or silently drop them)."""
    import torch.nn.functional as F
    from nanospec.model.checkpoint import gpt_checkpoint
    from nanospec.training.trainer import train
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, n_future=0))
    x = torch.randint(0, 64, (2, 17))

    def loss_fn(m, step):
        return F.cross_entropy(m(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten()), {}
    path = str(tmp_path / "part.pt")
    args = (loss_fn, lambda m: {}, None, path, lambda: gpt_checkpoint(model, "tok"), "cpu", 32)
    losses = train("part", model, *args[:2], TrainConfig(max_iters=3, eval_interval=1, optimizer="muon"), *args[3:])
    assert losses == {}
    with pytest.raises(ValueError, match="trained with another optimizer than 'adamw'"):
        train("part", model, *args[:2], TrainConfig(max_iters=6, optimizer="adamw"), *args[3:])
