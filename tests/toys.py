"""The toys the tests build for themselves, so that every test is hermetic (no checkpoint from `make train`).
Not a test file: it holds no tests; test files import what they need from here (tests/laws.py holds the laws).

  - tiny random models in float64 (`tiny_gpt`, `toy_gpt`) and every drafter the methods use, random
    (`random_head`, `tiny_drafter`, `random_adapter`), alone or together (`every_part`, `all_models`), and the
    slow oracles they are compared with (`full_logits`: a plain forward; `slow_tree`: EAGLE's tree grown one
    plain forward per node);
  - models trained for a second on a toy language, so that guesses are often right and long paths accepted
    (`trained_tiny`, `briefly_trained`; ParallelSpec's law tests' pair, `parallelspec_sampling_models`);
  - run folders the command lines read: a tiny one for decode.py (`tiny_run_folder`, with `decode_error` for its
    one-line errors) and a toy one trained in seconds for the bench (`train_toy`), both made once per module or
    session by tests/conftest.py's fixtures.
"""
import functools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import decode
import train_tiny
from nanospec.model.checkpoint import gpt_checkpoint, save_atomic
from nanospec.steps.run import tensor
from nanospec.model.drafters.eagle import Eagle, eagle_config
from nanospec.model.drafters.early_exit import ExitAdapter
from nanospec.training.drafter_losses import mask_losses
from nanospec.model.drafters.parallelspec import ParallelSpec, ParallelSpecConfig
from nanospec.model.gpt import GPT, GPTConfig
from nanospec.model.load import Models
from nanospec.training.pipeline import lm_losses
from nanospec.tokenizer import Tokenizer, save_tokenizer
from nanospec.rules.tree import path_to
from nanospec.steps.tree_guesses import DrawnTree

ROOT = Path(__file__).resolve().parent.parent  # the project
PROMPTS = str(ROOT / "data" / "prompts.json")  # the bench's committed prompts
TOL = 1e-10  # float64: a fast path equals its slow oracle to this


# ---------------------------------------------------------------------------------------------------------
# Tiny random models and the slow oracle they are held to


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=11, block_size=48, n_layer=2, n_head=2, n_embd=16, n_future=2)
    cfg.update(kw)
    model = GPT(GPTConfig(**cfg)).double().eval()
    for p in model.heads.parameters():  # heads start as identity; perturb so they differ from the main head
        p.data.add_(0.1 * torch.randn_like(p))
    return model


def shorter_context(target, block_size, n_future):
    """`target`'s weights with a context of `block_size` (its own position table, fresh): a method must shrink
    its guesses near the end of this context as `ar` stops there."""
    short = tiny_gpt(0, n_future=n_future, block_size=block_size)
    short.load_state_dict({k: v for k, v in target.state_dict().items() if k != "wpe.weight"}, strict=False)
    return short


def full_logits(model, ids):
    return model(torch.tensor([ids])).logits[0]  # (T, V)


