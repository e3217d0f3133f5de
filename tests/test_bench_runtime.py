"""The bench and the runtime paths (issue 20; issue 26: "speed is one layer, chosen once"): a row is (method,
options, path), its models are runtime.prepare's for that path, wrapped once per path; the report says which
path ran; comparing runtimes (the default on CUDA, --compare-runtimes anywhere) shows every method on the static
path with an eager row "name (eager)" beside it, speedups against the static `ar`, drafter cost c and the
forward-cost table both ways. On the CPU the static path is replayed by the emulation (graphs.Emulated): these
tests check the logic, not the gain."""
import pytest
import torch

from nanospec.bench import compare as bench
from nanospec.decoding import MODULES
from nanospec.bench.timing import Timed
from nanospec.fast import graphs
from nanospec.fast.runtime import Fast, prepare
from toys import PROMPTS


def quick(ckpt, out, *flags):
    """A small quick bench: one prompt per category, a few tokens, float64 (no near-ties)."""
    return bench.main(["--quick", "--ckpt", str(ckpt), "--prompts", PROMPTS, "--device", "cpu", "--dtype",
                       "float64", "--prompts-per-category", "1", "--max-new-tokens", "8", "--out", str(out), *flags])


def test_table_rows_put_every_method_on_every_path():
    names = list(MODULES)
    plain = bench.table_rows(names, 0.0)
    assert plain == {name: (name, {}, "eager") for name in names}  # greedy: one row per method, its defaults
    both = bench.table_rows(names, 1.0, ("static", "eager"))
    labels = list(both)
    for name in names:  # every method on both paths, the eager row right after the static one
        assert both[name] == (name, {}, "static") and both[f"{name} (eager)"] == (name, {}, "eager")
        assert labels.index(f"{name} (eager)") == labels.index(name) + 1
    for label, (name, options, path) in both.items():
        if "draft_sampling" in options:  # the other drafting mode, on the table's own path
            assert path == "static" and label == f"{name} ({options['draft_sampling']})"
    assert any("draft_sampling" in options for _, options, _ in both.values())


def test_set_up_wraps_the_models_once_per_path(toy_out, tmp_path):
    args = bench.parse_args(["--quick", "--ckpt", str(toy_out), "--prompts", PROMPTS, "--device", "cpu", "--methods",
                             "speculative", "--compare-runtimes", "--out", str(tmp_path / "r.md")])
    setup = bench.set_up(args)
    static, eager = setup["paths"]["static"], setup["paths"]["eager"]
    assert list(setup["paths"]) == ["static", "eager"]  # the table's path first
    for part in ("target", "draft"):  # the Timed layer outermost, over runtime.prepare's
        assert isinstance(getattr(static, part), Timed) and isinstance(getattr(static, part).model, Fast)
        assert getattr(eager, part).model is getattr(setup["models"], part)  # eager: the model itself
        assert getattr(static, part).ledger is getattr(eager, part).ledger is setup["ledger"]
    assert prepare(setup["models"], "static")[0].target is static.target.model  # one Fast per model, kept


def test_runtime_flag_picks_the_path_and_the_header_says_which_ran(toy_out, tmp_path):
    got = quick(toy_out, tmp_path / "r.md", "--runtime", "static", "--temperatures", "0",
                "--methods", "speculative,jacobi")
    line = next(line for line in got["report"].splitlines() if line.startswith("- runtime: "))
    assert line.startswith("- runtime: --runtime static;")
    assert "ran static (shape-static forwards, replay emulated on the CPU) for every row" in line
    assert "forward costs below: static" in line
    assert "ar (eager)" not in got["summaries"][0.0]  # not comparing on a CPU unless asked
    eager = quick(toy_out, tmp_path / "e.md", "--runtime", "eager", "--temperatures", "0", "--methods", "ar")
    assert "the forwards ran eager (plain PyTorch) for every row; forward costs below: eager" in eager["report"]
    auto = quick(toy_out, tmp_path / "a.md", "--temperatures", "0", "--methods", "ar")
    assert "--runtime auto; the forwards ran eager (plain PyTorch) for every row" in auto["report"]  # a CPU


