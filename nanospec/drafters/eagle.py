"""
The EAGLE draft head (Li et al. 2024, arXiv 2401.15077): a one-layer drafter that predicts the target's next
*feature* (its trunk output before the final norm, `Output.hidden`) instead of its next token.

Why features? The target's top hidden state already holds everything its head needs to pick a token, so the
next one is much easier to guess from it than from tokens alone: a single transformer layer on top of the
target's own features is enough. One draft step reads the token just chosen and the feature before it:

    [ wte(x_{t+1}) + wpe(t+1) ; f_t ]  (2C)  -fc->  (C)  -one Block->  f̂_{t+1}   (the guess of f_{t+1})
    ln_f + lm_head of the TARGET on f̂_{t+1}  ->  q_draft, the law of token x_{t+2}

The embedding (wte, wpe) and the unembedding (ln_f, lm_head) are the target's, frozen and not stored in
eagle.pt (which holds only fc and the block), so every call takes the target as its first argument.

Slot j of the head's own KV cache holds token x_{j+1} at position j+1, read together with the feature f_j:

    sequence  x0 x1 x2 x3, target features f0 f1 f2 f3     head slots  (x1, f0) (x2, f1) (x3, f2)
    -> predicted f̂1 f̂2 f̂3; the last one drafts x4. Drafting deeper feeds (x4 guess, f̂3), and so on.

While drafting, the head feeds on its own predicted features; after the target verified, the accepted tokens
are fed again with the target's TRUE features (`refresh` in nanospec/decoding/eagle.py), so errors never pile
up across steps. Training is teacher-forced on true features (the frozen target runs on each batch):

    loss = FEATURE_WEIGHT * SmoothL1(f̂_{t+1}, f_{t+1}) + DIST_WEIGHT * CE(p_target(. | x_<=t+1), q_draft)

the second term with the target's full distribution as a soft label (EAGLE used weights 1.0 and 0.1; what
other weights, input noise and a second unrolled step did: docs/training-notes.md).
"""
from dataclasses import replace

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanospec.checkpoint import load_module
from nanospec.graphs import Graphs
from nanospec.model import Block, GPTConfig, KVCache, Output, causal_mask
from nanospec.static import kept, padded_mask

FEATURE_WEIGHT = 1.0  # SmoothL1 on features: what keeps the head's own features usable for deeper drafts
DIST_WEIGHT = 0.3  # soft cross-entropy to the target's next-token law: what acceptance needs (0.1-1.0 all fine)


class Eagle(nn.Module):
    def __init__(self, config):
        """config: the target's GPTConfig with n_layer=1 (one Block; a KVCache of one layer), n_future=0."""
        super().__init__()
        self.config = config
        C = config.n_embd
        self.fc = nn.Linear(2 * C, C, bias=True)  # fuses [token embedding ; feature] back to the model width
        self.block = Block(config)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, target, tokens, features, pos=None, cache=None, mask=None, logits=True, slots=None):
        """tokens (B, T): x_{t+1}; features (B, T, C): f_t (true or predicted); pos (T,): the positions of the
        tokens, default right after the cache (slot j holds position j+1); cache: this head's KVCache;
        mask (T, cached+T) bool, default causal. Returns Output(logits (B, T, V) for x_{t+2}, or None when not
        asked for; hidden (B, T, C) = f̂_{t+1}). slots (T,): the shape-static form (`StaticEagle`): keys written
        there, mask (T, max_len) over every slot, the cache's length left to the caller."""
        B, T = tokens.shape
        n_cached = cache.length if cache is not None else 0
        if pos is None:
            pos = torch.arange(n_cached + 1, n_cached + 1 + T, device=tokens.device)  # (T,)
        if mask is None and n_cached > 0:
            mask = causal_mask(n_cached, T, tokens.device)
        emb = target.wte(tokens) + target.wpe(pos)  # (B, T, C) the target's own input embedding
        # the features at unit RMS: a target trained with Muon carries features of RMS ~8 beside embeddings of ~0.1
        features = F.rms_norm(features, (features.size(-1),))  # (B, T, C)
        x = self.fc(torch.cat([emb, features], dim=-1))  # (B, T, 2C) -> (B, T, C)
        x = self.block(x, mask, cache, 0, slots)  # (B, T, C) the predicted next feature
        if cache is not None and slots is None:
            cache.advance(T)
        return Output(logits=self.unembed(target, x) if logits else None, hidden=x)

    def unembed(self, target, hidden):
        """(B, T, C) predicted features -> (B, T, V) logits, through the target's own final norm and head."""
        return target.lm_head(target.ln_f(hidden))

    def new_cache(self, max_len=None):
        w = self.fc.weight
        return KVCache(self.config, 1, w.device, w.dtype, max_len)


