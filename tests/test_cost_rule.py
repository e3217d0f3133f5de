"""`--adaptive cost` (nanospec/steps/adaptive.py): each step drafts the k that maximises expected tokens per
second, E(k) / T(k), from the step costs nanospec/bench/calibration.py measures, and nothing when no draft pays.

  - the rule's arithmetic, literal: best_k on the docstring's example, interpolate, the chances it learns;
  - every method that drafts takes it: greedy it is `ar` token for token, whether drafting pays (it drafts) or
    not (plain steps only); without a calibration it drafts draft_len, as "off"; the same seed and step costs give
    the same tokens; `sweep` visits every k;
  - sampling keeps the target's law, for a chain (speculative) and a tree (medusa), with step costs at which the
    rule's choice of the second step depends on how the first went (the test checks that it does);
  - the calibration: every k timed, kept in the run folder and read back, never written over a file it did not
    write, keyed by the thread count and by the weights each method runs (a retrained drafter is measured afresh,
    an older file's format measured again and replaced).
Timings are never asserted: the step costs here are tables made up for the test."""
import copy
import json
import os

import pytest
import torch

from nanospec.bench import calibration
from nanospec.decoding import METHODS, MODULES, parts_for
from nanospec.steps import verify_step
from nanospec.steps.adaptive import DraftLength
from nanospec.steps.pricing import FORGET, Price, best_k, interpolate
from nanospec.model.load import Models
from laws import empirical_law, exact_law, method_law, sequence_codes, tv, tv_bound
from toys import SAMPLING_MODEL, every_part, random_ids, tiny_gpt, toy_gpt

PRICED = [name for name, module in MODULES.items() if "cost" in (module.OPTIONS.get("adaptive") or [()] * 6)[5]]
CHEAP = {k: 1.0 + 0.01 * k for k in range(300)}  # a guess costs 1% of a step: drafting pays
DEAR = {k: 1.0 + 10.0 * k for k in range(300)}  # a guess costs ten steps: it never does


def priced(models, method, seconds, temperature=0.0, **options):
    """models with `seconds` as the step costs of `method` (its --adaptive cost run at this temperature), and no
    measured chances (the rule's own prior)."""
    name = calibration.key(method, temperature, {**options, "adaptive": "cost"})
    return Models(**{**vars(models), "step_costs": {name: {"seconds": seconds}}})


def test_best_k_is_the_most_tokens_per_second():
    seconds = [1.0, 1.2, 1.3, 1.45]
    assert best_k([0.8, 0.6, 0.3], seconds, range(4)) == 3  # E/T = 1.0, 1.5, 1.85, 1.86
    assert best_k([0.2, 0.05, 0.01], seconds, range(4)) == 0  # 1.0, 1.0, 0.96, 0.86: no draft pays
    assert best_k([0.8, 0.6, 0.3], seconds, (0, 1)) == 1  # only the menu's k
    assert best_k([0.2], [1.0, 1.2], range(2)) == 0  # a tie goes to the smaller k


def test_interpolate_between_and_beyond_the_measured_k():
    assert interpolate({0: 1.0, 2: 1.4}, 3) == pytest.approx([1.0, 1.2, 1.4, 1.4])  # above the measured: flat
    assert interpolate({1: 1.0, 2: 2.0, 5: 3.0}, 6) == pytest.approx([1e-9, 1.0, 2.0, 7 / 3, 8 / 3, 3.0, 3.0])
    assert interpolate({1: 1.0, 3: 1.4}, 4)[0] == pytest.approx(0.8)  # below: the line through the first two
    assert interpolate({3: 2.0}, 1) == [2.0, 2.0]
    with pytest.raises(ValueError):
        interpolate({}, 2)


def test_the_chances_start_at_the_prior_learn_and_forget():
    price = Price({"seconds": {0: 1.0}}, 3, range(4))
    assert price.chances() == pytest.approx([0.5, 0.35, 0.245])  # PRIOR, then PRIOR_DECAY times the one before
    memory = round(1 / (1 - FORGET))  # the steps the rule remembers (50)
    for _ in range(3 * memory):
        price.observe(3, [1, 2, 3])  # every guess accepted
    assert min(price.chances()) > 0.9
    for _ in range(3 * memory):
        price.observe(3, [])  # every first guess rejected: the later ones never even judged
    assert price.chances()[0] < 0.15
    for _ in range(6 * memory):
        price.observe(0, [])  # plain steps: what was counted fades, the prior comes back
    assert price.chances() == pytest.approx([0.5, 0.35, 0.245], abs=0.01)
    measured = Price({"seconds": {0: 1.0}, "chances": [0.1, 0.02]}, 3, range(4))  # what the calibration saw
    assert measured.chances() == pytest.approx([0.1, 0.02, 0.014])  # the last: PRIOR_DECAY times the one before


