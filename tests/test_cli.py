"""The two commands users run, end to end on a toy model trained in seconds: train_tiny.py (stages, resume,
atomic checkpoints, clear errors) and decode.py (grouped output, --json, one-line errors).

Most of decode.py's runs call its main here (`as_a_command`), as `python decode.py ARGS` would: a fresh
interpreter costs seconds of importing torch and proves nothing more, since a `sys.exit("error: ...")` is exactly
what Python prints as that one line with status 1. What only a process shows runs in one: the modules a fresh
interpreter imports, a missing checkpoint's one line and status, SIGTERM mid-training."""
import ast
import io
import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import decode
import train_tiny
from nanospec.model import checkpoint
from nanospec.model.checkpoint import CheckpointError, load_checkpoint
from nanospec.model.load import load_models
from nanospec.decoding.ar import generate_nocache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy run folder: corpus from a few stdlib-like files, tokenizer, target and draft, ~5 s."""
    base = tmp_path_factory.mktemp("toy")
    src = base / "src"
    src.mkdir()
    for i in range(12):
        body = "".join(f"    x{j} = f(x{j - 1}, {i})  # step {j}\n" for j in range(1, 30))
        (src / f"m{i:02d}.py").write_text(f'def run_{i}(x0):\n    """Run {i} steps."""\n{body}    return x29\n')
    args = ["--preset", "toy", "--corpus", str(src), "--data-dir", str(base / "data"), "--out-dir", str(base / "out"),
            "--max-iters", "6"]
    train_tiny.main(args)
    return base, args


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, input=stdin, timeout=120)


def as_a_command(main, script, args, capfd, monkeypatch, stdin=None):
    """`python SCRIPT ARGS` (stdin: bytes piped in) run as main(ARGS) in this process: what the process would give,
    as subprocess.run's result. A SystemExit with a message is the line Python prints and status 1; argparse
    names the program after sys.argv[0], as the interpreter sets it. Anything else raised fails the test."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO(stdin)))
    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    if isinstance(code, str):
        err, code = err + code + "\n", 1
    return subprocess.CompletedProcess([script, *args], code or 0, out, err)


def test_train_writes_complete_checkpoints_and_skips_them(toy, capsys):
    base, args = toy
    for part in ("target", "draft"):
        ckpt = load_checkpoint(str(base / "out" / f"{part}.pt"))
        assert ckpt["done"] and ckpt["step"] == 6
    train_tiny.main(args)  # everything exists: nothing retrains
    assert "complete, skipping" in capsys.readouterr().out


def test_train_resumes_from_an_unfinished_checkpoint(toy, capsys):
    base, args = toy
    path = base / "out" / "draft.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["done"], ckpt["step"] = False, 3  # as if stopped at step 3
    checkpoint.save_atomic(ckpt, path)  # (with a new checksum: a file edited without one is refused as damaged)
    train_tiny.main(args + ["--stage", "draft"])
    out = capsys.readouterr().out
    assert "resuming from" in out and "at step 3" in out
    assert load_checkpoint(str(path))["step"] == 6


def test_corrupt_and_mismatched_checkpoints_are_clear_errors(toy, tmp_path):
    base, _ = toy
    bad = tmp_path / "target.pt"
    bad.write_bytes(open(base / "out" / "target.pt", "rb").read()[:1000])  # truncated mid-write
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(str(bad))
    with pytest.raises(CheckpointError, match="different tokenizer"):
        load_checkpoint(str(base / "out" / "target.pt"), tokenizer_identity="0" * 64)
    with pytest.raises(CheckpointError, match="make train"):
        load_checkpoint(str(tmp_path / "missing.pt"))


