"""`make gpu-check` (nanospec/gpu_check.py), its logic on the CPU: on toy checkpoints every method passes at
every setting and the quick bench completes; a method that crashes when sampling, or whose greedy output
differs from ar's, is named (negative controls); without a GPU it says so in one line and runs the same
checks on the CPU, replay emulated; without checkpoints one line says how to make them. With --runtime static (the default) every method also runs on the
static path (runtime.prepare's models), its greedy output held to its eager one; a static path that differs, a
capture that fails (its model then runs eager: blamed on the methods that run that model only) or a device
that does not take the path it should, is named (negative controls)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanospec import gpu_check
from nanospec.fast.runtime import Fast


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def toy_out(toy_run):
    return str(toy_run)  # conftest.py's, trained once for the session


@pytest.fixture(scope="module")
def CPU(tmp_path_factory):
    """The flags of a quick check on the CPU. The bench --quick it ends with reads data/prompts.json's first prompt
    of each category only (it would read two): every method and category still runs."""
    data = json.loads((ROOT / "data" / "prompts.json").read_text(encoding="utf-8"))
    firsts = {}
    for p in data["prompts"]:
        firsts.setdefault(p["category"], p)
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps({**data, "prompts": list(firsts.values())}), encoding="utf-8")
    return ["--device", "cpu", "--dtype", "float64", "--seeds", "1", "--max-new-tokens", "8", "--prompts", str(path)]


def test_without_a_gpu_every_method_passes_on_the_cpu_with_replay_emulated(toy_out, CPU, capsys, monkeypatch):
    """`make gpu-check` on a machine without CUDA: one line says so, then the same checks on the CPU, where the
    static rows replay their forwards through graphs.Emulated (a Python value frozen into a forward fails
    there as on a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(CPU[2:] + ["--ckpt", toy_out]) == 0  # no --device: cuda asked for, and not here
    out, err = capsys.readouterr()
    assert out.startswith("gpu-check: no CUDA GPU here") and "CUDA-graph replay emulated" in out.splitlines()[0]
    # issue 40: as it goes, a line per method and path on standard error, and the bench's own progress
    said = err.splitlines()
    assert said[0] == f"gpu-check: loading {toy_out}/ on cpu, 1 torch thread"
    for name in [*gpu_check.MODULES, *gpu_check.VARIANTS]:  # eagle --tree dynamic: a row of its own
        for label in (name, f"{name} (static)"):
            line = next(line for line in said if line.startswith(f"gpu-check: {label}: "))
            assert line.endswith(" s)") and "greedy ok, t=1 ok, t=0.7 top-p=0.9 ok" in line, line
    assert any(line.startswith("  bench [") and "settings:" in line for line in said)
    assert "bench --quick: ok, every method ran" in out and "FAIL" not in out
    assert all(f"| {name} (static) " in out for name in gpu_check.MODULES)
    assert all(f"| batch: {name} (static) " in out for name in gpu_check.BATCHED)
    rows = 2 * (len(gpu_check.MODULES) + len(gpu_check.VARIANTS) + len(gpu_check.BATCHED))  # and again static
    assert out.strip().splitlines()[-1] == f"gpu-check: all {rows * 3 + 1} checks passed"


def test_a_crash_when_sampling_and_a_greedy_mismatch_are_named(toy_out, CPU, capsys, monkeypatch):
    """On the eager path alone (--runtime eager): the failures of the static path are named by the tests below."""
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
    assert gpu_check.main(CPU + ["--ckpt", toy_out, "--runtime", "eager"]) == 1
    out = capsys.readouterr().out
    assert "FAIL jacobi at t=1: prompt 0, seed 0: RuntimeError: Expected all tensors to be on the same device" in out
    assert "FAIL mtp at greedy: prompt 0, seed 0: greedy output differs from ar's at token 0" in out
    assert "FAIL bench --quick: skipped jacobi: failed in its warm-up at temperature 1" in out


def test_without_a_gpu_or_checkpoints_two_lines_say_what_to_do(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the command itself, as `make gpu-check` runs it
    done = subprocess.run([sys.executable, "-m", "nanospec.gpu_check", "--ckpt", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout.count("\n") == 2 and not done.stderr
    assert done.stdout.startswith("gpu-check: no CUDA GPU here") and "run `make train`" in done.stdout


def test_a_device_that_is_no_device_is_one_line(tmp_path, capsys):
    """Before: `--device bogus` failed in torch and told the user to delete a good checkpoint."""
    assert gpu_check.main(["--device", "bogus", "--ckpt", str(tmp_path)]) == 1
    assert capsys.readouterr().out == ("gpu-check: unknown --device 'bogus': use cuda (the default), cuda:N, mps or "
                                       "cpu\n")
    assert gpu_check.main(["--device", "cpu", "--threads", str((os.cpu_count() or 1) + 1)]) == 1
    assert "--threads must be in 0.." in capsys.readouterr().out


def test_ctrl_c_and_a_closed_pipe_end_it_plainly(toy_out, CPU, tmp_path):
    """Real processes (issue 40; before, a traceback each): SIGINT while it checks ends with 'interrupted' and
    status 130; standard output a pipe already closed ends it quietly, status 0."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-m", "nanospec.gpu_check", *CPU, "--ckpt", toy_out], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().startswith("gpu-check: loading")  # it is at work
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.endswith("interrupted\n") and "Traceback" not in err, err
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "nanospec.gpu_check", "--ckpt", str(tmp_path)], cwd=ROOT, env=env,
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_without_checkpoints_one_line_says_how_to_make_them(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--ckpt", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "run `make train`" in out


def grid_of(toy_out, CPU, monkeypatch, methods, *flags):
    """gpu_check's grid over a few methods only (fast): the logic of `main` without the bench."""
    monkeypatch.setattr(gpu_check, "MODULES", {name: gpu_check.MODULES[name] for name in methods})
    args = gpu_check.parse_args(CPU + ["--ckpt", toy_out, *flags])
    models, _ = gpu_check.bench.load_parts(args.ckpt, args.device, ("draft",), args.dtype)
    return gpu_check.run_methods(models, args)


def test_the_static_path_runs_every_setting_and_is_held_to_eager(toy_out, CPU, monkeypatch):
    seen = []
    real = gpu_check.METHODS["speculative"]

    def spy(models, ids, n, **kw):
        seen.append("static" if isinstance(models.target, Fast) and isinstance(models.draft, Fast) else "eager")
        return real(models, ids, n, **kw)
    monkeypatch.setitem(gpu_check.METHODS, "speculative", spy)
    grid = grid_of(toy_out, CPU, monkeypatch, ["ar", "speculative"])
    assert set(grid) == {"ar", "ar (static)", "speculative", "speculative (static)", "batch: ar", "batch: ar (static)",
                         "batch: speculative", "batch: speculative (static)"}
    assert all(why is None for row in grid.values() for why in row.values()), grid
    assert seen.count("static") == seen.count("eager") == 3 * 3  # 3 settings x 3 prompts x 1 seed, both paths
    plain = grid_of(toy_out, CPU, monkeypatch, ["ar", "speculative"], "--runtime", "eager")
    assert set(plain) == {"ar", "speculative", "batch: ar", "batch: speculative"} and seen.count("eager") == 18


def test_a_static_path_that_differs_or_gives_up_its_graphs_is_named(toy_out, CPU, monkeypatch):
    real_spec, real_ar = gpu_check.METHODS["speculative"], gpu_check.METHODS["ar"]

    def off_by_one_when_static(models, ids, n, **kw):
        out, stats = real_spec(models, ids, n, **kw)
        if isinstance(models.target, Fast):
            out = out[:3] + [(t + 1) % models.target.config.vocab_size for t in out[3:]]
        return out, stats

    def capture_fails(models, ids, n, **kw):  # as runtime.Fast does when a CUDA graph capture fails
        if isinstance(models.draft, Fast):
            monkeypatch.setattr(models.draft.graphs, "enabled", False)
        return real_ar(models, ids, n, **kw)
    monkeypatch.setitem(gpu_check.METHODS, "speculative", off_by_one_when_static)
    monkeypatch.setitem(gpu_check.METHODS, "ar", capture_fails)
    grid = grid_of(toy_out, CPU, monkeypatch, ["ar", "speculative"])
    assert grid["ar (static)"]["greedy"] is None  # ar runs no draft: the draft's failed capture is not ar's
    assert grid["ar"]["greedy"] is None
    assert grid["speculative"]["greedy"] is None
    assert grid["speculative (static)"]["greedy"] == ("prompt 0, seed 0: the draft's graph capture failed: it ran "
                                                     "eager")
    monkeypatch.undo()  # the graphs back, the plain methods back; a mismatch on the static path alone
    monkeypatch.setitem(gpu_check.METHODS, "speculative", off_by_one_when_static)
    grid = grid_of(toy_out, CPU, monkeypatch, ["ar", "speculative"])
    assert grid["speculative (static)"]["greedy"] == ("prompt 0, seed 0: greedy output on the static path differs "
                                                     "from eager's at token 3")
    assert grid["speculative"]["greedy"] is None and grid["ar (static)"]["greedy"] is None
    assert grid["speculative (static)"]["t=1"] is None  # sampled: nothing to compare with


def test_a_device_that_does_not_take_its_path_is_named(toy_out, CPU, monkeypatch):
    real = gpu_check.prepare
    monkeypatch.setattr(gpu_check, "prepare", lambda models, runtime: (real(models, runtime)[0], "eager"))
    grid = grid_of(toy_out, CPU, monkeypatch, ["ar"])
    assert grid["ar (static)"] == {s: "runtime.prepare took the eager path, not static" for s, _ in gpu_check.SETTINGS}
    assert all(why is None for why in grid["ar"].values())


def test_a_batch_that_differs_from_ar_alone_or_from_eager_is_named(toy_out, CPU, monkeypatch):
    """Batched decoding's rows: greedy, each row against `ar` alone on its prompt (eager) and against the eager
    batch (static). A row off by one from token 2 on, on one path at a time, is named there and only there."""
    real = gpu_check.generate_batch

    def off_by_one_when(static):
        def batch(models, prompts, n, **kw):
            rows, stats = real(models, prompts, n, **kw)
            if isinstance(models.target, Fast) == static and kw["method"] == "speculative":
                rows[1] = rows[1][:2] + [(t + 1) % models.target.config.vocab_size for t in rows[1][2:]]
            return rows, stats
        return batch
    monkeypatch.setattr(gpu_check, "generate_batch", off_by_one_when(static=False))
    grid = grid_of(toy_out, CPU, monkeypatch, ["ar", "speculative"])
    assert grid["batch: speculative"]["greedy"] == "seed 0: greedy row 1 differs from ar alone"
    assert grid["batch: ar"]["greedy"] is None and grid["batch: speculative"]["t=1"] is None
    monkeypatch.setattr(gpu_check, "generate_batch", off_by_one_when(static=True))
    grid = grid_of(toy_out, CPU, monkeypatch, ["ar", "speculative"])
    assert grid["batch: speculative (static)"]["greedy"] == "seed 0: greedy row 1 differs from eager"
    assert grid["batch: speculative"]["greedy"] is None and grid["batch: ar (static)"]["greedy"] is None


def test_a_missing_part_names_the_folder_to_train_it_into(toy_out, CPU, monkeypatch, tmp_path):
    """Before: a folder without eagle.pt said `python train_tiny.py --stage eagle`, which trains into out/."""
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("tokenizer.tiktoken", "target.pt", "draft.pt"):
        (folder / name).write_bytes((Path(toy_out) / name).read_bytes())
    grid = grid_of(str(folder), CPU, monkeypatch, ["ar", "eagle"])
    assert grid["eagle"]["greedy"] == (f"cannot run: --method eagle needs the eagle model, which {folder} lacks: "
                                       f"run `python train_tiny.py --stage eagle --out-dir {folder}` (with the "
                                       f"--preset and --data-dir {folder} was trained with)")
    assert grid["ar"]["greedy"] is None
