"""
The EAGLE draft head (Li et al. 2024, arXiv 2401.15077): a one-layer drafter that predicts the target's next
*feature* (its trunk output before the final norm, `Output.hidden`) instead of its next token.

Why features? The target's top hidden state already holds everything its head needs to pick a token, so the
next one is much easier to guess from it than from tokens alone: a single layer on top of the
target's own features is enough. One draft step reads the token just chosen and the feature before it:

    [ wte(x_{t+1}) ; norm(f_t) ]  (2C)  -fc->  (C)  -one layer->  f̂_{t+1}   (the guess of f_{t+1})
    ln_f + lm_head of the TARGET on f̂_{t+1}  ->  q_draft, the law of token x_{t+2}

The layer: EAGLE-1's is a transformer block (attention over the head's own cache, then an MLP); nanospec's head,
by default, is the block WITHOUT its attention, x + MLP(norm(x)) (config.attention = False). f_t already carries
the context, so attention adds little: sum(min(p, q)) at t=1, teacher-forced on validation, 0.736 with it and
0.717 without; but on a CPU it was most of a draft pass (0.48 of a target forward with it, 0.23 without), and
without it `eagle` went from 1.13x to 1.18x `ar` at t=1, 1.24x to 1.30x greedy (docs/training-notes.md, "The
head's attention"; docs/benchmark.md). A head trained with attention (config.attention = True, every eagle.pt
from before the option) still loads and runs the same code: the cache's lengths are kept either way (they number
the positions of a head that reads them), and a head without attention writes no keys. To train EAGLE-1's layer,
give eagle_config attention=True in eagle_recipe (nanospec/training/drafters.py).

Three more defaults make a pass cheaper on a CPU for no acceptance (sum(min(p, q)) at t=1 on validation 0.717
before them, 0.716 after, 0.668 against 0.663 a step deeper): the MLP's GELU is the tanh approximation (torch's exact
GELU computes erf element by element on a CPU), the features are normed by F.layer_norm rather than F.rms_norm (the
same job in a third of the time), and no position embedding is added to the token's (f_t already carries where the
token stands). Heads saved before these fields load with what they were trained with (load.load_eagle).

The embedding (wte; wpe for a head with positions) and the unembedding (ln_f, lm_head) are the target's, frozen
and not stored in eagle.pt (which holds only fc and the block), so every call takes the target as its first
argument.

Slot j of the head's own KV cache holds token x_{j+1} at position j+1, read together with the feature f_j:

    sequence  x0 x1 x2 x3, target features f0 f1 f2 f3     head slots  (x1, f0) (x2, f1) (x3, f2)
    -> predicted f̂1 f̂2 f̂3; the last one drafts x4. Drafting deeper feeds (x4 guess, f̂3), and so on.

While drafting, the head feeds on its own predicted features; after the target verified, the accepted tokens
are fed again with the target's TRUE features (`refresh` in nanospec/decoding/eagle.py), so errors never pile
up across steps. Training is teacher-forced on true features (the frozen target runs on each batch):

    loss = FEATURE_WEIGHT * SmoothL1(f̂_{t+1}, f_{t+1}) + DIST_WEIGHT * CE(p_target(. | x_<=t+1), q_draft)

the second term with the target's full distribution as a soft label (EAGLE used weights 1.0 and 0.1; what
other weights, input noise and a second unrolled step did: docs/training-notes.md). The losses are in
nanospec/training/drafter_losses.py, the loader in nanospec/model/load.py; the chain the head drafts in
nanospec/decoding/eagle.py, the tree it grows in nanospec/steps/eagle_tree.py.
"""
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanospec.model.cache import KVCache, Placement, place
from nanospec.model.gpt import Block, GPTConfig, MTPHead, Output


FEATURE_NORMS = {"layer": F.layer_norm, "rms": F.rms_norm}  # EagleConfig.feature_norm


