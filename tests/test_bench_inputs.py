"""The bench against bad input and broken parts (issue 21, items 4, 8 and 9; issue 19 for devices): every bad
setting is a one-line error before anything runs; a damaged optional part, or a method that fails in its
warm-up, becomes a '- skipped' line with its reason while the rest is benched; --quick does not override a
flag given explicitly; the forward-cost timing makes every tensor and generator on the model's device."""
import shutil

import pytest
import torch

from nanospec.bench import compare as bench
from nanospec.device import THREADS_HELP
from nanospec.model.load import load_models
from toys import PROMPTS


def quick(ckpt, out, *flags):
    """A small quick bench: greedy, one prompt per category, a few tokens."""
    return bench.main(["--quick", "--ckpt", str(ckpt), "--prompts", PROMPTS, "--device", "cpu",
                       "--temperatures", "0", "--prompts-per-category", "1", "--max-new-tokens", "8",
                       "--out", str(out), *flags])


# ----------------------------------------------------------------------------- item 4: a broken part, a broken method

def test_a_damaged_optional_part_is_a_skipped_row(toy_out, tmp_path):
    ckpt = tmp_path / "out"
    shutil.copytree(toy_out, ckpt)
    eagle = ckpt / "eagle.pt"
    eagle.write_bytes(eagle.read_bytes()[:1000])  # `head -c 1000 out/eagle.pt`
    got = quick(ckpt, tmp_path / "r.md", "--methods", "eagle,jacobi,speculative")
    skipped = [line for line in got["skipped"] if line.startswith("- skipped eagle:")]
    assert len(skipped) == 1 and "eagle.pt" in skipped[0] and "\n" not in skipped[0], got["skipped"]
    assert {"ar", "jacobi", "speculative"} <= set(got["summaries"][0.0]) and "eagle" not in got["summaries"][0.0]
    assert skipped[0] in got["report"]


def test_another_part_copied_over_target_pt_is_a_one_line_error(toy_out, tmp_path):
    ckpt = tmp_path / "out"
    shutil.copytree(toy_out, ckpt)
    shutil.copy(ckpt / "eagle.pt", ckpt / "target.pt")
    with pytest.raises(SystemExit) as e:
        quick(ckpt, tmp_path / "r.md")
    message = str(e.value.code)
    assert message.startswith(f"error: {ckpt / 'target.pt'}") and "not the target" in message and "\n" not in message


def test_a_method_that_fails_in_its_warm_up_is_a_skipped_row(toy_out, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Expected all tensors to be on the same device\nsecond line")
    monkeypatch.setitem(bench.METHODS, "jacobi", broken)
    got = quick(toy_out, tmp_path / "r.md", "--methods", "jacobi,prompt-lookup")
    assert "- skipped jacobi: failed in its warm-up at temperature 0: RuntimeError: Expected all tensors to be on " \
           "the same device" in got["skipped"]
    assert set(got["summaries"][0.0]) == {"ar", "prompt-lookup"} and not got["failed"]


def test_ar_failing_in_its_warm_up_is_a_one_line_error(toy_out, tmp_path, monkeypatch):
    monkeypatch.setitem(bench.METHODS, "ar", lambda *a, **k: 1 / 0)
    with pytest.raises(SystemExit) as e:
        quick(toy_out, tmp_path / "r.md", "--methods", "jacobi")
    assert str(e.value.code) == "error: ar, the baseline, fails: ZeroDivisionError: division by zero"


# ----------------------------------------------------------------------------- item 8: one-line errors

@pytest.mark.parametrize("flags, message", [
    (["--temperatures", "-1"], "--temperatures: each must be a finite number >= 0"),
    (["--temperatures", "0,nan"], "--temperatures: each must be a finite number >= 0"),
    (["--temperatures", "x"], "--temperatures: 'x' is not a number"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--prompts-per-category", "0"], "--prompts-per-category must be at least 1 (or -1 = all)"),
    (["--threads", "-1"], "--threads must be in 0.."),  # decode.py's check (device.set_threads)
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
])
def test_bad_settings_are_one_line_errors(toy_out, tmp_path, flags, message):
    out = tmp_path / "r.md"
    with pytest.raises(SystemExit) as e:
        bench.main(["--ckpt", str(toy_out), "--prompts", PROMPTS, "--device", "cpu", "--out", str(out), *flags])
    assert str(e.value.code).startswith(f"error: {message}") and "\n" not in str(e.value.code)
    assert not out.exists()


def test_threads_is_decode_pys_flag_with_one_thread_by_default(capsys):
    """The bench takes --threads as decode.py does (device.add_threads_flag): the same help, one thread unless told."""
    import decode
    assert bench.parse_args([]).threads == 1 == decode.parse_args([])[0].threads
    assert bench.parse_args(["--threads", "0"]).threads == 0  # torch's default, one per core
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    assert " ".join(THREADS_HELP.split()) in " ".join(capsys.readouterr().out.split())


def test_out_in_a_missing_folder_is_refused_before_the_bench_runs(toy_out, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "load_parts", lambda *a: pytest.fail("the models were loaded"))
    with pytest.raises(SystemExit) as e:
        quick(toy_out, tmp_path / "missing" / "r.md")
    assert str(e.value.code).startswith("error: --out ") and "does not exist" in str(e.value.code)


# ----------------------------------------------------------------------------- item 9: --quick and explicit flags

def test_an_explicit_flag_wins_over_quick_and_the_settings_are_printed(toy_out, tmp_path, capsys):
    got = bench.main(["--quick", "--max-new-tokens", "5", "--ckpt", str(toy_out), "--prompts", PROMPTS,
                      "--device", "cpu", "--methods", "ar", "--temperatures", "0", "--out", str(tmp_path / "r.md")])
    assert "- settings: 5 new tokens per prompt" in got["report"]
    assert all(r["stats"]["new_tokens"] <= 5 for r in got_runs(got))
    err = capsys.readouterr().err
    assert "settings: 6 prompts (2 per category), 5 new tokens" in err  # --quick's 2 per category, the flag's 5
    assert bench.parse_args(["--quick"]).max_new_tokens == 16 and bench.parse_args([]).max_new_tokens == 64


def got_runs(got):
    return [r for by_prompt in got["results"][0.0].values() for r in by_prompt.values()]


# ----------------------------------------------------------------------------- issue 19: the model's device

def test_forward_costs_make_every_tensor_and_generator_on_the_models_device(toy_out, monkeypatch):
    """A tensor made without naming the device lands on `meta` here and fails the first operation that mixes it
    with the model's; a generator made without a device is caught by the spy (a CPU generator cannot sample
    CUDA probabilities: the crash of `python -m nanospec.bench --device cuda`)."""
    models = load_models(str(toy_out), "cpu")
    made, real = [], torch.Generator

    def spy(*args, **kwargs):
        made.append(kwargs.get("device", args[0] if args else None))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "Generator", spy)
    torch.set_default_device("meta")
    try:
        cost, step, _, _, _ = bench.forward_costs(models, ["ar", "speculative"], [0.0, 1.0], quick=True)
    finally:
        torch.set_default_device(None)
    assert sorted(cost) == list(range(1, 9)) and (True, 1.0) in step and (False, None) not in step
    assert made and all(str(d) == "cpu" for d in made), made