def test_comparing_runtimes_shows_eager_and_static_side_by_side(toy_out, tmp_path):
    got = quick(toy_out, tmp_path / "r.md", "--compare-runtimes", "--methods", "speculative,eagle,jacobi")
    report = got["report"]
    for t in (0.0, 1.0):
        rows = got["summaries"][t]
        assert rows["ar"]["all"]["speedup"] == pytest.approx(1.0)
        for name in ("ar", "speculative", "eagle", "jacobi"):  # every method, both paths
            assert name in rows and f"{name} (eager)" in rows, name
            if name == "ar":  # the same code reads alike (the others price their steps with each path's own costs)
                assert got["reads"][t][name] == got["reads"][t][f"{name} (eager)"]
    assert got["summaries"][0.0]["ar (eager)"]["equal"] == 3  # the eager row's greedy output is ar's too
    assert "| ar (eager) " in report and "MISMATCH" not in report and not got["failed"]
    line = next(line for line in report.splitlines() if line.startswith("- runtime: "))
    assert "static (shape-static forwards, replay emulated on the CPU): ar, speculative, eagle, jacobi" in line
    assert "eager (plain PyTorch): ar (eager), speculative (eager)" in line
    c_line = next(line for line in report.splitlines() if line.startswith("- drafter cost c = "))
    idle = c_line.split(": made no drafter pass")[0].split("; ")[-1] if "no drafter pass" in c_line else ""
    assert "speculative" not in idle  # it drafts on the toy model (its draft GPT also reads each prompt)
    for name in ("speculative", "eagle"):  # c on each path its rows made drafter passes on (--adaptive cost prices
        # each path with its own calibration: one may draft where the other takes plain steps)
        passes = {label: sum(run["timing"]["passes"] for t in (0.0, 1.0) for run in got["results"][t][label].values())
                  for label in (name, f"{name} (eager)")}
        if not any(passes.values()):
            assert name in idle
            continue
        assert c_line.count(f" {name} ") == 1 and name not in idle
        shown = c_line.split(f" {name} ")[1].split(",")[0].split(";")[0]  # "0.41 (eager 0.38)", "no pass (eager
        # 0.38)" or "0.41"
        assert shown.startswith("no pass") == (not passes[name])
        assert ("(eager " in shown) == bool(passes[f"{name} (eager)"])
    assert "## Cost of one target forward over n new tokens, relative to n = 1 (static and eager)" in report
    assert "static (shape-static forwards, replay emulated on the CPU): cost(1) = " in report
    assert "eager (plain PyTorch): cost(1) = " in report and "as much eager as static over 1 token" in report
    assert "Every speedup here is against ar on the static path" in report
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
    from nanospec.model.load import load_models
    models = load_models(str(toy_out), "cpu")
    torch.set_default_device("meta")
    try:
        cost, step, prefix, reps, path = bench.forward_costs(models, ["ar", "speculative"], [0.0], True, "static")
    finally:
        torch.set_default_device(None)
    assert path == "static" and sorted(cost) == list(range(1, 9)) and (True, 0.0) in step
    assert bench.forward_costs(models, ["ar"], [0.0], True, "eager")[4] == "eager"


def test_timed_runs_on_a_replayed_path_only_replay(toy_out, tmp_path, monkeypatch):
    """A shape is recorded at its second sight, and a capture costs many replays (on CUDA: three warm-up calls and
    the recording), so a row on a replayed path runs each prompt REPLAY_WARMUPS times untimed first: every forward
    its timed runs make through the graphs is a replay. Negative control: with no untimed runs, a timed run meets
    a shape for the first time (or records it)."""
    timing, outcomes = [False], []
    real_call, real_timed = graphs.Graphs.__call__, bench.timed

    def call(self, fn, *inputs, key=(), protect=()):
        if timing[0]:
            full = (key, tuple((tuple(x.shape), x.dtype, x.device) for x in inputs))
            outcomes.append("replay" if full in self.entries else "capture" if full in self.seen else "first")
        return real_call(self, fn, *inputs, key=key, protect=protect)

    def timed(*args, **kwargs):
        timing[0] = True
        try:
            return real_timed(*args, **kwargs)
        finally:
            timing[0] = False
    monkeypatch.setattr(graphs.Graphs, "__call__", call)
    monkeypatch.setattr(bench, "timed", timed)
    flags = ("--runtime", "static", "--methods", "prompt-lookup,eagle", "--max-new-tokens", "16")
    assert not quick(toy_out, tmp_path / "r.md", *flags)["failed"]
    assert outcomes and set(outcomes) == {"replay"}
    monkeypatch.setattr(bench, "REPLAY_WARMUPS", 0)
    outcomes.clear()
    quick(toy_out, tmp_path / "s.md", *flags)
    assert set(outcomes) > {"replay"}


def test_the_header_gives_c_for_each_path_that_drafted():
    """Each path prices its steps with its own calibration, so a drafter may make passes on one and not the other:
    the header says c where it did, "no pass" where it did not, and lists a method as idle only when neither
    path drafted; the MTP heads are the target's own."""
    from nanospec.bench.report import drafter_costs_text
    text = drafter_costs_text({"speculative": 0.41, "eagle": None, "parallelspec": 0.3, "early-exit": None,
                               "mtp": None}, {"speculative": 0.38, "eagle": 0.52})
    assert text == ("speculative 0.41 (eager 0.38), eagle no pass (eager 0.52), parallelspec 0.30; mtp: the "
                    "target's own heads (run in its verify forward, their seconds the forward's; run alone, drafting "
                    "with no drafter pass); early-exit: made no drafter pass")
    assert drafter_costs_text({}, {}) == "no method with a trained drafter ran"
