"""Checkpoints: a checksum that catches a flipped bit, the part each file holds, drafters checked against the
target they learnt from, one-line errors naming the file, and the temporary files of a killed save cleaned."""
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import train_tiny
from nanospec.model.checkpoint import (CheckpointError, clean_orphans, gpt_checkpoint, load_checkpoint, load_gpt,
                                 save_atomic, target_fingerprint)
from nanospec.model.drafters.eagle import Eagle, eagle_config
from nanospec.model.drafters.early_exit import ExitAdapter
from nanospec.model.drafters.parallelspec import ParallelSpec, ParallelSpecConfig
from nanospec.model.gpt import GPT, GPTConfig
from nanospec.model.load import load_models
from nanospec.tokenizer import Tokenizer, save_tokenizer, train_bpe


def small_gpt(seed=0, n_embd=16):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=n_embd, n_future=2))


def run_folder(path, seed=0):
    """A run folder as `make train` leaves it: tokenizer.tiktoken and target.pt. Returns (tokenizer, target)."""
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(train_bpe("def f(x):\n    return x\n" * 20, 299), str(path / "tokenizer"))
    tokenizer = Tokenizer.load(path / "tokenizer.tiktoken")
    target = small_gpt(seed)
    save_atomic(gpt_checkpoint(target, tokenizer.identity, part="target", done=True), str(path / "target.pt"))
    return tokenizer, target


def drafter(part, target_cfg, n_embd=None):
    """An untrained drafter of each kind for a target of target_cfg (of another width when n_embd is given)."""
    cfg = GPTConfig(**{**asdict(target_cfg), "n_embd": n_embd or target_cfg.n_embd})
    if part == "eagle":
        return Eagle(eagle_config(cfg))
    if part == "early_exit":
        return ExitAdapter(cfg)
    return ParallelSpec(ParallelSpecConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_embd=cfg.n_embd,
                                           n_head=cfg.n_head))


def save_drafter(path, module, tokenizer, target_id):
    save_atomic({"part": path.stem, "config": asdict(module.config), "model": module.state_dict(),
                 "tokenizer": tokenizer.identity, "target": target_id, "done": True}, str(path))


