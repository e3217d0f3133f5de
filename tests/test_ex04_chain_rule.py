"""Exercise 4 (EXERCISES.md): `verify_chain` in nanospec/rules/verify.py, speculative sampling over a chain of
k drafts with its bonus token, on one chain or B at once (leading dimensions). Literal greedy cases (a wrong guess first, in the middle, last; all accepted plus
the bonus; no guesses), then seeded statistics: the rejection draws from the residual, the bonus from p, the
accepted count follows its truncated geometric law, and whole sequences follow the target's law.

These tests grade exercise 4 alone: `accept_prob` and `residual` (exercise 3) are replaced by the course's own
copy (tests/reference_ex03.py), so a student who has not finished exercise 3 still gets exercise 4's points.
A handout that blanks exercise 3 does not ship that copy: there your own exercise 3 is used, and the course's
grader brings its copy back. The sampled tests are gates (nanospec/course/registry.py): if one fails, the
exercise scores zero, since a chain rule with the wrong law is wrong however many literal cases it gets right.
Run: python -m pytest -m ex4 -x"""
import pytest
import torch

from nanospec.rules.verify import verify_chain
from laws import empirical_law, sequence_codes, tv, tv_bound
from teach import expect, expect_equal, expect_law

pytestmark = [pytest.mark.ex4, pytest.mark.usefixtures("exercise_3_stand_ins")]  # tests/conftest.py

F64 = torch.float64


def one_hot(tokens, V=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).to(F64)


TARGET = [5, 9, 7, 3]  # greedy: the target's argmax after [last, d1, d2, d3]


@pytest.mark.parametrize("draft, expected", [
    ([4, 9, 7], (0, 5)),  # the first guess is wrong: emit the target's 5
    ([5, 1, 7], (1, 9)),  # wrong in the middle
    ([5, 9, 2], (2, 7)),  # wrong last (the docstring's example)
    ([5, 9, 7], (3, 3)),  # all accepted, plus the bonus from p_target[k]
], ids=["first-wrong", "middle-wrong", "last-wrong", "all-accepted"])
def test_greedy_literal(draft, expected):
    """Greedy decoding is the one-hot case: p and q point masses, so the rule is "accept while equal"."""
    got = tuple(int(v) for v in verify_chain(one_hot(TARGET), one_hot(draft), torch.tensor(draft)))  # one chain
    expect_equal(got, expected, f"verify_chain (greedy: one-hot p and q), draft {draft}, target argmax {TARGET}, "
                                f"as (n_accepted, next_token)")


def test_no_guesses_is_a_plain_sample_of_p():
    p = torch.tensor([[0.0, 0.25, 0.75]], dtype=F64).expand(20_000, 1, 3)
    n, nxt = verify_chain(p, torch.zeros(20_000, 0, 3, dtype=F64), torch.zeros(20_000, 0, dtype=torch.long),
                                  torch.Generator().manual_seed(0))
    expect(bool((n == 0).all()), f"verify_chain with k = 0 guesses must accept 0, got n_accepted "
                                 f"{sorted(set(n.tolist()))}")
    law = empirical_law(nxt, 3)
    expect_law(tv(law, p[0, 0]), tv_bound(3, 20_000), "verify_chain with no guesses: the next token must "
               "be a plain sample of p_target[0] = [0, 0.25, 0.75]", law, p[0, 0])


def test_shapes_and_independent_rows():
    """B chains at once, each with its own p and q: (B,) LongTensors, row b's answer is row b's alone."""
    drafts = [[4, 9, 7], [5, 1, 7], [5, 9, 2], [5, 9, 7]]
    targets = [TARGET, TARGET, TARGET, [5, 9, 7, 8]]
    p = torch.stack([one_hot(t) for t in targets])  # (4, 4, 10)
    q = torch.stack([one_hot(d) for d in drafts])  # (4, 3, 10)
    n, nxt = verify_chain(p, q, torch.tensor(drafts), torch.Generator().manual_seed(0))
    expect(n.dtype == nxt.dtype == torch.long and n.shape == nxt.shape == (4,),
           f"verify_chain on 4 chains: expected two LongTensors of shape (4,), got {n.dtype} "
           f"{tuple(n.shape)} and {nxt.dtype} {tuple(nxt.shape)}")
    expect_equal((n.tolist(), nxt.tolist()), ([0, 1, 2, 3], [5, 9, 7, 8]),
                 "verify_chain on 4 greedy chains (each row its own p and q), (n_accepted, next_token)")


