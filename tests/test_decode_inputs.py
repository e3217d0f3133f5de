"""Bad input to decode.py and the methods: a one-line error that says what to do, never a traceback, a hang, a huge
allocation or silent garbage. Each test here failed before its fix (issue 21).

The run folder is built in the test: a byte-level tokenizer (the 256 single bytes, no merges) and a random tiny
target, so decode.py runs end to end in well under a second."""
import io
import json
import os
import sys
import types

import pytest
import torch

import decode
from nanospec.decoding import METHODS
from toys import decode_error, every_part


@pytest.fixture(scope="module")
def models():
    """Every part every method can use, tiny and random, on the CPU (context 48)."""
    return every_part(block_size=48)


def test_the_run_folder_decodes(ckpt, capsys):
    decode.main(["--ckpt", ckpt, "--device", "cpu", "--max-new-tokens", "4", "--prompt", "def f(", "--json"])
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 4


# ---------------------------------------------------------------------------------------------------------
# --runtime: the speed layer, chosen once in decode.py (runtime.prepare); the method cannot tell


@pytest.mark.parametrize("method", ["ar", "mtp", "medusa", "prompt-lookup", "jacobi", "lookahead"])
@pytest.mark.parametrize("sampling", [[], ["--temperature", "1", "--seed", "3"]], ids=["greedy", "seeded"])
def test_runtime_static_gives_the_eager_tokens(ckpt, capsys, method, sampling):
    """Greedy and seeded sampling alike: the same code and the same RNG on both paths, so the same tokens. (With
    --adaptive off: the cost rule prices each path's steps with that path's own step times, so sampled, the two
    may choose other draft lengths, and draw the same law by other draws.)"""
    runs = {}
    fixed = ["--adaptive", "off"] if method != "ar" else []
    for runtime in ("eager", "static"):
        decode.main(["--ckpt", ckpt, "--device", "cpu", "--max-new-tokens", "12", "--prompt", "def f(x):",
                     "--method", method, "--json", "--runtime", runtime, *sampling, *fixed])
        runs[runtime] = json.loads(capsys.readouterr().out)
        assert runs[runtime]["runtime"] == runtime  # the path taken, at the top level of the JSON object
    ids, stop = runs["eager"]["ids"], runs["eager"]["stats"]["stop"]  # all 12 tokens, or fewer up to end-of-text
    assert runs["static"]["ids"] == ids and (len(ids) == 12 or (len(ids) >= 4 and stop == "eot"))


def test_bad_runtime_is_refused_by_argparse(ckpt, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--ckpt", ckpt, "--device", "cpu", "--prompt", "x", "--runtime", "graph"])
    assert exit_info.value.code == 2  # argparse's usage error, before any model is loaded
    err = capsys.readouterr().err
    assert "argument --runtime: invalid choice: 'graph'" in err.strip().splitlines()[-1] and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------
# lookahead: bounded options, and a tree that must fit in the context (the cache is context + one tree)


@pytest.mark.parametrize("flag, value", [("--ngram", "40"), ("--window", "100"), ("--guesses", "100")])
def test_lookahead_flags_are_bounded(ckpt, flag, value):
    """Before: --ngram 1000000 asked for gigabytes. Each bound is declared once, with the option."""
    assert "must be in" in decode_error(ckpt, "--method", "lookahead", "--prompt", "def f(", flag, value)


def test_lookahead_tree_must_fit_the_context(ckpt):
    """Within every bound, a tree larger than the context is still refused: no setting allocates more than
    twice the model's context (prefix + one tree)."""
    message = decode_error(ckpt, "--method", "lookahead", "--prompt", "def f(", "--window", "30", "--ngram", "4",
                           "--guesses", "0")  # 1 + 29 + 60 = 90 tokens per forward, context 64
    assert "exceeds the model's context of 64" in message


def test_lookahead_tree_larger_than_the_context_is_refused(models):
    """The same check in generate, which every caller goes through; a tree of exactly the context is fine."""
    METHODS["lookahead"](models, [1, 2, 3], 5, window=10, ngram=5, guesses=2)  # 1 + 9 + 30 + 8 = 48
    block = models.target.config.block_size  # 48
    with pytest.raises(ValueError, match="exceeds the model's context of 48"):
        METHODS["lookahead"](models, [1, 2, 3], 5, window=10, ngram=5, guesses=3)  # 1 + 9 + 30 + 12 = 52
    from nanospec.decoding.lookahead import OPTIONS, tree_size
    largest = tree_size(*(OPTIONS[name].high for name in ("window", "ngram", "guesses")))
    assert largest > block  # the bounds alone would not keep the cache small: the context check does


# ---------------------------------------------------------------------------------------------------------
# Sampling settings: every method, and decode.py before it loads anything


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 1e-40, -1.0])
@pytest.mark.parametrize("method", METHODS)
def test_bad_temperature_is_a_clear_error_in_every_method(models, method, temperature):
    """Before: nan and 1e-40 gave tracebacks, inf sampled uniform noise."""
    with pytest.raises(ValueError, match="temperature"):
        METHODS[method](models, [1, 2, 3], 5, temperature=temperature, seed=0)


