"""The figure code (nanospec/bench/figures.py) on tiny inputs: every figure is written, non-empty, a valid PNG; the step
and tree figures from tiny random models with a byte-level tokenizer. matplotlib is optional (the README says how
to install it): without it these tests are skipped, and `python -m nanospec.bench.figures` says how to install it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanospec.bench import figures
from nanospec.model.load import Models
from nanospec.tokenizer import Tokenizer
from toys import tiny_gpt

# A marker, not a module-level importorskip: that raises Skipped at import, and the course's impostor search
# (nanospec/course/impostors.py) imports every test module of a handout.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                reason="matplotlib is optional: pip install matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path):
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG)


def test_each_drawing_writes_a_png(tmp_path):
    figures.draw_step(tmp_path / "step.png", "def f(x):", ["a", "b", "c"], ["a", "b", "d", "e"], 2)
    figures.draw_tree(tmp_path / "tree.png", ["(", "x", ")", "self"], [-1, 0, 1, 0], {0, 1}, torch.eye(4).bool())
    rows = {"ar": {"greedy": (1.0, 1.0), "t=1": (1.0, 1.0)}, "mtp": {"greedy": (1.6, 1.2), "t=1": (1.5, 0.9)}}
    figures.draw_bench(tmp_path / "bench.png", rows, "tiny")
    figures.draw_curves(tmp_path / "curves.png", [("mtp", "greedy", 1.6, 1.2), ("mtp", "t=1", 1.5, 0.9)])
    batch = {"greedy": {"ar": {"1": (100.0, 1.0), "4": (300.0, 1.0)}, "speculative": {"1": (150, 1.5), "4": (280, 0.9)}}}
    figures.draw_batch(tmp_path / "batch.png", batch, "tiny")
    for name in ("step", "tree", "bench", "curves", "batch"):
        assert is_png(tmp_path / f"{name}.png"), name


def byte_models():
    """Tiny random target (with MTP heads) and draft over a byte-level tokenizer (256 bytes + end-of-text)."""
    tokenizer = Tokenizer({bytes([b]): b for b in range(256)})
    target = tiny_gpt(0, vocab_size=257, block_size=96, n_future=2)
    return Models(target=target, draft=tiny_gpt(1, vocab_size=257, block_size=96, n_future=0), tokenizer=tokenizer)


def test_the_step_and_tree_figures_from_models(tmp_path):
    models = byte_models()
    figures.step_figure(models, tmp_path / "step.png")
    figures.tree_figure(models, tmp_path / "tree.png")
    assert is_png(tmp_path / "step.png") and is_png(tmp_path / "tree.png")


def test_main_draws_what_it_has_and_names_what_it_lacks(tmp_path, capsys):
    results = {"title": "tiny", "methods": {"ar": {"greedy": [1.0, 1.0]}, "mtp": {"greedy": [1.6, 1.2]}}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    figures.main(["--ckpt", str(tmp_path / "none"), "--results", str(tmp_path / "r.json"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "run `make train`" in err and "no batch table" in err
    assert is_png(tmp_path / "bench.png") and is_png(tmp_path / "speedup_curves.png")


def test_ctrl_c_while_saving_leaves_no_half_picture(tmp_path, monkeypatch):
    """Each PNG goes to a temporary file renamed into place: interrupted mid-write, neither a half PNG nor the
    temporary file is left (issue 40)."""
    plt = figures.pyplot()
    fig, _ = plt.subplots()
    (tmp_path / "bench.png").write_bytes(b"the old picture")

    def half_then_ctrl_c(path, **kw):
        Path(path).write_bytes(PNG)
        raise KeyboardInterrupt
    monkeypatch.setattr(fig, "savefig", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        figures.save(fig, tmp_path / "bench.png")
    assert sorted(os.listdir(tmp_path)) == ["bench.png"] and (tmp_path / "bench.png").read_bytes() == b"the old picture"


def test_a_closed_pipe_stops_the_printing_not_the_figures(tmp_path):
    """`python -m nanospec.bench.figures | head -1`: before, a BrokenPipeError traceback after the first PNG. A real
    process whose standard output is a pipe already closed: every figure is still drawn, quietly, status 0."""
    results = {"title": "tiny", "methods": {"ar": {"greedy": [1.0, 1.0]}, "mtp": {"greedy": [1.6, 1.2]}},
               "batch": {"greedy": {"ar": {"1": [100.0, 1.0], "4": [300.0, 1.0]}}}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    read, write = os.pipe()
    os.close(read)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "nanospec.bench.figures", "--ckpt", str(tmp_path / "none"), "--results",
                           str(tmp_path / "r.json"), "--out", str(tmp_path / "png")], cwd=root, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path / "png")) == ["batch.png", "bench.png", "speedup_curves.png"]
