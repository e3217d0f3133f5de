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
from torch.nn import functional as F

from nanospec.checkpoint import load_module
from nanospec.graphs import Graphs
from nanospec.model import Block, KVCache
from nanospec.static import kept, padded_mask


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

    def inputs(self, target, tokens, anchors, k, n_cached=0):
        """The embedded input and the attention mask of one forward: tokens (B, T) real tokens at positions
        n_cached.., then a group of k masks after each anchor (absolute positions of tokens among the T).
        Returns x (B, T + G*k, C) and mask (T + G*k, n_cached + T + G*k)."""
        B, T = tokens.shape
        mask, pos = group_layout(n_cached, T, anchors, k, tokens.device)
        real = target.wte(tokens)  # (B, T, C)
        anchor = real[:, torch.as_tensor(anchors, device=tokens.device) - n_cached]  # (B, G, C)
        masks = self.mask_emb[:k] + anchor[:, :, None]  # (B, G, k, C): mask j of a group, plus its anchor
        x = torch.cat([real, masks.flatten(1, 2)], dim=1) + target.wpe(pos)  # (B, T + G*k, C)
        return x, mask

    def trunk(self, target, x, mask, n_real, cache=None):
        """Run the block(s); return the mask tokens' logits (B, G*k, V). With a cache, only the n_real real
        tokens stay in it: the masks' keys are written after them and forgotten (no later token sees them)."""
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache, i)
        if cache is not None:
            cache.advance(n_real)
        return target.lm_head(target.ln_f(x[:, n_real:]))  # (B, G*k, V)

    def forward(self, target, tokens, anchors, k=None, cache=None):
        """Logits (B, G, k, V): guess j (0-based) of the group after anchor a is for token a+1+j."""
        k = k or self.config.n_masks
        n_cached = cache.length if cache is not None else 0
        x, mask = self.inputs(target, tokens, anchors, k, n_cached)
        logits = self.trunk(target, x, mask, tokens.size(1), cache)  # (B, G*k, V)
        return logits.view(tokens.size(0), -1, k, logits.size(-1))

    def draft(self, target, cache, tokens, k):
        """Inference: append the new real tokens (a list; the last one is the root) to the cache and guess the
        k tokens after the root in the same pass. Returns logits (k, V)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=cache.device)  # (1, T)
        root = cache.length + len(tokens) - 1
        return self(target, ids, [root], k, cache)[0, 0]  # (k, V)

    def new_cache(self):
        w = self.mask_emb
        return KVCache(self.config, 1, w.device, w.dtype, max_len=self.config.block_size + self.config.n_masks)


class StaticParallelSpec:
    """The drafter's inference pass (`ParallelSpec.draft`) shape-static and, on CUDA, replayed from graphs
    (nanospec/static.py's recipe): the real tokens' and the masks' keys are written at slot tensors, attention runs
    over every slot under group_layout's mask padded to all of them, so a pass's shapes depend only on its number
    of new tokens and k. Its logits are rewritten by the next pass of the same shape (clone what must outlive it)."""

    def __init__(self, drafter, cache, capture=False):
        self.drafter, self.cache = drafter, cache
        self.graphs = Graphs(capture, protect=(cache.k, cache.v))

    def draft(self, target, cache, tokens, k):
        """What ParallelSpec.draft returns, logits (k, V), and the same cache afterwards."""
        if cache is not self.cache:
            raise ValueError("a StaticParallelSpec runs on the cache it was made with")
        ids = torch.tensor([tokens], dtype=torch.long, device=cache.device)  # (1, T)
        T, n = ids.size(1), cache.length
        if n + T + k > cache.max_len:
            raise ValueError(f"the parallelspec drafter's cache is full: {n + T + k} tokens > {cache.max_len}")
        mask, pos = group_layout(n, T, [n + T - 1], k, cache.device)  # (T+k, n+T+k), (T+k,): one group, at the root
        full = padded_mask(mask, cache.max_len)  # (T+k, max_len)
        slots = torch.arange(n, n + T + k, device=cache.device)  # (T+k,) the masks' slots are reused next pass

        def fn(ids, pos, slots, full):  # ParallelSpec.inputs + trunk with the anchor = the last real token
            real = target.wte(ids)  # (1, T, C)
            x = torch.cat([real, self.drafter.mask_emb[:k][None] + real[:, -1:]], dim=1) + target.wpe(pos)
            for i, block in enumerate(self.drafter.blocks):
                x = block(x, full, cache, i, slots)  # (1, T+k, C)
            return (target.lm_head(target.ln_f(x[:, T:]))[0],)  # (k, V)

        logits, = self.graphs(fn, ids, pos, slots, full, key=(k,))
        cache.advance(T)  # only the real tokens stay
        return logits


def drafter_runtime(drafter, target, path):
    """What runs the drafter's passes and its cache, for the target's runtime path (static.py's runtime_model):
    (the drafter, a new cache) on "eager", else a StaticParallelSpec (graphs on "graph") on its emptied cache,
    kept per drafter and target so that each shape is captured once per process, not per generation."""
    if path == "eager":
        return drafter, drafter.new_cache()
    key = (target.wte.weight.data_ptr(), drafter.mask_emb.data_ptr(), drafter.mask_emb.dtype)
    static = kept(drafter, key, lambda proxy: StaticParallelSpec(proxy, drafter.new_cache(), capture=path == "graph"))
    return static, static.cache


def load_parallelspec(path, tokenizer_identity=None, device="cpu", target_id=None):
    """The drafter from parallelspec.pt (target_id: the fingerprint of the target it must have learnt from)."""
    return load_module(path, tokenizer_identity, device, lambda cfg: ParallelSpec(ParallelSpecConfig(**cfg)),
                       "parallelspec", target_id)


# ---------------------------------------------------------------------------------------------------------
# What training minimises: the frozen target distilled into the drafter, many groups per sequence (the stage
# itself: nanospec/drafters/training.py; the design choices behind it: docs/training-notes.md).


def distill_losses(drafter, target, w, anchors):
    """w (B, T+k) windows of text; the drafter reads the first T tokens with a group after each anchor (G,).
    Mask j (0-based) of the group at anchor a learns the target's argmax after x_0..x_{a+j} along the text.
    Returns {loss: cross-entropy, agree1..k: how often the drafter's top-1 is the target's, per mask}."""
    k = drafter.config.n_masks
    T = w.size(1) - k
    with torch.no_grad():  # the target is frozen: its choices are the data
        greedy = target(w[:, :T + k - 1]).logits.argmax(-1)  # (B, T+k-1) the target's token after each prefix
    logits = drafter(target, w[:, :T], anchors)  # (B, G, k, V)
    label_pos = torch.as_tensor(anchors, device=w.device)[:, None] + torch.arange(k, device=w.device)  # (G, k)
    labels = greedy[:, label_pos]  # (B, G, k)
    loss = F.cross_entropy(logits.flatten(0, 2), labels.flatten())
    agree = (logits.argmax(-1) == labels).float().mean((0, 1))  # (k,)
    return {"loss": loss, **{f"agree{j + 1}": agree[j] for j in range(k)}}
