"""A drafter's chain of guesses (nanospec/steps/draft_chain.py), the one way `speculative` and `early-exit` draft,
on either runtime:

  - greedy, the chain is the argmax chain, each guess fed back (literal, on a bigram drafter; and a tiny draft
    GPT's chain is its own greedy `ar` output, eager and Fast alike);
  - sampling, each guess is drawn from q given the guesses before it: the joint law of 3-guess chains against the
    product of the drafter's warped conditionals (tv_bound), and q_draft holds those conditionals. Two broken
    chains fail the same test: one that takes the argmax where it should draw (its q_draft lies about where the
    guesses came from), and one that re-seeds its generator before each draw (every marginal right, the joint
    law wrong: the test sees the chain, not only single draws);
  - `stop` ends the chain after the guess it is asked about; k = 0 drafts nothing; the chain reads the host once;
  - end to end on the static path (speculative and early-exit at t=1, and with top-k and top-p): the first tokens
    follow the target's exact law, and the argmax chain fails speculative's test (the method-level control).
"""
import pytest
import torch

from nanospec.decoding import METHODS
from nanospec.steps import draft_chain as draft_chain_module
from nanospec.steps.draft_chain import draft_chain
from nanospec.steps.options import Sampling
from nanospec.model.load import Models
from nanospec.fast.runtime import Fast, prepare
from nanospec.rules.verify import sample, warp
from nanospec.bench.timing import counting_host_reads
from laws import empirical_law, exact_law, sequence_codes, tv, tv_bound
from toys import random_adapter, random_ids, tiny_gpt, toy_gpt

# A bigram drafter over 4 tokens: row a = its logits for the token after a. Argmax: 0 -> 2, 2 -> 1, 1 -> 3, 3 -> 0.
LOGITS = torch.tensor([[1.0, 2.0, 6.0, 1.0], [1.0, 1.0, 2.0, 6.0], [2.0, 5.0, 2.0, 1.0], [6.0, 1.0, 2.0, 1.0]],
                      dtype=torch.float64).log()  # (V, V)
V = 4


def bigram_step(fed=None):
    """step(x) for draft_chain: the drafter's logits (B, V) after each row's last token of x (B, T); every x it
    reads goes in `fed` (a host read: None reads nothing)."""
    def step(x):  # x (B, T)
        if fed is not None:
            fed.append(x.tolist())
        return LOGITS.index_select(0, x[:, -1])  # (B, V) indexed on the device: no host read
    return step


def test_greedy_is_the_argmax_chain_fed_back():
    fed = []
    drafts, q_draft = draft_chain(bigram_step(fed), torch.tensor([[3, 0]]), 4, Sampling(0.0))
    assert drafts == [[2, 1, 3, 0]]  # one row
    assert fed == [[[3, 0]], [[2]], [[1]], [[3]]]  # the newest tokens first, then each guess, one at a time
    assert q_draft is None  # greedy: no q is built (every rule judges by the target's argmax alone)


def test_rows_draft_side_by_side():
    """B rows at once: each row's chain is the one it drafts alone (greedy, and seeded sampling row by row)."""
    fed = []
    drafts, q_draft = draft_chain(bigram_step(fed), torch.tensor([[3, 0], [1, 2]]), 3, Sampling(0.0))
    assert drafts == [[2, 1, 3], [1, 3, 0]] and q_draft is None
    assert fed == [[[3, 0], [1, 2]], [[2], [1]], [[1], [3]]]
    rows, _ = draft_chain(bigram_step(), torch.tensor([[0]] * 400), 2, Sampling(1.0), torch.Generator().manual_seed(0))
    assert len({tuple(r) for r in rows}) > 4  # rows draw apart: each its own slice of every draw


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "fast"])
@torch.inference_mode()
def test_a_draft_gpts_greedy_chain_is_its_own_ar_output(fast):
    draft = tiny_gpt(5, n_layer=1, n_future=0)
    prompt = random_ids(4, seed=2)
    model = Fast(draft) if fast else draft
    cache = model.new_cache()
    [drafts], _ = draft_chain(lambda x: model(x, cache=cache).logits[:, -1], torch.tensor([prompt]), 8, Sampling(0.0))
    assert drafts == METHODS["ar"](Models(target=draft), prompt, 8)[0]
    assert cache.length == len(prompt) + 7  # the prompt and every guess but the last were read


def test_stop_ends_the_chain_after_the_guess_it_judges():
    asked = []

    def stop(logits, guess):  # the drafter's logits for the guess, and the guess (a tensor on the device)
        asked.append((logits.argmax().item(), guess.item()))
        return guess.item() == 1

    drafts, q_draft = draft_chain(bigram_step(), torch.tensor([[0]]), 4, Sampling(0.0), stop=stop)
    assert drafts == [[2, 1]] and q_draft is None and asked == [(2, 2), (1, 1)]
    fed = []
    assert draft_chain(bigram_step(fed), torch.tensor([[0]]), 0, Sampling(1.0)) == ([[]], None) and not fed


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0), Sampling(0.8, 3, 0.9)])
def test_the_chain_reads_the_host_once(sampling):
    with counting_host_reads() as counts:
        drafts, _ = draft_chain(bigram_step(), torch.tensor([[0]]), 5, sampling, torch.Generator().manual_seed(0))
    assert len(drafts[0]) == 5 and sum(counts.values()) == 1, counts  # the guesses' .tolist(), at the end


# ---------------------------------------------------------------------------------------------------------
# The law of the chain

K = 3  # guesses per chain: V**K = 64 outcomes
N = 10_000  # tv_bound(64, 10_000) = 0.054


