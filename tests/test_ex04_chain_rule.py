"""Exercise 4 (EXERCISES.md): `verify_chain_batched` in nanospec/verify.py, speculative sampling over a chain of
k drafts with its bonus token. Literal greedy cases (a wrong guess first, in the middle, last; all accepted plus
the bonus; no guesses), then seeded statistics: the rejection draws from the residual, the bonus from p, the
accepted count follows its truncated geometric law, and whole sequences follow the target's law.

These tests grade exercise 4 alone: `accept_prob` and `residual` (exercise 3) are replaced by the slow
versions below, so a student who has not finished exercise 3 still gets exercise 4's points.
Run: python -m pytest -m ex4"""
import pytest
import torch

from nanospec import verify
from nanospec.verify import verify_chain, verify_chain_batched
from test_verify import empirical_law, sequence_codes, tv, tv_bound

pytestmark = pytest.mark.ex4

F64 = torch.float64


def slow_accept_prob(p, q, x):
    """Exercise 3's rule, spelled out: min(1, p(x) / q(x)), and, where q(x) = 0, 1 if p(x) > 0 else 0."""
    px = torch.take_along_dim(p, x[..., None], dim=-1)[..., 0]
    qx = torch.take_along_dim(q, x[..., None], dim=-1)[..., 0]
    out = (px > 0).to(p.dtype)  # the q(x) = 0 convention, overwritten below where q(x) > 0
    drawable = qx > 0
    out[drawable] = torch.clamp(px[drawable] / qx[drawable], max=1.0)
    return out


def slow_residual(p, q):
    """Exercise 3's residual, spelled out: max(0, p - q) normalised, or p where that leaves nothing."""
    left = torch.relu(p - q)
    total = left.sum(-1, keepdim=True)
    return torch.where(total > 0, left / torch.where(total > 0, total, 1.0), p)


@pytest.fixture(autouse=True)
def exercise_3_stand_ins(monkeypatch):
    monkeypatch.setattr(verify, "accept_prob", slow_accept_prob)
    monkeypatch.setattr(verify, "residual", slow_residual)


def one_hot(tokens, V=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).to(F64)


TARGET = [5, 9, 7, 3]  # greedy: the target's argmax after [last, d1, d2, d3]


@pytest.mark.parametrize("draft, expected", [
    ([4, 9, 7], (0, 5)),  # the first guess is wrong: emit the target's 5
    ([5, 1, 7], (1, 9)),  # wrong in the middle
    ([5, 9, 2], (2, 7)),  # wrong last (the docstring's example)
    ([5, 9, 7], (3, 3)),  # all accepted, plus the bonus from p_target[k]
])
def test_greedy_literal(draft, expected):
    """Greedy decoding is the one-hot case: p and q point masses, so the rule is "accept while equal"."""
    assert verify_chain(one_hot(TARGET), one_hot(draft), torch.tensor(draft)) == expected


def test_no_guesses_is_a_plain_sample_of_p():
    p = torch.tensor([[0.0, 0.25, 0.75]], dtype=F64).expand(20_000, 1, 3)
    n, nxt = verify_chain_batched(p, torch.zeros(20_000, 0, 3, dtype=F64), torch.zeros(20_000, 0, dtype=torch.long),
                                  torch.Generator().manual_seed(0))
    assert (n == 0).all()
    assert tv(empirical_law(nxt, 3), p[0, 0]) < tv_bound(3, 20_000)


def test_shapes_and_independent_rows():
    """B chains at once, each with its own p and q: (B,) LongTensors, row b's answer is row b's alone."""
    drafts = [[4, 9, 7], [5, 1, 7], [5, 9, 2], [5, 9, 7]]
    targets = [TARGET, TARGET, TARGET, [5, 9, 7, 8]]
    p = torch.stack([one_hot(t) for t in targets])  # (4, 4, 10)
    q = torch.stack([one_hot(d) for d in drafts])  # (4, 3, 10)
    n, nxt = verify_chain_batched(p, q, torch.tensor(drafts), torch.Generator().manual_seed(0))
    assert n.dtype == nxt.dtype == torch.long and n.shape == nxt.shape == (4,)
    assert n.tolist() == [0, 1, 2, 3] and nxt.tolist() == [5, 9, 7, 8]


def test_a_rejection_draws_from_the_residual():
    """The docstring's example: p_0 = [0.2, 0.8], q_0 = [0.6, 0.4], the draft is token 0. It is accepted with
    probability 1/3; after a rejection the emitted token is a draw of norm(max(0, p - q)) = [0, 1]: always 1."""
    B, g = 60_000, torch.Generator().manual_seed(1)
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]], dtype=F64).expand(B, 2, 2)
    q = torch.tensor([[0.6, 0.4]], dtype=F64).expand(B, 1, 2)
    n, nxt = verify_chain_batched(p, q, torch.zeros(B, 1, dtype=torch.long), g)
    assert (nxt[n == 0] == 1).all()
    assert tv(empirical_law(n, 2), torch.tensor([2 / 3, 1 / 3], dtype=F64)) < tv_bound(2, B)


def test_all_accepted_then_the_bonus_follows_p_not_q():
    """q = p at every drafted position: every guess is accepted, and the bonus must be a draw of p_target[k]
    (the next position's law), which here differs from every q row."""
    B, k, g = 60_000, 3, torch.Generator().manual_seed(2)
    q_rows = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]], dtype=F64)
    bonus = torch.tensor([0.7, 0.0, 0.0, 0.3], dtype=F64)
    drafts = torch.stack([torch.multinomial(q_rows[j], B, replacement=True, generator=g) for j in range(k)], 1)
    p = torch.cat([q_rows, bonus[None]]).expand(B, k + 1, 4)
    n, nxt = verify_chain_batched(p, q_rows.expand(B, k, 4), drafts, g)
    assert (n == k).all()
    assert tv(empirical_law(nxt, 4), bonus) < tv_bound(4, B)


def test_accepted_count_is_truncated_geometric():
    """With the same p and q at every position, each guess is accepted with probability a = sum min(p, q),
    independently: P(n = j) = a^j (1 - a) for j < k, and P(n = k) = a^k (Leviathan et al. 2022)."""
    B, k, g = 100_000, 4, torch.Generator().manual_seed(3)
    p_row, q_row = torch.tensor([0.5, 0.3, 0.2], dtype=F64), torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    a = torch.minimum(p_row, q_row).sum().item()  # 0.7
    drafts = torch.multinomial(q_row, B * k, replacement=True, generator=g).view(B, k)
    n, _ = verify_chain_batched(p_row.expand(B, k + 1, 3), q_row.expand(B, k, 3), drafts, g)
    law = torch.tensor([a**j * (1 - a) for j in range(k)] + [a**k], dtype=F64)
    assert tv(empirical_law(n, k + 1), law) < tv_bound(k + 1, B)


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
        n, nxt = verify_chain_batched(P[context], Q[context[:, :k]], drafts, g)
        for j in range(k):
            take = j < n
            seq[rows[take], count[take] + j] = drafts[take, j]
        seq[rows, count + n] = nxt
        count += n + 1
    exact = torch.zeros(V**L, dtype=F64)
    for code in range(V**L):
        xs = [code // V**(L - 1 - i) % V for i in range(L)]
        exact[code] = P[0, xs[0]] * P[xs[0], xs[1]] * P[xs[1], xs[2]]
    assert tv(empirical_law(sequence_codes(seq[:, 1:L + 1], V), V**L), exact) < tv_bound(V**L, B)
