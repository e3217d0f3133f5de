"""The bench and the runtime option (issue 20): --runtime reaches every method that takes it and the report
says which path ran; comparing runtimes (the default on CUDA, --compare-runtimes anywhere) shows eager and
static `ar` as two rows, speedups against the static `ar`, drafter cost c and the forward-cost table both
ways. On the CPU the static path is just called, not replayed: these tests check the logic, not the gain."""
from pathlib import Path

import pytest
import torch

from nanospec import bench
from nanospec.decoding import MODULES

from test_bench import train_toy

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = str(ROOT / "data" / "prompts.json")
TAKES = [name for name in MODULES if "runtime" in MODULES[name].OPTIONS]


@pytest.fixture(scope="module")
def toy_out(tmp_path_factory):
    return train_toy(tmp_path_factory.mktemp("toy"))


def quick(ckpt, out, *flags):
    """A small quick bench: one prompt per category, a few tokens, float64 (no near-ties)."""
    return bench.main(["--quick", "--ckpt", str(ckpt), "--prompts", PROMPTS, "--device", "cpu", "--dtype",
                       "float64", "--prompts-per-category", "1", "--max-new-tokens", "8", "--out", str(out), *flags])


def runtimes(got, t, label):
    return {r["stats"].get("runtime") for r in got["results"][t][label].values()}


def test_table_rows_pass_the_runtime_to_the_methods_that_take_it():
    assert "ar" in TAKES and "speculative" in TAKES
    names = list(MODULES)
    plain = bench.table_rows(names, 0.0)
    assert all(options == {} for _, options in plain.values())  # auto: each method's default, nothing passed
    static = bench.table_rows(names, 0.0, "static")
    for name in names:
        assert static[name] == (name, {"runtime": "static"} if name in TAKES else {})
    both = bench.table_rows(names, 1.0, compare=True)
    labels = list(both)
    for name in TAKES:  # the eager row right after the static one
        assert both[name][1]["runtime"] == "static" and both[f"{name} (eager)"] == (name, {"runtime": "eager"})
        assert labels.index(f"{name} (eager)") == labels.index(name) + 1
    for label, (name, options) in both.items():
        assert ("runtime" in options) == (name in TAKES), label
        if "draft_sampling" in options and name in TAKES:  # the other drafting mode on the static path too
            assert options["runtime"] == "static"
    assert not any(f"{name} (eager)" in both for name in names if name not in TAKES)


def test_runtime_flag_reaches_the_methods_and_the_header_says_which_path_ran(toy_out, tmp_path):
    got = quick(toy_out, tmp_path / "r.md", "--runtime", "static", "--temperatures", "0",
                "--methods", "speculative,jacobi")
    for name in TAKES:
        if name in got["results"][0.0]:
            assert runtimes(got, 0.0, name) == {"static"}, name
    line = next(line for line in got["report"].splitlines() if line.startswith("- runtime: "))
    assert line.startswith("- runtime: --runtime static;")
    if all(name in TAKES for name in ("ar", "speculative", "jacobi")):  # every row took the option
        assert "ran static (shape-static forwards, just called) for every row" in line
    else:
        assert "static (shape-static forwards, just called): ar" in line
    if "jacobi" not in TAKES:  # a method without the option runs eager, and the line names it there
        assert "eager (plain PyTorch): jacobi" in line
    assert "forward costs below: static" in line
    assert "ar (eager)" not in got["summaries"][0.0]  # not comparing on a CPU unless asked
    eager = quick(toy_out, tmp_path / "e.md", "--runtime", "eager", "--temperatures", "0", "--methods", "ar")
    assert runtimes(eager, 0.0, "ar") == {"eager"}
    assert "the forwards ran eager (plain PyTorch) for every row; forward costs below: eager" in eager["report"]


def test_comparing_runtimes_shows_eager_and_static_side_by_side(toy_out, tmp_path):
    got = quick(toy_out, tmp_path / "r.md", "--compare-runtimes", "--methods", "speculative,eagle,jacobi")
    report = got["report"]
    for t in (0.0, 1.0):
        rows = got["summaries"][t]
        assert "ar" in rows and "ar (eager)" in rows and rows["ar"]["all"]["speedup"] == pytest.approx(1.0)
        assert runtimes(got, t, "ar") == {"static"} and runtimes(got, t, "ar (eager)") == {"eager"}
        assert runtimes(got, t, "speculative") == {"static"} and "speculative (eager)" in rows
    assert got["summaries"][0.0]["ar (eager)"]["equal"] == 3  # the eager row's greedy output is ar's too
    assert "| ar (eager) " in report and "MISMATCH" not in report and not got["failed"]
    c_line = next(line for line in report.splitlines() if line.startswith("- drafter cost c = "))
    for name in ("speculative", "eagle"):  # c both ways for every drafter that takes the option
        if name in TAKES:
            assert c_line.count(f" {name} ") == 1 and c_line.split(f" {name} ")[1].split(")")[0].count("eager") == 1
    assert "## Cost of one target forward over n new tokens, relative to n = 1 (static and eager)" in report
    assert "static (shape-static forwards, just called): cost(1) = " in report
    assert "eager (plain PyTorch): cost(1) = " in report and "as much eager as static over 1 token" in report
    args = bench.parse_args([])
    assert args.runtime == "auto" and not args.compare_runtimes  # on a CPU, comparing is asked for, not a default


def test_on_cuda_auto_compares_and_an_explicit_runtime_does_not():
    assert bench.compares(bench.parse_args([]), "cuda") and bench.compares(bench.parse_args([]), "cuda:1")
    assert not bench.compares(bench.parse_args([]), "cpu") and not bench.compares(bench.parse_args([]), "mps")
    assert not bench.compares(bench.parse_args(["--runtime", "static"]), "cuda")
    assert not bench.compares(bench.parse_args(["--runtime", "eager"]), "cuda")
    assert bench.compares(bench.parse_args(["--compare-runtimes"]), "cpu")


def test_compare_with_eager_only_is_a_one_line_error(toy_out, tmp_path):
    with pytest.raises(SystemExit) as e:
        quick(toy_out, tmp_path / "r.md", "--compare-runtimes", "--runtime", "eager")
    assert "drop --runtime eager" in str(e.value.code) and "\n" not in str(e.value.code)
    with pytest.raises(SystemExit):  # argparse refuses a runtime that is not one
        bench.parse_args(["--runtime", "fast"])


def test_static_forward_costs_run_on_the_static_path(toy_out):
    """Every tensor on the model's device (a tensor made without naming it lands on `meta` and fails)."""
    from nanospec.parts import load_models
    models = load_models(str(toy_out), "cpu")
    torch.set_default_device("meta")
    try:
        cost, step, prefix, reps, path = bench.forward_costs(models, ["ar", "speculative"], [0.0], True, "static")
    finally:
        torch.set_default_device(None)
    assert path == "static" and sorted(cost) == list(range(1, 9)) and (True, 0.0) in step
    assert bench.forward_costs(models, ["ar"], [0.0], True, "eager")[4] == "eager"