def test_without_step_costs_the_rule_drafts_draft_len():
    length = DraftLength("cost", 4, costs=None)
    length.update(4, 0)
    assert (length.rule, length.k) == ("off", 4)


def test_a_rule_that_starts_at_no_draft_never_drafts():
    """A plain step offers no guess, so the books only fade towards the prior they start at: k = 0 for good."""
    length = DraftLength("cost", 4, costs={"seconds": DEAR})
    assert (length.never, length.k) == (True, 0)
    for _ in range(500):
        length.update(0, 0)
        assert length.k == 0
    assert not DraftLength("cost", 4, costs={"seconds": CHEAP}).never  # a draft pays: it drafts
    dear_at_the_prior = {"seconds": {0: 1.0, 1: 1.6}}  # E/T at k = 1: 1.5 / 1.6 with pi_1 = 0.5; 1.9 / 1.6 at 0.9
    assert DraftLength("cost", 1, costs=dear_at_the_prior).never
    assert not DraftLength("cost", 1, costs={**dear_at_the_prior, "chances": [0.9]}).never  # the calibration's
    assert not DraftLength("sweep", 4).never  # starts at k = 0, then tries the others


@pytest.fixture(scope="module")
def models():
    return every_part()


@pytest.mark.parametrize("method", PRICED)
def test_greedy_is_ar_whether_drafting_pays_or_not(models, method):
    prompt = random_ids(8, seed=2)
    expect = METHODS["ar"](models, prompt, 40)[0]
    ids, cheap = METHODS[method](priced(models, method, CHEAP), prompt, 40, adaptive="cost")
    assert ids == expect
    ids, dear = METHODS[method](priced(models, method, DEAR), prompt, 40, adaptive="cost")
    assert ids == expect and not cheap["no_draft_pays"]
    assert set(dear["drafted_per_step"]) == {0}, "a guess that costs ten steps was drafted"
    if method != "prompt-lookup":  # (random text: its lookups may find nothing to copy)
        assert max(cheap["drafted_per_step"]) > 0, "a guess that costs 1% of a step was never drafted"


@pytest.mark.parametrize("method", PRICED)
def test_a_method_no_draft_pays_for_runs_ars_own_steps(models, method, monkeypatch):
    """When the cost rule starts at k = 0 it stays there (above), so the method's run is `ar`'s from the prefill on:
    the same tokens for a seed at t = 1 too, and no step through the method's loop (its plain step's own_token)."""
    def own_token(*args):
        raise AssertionError("a plain step went through the method's loop")
    monkeypatch.setattr(verify_step, "own_token", own_token)
    prompt = random_ids(8, seed=4)
    for temperature in (0.0, 1.0):
        expect = METHODS["ar"](models, prompt, 30, temperature=temperature, seed=5)[0]
        ids, stats = METHODS[method](priced(models, method, DEAR, temperature), prompt, 30, temperature=temperature,
                                     seed=5, adaptive="cost")
        assert ids == expect and set(stats["drafted_per_step"]) == {0} and stats["no_draft_pays"]


@pytest.mark.parametrize("method", ["speculative", "medusa", "eagle", "parallelspec", "lookahead"])
def test_the_same_seed_and_step_costs_give_the_same_tokens(models, method):
    table = {k: 1.0 + 0.3 * k for k in range(300)}
    runs = [METHODS[method](priced(models, method, table, 1.0), random_ids(8, seed=3), 30, temperature=1.0, seed=7,
                            adaptive="cost") for _ in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][1]["drafted_per_step"] == runs[1][1]["drafted_per_step"]


@pytest.mark.parametrize("method", PRICED)
def test_sweep_tries_every_k_in_turn(models, method):
    _, stats = METHODS[method](models, random_ids(8, seed=1), 60, temperature=1.0, seed=0, adaptive="sweep")
    steps = stats["drafted_per_step"][1:]  # after the prefill
    assert steps[:3] == [0, 0, 0] and max(steps) > 0  # 3 steps of k = 0 first (SWEEP_STEPS), then more


# ---------------------------------------------------------------------------------------------------------
# Sampling: the target's law with the rule choosing k from what it saw


# k = 2 pays at the prior (E/T = 1.85 / 1.6 > 1), and after a first step whose guesses all failed (pi_1 ~ 0.25)
# no k pays: the second step then drafts nothing. After a good first step it drafts again.
SWITCHING = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9}


