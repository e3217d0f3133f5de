"""
The GPT that every decoding method runs: a plain pre-norm transformer with multi-token-prediction (MTP)
heads, whose forward takes explicit position ids and an attention mask, and writes to a KV cache
(nanospec/model/cache.py: the cache, where a forward's tokens go, and the contract with the fast layer).

Why position ids and a mask? To verify several guesses in one pass. A chain of guesses is ordinary causal
attention. A *tree* of guesses needs each node to see only its ancestors, at the position it would have in
its own sequence (nanospec/rules/tree.py draws the worked example: its mask and position ids).

MTP heads (Gloeckle et al. 2024, arXiv 2404.19737; Stern et al. 2018, arXiv 1811.03115): head i (1-based)
predicts token t+1+i from the trunk's hidden state at t, sharing the final norm and unembedding with the main
head. nanospec's heads are residual MLP blocks (as in Medusa, arXiv 2401.10774), not transformer layers as in
Meta's design: an MLP head reads one position and keeps no cache, so drafting from the heads costs a few
matrix-vector products at the last accepted position and tree verification needs no per-head cache.
The heads are trained with the trunk, then retrained alone on the frozen target's own text
(nanospec/training/heads.py), which makes their guesses far more often right (figures in docs/training.md).
Every drafter that speaks the target's vocabulary (the MTP heads, EAGLE, the early exit, ParallelSpec) turns
hidden states into logits with the target's `unembed`.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanospec.model.cache import KVCache, place


@dataclass
class GPTConfig:
    vocab_size: int = 2048  # BPE tokens incl. end-of-text; small, since unembedding cost grows with it
    block_size: int = 256  # longest context in tokens; sets the learned position table and the cache size
    n_layer: int = 4  # transformer blocks in the trunk
    n_head: int = 4  # attention heads per block; n_embd must divide by it
    n_embd: int = 192  # width of the residual stream
    n_future: int = 3  # MTP heads: head i predicts token t+1+i, on top of the main head's t+1
    dropout: float = 0.0  # tiny models on a few MB rarely need it; kept for larger presets
    bias: bool = False  # biases in linears and norms: slightly faster and no worse without


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x, at, layer=0):
        """x (B, T, C); at: the Placement of the T tokens (nanospec/model/cache.py); layer: this block's index."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        k, v = at.update(layer, k, v)  # (B, nh, S', hs): the cache's slots (S' = seen, or S replayed), or T
        p = self.dropout if self.training else 0.0
        # at.attend (.., T, S') additive, or a given bool mask; None: plain causal attention over T == S' tokens
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=at.attend, dropout_p=p, is_causal=at.attend is None)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config, gelu="none"):
        """gelu: F.gelu's `approximate`, "none" (exact, with erf: every GPT here) or "tanh" (the approximation: the
        EAGLE head's default, several times cheaper on a CPU; nanospec/model/drafters/eagle.py)."""
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.gelu = gelu

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.gelu))


class Block(nn.Module):
    def __init__(self, config, gelu="none"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, gelu)

    def forward(self, x, at, layer=0):
        x = x + self.attn(self.ln_1(x), at, layer)
        return x + self.mlp(self.ln_2(x))


class MTPHead(nn.Module):
    """x + W2 gelu(W1 norm(x)): one residual MLP block per head; W2 starts at zero so every head starts as a
    copy of the main head (the trunk already predicts t+1, a fair first guess for t+2)."""

    def __init__(self, config, gelu="none"):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, gelu)
        nn.init.zeros_(self.mlp.c_proj.weight)

    def forward(self, h):
        return h + self.mlp(self.ln(h))


@dataclass
class Output:
    logits: torch.Tensor  # (B, T, V) main head: token t+1 (None from a forward that stops below the last block)
    hidden: torch.Tensor  # (B, T, C) trunk output before the final norm: the feature drafters read
    head_logits: torch.Tensor = None  # (B, n, T, V) MTP heads 1..n, from a forward asked for them (heads=n)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.heads = nn.ModuleList(MTPHead(config) for _ in range(config.n_future))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: saves vocab*n_embd parameters, trains no worse
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight") and not name.startswith("heads."):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def forward(self, idx, cache=None, pos=None, mask=None, layers=None, hidden_in=None, heads=0):
        """idx (B, T) new tokens; cache: a KVCache their keys and values are written to (then advanced by T);
        pos (T,) or (B, T) position ids, default right after the cache; mask (T, cached+T) bool, True = may attend,
        default causal (`place` turns these into the Placement the blocks read).

        layers (start, end): run only blocks start..end-1 (early exit). A range that starts above 0 reads
        hidden_in (B, T, C), the output of block start-1, in place of idx (pass idx=None); a range that
        stops below the last block returns only `hidden` (its output), no logits.

        heads: also run MTP heads 1..heads on every position, unembedded with the main head in one norm and one
        matmul (out.head_logits (B, heads, T, V)). `mtp` and `medusa` draw their next guesses from the heads at the
        last accepted position: run here, the heads need no call, norm and unembedding of their own (~2% of a
        drafting step on a CPU).
        """
        start, end = layers if layers is not None else (0, self.config.n_layer)
        at = self.place(idx, cache, pos, mask, layers, hidden_in)
        x = self.drop(self.wte(idx) + self.wpe(at.pos)) if start == 0 else hidden_in  # (B, T, C)
        for i in range(start, end):
            x = self.blocks[i](x, at, i)
        if cache is not None:
            cache.advance(x.size(1), range(start, end))
        if end < self.config.n_layer:
            return Output(logits=None, hidden=x)
        if not heads:
            return Output(logits=self.unembed(x), hidden=x)
        logits = self.head_logits(x, heads, main=True)  # (B, 1+heads, T, V)
        return Output(logits=logits[:, 0], hidden=x, head_logits=logits[:, 1:])

    def place(self, idx, cache=None, pos=None, mask=None, layers=None, hidden_in=None, heads=0):
        """The Placement `forward` gives its new tokens, from its own arguments (the fast layer calls it too: the
        contract is nanospec/model/cache.py's): after the tokens its first block holds."""
        start = layers[0] if layers is not None else 0
        x = hidden_in if start > 0 else idx  # (B, T) ids or (B, T, C) block start-1's output
        return place(cache, x.size(1), pos, mask, x.device, layer=start, table=self.config.block_size)

    def unembed(self, hidden):
        """(..., C) trunk output, or a drafter's guess of it -> (..., V) logits: the final norm, then the head."""
        return self.lm_head(self.ln_f(hidden))

    def head_logits(self, hidden, n=None, main=False):
        """hidden (B, T, C) trunk output -> (B, n, T, V): head i's logits for token t+1+i, for the first n heads
        (default all n_future): a drafter that guesses fewer tokens runs fewer heads. main: the main head's logits
        first, (B, 1+n, T, V) (forward's `heads`)."""
        if not len(self.heads):
            raise ValueError("this model has no MTP heads (n_future = 0)")
        states = ([hidden] if main else []) + [head(hidden) for head in list(self.heads)[:n]]
        return self.unembed(torch.stack(states, dim=1))  # (B, n, T, C) -> one final norm and unembedding for all

    def new_cache(self, batch_size=1, max_len=None):
        """A fresh, empty KVCache for this model's layers, on its device and in its dtype."""
        w = self.wte.weight
        return KVCache(self.config, batch_size, w.device, w.dtype, max_len)
