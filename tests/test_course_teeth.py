"""
The course kit's teeth, part two: wrong answers earn nothing, right ones earn everything, and handouts never
destroy work. Instructor-only: handouts leave this file out (tests/test_course*.py).

  - A gallery of plausible wrong answers, at least three per auto-graded exercise: the ones issue 22 found
    keeping points (exercise 3's `residual = p` and a zero-mass check over the whole batch; exercise 8's fresh
    draw after a mismatch and a rejected child's mass not removed), the ones EXERCISES.md warns about, and the
    classic slips of each deterministic exercise. Each is put in place of the reference and must fail a gate,
    so the grader's own `score` gives it 0 points.
    Correct answers written in other words must score full marks.
  - The grader's gate rule and its messages, on a literal report.
  - `make handout` over an earlier handout that is a git repository with the student's own files keeps both;
    a folder that is not a handout is refused, and so is a generated file edited since, unless --overwrite.
  - The handout's documents speak only of its exercises.

Everything runs in this process, with the impostor search's runner (nanospec/course/impostors.py): a wrong
answer is installed by pointing the reference function at it (its code object is swapped for a one-line call, so
every module that imported the function sees the answer), and the exercise's graded tests are called directly,
gates first, stopping at the first failing gate. No pytest subprocess, no handout per answer: the file takes a
few seconds. (The search itself, over every function of each one-exercise handout: tests/test_course.py.)
"""
import inspect
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanospec.course import grade
from nanospec.course.handout import HandoutError, make_handout
from nanospec.course.impostors import compile_answer, graded_items, installed, reference_function, run_items
from nanospec.course.registry import BY_ID, EXERCISES, parse_selection

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# Wrong answers written as edits of the reference, and the score of an exercise's run


@dataclass(frozen=True)
class Edit:
    """A wrong answer written as one change to the reference itself: its source with `old` (there exactly once)
    replaced by `new`. So the gallery keeps no copy of a reference, and a reference that changes under an edit
    breaks the test instead of turning the wrong answer into a right one."""
    old: str
    new: str


def answer_source(path, function, source):
    """The source of a gallery answer: itself, or for an Edit the reference's source so edited."""
    if not isinstance(source, Edit):
        return source
    text = textwrap.dedent(inspect.getsource(reference_function(path, function)[1]))
    assert text.count(source.old) == 1, f"{function} no longer holds {source.old!r} once: update the gallery"
    return text.replace(source.old, source.new)


def score_of(ex, cases):
    return grade.score([ex], cases)[0]


# ---------------------------------------------------------------------------------------------------------
# The gallery: (exercise, region function, name, source). Written as they would stand in the reference file.

