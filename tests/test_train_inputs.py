"""train_tiny.py's inputs: every bad one a one-line error before any training, a corpus that never overwrites
another run's, the gpu preset well-formed, and decoding that never imports the training code."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import train_tiny
from nanospec.training import corpus
from nanospec.training import pipeline
from nanospec.model.drafters.eagle import Eagle, eagle_config
from nanospec.model.drafters.early_exit import ExitAdapter
from nanospec.model.drafters.parallelspec import ParallelSpec, ParallelSpecConfig
from nanospec.model.gpt import GPT
from nanospec.training.presets import PRESETS

TRAINING = {"nanospec.training.trainer", "nanospec.training.muon", "nanospec.training.pipeline", "nanospec.training.drafters", "train_tiny"}


def write_source(folder, n=8, lines=25, tag="x"):
    """A small corpus: n Python files of `lines` lines each."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        body = "".join(f"    {tag}{j} = f({tag}{j - 1}, {i})\n" for j in range(1, lines))
        (folder / f"m{i}.py").write_text(f"def g_{i}({tag}0):\n{body}    return {tag}0\n")
    return folder


def train_error(argv, tmp_path, **kw):
    """Run train_tiny.main with argv and the toy preset in tmp_path; return the one-line message it exits with."""
    base = ["--preset", "toy", "--data-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        train_tiny.main(base + argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message.strip(), message
    return message


def test_decode_imports_nothing_of_training(fresh_imports):
    """`python decode.py --method ar` in a fresh interpreter (conftest.py's fresh_imports) never loads the trainer."""
    imported = set(fresh_imports["decode"])
    assert "nanospec.model.load" in imported and "nanospec.model.drafters.eagle" in imported  # the check sees our modules
    assert not imported & TRAINING, imported & TRAINING


@pytest.mark.parametrize("flag, value, meaning", [
    ("--max-seconds", "-1", "seconds >= 0"), ("--max-seconds", "inf", "seconds >= 0"),
    ("--max-seconds", "nan", "seconds >= 0"), ("--max-iters", "0", "step count"),
    ("--seed", str(2 ** 64), "2**63 - 1"), ("--seed", "-3", "2**63 - 1"), ("--seed", "2**64", "2**63 - 1"),
])
def test_bad_numbers_are_one_line_errors(tmp_path, flag, value, meaning):
    message = train_error([flag, value], tmp_path)
    assert flag in message and meaning in message
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_max_seconds_zero_means_no_budget(tmp_path):
    ctx = SimpleNamespace(args=SimpleNamespace(max_seconds=0.0), cfg=PRESETS["tiny"])
    assert pipeline.Context.budget(ctx, "target_train") == 0.0  # plan and train_cfg read 0 as "no time budget"
    ctx = pipeline.Context(train_tiny.build_parser().parse_args(["--max-seconds", "0"]))
    assert ctx.train_cfg("target_train").max_seconds == 0.0  # the preset's 315 s are gone too


def test_a_missing_corpus_names_the_flag_train_tiny_has(tmp_path):
    message = train_error(["--corpus", str(tmp_path / "nope")], tmp_path)
    assert "--corpus" in message and "--source" not in message
    one_file = tmp_path / "one.txt"
    one_file.write_text("x = 1\n")  # one document: too little to hold one out
    message = train_error(["--corpus", str(one_file)], tmp_path)
    assert "give more text" in message and "--budget-bytes" not in message


def test_a_corpus_too_small_for_the_preset_is_a_clear_error(tmp_path):
    src = write_source(tmp_path / "src", n=4, lines=16)  # about 1.2 KB
    assert 1000 < sum(p.stat().st_size for p in src.iterdir()) < 1500
    message = train_error(["--corpus", str(src), "--preset", "tiny"], tmp_path)  # windows of 256 + 4 tokens
    assert "too small for preset 'tiny'" in message and "--corpus" in message


def test_a_read_only_out_dir_is_refused_before_training(tmp_path, monkeypatch):
    src = write_source(tmp_path / "src")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    message = train_error(["--corpus", str(src), "--out-dir", str(not_a_folder / "out")], tmp_path)
    assert "--out-dir" in message and "not a writable folder" in message

    def read_only(*args, **kw):  # what a read-only folder does (root, running the tests, writes anywhere)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(pipeline.tempfile, "TemporaryFile", read_only)
    message = train_error(["--corpus", str(src), "--max-iters", "2"], tmp_path)
    assert "not a writable folder (Permission denied)" in message
    assert not (tmp_path / "data").exists() or not (tmp_path / "data" / "train.txt").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_chmod_read_only_out_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        message = train_error(["--corpus", str(write_source(tmp_path / "src")), "--out-dir", str(out)], tmp_path)
    finally:
        out.chmod(0o755)
    assert "not a writable folder" in message


def test_ctrl_c_outside_a_training_loop_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(ctx):
        raise KeyboardInterrupt
    monkeypatch.setitem(pipeline.STAGES, "corpus", interrupted)
    with pytest.raises(SystemExit) as e:
        train_tiny.main(["--preset", "toy", "--data-dir", str(tmp_path / "d"), "--out-dir", str(tmp_path / "o")])
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("interrupted") and "\n" not in err


def test_a_tokenizer_path_that_is_a_folder(tmp_path):
    (tmp_path / "out" / "tokenizer.tiktoken").mkdir(parents=True)
    message = train_error(["--corpus", str(write_source(tmp_path / "src"))], tmp_path)
    assert "tokenizer.tiktoken is a folder" in message


def test_another_corpus_never_overwrites_a_run_s_data(tmp_path, capsys):
    """Issue 21: `--out-dir other --corpus X` rewrote the shared data/ under a run trained on it."""
    a, b = write_source(tmp_path / "a", tag="a"), write_source(tmp_path / "b", tag="b")
    data = tmp_path / "data"
    run_a = ["--preset", "toy", "--data-dir", str(data), "--corpus", str(a), "--stage", "corpus"]
    train_tiny.main(run_a + ["--out-dir", str(tmp_path / "out")])
    before = (data / "train.txt").read_text()
    message = train_error(["--corpus", str(b), "--out-dir", str(tmp_path / "other")], tmp_path)
    assert "holds another corpus" in message and "--data-dir" in message
    assert (data / "train.txt").read_text() == before  # kept, untouched
    # and a run folder refuses a data folder rebuilt since from another corpus (say, by hand)
    corpus.build_corpus(str(data), str(b), PRESETS["toy"]["corpus_bytes"])
    message = train_error(["--out-dir", str(tmp_path / "out")], tmp_path)
    assert "trained on another corpus" in message


def test_the_gpu_preset_is_well_formed():
    """Built on the meta device (no memory, no GPU): the target, the draft and every drafter fit together."""
    cfg = PRESETS["gpu"]
    target_cfg = cfg["target"].__class__(**{**cfg["target"].__dict__, "vocab_size": cfg["vocab_size"]})
    draft_cfg = cfg["draft"].__class__(**{**cfg["draft"].__dict__, "vocab_size": cfg["vocab_size"]})
    with torch.device("meta"):
        target, draft = GPT(target_cfg), GPT(draft_cfg)
        eagle = Eagle(eagle_config(target_cfg))
        ps = ParallelSpec(ParallelSpecConfig(vocab_size=target_cfg.vocab_size, block_size=target_cfg.block_size,
                                             n_embd=target_cfg.n_embd, n_head=target_cfg.n_head,
                                             **cfg.get("parallelspec", {})))
        adapter = ExitAdapter(target_cfg)
        x = torch.zeros(2, 16, dtype=torch.long)
        assert target(x).logits.shape == (2, 16, cfg["vocab_size"])
        assert eagle(target, x, target(x).hidden).logits.shape == (2, 16, cfg["vocab_size"])
        assert ps(target, x, torch.tensor([3, 7], device=x.device)).shape == (2, 2, ps.config.n_masks, cfg["vocab_size"])
    assert target_cfg.n_embd % target_cfg.n_head == 0 and draft_cfg.n_embd % draft_cfg.n_head == 0
    assert draft_cfg.block_size == target_cfg.block_size  # speculative drafts within the target's context
    assert len(adapter.exits) == target_cfg.n_layer - 1
    n = lambda m: sum(p.numel() for p in m.parameters())
    assert target_cfg.n_layer >= 12 and n(eagle) < n(target) / 8 and n(draft) < n(target) / 8  # deep and thin
    # the stdlib with its tests and site-packages, a few hundred MB: under ~4 passes of the data (issue 35)
    assert cfg["corpus_tests"] and cfg["corpus_packages"] and cfg["corpus_bytes"] >= 200_000_000
    tc = cfg["target_train"]
    assert tc.expected_steps * tc.batch_size * cfg["target"].block_size * 3.5 / cfg["corpus_bytes"] < 4
    budgets = [cfg[key].max_seconds for key in pipeline.TRAINED.values()]
    assert all(budgets) and sum(budgets) <= 270  # + corpus, tokenizer and loading: about 5 minutes
    assert all(math.isfinite(b) for b in budgets)


def test_the_default_run_names_the_gpu_preset_when_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "make train PRESET=gpu" in pipeline.gpu_note(SimpleNamespace(preset="tiny"))
    assert pipeline.gpu_note(SimpleNamespace(preset="gpu")) == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pipeline.gpu_note(SimpleNamespace(preset="tiny")) == ""


def test_presets_other_than_tiny_get_their_own_folders(monkeypatch):
    seen = {}
    monkeypatch.setattr(train_tiny, "run", lambda args: seen.update(data=args.data_dir, out=args.out_dir))
    train_tiny.main(["--preset", "gpu"])
    assert seen == {"data": "data-gpu", "out": "out-gpu"}
    train_tiny.main([])
    assert seen == {"data": "data", "out": "out"}


def test_the_corpus_can_include_test_folders(tmp_path):
    src = write_source(tmp_path / "src", n=3)
    write_source(src / "tests", n=2, tag="t")
    without = corpus.build_corpus(str(tmp_path / "d1"), str(src), 10 ** 6)
    with_tests = corpus.build_corpus(str(tmp_path / "d2"), str(src), 10 ** 6, include_tests=True)
    assert sum(without["files"].values()) == 3 and sum(with_tests["files"].values()) == 5
    assert with_tests["tests"] and not without["tests"]


def test_training_makes_every_tensor_on_the_model_s_device():
    """Models on the CPU, then every loss under torch.device("meta"): a tensor made without naming the device
    lands on meta, and the first operation mixing it with the model's tensors fails (issue 19's check)."""
    import numpy as np

    from nanospec.training import drafters as training
    from nanospec.model.gpt import GPTConfig
    from nanospec.training.trainer import TrainConfig, batch_rng, windows

    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=50, block_size=24, n_layer=2, n_head=2, n_embd=16, n_future=2))
    tokens = np.random.default_rng(0).integers(0, 50, size=500).astype(np.uint16)
    ctx = SimpleNamespace(cfg={}, device="cpu", train_tokens=tokens, val_tokens=tokens,
                          train_cfg=lambda key: TrainConfig(batch_size=2))
    recipes = [training.eagle_recipe, training.early_exit_recipe, training.parallelspec_recipe, training.heads_recipe]
    for recipe_of in recipes:
        recipe = recipe_of(ctx, target)
        module = recipe.make()
        rng = batch_rng(TrainConfig(), 3)
        with torch.device("meta"):
            w, step_rng = recipe.sample(0) if recipe.sample else (windows(tokens, rng, 2, recipe.window), rng)
            recipe.losses(module, w, step_rng)["loss"].backward()
            recipe.losses(module, w, None)
            if recipe.validation:
                recipe.validation(1)
    with torch.device("meta"):
        w = windows(tokens, rng, 2, 24 + 1 + 2)
        assert set(pipeline.lm_losses(target, w)) == {"main", "head1", "head2"}
        pipeline.lm_losses(target, w, torch.arange(3, device="cpu"))


