"""
The heads-only phase (Medusa-1, Cai et al. 2024, arXiv 2401.10774): retrain the MTP heads on the frozen
target, from text the target wrote itself.

Trained jointly with the trunk (the `target` stage of train_tiny.py), the heads learn to guess the CORPUS's token
t+1+i, as a side task weighted 0.3 x 0.8^(i-1). But verification accepts a guess only when it is what the
TARGET would emit, and a 3M-parameter model often emits something else than the corpus. So this phase:

  1. freezes the whole target (trunk, main head and the unembedding the heads share);
  2. lets the target continue random training windows greedily, in batches, with its KV cache (`rollouts`):
     self-distillation data, as in Medusa-2's recipe;
  3. trains head i at each position t to guess the rollout's token t+1+i, with weight 1 for every head (plain
     cross-entropy on the target's own text: sequence-level distillation, Kim and Rush 2016, arXiv 1606.07947).

    rollout  [prompt from the corpus] def f ( x ) : return x     (from "def" on: the target's own greedy text)
    at the position of "(": the main head said "x"; head 1 learns ")", head 2 ":", head 3 "return"

Only the heads change; out/heads.pt holds them and `load_models` (nanospec/model/load.py) puts them on the target in
place of the jointly trained ones (delete heads.pt to decode with those). The target's own output is untouched, so
every method stays exact with respect to target.pt. The figures (agreement before and after) are in docs/training.md.
"""
import torch
from torch.nn import functional as F


PROMPT_LEN = 32  # tokens of training text each rollout starts from; the target writes the rest of the window
POOL = 128  # rollouts generated at once: one batched generation, read by EPOCHS * POOL / batch_size steps
EPOCHS = 2  # each rollout is trained on twice: generating costs more than a training step (6k against 15k tok/s)


@torch.no_grad()
def rollouts(target, prompts, n_new):
    """prompts (B, P) -> (B, P + n_new): each row continued greedily by the target, all rows in one batch.
    The same tokens as `ar` on each row alone (tests/test_heads.py checks it)."""
    cache = target.new_cache(batch_size=prompts.size(0), max_len=prompts.size(1) + n_new)
    with torch.autocast(prompts.device.type, enabled=False):  # one token per row: bf16 only slows it down
        logits = target(prompts, cache=cache).logits[:, -1]  # (B, V)
        seq = [prompts]
        for i in range(n_new):
            seq.append(logits.argmax(-1, keepdim=True))  # (B, 1)
            if i + 1 < n_new:
                logits = target(seq[-1], cache=cache).logits[:, -1]
    return torch.cat(seq, 1)


def head_losses(heads, target, seq):
    """seq (B, T) rollouts -> {head i: cross-entropy of head i at t to token t+1+i, agree i: how often head i's
    top-1 is that token}. On the generated part of a rollout, token t+1+i IS the target's greedy choice at t+i,
    so agree i is how often a greedy tree step would accept head i's top-1 (given the guesses before it)."""
    with torch.no_grad():
        hidden = target(seq).hidden  # (B, T, C)
    losses = {}
    for i, head in enumerate(heads, 1):
        logits = target.unembed(head(hidden[:, :-1 - i]))  # (B, T-1-i, V): guesses of t+1+i
        truth = seq[:, 1 + i:]  # (B, T-1-i)
        losses[f"head{i}"] = F.cross_entropy(logits.reshape(-1, logits.size(-1)), truth.reshape(-1))
        losses[f"agree{i}"] = (logits.argmax(-1) == truth).float().mean()
    losses["total"] = sum(losses[f"head{i}"] for i in range(1, len(heads) + 1))
    return losses
