"""The bench's batch table (nanospec/bench/batch.py): its helpers on literal examples, and a run on a toy model
(trained here, in seconds) with a row per batch size and setting, greedy rows equal to batched ar's, and the
figures' numbers merged into bench_results.json beside those of the method table. No timing is asserted."""
import json
from pathlib import Path

import pytest

from nanospec.bench import compare as bench
from nanospec.bench import batch as bench_batch
from toys import train_toy

ROOT = Path(__file__).resolve().parent.parent


def test_batch_sizes_are_checked_in_one_line():
    assert bench_batch.parse_sizes("8,1,2,2") == [1, 2, 8]
    for bad in ("1,x", "0,2", "2000", ""):
        with pytest.raises(ValueError, match="--batch-sizes"):
            bench_batch.parse_sizes(bad)
    with pytest.raises(SystemExit, match="--batch-sizes"):  # refused before any model loads
        bench.main(["--batch-sizes", "1,0", "--ckpt", "no-such-folder"])


def test_a_batch_mixes_the_categories_and_repeats_only_when_it_must():
    prompts = [dict(category=c, ids=[i]) for i, c in enumerate("aaabbc")]  # a: 0 1 2, b: 3 4, c: 5
    assert bench_batch.mixed(prompts, 4) == [[0], [3], [5], [1]]
    assert bench_batch.mixed(prompts, 8) == [[0], [3], [5], [1], [4], [2], [0], [3]]


def test_the_crossover_names_the_first_batch_size_below_ar():
    speeds = {1: (100, 150, 90), 2: (190, 200, 180), 4: (350, 300, 360)}  # ar, speculative, prompt-lookup
    methods = ["ar", "speculative", "prompt-lookup"]
    got = {(0.0, m, B): dict(tokens_per_s=s[i]) for B, s in speeds.items() for i, m in enumerate(methods)}
    assert bench_batch.crossover(got, methods, [1, 2, 4], [0.0]) == [
        "- speculative, greedy: below batched ar from B = 4",
        "- prompt-lookup, greedy: below batched ar from B = 1"]
    table = bench_batch.results(got, methods, [1, 2, 4], [0.0])["greedy"]
    assert table["ar"]["4"] == [350, 1.0] and table["speculative"]["1"] == [150, 1.5]


def test_batch_table_on_a_toy_model(tmp_path):
    out = train_toy(tmp_path)
    results = tmp_path / "bench_results.md"
    (tmp_path / "bench_results.json").write_text(json.dumps({"methods": {"ar": {"greedy": [1.0, 1.0]}}}))
    # float64: an untrained toy model has near-tied logits, and greedy equality must not hinge on rounding
    got = bench.main(["--batch-sizes", "1,3", "--ckpt", str(out), "--prompts", str(ROOT / "data" / "prompts.json"),
                      "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float64", "--out", str(results),
                      "--json", str(tmp_path / "bench_results.json")])
    report = results.read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines()
            if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert [(r[0], r[1]) for r in rows] == [("1", "greedy"), ("1", "t=1"), ("3", "greedy"), ("3", "t=1")]
    for B, setting, ar, spec, lookup, cost in rows:
        assert "(1.00x, 1.00 tok/fwd)" in ar  # ar: its own baseline, one token per forward
        if setting == "greedy":  # every greedy row equals batched ar's, for both guessing methods
            assert spec.endswith(f"{B}/{B} = ar)") and lookup.endswith(f"{B}/{B} = ar)"), (spec, lookup)
        assert float(cost.split(", ")[1]) > 0
    assert sum(line.startswith("- speculative, ") for line in report.splitlines()) == 2  # greedy and t=1
    saved = json.loads((tmp_path / "bench_results.json").read_text())
    assert saved["methods"] == {"ar": {"greedy": [1.0, 1.0]}}  # the method table's numbers are kept
    assert saved["batch"] == got["batch"] and set(saved["batch"]) == {"greedy", "t=1"}
    assert set(saved["batch"]["greedy"]) == {"ar", "speculative", "prompt-lookup"}
    assert saved["batch"]["t=1"]["ar"]["3"][1] == 1.0 and saved["batch_title"]