# ----------------------------------------------------------------------------- token files and named files (issues 33, 35)


def toy_run(tmp_path, *extra):
    """The corpus, tokenizer and tokens stages of the toy preset on a small source; returns the base argv."""
    argv = ["--preset", "toy", "--corpus", str(write_source(tmp_path / "src", n=30, lines=40)),
            "--data-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path / "out")]
    train_tiny.main(argv + ["--stage", "tokens", *extra])
    return argv


def test_the_tokens_are_uint16_files_of_the_corpus_encoded_once(tmp_path, monkeypatch, capsys):
    import numpy as np

    from nanospec.tokenizer import Tokenizer
    monkeypatch.setattr(pipeline, "TOKENIZE_BLOCK_BYTES", 1000)  # many blocks: documents cut across them rejoin
    argv = toy_run(tmp_path)
    tok = Tokenizer.load(tmp_path / "out" / "tokenizer.tiktoken")
    for split in ("train", "val"):
        expected = tok.encode_corpus((tmp_path / "data" / f"{split}.txt").read_text())
        assert np.fromfile(tmp_path / "out" / f"{split}.bin", dtype=np.uint16).tolist() == expected
    capsys.readouterr()
    ctx = pipeline.Context(train_tiny.build_parser().parse_args(argv))
    for stage in ("corpus", "tokenizer", "tokens"):
        pipeline.STAGES[stage](ctx)
    assert "train.bin exists, skipping" in capsys.readouterr().out  # encoded once
    assert isinstance(ctx.train_tokens, np.memmap) and ctx.train_tokens.dtype == np.uint16  # read from disk
    # a retrained tokenizer gets new token files
    (tmp_path / "out" / "tokenizer.tiktoken").unlink()
    monkeypatch.setitem(PRESETS["toy"], "vocab_size", 300)
    train_tiny.main(argv + ["--stage", "tokens"])
    assert "tokens:" in capsys.readouterr().out
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).max() < 300


