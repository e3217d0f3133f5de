"""Host reads per target forward, counted for every method: each read of a tensor's value by Python (`.item()`,
`.tolist()`, `int(t)`, `float(t)`, `if t:`, `t` as an index, `nonzero`) is, on a GPU, a sync that waits for every
queued kernel and keeps the next forward (or the next CUDA graph) from being queued while the host decides. The
methods are plain PyTorch and read the host a few times per step; the bench reports how often (nanospec/bench/timing.py
holds the counter, nanospec/bench/compare.py counts one untimed run per row), and this file holds each method to a bound.

The counter wraps those seven on torch.Tensor while one generation runs (48 new tokens, tiny random models with
every part), on the eager and on the static path (runtime.prepare), at greedy and at t=1, divides by the target
forwards and prints the table (`pytest -s`). Eager and static are the same code, so they read exactly alike."""
import pytest
import torch

from nanospec.decoding import METHODS, MODULES, speculative
from nanospec.bench.timing import READS, counting_host_reads
from nanospec.fast.runtime import prepare
from toys import every_part, random_ids

SAMPLINGS = {"greedy": 0.0, "t=1": 1.0}
NEW_TOKENS = 48
# The most reads per target forward, (greedy, t=1). ar reads exactly one: the token it samples. prompt-lookup
# finds its guesses in the host's token list and reads only the verdict. A chain method (and jacobi's window,
# lookahead's pool) reads its guesses once and the verdict once: 2 (the prefill reads 1). Those are the design,
# with no margin. The tree methods read once or more per level of the tree they grow (eagle's top-k tree: the
# root's scores and tokens, then three per level); their bounds are the values measured here when the methods
# became plain PyTorch (medusa 1.96, 2.78; eagle 5.73, 2.82; parallelspec 1.96, 3.64) plus 25%, rounded up to a
# tenth: a read per node or per guess instead of per level adds several per forward and breaks them.
LIMITS = {"ar": (1.0, 1.0), "prompt-lookup": (1.0, 1.0), "jacobi": (2.0, 2.0), "lookahead": (2.0, 2.0),
          "speculative": (2.0, 2.0), "mtp": (2.0, 2.0), "early-exit": (2.0, 2.0),
          "medusa": (2.5, 3.5), "eagle": (7.2, 3.6), "parallelspec": (2.5, 4.6)}
RUNS = [(m, {}) for m in METHODS] + [(m, {"draft_sampling": mode}) for m in METHODS  # and in its other modes
                                     if "draft_sampling" in MODULES[m].OPTIONS
                                     for mode in MODULES[m].OPTIONS["draft_sampling"].choices
                                     if mode != MODULES[m].OPTIONS["draft_sampling"].default]


@pytest.fixture(scope="module")
def models():
    return every_part()


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
    t[0].item()  # the patch is gone when the block ends
    assert sum(counts.values()) == len(READS)


def test_host_reads_per_target_forward(models):
    static, path = prepare(models, "static")
    assert path == "static"
    rows, over = [], []
    for method, options in RUNS:
        name = method + "".join(f" ({v})" for v in options.values())
        per_forward = {}
        for s, t in SAMPLINGS.items():
            per_forward[s], counts = reads_per_forward(models, method, t, **options)
            assert reads_per_forward(static, method, t, **options)[1] == counts, f"{name} {s}: static reads differ"
        rows.append(f"{name:30s}" + "".join(f"{per_forward[s]:>8.2f}" for s in SAMPLINGS))
        limits = LIMITS[method] if not options else (LIMITS[method][0],) * 2  # the other mode: the top-k tree
        if any(per_forward[s] > limit for s, limit in zip(SAMPLINGS, limits)):
            over.append(f"{name}: {per_forward}, limits {limits}")
    print(f"\nhost reads per target forward, {NEW_TOKENS} new tokens (eager = static)\n{'method':30s}"
          + "".join(f"{s:>8s}" for s in SAMPLINGS) + "\n" + "\n".join(rows))
    assert not over, f"above the limit: {over}"
    assert rows[0].split()[1:] == ["1.00", "1.00"]  # ar: exactly one read, its token, per forward


def test_a_read_per_guess_breaks_the_bound(models, monkeypatch):
    """Negative control: a draft chain that reads each guess as it drafts it (the natural way to write it)."""
    def read_per_guess(step, x, k, sampling, generator=None, stop=None):
        drafts = []
        for _ in range(k):
            drafts.append(int(step(x)[0].argmax()))  # a host read per guess (one row)
            x = torch.tensor([[drafts[-1]]], device=x.device)  # (1, 1)
        return [drafts], None
    assert reads_per_forward(models, "speculative", 0.0)[0] <= LIMITS["speculative"][0]
    monkeypatch.setattr(speculative, "draft_chain", read_per_guess)
    assert reads_per_forward(models, "speculative", 0.0)[0] > LIMITS["speculative"][0]