@pytest.mark.parametrize("value", ["nan", "inf", "1e-40"])
def test_bad_temperature_in_decode(ckpt, value):
    assert "temperature" in decode_error(ckpt, "--prompt", "x", "--temperature", value)


def test_smallest_temperature_samples(models):
    """The documented floor, 1e-4, still samples (and is all but greedy)."""
    ids, _ = METHODS["ar"](models, [1, 2, 3], 5, temperature=1e-4, seed=0)
    assert ids == METHODS["ar"](models, [1, 2, 3], 5)[0]


# ---------------------------------------------------------------------------------------------------------
# Device, prompt bytes, options that only make sense together


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda:0", "cuda", "cuda:1"])
def test_missing_cuda_device_is_one_line(ckpt, device):
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--ckpt", ckpt, "--device", device, "--prompt", "x"])
    assert "no CUDA GPU" in exit_info.value.code and "\n" not in exit_info.value.code


def run_decode(ckpt, monkeypatch, capfd, *args, stdin=None):
    """decode.py's main in this process, as `python decode.py ...` with `stdin` (bytes) piped in runs it: its
    output, and its exit message or None. (The real process with a non-UTF-8 argument: test_edges_decode.py.)"""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO(stdin)))
    try:
        decode.main(["--ckpt", ckpt, "--device", "cpu", "--max-new-tokens", "3", *args])
        message = None
    except SystemExit as e:
        message = e.code
    out, err = capfd.readouterr()
    assert err == "", err
    return out, message


@pytest.mark.parametrize("where", ["stdin", "argv"])
def test_non_utf8_prompt_is_a_clear_error(ckpt, monkeypatch, capfd, where):
    """Before: the bad byte became U+FFFD (or a lone surrogate) without a word. A byte that is not UTF-8 reaches
    decode.py's argv as Python decodes every argument, a surrogate escape: b"\\xff" is "\\udcff"."""
    prompt = b"def f(\xff):"
    if where == "stdin":
        _, message = run_decode(ckpt, monkeypatch, capfd, stdin=prompt)
    else:
        _, message = run_decode(ckpt, monkeypatch, capfd, "--prompt", os.fsdecode(prompt))
    assert message.startswith("error: ") and "\n" not in message, message
    assert "not UTF-8" in message and "0xff" in message, message


def test_utf8_prompt_from_stdin_still_works(ckpt, monkeypatch, capfd):
    out, message = run_decode(ckpt, monkeypatch, capfd, "--json", stdin="def f(ü):".encode())
    assert message is None and json.loads(out)["prompt"] == "def f(ü):"


def test_confidence_needs_adaptive_confidence(ckpt, models):
    """Before: --confidence without --adaptive confidence was silently ignored."""
    assert "--adaptive confidence" in decode_error(ckpt, "--method", "early-exit", "--prompt", "x", "--confidence", "0.3")
    for method in ("speculative", "early-exit", "mtp", "parallelspec"):
        with pytest.raises(ValueError, match="--adaptive confidence"):
            METHODS[method](models, [1, 2, 3], 5, confidence=0.3, adaptive="history")
    METHODS["early-exit"](models, [1, 2, 3], 5, confidence=0.3, adaptive="confidence")  # together: fine


def test_show_tree_with_json_is_refused(ckpt):
    """Before: the tree went to stdout ahead of the JSON object, so stdout was not JSON."""
    assert "--show-tree" in decode_error(ckpt, "--method", "medusa", "--prompt", "x", "--show-tree", "--json")


def test_unknown_option_of_a_method_is_a_clear_error(models):
    with pytest.raises(ValueError, match="unknown option"):
        METHODS["jacobi"](models, [1, 2, 3], 5, blocks=4)


def test_lone_surrogate_prompt_is_a_clear_error(ckpt):
    assert "lone surrogate" in decode_error(ckpt, "--prompt", "def f(\ud800):")


@pytest.mark.parametrize("seed", [str(2**64), str(2**63), "-1", str(2**64 - 1)])
def test_seed_outside_0_to_2_63_is_a_clear_error(ckpt, seed):
    """Before: "Overflow when unpacking long long", a traceback; then -1 ran as 2**64-1 (issue 33)."""
    assert "--seed must be in 0..2**63-1" in decode_error(ckpt, "--prompt", "x", "--seed", seed)
