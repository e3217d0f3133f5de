"""
The KV cache: the keys and values of every layer for the tokens seen so far, in preallocated tensors
(L, B, nh, S, hs), S = max_len slots; and the one way a cached forward places its new tokens there (`place`).
The contract between a model and the fast layer is stated here, once, at the end.

Three lengths, each counting one thing:
    length         the tokens the cache holds (one prompt, or a batch whose rows are in step): what a method reads
    layer_lengths  L ints, the tokens each layer holds. All equal, except while early-exit drafts: its passes through
                   the lower layers run ahead of the upper ones until the verify forward catches up.
    row_lengths    B ints, the tokens each row holds. All equal until a batch's rows fall out of step
                   (`rollback_rows` with different lengths); then each row's new tokens go after its own.
A slot past a row's length holds a rejected guess or padding, which no one sees before a forward writes it again.
What was accepted is kept by moving lengths: `rollback(n)` forgets every slot from n on (a chain), `compact(keep)`
moves the listed slots to the front (a tree path), `rollback_rows` one length per row, `keep_rows` drops rows.

`place(T)` says where a forward's T new tokens go, as tensors (a Placement), whether it runs eager or replayed:
    slots (B or 1, T)         where their keys and values are written: right after each row's own tokens
    pos   (T,) or (B or 1, T)  their position ids: given (a tree node's: prefix + depth) or the slots (+ first)
    attend (B or 1, 1, T, seen)  where each may look among the slots in use (seen = the longest row + T): given
                              over the cached and new tokens (T, n + T, True = may look), or causal (its row's
                              slots up to its own); made additive once (0, or -inf where hidden), not per layer
An eager forward reads those `seen` slots alone; a replayed one reads every slot (`Placement.mask`, the same mask
padded to S, hidden there), so that its shapes depend on B and T alone. The two are the same attention: a hidden
slot adds an exact 0. Reading all S slots eagerly cost the tree methods 4-5% of their greedy speed-up in `make
bench` on a 2-core Xeon (eagle 1.15x -> 1.10x, parallelspec 1.09x -> 1.04x, one thread, fp32): a slice is free.
    max_len 6, 2 tokens cached, 2 new:  slots [[2, 3]], pos [[2, 3]], mask (the slots 4 and 5 may hold keys of
    slot:   0 1 2 3 4 5                 rolled-back guesses, which no one sees)
    new 0   1 1 1 . . .
    new 1   1 1 1 1 . .
    rows out of step [3, 1], 2 new:  row 0 writes slots 3, 4 and sees 0..3, 0..4; row 1 writes 1, 2, sees 0..1, 0..2

The contract with the fast layer (nanospec/fast/runtime.py), which replays a forward without running its Python:
  - a cached model (GPT, the EAGLE head, the ParallelSpec drafter) has a `place` method that takes its forward's
    own arguments and returns the Placement that forward uses; the forward starts by calling it;
  - the forward writes keys and values only through `Placement.update` and moves the cache only through
    `cache.advance`;
  - everything that changes from one step to the next reaches the forward as a tensor (the Placement, the
    ParallelSpec anchors): a Python value it reads would be frozen into a replayed graph.
The fast layer calls `place` on the host before each replay, hands the replay the Placement's tensors, and applies
the forward's `advance`s after it. The lengths stay Python ints on the host, as rollback and compaction are host
decisions; `keep_rows` keeps the rows left in the same memory, so that a replay writes where it was recorded.
"""
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class Placement:
    """Where a forward's T new tokens go (KVCache.place), all tensors. Without a cache (training, the slow oracle)
    there are no slots, and attention stays among the T new tokens."""
    pos: torch.Tensor  # (T,) or (B or 1, T) position ids
    attend: torch.Tensor = None  # the mask attention reads (.., T, seen or S), additive (0 = may look, -inf: not);
    # without a cache, a given (T, T) bool or None (causal)
    slots: torch.Tensor = None  # (B or 1, T) the cache slots their keys and values go to
    cache: "KVCache" = None

    @property
    def mask(self):
        """The mask over EVERY slot (.., T, S), additive: what a replay is handed (its shapes depend on B and T
        alone), the slots past the `seen` ones that `attend` covers hidden. Without a cache: `attend` itself."""
        if self.cache is None:
            return self.attend
        hidden = self.cache.max_len - self.attend.size(-1)
        return F.pad(self.attend, (0, hidden), value=float("-inf")) if hidden else self.attend

    def update(self, layer, k_new, v_new):
        """Attention's one write: the new keys and values (B, nh, T, hs) of `layer`. Returns what to attend over:
        the slots `attend` covers (B, nh, seen, hs; a replay's: all S), or, without a cache, the new keys and values
        themselves."""
        if self.cache is None:
            return k_new, v_new
        k, v = self.cache.write(layer, self.slots, k_new, v_new)
        seen = self.attend.size(-1)  # a view of the first `seen` slots: eager reads only those in use
        return k[:, :, :seen], v[:, :, :seen]


