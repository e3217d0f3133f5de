"""
The GPT that every decoding method runs: a plain pre-norm transformer with multi-token-prediction (MTP)
heads, a forward pass that takes explicit position ids and an attention mask, and a KV cache that can
append, roll back and compact.

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

The fast layer's contract, the model's side (nanospec/fast/runtime.py wraps any model that keeps it: GPT, the EAGLE
head, the ParallelSpec drafter; tests/test_runtime.py holds each wrapped model to the plain one):
  - the forward takes `pos`, `cache` and `mask` keywords, writes keys and values only through `cache.update`
    and moves the cache only through `cache.advance`;
  - `layout(...)`, called with the forward's own arguments, returns what the forward will use: (pos (T,), the
    new tokens' positions; mask (T, cached + T), True where a new token sees a slot, or None for plain causal
    attention with nothing cached), the given pos and mask when there are. The fast layer pads that mask with
    False to the whole cache and writes the new keys at slots cached..cached + T - 1, so that a forward's shapes
    depend on T alone and it can be replayed. A cache whose rows are out of step (a batch) gives (pos (B, T),
    mask (B, 1, T, S)) over every slot already, and the new keys go at the rows' own slots (KVCache.row_slots);
  - everything that changes from one step to the next reaches the forward as a tensor: a Python value it
    reads is frozen into a replayed graph.
And the bench's side (nanospec/bench/timing.py times parts from outside, knowing none of their insides): a GPT names
the modules drafters call outside its forward (`borrowed_by_drafters`) and says which of its forwards draft
(`drafts`).
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


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


class KVCache:
    """Keys and values of every layer for the tokens seen so far, in preallocated tensors (L, B, nh, S, hs).

    Slots [0, length) hold real tokens. A forward writes its T new tokens at [length, length+T) in every
    layer, then `advance(T)` makes them part of the cache. Decoding methods then keep what was accepted:
    `rollback(n)` drops everything from slot n on (a chain), `compact(keep)` keeps the listed slots in order
    (a tree path). Nothing outside this class touches its tensors: attention writes through `update`, and
    everyone else reads the cache through `length`, `lengths`, `rows`, `max_len` and `device`.

    Each layer counts its own tokens (`lengths`). They are all equal, except while `early-exit` drafts: it
    runs only the lower layers over its guesses, so those layers run ahead of the upper ones until the
    verify forward catches up. `length` is layer 0's count, i.e. every layer's in a cache used the plain way.

    Each row of a batch (B prompts) may hold its own number of tokens: `rollback_rows` given different lengths
    puts the rows out of step, and from then on `rows` (B ints) counts each row's, row b's new tokens go at its
    own slots rows[b] .. rows[b] + T - 1 (`row_slots`), and each sees its own row's slots up to its own
    (`row_mask`). A slot past a row's count holds a rejected guess or padding, which no one sees before the
    row's next forward writes it again. A single prompt is the case B = 1, whose rows never fall out of step.
    Rows [3, 1], T = 2:  row 0 writes slots 3, 4 and sees 0..3, 0..4;  row 1 writes 1, 2 and sees 0..1, 0..2.
    """

    def __init__(self, config, batch_size=1, device="cpu", dtype=torch.float32, max_len=None):
        n_layer, H = config.n_layer, config.n_head
        self.max_len = max_len or config.block_size
        shape = (n_layer, batch_size, H, self.max_len, config.n_embd // H)  # (L, B, nh, S, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.forget()

    def forget(self):
        """Every slot free again (the tensors are kept: stale keys are never seen)."""
        self.lengths = [0] * self.k.size(0)  # tokens held by each layer (every row's, while rows are in step)
        self.counts = None  # tokens held by each row (B ints) once rows are out of step, else None
        self.row_lengths = None  # (B,) the same on the device, for `slots`

    @property
    def length(self):
        return self.lengths[0]

    @property
    def rows(self):
        """Tokens held by each row, B ints (in step: what every layer holds; early-exit's lower layers may be
        ahead of that while it drafts)."""
        return self.counts if self.ragged else [min(self.lengths)] * self.k.size(1)

    @property
    def ragged(self):
        """Are the rows out of step (each at its own length)?"""
        return self.counts is not None

    @property
    def device(self):
        """Where the cache (and the model that fills it) lives: make the forward's inputs there."""
        return self.k.device

    def update(self, layer, k_new, v_new):
        """Write the new tokens' keys/values (B, nh, T, hs) for one layer; return all of them so far: the first
        length + T slots (B, nh, length+T, hs), or, rows out of step, every slot (B, nh, S, hs)."""
        T, start = k_new.size(2), self.lengths[layer]
        end = start + T
        self.check_room(end)
        if self.ragged:
            return self.write_at(layer, self.row_slots(T), k_new, v_new)
        self.k[layer, :, :, start:end] = k_new
        self.v[layer, :, :, start:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nh, start+T, hs)

    def check_room(self, end):
        """A one-line ValueError unless `end` slots fit (the eager forward and the fast runtime both ask)."""
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > {self.max_len}; shorten the prompt or the generation")

    def write_at(self, layer, slots, k_new, v_new):
        """Write the new keys/values (B, nh, T, hs) at `slots` (B or 1, T), row b's at slots[b]; return every
        slot of the layer (B, nh, S, hs). The fast runtime writes this way too, at slots given as a tensor."""
        at = slots[:, None, :, None].expand_as(k_new)  # (B, nh, T, hs)
        self.k[layer].scatter_(2, at, k_new)
        self.v[layer].scatter_(2, at, v_new)
        return self.k[layer], self.v[layer]

    def row_slots(self, T):
        """Rows out of step: (B, T), where each row's T new tokens go, right after its own."""
        return self.row_lengths[:, None] + torch.arange(T, device=self.device)

    def row_mask(self, slots):
        """Rows out of step: (B, 1, T, S), True where row b's new token at slots[b, t] may look (its row's slots up
        to its own; the 1 broadcasts over the heads)."""
        return (torch.arange(self.max_len, device=self.device) <= slots[..., None])[:, None]

    def advance(self, T, layers=None):
        """Make the T tokens just written part of the cache, in `layers` (default: all of them)."""
        for i in range(len(self.lengths)) if layers is None else layers:
            self.lengths[i] += T
        if self.ragged:  # (early-exit, the one user of `layers`, decodes one prompt: rows in step)
            self.keep_counts([r + T for r in self.counts])

    def rollback_rows(self, lengths):
        """Row b keeps its first lengths[b] tokens (B ints): `rollback` while the rows stay in step (one prompt
        always does), else the rows go out of step, each at its own length."""
        if self.ragged or len(set(lengths)) > 1:
            return self.keep_counts(lengths)
        self.rollback(lengths[0])

    def rollback(self, length):
        """Forget every slot from `length` on, in every layer. Cheap: the slots are simply overwritten later."""
        # BEGIN SOLUTION ex5
        assert 0 <= length <= max(self.lengths), (length, self.lengths)
        self.lengths = [min(n, length) for n in self.lengths]
        # END SOLUTION ex5

    def keep_counts(self, rows):
        """Row b holds rows[b] tokens from now on: the rows are out of step (see the class docstring)."""
        assert len(rows) == self.k.size(1) and 0 <= min(rows) and max(rows) <= self.max_len, (rows, self.max_len)
        self.counts = [int(r) for r in rows]
        self.row_lengths = torch.tensor(self.counts, device=self.device)  # (B,)
        self.lengths = [max(self.counts)] * len(self.lengths)  # the widest row: how far any row has written

    def keep_rows(self, rows):
        """Only the rows `rows` (B' indices, increasing) go on, moved to rows 0..B'-1 of the same memory (a graph
        of the fast runtime keeps writing where it was captured); the others are dropped."""
        index = torch.tensor(rows, device=self.device)  # (B',)
        self.k[:, :len(rows)] = self.k[:, index]
        self.v[:, :len(rows)] = self.v[:, index]
        self.k = self.k[:, :len(rows)]  # (L, B', nh, S, hs): a view, the same memory
        self.v = self.v[:, :len(rows)]
        if self.ragged:
            self.keep_counts([self.counts[b] for b in rows])

    def compact(self, keep):
        """Keep only the slots listed in `keep` (increasing), moved to 0..len(keep)-1.
        Example: length 7, keep [0, 1, 2, 3, 5] (prefix 0..3, then tree node 5) -> slot 4 := slot 5, length 5."""
        # BEGIN SOLUTION ex5
        assert len(set(self.lengths)) == 1, f"compact needs every layer at the same length, got {self.lengths}"
        keep = [int(s) for s in keep]
        first = next((i for i, s in enumerate(keep) if s != i), len(keep))  # slots before it are in place
        if first < len(keep):
            src = torch.tensor(keep[first:], dtype=torch.long, device=self.device)
            self.k[:, :, :, first:len(keep)] = self.k[:, :, :, src]
            self.v[:, :, :, first:len(keep)] = self.v[:, :, :, src]
        self.lengths = [len(keep)] * len(self.lengths)
        # END SOLUTION ex5

    def clone(self):
        other = copy.copy(self)
        other.lengths = list(self.lengths)
        other.k, other.v = self.k.clone(), self.v.clone()
        return other


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x, mask, cache=None, layer=0):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs), S = the S keys the mask's columns name
        p = self.dropout if self.training else 0.0
        if mask is None:  # plain causal attention over T == S tokens (training, no cache)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:  # mask (T, S) bool, True = may attend
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, mask, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), mask, cache, layer)
        return x + self.mlp(self.ln_2(x))


