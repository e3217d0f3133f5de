"""The benchmark: its prompts come from validation text only, its helpers compute what they claim, and a quick
run on a toy model (trained here, in seconds) gives a row per registered method with greedy outputs equal
to ar's. No timing is asserted: the machine is shared."""
import json
import random
import sys
from pathlib import Path

import pytest

import train_tiny
from nanospec import bench, corpus, report
from nanospec.presets import PRESETS
from nanospec.decoding import MODULES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_prompts  # noqa: E402  (a script, not a package module)

WORDS = ("buffer reader stream codec frame socket header record table parser token value index offset cache "
         "window queue worker timer event signal handler client server packet field option module").split()


def toy_document(rng, d):
    """Python-like text with docstrings, comments, varied code and methods that repeat a pattern."""
    def sentence():
        return " ".join(rng.choice(WORDS) for _ in range(9)).capitalize() + "."

    def name():
        return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"

    parts = [f'"""Module {d}: {sentence()}\n\n{sentence()}\n{sentence()}\n{sentence()}\n"""\n\nimport os\n']
    for f in range(6):
        a, b, c = name(), name(), name()
        parts.append(f"def {a}({b}, {c}=None):\n    \"\"\"{sentence()}\n\n    {sentence()}\n    {sentence()}\n"
                     f"    {sentence()}\n    \"\"\"\n    # {sentence()}\n    # {sentence()}\n    # {sentence()}\n"
                     f"    {c} = {b}.{name()}({rng.randrange(100)})\n    if {c} > {rng.randrange(100)}:\n"
                     f"        {b} = os.{name()}({c}, {b})\n    for {name()} in range({c}):\n"
                     f"        {b}.{name()}({c} + {rng.randrange(9)})\n    return {name()}({b}, {c})\n")
    methods = "".join(f"    def get_{w}(self, key):\n        if key not in self._{w}s:\n"
                      f"            raise KeyError(key)\n        return self._{w}s[key]\n\n"
                      for w in rng.sample(WORDS, 5))
    parts.append(f"class {name().title().replace('_', '')}:\n{methods}")
    return "\n\n".join(parts)


def write_toy_corpus(folder, n_docs=12, seed=0):
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        (folder / f"mod{d:02d}.py").write_text(toy_document(rng, d))
    return folder


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
    # k = 2, 10 tokens: prefill 1, then steps keeping 3 (2 accepted), 1 (0, a rejection), 2 (1, a rejection),
    # 3 (2): 5 accepted, 2 rejections -> a = 5/7; 9 tokens in 4 steps
    a, per_step = report.acceptance_mle([{"accepted_per_step": [1, 3, 1, 2, 3]}], k=2, max_new_tokens=10)
    assert a == pytest.approx(5 / 7) and per_step == pytest.approx(9 / 4)
    assert report.leviathan(0.0, 4, 0.5) == pytest.approx(1 / 3)  # nothing accepted: 1 token for 4c + 1
    assert report.leviathan(1.0, 4, 0.0) == pytest.approx(5.0)  # free draft, always right: k + 1
    assert report.leviathan(0.5, 1, 0.0) == pytest.approx(1.5)  # (1 - 0.25) / 0.5
    assert report.table(["a", "b"], [["x", 1]]) == "| a | b |\n|---|--:|\n| x | 1 |"


def test_drafter_cost_comes_from_the_methods_own_drafting_time():
    # a method's stats: seconds inside run.drafting(passes) and the passes made there
    assert bench.drafting({"draft_time": 0.2, "drafter_passes": 4}) == (0.2, 4)
    assert bench.drafting({"new_tokens": 8}) == (0.0, 0)  # a run that never drafted
    results = {0.0: {"parallelspec": {"p1": {"stats": {"draft_time": 0.2, "drafter_passes": 4}},
                                      "p2": {"stats": {"draft_time": 0.4, "drafter_passes": 8}}},
                     "speculative": {"p1": {"stats": {"new_tokens": 8}}}}}
    c = bench.drafter_costs(results, ["ar", "jacobi", "speculative", "parallelspec"], cost_1=0.1)
    assert c == {"speculative": None, "parallelspec": pytest.approx(0.5)}  # 0.6 s / 12 passes / 0.1 s


# ----------------------------------------------------------------------------- the whole bench, quick

def train_toy(folder):
    """A toy run folder, folder/out, with the tokenizer, the target and every drafter (5 steps each, seconds):
    useless text, but every method runs on it. tests/test_bench_inputs.py and tests/test_gpu_check.py use it."""
    src = write_toy_corpus(folder / "src")
    train_tiny.main(["--preset", "toy", "--max-iters", "5", "--corpus", str(src), "--device", "cpu",
                     "--data-dir", str(folder / "data"), "--out-dir", str(folder / "out")])
    return folder / "out"


def test_quick_bench_on_a_toy_model(tmp_path, capsys):
    train_toy(tmp_path)
    results = tmp_path / "bench_results.md"
    # float64: an untrained toy model has near-tied logits, and greedy equality must not hinge on rounding
    got = bench.main(["--quick", "--ckpt", str(tmp_path / "out"), "--prompts", str(ROOT / "data" / "prompts.json"),
                      "--device", "cpu", "--dtype", "float64", "--out", str(results)])
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
    sampled = got["summaries"][1.0]
    for name in ("mtp", "medusa"):  # a --draft-sampling method shows both modes side by side when sampling
        assert name in sampled and f"{name} (topk)" in sampled and f"| {name} (topk) " in report
    assert not any("(" in name for name in greedy)  # greedy: one row per method, both modes are the same there
    assert "## speculative: predicted against measured" in report
    c_line = next(line for line in report.splitlines() if line.startswith("- drafter cost c = "))
    drafters = ("speculative", "early-exit", "mtp", "medusa", "eagle", "parallelspec")
    for name in drafters:  # each drafter once
        assert c_line.count(f" {name}") == 1, c_line
    for name in ("eagle", "parallelspec"):  # c from the method's own drafting timer, as its stats report it
        assert float(c_line.split(f" {name} ")[1].split(",")[0].split(";")[0]) > 0, c_line
    assert "MISMATCH" not in report
    # where a step's time goes: a row per method and temperature; the drafting and target-forward timers run
    # inside the generation's wall clock, one after the other, so on a CPU their sum never exceeds it
    split = report.split("## Where a step's time goes")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in split.splitlines()[4:] if line.startswith("|")]
    assert sorted((r[0], r[1]) for r in rows) == sorted((f"{t:g}", n) for t in (0.0, 1.0) for n in got["summaries"][t])
    for t, name, wall, draft, target, rest, share in rows:
        assert float(target) > 0 and float(rest) >= 0 and (float(draft) > 0) == (name.split()[0] in drafters), name
