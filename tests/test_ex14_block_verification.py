"""Exercise 14 (EXERCISES.md): `block_acceptance` in nanospec/rules/verify.py, block verification (Sun et al. 2024,
"Block Verification Accelerates Speculative Decoding", arXiv 2403.10444): the chance h_i of stopping after i
accepted drafts, and the law of the token emitted there, for a whole chain judged at once. Literal cases (the
paper's example, one draft = the token rule, greedy = the argmax match, p = q, rows independent), then the gates:
exact enumeration of every draft and every outcome on random context-dependent laws, where the output must follow
the target's law to 1e-12 and accept in expectation at least as many drafts as the token rule (11/9 against 10/9
on the paper's example), and a speculative loop verified by `verify_block` that keeps a bigram target's
law. The enumeration is tests/laws.py's block_law; tests/test_block_verification.py's negative controls show it
catches a weight off by one position, the token rule's residual and an uncapped weight. The law tests are gates
(nanospec/course/registry.py): if one fails the exercise scores zero.
Run: python -m pytest -m ex14 -x"""
import itertools

import pytest
import torch

from nanospec.rules.verify import block_acceptance, verify_block
from laws import (P_BIGRAM, PAPER_P, PAPER_Q, START, V3, bigram_law, block_law, empirical_law, gap, prefix_laws,
                  run_chain, sequence_codes, target_law, tv, tv_bound)
from teach import expect, expect_close

pytestmark = pytest.mark.ex14

F64 = torch.float64


def test_docstring_example():
    """The paper's example: p = [1/3, 2/3], q = [2/3, 1/3] at both positions, drafts [0, 1]. Weights w = [1, 1/2,
    1]; nothing is left over at position 1 (w_1 p_1 <= q_1), so h = [1, 0, 1]: both drafts, every time."""
    h, law = block_acceptance(PAPER_P.expand(1, 3, 2), PAPER_Q.expand(1, 2, 2), torch.tensor([[0, 1]]))
    expect_close(h[0], [1.0, 0.0, 1.0], "h of block_acceptance on the paper's example", atol=1e-12)
    expect_close(law[0, 2], PAPER_P, "the law emitted after both drafts (it must be p_target[2])", atol=1e-12)


def test_one_draft_is_the_token_rule():
    """k = 1: h_1 = min(1, p(x) / q(x)); stopping at 0 emits norm(max(p - q, 0)); after the draft, p_target[1]."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        p, q = torch.softmax(2 * torch.randn(2, 4, generator=g, dtype=F64), -1), \
            torch.softmax(2 * torch.randn(1, 4, generator=g, dtype=F64), -1)
        x = int(torch.randint(0, 4, (1,), generator=g))
        h, law = block_acceptance(p[None], q[None], torch.tensor([[x]]))
        ratio = min(1.0, (p[0, x] / q[0, x]).item())
        expect_close(h[0, 1], ratio, f"h_1 with p(x) = {p[0, x]:.3f}, q(x) = {q[0, x]:.3f}", atol=1e-12)
        excess = (p[0] - q[0]).clamp(min=0)
        if ratio < 1:
            expect_close(law[0, 0], excess / excess.sum(), "the law after a rejected single draft", atol=1e-12)
        expect_close(law[0, 1], p[1], "the law after the accepted draft (p_target[1])", atol=1e-12)


def test_greedy_one_hot_laws_accept_up_to_the_first_mismatch():
    """One-hot p and q (greedy): the first mismatch m is where the rule stops (h_m = 1, h_j = 0 after it), and it
    emits the target's argmax there."""
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        best = torch.randint(0, 4, (5,), generator=g)  # (k+1,) the target's argmax at each position
        drafts = torch.where(torch.rand(4, generator=g) < 0.6, best[:4], torch.randint(0, 4, (4,), generator=g))
        p = torch.nn.functional.one_hot(best, 4).to(F64)
        q = torch.nn.functional.one_hot(drafts, 4).to(F64)
        h, law = block_acceptance(p[None], q[None], drafts[None])
        m = next((i for i in range(4) if drafts[i] != best[i]), 4)
        expect(h[0, m].item() == pytest.approx(1.0) and bool((h[0, m + 1:] == 0).all()),
               f"drafts {drafts.tolist()} against argmaxes {best.tolist()}: h = {h[0].tolist()}, but the rule "
               f"must stop at the first mismatch, position {m}")
        expect(int(law[0, m].argmax()) == best[m] and law[0, m].max().item() == pytest.approx(1.0),
               f"the token emitted at the first mismatch must be the argmax {int(best[m])}, got {law[0, m].tolist()}")