class MTPHead(nn.Module):
    """x + W2 gelu(W1 norm(x)): one residual MLP block per head; W2 starts at zero so every head starts as a
    copy of the main head (the trunk already predicts t+1, a fair first guess for t+2)."""

    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        nn.init.zeros_(self.mlp.c_proj.weight)

    def forward(self, h):
        return h + self.mlp(self.ln(h))


@dataclass
class Output:
    logits: torch.Tensor  # (B, T, V) main head: token t+1
    hidden: torch.Tensor  # (B, T, C) trunk output before the final norm: the feature drafters read
    head_logits: torch.Tensor = None  # (B, n_future, T, V) MTP heads, when asked for


def causal_mask(n_cached, T, device):
    """(T, n_cached+T) bool: new token i sees every cached token and new tokens 0..i."""
    return torch.ones(T, n_cached + T, dtype=torch.bool, device=device).tril(diagonal=n_cached)


def layout(n_cached, T, pos=None, mask=None, device="cpu", first=0, table=None):
    """Where a forward's T new tokens go after the n_cached a cache holds: (pos (T,), mask (T, n_cached+T) or None).
    Given ones are kept; by default the positions follow the cache (starting at n_cached + first) and the mask is
    causal, None when nothing is cached (plain causal attention over the T tokens). Every cached model asks this
    of its arguments in its `layout` method, which the fast runtime (nanospec/fast/runtime.py) calls too.
    table: the rows of the position table. A default position past it is refused here, on the host: inside a
    kernel it is, on CUDA, a device-side assert that ends the process."""
    if pos is None and table is not None and n_cached + first + T > table:
        raise ValueError(f"position {n_cached + first + T - 1} is past the model's context of {table} tokens; "
                         "shorten the prompt or the generation")
    if pos is None:
        pos = torch.arange(n_cached + first, n_cached + first + T, device=device)  # (T,)
    if mask is None and n_cached > 0:  # (is_causal in attention only fits a square T == S mask)
        mask = causal_mask(n_cached, T, device)
    return pos, mask


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

    def forward(self, idx, pos=None, cache=None, mask=None, heads=False, layers=None, hidden_in=None):
        """idx (B, T) new tokens; pos (T,) or (B, T) position ids, default: right after the cache;
        cache: a KVCache the new keys/values are written to (then advanced by T);
        mask (T, cached+T) bool, True = may attend, default causal; heads: also run the MTP heads.

        layers (start, end): run only blocks start..end-1 (early exit). A range that starts above 0 reads
        hidden_in (B, T, C), the output of block start-1, in place of idx (pass idx=None); a range that
        stops below the last block returns only `hidden` (its output), no logits.
        """
        start, end = layers if layers is not None else (0, self.config.n_layer)
        x = hidden_in if start > 0 else idx  # (B, T) ids or (B, T, C) block start-1's output
        pos, mask = self.layout(idx, pos, cache, mask, layers=layers, hidden_in=hidden_in)  # (T,), (T, S)
        if start == 0:
            x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for i in range(start, end):
            x = self.blocks[i](x, mask, cache, i)
        if cache is not None:
            cache.advance(x.size(1), range(start, end))
        if end < self.config.n_layer:
            return Output(logits=None, hidden=x)
        out = Output(logits=self.lm_head(self.ln_f(x)), hidden=x)
        if heads:
            out.head_logits = self.head_logits(x)
        return out

    def layout(self, idx, pos=None, cache=None, mask=None, layers=None, hidden_in=None, **unplaced):
        """(pos (T,), mask (T, cached + T) or None): the positions and mask `forward` gives its new tokens
        (model.layout), from the same arguments; `unplaced`, the forward's others (heads), move no token.
        A cache whose rows are out of step gives (pos (B, T), mask (B, 1, T, S)) from each row's own slots."""
        start = layers[0] if layers is not None else 0
        x = hidden_in if start > 0 else idx  # (B, T) or (B, T, C)
        if cache is not None and cache.ragged and pos is None:  # rows out of step: each row after its own tokens
            slots = cache.row_slots(x.size(1))  # (B, T)
            return slots.clamp(max=self.config.block_size - 1), cache.row_mask(slots)  # (only padding is clamped)
        n_cached = cache.lengths[start] if cache is not None else 0
        return layout(n_cached, x.size(1), pos, mask, x.device, table=self.config.block_size)

    def head_logits(self, hidden, n=None):
        """hidden (B, T, C) trunk output -> (B, n, T, V): head i's logits for token t+1+i, for the first n heads
        (default all n_future): a drafter that guesses fewer tokens runs fewer heads."""
        if not len(self.heads):
            raise ValueError("this model has no MTP heads (n_future = 0)")
        return torch.stack([self.lm_head(self.ln_f(h(hidden))) for h in self.heads[:n]], dim=1)

    def new_cache(self, batch_size=1, max_len=None):
        """A fresh, empty KVCache for this model's layers, on its device and in its dtype."""
        w = self.wte.weight
        return KVCache(self.config, batch_size, w.device, w.dtype, max_len)

    # What the bench times as drafting (nanospec/bench/timing.py): the modules a drafter calls outside the forward
    # (the EAGLE head's unembedding, the early exit's head, the MTP heads), and a forward through the first blocks.
    borrowed_by_drafters = ("ln_f", "lm_head", "head_logits")

    def drafts(self, layers=None, **forward):
        """Does a forward with these keywords draft? One through blocks 0..E-1 only, E < n_layer, does (early-exit's
        draft: the target's own first layers); every other is a target forward."""
        return layers is not None and layers[0] == 0 and layers[1] < self.config.n_layer
