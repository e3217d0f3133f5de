"""`ar`, the reference: its cached greedy output equals the slow no-cache argmax loop; it stops cleanly at
end-of-text and at the context limit; sampling is seeded; bad requests are one-line errors."""
import pytest

from nanospec.model.load import Models
from nanospec.decoding import METHODS, check_method
from nanospec.decoding.ar import generate_nocache
from toys import random_ids, tiny_gpt


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_nocache_argmax_loop(seed):
    model = tiny_gpt(seed)
    prompt = random_ids(1 + seed * 3, seed=seed)
    ids, stats = METHODS["ar"](Models(target=model), prompt, 20)
    assert ids == generate_nocache(model, prompt, 20)
    assert stats["new_tokens"] == 20 and stats["target_forwards"] == 20
    assert stats["accepted_per_step"] == [1] * 20 and stats["tokens_per_forward"] == 1.0


def test_stops_at_end_of_text():
    model = tiny_gpt(0)
    prompt = random_ids(4)
    full = generate_nocache(model, prompt, 20)
    eot = full[5]
    ids, stats = METHODS["ar"](Models(target=model, eot=eot), prompt, 20)
    assert ids == full[:full.index(eot)] and stats["stop"] == "eot"


def test_stops_at_context_limit_with_a_note_not_a_crash():
    model = tiny_gpt(0, block_size=16)
    ids, stats = METHODS["ar"](Models(target=model), random_ids(10), 100)
    assert len(ids) == 6 and stats["stop"] == "context"


def test_sampling_is_seeded():
    models = Models(target=tiny_gpt(0))
    a = METHODS["ar"](models, [1, 2], 30, temperature=1.0, seed=7)[0]
    b = METHODS["ar"](models, [1, 2], 30, temperature=1.0, seed=7)[0]
    c = METHODS["ar"](models, [1, 2], 30, temperature=1.0, seed=8)[0]
    assert a == b and a != c


@pytest.mark.parametrize("prompt, kwargs, message", [
    ([], {}, "empty"), (list(range(10)) * 5, {}, "context"), ([1], {"temperature": -1}, "temperature"),
    ([1], {"top_k": 0}, "top_k"), ([1], {"top_p": 1.5}, "top_p"), ([99], {}, "token ids"),
])
def test_bad_requests_are_clear_errors(prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        METHODS["ar"](Models(target=tiny_gpt(0)), prompt, 5, **kwargs)


def test_unknown_method_and_missing_part():
    models = Models(target=tiny_gpt(0))
    with pytest.raises(ValueError, match="unknown method"):
        check_method("nope", models)
