"""The benchmark: its prompts come from validation text only, its helpers compute what they claim, the timing
wrapper (nanospec/bench/timing.py's Timed) files every call of every method under drafting or target forwards, and a
quick run on a toy model (trained here, in seconds) gives a row per registered method with greedy outputs equal
to ar's. No timing is asserted: the machine is shared (the wrapper's laws run on a fake clock)."""
import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from nanospec.bench import compare as bench
from nanospec.training import corpus
from nanospec.bench import report
from nanospec.decoding import METHODS, MODULES
from nanospec.decoding.early_exit import default_exit_layer
from nanospec.model.cache import KVCache
from nanospec.training.presets import PRESETS
from nanospec.bench.timing import Ledger, Timed, timed_models
from nanospec.fast.runtime import prepare
from toys import ROOT, every_part, random_ids, write_toy_corpus

sys.path.insert(0, str(ROOT / "scripts"))
import make_prompts  # noqa: E402  (a script, not a package module)

# ----------------------------------------------------------------------------- prompts

def test_make_prompts_is_deterministic_and_uses_only_validation_text(tmp_path):
    data = tmp_path / "data"
    stats = corpus.build_corpus(data, source=write_toy_corpus(tmp_path / "src", n_docs=30), val_every=3)
    argv = ["--val", str(data / "val.txt"), "--corpus-json", str(data / "corpus.json"),
            "--train", str(data / "train.txt"), "--per-category", "4"]
    make_prompts.main(argv + ["--out", str(tmp_path / "a.json")])
    make_prompts.main(argv + ["--out", str(tmp_path / "b.json")])
    a = (tmp_path / "a.json").read_text()
    assert a == (tmp_path / "b.json").read_text()
    prompts = json.loads(a)["prompts"]
    assert {p["category"] for p in prompts} == {"code", "prose", "repeat"}
    val_files = {name: (tmp_path / "src" / name).read_text() for name in stats["val_files"]}
    train = (data / "train.txt").read_text()
    for p in prompts:
        text = "\n".join(p["lines"])
        assert text in val_files[p["source"]] and text not in train
        assert make_prompts.MIN_CHARS <= len(text) <= make_prompts.MAX_CHARS
    for p in (p for p in prompts if p["category"] == "repeat"):
        assert p["repeat_share"] >= make_prompts.REPEAT_MIN


def test_committed_prompts_are_validation_text_of_the_default_corpus(tmp_path):
    doc = json.loads((ROOT / "data" / "prompts.json").read_text())
    counts = {c: sum(p["category"] == c for p in doc["prompts"]) for c in ("code", "prose", "repeat")}
    assert min(counts.values()) >= 10, counts
    if doc["python"] != sys.version.split()[0]:
        pytest.skip(f"prompts.json was cut from Python {doc['python']}'s stdlib, this is {sys.version.split()[0]}")
    corpus.build_corpus(tmp_path, budget_bytes=PRESETS["tiny"]["corpus_bytes"])
    val, train = (tmp_path / "val.txt").read_text(), (tmp_path / "train.txt").read_text()
    for p in doc["prompts"]:
        text = "\n".join(p["lines"])
        assert text in val, p["id"]
        assert text not in train, p["id"]


# ----------------------------------------------------------------------------- helpers

def test_helpers_on_literal_examples():
    assert report.ngram_repeats([], [1, 2, 3, 4, 1, 2, 3, 4, 1]) == (2, 2, 6)  # a loop repeats its own 4-grams
    assert report.ngram_repeats([1, 2, 3, 4], [1, 2, 3, 4, 5]) == (0, 1, 2)  # 1234 is copied from the prompt
    assert report.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert report.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert report.first_difference([1, 2], [1, 2, 3]) == 2
    # k = 2 where a step drafted: prefill 1, then steps keeping 3 (2 accepted), 1 (a plain step: nothing to say
    # of a), 1 (0 accepted, a rejection), 2 (1, a rejection): 3 accepted, 2 rejections -> a = 3/5; 6 tokens in
    # the 3 steps that drafted
    stats = {"drafted_per_step": [0, 2, 0, 2, 2], "accepted_per_step": [1, 3, 1, 1, 2],
             "guesses_per_step": [0, 2, 0, 0, 1]}
    a, per_step, ks = report.acceptance_mle([stats])
    assert a == pytest.approx(3 / 5) and per_step == pytest.approx(6 / 3) and ks == [2, 0, 2, 2]
    assert report.expected_tokens(0.5, 1) == pytest.approx(1.5)  # (1 - 0.25) / 0.5
    assert report.expected_tokens(1.0, 4) == 5 and report.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert report.leviathan(0.0, 4, 0.5) == pytest.approx(1 / 3)  # nothing accepted: 1 token for 4c + 1
    assert report.leviathan(1.0, 4, 0.0) == pytest.approx(5.0)  # free draft, always right: k + 1
    assert report.leviathan(0.5, 1, 0.0) == pytest.approx(1.5)  # (1 - 0.25) / 0.5
    assert report.table(["a", "b"], [["x", 1]]) == "| a | b |\n|---|--:|\n| x | 1 |"
    # the guesses the steps checked, by value
    assert report.chosen([2, 0, 2, 4, 0, 0, 0]) == "0 x4, 2 x2, 4 x1"
    assert report.chosen(list(range(8)), most=2) == "0 x1, 1 x1, +6 more"