V = "nanospec/rules/verify.py"
GALLERY = [
    # exercise 3
    (3, "residual", "residual = p (the fallback drawn from the target again)", """
        def residual(p, q):
            return p.clone()
    """),
    (3, "residual", "zero mass checked over the whole batch, not row by row", """
        def residual(p, q):
            excess = (p - q).clamp(min=0)
            if excess.sum() == 0:
                return p
            return excess / excess.sum(-1, keepdim=True)
    """),
    (3, "residual", "max(0, p - q) not normalised", """
        def residual(p, q):
            return (p - q).clamp(min=0)
    """),
    (3, "residual", "norm(max(0, q - p)): the sides swapped", """
        def residual(p, q):
            excess = (q - p).clamp(min=0)
            mass = excess.sum(-1, keepdim=True)
            return torch.where(mass > 0, excess / torch.where(mass > 0, mass, 1.0), p)
    """),
    (3, "accept_prob", "accept with p(x), as if q were a point mass", """
        def accept_prob(p, q, x):
            return p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    """),
    (3, "accept_prob", "p(x) / q(x) without the cap at 1", """
        def accept_prob(p, q, x):
            p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            return torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, 1.0), (p_x > 0).to(p.dtype))
    """),
    (3, "accept_prob", "min(1, q(x) / p(x)): the ratio upside down", """
        def accept_prob(p, q, x):
            p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            return torch.where(p_x > 0, (q_x / torch.where(p_x > 0, p_x, 1.0)).clamp(max=1.0), torch.ones_like(p_x))
    """),
    # exercise 4
    (4, "verify_chain", "after a rejection, a fresh draw from p instead of the residual",
     Edit("sample(residual(p_at, q_at), generator)", "sample(p_at, generator)")),
    (4, "verify_chain", "the bonus token drawn from q's last row, not p_target[k]",
     Edit("F.pad(q_draft, (0, 0, 0, 1))",
          "torch.cat([q_draft, q_draft[..., -1:, :] if k else torch.zeros_like(p_target[..., :1, :])], dim=-2)")),
    (4, "verify_chain", "every accepted guess counted, not the prefix before the first rejection",
     Edit("accepted.long().cumprod(-1).sum(-1)", "accepted.long().sum(-1)")),
    (4, "verify_chain", "one uniform shared by every position of a chain",
     Edit("u = torch.rand(draft_tokens.shape, generator=generator, dtype=p_target.dtype, device=p_target.device)",
          "u = torch.rand(draft_tokens.shape[:-1] + (1,), generator=generator, dtype=p_target.dtype, "
          "device=p_target.device).expand(draft_tokens.shape)")),
    # exercise 8
    (8, "_descend", "a fresh draw after a mismatch (the classic bug EXERCISES.md warns about)",
     Edit("return path, y", "return path, pick(node)")),
    (8, "_descend", "one draw per child: a rejected child's mass is not removed", """
        def _descend(tokens, parents, pick):
            node, path = 0, []
            while True:
                entered = None
                for c in range(1, len(parents)):
                    if parents[c] == node and pick(node) == int(tokens[c]):
                        entered = c
                        break
                if entered is None:
                    return path, pick(node)
                node = entered
                path.append(node)
    """),
    (8, "_descend", "the last of two siblings holding y wins",
     Edit("for c in range(len(parents) - 1, 0, -1):", "for c in range(1, len(parents)):")),
    (8, "_descend", "stops after one level", """
        def _descend(tokens, parents, pick):
            y = pick(0)
            for c in range(1, len(parents)):
                if parents[c] == 0 and int(tokens[c]) == y:
                    return [c], pick(c)
            return [], y
    """),
    # exercises whose function is deterministic: a broken rule fails a gate (a docstring example, a rule
    # EXERCISES.md names, or the comparison with a slow oracle)
    (1, "lookup", "the most recent match wins over the longest",
     Edit("for n in range(min(max_ngram, len(seq) - 1), 0, -1):",
          "for n in range(1, min(max_ngram, len(seq) - 1) + 1):")),
    (1, "lookup", "no overlapping copy: the draft stops at the present",
     Edit("copy = list(seq)\n"
          "                for j in range(i + n, i + n + draft_len):"
          "  # j < len(copy) always: copying may overlap the copy\n"
          "                    copy.append(copy[j])\n"
          "                return copy[len(seq):]", "return list(seq[i + n:i + n + draft_len])")),
    (1, "lookup", "the earliest occurrence instead of the most recent",
     Edit("for i in range(len(seq) - n - 1, -1, -1):", "for i in range(0, len(seq) - n):")),
    (2, "verify_chain_greedy", "every matching guess counted, not the prefix", """
        def verify_chain_greedy(logits, draft_tokens):
            best = logits.argmax(-1).tolist()
            n = sum(int(d) == b for d, b in zip(draft_tokens, best))
            return n, best[n]
    """),
    (2, "verify_chain_greedy", "the emitted token is the argmax after the last draft, not after the last accepted", """
        def verify_chain_greedy(logits, draft_tokens):
            best = logits.argmax(-1).tolist()
            n = 0
            while n < len(draft_tokens) and int(draft_tokens[n]) == best[n]:
                n += 1
            return n, best[len(draft_tokens)]
    """),
    (2, "verify_chain_greedy", "ties go to the last maximum", """
        def verify_chain_greedy(logits, draft_tokens):
            V = logits.size(-1)
            best = (V - 1 - logits.flip(-1).argmax(-1)).tolist()
            n = 0
            while n < len(draft_tokens) and int(draft_tokens[n]) == best[n]:
                n += 1
            return n, best[n]
    """),
    (5, "KVCache.rollback", "every layer set to the length, even one that had not reached it", """
        def rollback(self, length):
            self.layer_lengths = [length] * len(self.layer_lengths)
    """),
    (5, "KVCache.compact", "the length shortened but the kept slots not moved", """
        def compact(self, keep):
            self.layer_lengths = [len(keep)] * len(self.layer_lengths)
    """),
    (5, "KVCache.compact", "keys moved, values left behind", """
        def compact(self, keep):
            keep = [int(s) for s in keep]
            src = torch.tensor(keep, dtype=torch.long, device=self.k.device)
            self.k[:, :, :, :len(keep)] = self.k[:, :, :, src]
            self.layer_lengths = [len(keep)] * len(self.layer_lengths)
    """),
    (6, "tree_mask", "a node sees its parent, not all its ancestors", """
        def tree_mask(parents, prefix_len, device="cpu"):
            N = len(parents)
            m = torch.zeros(N, prefix_len + N, dtype=torch.bool, device=device)
            m[:, :prefix_len] = True
            for i, par in enumerate(parents):
                m[i, prefix_len + i] = True
                if par >= 0:
                    m[i, prefix_len + par] = True
            return m
    """),
    (6, "tree_mask", "a node does not see itself", """
        def tree_mask(parents, prefix_len, device="cpu"):
            N = len(parents)
            m = torch.zeros(N, prefix_len + N, dtype=torch.bool, device=device)
            m[:, :prefix_len] = True
            for i in range(N):
                a = parents[i]
                while a >= 0:
                    m[i, prefix_len + a] = True
                    a = parents[a]
            return m
    """),
    (6, "tree_positions", "positions by node index, as in a chain", """
        def tree_positions(parents, prefix_len, device="cpu"):
            return torch.arange(len(parents), device=device) + prefix_len
    """),
    (7, "tree_from_paths", "paths in plain sorted order, not by depth then rank",
     Edit("for p in paths}, key=lambda p: (len(p), p))", "for p in paths})")),
    (7, "tree_from_paths", "duplicate paths kept twice",
     Edit("sorted({tuple(int(r) for r in p) for p in paths}, key",
          "sorted((tuple(int(r) for r in p) for p in paths), key")),
    (7, "medusa_tree", "a node's token from the head of its rank, not of its depth (indices swapped)", """
        def medusa_tree(root, candidates, paths):
            parents, nodes = tree_from_paths(paths)
            cand = candidates.tolist() if torch.is_tensor(candidates) else candidates
            D, K = len(cand), len(cand[0])
            tokens = [int(root)] + [cand[node[-1] % D][(len(node) - 1) % K] for node in nodes[1:]]
            return tokens, parents
    """),
    (9, "frontier_mask", "a frontier node sees itself and the prefix, not its fed ancestors",
     Edit("c = parent[c]", "c = -1")),
    (9, "frontier_mask", "the frontier not added to fed",
     Edit("fed[c] = F + i", "fed = {**fed, c: F + i}")),  # a local copy: the caller's `fed` never learns them
    (9, "frontier_mask", "the parent only, not every ancestor",
     Edit("c = parent[c]", "c = parent[c] if c == frontier[i] else -1")),
    (10, "remember", "a known n-gram is not moved to the newest place", """
        def remember(pool, key, gram, guesses):
            grams = pool.setdefault(key, [])
            if gram not in grams:
                grams.append(gram)
            del grams[:len(grams) - guesses]
    """),
    (10, "learn", "the n-gram ending at the last token is left out", """
        def learn(pool, seq, new, N, guesses):
            for j in range(max(0, len(seq) - new - N + 1), len(seq) - N):
                remember(pool, seq[j], tuple(seq[j + 1:j + N]), guesses)
    """),
    (10, "build_tree", "no trie: each n-gram its own chain",
     Edit("if (node, tok) not in trie:  # shared prefixes share nodes: each guess is checked once\n"
          "                trie[node, tok] = add(tok, node)\n            node = trie[node, tok]",
          "node = add(tok, node)")),
    (11, "group_layout", "the masks' positions start at the anchor, not after it", Edit("anchors[group] + 1 + slot])",
                                                                                      "anchors[group] + slot])")),
    (11, "group_layout", "a mask sees every mask of its group, later ones too",
     Edit("(row_group[:, None] == group[None, :]) & (slot[None, :] <= row_slot[:, None])",
          "row_group[:, None] == group[None, :]")),
    (11, "group_layout", "a group sees every real token, past its anchor too", """
        def group_layout(n_cached, n_real, anchors, k, device="cpu"):
            anchors = torch.as_tensor(anchors, dtype=torch.long, device=device)
            G, n_seen = len(anchors), n_cached + n_real
            real_pos = torch.arange(n_cached, n_seen, device=device)
            group = torch.arange(G, device=device).repeat_interleave(k)
            slot = torch.arange(k, device=device).repeat(G)
            limit = torch.cat([real_pos, torch.full((G * k,), n_seen - 1, device=device)])
            sees_real = torch.arange(n_seen, device=device)[None, :] <= limit[:, None]
            row_group = torch.cat([torch.full((n_real,), -1, device=device), group])
            row_slot = torch.cat([torch.full((n_real,), -1, device=device), slot])
            sees_mask = (row_group[:, None] == group[None, :]) & (slot[None, :] <= row_slot[:, None])
            pos = torch.cat([real_pos, anchors[group] + 1 + slot])
            return torch.cat([sees_real, sees_mask], dim=1), pos
    """),
    # exercise 13
    (13, "without_replacement_proposals", "q itself for every child (the with-replacement rule)", """
        def without_replacement_proposals(q, drawn):
            return q.unsqueeze(-2).expand(*drawn.shape, q.size(-1)).clone()
    """),
    (13, "without_replacement_proposals", "earlier draws removed but not renormalised", """
        def without_replacement_proposals(q, drawn):
            hot = torch.nn.functional.one_hot(drawn, q.size(-1)).to(q.dtype)
            before = hot.cumsum(-2) - hot
            return torch.where(before > 0, 0.0, q.unsqueeze(-2))
    """),
    (13, "without_replacement_proposals", "only the previous draw removed", """
        def without_replacement_proposals(q, drawn):
            hot = torch.nn.functional.one_hot(drawn, q.size(-1)).to(q.dtype)
            before = torch.cat([torch.zeros_like(hot[..., :1, :]), hot[..., :-1, :]], -2)
            kept = torch.where(before > 0, 0.0, q.unsqueeze(-2))
            mass = kept.sum(-1, keepdim=True)
            return kept / torch.where(mass > 0, mass, torch.ones_like(mass))
    """),
    (13, "without_replacement_proposals", "each draw also removes itself (off by one)", """
        def without_replacement_proposals(q, drawn):
            hot = torch.nn.functional.one_hot(drawn, q.size(-1)).to(q.dtype)
            kept = torch.where(hot.cumsum(-2) > 0, 0.0, q.unsqueeze(-2))
            mass = kept.sum(-1, keepdim=True)
            return kept / torch.where(mass > 0, mass, torch.ones_like(mass))
    """),
    # exercise 14
    (14, "block_acceptance", "each position's test built from the next position's weight (off by one)",
     Edit("fail = mass + 1 - w[:, :k]", "fail = mass + 1 - w[:, 1:]")),
    (14, "block_acceptance", "the token rule's residual max(p - q, 0), not the block's max(w p - q, 0)",
     Edit("excess = (w[:, :k, None] * p_target[:, :k] - q_draft)", "excess = (p_target[:, :k] - q_draft)")),
    (14, "block_acceptance", "the weight never capped at 1",
     Edit("w.append(capped_ratio(w[-1] * p_x[:, i], q_x[:, i]))",  # q(x) = 0 as capped_ratio has it, no cap
          "w.append(torch.where(q_x[:, i] > 0, w[-1] * p_x[:, i] / q_x[:, i], (w[-1] * p_x[:, i] > 0) * 1.0))")),
    (14, "block_acceptance", "h_i = w_i: the chance of reaching a prefix taken for the chance of stopping there",
     Edit("h = torch.cat([torch.where(fail > 0, mass / fail.clamp(min=1e-30), 1.0), w[:, k:]], 1)", "h = w")),
]

