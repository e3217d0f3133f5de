"""
The ParallelSpec drafter: k future tokens in ONE forward pass, by appending k learned mask tokens.

An autoregressive drafter needs k passes for k guesses, each waiting for the last. This one reads the context
followed by k mask tokens [M1 .. Mk] and predicts token t+j from mask Mj, all at once:

    context "for i in" (root " in" at position 5), masks at positions 6, 7, 8
    -> M1 " range", M2 "(", M3 "len"          one pass, three guesses for the target to verify

The drafter is small: the mask embeddings and one transformer block. It reads tokens through the target's
frozen embeddings (wte, wpe) and unembeds through the target's frozen final norm and lm_head, so it speaks the
target's vocabulary from the first step. Each mask token starts as its own learned embedding plus the
embedding of its anchor (the root): one block with absolute positions learns only slowly to find "the token
just before me" by attention, and that token matters most. (Reading the target's trunk features as well, as
EAGLE does, made the drafter worse within the training budget: see docs/training-notes.md.)

Training packs many prefixes into one sequence (group-wise parallel training). The real text comes first,
then one group of k masks per anchor position a; `group_layout` builds the mask and the position ids:

    real x0 x1 x2 x3, anchors [1, 3], k = 2       rows see (1 = attend):
                 x0 x1 x2 x3 | A1 A2 | B1 B2        pos
        x2       1  1  1  .  |  .  . |  .  .         2     real tokens: causal, never a mask
        A1       1  1  .  .  |  1  . |  .  .         2     group A (anchor 1): x0..x1, its own earlier masks,
        A2       1  1  .  .  |  1  1 |  .  .         3       positions continue from the anchor: 2, 3
        B2       1  1  1  1  |  .  . |  1  1         5     group B (anchor 3): x0..x3, B1, B2

Each group then computes exactly what inference computes for that prefix: at inference the cached context
plus k masks is the same layout with one group, anchored at the root (tests/test_parallelspec.py checks both
the isolation of groups and this equality). Labels: mask Mj of the group at anchor a learns the target's own
greedy choice after x_0..x_{a+j-1} along the real text (distillation): what verification compares against when
the earlier guesses were right.

Paper: Xiao et al. 2024, ParallelSpec: Parallel Drafter for Efficient Speculative Decoding, arXiv 2410.05589.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanospec.model.cache import KVCache, place
from nanospec.model.gpt import Block


@dataclass
class ParallelSpecConfig:
    vocab_size: int = 2048  # the target's: the drafter unembeds with the target's lm_head
    block_size: int = 256  # the target's context: mask positions index the target's position table
    n_embd: int = 192  # the target's width: the drafter reads the target's embeddings
    n_head: int = 4  # attention heads in the drafter's block(s)
    n_layer: int = 1  # drafter blocks: a second one did not pay for its cost in the 4x192 tiny preset
    n_masks: int = 4  # k: mask tokens, i.e. the most tokens one pass can guess
    dropout: float = 0.0  # (Block reads these two)
    bias: bool = False


def group_layout(n_cached, n_real, anchors, k, device="cpu"):
    """The attention mask and position ids of one drafter forward: real tokens, then one group of k masks
    per anchor. n_cached tokens are already in the drafter's cache (positions 0..n_cached-1), n_real new real
    tokens follow; anchors (G,) are absolute positions of real tokens. Rows = the n_real + G*k new tokens,
    columns = the n_cached + n_real + G*k tokens they may see.

    Returns mask (n_real + G*k, n_cached + n_real + G*k) bool, True = may attend, and pos (n_real + G*k,).
    Example (no cache, 4 real tokens, anchors [1, 3], k 2): pos = [0, 1, 2, 3, 2, 3, 4, 5]; see the module doc.
    """
    # BEGIN SOLUTION ex11
    anchors = torch.as_tensor(anchors, dtype=torch.long, device=device)  # (G,)
    G, n_seen = len(anchors), n_cached + n_real
    real_pos = torch.arange(n_cached, n_seen, device=device)  # (n_real,)
    group = torch.arange(G, device=device).repeat_interleave(k)  # (G*k,) which group each mask is in
    slot = torch.arange(k, device=device).repeat(G)  # (G*k,) its index j within the group
    # every row sees the real tokens up to a limit: itself for a real token, the anchor for a mask
    limit = torch.cat([real_pos, anchors[group]])  # (R,)
    sees_real = torch.arange(n_seen, device=device)[None, :] <= limit[:, None]  # (R, n_seen)
    # masks see their own group's masks up to themselves; real rows (group -1) see no mask
    row_group = torch.cat([torch.full((n_real,), -1, device=device), group])  # (R,)
    row_slot = torch.cat([torch.full((n_real,), -1, device=device), slot])  # (R,)
    sees_mask = (row_group[:, None] == group[None, :]) & (slot[None, :] <= row_slot[:, None])  # (R, G*k)
    pos = torch.cat([real_pos, anchors[group] + 1 + slot])  # masks continue the anchor's positions
    return torch.cat([sees_real, sees_mask], dim=1), pos
    # END SOLUTION ex11


class ParallelSpec(nn.Module):
    """The drafter's own weights: the mask embeddings and its block(s). The target (its frozen embeddings,
    final norm and unembedding) is passed to every call and never stored, so checkpoints hold only these."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.mask_emb = nn.Parameter(0.02 * torch.randn(config.n_masks, config.n_embd))  # (k, C) [M1 .. Mk]
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))

    def forward(self, target, tokens, anchors, k=None, cache=None, pos=None, mask=None):
        """tokens (B, T) real tokens after the cache's; anchors (G,): indices among them, a tensor on the tokens'
        device (a list would be a host tensor made inside the forward, which a CUDA graph cannot capture), each
        followed by a group of k masks (default n_masks). Returns logits (B, G, k, V): guess j (0-based) of
        the group after anchor a is for the token j+1 after it. With a cache, only the T real tokens stay in it:
        the masks' keys are written after them and forgotten (no later token sees them)."""
        B, T = tokens.shape
        if not torch.is_tensor(anchors):
            raise TypeError(f"anchors must be a (G,) tensor of indices, got {type(anchors).__name__}: "
                            "torch.tensor(anchors, device=tokens.device)")
        k = k or self.config.n_masks
        at = self.place(target, tokens, anchors, k, cache, pos, mask)  # T + G*k tokens
        real = target.wte(tokens)  # (B, T, C)
        masks = self.mask_emb[:k] + real[:, anchors, None]  # (B, G, k, C): mask j of a group, plus its anchor
        x = torch.cat([real, masks.flatten(1, 2)], dim=1) + target.wpe(at.pos)  # (B, T + G*k, C)
        for i, block in enumerate(self.blocks):
            x = block(x, at, i)
        if cache is not None:
            cache.advance(T)
        logits = target.unembed(x[:, T:])  # (B, G*k, V)
        return logits.view(B, -1, k, logits.size(-1))

    def place(self, target, tokens, anchors, k=None, cache=None, pos=None, mask=None):
        """The Placement `forward` gives its T + G*k tokens, from its own arguments (the fast layer's hook: the
        contract is nanospec/model/cache.py's): group_layout's positions and mask after the cache, unless given."""
        if pos is None or mask is None:
            n_cached = cache.length if cache is not None else 0
            anchors = anchors + n_cached  # (G,) absolute
            mask, pos = group_layout(n_cached, tokens.size(1), anchors, k or self.config.n_masks, tokens.device)
        return place(cache, pos.size(-1), pos, mask)

    def new_cache(self):
        w = self.mask_emb
        return KVCache(self.config, 1, w.device, w.dtype, max_len=self.config.block_size + self.config.n_masks)