def test_drafting_section_on_a_literal_example():
    """Guesses per step, plain steps and how often each number of guesses was checked leave out the prefill (the
    first entry)."""
    def run(drafted):
        return {"seconds": 1.0, "stats": {"drafted_per_step": drafted}}
    prompts = [{"id": "p1"}, {"id": "p2"}]
    m = SimpleNamespace(temperatures=[1.0], prompts=prompts, rows={1.0: {"ar": None, "speculative": None}},
                        results={1.0: {"ar": {"p1": run([0, 0]), "p2": run([0, 0])},
                                       "speculative": {"p1": run([0, 4, 0]), "p2": run([0, 4, 0, 4])}}})
    lines = report.drafting_section(m)
    row = [c.strip() for c in lines[2].splitlines()[2].strip("|").split("|")]
    assert row == ["1", "speculative", "2.40", "40%", "0 x2, 4 x3"]
    assert len(lines[2].splitlines()) == 3  # ar drafts nothing: no row


def timing(drafting, passes, target=0.1, forwards=4, wall=1.0):
    """One run's timing as bench.run_all records it beside the method's stats."""
    return {"timing": dict(wall=wall, drafting=drafting, passes=passes, target=target, forwards=forwards)}


def test_drafter_cost_comes_from_the_drafting_calls():
    results = {0.0: {"parallelspec": {"p1": timing(0.2, 4), "p2": timing(0.4, 8)},
                     "parallelspec (eager)": {"p1": timing(0.9, 3)},
                     "mtp": {"p1": timing(0.0, 0)}},  # its heads run inside the target's forward
               1.0: {"parallelspec": {"p1": timing(0.3, 3)}}}
    c = bench.drafter_costs(results, ["ar", "jacobi", "mtp", "parallelspec"], cost_1=0.1)
    assert c == {"mtp": None, "parallelspec": pytest.approx(0.6)}  # 0.9 s / 15 passes / 0.1 s, both temperatures
    assert bench.drafter_costs(results, ["parallelspec"], 0.1, " (eager)") == {"parallelspec": pytest.approx(3.0)}


# ----------------------------------------------------------------------------- timing by wrapping the models

def tick():
    """A fake clock that moves one second each time it is read: each timed call then lasts exactly one second."""
    now = iter(range(10**9))
    return lambda: float(next(now))


def spy_calls(module):
    """A list that gets the `layers` keyword of every call of `module` (a forward pre-hook on the real model)."""
    seen = []
    module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("layers")), with_kwargs=True)
    return seen


@pytest.fixture(scope="module")
def parts():
    return every_part()


