"""decode.py's batches: --prompt several times, or --prompts-file with one prompt per line, and --batch-size. Each
row's text equals what decode.py prints for that prompt alone (greedy); bad input is a one-line error. The run folder
is conftest.py's `ckpt`: a byte-level tokenizer and a random tiny target."""
import json

import pytest

import decode
from toys import decode_error

ARGS = ["--device", "cpu", "--max-new-tokens", "8"]


def alone(ckpt, capsys, method, prompt):
    decode.main(["--ckpt", ckpt, *ARGS, "--method", method, "--prompt", prompt, "--json"])
    return json.loads(capsys.readouterr().out)["text"]


@pytest.mark.parametrize("method", ["ar", "prompt-lookup"])
def test_each_row_is_the_prompt_decoded_alone(ckpt, capsys, tmp_path, method):
    prompts = ["def f(x):", "import os", "class A:\\n    pass", "x = 1"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    decode.main(["--ckpt", ckpt, *ARGS, "--method", method, "--prompts-file", str(path), "--batch-size", "3"])
    out = capsys.readouterr().out
    assert out.count("=== ") == 2, out  # 4 prompts in batches of 3: two batches
    rows = [block.split("\n", 1)[1].split("\n\n===")[0] for block in out.split("--- row ")[1:]]
    for prompt, row in zip(prompts, rows):  # a row: its prompt, then its text with each forward's tokens in [ ]
        prompt = prompt.replace("\\n", "\n")
        assert row.rstrip("\n").replace("[", "").replace("]", "") == prompt + alone(ckpt, capsys, method, prompt)


def test_repeated_prompts_are_a_batch(ckpt, capsys):
    decode.main(["--ckpt", ckpt, *ARGS, "--prompt", "a = 1", "--prompt", "b = 2"])
    out = capsys.readouterr().out
    assert "--- row 1" in out and "--- row 2" in out and "batch of 2" in out


def test_a_batch_on_the_static_runtime_says_so_and_decodes_the_same(ckpt, capsys):
    rows = {}
    for runtime in ("eager", "static"):
        decode.main(["--ckpt", ckpt, *ARGS, "--method", "prompt-lookup", "--prompt", "a = 1", "--prompt", "def f(",
                     "--runtime", runtime, "--json"])
        rows[runtime] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["ids"] for r in rows["static"]] == [r["ids"] for r in rows["eager"]]
    assert {r["runtime"] for r in rows["static"]} == {"static"}


@pytest.mark.parametrize("args, match", [
    (["--prompt", "x", "--batch-size", "0"], "--batch-size must be in 1..1024, got 0"),
    (["--prompt", "x", "--batch-size", "5000"], "--batch-size must be in 1..1024, got 5000"),
    (["--prompt", "x", "--prompt", "y", "--method", "medusa"], "runs ar, speculative, prompt-lookup, not medusa"),
    (["--prompts-file", "/no/such/file"], "cannot read --prompts-file"),
    (["--prompt", "x", "--prompt", "y", "--method", "prompt-lookup", "--adaptive", "history"],
     "--adaptive is not an option of batched decoding"),
])
def test_bad_batches_are_one_line_errors(ckpt, args, match):
    assert match in decode_error(ckpt, *args)


def test_an_empty_line_or_a_long_prompt_is_named(ckpt, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a\n\nb\n", encoding="utf-8")
    assert "line 2 of" in decode_error(ckpt, "--prompts-file", str(path))
    path.write_text("a\n" + "x" * 80 + "\n", encoding="utf-8")  # 80 bytes: over the 64-token context
    message = decode_error(ckpt, "--prompts-file", str(path))
    assert f"prompt 2 (line 2 of {path}) is 80 tokens but the model's context is 64" in message
