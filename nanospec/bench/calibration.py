"""
The step costs the cost rule prices speculation with (`--adaptive cost`, nanospec/steps/adaptive.py): how many
seconds one step of a method takes on this machine when it checks k guesses, for k = 0 (a plain step) up to the
method's draft_len. Measured, never typed in: a short run of the method under `--adaptive sweep` (every k in
turn, a few steps each), with the models wrapped as the bench wraps them (nanospec/bench/timing.py: a Ledger notes when
each target forward begins), so that a step's seconds run from the start of its forward to the start of the
next one: the forward over its guesses, the rule, and the drafting of the next step's guesses, host work
included. Each k is the mean of its steps less the fastest and the slowest tenth (`trimmed_mean`): tokens per second
depend on a step's mean cost, which a median misses when a step's work varies with what it accepted, and the trimmed
tenths keep a step stalled by other work on a shared machine from moving it.

    costs = measure(models, "speculative", 1.0, {})   # {0: 0.0021, 1: 0.0027, 2: 0.0031, 3: 0.0036, 4: 0.0041}
    attach(models, "out", [("speculative", 1.0, {})])  # from out/calibration.json, or measured and kept there

They are kept per machine (device, dtype, thread count, runtime path, torch) and, for each method, per the weights
it runs on (the target's, and its drafter's: draft.pt, eagle.pt, heads.pt, parallelspec.pt or early_exit.pt), in
the run folder beside the checkpoints (calibration.json: generated, never committed), so the next run of decode.py
or the bench reads them instead of measuring again; retraining the target or a method's drafter measures that
method afresh. A method only reads the table attached to its
models (`Models.step_costs`), so the same seed and the same calibration give the same tokens.
"""
import json
import os
from contextlib import contextmanager

import torch

from nanospec.model.checkpoint import fingerprint
from nanospec.decoding import METHODS, MODULES, parts_for
from nanospec.steps.adaptive import DraftLength
from nanospec.steps.pricing import costs_key
from nanospec.steps.options import Sampling, read_options
from nanospec.bench.timing import Ledger, timed_models
from nanospec.tokenizer import write_atomic

FILE = "calibration.json"
FORMAT = 5  # 5: mtp's and medusa's heads run in the verify forward (4: each k's seconds a trimmed mean; 3: a
# median; 2: entries keyed on the target's trunk alone): a file of an older format is measured again
TEXTS = (  # what the sweeps continue, one after the other: code, prose, and text that repeats itself
    "    def close(self):\n        if self._file is not None:\n            self._file.close()\n",
    "The module provides functions for reading and writing files, and for finding out how large",
    "    self.assertEqual(f(1), 1)\n    self.assertEqual(f(2), 4)\n    self.assertEqual(f(3), 9)\n")
RUNS = 6  # sweeps (after one to warm up); each k gets SWEEP_STEPS - 1 steps per pass through the k's
CHANCES_OVER = 64  # the tokens of each sweep whose steps tell the chances (the bench's generations are as long)
SWEEP_TOKENS = 160  # the most tokens of one sweep: enough steps of every k for their seconds


def key(method, temperature, options):
    """What a run needs calibrated (adaptive.costs_key: the method, greedy or sampled, the options that change a
    step's cost), or None when it does not price its steps (its --adaptive is not cost). A ValueError for a bad
    option."""
    module = MODULES[method]
    opts = read_options(module.OPTIONS, options)
    if getattr(opts, "adaptive", None) != "cost":
        return None
    return costs_key(module.__name__.rsplit(".", 1)[-1], Sampling(temperature).greedy, opts)