CORRECT = [
    (3, "accept_prob", "accept_prob with a clamp and nan_to_num", """
        def accept_prob(p, q, x):
            p_x = torch.take_along_dim(p, x[..., None], -1)[..., 0]
            q_x = torch.take_along_dim(q, x[..., None], -1)[..., 0]
            ratio = torch.nan_to_num(p_x / q_x, nan=0.0, posinf=1.0)
            return torch.clamp(ratio, max=1.0)
    """),
    (3, "residual", "residual with relu and a masked division", """
        def residual(p, q):
            left = torch.relu(p - q)
            total = left.sum(dim=-1, keepdim=True)
            nothing = total == 0
            return torch.where(nothing, p, left / total.masked_fill(nothing, 1.0))
    """),
    (4, "verify_chain", "a loop over positions, the bonus as its own case", """
        def verify_chain(p_target, q_draft, draft_tokens, generator=None):
            lead, k, V = draft_tokens.shape[:-1], draft_tokens.size(-1), p_target.size(-1)
            B = lead.numel()
            p_target, q_draft = p_target.reshape(B, k + 1, V), q_draft.reshape(B, k, V)
            draft_tokens = draft_tokens.reshape(B, k)
            u = torch.rand(B, k, generator=generator, dtype=p_target.dtype, device=p_target.device)
            a = accept_prob(p_target[:, :k], q_draft, draft_tokens)
            n = torch.zeros(B, dtype=torch.long)
            going = torch.ones(B, dtype=torch.bool)
            for j in range(k):
                going = going & (u[:, j] < a[:, j])
                n += going.long()
            rows = torch.arange(B)
            at = n.clamp(max=max(k - 1, 0))
            rejected = residual(p_target[rows, at], q_draft[rows, at]) if k else p_target[:, 0]
            dist = torch.where((n < k)[:, None], rejected, p_target[rows, n])
            return n.reshape(lead), sample(dist, generator).reshape(lead)
    """),
    (8, "_descend", "a walk over children lists", """
        def _descend(tokens, parents, pick):
            kids = [[] for _ in parents]
            for c in range(1, len(parents)):
                kids[parents[c]].append(c)
            node, path = 0, []
            while True:
                y = pick(node)
                nxt = next((c for c in kids[node] if int(tokens[c]) == y), None)
                if nxt is None:
                    return path, y
                path.append(nxt)
                node = nxt
    """),
    (13, "without_replacement_proposals", "a running mask", """
        def without_replacement_proposals(q, drawn):
            rows, left = [], q.clone()
            for j in range(drawn.size(-1)):
                mass = left.sum(-1, keepdim=True)
                rows.append(torch.where(mass > 0, left / torch.where(mass > 0, mass, 1.0), torch.zeros_like(left)))
                left = left.scatter(-1, drawn[..., j:j + 1], 0.0)
            return torch.stack(rows, -2)
    """),
    (14, "block_acceptance", "a loop over positions, the weight carried along", """
        def block_acceptance(p_target, q_draft, draft_tokens):
            B, k = draft_tokens.shape
            rows = torch.arange(B)
            h = torch.ones(B, k + 1, dtype=p_target.dtype)
            law = p_target.clone()
            w = torch.ones(B, dtype=p_target.dtype)
            for i in range(k):
                d = torch.relu(w[:, None] * p_target[:, i] - q_draft[:, i])
                r = d.sum(-1)
                denom = r + 1 - w
                h[:, i] = torch.where(denom > 0, r / torch.where(denom > 0, denom, 1.0), torch.ones_like(r))
                law[:, i] = torch.where(r[:, None] > 0, d / torch.where(r > 0, r, 1.0)[:, None], p_target[:, i])
                x = draft_tokens[:, i]
                px, qx = p_target[rows, i, x], q_draft[rows, i, x]
                w = torch.where(qx > 0, w * px / torch.where(qx > 0, qx, 1.0), (w * px > 0).to(w.dtype)).clamp(max=1)
            h[:, k] = w
            return h, law
    """),
]


