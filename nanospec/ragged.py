"""
A KV cache whose B rows hold different numbers of tokens, and the forward that fills it: what batched decoding
(nanospec/decoding/batched.py) runs its models on.

The cache is a plain KVCache's tensors (L, B, heads, S slots, head size) and a committed length per row. A forward
over T new tokens per row writes row b's keys at slots lengths[b] .. lengths[b] + T - 1 (`update`, a scatter), at
positions equal to those slots, and each new token attends to its own row's slots up to its own: a causal mask in
absolute positions, (B, T, S), built from the slots. Nothing beyond a row's committed length is ever seen before
it is written again, so rolling a row back is setting its length. Rows of lengths [3, 1], T = 2:

    row 0: slots 3, 4   mask rows  1 1 1 1 . .  /  1 1 1 1 1 .
    row 1: slots 1, 2   mask rows  1 1 . . . .  /  1 1 1 . . .
"""
import torch


class RaggedCache:
    """Keys and values of B rows holding different numbers of tokens: tensors (L, B, nh, S, hs) made by the model's
    own new_cache, and `lengths` (B,), each row's committed tokens. A forward writes through `update` at `slots`."""

    def __init__(self, model, batch_size, max_len):
        kv = model.new_cache(batch_size=batch_size, max_len=max_len)
        self.k, self.v, self.max_len = kv.k, kv.v, kv.max_len  # (L, B, nh, S, hs) each
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=kv.device)  # (B,)
        self.slots = None  # (B, T) where the forward running now writes, set by `forward`

    def update(self, layer, k_new, v_new):
        """Row b's T new keys/values (B, nh, T, hs) at its slots; returns every slot (B, nh, S, hs)."""
        at = self.slots[:, None, :, None].expand_as(k_new)  # (B, nh, T, hs)
        self.k[layer].scatter_(2, at, k_new)
        self.v[layer].scatter_(2, at, v_new)
        return self.k[layer], self.v[layer]

    def advance(self, T, layers=None):
        pass  # a row's tokens count once it keeps them: `lengths` moves with the rule's result

    def keep_rows(self, rows):
        """Only the rows `rows` (a LongTensor) go on: the others' keys and values are dropped."""
        self.k, self.v, self.lengths = self.k[:, rows], self.v[:, rows], self.lengths[rows]


def forward(model, cache, ids):
    """ids (B, T), row b's at slots lengths[b] + 0..T-1 -> logits (B, T, V). Positions are the slots, clamped inside
    the context (only padding can pass it); each token sees its row's slots up to its own."""
    cache.slots = cache.lengths[:, None] + torch.arange(ids.size(1), device=ids.device)  # (B, T)
    mask = torch.arange(cache.max_len, device=ids.device) <= cache.slots[..., None]  # (B, T, S)
    pos = cache.slots.clamp(max=model.config.block_size - 1)  # (B, T)
    return model(ids, pos=pos, cache=cache, mask=mask[:, None]).logits  # mask (B, 1, T, S): every head alike


def padded(rows, fill=0):
    """Lists of token ids -> (B, max length) LongTensor, short rows padded at the end with `fill`."""
    width = max(map(len, rows))
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows])


def prefill(model, cache, prompts):
    """The model reads every row's prompt (a list of token ids) in one forward, short ones padded at the end.
    Returns logits (B, V) after each row's last prompt token."""
    device = cache.lengths.device
    logits = forward(model, cache, padded(prompts).to(device))  # (B, P, V)
    cache.lengths = torch.tensor([len(p) for p in prompts], device=device)
    return logits[torch.arange(len(prompts), device=device), cache.lengths - 1]