def speculative_law_distance(n=2000):
    """(TV distance of speculative's first 3 tokens from the target's law, its bound, the second steps' k) over n
    seeded runs with the cost rule on SWITCHING's step costs. V = 5: 125 outcomes; tv_bound(125, 2000) = 0.158."""
    target = toy_gpt(0, n_layer=2)
    models = priced(Models(target=target, draft=toy_gpt(50)), "speculative", SWITCHING, 1.0, draft_len=3)
    prompt, second, seqs = [1, 3], set(), []
    for s in range(n):
        ids, stats = METHODS["speculative"](models, prompt, 5, temperature=1.0, seed=s, draft_len=3, adaptive="cost")
        seqs.append(ids[:3])
        second.add(stats["drafted_per_step"][2] if len(stats["drafted_per_step"]) > 2 else None)
    law = exact_law(target, prompt, 3, (1.0, None, None))
    return tv(empirical_law(sequence_codes(torch.tensor(seqs), 5), 125), law), tv_bound(125, n), second


def test_speculative_with_the_cost_rule_follows_the_targets_law():
    """The second verify step's k depends on the first one's verdicts: both choices happen."""
    distance, bound, second = speculative_law_distance()
    assert 0 in second and max(second - {None}) > 0, second  # the rule drafted again, or not, after what it saw
    assert distance < bound, f"TV {distance:.4f} >= bound {bound:.4f}"


def test_the_law_test_sees_a_broken_rule_with_the_cost_rule_on(monkeypatch):
    """The negative control: the same runs with the residual left out (a rejection draws from p again) fail the
    same bound, so the test above has the power to see a rule that loses the law."""
    from nanospec.rules import verify
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    distance, bound, _ = speculative_law_distance()
    assert distance > bound, f"TV {distance:.4f} within the bound {bound:.4f}"


def test_medusa_with_the_cost_rule_follows_the_targets_law():
    """A drawn tree of up to 4 guesses priced by the rule; first 3 tokens, V = 5, 1500 draws: bound 0.184."""
    models = priced(Models(target=tiny_gpt(3, **SAMPLING_MODEL)), "medusa", SWITCHING, 1.0, tree="0;1;0,0;1,0")
    prompt, sampling, n = [1, 2], (1.0, None, None), 1500
    law, accepted = method_law(models, prompt, 3, n, "medusa", sampling, tree="0;1;0,0;1,0", adaptive="cost")
    assert tv(law, exact_law(models.target, prompt, 3, sampling)) < tv_bound(5 ** 3, n)
    assert accepted > n / 8, accepted


# ---------------------------------------------------------------------------------------------------------
# The calibration


FAKE = {"seconds": {0: 1.0, 1: 1.5}, "chances": [0.3]}  # what the tests below pretend was measured


def test_a_step_costs_the_mean_of_its_steps_less_the_fastest_and_slowest_tenth():
    assert calibration.trimmed_mean([1, 2, 3, 4, 5, 6, 7, 8, 9, 100]) == 5.5  # a stalled step left out
    assert calibration.trimmed_mean([1, 1, 1, 2, 2, 2, 2, 2, 9, 9]) == 2.625  # slow steps a fifth of them: counted
    assert calibration.trimmed_mean([3.0]) == 3.0 and calibration.trimmed_mean(list(range(9))) == 4.0  # none cut


def test_the_calibration_times_every_k(models):
    costs = calibration.measure(models, "speculative", 1.0, {"draft_len": 3}, runs=1)
    assert sorted(costs["seconds"]) == [0, 1, 2, 3] and all(s > 0 for s in costs["seconds"].values())
    assert len(costs["chances"]) == 3 and all(0 <= c <= 1 for c in costs["chances"])


def test_the_calibration_is_kept_in_the_run_folder_and_read_back(models, tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: measured.append(a[1]) or FAKE)
    wanted = [("speculative", 1.0, {"adaptive": "cost"}), ("medusa", 0.0, {"adaptive": "cost"}),
              ("ar", 0.0, {}), ("speculative", 1.0, {})]  # ar and --adaptive off price nothing
    m = calibration.attach(Models(**vars(models)), str(tmp_path), wanted)
    assert measured == ["speculative", "medusa"] and len(m.step_costs) == 2
    again = calibration.attach(Models(**vars(models)), str(tmp_path), wanted)
    assert measured == ["speculative", "medusa"] and again.step_costs == m.step_costs  # read, not measured
    data = json.loads((tmp_path / calibration.FILE).read_text())
    assert data["format"] == calibration.FORMAT and len(data["machines"]) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count: another machine, measured afresh
        calibration.attach(Models(**vars(models)), str(tmp_path), wanted[:1])
    finally:
        torch.set_num_threads(threads)
    assert measured[-1] == "speculative" and len(json.loads((tmp_path / calibration.FILE).read_text())["machines"]) == 2