def region_path(ex_id, function):
    return next(path for path, fn in BY_ID[ex_id].regions if fn == function)


@pytest.mark.parametrize("ex_id, function, name, source", GALLERY, ids=[g[2] for g in GALLERY])
def test_every_wrong_answer_in_the_gallery_scores_zero(ex_id, function, name, source):
    ex = BY_ID[ex_id]
    path = region_path(ex_id, function)
    with installed(path, function, compile_answer(path, answer_source(path, function, source))):
        cases = run_items(ex, gates_only=True)
    failed = [c.name for c in cases if c.outcome == "failed"]
    assert failed, f"exercise {ex_id}, {name}: every gate passed"
    result = score_of(ex, cases)
    assert result.score == 0 and result.status == "law failed", (name, result.score, result.status)


@pytest.mark.parametrize("ex_id, function, name, source", CORRECT, ids=[c[2] for c in CORRECT])
def test_correct_answers_in_other_words_score_full_marks(ex_id, function, name, source):
    ex = BY_ID[ex_id]
    path = region_path(ex_id, function)
    with installed(path, function, compile_answer(path, source)):
        cases = run_items(ex)
    result = score_of(ex, cases)
    assert result.score == ex.points, [f"{c.name}: {c.message}" for c in cases if c.outcome != "passed"]