def test_the_tokenizer_learns_from_a_sample_of_the_whole_split(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("".join(f"first part line {i}\n" for i in range(5000)) +
                    "".join(f"last part line {i}\n" for i in range(5000)))
    sample = pipeline.tokenizer_sample(path, 20_000)
    assert len(sample) <= 20_000 and "first part" in sample and "last part" in sample
    assert all(line.startswith(("first part line", "last part line")) or line == ""
               for piece in sample.split(corpus.EOT) for line in piece.split("\n"))  # whole lines only
    assert pipeline.tokenizer_sample(path, None) == path.read_text()


@pytest.mark.parametrize("damage, named", [
    (lambda d, o: (d / "train.txt").write_text(""), "data/train.txt holds 0 bytes"),
    (lambda d, o: (d / "val.txt").unlink(), "data/val.txt is missing"),
    (lambda d, o: (d / "corpus.json").write_text("{\n"), "data/corpus.json is corrupt"),
    (lambda d, o: (d / "corpus.json").write_text("[]"), "data/corpus.json is corrupt"),
    (lambda d, o: (o / "corpus.json").write_text("not json"), "out/corpus.json is corrupt"),
    (lambda d, o: (o / "tokens.json").write_text("{"), "out/tokens.json is corrupt"),
    (lambda d, o: (d / "train.txt").write_text((d / "train.txt").read_text().replace("g_1", "h_1")),
     "is not the text"),
])
def test_damaged_training_files_are_named(tmp_path, damage, named):
    """Issue 33: an emptied data/train.txt said "too small for preset 'toy' ... or use --preset toy", and a corrupt
    data/corpus.json "Expecting value: line 2 column 1", neither naming the file."""
    argv = toy_run(tmp_path)
    damage(tmp_path / "data", tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        train_tiny.main(argv + ["--stage", "tokens"])
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message and named in message, message
    assert "delete" in message or "pass another --data-dir" in message


def test_too_small_names_the_split_and_never_suggests_the_preset_in_use(tmp_path):
    src = write_source(tmp_path / "src", n=4, lines=3)
    message = train_error(["--corpus", str(src)], tmp_path)
    assert "too small for preset 'toy'" in message and "/data/" in message and "--preset toy" not in message


# ----------------------------------------------------------------------------- files training did not write (issue 40)


def test_your_own_train_and_val_txt_are_never_replaced(tmp_path, capsys):
    """Before: `--stage corpus --data-dir D`, D holding your own train.txt and val.txt but no corpus.json, said
    "all done" with both replaced by standard-library text. A corpus.json nanospec did not write is kept too."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("my own notes\n")
    (data / "val.txt").write_text("mine too\n")
    (data / "prompts.json").write_text("{}")  # a file training never writes: left alone, never a reason to refuse
    message = train_error(["--stage", "corpus"], tmp_path)
    assert "holds train.txt and val.txt that no corpus.json of nanospec's describes" in message
    assert "--data-dir" in message and "--corpus" in message
    assert (data / "train.txt").read_text() == "my own notes\n" and (data / "val.txt").read_text() == "mine too\n"
    assert sorted(p.name for p in data.iterdir()) == ["prompts.json", "train.txt", "val.txt"]
    assert "plan: corpus, tokenizer, tokens only, no model trained" in capsys.readouterr().out  # not "complete"
    (data / "corpus.json").write_text('{"mine": true}')
    assert "is not a corpus record nanospec wrote" in train_error(["--stage", "corpus"], tmp_path)
    assert (data / "corpus.json").read_text() == '{"mine": true}'


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.vocab", "my vocabulary\n", "tokenizer.vocab is not a tokenizer listing nanospec wrote"),
    ("train.bin", "my data", "train.bin was not written by nanospec"),
    ("tokens.json", '{"mine": 1}', "tokens.json is not the record of token files nanospec writes"),
])
def test_files_in_the_out_dir_training_did_not_write_are_refused(tmp_path, name, content, message):
    """Before: `--stage tokens --out-dir O` silently replaced your own O/train.bin and O/tokenizer.vocab. A file
    of another name (notes.txt) is left alone and stops nothing."""
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text(content)
    (out / "notes.txt").write_text("mine")
    argv = ["--preset", "toy", "--corpus", str(write_source(tmp_path / "src", n=30, lines=40)), "--data-dir",
            str(tmp_path / "data"), "--out-dir", str(out), "--stage", "tokens"]
    with pytest.raises(SystemExit) as e:
        train_tiny.main(argv)
    assert message in str(e.value.code) and "pass another --out-dir" in str(e.value.code)
    assert (out / name).read_text() == content and (out / "notes.txt").read_text() == "mine"
    (out / name).unlink()
    train_tiny.main(argv)  # moved away: the run goes on, and leaves notes.txt as it was
    assert (out / "train.bin").stat().st_size > 0 and (out / "notes.txt").read_text() == "mine"


def test_a_run_stopped_while_writing_its_corpus_or_tokens_goes_on(tmp_path, capsys):
    """The records of what is ours are written first ("building" in corpus.json, tokens.json without its counts):
    files a stopped run left half-written are written again, not refused as someone else's."""
    argv = toy_run(tmp_path)
    data, out = tmp_path / "data", tmp_path / "out"
    (data / "corpus.json").write_text(json.dumps(corpus.BUILDING))
    (data / "val.txt").write_text("half")
    (out / "tokens.json").write_text(json.dumps({k: v for k, v in json.loads((out / "tokens.json").read_text()).items()
                                                 if k in ("tokenizer", "corpus_sha256")}))
    (out / "train.bin").write_bytes(b"half")
    train_tiny.main(argv + ["--stage", "tokens"])
    assert "corpus: " in capsys.readouterr().out and json.loads((data / "corpus.json").read_text())["bytes"]
    assert (out / "train.bin").stat().st_size > 4 and json.loads((out / "tokens.json").read_text())["train"] > 2


def test_a_closed_pipe_stops_the_printing_not_the_training(tmp_path):
    """`python train_tiny.py ... | head -1`: before, a BrokenPipeError traceback and training stopped after the
    corpus. A real process whose standard output is a pipe already closed runs every stage it was asked for."""
    read, write = os.pipe()
    os.close(read)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "train_tiny.py", "--preset", "toy", "--corpus",
                           str(write_source(tmp_path / "src", n=30, lines=40)), "--data-dir", str(tmp_path / "data"),
                           "--out-dir", str(tmp_path / "out"), "--stage", "tokens"], cwd=root, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads((tmp_path / "out" / "tokens.json").read_text())["val"] > 0