def random_ids(n, vocab=11, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def ids(values):
    return torch.tensor([values], dtype=torch.long)  # (1, T)


def random_tree(n, vocab, rng):
    parents, tokens = [-1], [rng.randrange(vocab)]
    for i in range(1, n):
        parents.append(rng.randrange(i))
        tokens.append(rng.randrange(vocab))
    return tokens, parents


def toy_gpt(seed, n_layer=1):
    """A 5-token GPT with a random untied unembedding, so next-token laws are far from uniform, a target and a
    draft of different seeds disagree often (acceptance about 0.5: every branch of the rule is used), and the
    draft's confidence crosses the adaptive rules' thresholds both ways."""
    model = tiny_gpt(seed, vocab_size=5, n_layer=n_layer, n_future=0)
    g = torch.Generator().manual_seed(seed)
    model.lm_head.weight = torch.nn.Parameter(0.3 * torch.randn(5, 16, generator=g, dtype=torch.float64))
    return model


SAMPLING_MODEL = dict(vocab_size=5, n_future=2, n_layer=1, n_embd=8, block_size=16)  # tiny_gpt(3, **it): the
# methods' law tests, 5 tokens (125 outcomes for 3 of them) and two MTP heads
SAMPLING_TREE = "0;1;2;0,0;0,1;1,0"  # 3 guesses for the first token after the root, 3 for the second


# ---------------------------------------------------------------------------------------------------------
# Random drafters, and every part at once


def random_head(target, seed=0, attention=True):
    """A random EAGLE head; attention=True (EAGLE-1's layer, not the trained default) by default: its masks and
    cache are what the tree and the fast layer can get wrong."""
    torch.manual_seed(seed)
    head = Eagle(eagle_config(target.config, attention)).to(target.wte.weight.dtype)
    for p in head.parameters():  # larger than the init, so the random head's guesses differ from node to node
        p.data.add_(0.3 * torch.randn_like(p))
    return head.eval()


def tiny_drafter(target, seed=0, n_masks=3, **kw):
    torch.manual_seed(seed)
    c = target.config
    cfg = ParallelSpecConfig(vocab_size=c.vocab_size, block_size=c.block_size, n_embd=c.n_embd, n_head=c.n_head,
                             n_masks=n_masks, **kw)
    drafter = ParallelSpec(cfg).double().eval()
    for p in drafter.blocks.parameters():  # a random drafter worth the name: not a near-identity block
        p.data.add_(0.1 * torch.randn_like(p))
    return drafter


def random_adapter(target, seed=0, scale=0.1):
    """Adapters with random weights (a trained one starts as the identity, which would test nothing)."""
    torch.manual_seed(seed)
    adapter = ExitAdapter(target.config).double().eval()
    for p in adapter.parameters():
        p.data.add_(scale * torch.randn_like(p))
    return adapter


def every_part(block_size=96):
    """Every part every method can use, tiny and random; the default context has room for a prompt and 48 new
    tokens."""
    target = tiny_gpt(0, n_layer=3, block_size=block_size)
    return Models(target=target, draft=tiny_gpt(5, n_layer=1, n_future=0, block_size=block_size),
                  eagle=random_head(target).double(), parallelspec=tiny_drafter(target),
                  early_exit=random_adapter(target))


def all_models(seed, block_size=64):
    """A 3-layer target with 3 MTP heads and every drafter, tiny and random, all seeded by `seed`."""
    target = tiny_gpt(seed, n_layer=3, n_future=3, block_size=block_size)
    return Models(target=target, draft=tiny_gpt(seed + 10, n_layer=1, n_future=0, block_size=block_size),
                  eagle=random_head(target, seed), parallelspec=tiny_drafter(target, seed),
                  early_exit=random_adapter(target, seed))


def slow_tree(head, target, prefix_tokens, prefix_features, root, depth, width, total_tokens):
    """EAGLE-2's tree the obvious way: every node's children come from a plain head forward, without cache
    or mask, over the accepted slots followed by the node's own path (tokens with their parents' f̂)."""
    def head_at(path):  # path: candidates from depth 1 down -> the head's Output at the path's end
        x, f = list(prefix_tokens), [prefix_features]
        for c in path:
            h = head(target, tensor(x, "cpu"), torch.cat(f, 0)[None]).hidden[0, -1:]  # (1, C) f̂ at the end
            x, f = x + [tok[c]], f + [h]
        out = head(target, tensor(x, "cpu"), torch.cat(f, 0)[None])
        return torch.log_softmax(out.logits[0, -1], -1)  # (V,)

    tok, parent, score = [], [], []
    frontier = [None]  # None = the root
    for d in range(depth):
        children = []
        for c in frontier:
            path = [] if c is None else path_to(parent, c)
            base = 0.0 if c is None else score[c]
            s, t = head_at(path).topk(width)
            for si, ti in zip(s.tolist(), t.tolist()):
                tok.append(ti), parent.append(-1 if c is None else c), score.append(base + si)
                children.append(len(tok) - 1)
        frontier = sorted(children, key=lambda i: -score[i])[:width]
    keep = sorted(sorted(range(len(tok)), key=lambda i: (-score[i], i))[:total_tokens - 1])
    node = {c: i + 1 for i, c in enumerate(keep)}
    return [root] + [tok[c] for c in keep], [-1] + [node.get(parent[c], 0) for c in keep]


# ---------------------------------------------------------------------------------------------------------
# Trained for a second: guesses often right, long paths accepted


def draw_tree(root, paths, q_root, next_q, generator=None):
    """A DrawnTree filled by a drafter given as a function, the loop eagle_tree.grow_sampled_tree runs with its head:
    next_q(d, level, tokens, parents) -> (K, V), the drafter's laws at the drawn nodes `level` of depth d, in the
    tree's numbering (the root 0: candidate c of the DrawnTree is node c + 1). Returns (tokens, parents, q_draft)."""
    tree = DrawnTree(paths)
    level, d = tree.draw([-1], q_root[None], generator), 1
    while level:
        tokens, parents = [root] + tree.tokens, [-1] + [p + 1 for p in tree.parents]
        level, d = tree.draw(level, next_q(d, [c + 1 for c in level], tokens, parents), generator), d + 1
    return tree.result(root)


def trained_tiny(n_future, steps=150, lr=0.5, seed=0):
    """A tiny model trained for a second on a toy language (x -> 3x + 1 mod 11, one token in eight random),
    so that its heads guess well and long paths get accepted, which random models rarely do.
    Plain SGD written out: torch.optim's first step costs seconds of imports."""
    torch.manual_seed(seed)
    model = tiny_gpt(seed, n_future=n_future).float().train()  # float32 to train, float64 to test
    for _ in range(steps):
        w = torch.empty(16, 16 + n_future, dtype=torch.long)  # (B, T+1+n_future) training windows
        w[:, 0] = torch.randint(0, 11, (16,))
        for t in range(1, w.size(1)):
            noise = torch.rand(16) < 1 / 8
            w[:, t] = torch.where(noise, torch.randint(0, 11, (16,)), (3 * w[:, t - 1] + 1) % 11)
        model.zero_grad()
        sum(lm_losses(model, w).values()).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return model.double().eval()


def briefly_trained(target, steps=40, seed=0):
    """A drafter distilled from the target for a few Adam steps on random text: better than random."""
    drafter = tiny_drafter(target, seed).train()
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    target.requires_grad_(False)
    T = min(20, target.config.block_size - 3)  # real tokens per window; 3 more for the last masks' labels
    for _ in range(steps):
        w = torch.from_numpy(rng.integers(0, target.config.vocab_size, size=(4, T + 3)))
        loss = mask_losses(drafter, target, w, torch.arange(0, T, 2))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.requires_grad_(True)
    return drafter.eval()


@functools.lru_cache
def parallelspec_sampling_models():
    """ParallelSpec's law tests (test_parallelspec.py; test_runtime.py on the static path): a 5-token target and a
    briefly trained drafter, so that its guesses are often accepted and every branch of the rule runs. Built once."""
    target = tiny_gpt(3, vocab_size=5, n_layer=1, n_embd=8, block_size=16)
    return Models(target=target, parallelspec=briefly_trained(target, seed=3))


# ---------------------------------------------------------------------------------------------------------
# Run folders: a tiny one for decode.py, a toy one for the bench


def tiny_run_folder(out):
    """A run folder decode.py can read: tokenizer.tiktoken and a random target.pt with MTP heads, context 64."""
    ranks = {bytes([b]): b for b in range(256)}
    save_tokenizer(ranks, out / "tokenizer")
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=16, n_future=2))
    save_atomic(gpt_checkpoint(target, Tokenizer(ranks).identity), str(out / "target.pt"))
    return str(out)