# ---------------------------------------------------------------------------------------------------------
# The grader: gates and messages


def case(name, outcome="passed", message="", exercise=3):
    return grade.Case("tests/test_ex03_accept_residual.py", name, exercise, outcome, message)


def test_a_failing_gate_scores_zero_and_says_why():
    ex = BY_ID[3]
    names = [f"test_{i}" for i in range(ex.tests - len(ex.gates))] + list(ex.gates)
    cases = [case(n) for n in names]
    assert grade.score([ex], cases)[0].score == ex.points
    cases[-1] = case(names[-1], "failed", "the sampled law of one step: total variation 0.2 over the bound 0.01")
    r = grade.score([ex], cases)[0]
    assert r.score == 0 and r.status == "law failed" and r.passed == ex.tests - 1
    assert ex.gates[-1] in r.notes[0] and "0 points" in r.notes[0]
    assert "total variation 0.2" in r.notes[1]
    text = grade.table([r], "/course")
    assert "python -m pytest -m ex3 -x" in text and "(law failed)" in text
    cases[-1] = case(names[-1] + "x")  # a gate the tests do not have: the registry is wrong, never full marks
    assert grade.score([ex], cases)[0].status == "registry mismatch"


@pytest.mark.parametrize("raw, words", [
    ("AssertionError: residual row 0: expected [0.5], got [nan]\nassert False", "residual row 0: expected [0.5], got [nan]"),
    ("NotImplementedError: exercise 3: implement accept_prob in nanospec/rules/verify.py, see EXERCISES.md",
     "NotImplementedError: exercise 3: implement accept_prob in nanospec/rules/verify.py, see EXERCISES.md"),
    ("AssertionError: verify_chain: expected (2, 7),\n got (1, 9)\nassert (1, 9) == (2, 7)",
     "verify_chain: expected (2, 7), got (1, 9)"),
], ids=["assertion-with-introspection", "stub", "two-line-message"])
def test_the_grader_keeps_the_tests_words(raw, words):
    assert grade.failure_message(raw) == words


