"""Every edge a user meets in decode.py (issue 33): each bad input is one line that says what to do, each edge
case gives correct output; Ctrl-C and a closed pipe go through real subprocesses and signals. The run folder is
conftest.py's `ckpt`: a byte-level tokenizer and a random tiny target (context 64) that decodes in
milliseconds."""
import io
import json
import os
import signal
import subprocess
import sys
import types

import pytest
import torch

import decode
from nanospec.device import MAX_SEED, seeded_generator
from toys import decode_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--device", "cpu", "--max-new-tokens", "4"]


def start_decode(ckpt, *args, **kwargs):
    return subprocess.Popen([sys.executable, "decode.py", "--ckpt", ckpt, *ARGS, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, **kwargs)


@pytest.fixture(scope="module")
def many_prompts(tmp_path_factory):
    """A prompts file long enough that decoding it takes seconds and prints far more than a pipe holds."""
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text("".join(f"def f{i}(x):\n" for i in range(3000)), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------------
# Ctrl-C, a closed pipe, the terminal's encoding: real processes


def test_ctrl_c_ends_with_one_line(ckpt, many_prompts):
    """Before: a KeyboardInterrupt traceback. SIGINT once the output has started: 'interrupted', status 130."""
    proc = start_decode(ckpt, "--prompts-file", many_prompts, "--batch-size", "1")
    assert proc.stdout.readline().startswith(b"--- row 1")  # it is decoding
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.decode() == "interrupted\n", err


def test_a_closed_pipe_ends_quietly(ckpt, many_prompts):
    """`decode.py ... | head -1`: before, a BrokenPipeError traceback. The reader goes away after one line."""
    proc = start_decode(ckpt, "--prompts-file", many_prompts, "--batch-size", "64")
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == b"", err


def test_text_the_terminal_cannot_encode_is_escaped(ckpt):
    """PYTHONIOENCODING=ascii and a prompt with 'é': before, a UnicodeEncodeError traceback."""
    proc = start_decode(ckpt, "--prompt", "# café", env={**os.environ, "PYTHONIOENCODING": "ascii"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.startswith(b"# caf\\xe9") and err == b"", err


# ---------------------------------------------------------------------------------------------------------
# The terminal: colour and standard input


@pytest.mark.parametrize("env, colour", [({}, True), ({"NO_COLOR": "1"}, False), ({"TERM": "dumb"}, False),
                                         ({"NO_COLOR": ""}, True)])
def test_color_auto_honours_no_color_and_dumb_terminals(monkeypatch, env, colour):
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert decode.colour_on(types.SimpleNamespace(color="auto")) is colour
    assert decode.colour_on(types.SimpleNamespace(color="always")) is True  # asked for: always


def test_reading_a_prompt_from_a_terminal_says_so(monkeypatch, capsys):
    """Before: decode.py without --prompt waited on the terminal without a word."""
    terminal = types.SimpleNamespace(isatty=lambda: True, buffer=io.BytesIO("def f(ü):".encode()))
    monkeypatch.setattr(sys, "stdin", terminal)
    assert decode.read_prompt(types.SimpleNamespace(prompt=None)) == "def f(ü):"
    assert "reading the prompt from standard input" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# One rule for flags that only matter when sampling, and seeds


@pytest.mark.parametrize("flags", [
    ["--top-k", "3"], ["--top-p", "0.9"], ["--method", "mtp", "--verify", "block"],
    ["--method", "medusa", "--verify", "traversal"], ["--method", "eagle", "--verify", "traversal"],
    ["--method", "eagle", "--verify", "traversal", "--draft-sampling", "topk"],
    ["--method", "mtp", "--draft-sampling", "sample"], ["--seed", "3"],
], ids=lambda f: " ".join(f))
def test_flags_that_only_matter_when_sampling_are_refused_at_temperature_0(ckpt, flags):
    """Before: accepted and silently ignored, while --confidence was refused (--seed too, issue 40)."""
    assert "only matters when sampling" in decode_error(ckpt, "--prompt", "x", *flags)


def test_show_tree_on_another_method_is_a_lowercase_one_line_error(ckpt):
    """Before: `eagle --show-tree` said 'Error: ...', unlike every other message."""
    assert "--show-tree is an option of medusa, not of eagle" in decode_error(ckpt, "--method", "eagle",
                                                                             "--show-tree", "--prompt", "x")


def test_the_same_flags_sample_at_temperature_1(ckpt, capsys):
    decode.main(["--ckpt", ckpt, *ARGS, "--prompt", "x", "--temperature", "1", "--seed", "1", "--top-k", "3",
                 "--top-p", "0.9", "--method", "mtp", "--verify", "block", "--draft-sampling", "sample", "--json"])
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 4


def test_a_verify_rule_for_coupled_guesses_is_a_clear_error(ckpt):
    """mtp's default guesses at t > 0 are coupled (drawn in the target's own races), which --verify's rules do not
    judge: one line that says what to do, not a run that ignores the flag."""
    with pytest.raises(SystemExit, match="coupled guesses have their own rule: leave --verify out"):
        decode.main(["--ckpt", ckpt, *ARGS, "--prompt", "x", "--temperature", "1", "--method", "mtp", "--verify",
                     "block"])


def test_the_largest_seed_samples(ckpt, capsys):
    decode.main(["--ckpt", ckpt, *ARGS, "--prompt", "x", "--temperature", "1", "--seed", str(MAX_SEED), "--json"])
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 4


def test_every_seed_is_its_own_stream():
    """The CPU generator keeps only a seed's low 32 bits: 2**32 drew what 0 draws. seeded_generator gives each
    seed in 0..2**63-1 its own stream, and keeps the streams of seeds below 2**32 as they were."""
    def draws(seed):
        return torch.rand(4, generator=seeded_generator("cpu", seed)).tolist()
    assert draws(7) == torch.rand(4, generator=torch.Generator().manual_seed(7)).tolist()
    seeds = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**63 - 2, MAX_SEED]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    assert draws(2**40) == draws(2**40)  # and the same seed, the same stream
    with pytest.raises(ValueError, match="0..2"):
        seeded_generator("cpu", -1)


def test_seeds_0_and_2_to_the_32_decode_differently(ckpt, capsys):
    """The same through a method's run (steps/run.py's new_run): before, --seed 4294967296 gave --seed 0's tokens."""
    def tokens(seed):
        decode.main(["--ckpt", ckpt, *ARGS, "--prompt", "x", "--temperature", "1", "--max-new-tokens", "12",
                     "--seed", str(seed), "--json"])
        return json.loads(capsys.readouterr().out)["ids"]
    assert tokens(0) != tokens(2**32) and tokens(2**32) == tokens(2**32)


# ---------------------------------------------------------------------------------------------------------
# Batches


def test_batches_hold_at_most_64_prompts_by_default(ckpt, capsys, tmp_path):
    """Before: every prompt in one batch (8,000 prompts tried to allocate 4.2 GB)."""
    path = tmp_path / "p.txt"
    path.write_text("".join(f"x = {i}\n" for i in range(70)), encoding="utf-8")
    decode.main(["--ckpt", ckpt, *ARGS, "--max-new-tokens", "1", "--prompts-file", str(path)])
    out = capsys.readouterr().out
    assert "batch of 64:" in out and "batch of 6:" in out and "[runtime eager]" in out


@pytest.mark.parametrize("content, message", [
    (b"a\n  \nb\n", "prompt 2 (line 2 of {path}) is only whitespace"),
    (b"a\n\nb\n", "prompt 2 (line 2 of {path}) is empty"),
    (b"a\nb\ndef f(\xff):\n", "prompt 3 (line 3 of {path}) is not UTF-8 text (byte 0xff"),
], ids=["whitespace", "empty", "not-utf8"])
def test_every_prompt_is_checked_before_loading_a_model(ckpt, tmp_path, monkeypatch, content, message):
    path = tmp_path / "p.txt"
    path.write_bytes(content)
    monkeypatch.setattr(decode, "load_models", lambda *a: pytest.fail("the models were loaded"))
    assert message.format(path=path) in decode_error(ckpt, "--prompts-file", str(path))


@pytest.mark.parametrize("prompts", [["a", "  "], ["  "]], ids=["batch", "single"])
def test_a_whitespace_prompt_is_refused_alike_everywhere(ckpt, prompts):
    """Before: decoded as a --prompt, refused as a line of a file."""
    args = [a for p in prompts for a in ("--prompt", p)]
    assert "only whitespace: give some text" in decode_error(ckpt, *args)


def test_a_non_utf8_prompt_is_refused_in_a_batch_too(ckpt):
    """Before: refused alone, decoded in a batch."""
    res = subprocess.run([sys.executable, "decode.py", "--ckpt", ckpt, *ARGS, "--prompt", "a", b"--prompt",
                          b"def f(\xff):"], cwd=ROOT, capture_output=True, timeout=120)
    err = res.stderr.decode()
    assert res.returncode == 1 and err.startswith("error: prompt 2 (--prompt) is not UTF-8") and "Traceback" not in err


def test_json_with_a_batch_prints_json_lines(ckpt, capsys):
    """Before: refused; a script had no machine-readable batch output."""
    decode.main(["--ckpt", ckpt, *ARGS, "--prompt", "a = 1", "--prompt", "b = 2", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["row"] for r in rows] == [1, 2] and [r["prompt"] for r in rows] == ["a = 1", "b = 2"]
    assert all(len(r["ids"]) == r["stats"]["new_tokens"] == 4 for r in rows)


def test_a_batch_row_stopped_by_the_context_says_so(ckpt, capsys):
    """Before: only single mode said 'stopped: the model's context is full'."""
    decode.main(["--ckpt", ckpt, *ARGS, "--max-new-tokens", "20", "--prompt", "x" * 60, "--prompt", "y"])
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("--- row 1"))
    assert first.endswith("(stopped: the model's context is full)"), first


def test_the_help_names_every_choice_of_verify(capsys, monkeypatch):
    """Before: --verify's help named only token and block (the first method's)."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width: no line breaks here
    with pytest.raises(SystemExit):
        decode.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    verify = text.split("--verify VERIFY")[-1].split("--draft-sampling")[0]  # the help, not the usage line
    assert "medusa: token|traversal|typical" in verify and "eagle, parallelspec: token|block|traversal" in verify


# ---------------------------------------------------------------------------------------------------------
# Threads, the method list, the help, and the hints (issue 40)


def test_decoding_runs_on_one_thread_unless_told(ckpt, fresh_imports):
    """A fresh interpreter (conftest.py's fresh_imports, OMP_NUM_THREADS unset) starts with torch's default, one
    thread per core; decode.py sets one (on a busy 2-core machine, 0.45 s a forward with two, 0.0035 s with one).
    --threads outside 0..cores is a one-line error."""
    assert fresh_imports["threads_before"] >= 1 and fresh_imports["threads"] == 1
    assert "--threads must be in 0.." in decode_error(ckpt, "--prompt", "x", "--threads", str(os.cpu_count() + 1))
    assert "--threads must be in 0.." in decode_error(ckpt, "--prompt", "x", "--threads", "-1")


def test_the_method_list_is_whole_sentences_and_json(capsys):
    """Before: each description cut at the docstring's first line ('... every other method must'), and --json
    printed the same text."""
    decode.main(["--method", "list"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(decode.MODULES)
    assert all(line.split(" [needs")[0].endswith(".") for line in lines), lines
    assert "one token per target forward." in lines[0] and any("[needs eagle]" in line for line in lines)
    decode.main(["--method", "list", "--json"])
    methods = json.loads(capsys.readouterr().out)["methods"]
    assert [m["name"] for m in methods] == list(decode.MODULES)
    assert next(m for m in methods if m["name"] == "speculative")["needs"] == ["draft"]


@pytest.mark.parametrize("flags", [["--temperature", "-1"], ["--prompt", "x"], ["--threads", "2"]])
def test_the_method_list_refuses_other_flags(flags):
    """Before: `--method list --temperature -1` listed the methods and returned 0."""
    with pytest.raises(SystemExit) as stop:
        decode.main(["--method", "list", *flags])
    assert stop.value.code == f"error: --method list lists the methods and takes no other flag but --json: drop {flags[0]}"


def test_the_help_states_each_default_once(capsys, monkeypatch):
    """Before: '(default 0.5) (default: speculative None, mtp None, ...)' and '(default: medusa False)'."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        decode.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "None" not in text.replace("(None =", "") and "False" not in text
    assert "(default 0.5; 0.0..1.0)" in text and "(default 0.5) (" not in text
    assert "--threads" in text and "decodes fastest on one" in text


def test_a_batch_option_of_a_method_that_has_no_batch_says_what_to_drop(ckpt):
    """Before: `--method eagle --batch-size 1 --prompt x` said 'give one prompt' when one was given."""
    assert decode_error(ckpt, "--method", "eagle", "--batch-size", "1", "--prompt", "x").endswith(
        "not eagle: drop --batch-size")
    assert decode_error(ckpt, "--method", "eagle", "--prompt", "x", "--prompt", "y").endswith(
        "not eagle: give one --prompt")


def test_a_missing_part_names_the_folder_to_train_it_into(ckpt):
    """Before: with --ckpt elsewhere the hint said `python train_tiny.py --stage draft`, which trains into out/."""
    message = decode_error(ckpt, "--method", "speculative", "--prompt", "x")
    assert f"which {ckpt} lacks: run `python train_tiny.py --stage draft --out-dir {ckpt}`" in message


def test_batched_prompt_lookup_copies_as_far_as_one_prompt_does(ckpt, capsys):
    """Before: batched prompt-lookup copied 4 tokens where its --help (and one prompt) says 10: the same tokens,
    fewer per forward. A prompt that repeats itself gives copies longer than 4. One prompt with --adaptive off: a
    batch drafts draft_len every step (the cost rule is not an option of batched decoding)."""
    prompt = "abcdefghijklmnop" * 3

    def stats(*extra):
        decode.main(["--ckpt", ckpt, "--device", "cpu", "--max-new-tokens", "24", "--method", "prompt-lookup",
                     "--prompt", prompt, "--json", *extra])
        return json.loads(capsys.readouterr().out)
    alone, batched = stats("--adaptive", "off"), stats("--batch-size", "1")
    assert batched["ids"] == alone["ids"]
    assert batched["stats"]["guesses_per_step"] == alone["stats"]["guesses_per_step"]
    assert max(alone["stats"]["guesses_per_step"]) > 4, alone["stats"]["guesses_per_step"]