@dataclass
class EagleConfig(GPTConfig):
    """The target's GPTConfig (n_layer=1: one layer, a KVCache of one layer; n_future=0), and the head's own fields.
    A head saved before a field existed loads with the value it was trained with (load.load_eagle)."""
    attention: bool = False  # the layer attends over the head's cache (EAGLE-1's block) or not (its MLP alone): on a
    # CPU the attention cost most of a draft pass for 0.019 of acceptance (module docstring)
    gelu: str = "tanh"  # the layer's GELU, F.gelu's `approximate`: "tanh" or "none" (exact, as the target's); on
    # the 2-core Xeon one token's 256 values took 7.2 us exact (erf element by element), 1.3 us with tanh
    positions: bool = False  # add the target's position embedding to the token's (f_t already carries where it is)
    feature_norm: str = "layer"  # how f_t is brought to unit scale before fc: "layer" (F.layer_norm, no weights) or
    # "rms" (F.rms_norm): the same job; over 64 values 2.3 us against 7.6 us there (docs/training-notes.md)


class Eagle(nn.Module):
    def __init__(self, config):
        """config: an EagleConfig (eagle_config)."""
        super().__init__()
        self.config = config
        C = config.n_embd
        self.fc = nn.Linear(2 * C, C, bias=True)  # fuses [token embedding ; feature] back to the model width
        # the layer: a Block (ln, attention, ln, MLP), or x + MLP(norm(x)) (an MTPHead's shape, trained here)
        self.block = Block(config, config.gelu) if config.attention else MTPHead(config, config.gelu)
        if config.feature_norm not in FEATURE_NORMS:
            raise ValueError(f"feature_norm must be one of {', '.join(FEATURE_NORMS)}, got {config.feature_norm!r}")
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, target, tokens, features, pos=None, cache=None, mask=None, logits=True):
        """tokens (B, T): x_{t+1}; features (B, T, C): f_t (true or predicted); pos (T,): the positions of the
        tokens, default right after the cache (slot j holds position j+1); cache: this head's KVCache;
        mask (T, cached+T) bool, default causal. Returns Output(logits (B, T, V) for x_{t+2}, or None when not
        asked for; hidden (B, T, C) = f̂_{t+1})."""
        at = self.place(target, tokens, features, pos, cache, mask)
        emb = target.wte(tokens)  # (B, T, C) the target's own token embedding
        if self.config.positions:
            emb = emb + target.wpe(at.pos)  # and its position embedding
        # the features at unit scale: a target trained with Muon carries features of RMS ~8 beside embeddings of ~0.1
        features = FEATURE_NORMS[self.config.feature_norm](features, (features.size(-1),))  # (B, T, C)
        x = self.fc(torch.cat([emb, features], dim=-1))  # (B, T, 2C) -> (B, T, C)
        x = self.block(x, at, 0) if self.config.attention else self.block(x)  # (B, T, C) the predicted next feature
        if cache is not None:
            cache.advance(tokens.size(1))
        return Output(logits=target.unembed(x) if logits else None, hidden=x)

    def place(self, target, tokens, features, pos=None, cache=None, mask=None, logits=True):
        """The Placement `forward` gives its tokens, from its own arguments (the fast layer's hook: the contract is
        nanospec/model/cache.py's): slot j holds position j+1. It takes every argument of `forward`, as the fast
        layer hands them on; `target`, `features` and `logits` place nothing. A layer without attention reads no
        slot and no mask: its Placement is the positions alone, right after the cache's tokens (the cache still
        counts them), which spared a few of a draft pass's ~20 tensor operations (on this CPU ~10% of a pass); a
        head without positions either places nothing."""
        T, table = tokens.size(1), self.config.block_size
        if self.config.attention:
            return place(cache, T, pos, mask, tokens.device, first=1, table=table)
        if not self.config.positions:  # it reads no position either: nothing to place
            return Placement(pos=None)
        first = 1 + (cache.length if cache is not None else 0)  # slot j holds position j+1
        return place(None, T, pos, None, tokens.device, first=first, table=table)

    def new_cache(self, max_len=None):
        w = self.fc.weight
        return KVCache(self.config, 1, w.device, w.dtype, max_len)


def eagle_config(target_config, attention=False):
    """The head's EagleConfig on `target_config` (a GPTConfig): its width, vocabulary and context, one layer."""
    return EagleConfig(**{**asdict(target_config), "n_layer": 1, "n_future": 0, "dropout": 0.0, "attention": attention})