def test_a_rejection_draws_from_the_residual():
    """The docstring's example: p_0 = [0.2, 0.8], q_0 = [0.6, 0.4], the draft is token 0. It is accepted with
    probability 1/3; after a rejection the emitted token is a draw of norm(max(0, p - q)) = [0, 1]: always 1."""
    B, g = 60_000, torch.Generator().manual_seed(1)
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]], dtype=F64).expand(B, 2, 2)
    q = torch.tensor([[0.6, 0.4]], dtype=F64).expand(B, 1, 2)
    n, nxt = verify_chain(p, q, torch.zeros(B, 1, dtype=torch.long), g)
    after = nxt[n == 0]
    expect(bool((after == 1).all()), f"after a rejection the token must be drawn from residual(p_0, q_0) = [0, 1], "
                                     f"but token 0 came {(after == 0).sum().item()} times in {len(after)} rejections "
                                     f"(drawn from p_0, or from the wrong position?)")
    law, exact = empirical_law(n, 2), torch.tensor([2 / 3, 1 / 3], dtype=F64)
    expect_law(tv(law, exact), tv_bound(2, B), "n_accepted with accept_prob 1/3 (law [2/3, 1/3])", law, exact)


def test_all_accepted_then_the_bonus_follows_p_not_q():
    """q = p at every drafted position: every guess is accepted, and the bonus must be a draw of p_target[k]
    (the next position's law), which here differs from every q row."""
    B, k, g = 60_000, 3, torch.Generator().manual_seed(2)
    q_rows = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]], dtype=F64)
    bonus = torch.tensor([0.7, 0.0, 0.0, 0.3], dtype=F64)
    drafts = torch.stack([torch.multinomial(q_rows[j], B, replacement=True, generator=g) for j in range(k)], 1)
    p = torch.cat([q_rows, bonus[None]]).expand(B, k + 1, 4)
    n, nxt = verify_chain(p, q_rows.expand(B, k, 4), drafts, g)
    expect(bool((n == k).all()), f"with q = p every guess must be accepted: n_accepted {sorted(set(n.tolist()))}, "
                                 f"expected always {k}")
    law = empirical_law(nxt, 4)
    expect_law(tv(law, bonus), tv_bound(4, B), "the bonus token must be a draw of p_target[k] = [0.7, 0, 0, 0.3]",
               law, bonus)


def test_accepted_count_is_truncated_geometric():
    """With the same p and q at every position, each guess is accepted with probability a = sum min(p, q),
    independently: P(n = j) = a^j (1 - a) for j < k, and P(n = k) = a^k (Leviathan et al. 2022)."""
    B, k, g = 100_000, 4, torch.Generator().manual_seed(3)
    p_row, q_row = torch.tensor([0.5, 0.3, 0.2], dtype=F64), torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    a = torch.minimum(p_row, q_row).sum().item()  # 0.7
    drafts = torch.multinomial(q_row, B * k, replacement=True, generator=g).view(B, k)
    n, _ = verify_chain(p_row.expand(B, k + 1, 3), q_row.expand(B, k, 3), drafts, g)
    law = torch.tensor([a**j * (1 - a) for j in range(k)] + [a**k], dtype=F64)
    got = empirical_law(n, k + 1)
    expect_law(tv(got, law), tv_bound(k + 1, B), "n_accepted must follow the truncated geometric law a^j (1 - a), "
               "a = 0.7: only the prefix before the first rejection counts, one uniform per position", got, law)


def test_generated_sequences_follow_the_target_law():
    """A bigram target P and draft Q over 3 tokens; 100,000 sequences of 3 tokens, each made by repeated steps
    (draft 2 tokens from Q, verify against P, append what is emitted). Their joint law must be the target's,
    prod_t P[x_{t-1}, x_t], within tv_bound over the 27 sequences."""
    V, k, L, B = 3, 2, 3, 100_000
    g = torch.Generator().manual_seed(4)
    P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.0, 0.7]], dtype=F64)  # P[prev] = law of next
    Q = torch.tensor([[0.2, 0.7, 0.1], [0.5, 0.1, 0.4], [0.0, 0.5, 0.5]], dtype=F64)
    seq = torch.zeros(B, L * (k + 1) + 1, dtype=torch.long)  # column 0: the context token 0
    count = torch.ones(B, dtype=torch.long)  # tokens so far, context included
    rows = torch.arange(B)
    while (count <= L).any():
        last = seq[rows, count - 1]
        drafts, prev = [], last
        for _ in range(k):
            prev = torch.multinomial(Q[prev], 1, generator=g)[:, 0]
            drafts.append(prev)
        drafts = torch.stack(drafts, 1)  # (B, k)
        context = torch.cat([last[:, None], drafts], 1)  # (B, k+1): the token before each position
        n, nxt = verify_chain(P[context], Q[context[:, :k]], drafts, g)
        for j in range(k):
            take = j < n
            seq[rows[take], count[take] + j] = drafts[take, j]
        seq[rows, count + n] = nxt
        count += n + 1
    exact = torch.zeros(V**L, dtype=F64)
    for code in range(V**L):
        xs = [code // V**(L - 1 - i) % V for i in range(L)]
        exact[code] = P[0, xs[0]] * P[xs[0], xs[1]] * P[xs[1], xs[2]]
    got = empirical_law(sequence_codes(seq[:, 1:L + 1], V), V**L)
    expect_law(tv(got, exact), tv_bound(V**L, B), "3-token sequences made by repeated verify_chain steps "
               "must follow the bigram target's law", got, exact)