def test_every_auto_graded_exercise_has_gates_and_a_gallery_of_three():
    for ex in EXERCISES:
        if not ex.manual:
            assert ex.gates, ex.id
            assert sum(g[0] == ex.id for g in GALLERY) >= 3, ex.id
        module, items = (None, []) if ex.manual else graded_items(ex)
        names = {name.split("[")[0] for name, _, _ in items}
        assert set(ex.gates) <= names, (ex.id, set(ex.gates) - names)


# ---------------------------------------------------------------------------------------------------------
# Handouts: regeneration keeps work, bad selections are one line, documents speak of the handout only


def git(folder, *args):
    return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, check=True).stdout


def test_regenerating_over_a_git_repository_keeps_both(tmp_path):
    out = tmp_path / "h"
    make_handout(ROOT, out, parse_selection("3"))
    git(out, "init", "-q")
    git(out, "add", "-A")
    git(out, "-c", "user.email=s@example.com", "-c", "user.name=s", "commit", "-qm", "handout")
    (out / "MYNOTES.md").write_text("my notes\n")
    (out / "nanospec" / "mine.py").write_text("x = 1\n")
    head = git(out, "rev-parse", "HEAD")
    summary = make_handout(ROOT, out, parse_selection("3,8"))
    assert (out / "MYNOTES.md").read_text() == "my notes\n" and (out / "nanospec" / "mine.py").exists()
    assert git(out, "rev-parse", "HEAD") == head and (out / ".git").is_dir()
    assert summary["kept"] == 3  # .git, MYNOTES.md, nanospec/mine.py
    assert json.loads((out / "handout.json").read_text())["exercises"] == [3, 8]
    assert "exercise 8: implement _descend" in (out / "nanospec" / "rules" / "verify.py").read_text()
    # a generated file the student edited is not overwritten without --overwrite
    verify_py = out / "nanospec" / "rules" / "verify.py"
    verify_py.write_text(verify_py.read_text() + "# my work\n")
    with pytest.raises(HandoutError, match="changed since the last handout .first: nanospec/rules/verify.py"):
        make_handout(ROOT, out, parse_selection("3"))
    assert verify_py.read_text().endswith("# my work\n")
    make_handout(ROOT, out, parse_selection("3"), overwrite=True)
    assert not verify_py.read_text().endswith("# my work\n") and (out / "MYNOTES.md").exists()


