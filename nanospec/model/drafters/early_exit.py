"""
The early-exit adapter: what makes the target's first E layers a useful draft of the whole target.

Exiting after block E means putting the hidden state there through the model's final norm and unembedding,
which were trained to read the LAST block's output, not block E's. A small adapter, trained afterwards on the
frozen target, bridges the two (Kangaroo, Liu et al. 2024, arXiv 2404.18911, trains one attention layer for
the same job; LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710, instead adds an early-exit loss to the
target's own training, which needs a retrain):

    h_E (block E's output)  -> adapter: h + W2 gelu(W1 norm(h))  -> ln_f -> lm_head  -> q_draft (exit E's law)

One adapter per exit layer E = 1..n_layer-1, each one residual MLP like an MTP head (nanospec/model/gpt.py's
MTPHead): it reads one position and keeps no cache, so drafting costs E layers + one MLP per guess. Its last
projection starts at zero, so an untrained adapter is the plain exit. Training distills each exit to the
target's next-token law, minimising KL(p_target || q_draft) (0 when the exit says what the target says):
acceptance is about agreeing with the target, not about predicting the data (nanospec/training/drafter_losses.py).
"""
import torch.nn as nn

from nanospec.model.gpt import MTPHead


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
    return target.unembed(hidden)