def test_decode_ar_matches_the_nocache_loop_and_prints_json(toy, capfd, monkeypatch):
    base, _ = toy
    res = as_a_command(decode.main, "decode.py", ["--ckpt", str(base / "out"), "--method", "ar", "--prompt",
                                                  "def run_3(x0):", "--max-new-tokens", "12", "--json", "--device",
                                                  "cpu"], capfd, monkeypatch)
    assert res.returncode == 0, res.stderr
    obj = json.loads(res.stdout)
    assert set(obj) == {"method", "prompt", "ids", "text", "runtime", "stats"}
    assert obj["runtime"] == "eager" and "runtime" not in obj["stats"]  # --runtime auto on a CPU: plain PyTorch
    for key in ("new_tokens", "target_forwards", "tokens_per_forward", "accepted_per_step", "wall_time"):
        assert key in obj["stats"]
    models = load_models(str(base / "out"))
    prompt_ids = models.tokenizer.encode("def run_3(x0):")
    expect = generate_nocache(models.target, prompt_ids, 12)
    assert obj["ids"] == [t for t in expect[:len(obj["ids"])]] and obj["text"] == models.tokenizer.decode(obj["ids"])


def test_decode_groups_tokens_by_forward_in_brackets(toy, capsys):
    base, _ = toy
    decode.main(["--ckpt", str(base / "out"), "--prompt", "def run_3(x0):", "--max-new-tokens", "5", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("def run_3(x0):[") and "tokens/forward" in out
    assert out.rstrip().endswith("[runtime eager]")  # the path the forwards took, on the summary line


def test_decode_says_when_no_draft_pays(toy, tmp_path, capsys, monkeypatch):
    """A method whose cost rule finds no draft that pays runs `ar`'s steps, and the summary line says why."""
    import shutil
    from nanospec.bench import calibration
    base, _ = toy
    shutil.copytree(base / "out", tmp_path / "out")  # the calibration.json written below is this test's own
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: {"seconds": {0: 1.0, 1: 11.0}, "chances": [0.5]})
    args = ["--ckpt", str(tmp_path / "out"), "--method", "jacobi", "--prompt", "def run_3(x0):", "--max-new-tokens",
            "6", "--device", "cpu", "--temperature", "1", "--seed", "0"]
    decode.main(args)
    assert "[no draft pays here: `ar`'s plain steps; --adaptive off drafts anyway]" in capsys.readouterr().out
    decode.main(args + ["--adaptive", "off"])
    assert "no draft pays" not in capsys.readouterr().out


@pytest.mark.parametrize("method", ["ar", "speculative"])
def test_decode_runtime_static_gives_the_eager_greedy_text(toy, capsys, method):
    """--runtime wraps the models once (runtime.prepare); the method cannot tell, so greedy text is the same."""
    base, _ = toy
    objs = {}
    for runtime in ("eager", "static"):
        decode.main(["--ckpt", str(base / "out"), "--method", method, "--prompt", "def run_3(x0):",
                     "--max-new-tokens", "16", "--json", "--device", "cpu", "--runtime", runtime])
        objs[runtime] = json.loads(capsys.readouterr().out)
    assert objs["eager"]["runtime"] == "eager" and objs["static"]["runtime"] == "static"
    assert objs["static"]["ids"] == objs["eager"]["ids"] and objs["static"]["text"] == objs["eager"]["text"]
    assert len(objs["eager"]["ids"]) == 16


def test_bad_runtime_is_a_one_line_error(toy, capfd, monkeypatch):
    base, _ = toy
    res = as_a_command(decode.main, "decode.py", ["--ckpt", str(base / "out"), "--prompt", "def f(", "--runtime",
                                                  "fast"], capfd, monkeypatch)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    # argparse's choices error: the usage, then one line that says what was wrong and what is allowed
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("decode.py: error: argument --runtime: invalid choice: 'fast'")
    assert all(runtime in last for runtime in ("auto", "eager", "static")), last


TRAINING_MODULES = ("nanospec.training.corpus", "nanospec.training.trainer", "nanospec.training.pipeline", "nanospec.training.drafters",
                    "nanospec.training.drafter_losses", "nanospec.training.muon")


def test_decode_ar_imports_no_training_code(fresh_imports):
    """Decoding needs the models and the methods, not the corpus builder, the trainer or the losses: a fresh
    interpreter runs `decode.py --method ar` and none of those modules may have been imported (conftest.py's
    fresh_imports)."""
    assert "nanospec.model.load" in fresh_imports["decode"]  # the check sees our modules
    training = sorted(set(TRAINING_MODULES) & set(fresh_imports["decode"]))
    assert training == [], f"training code imported: {training}"


def test_the_methods_hold_no_clock_and_no_speed_layer(fresh_imports):
    """Timing and speed are layers around the methods (docs/design.md): no file of nanospec/decoding imports
    `time`, the probes, the runtime or the graphs, and importing every method loads none of those modules."""
    banned = {"time", "nanospec.bench.timing", "nanospec.fast.runtime", "nanospec.fast.graphs"}
    for path in sorted(pathlib.Path(ROOT, "nanospec", "decoding").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            assert not banned & set(names), f"{path.name} imports {sorted(banned & set(names))}"
    assert "nanospec.decoding.speculative" in fresh_imports["methods"]  # the check sees the methods
    speed = sorted({"nanospec.bench.timing", "nanospec.fast.runtime", "nanospec.fast.graphs"} & set(fresh_imports["methods"]))
    assert speed == [], f"importing the methods loaded {speed}"


def test_stdin_prompt(toy, capfd, monkeypatch):
    base, _ = toy
    res = as_a_command(decode.main, "decode.py", ["--ckpt", str(base / "out"), "--max-new-tokens", "3", "--json"],
                       capfd, monkeypatch, stdin=b"def f(")
    assert res.returncode == 0 and json.loads(res.stdout)["prompt"] == "def f("


@pytest.mark.parametrize("extra, message", [
    (["--method", "nope"], "unknown method"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "x " * 200], "context"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
    (["--method", "medusa", "--tree", "0;1;70"], "at most 256 paths with ranks up to 63"),
    (["--method", "mtp", "--temperature", "1", "--draft-sampling", "beam"], "draft_sampling must be one of"),
])
def test_bad_input_is_a_one_line_error(toy, capfd, monkeypatch, extra, message):
    base, _ = toy
    res = as_a_command(decode.main, "decode.py", ["--ckpt", str(base / "out"), "--prompt", "def f(", *extra],
                       capfd, monkeypatch)
    assert res.returncode != 0 and message in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr


def test_missing_checkpoint_says_run_make_train(tmp_path):
    """A real process, the one of this file's one-line errors: one line on stderr, nothing on stdout, status 1."""
    res = run_cli("decode.py", "--ckpt", str(tmp_path), "--prompt", "x")
    assert res.returncode == 1 and "make train" in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and res.stdout == "", res.stderr


def test_decode_loads_only_the_parts_its_method_uses(toy, tmp_path, capfd, monkeypatch):
    """A broken drafter file stops only the method that needs it, with a one-line error naming the file."""
    base, _ = toy
    out = tmp_path / "out"
    out.mkdir()
    for name in ("tokenizer.tiktoken", "target.pt", "draft.pt"):
        (out / name).write_bytes((base / "out" / name).read_bytes())
    (out / "eagle.pt").write_bytes((base / "out" / "draft.pt").read_bytes()[:500])  # truncated mid-write
    res = as_a_command(decode.main, "decode.py", ["--ckpt", str(out), "--method", "ar", "--prompt", "def f(",
                                                  "--max-new-tokens", "3"], capfd, monkeypatch)
    assert res.returncode == 0, res.stderr
    res = as_a_command(decode.main, "decode.py", ["--ckpt", str(out), "--method", "eagle", "--prompt", "def f(",
                                                  "--max-new-tokens", "3"], capfd, monkeypatch)
    assert res.returncode != 0 and "eagle.pt is not a readable checkpoint" in res.stderr
    assert res.stderr.strip().count("\n") == 0
    models = load_models(str(out), parts=["draft"])
    assert models.draft is not None and models.eagle is None
    with pytest.raises(ValueError, match="unknown model part"):
        load_models(str(out), parts=["drafty"])


def test_method_list(capfd, monkeypatch):
    res = as_a_command(decode.main, "decode.py", ["--method", "list"], capfd, monkeypatch)
    assert res.returncode == 0 and res.stdout.startswith("ar")


def test_a_crash_while_saving_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    from nanospec.model import checkpoint
    path = str(tmp_path / "x.pt")
    checkpoint.save_atomic({"config": {}, "model": {}, "step": 1}, path)

    def dies_mid_write(obj, f):
        open(f, "wb").write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint.torch, "save", dies_mid_write)
    with pytest.raises(OSError):
        checkpoint.save_atomic({"config": {}, "model": {}, "step": 2}, path)
    assert load_checkpoint(path)["step"] == 1


def test_sigterm_mid_training_saves_a_checkpoint_that_resumes(toy, tmp_path):
    import signal
    import time
    base, _ = toy
    out = tmp_path / "out"
    args = [sys.executable, "train_tiny.py", "--preset", "toy", "--stage", "target", "--data-dir", str(base / "data"),
            "--out-dir", str(out), "--max-iters", "100000"]
    out.mkdir()
    for f in ("tokenizer.tiktoken", "tokenizer.vocab"):
        (out / f).write_bytes((base / "out" / f).read_bytes())
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while not (out / "target.pt").exists() and time.time() < deadline:  # the first checkpoint (step 15)
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[0]
    assert "interrupted" in log, log
    ckpt = load_checkpoint(str(out / "target.pt"))
    assert not ckpt["done"] and ckpt["step"] > 0
    res = subprocess.run(args[:-1] + [str(ckpt["step"] + 2)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert f"resuming from {out / 'target.pt'} at step {ckpt['step']}" in res.stdout, res.stdout + res.stderr
    assert load_checkpoint(str(out / "target.pt"))["done"]


def test_precision_flag_chooses_the_autocast_dtype(capfd, monkeypatch):
    from nanospec.training.trainer import autocast_dtype, fast_bf16
    assert autocast_dtype("cpu", "fp32") is None  # the reference, on every machine
    assert autocast_dtype("cpu", "bf16") is torch.bfloat16
    assert autocast_dtype("cpu", "auto") is (torch.bfloat16 if fast_bf16("cpu") else None)
    with pytest.raises(ValueError, match="precision must be one of"):
        autocast_dtype("cpu", "fp8")
    r = as_a_command(train_tiny.main, "train_tiny.py", ["--precision", "fp8"], capfd, monkeypatch)
    assert r.returncode != 0 and "invalid choice: 'fp8'" in r.stderr


def test_train_prints_its_plan_and_precision(toy, tmp_path, capsys):
    base, args = toy
    out = tmp_path / "out"
    train_tiny.main(args[:-4] + ["--out-dir", str(out), "--stage", "draft", "--max-iters", "2", "--max-seconds", "30",
                                 "--precision", "fp32"])
    text = capsys.readouterr().out
    assert "precision fp32: fp32" in text
    assert "plan: draft 30s = 0.5 min of training; expected end" in text
    assert "bpb" in text and load_checkpoint(str(out / "draft.pt"))["done"]


def test_a_stage_calling_a_blank_exercise_is_skipped_with_a_note(toy, tmp_path, capsys, monkeypatch):
    """A course handout leaves functions as `raise NotImplementedError`: train what can be trained, note the rest."""
    base, args = toy

    def blank(ctx):
        raise NotImplementedError("exercise 9: implement build_tree")
    monkeypatch.setitem(train_tiny.STAGES, "draft", blank)
    train_tiny.main(args[:-4] + ["--out-dir", str(tmp_path / "out"), "--stage", "draft", "--max-iters", "2"])
    out = capsys.readouterr().out
    assert "draft: skipped, it calls a function not written yet (exercise 9: implement build_tree)" in out


def test_verify_help_says_what_an_unset_rule_is_for_each_method(capfd, monkeypatch):
    """--verify is unset (None) for the methods that draw trees: the help names the rule each kind of guesses gets,
    beside the chain methods' "token" (before: only the chain methods' defaults were shown)."""
    res = as_a_command(decode.main, "decode.py", ["--help"], capfd, monkeypatch)
    text = " ".join(res.stdout.split())
    assert res.returncode == 0
    assert "speculative token" in text
    assert "medusa, eagle, parallelspec: traversal for a tree of drawn guesses, token for the rest" in text
