"""
The early-exit adapter: what makes the target's first E layers a useful draft of the whole target.

Exiting after block E means putting the hidden state there through the model's final norm and unembedding,
which were trained to read the LAST block's output, not block E's. A small adapter, trained afterwards on the
frozen target, bridges the two (Kangaroo, Liu et al. 2024, arXiv 2404.18911, trains one attention layer for
the same job; LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710, instead adds an early-exit loss to the
target's own training, which needs a retrain):

    h_E (block E's output)  -> adapter: h + W2 gelu(W1 norm(h))  -> ln_f -> lm_head  -> q_draft (exit E's law)

One adapter per exit layer E = 1..n_layer-1, each one residual MLP like an MTP head (nanospec/model.py's
MTPHead): it reads one position and keeps no cache, so drafting costs E layers + one MLP per guess. Its last
projection starts at zero, so an untrained adapter is the plain exit. Training distills each exit to the
target's next-token law, minimising KL(p_target || q_draft) (0 when the exit says what the target says):
acceptance is about agreeing with the target, not about predicting the data.
"""
import torch
import torch.nn as nn
from torch.nn import functional as F

from nanospec.checkpoint import load_module
from nanospec.model import GPTConfig, MTPHead


class ExitAdapter(nn.Module):
    def __init__(self, config):
        """config: the target's GPTConfig; one residual MLP for each exit layer 1..n_layer-1."""
        super().__init__()
        self.config = config
        self.exits = nn.ModuleList(MTPHead(config) for _ in range(config.n_layer - 1))

    def forward(self, hidden, exit_layer):
        """hidden (B, T, C), block exit_layer's output -> (B, T, C), what ln_f and lm_head should read."""
        return self.exits[exit_layer - 1](hidden)


def exit_logits(target, adapter, exit_layer, hidden):
    """The early-exit draft's logits (B, T, V) from block exit_layer's output (B, T, C): the target's final norm
    and unembedding, through the adapter when there is one (None: the plain exit)."""
    if adapter is not None:
        hidden = adapter(hidden, exit_layer)
    return target.lm_head(target.ln_f(hidden))


def exit_hidden_states(target, w):
    """w (B, T) -> [block 1's output, ..., block L's output], each (B, T, C), and the target's logits (B, T, V)."""
    L = target.config.n_layer
    hidden = [target(w, layers=(0, 1)).hidden]
    for i in range(1, L - 1):
        hidden.append(target(None, layers=(i, i + 1), hidden_in=hidden[-1]).hidden)
    out = target(None, layers=(L - 1, L), hidden_in=hidden[-1])
    return hidden + [out.hidden], out.logits


def distill_losses(adapter, target, w, positions=None):
    """w (B, T) windows -> {exit E: KL(p_target || q_draft of exit E), agree E: how often exit E's argmax
    equals the target's}. The loss to minimise is the sum over exits. positions (S,): use only these."""
    with torch.no_grad():
        hidden, logits = exit_hidden_states(target, w)
    if positions is not None:
        hidden, logits = [h[:, positions] for h in hidden], logits[:, positions]
    V = logits.size(-1)
    log_p_target = torch.log_softmax(logits.float(), dim=-1).reshape(-1, V)  # (B*S, V)
    losses = {}
    for E in range(1, target.config.n_layer):
        q_logits = exit_logits(target, adapter, E, hidden[E - 1]).float()  # (B, S, V)
        log_q_draft = torch.log_softmax(q_logits.reshape(-1, V), dim=-1)  # (B*S, V)
        losses[f"exit{E}"] = F.kl_div(log_q_draft, log_p_target, log_target=True, reduction="batchmean")
        losses[f"agree{E}"] = (q_logits.argmax(-1) == logits.argmax(-1)).float().mean()
    return losses


def load_early_exit(path, tokenizer_identity=None, device="cpu", target_id=None):
    """The adapters from early_exit.pt; `exit_logits` applies them on the target they were trained on (target_id:
    that target's fingerprint, checked when given)."""
    return load_module(path, tokenizer_identity, device, lambda cfg: ExitAdapter(GPTConfig(**cfg)), "early_exit",
                       target_id)