def flip_a_bit_in_the_weights(path, tensor):
    """Flip one bit of `tensor`'s bytes where they lie in the file (torch stores them uncompressed)."""
    data = bytearray(path.read_bytes())
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at > 0
    data[at + len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_bit_flipped_target_does_not_load(tmp_path):
    tokenizer, target = run_folder(tmp_path)
    path = tmp_path / "target.pt"
    assert load_gpt(str(path), tokenizer.identity) is not None
    flip_a_bit_in_the_weights(path, target.blocks[0].attn.c_attn.weight)
    with pytest.raises(CheckpointError, match=r"target\.pt is damaged \(its checksum"):
        load_gpt(str(path), tokenizer.identity)
    with pytest.raises(CheckpointError, match="damaged"):
        load_models(str(tmp_path), parts=[])


def test_every_saved_checkpoint_carries_its_checksum(tmp_path):
    save_atomic({"config": {}, "model": {"w": torch.ones(3, dtype=torch.bfloat16)}}, str(tmp_path / "x.pt"))
    raw = torch.load(tmp_path / "x.pt", weights_only=True)
    assert len(raw["checksum"]) == 64
    raw["model"]["w"][1] = 2.0  # an edit without a new checksum
    torch.save(raw, tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match="x.pt is damaged"):
        load_checkpoint(str(tmp_path / "x.pt"))


def test_another_part_or_an_edited_config_in_target_pt(tmp_path):
    tokenizer, target = run_folder(tmp_path)
    eagle = tmp_path / "eagle.pt"
    save_drafter(eagle, drafter("eagle", target.config), tokenizer, target_fingerprint(target))
    os.replace(eagle, tmp_path / "target.pt")  # eagle.pt copied as target.pt
    with pytest.raises(CheckpointError, match=r"target\.pt holds the eagle part, not the target"):
        load_models(str(tmp_path), parts=[])
    ckpt = gpt_checkpoint(target, tokenizer.identity)  # a file without a part name (older versions)...
    ckpt["config"]["n_embd"] = 32  # ...whose config was edited, and its checksum written anew
    save_atomic(ckpt, str(tmp_path / "target.pt"))
    with pytest.raises(CheckpointError, match=r"target\.pt: its weights do not fit its config"):
        load_models(str(tmp_path), parts=[])
    ckpt["config"]["n_embd"], ckpt["config"]["colour"] = 18, "red"  # not a config at all
    save_atomic(ckpt, str(tmp_path / "target.pt"))
    with pytest.raises(CheckpointError, match=r"target\.pt holds a config that makes no model"):
        load_models(str(tmp_path), parts=[])


@pytest.mark.parametrize("part", ["eagle", "parallelspec", "early_exit"])
def test_a_drafter_trained_for_another_target_is_refused(tmp_path, part):
    tokenizer, target = run_folder(tmp_path)
    other = small_gpt(seed=7)  # the same shape, trained with another --seed
    save_drafter(tmp_path / f"{part}.pt", drafter(part, target.config), tokenizer, target_fingerprint(other))
    with pytest.raises(CheckpointError, match=rf"{part}\.pt was trained for another target.pt: retrain it with "
                                              rf"`python train_tiny.py --stage {part}`"):
        load_models(str(tmp_path), parts=[part])
    assert load_models(str(tmp_path), parts=["draft"]).target is not None  # the other methods still load
    save_drafter(tmp_path / f"{part}.pt", drafter(part, target.config), tokenizer, target_fingerprint(target))
    assert getattr(load_models(str(tmp_path), parts=[part]), part) is not None


def test_an_early_exit_pt_of_another_width(tmp_path):
    tokenizer, target = run_folder(tmp_path)
    other = small_gpt(n_embd=32)
    save_drafter(tmp_path / "early_exit.pt", drafter("early_exit", other.config), tokenizer, target_fingerprint(other))
    with pytest.raises(CheckpointError, match=r"early_exit\.pt was trained for another target.pt"):
        load_models(str(tmp_path), parts=["early_exit"])


def test_a_tokenizer_path_that_is_a_folder_is_one_line(tmp_path):
    run_folder(tmp_path)
    os.remove(tmp_path / "tokenizer.tiktoken")
    (tmp_path / "tokenizer.tiktoken").mkdir()
    with pytest.raises(CheckpointError, match=r"tokenizer\.tiktoken is a folder, not a tokenizer file"):
        load_models(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is a folder"):
        Tokenizer.load(tmp_path / "tokenizer.tiktoken")


def dead_pid():
    """The id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_orphans_of_a_killed_save_are_cleaned_on_the_next_start(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"m{i}.py").write_text("".join(f"x{j} = f({i}, {j})\n" for j in range(30)))
    out = tmp_path / "out"
    out.mkdir()
    orphan, live = out / f"target.pt.tmp{dead_pid()}", out / f"draft.pt.tmp{os.getpid()}"
    orphan.write_bytes(b"half a checkpoint")
    live.write_bytes(b"a save under way")  # a running process's: left alone
    tokens = out / f"train.bin.tmp{dead_pid()}"  # the token files' (issue 35) too
    tokens.write_bytes(b"half the tokens")
    train_tiny.main(["--preset", "toy", "--corpus", str(src), "--data-dir", str(tmp_path / "data"),
                     "--out-dir", str(out), "--stage", "corpus"])
    assert not orphan.exists() and live.exists() and not tokens.exists()
    printed = capsys.readouterr().out
    assert f"removed {orphan}" in printed and f"removed {tokens}" in printed
    assert clean_orphans(str(out)) == []


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ctrl_c_then_resume_is_bit_identical_to_an_unbroken_run(tmp_path, optimizer):
    """The checksummed save keeps resume exact: weights after Ctrl-C at step 5 and a resume equal an unbroken run."""
    import numpy as np
    from torch.nn import functional as F

    from nanospec.training.trainer import TrainConfig, batch_rng, train, windows
    tokens = np.random.default_rng(0).integers(0, 300, size=400).astype(np.uint16)
    cfg = TrainConfig(max_iters=9, eval_interval=4, batch_size=2, warmup_iters=2, optimizer=optimizer)

    def run(path, stop_at=None):
        model = small_gpt(0)

        def loss_fn(m, step):
            if step == stop_at:
                raise KeyboardInterrupt
            w = windows(tokens, batch_rng(cfg, step), 2, 17)
            return F.cross_entropy(m(w[:, :-1]).logits.flatten(0, 1), w[:, 1:].flatten()), {}
        train("part", model, loss_fn, lambda m: {}, cfg, str(path), lambda: gpt_checkpoint(model, "tok"), "cpu", 32)
        return model

    unbroken = run(tmp_path / "a.pt")
    with pytest.raises(SystemExit):
        run(tmp_path / "b.pt", stop_at=5)
    assert load_checkpoint(str(tmp_path / "b.pt"))["step"] == 5
    resumed = run(tmp_path / "b.pt")
    for name, p in unbroken.state_dict().items():
        assert torch.equal(p, resumed.state_dict()[name]), name
