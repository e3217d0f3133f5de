"""`make gpu-check` (nanospec/gpu_check.py), its logic on the CPU: on toy checkpoints every method passes at
every setting and the quick bench completes; a method that crashes when sampling, or whose greedy output
differs from ar's, is named (negative controls); without a GPU it prints one line and exits 0; without
checkpoints one line says how to make them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanospec import gpu_check

from test_bench import train_toy

ROOT = Path(__file__).resolve().parent.parent
CPU = ["--device", "cpu", "--dtype", "float64", "--seeds", "1", "--max-new-tokens", "8",
       "--prompts", str(ROOT / "data" / "prompts.json")]


@pytest.fixture(scope="module")
def toy_out(tmp_path_factory):
    return str(train_toy(tmp_path_factory.mktemp("toy")))


def test_every_method_passes_on_toy_checkpoints(toy_out, capsys):
    assert gpu_check.main(CPU + ["--ckpt", toy_out]) == 0
    out = capsys.readouterr().out
    assert "bench --quick: ok, every method ran" in out and "FAIL" not in out
    assert out.strip().splitlines()[-1] == f"gpu-check: all {len(gpu_check.MODULES) * 3 + 1} checks passed"


def test_a_crash_when_sampling_and_a_greedy_mismatch_are_named(toy_out, capsys, monkeypatch):
    real = gpu_check.METHODS["jacobi"]

    def crashes_when_sampling(models, ids, n, temperature=0.0, **kw):
        if temperature > 0:
            raise RuntimeError("Expected all tensors to be on the same device, but got index is on cpu")
        return real(models, ids, n, temperature=temperature, **kw)

    def off_by_one(models, ids, n, **kw):
        out, stats = real(models, ids, n, **kw)
        return [(t + 1) % models.target.config.vocab_size for t in out], stats
    monkeypatch.setitem(gpu_check.METHODS, "jacobi", crashes_when_sampling)
    monkeypatch.setitem(gpu_check.METHODS, "mtp", off_by_one)
    assert gpu_check.main(CPU + ["--ckpt", toy_out]) == 1
    out = capsys.readouterr().out
    assert "FAIL jacobi at t=1: prompt 0, seed 0: RuntimeError: Expected all tensors to be on the same device" in out
    assert "FAIL mtp at greedy: prompt 0, seed 0: greedy output differs from ar's at token 0" in out
    assert "FAIL bench --quick: skipped jacobi: failed in its warm-up at temperature 1" in out


def test_without_a_gpu_one_line_and_exit_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the command itself, as `make gpu-check` runs it
    done = subprocess.run([sys.executable, "-m", "nanospec.gpu_check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("\n") == 1
    assert done.stdout.startswith("gpu-check: no CUDA GPU here")


def test_without_checkpoints_one_line_says_how_to_make_them(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--ckpt", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "run `make train`" in out
