"""Exercise 1 (EXERCISES.md): `lookup` in nanospec/decoding/prompt_lookup.py, the n-gram search that drafts
by copying the context. Literal cases, each one rule of the search, then a property every answer must have.
The literal cases and the property are gates (nanospec/course/registry.py): one fails, the exercise scores zero.
Run: python -m pytest -m ex1 -x"""
import random

import pytest

from nanospec.decoding.prompt_lookup import lookup

pytestmark = pytest.mark.ex1


@pytest.mark.parametrize("seq, max_ngram, draft_len, expected", [
    # the docstring's example: the tail [1, 2, 3] occurred at index 1, followed by 9 4 1 2
    ([7, 1, 2, 3, 9, 4, 1, 2, 3], 3, 4, [9, 4, 1, 2]),
    # the match ends where the tail begins: the copy runs on into what it has just copied
    ([5, 6, 5, 6], 2, 4, [5, 6, 5, 6]),
    # a match whose continuation reaches the end of the sequence keeps copying the copy
    ([1, 2, 3, 1, 2], 2, 5, [3, 1, 2, 3, 1]),
    # two earlier matches of [1, 2]: the most recent one wins
    ([1, 2, 5, 1, 2, 6, 1, 2], 2, 1, [6]),
    # the longest tail first: [3, 1, 2] matched at index 0 beats the more recent [1, 2] at index 5
    ([3, 1, 2, 5, 4, 1, 2, 6, 3, 1, 2], 3, 1, [5]),
    # a long match, a short draft: exactly draft_len tokens
    ([1, 2, 3, 4, 5, 1, 2], 2, 2, [3, 4]),
    # max_ngram longer than anything earlier: fall back to the tail that fits ([2] at index 0)
    ([2, 2], 5, 3, [2, 2, 2]),
    # nothing earlier matches the last token, or there is nothing earlier at all, or no room: no guesses
    ([1, 2, 3, 4], 3, 5, []),
], ids=["docstring", "copy-runs-on", "copy-the-copy", "most-recent-wins", "longest-tail-wins", "exactly-draft_len",
        "fall-back-to-a-shorter-tail", "no-match"])
def test_lookup_literal(seq, max_ngram, draft_len, expected):
    got = lookup(seq, max_ngram, draft_len)
    assert got == expected, f"lookup({seq}, max_ngram={max_ngram}, draft_len={draft_len}): expected {expected}, got {got}"


def test_no_guesses_for_a_one_token_context_or_no_room():
    assert lookup([4], 3, 5) == [], f"lookup([4], 3, 5): one token, nothing earlier: expected [], got {lookup([4], 3, 5)}"
    got = lookup([5, 6, 5, 6], 2, 0)
    assert got == [], f"lookup([5, 6, 5, 6], 2, draft_len=0): no room, expected [], got {got}"


def test_every_answer_is_a_copy_of_an_earlier_continuation():
    """On random sequences over 4 tokens: the draft is empty exactly when the last token never occurred
    before; otherwise it has draft_len tokens, and some n-gram ending the sequence (n <= max_ngram) occurs
    earlier, at i, such that the sequence followed by the draft continues from i with the draft."""
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        max_ngram, draft_len = rng.randrange(1, 5), rng.randrange(1, 6)
        draft = lookup(seq, max_ngram, draft_len)
        case = f"lookup({seq}, max_ngram={max_ngram}, draft_len={draft_len}) = {draft}"
        assert (draft == []) == (seq[-1] not in seq[:-1]), \
            f"{case}: the draft must be empty exactly when the last token never occurred before"
        if not draft:
            continue
        assert len(draft) == draft_len, f"{case}: a match must give draft_len = {draft_len} tokens, got {len(draft)}"
        full = seq + draft
        assert any(seq[i:i + n] == seq[-n:] and full[i + n:i + n + draft_len] == draft
                   for n in range(1, max_ngram + 1) for i in range(len(seq) - n)), \
            f"{case}: the draft is not what followed any earlier occurrence of a tail (copying on into the copy)"