@pytest.mark.parametrize("runtime", ["eager", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_timed_files_each_call_as_drafting_or_a_target_forward(runtime, temperature):
    """On a fake clock each outermost call adds one second to its kind: the ledger's seconds count the calls it
    filed there. Early-exit: every pass through the target's first E layers drafts (a pass), and so do the
    adapter and the borrowed unembedding after each guess (no pass: they finish it); the verify over
    layers E..L is a target forward (a step with no guess is one forward through every layer). Speculative: every
    call of the draft GPT is a pass. mtp: its heads, run alone on the target's state after the prompt, draft (no
    pass: they are the target's own); in a verify forward (heads=k) they are the forward's time. ar: no drafting at
    all. The EAGLE head reads the target's modules inside its own call,
    which is its own time, not a second entry. The spies on the real modules see every call on the eager path
    only: the static path replays its captured forwards (a CUDA graph, or its emulation on a CPU) without
    calling the module, so there the ledger is checked against the method's own counts alone."""
    models = every_part()  # fresh hooks for this test
    target_calls, draft_calls, eagle_calls = spy_calls(models.target), spy_calls(models.draft), spy_calls(models.eagle)
    ledger = Ledger(clock=tick())
    timed = timed_models(prepare(models, runtime)[0], ledger)
    L = models.target.config.n_layer
    E = default_exit_layer(L)  # early-exit's exit: blocks 1..E draft
    for method in ("early-exit", "speculative", "ar", "mtp", "eagle"):
        target_calls.clear(), draft_calls.clear(), eagle_calls.clear()
        ledger.clear()
        _, stats = METHODS[method](timed, random_ids(8, seed=1), 24, temperature=temperature, seed=0)
        got = ledger.totals()
        assert got["forwards"] == got["target"] == stats["target_forwards"], method
        called = runtime == "eager"  # the spies see every call (see the docstring)
        if method == "early-exit":
            guessing = sum(1 for d in stats["drafted_per_step"] if d)  # the steps that drafted
            lower = stats["drafted"] + guessing  # k guesses + the read-back, per step that drafted
            assert got["passes"] == lower and got["drafting"] == lower + 2 * stats["drafted"]  # adapter, unembed
            if called:
                assert target_calls.count((0, E)) == lower
                assert target_calls.count((E, L)) == guessing  # every verify after a draft; the others: None
        elif method == "mtp":  # the heads alone after the prefill; every verify forward runs them itself
            assert got["passes"] == 0 and got["drafting"] == 1 and not draft_calls
        elif method == "speculative":
            assert got["passes"] == got["drafting"] > 0 and (not called or got["passes"] == len(draft_calls))
        elif method == "eagle":
            assert got["passes"] > 0 and (not called or got["passes"] == len(eagle_calls))  # tree levels
            refreshes = stats["target_forwards"] - 1  # after the prefill and every verify but the last
            assert got["drafting"] == got["passes"] + refreshes  # refresh's unembed, no pass
        else:
            assert got["passes"] == got["drafting"] == 0 and not draft_calls and not eagle_calls, method


def test_without_the_layers_rule_early_exit_drafting_counts_as_target_forwards(parts, monkeypatch):
    """Negative control: a Timed that files every target call as a target forward miscounts early-exit."""
    monkeypatch.setattr(Timed, "kind_of", lambda self, call: self.kind)
    ledger = Ledger()
    _, stats = METHODS["early-exit"](timed_models(parts, ledger), random_ids(8, seed=1), 24, seed=0)
    got = ledger.totals()
    assert got["forwards"] > stats["target_forwards"] and got["passes"] == 0


def test_timed_passes_the_model_through(parts):
    ledger = Ledger()
    target = Timed(parts.target, ledger, "target")
    assert target.config is parts.target.config and target.wte is parts.target.wte  # attributes are the model's
    assert isinstance(target.new_cache(), KVCache) and target.new_cache() is not target.new_cache()  # eager: fresh
    head = target.unembed  # borrowed outside the target's forward: drafting, no pass
    assert isinstance(head, Timed) and head.model == parts.target.unembed
    assert head.kind == "drafting" and not head.counts
    fast = Timed(prepare(parts, "static")[0].target, ledger, "target")
    first = fast.new_cache()
    pooled = first.k
    del first  # its generation ended: the next cache, fresh, gets the Fast's pooled tensors, through the wrapper
    assert fast.new_cache().k is pooled and fast.new_cache() is not fast.new_cache()
    x = random_ids(5, seed=2)
    with torch.inference_mode():
        assert torch.equal(target(torch.tensor([x])).logits, parts.target(torch.tensor([x])).logits)
    assert ledger.totals()["forwards"] == 1 and ledger.depth == 0
    wrapped = timed_models(parts, ledger)
    parts_called = ("target", "draft", "eagle", "parallelspec", "early_exit")
    assert all(isinstance(getattr(wrapped, part), Timed) for part in parts_called)
    assert timed_models(type(parts)(target=parts.target), ledger).draft is None  # a missing part stays missing


# ----------------------------------------------------------------------------- the whole bench, quick

def test_quick_bench_on_a_toy_model(toy_run, tmp_path, capsys):
    results = tmp_path / "bench_results.md"
    # float64: an untrained toy model has near-tied logits, and greedy equality must not hinge on rounding
    got = bench.main(["--quick", "--ckpt", str(toy_run), "--prompts", str(ROOT / "data" / "prompts.json"),
                      "--device", "cpu", "--dtype", "float64", "--out", str(results),
                      "--json", str(tmp_path / "bench_results.json")])
    report = results.read_text()
    assert report == got["report"] and "## greedy (temperature 0)" in report and "## temperature 1" in report
    assert not got["failed"], got["failed"]
    greedy = got["summaries"][0.0]
    for name in MODULES:  # every registered method has a row, or is skipped with a reason
        skipped = any(line.startswith(f"- skipped {name}:") for line in got["skipped"])
        assert (name in greedy) != skipped, name
        if name in greedy:
            assert f"| {name} " in report
            assert greedy[name]["equal"] == 6, f"{name}: greedy output differs from ar's"  # 2 prompts x 3 categories
    assert {"ar", "speculative", "prompt-lookup"} <= set(greedy)  # the toy run trains a draft model
    figures = json.loads((tmp_path / "bench_results.json").read_text())["methods"]  # what `make figures` reads
    assert figures["ar"] == {"greedy": [1.0, 1.0], "t=1": [1.0, 1.0]}
    assert figures["speculative"]["greedy"] == [greedy["speculative"]["all"]["tokens_per_forward"],
                                                greedy["speculative"]["all"]["speedup"]]
    sampled = got["summaries"][1.0]
    for name in ("mtp", "medusa"):  # a --draft-sampling method shows both modes side by side when sampling
        assert name in sampled and f"{name} (topk)" in sampled and f"| {name} (topk) " in report
    assert not any("(" in name for name in greedy)  # greedy: one row per method, both modes are the same there
    assert "## speculative: predicted against measured" in report
    c_line = next(line for line in report.splitlines() if line.startswith("- drafter cost c = "))
    drafters = ("speculative", "early-exit", "eagle", "parallelspec")  # a drafter with calls of its own
    for name in drafters + ("mtp", "medusa"):  # each drafter once
        assert c_line.count(f" {name}") == 1, c_line
    idle = c_line.split(": made no drafter pass")[0].split("; ")[-1] if "no drafter pass" in c_line else ""
    for name in drafters:  # c from the drafter's calls, as the Timed parts measured them (unless every step was plain)
        assert name in idle or float(c_line.split(f" {name} ")[1].split(",")[0].split(";")[0]) > 0, c_line
    assert "mtp, medusa: the target's own heads" in c_line  # not a c of 0
    assert "MISMATCH" not in report
    for t in (0.0, 1.0):  # every run: the Timed target's forwards are the method's own count
        for label, by_prompt in got["results"][t].items():
            for r in by_prompt.values():
                assert r["timing"]["forwards"] == r["stats"]["target_forwards"], label
                drafter, drafted = label.split()[0] in drafters, any(r["stats"]["drafted_per_step"])
                assert (not r["timing"]["passes"] or drafter) and (r["timing"]["passes"] or not drafter or not drafted)
    # host reads per target forward: one untimed run per row and temperature, in the table's own column
    for t in (0.0, 1.0):
        assert set(got["reads"][t]) == set(got["summaries"][t]) and got["reads"][t]["ar"] == 1.0
        assert all(r >= 1 for r in got["reads"][t].values())  # at least the token each forward gives
    table = report.split("## greedy (temperature 0)")[1].split("\n\n")[1]
    head = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    ar_row = next([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if "| ar " in line)
    assert ar_row[head.index("host reads/forward")] == "1.00"
    assert "each read waits for every kernel queued before it" in report
    # host ops per target forward, from the same run: all (kernel launches), a launch is an op
    for t in (0.0, 1.0):
        assert set(got["ops"][t]) == set(got["summaries"][t])
        assert all(0 < launches <= ops for ops, launches in got["ops"][t].values())
    assert re.fullmatch(r"\d+ \(\d+\)", ar_row[head.index("host ops/forward")]) and "kernel launch" in report
    # where the drafting went: a row per method but ar and temperature, guesses per step and plain steps
    drafting = report.split("## Where the drafting went")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in drafting.splitlines()[4:]
            if line.startswith("|")]
    assert sorted((r[0], r[1]) for r in rows) == sorted((f"{t:g}", n) for t in (0.0, 1.0)
                                                        for n in got["summaries"][t] if n != "ar")
    assert all(float(r[2]) >= 0 and r[3].endswith("%") for r in rows)
    # where a step's time goes: a row per method and temperature; the drafting and target-forward calls run
    # inside the generation's wall clock, one after the other, so on a CPU their sum never exceeds it
    split = report.split("## Where a step's time goes")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in split.splitlines()[4:] if line.startswith("|")]
    assert sorted((r[0], r[1]) for r in rows) == sorted((f"{t:g}", n) for t in (0.0, 1.0) for n in got["summaries"][t])
    for t, name, wall, draft, target, rest, share in rows:
        guessers = drafters + ("mtp", "medusa")  # a trained drafter, or the target's heads (run after its forward)
        assert float(target) > 0 and float(rest) >= 0 and (float(draft) == 0 or name.split()[0] in guessers), name