def test_p_equal_to_q_accepts_every_draft_without_nan():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(1, 4, 5, generator=g, dtype=F64), -1)
    h, law = block_acceptance(p, p[:, :3], torch.tensor([[0, 3, 1]]))
    expect(torch.isfinite(h).all() and torch.isfinite(law).all(), f"NaN or inf when p = q: h = {h.tolist()}")
    expect_close(h[0, 3], 1.0, "h_k when p = q (every draft is accepted)", atol=1e-12)


def test_rows_are_independent():
    """B = 3 chains at once give what each gives alone."""
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(2 * torch.randn(3, 4, 3, generator=g, dtype=F64), -1)
    q = torch.softmax(2 * torch.randn(3, 3, 3, generator=g, dtype=F64), -1)
    drafts = torch.randint(0, 3, (3, 3), generator=g)
    h, law = block_acceptance(p, q, drafts)
    for b in range(3):
        h_b, law_b = block_acceptance(p[b:b + 1], q[b:b + 1], drafts[b:b + 1])
        expect_close(h[b], h_b[0], f"row {b}'s h in a batch of 3 against alone", atol=1e-12)
        expect_close(law[b], law_b[0], f"row {b}'s laws in a batch of 3 against alone", atol=1e-12)


def test_the_papers_example_accepts_more_than_the_token_rule():
    """Every draft of the paper's example enumerated: 11/9 drafts accepted per step (the token rule: 10/9), and
    the first three tokens follow the target's law exactly."""
    table = {prefix: (PAPER_P, PAPER_Q) for n in range(3) for prefix in itertools.product(range(2), repeat=n)}
    law, accepted, token_accepted = block_law(block_acceptance, table, 2, 2)
    expect(gap(law, target_law(table, 2, 3)) < 1e-12, "the paper's example: the output's law is not the target's")
    expect(abs(accepted - 11 / 9) < 1e-12, f"expected accepted drafts {accepted:.6f}, the paper's is 11/9 = 1.2222")


def test_the_law_is_the_targets_and_never_fewer_accepted():
    """Exact enumeration, V = 2 and 3, k = 2 and 3, random context-dependent p and q: the law of the first k+1
    tokens is the target's to 1e-12, and the expected accepted drafts are at least the token rule's."""
    for V, k in ((2, 2), (3, 2), (2, 3)):
        for seed in range(3):
            table = prefix_laws(V, k, seed)
            law, accepted, token_accepted = block_law(block_acceptance, table, V, k)
            worst = gap(law, target_law(table, V, k + 1))
            expect(worst < 1e-12, f"V = {V}, k = {k}, seed {seed}: a sequence's probability is off by {worst:.3g}")
            expect(accepted >= token_accepted - 1e-12, f"V = {V}, k = {k}, seed {seed}: {accepted:.4f} drafts "
                   f"accepted in expectation, fewer than the token rule's {token_accepted:.4f}")


def test_a_block_verified_loop_keeps_the_law_when_sampled():
    """60,000 runs of a speculative loop (bigram target and draft, 4 tokens, k = 3) judged by verify_block:
    total variation to the target's law under tv_bound (failure probability 1e-6)."""
    def block(p_target, q_draft, drafts, g):
        return verify_block(p_target, q_draft[:, :-1], drafts, g)

    law = empirical_law(sequence_codes(run_chain(block, L=4, k=3, n=60_000), V3), V3 ** 4)
    distance, bound = tv(law, bigram_law(P_BIGRAM, START, 4)), tv_bound(V3 ** 4, 60_000)
    expect(distance < bound, f"sampled sequences are {distance:.4f} from the target's law (bound {bound:.4f})")