def exact_chain_law(sampling, root=0):
    """P(d1, d2, d3) = q(d1 | root) q(d2 | d1) q(d3 | d2), (V**K,) indexed like sequence_codes (first guess most
    significant): a chain's code c, then guess d, is c * V + d, and its last guess is c % V."""
    q = warp(LOGITS, *sampling)  # (V, V) row a: the warped law after a
    law = q[root]  # (V,) over chains of one guess
    for _ in range(K - 1):
        law = (law[:, None] * q[torch.arange(len(law)) % V]).reshape(-1)  # (V**j, V) -> (V**(j+1),)
    return law


def chain_law(sampling, n=N, root=0):
    """The empirical law of n chains of K guesses from `root`, each run with its own seeded generator; checks
    on the way that each q_draft row is the warped law after the guess before it."""
    q = warp(LOGITS, *sampling)  # (V, V)
    chains = []
    for seed in range(n):
        [drafts], q_draft = draft_chain(bigram_step(), torch.tensor([[root]]), K, sampling,
                                        torch.Generator().manual_seed(seed))
        assert torch.equal(q_draft[0], q[[root] + drafts[:-1]])  # (K, V): the law each guess was drawn from
        chains.append(drafts)
    return empirical_law(sequence_codes(torch.tensor(chains), V), V ** K)


SAMPLINGS = [Sampling(1.0), Sampling(0.8, 3, 0.9)]  # top-k and top-p: drafts only where q allows them


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_each_guess_follows_q_given_the_guesses_before_it(sampling):
    distance, bound = tv(chain_law(sampling), exact_chain_law(sampling)), tv_bound(V ** K, N)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f}"


def test_an_argmax_chain_is_caught(monkeypatch):
    """Negative control: the chain takes the argmax of q where it should draw from it (q_draft then says the
    guesses were drawn from q). 1000 chains: the bound is 0.171, this chain comes out near 0.8."""
    monkeypatch.setattr(draft_chain_module, "sample", lambda q_draft, generator: q_draft.argmax(-1))
    n = 1000
    distance, bound = tv(chain_law(Sampling(1.0), n), exact_chain_law(Sampling(1.0))), tv_bound(V ** K, n)
    assert distance > bound, f"TV {distance:.4f} <= bound {bound:.4f}: the test cannot see this bug"


def test_a_chain_that_reseeds_before_each_draw_is_caught(monkeypatch):
    """Negative control: re-seeding the generator before each draw (with the run's own seed, so every run still
    differs) gives every guess of a chain the same uniform. Each draw alone still follows its q; the chain does
    not: its guesses move together. 1000 chains: bound 0.171, this chain comes out near 0.5."""
    def reseeded(q_draft, generator):
        return sample(q_draft, torch.Generator().manual_seed(generator.initial_seed()))

    monkeypatch.setattr(draft_chain_module, "sample", reseeded)
    n = 1000
    distance, bound = tv(chain_law(Sampling(1.0), n), exact_chain_law(Sampling(1.0))), tv_bound(V ** K, n)
    assert distance > bound, f"TV {distance:.4f} <= bound {bound:.4f}: the test cannot see this bug"


# ---------------------------------------------------------------------------------------------------------
# End to end on the static path: the first tokens follow the target's law

L = 3  # the prefill's token, then two tokens that went through a verify step


def first_tokens_tv(method, models, n, sampling, prompt=(1, 3), **options):
    """TV between the law of the first L = 3 tokens of n seeded runs of `method` on the static path and the
    target's exact law, and the bound a correct sampler stays under (tv_bound over the 125 outcomes, delta 1e-6).
    The budget lets the first verify step draft every guess (the run keeps one token for the target)."""
    wrapped, _ = prepare(models, "static")
    temperature, top_k, top_p = sampling
    seqs = torch.tensor([METHODS[method](wrapped, list(prompt), L + options["draft_len"] - 1,
                                         temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                                         **options)[0][:L] for s in range(n)])  # (n, L)
    law = exact_law(models.target, list(prompt), L, sampling)
    return tv(empirical_law(sequence_codes(seqs, 5), 5 ** L), law), tv_bound(5 ** L, n)


def speculative_models():
    """test_speculative's pair: 5-token GPTs with random unembeddings, which disagree about half the time."""
    return Models(target=toy_gpt(0), draft=toy_gpt(50))


def early_exit_models():
    target = toy_gpt(0, n_layer=2)
    return Models(target=target, early_exit=random_adapter(target, 1, scale=0.3))


@pytest.mark.parametrize("method, models, sampling, n", [
    ("speculative", speculative_models, (1.0, None, None), 1500),  # bound 0.184
    ("early-exit", early_exit_models, (1.0, None, None), 1500),
    ("early-exit", early_exit_models, (0.8, 3, 0.9), 1500),  # warping reaches q and p alike
])
def test_chain_methods_follow_the_target_law_on_the_static_path(method, models, sampling, n):
    distance, bound = first_tokens_tv(method, models(), n, sampling, draft_len=2)
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f}"


def test_an_argmax_chain_fails_speculatives_law_test(monkeypatch):
    """Negative control of the test above: the draft chain takes the argmax where it should draw. 1000 runs:
    bound 0.224, this chain comes out near 0.34."""
    monkeypatch.setattr(draft_chain_module, "sample", lambda q_draft, generator: q_draft.argmax(-1))
    distance, bound = first_tokens_tv("speculative", speculative_models(), 1000, (1.0, None, None), draft_len=2)
    assert distance > bound, f"TV {distance:.4f} <= bound {bound:.4f}: the test cannot see this bug"
