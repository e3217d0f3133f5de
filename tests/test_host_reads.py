"""Host reads per target forward, counted for every method: each read of a tensor's value by Python (`.item()`,
`.tolist()`, `int(t)`, `float(t)`, `if t:`, `t` as an index, `nonzero`) is, on a GPU, a sync that waits for every
queued kernel and keeps the next forward (or the next CUDA graph) from being queued while the host decides. A
method whose cost is its model can afford one per target forward: the tokens it emits.

The counter wraps those seven on torch.Tensor while one generation runs (48 new tokens, tiny random models with
every part), divides by the target forwards and prints the table (`pytest -s`). The methods converted to the
one-read step (`ar` and the chain methods, `prompt-lookup`, `jacobi`, `speculative`, `mtp`, `early-exit`:
nanospec/static.py, chain_step.verify_on_device) are held to at most 1.0, in both runtimes; the tree methods on
the static runtime (auto's path on CUDA) to STATIC_LIMITED, 1.0 too; their eager paths, the plain PyTorch oracle
(exercise 9's grow_tree reads the host per level), are recorded, not limited."""
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from nanospec.decoding import METHODS
from nanospec.parts import Models
from test_early_exit_adaptive import random_adapter
from test_eagle import random_head
from test_model import random_ids, tiny_gpt
from test_parallelspec import tiny_drafter

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero")
LIMITED = {m: 1.0 for m in ("ar", "prompt-lookup", "jacobi", "speculative", "mtp", "early-exit")}  # most per forward
# The tree methods on the static runtime, (greedy, t=1): greedy, the tree walk runs on the device and the step
# reads once (eagle's reranked tree stays there too: drafters/eagle.grow_tree_on_device); at t=1 the drawn trees
# keep their shape and the rule runs on the device too (trees.fill_tree and trees.draw_tree on_device,
# tree_step.walk_on_device): one read.
STATIC_LIMITED = {"medusa": (1.0, 1.0), "parallelspec": (1.0, 1.0), "lookahead": (1.0, 1.0), "eagle": (1.0, 1.0)}
RUNS = ([(m, {}) for m in METHODS] + [(m, {"runtime": "static"}) for m in [*LIMITED, *STATIC_LIMITED]]
        + [(m, {"runtime": "static", "draft_sampling": "topk"}) for m in ("medusa", "eagle", "parallelspec")])
SAMPLINGS = {"greedy": 0.0, "t=1": 1.0}
NEW_TOKENS = 48


@contextmanager
def counting_host_reads():
    """Inside `with counting_host_reads() as counts:` every host read of a tensor adds one to counts[name]."""
    counts = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, read):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return read(*args, **kwargs)
        return wrapper

    for name, read in originals.items():
        setattr(torch.Tensor, name, counted(name, read))
    try:
        yield counts
    finally:
        for name, read in originals.items():
            setattr(torch.Tensor, name, read)


@pytest.fixture(scope="module")
def models():
    """Every part every method can use, tiny and random, with room for a prompt and 48 new tokens."""
    target = tiny_gpt(0, n_layer=3, block_size=96)
    return Models(target=target, draft=tiny_gpt(5, n_layer=1, n_future=0, block_size=96),
                  eagle=random_head(target).double(), parallelspec=tiny_drafter(target),
                  early_exit=random_adapter(target))


def reads_per_forward(models, method, temperature, **options):
    """(host reads per target forward, the reads by kind) of one seeded generation of NEW_TOKENS."""
    with counting_host_reads() as counts:
        ids, stats = METHODS[method](models, random_ids(8, seed=1), NEW_TOKENS, temperature=temperature, seed=0,
                                     **options)
    assert len(ids) == NEW_TOKENS
    return sum(counts.values()) / stats["target_forwards"], counts


def test_the_counter_sees_every_kind_of_read():
    t = torch.tensor([3, 0])
    with counting_host_reads() as counts:
        t[0].item(), t.tolist(), int(t[0]), float(t[0]), bool(t[0]), [7, 8, 9, 10][t[0]], t.nonzero()
    assert sorted(counts) == sorted(READS) and set(counts.values()) == {1}


def test_host_reads_per_target_forward(models):
    rows, over = [], []
    for method, options in RUNS:
        name = method + "".join(f" ({v})" for v in options.values())
        per_forward = {s: reads_per_forward(models, method, t, **options)[0] for s, t in SAMPLINGS.items()}
        rows.append(f"{name:30s}" + "".join(f"{per_forward[s]:>8.2f}" for s in SAMPLINGS))
        limits = (STATIC_LIMITED.get(method) if options else None) or (LIMITED.get(method),) * len(SAMPLINGS)
        if any(limit is not None and per_forward[s] > limit for s, limit in zip(SAMPLINGS, limits)):
            over.append(f"{name}: {per_forward}")
    print(f"\nhost reads per target forward, {NEW_TOKENS} new tokens\n{'method':30s}"
          + "".join(f"{s:>8s}" for s in SAMPLINGS) + "\n" + "\n".join(rows))
    assert not over, f"above the limit: {over}"