class StaticEagle:
    """The head's forwards on one cache, shape-static and, on CUDA, replayed from graphs (nanospec/static.py's
    recipe: keys written at slot tensors, attention over every slot under a mask built on the device), so a
    forward's shapes depend on T alone (the mask is padded to every slot on the way in). Called like the head;
    its Output is rewritten by the next call of the same shape (clone what must outlive it)."""

    def __init__(self, eagle, cache, capture=False):
        self.eagle, self.cache = eagle, cache
        self.graphs = Graphs(capture, protect=(cache.k, cache.v))

    def unembed(self, target, hidden):
        return self.eagle.unembed(target, hidden)

    def __call__(self, target, tokens, features, pos=None, cache=None, mask=None, logits=True):
        if cache is not self.cache:
            raise ValueError("a StaticEagle runs on the cache it was made with")
        T, n = tokens.size(1), cache.length
        if n + T > cache.max_len:
            raise ValueError(f"the eagle head's cache is full: {n + T} tokens > {cache.max_len}")
        slots = torch.arange(n, n + T, device=cache.device)  # (T,)
        pos = slots + 1 if pos is None else pos.reshape(T)  # (T,) slot j holds position j+1
        # (T, max_len) over every slot: unlike a target's tree, a tree grown pass by pass hides earlier passes'
        # nodes that are not a node's ancestors, so the whole given mask is kept, not only its new columns
        full = padded_mask(causal_mask(n, T, cache.device) if mask is None else mask, cache.max_len)

        def fn(tokens, features, pos, slots, full):  # tensors in, tensors out: what a graph records
            out = self.eagle(target, tokens, features, pos, cache, full, logits, slots)
            return out.logits, out.hidden

        logits, hidden = self.graphs(fn, tokens, features, pos, slots, full, key=(logits,))
        cache.advance(T)
        return Output(logits=logits, hidden=hidden)


def head_runtime(eagle, target, path, max_len):
    """What runs the head's forwards and its cache of max_len slots, for the target's runtime path (static.py's
    runtime_model): (the head, a new cache) on "eager", else a StaticEagle (graphs on "graph") on its emptied
    cache, kept per head, target and size so that each shape is captured once per process, not per generation."""
    if path == "eager":
        return eagle, eagle.new_cache(max_len=max_len)
    key = (target.wte.weight.data_ptr(), eagle.fc.weight.data_ptr(), eagle.fc.weight.dtype, max_len)
    static = kept(eagle, key, lambda proxy: StaticEagle(proxy, eagle.new_cache(max_len=max_len),
                                                        capture=path == "graph"))
    return static, static.cache