@torch.inference_mode()
def measure(models, method, temperature, options, runs=RUNS, log=None):
    """{"seconds": {k: seconds of one step with k guesses}, "chances": [how often guess 1, 2, ... was accepted when
    it was made]} of `method` on `models` (as the run will have them: wrapped for its runtime path), from `runs`
    sweeps over TEXTS in turn, after one to warm up. The seconds come from every step; the chances, the cost rule's
    prior (what the method's guesses are worth at this temperature), from the steps of the first CHANCES_OVER
    tokens of each text only: a small model's long greedy continuation falls into a loop, where every guess
    looks good. log(line) is told once the first sweep ran (a bad option fails in it first, unannounced)."""
    ledger = Ledger(cuda=False)  # host seconds: every step reads its verdict on the host, which waits for the GPU
    timed = timed_models(models, ledger)
    options = {**options, "adaptive": "sweep"}
    steps = {}  # k -> seconds of each step with k guesses between two alike
    offered, won = {}, {}  # guess i -> the steps that made it, the steps that accepted it
    for run in range(runs + 1):
        text = TEXTS[run % len(TEXTS)]
        prompt = models.tokenizer.encode(text) if models.tokenizer else [1 + (i * (run + 2)) % 7 for i in range(12)]
        prompt = prompt[-max(1, models.target.config.block_size // 4):]  # a small context leaves room to sweep
        ledger.clear()
        with watching(DraftLength, "update") as verdicts:  # (drafted, accepted) of every verified step
            room = min(SWEEP_TOKENS, models.target.config.block_size - len(prompt) - 1)
            _, stats = METHODS[method](timed, prompt, room, temperature=temperature, seed=run, **options)
        drafted, starts = stats["drafted_per_step"], ledger.starts  # one of each per target forward
        if not run and log:
            log(f"calibrating {method} ({'greedy' if Sampling(temperature).greedy else 'sampled'}) on this machine: "
                f"the seconds of a step with each number of guesses, for --adaptive cost ({runs} sweeps)")
        made = 0  # tokens generated before the step
        for (k, accepted), kept in zip(verdicts, stats["accepted_per_step"][1:]):
            if run and made < CHANCES_OVER:
                for i in range(1, k + 1):
                    offered[i] = offered.get(i, 0) + 1
                for i in range(1, accepted + 1) if isinstance(accepted, int) else accepted:  # a chain; a tree's path
                    won[i] = won.get(i, 0) + 1
            made += kept
        for j in range(1, len(starts) - 1):  # step j: from its forward to the next; the prefill is forward 0
            if run and drafted[j] == drafted[j + 1]:  # the next step's drafting is of the same k
                steps.setdefault(drafted[j], []).append(starts[j + 1] - starts[j])
    if not steps:
        raise ValueError(f"{method} made too few steps to time (context {models.target.config.block_size})")
    chances = [won.get(i, 0) / offered[i] for i in range(1, max(offered, default=0) + 1)]
    return {"seconds": {k: trimmed_mean(s) for k, s in sorted(steps.items())}, "chances": chances}


def trimmed_mean(values, cut=0.1):
    """The mean of `values` less the `cut` fastest and the `cut` slowest of them (whole values: none of 9, 1 of 10 at
    0.1). [1, 2, 3, 4, 5, 6, 7, 8, 9, 100] -> 5.5 (the median: 5.5; the mean: 14.5); [1, 1, 1, 2, 2, 2, 2, 2, 9, 9] ->
    2.625 (the median: 2, deaf to the slow steps that are a fifth of them)."""
    values = sorted(values)
    n = int(len(values) * cut)
    kept = values[n:len(values) - n]
    return sum(kept) / len(kept)


@contextmanager
def watching(owner, name):
    """Inside `with watching(DraftLength, "update") as calls:` every call's first two arguments are appended to
    `calls` (the method still runs as it is): how the calibration sees each verified step's verdict."""
    calls, real = [], getattr(owner, name)

    def watched(self, *args):
        calls.append(args[:2])
        return real(self, *args)
    setattr(owner, name, watched)
    try:
        yield calls
    finally:
        setattr(owner, name, real)


def machine(models, runtime_path):
    """This machine, device, dtype, threads, runtime path and torch, as one string: a calibration is good for
    exactly these, and for the weights its entry names (fingerprints)."""
    target = models.target
    while not isinstance(target, torch.nn.Module):  # under timing.Timed or runtime.Fast: the model itself
        target = target.model
    weight = target.wte.weight
    device = torch.cuda.get_device_name(weight.device) if weight.is_cuda else weight.device.type
    return f"{device}|{weight.dtype}|threads {torch.get_num_threads()}|{runtime_path}|torch {torch.__version__}"


def fingerprints(models, method):
    """The weights `method` runs on, each part hashed (checkpoint.fingerprint), as one string: 'target
    c378fe4020ce2011' for ar, 'target c378fe4020ce2011, draft 03d003a3d90eff08' for speculative, 'early_exit none'
    where a part it uses when present is absent. The target's MTP heads count only for the methods that read them
    (parts_for: mtp and medusa use heads.pt, which changes no other method's steps)."""
    parts = parts_for([method])
    target = models.target.state_dict()  # through any wrapper (timing.Timed, runtime.Fast): the model's own
    if "heads" not in parts:
        target = {name: t for name, t in target.items() if not name.startswith("heads.")}
    prints = [f"target {fingerprint(target)}"]
    for part in (p for p in parts if p != "heads"):  # the heads are the target's, hashed with it
        module = getattr(models, part)
        prints.append(f"{part} {'none' if module is None else fingerprint(module.state_dict())}")
    return ", ".join(prints)


def read(path):
    """The calibration file as a dict, {} if there is none or it is of an older FORMAT (measured again, then
    replaced); None if a file of that name is not one (never overwritten)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    version = data.get("format") if isinstance(data, dict) else None
    if isinstance(version, int) and version < FORMAT and "machines" in data:
        return {}
    return data if version == FORMAT else None


def attach(models, ckpt, wanted, runtime_path="eager", log=None):
    """Set models.step_costs for every (method, temperature, options) in `wanted` that prices its steps (--adaptive
    cost), from ckpt/calibration.json where it holds them for this machine, else measured now and written there
    (when the folder is writable and the file is a calibration). log(line): told what is measured. Returns the
    models."""
    wanted = [(method, t, options, key(method, t, options)) for method, t, options in wanted]
    wanted = [w for w in wanted if w[3] is not None]
    if not wanted:
        return models
    path = os.path.join(ckpt, FILE) if ckpt else None
    data = read(path) if path else {}
    here = machine(models, runtime_path)
    known = (data or {}).get("machines", {}).get(here, {})
    costs, new = dict(models.step_costs or {}), False
    for method, temperature, options, name in wanted:
        entry = f"{name}|{fingerprints(models, method)}"  # retrained weights: another entry, measured afresh
        if entry not in known:
            known[entry], new = measure(models, method, temperature, options, log=log), True
        costs[name] = {"seconds": {int(k): s for k, s in known[entry]["seconds"].items()},
                       "chances": known[entry]["chances"]}
    models.step_costs = costs
    if new and data is not None and path and os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
        machines = {**data.get("machines", {}), here: known}  # other machines' and weights' entries kept
        write_atomic(path, json.dumps({"format": FORMAT, "machines": machines}, indent=1))
    elif new and data is None and log:
        log(f"{path} is not a calibration file: left as it is, the calibration kept for this run only")
    return models