def test_a_file_of_that_name_that_is_not_a_calibration_is_left_alone(models, tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: FAKE)
    mine = tmp_path / calibration.FILE
    mine.write_text("my notes")
    lines = []
    m = calibration.attach(Models(**vars(models)), str(tmp_path), [("speculative", 1.0, {"adaptive": "cost"})],
                           log=lines.append)
    assert mine.read_text() == "my notes" and m.step_costs and "left as it is" in lines[-1]
    assert not [f for f in os.listdir(tmp_path) if f != calibration.FILE]  # no temporary file left behind


def copied(models, part, retrained):
    """models with a copy of `part` ("draft", "eagle", ..., or "heads": the target's MTP heads): retrained (one
    weight moved), or the very same weights."""
    name = "target" if part == "heads" else part
    module = copy.deepcopy(getattr(models, name))
    if retrained:
        with torch.no_grad():
            next(iter(module.heads.parameters() if part == "heads" else module.parameters())).add_(0.01)
    return Models(**{**vars(models), name: module})


@pytest.mark.parametrize("part", ["draft", "eagle", "parallelspec", "early_exit", "heads"])
def test_the_calibration_key_names_the_weights_each_method_runs(models, part):
    """A retrained part changes the key of every method that runs it (parts_for) and of no other: ar never reads
    draft.pt, nor speculative the MTP heads. The same weights in another copy keep every key."""
    same, new = copied(models, part, retrained=False), copied(models, part, retrained=True)
    for method in MODULES:
        key = calibration.fingerprints(models, method)
        assert calibration.fingerprints(same, method) == key, method
        assert (calibration.fingerprints(new, method) != key) == (part in parts_for([method])), method


def test_a_retrained_drafter_is_measured_afresh(models, tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: measured.append(a[1]) or FAKE)
    wanted = [("speculative", 1.0, {"adaptive": "cost"}), ("prompt-lookup", 0.0, {"adaptive": "cost"})]
    calibration.attach(Models(**vars(models)), str(tmp_path), wanted)
    calibration.attach(Models(**vars(models)), str(tmp_path), wanted)  # the same weights: read back
    assert measured == ["speculative", "prompt-lookup"]
    calibration.attach(copied(models, "draft", retrained=True), str(tmp_path), wanted)
    assert measured == ["speculative", "prompt-lookup", "speculative"]  # prompt-lookup runs no draft: read back


def test_an_older_calibration_file_is_measured_again_and_replaced(models, tmp_path, monkeypatch):
    """Format 2 keyed every entry on the target's trunk alone (in the machine's name), so its step costs may be a
    stale drafter's: read as no file, measured again, and replaced by the current format. A format it does not
    know (a later nanospec's) is left as it is."""
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: measured.append(a[1]) or FAKE)
    wanted = [("speculative", 1.0, {"adaptive": "cost"})]
    name = calibration.key(*wanted[0])
    here = calibration.machine(models, "eager") + "|target c378fe4020ce2011"
    path = tmp_path / calibration.FILE
    path.write_text(json.dumps({"format": 2, "machines": {here: {name: {"seconds": {"0": 9.0}, "chances": [0.9]}}}}))
    m = calibration.attach(Models(**vars(models)), str(tmp_path), wanted)
    assert measured == ["speculative"] and m.step_costs[name] == FAKE
    data = json.loads(path.read_text())
    assert data["format"] == calibration.FORMAT == 5 and here not in data["machines"]
    later = json.dumps({"format": calibration.FORMAT + 1, "machines": {}})
    path.write_text(later)
    calibration.attach(Models(**vars(models)), str(tmp_path), wanted)
    assert measured == ["speculative", "speculative"] and path.read_text() == later


def test_a_menu_k_no_step_reaches_is_priced_at_the_largest_measured():
    """`lookahead` prices all-or-nothing, its menu (0, 17), but its trees held 8-11 guesses in the calibration (what
    its pool and window give). Drawn on as a line, 17 guesses cost 1.9 plain steps, and two rejected trees sent the
    rule into plain steps for good (81% of greedy steps in the bench); priced as the 11 they are, it drafts on."""
    costs = {"seconds": {0: 1.12e-3, 8: 1.40e-3, 11: 1.64e-3},
             "chances": [0.35, 0.27, 0.27, 0.0, 0.0, 0.06, 0.0, 0.0, 0.026, 0.0, 0.0]}
    price = Price(costs, 17, (0, 17))
    assert price.seconds[17] == pytest.approx(1.64e-3) and price.best() == 17
    price.observe(11, [])
    price.observe(8, [])
    assert price.best() == 17