def grow_tree_on_device(eagle, target, dcache, root, draft, depth, width, total_tokens):
    """eagle.grow_tree's tree (exercise 9: EAGLE-2's confidence expansion, then the rerank) with every candidate
    kept on the device, for the static runtime: the same head passes, topk calls and tie-breaks, and no host
    read: the tree's tokens and parents stay there (tree_step builds its mask there: tree.tree_layout_on_device).
    Frontier node i of pass d is fed at slot L + (d-1)*width + i, so a node's mask is the prefix and one slot per
    pass, its ancestors' (`at`). Returns (tokens, parents), two (N,) LongTensors."""
    if depth < 1 or total_tokens < 2:
        return [root], [-1]
    device, L, K = dcache.device, dcache.length, width
    score, tok = torch.log_softmax(draft.logits[0, -1], -1).topk(K)  # (K,) depth 1: scores and tokens
    toks, pars, scores = [tok], [torch.full((K,), -1, device=device)], [score]  # every candidate, level by level
    frontier, front_tok, front_score = torch.arange(K, device=device), tok, score  # (K,) candidate indices, ...
    at = torch.zeros(K, 0, dtype=torch.long, device=device)  # (K, d-1) each frontier node's ancestors' slots
    feats = draft.hidden[:, -1:].expand(1, K, -1)  # (1, K, C) each frontier node reads its parent's f̂
    for d in range(1, depth):
        at = torch.cat([at, L + (d - 1) * K + torch.arange(K, device=device)[:, None]], 1)  # (K, d) + itself
        mask = torch.zeros(K, L + d * K, dtype=torch.bool, device=device)
        mask[:, :L] = True
        mask.scatter_(1, at, True)  # (K, L + d*K) the prefix, the node's ancestors and itself
        out = eagle(target, front_tok[None], feats, torch.full((K,), L + d, device=device), dcache, mask)
        s, t = torch.log_softmax(out.logits[0], -1).topk(K, dim=-1)  # (K, K) each frontier node's best children
        s = (s + front_score[:, None]).flatten()  # (K*K,)
        best = s.topk(K).indices  # (K,) the best width of the width^2 children
        base = sum(x.numel() for x in toks)
        toks.append(t.flatten()), pars.append(frontier.repeat_interleave(K)), scores.append(s)
        frontier, front_tok, front_score = base + best, t.flatten()[best], s[best]
        at, feats = at[best // K], out.hidden[:, best // K]  # (K, d), (1, K, C): from each one's parent
    dcache.rollback(L)
    tok, par, score = torch.cat(toks), torch.cat(pars), torch.cat(scores)  # (M,) every candidate
    keep = torch.sort(-score, stable=True).indices[:total_tokens - 1].sort().values  # best first, ties: older
    node = torch.zeros_like(par)  # candidate -> its node in the tree, 0 (the root) if not kept
    node[keep] = torch.arange(1, keep.numel() + 1, device=device)
    parents = torch.where(par[keep] >= 0, node[par[keep].clamp(min=0)], 0)  # (N-1,)
    root = torch.tensor([int(root)], dtype=torch.long, device=device)
    return torch.cat([root, tok[keep]]), torch.cat([parents.new_full((1,), -1), parents])  # (N,), (N,)


def eagle_config(target_config):
    return replace(target_config, n_layer=1, n_future=0, dropout=0.0)


# ---------------------------------------------------------------------------------------------------------
# What training minimises, on the frozen target's features (the stage itself: nanospec/drafters/training.py).


def eagle_losses(eagle, target, w):
    """w (B, T+1) token windows -> {feature, dist, total, acc}: the two losses, their weighted sum, and how often
    the head's top-1 guess for x_{t+2} equals the target's (teacher-forced acceptance of a one-token draft)."""
    with torch.no_grad():
        out = target(w)  # hidden (B, T+1, C) = f_0..f_T, logits (B, T+1, V)
    f = out.hidden
    pred = eagle(target, w[:, 1:], f[:, :-1])  # reads f_0..f_{T-1}: predicts f_1..f_T, drafts x_2..x_{T+1}
    V = pred.logits.size(-1)
    p_target = torch.softmax(out.logits[:, 1:], dim=-1)  # (B, T, V) the target's law of x_{t+2}
    scale = f[:, 1:].pow(2).mean().sqrt()  # the features' RMS: the loss judges the error relative to it
    losses = {"feature": F.smooth_l1_loss(pred.hidden / scale, f[:, 1:] / scale),
              "dist": F.cross_entropy(pred.logits.reshape(-1, V), p_target.reshape(-1, V))}
    losses["total"] = FEATURE_WEIGHT * losses["feature"] + DIST_WEIGHT * losses["dist"]
    losses["acc"] = (pred.logits.argmax(-1) == out.logits[:, 1:].argmax(-1)).float().mean()
    return losses


def load_eagle(path, tokenizer_identity=None, device="cpu", target_id=None):
    """The bare head from eagle.pt; every call then takes the target it was trained on (target_id: that
    target's fingerprint, checked when given)."""
    return load_module(path, tokenizer_identity, device, lambda cfg: Eagle(GPTConfig(**cfg)), "eagle", target_id)