def test_a_folder_that_is_not_a_handout_is_refused(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "thesis.tex").write_text("...")
    with pytest.raises(HandoutError, match="not an earlier handout"):
        make_handout(ROOT, tmp_path / "work", parse_selection("3"))
    assert os.listdir(tmp_path / "work") == ["thesis.tex"]


@pytest.mark.parametrize("selection", ["3-1", "99", "3-x"], ids=["reversed", "unknown", "not-a-number"])
def test_bad_selections_are_one_line_errors(selection, tmp_path):
    """`make handout EX=3-1` once blanked nothing and replaced the folder; `make grade EX=3-1` printed a
    traceback. Every bad selection is now one line, and nothing is written."""
    args = ["--ex", selection, "--out", str(tmp_path / "h")]
    run = subprocess.run([sys.executable, "-m", "nanospec.course.handout", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.startswith("error: ") and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()
    run = subprocess.run([sys.executable, "-m", "nanospec.course.grade", "--ex", selection, "--json", ""], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.startswith("error: ") and "Traceback" not in run.stderr


def test_the_handouts_documents_speak_only_of_its_exercises(tmp_path):
    out = tmp_path / "h"
    make_handout(ROOT, out, parse_selection("3,8"))
    exercises = (out / "EXERCISES.md").read_text()
    readme = (out / "README.md").read_text()
    headings = [line for line in exercises.splitlines() if line.startswith("## ")]
    assert [h for h in headings if h[3].isdigit()] == [line for line in headings if line[3:5] in ("3.", "8.")]
    assert "Changelog" not in exercises and "exercise 11" not in exercises and "make train" not in exercises
    assert "19 graded tests for 18 points" in exercises
    # the methods table: what each method still needs in this copy, greedy and at temperature 1
    assert "| `prompt-lookup` | nothing left to write | 3 |" in exercises
    assert "| `medusa` | 8 | nothing left to write |" in exercises
    assert "| `ar` | nothing: it runs in any handout |" in exercises
    for doc in (exercises, readme):
        assert "test_course" not in doc and "reference_ex03" not in doc and "one search away" not in doc
        assert "<!--" not in doc
    assert "python -m pytest -m ex3 -x" in readme and "make grade" in readme
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert "tests/reference_ex03.py" not in files and not [f for f in files if "test_course" in f]
    # exercise 3 not blanked: its reference copy ships, so exercise 4 is graded alone
    make_handout(ROOT, tmp_path / "h4", parse_selection("4"))
    assert (tmp_path / "h4" / "tests" / "reference_ex03.py").exists()