def decode_error(ckpt, *args):
    """Run decode.main and return its one-line error (it must exit with one)."""
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--ckpt", ckpt, "--device", "cpu", "--max-new-tokens", "4", *args])
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


WORDS = ("buffer reader stream codec frame socket header record table parser token value index offset cache "
         "window queue worker timer event signal handler client server packet field option module").split()


def toy_document(rng, d):
    """Python-like text with docstrings, comments, varied code and methods that repeat a pattern."""
    def sentence():
        return " ".join(rng.choice(WORDS) for _ in range(9)).capitalize() + "."

    def name():
        return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"

    parts = [f'"""Module {d}: {sentence()}\n\n{sentence()}\n{sentence()}\n{sentence()}\n"""\n\nimport os\n']
    for f in range(6):
        a, b, c = name(), name(), name()
        parts.append(f"def {a}({b}, {c}=None):\n    \"\"\"{sentence()}\n\n    {sentence()}\n    {sentence()}\n"
                     f"    {sentence()}\n    \"\"\"\n    # {sentence()}\n    # {sentence()}\n    # {sentence()}\n"
                     f"    {c} = {b}.{name()}({rng.randrange(100)})\n    if {c} > {rng.randrange(100)}:\n"
                     f"        {b} = os.{name()}({c}, {b})\n    for {name()} in range({c}):\n"
                     f"        {b}.{name()}({c} + {rng.randrange(9)})\n    return {name()}({b}, {c})\n")
    methods = "".join(f"    def get_{w}(self, key):\n        if key not in self._{w}s:\n"
                      f"            raise KeyError(key)\n        return self._{w}s[key]\n\n"
                      for w in rng.sample(WORDS, 5))
    parts.append(f"class {name().title().replace('_', '')}:\n{methods}")
    return "\n\n".join(parts)


def write_toy_corpus(folder, n_docs=12, seed=0):
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        (folder / f"mod{d:02d}.py").write_text(toy_document(rng, d))
    return folder


def train_toy(folder):
    """A toy run folder, folder/out, with the tokenizer, the target and every drafter (5 steps each, seconds):
    useless text, but every method runs on it. conftest.py's toy_run is one, for the whole session."""
    src = write_toy_corpus(folder / "src")
    train_tiny.main(["--preset", "toy", "--max-iters", "5", "--corpus", str(src), "--device", "cpu",
                     "--data-dir", str(folder / "data"), "--out-dir", str(folder / "out")])
    return folder / "out"