def place(cache, T, pos=None, mask=None, device="cpu", layer=0, first=0, table=None):
    """The Placement of a forward's T new tokens: the cache's (KVCache.place), or, without a cache, positions
    first..first+T-1 unless given, and the given mask (None: causal). `table`: see KVCache.place."""
    if cache is not None:
        return cache.place(T, pos, mask, layer, first, table)
    if pos is None:
        check_table(first, T, table)
        pos = torch.arange(first, first + T, device=device)  # (T,)
    return Placement(pos, mask)


def check_table(start, T, table):
    """Refuse, on the host, default positions start..start+T-1 past a position table of `table` rows (None: no
    check): inside a kernel, on CUDA, they are a device-side assert that ends the process."""
    if table is not None and start + T > table:
        raise ValueError(f"position {start + T - 1} is past the model's context of {table} tokens; "
                         "shorten the prompt or the generation")


def additive(allowed, dtype):
    """A bool mask (True = may look) as the attention scores' addend: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class KVCache:
    """Keys and values (L, B, nh, S, hs) and the three lengths of the module docstring."""

    def __init__(self, config, batch_size=1, device="cpu", dtype=torch.float32, max_len=None):
        n_layer, H = config.n_layer, config.n_head
        self.max_len = max_len or config.block_size
        shape = (n_layer, batch_size, H, self.max_len, config.n_embd // H)  # (L, B, nh, S, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.forget()

    def forget(self):
        """Every slot free again (the tensors are kept: stale keys are never seen)."""
        self.layer_lengths = [0] * self.k.size(0)  # (in a batch out of step: its longest row's)
        self._row_lengths = None  # B ints while the rows are out of step; None: each row holds `length`

    @property
    def length(self):
        """The tokens the cache holds: every layer's (early-exit's lower layers may run ahead while it drafts)."""
        assert self._row_lengths is None, "the rows are out of step: read row_lengths"
        return min(self.layer_lengths)

    @property
    def row_lengths(self):
        """The tokens each row holds, B ints."""
        return list(self._row_lengths) if self._row_lengths is not None else [self.length] * self.k.size(1)

    @property
    def device(self):
        """Where the cache (and the model that fills it) lives: make the forward's inputs there."""
        return self.k.device

    def place(self, T, pos=None, mask=None, layer=0, first=0, table=None):
        """The Placement (module docstring) of T new tokens read from block `layer` on: they go after the tokens
        that layer holds in each row. Default positions are the slots + first (the EAGLE head's slot j holds
        position j + 1); `table`, the rows of the model's position table, refuses default ones past it."""
        ends = [self.layer_lengths[layer]] if self._row_lengths is None else self._row_lengths  # rows' tokens so far
        if pos is None:
            check_table(min(ends) + first, T, table)
        if max(ends) + T > self.max_len:
            raise ValueError(f"KV cache full: {max(ends) + T} tokens > {self.max_len}; shorten the prompt or the "
                             "generation")
        seen, device, dtype = max(ends) + T, self.device, self.k.dtype  # attention reads slots 0..seen-1
        if self._row_lengths is None:  # rows in step: one row of slots, one mask, for all
            n = ends[0]
            slots = torch.arange(n, n + T, device=device)[None]  # (1, T)
            if mask is None:  # causal: new token t sees slots 0..n+t
                mask = torch.full((T, seen), float("-inf"), dtype=dtype, device=device).triu(n + 1)  # (T, seen)
            else:  # given over the cached and new tokens (T, n + T), True = may look: made additive once
                assert mask.shape == (T, seen), (tuple(mask.shape), n, T)
                mask = additive(mask, dtype)
            mask = mask[None, None]  # (1, 1, T, seen)
        else:  # rows out of step, causal (a batch gives no mask): each row after its own tokens
            assert mask is None, "a given mask needs the rows in step"
            slots = torch.tensor(ends, device=device)[:, None] + torch.arange(T, device=device)  # (B, T)
            mask = additive(torch.arange(seen, device=device) <= slots[..., None], dtype)[:, None]  # (B, 1, T, seen)
        if pos is None:
            pos = slots + first if first else slots  # (B or 1, T)
            if slots.size(0) > 1 and table is not None:  # a row ahead of the shortest: only its padding goes past
                pos = pos.clamp(max=table - 1)
        return Placement(pos, mask, slots, self)  # mask (.., T, seen): attention reads the seen slots alone

    def write(self, layer, slots, k_new, v_new):
        """Write the new keys/values (B, nh, T, hs) at `slots` (B or 1, T), row b's at slots[b]; return every slot
        of the layer (B, nh, S, hs): attention's one write (through Placement.update)."""
        k, v = self.k[layer], self.v[layer]  # (B, nh, S, hs) views
        if slots.size(0) == 1:  # rows in step: one index for every row (cheaper than a scatter)
            k.index_copy_(2, slots[0], k_new)
            v.index_copy_(2, slots[0], v_new)
        else:
            at = slots[:, None, :, None].expand_as(k_new)  # (B, nh, T, hs)
            k.scatter_(2, at, k_new)
            v.scatter_(2, at, v_new)
        return k, v

    def advance(self, T, layers=None):
        """Make the T tokens just written part of the cache, in `layers` (default: all of them)."""
        for i in range(len(self.layer_lengths)) if layers is None else layers:
            self.layer_lengths[i] += T
        if self._row_lengths is not None:  # (early-exit, the one user of `layers`, decodes one prompt: rows in step)
            self._row_lengths = [n + T for n in self._row_lengths]

    def rollback(self, length):
        """Forget every slot from `length` on, in every layer. Cheap: the slots are simply overwritten later."""
        # BEGIN SOLUTION ex5
        assert 0 <= length <= max(self.layer_lengths), (length, self.layer_lengths)
        self.layer_lengths = [min(n, length) for n in self.layer_lengths]
        # END SOLUTION ex5

    def compact(self, keep):
        """Keep only the slots listed in `keep` (increasing), moved to 0..len(keep)-1.
        Example: length 7, keep [0, 1, 2, 3, 5] (prefix 0..3, then tree node 5) -> slot 4 := slot 5, length 5."""
        # BEGIN SOLUTION ex5
        assert len(set(self.layer_lengths)) == 1, f"compact needs every layer at one length, got {self.layer_lengths}"
        keep = [int(s) for s in keep]
        first = next((i for i, s in enumerate(keep) if s != i), len(keep))  # slots before it are in place
        if first < len(keep):
            src = torch.tensor(keep[first:], dtype=torch.long, device=self.device)
            self.k[:, :, :, first:len(keep)] = self.k[:, :, :, src]
            self.v[:, :, :, first:len(keep)] = self.v[:, :, :, src]
        self.layer_lengths = [len(keep)] * len(self.layer_lengths)
        # END SOLUTION ex5

    def rollback_rows(self, lengths):
        """Row b keeps its first lengths[b] tokens (B ints): `rollback` when they are all equal (one prompt always
        is), else the rows are out of step from then on, each at its own length."""
        if len(set(lengths)) == 1:
            self._row_lengths = None
            return self.rollback(lengths[0])
        assert len(lengths) == self.k.size(1) and 0 <= min(lengths) and max(lengths) <= self.max_len, lengths
        self._row_lengths = [int(n) for n in lengths]
        self.layer_lengths = [max(self._row_lengths)] * len(self.layer_lengths)

    def keep_rows(self, rows):
        """Only the rows `rows` (B' indices, increasing) go on, moved to rows 0..B'-1 of the same memory (a replay
        of the fast layer keeps writing where it was recorded); the others are dropped."""
        lengths = self.row_lengths
        first = next((i for i, b in enumerate(rows) if b != i), len(rows))  # rows before it are in place already
        if first < len(rows):
            index = torch.tensor(rows[first:], device=self.device)  # (B' - first,)
            self.k[:, first:len(rows)] = self.k[:, index]
            self.v[:, first:len(rows)] = self.v[:, index]
        self.k = self.k[:, :len(rows)]  # (L, B', nh, S, hs): a view, the same memory
        self.v = self.v[:, :len(rows)]
        if self._row_lengths is not None:
            self.rollback_rows([lengths[b] for b in rows])
