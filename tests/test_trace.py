"""The trace (nanospec/trace/record.py, `decode.py --trace run.html`): every target forward's guesses, how the target judged
each one, the randomness that decided it, the token that came out and its law, the cache before and after.

  - it changes nothing: every method, greedy, t=1 and t=0.7 top-p 0.9, chain and tree rules, block and traversal
    verification, typical acceptance, both --draft-sampling modes, every --adaptive rule, the static runtime: the
    traced run's tokens and stats are the untraced run's, exactly;
  - it is the run: the steps' emitted tokens are the output, one step per target forward, the accepted and
    drafted counts are the stats';
  - every verdict follows from its recorded randomness and probabilities (trace.check), and a trace recorded from
    a deliberately wrong rule is caught (made from the real source by a one-line edit; the exercises' own
    functions, whose bodies a handout blanks, by wrapping them);
  - tracing off costs nothing: no extra host read, no extra tensor operation, nothing left patched, and neither
    the methods nor a decode.py run without --trace load it;
  - the page opens in headless Chromium with no console error and shows one step per target forward and the
    emitted tokens (the test says how to install chromium and skips only where it is missing, never in CI);
  - decode.py: one line for a bad path (a folder, an extension other than .html or .json, a folder that is a file,
    a write that fails), a file that is not a trace is never replaced, a batch is refused; 64 tokens of any method
    make a page under 1 MB.
Tiny random models (toys.every_part), 32 new tokens."""
import inspect
import json
import os
import shlex
import struct
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import pytest

import decode
from nanospec.trace import browser
from nanospec.bench import calibration
from nanospec.bench import figures
from nanospec.trace import record as trace
from nanospec.rules import verify
from nanospec.decoding import METHODS, MODULES
from nanospec.steps import verify_step
from nanospec.model.load import Models
from nanospec.bench.timing import Ledger, counting_host_reads, counting_ops, timed_models
from nanospec.fast.runtime import prepare
from nanospec.tokenizer import Tokenizer
from toys import decode_error, every_part, random_head, random_ids, tiny_gpt

NEW_TOKENS = 32
PROMPT = random_ids(8, seed=1)
SAMPLINGS = {"greedy": {}, "t=1": {"temperature": 1.0, "seed": 0},
             "t=0.7 top-p 0.9": {"temperature": 0.7, "top_p": 0.9, "seed": 0},
             "t=1 top-k 5": {"temperature": 1.0, "top_k": 5, "seed": 3},
             "t=0.1": {"temperature": 0.1, "seed": 1}}  # random tiny models are nearly uniform: at t=1 the drafters
#                                                        and the target agree, at 0.1 they often do not
COSTS = {k: 1.0 + 0.3 * k for k in range(64)}  # made-up step costs for --adaptive cost: a guess costs 30% of a step
CASES = [(m, s, {}) for m in METHODS for s in ("greedy", "t=1", "t=0.7 top-p 0.9", "t=0.1")] + [
    ("speculative", "t=1 top-k 5", {}),
    ("speculative", "t=0.1", {"verify": "block"}), ("mtp", "t=1", {"verify": "block", "draft_sampling": "sample"}),
    ("early-exit", "t=0.7 top-p 0.9", {"verify": "block"}),
    ("parallelspec", "t=0.1", {"tree": "chain", "verify": "block"}),
    ("medusa", "t=0.1", {"verify": "traversal"}), ("eagle", "t=0.1", {"tree": "dynamic", "verify": "traversal"}),
    ("eagle", "greedy", {"tree": "dynamic"}), ("parallelspec", "t=0.7 top-p 0.9", {"verify": "traversal"}),
    ("medusa", "t=0.1", {"verify": "typical"}),
    ("medusa", "t=1", {"verify": "typical"}),
    ("mtp", "t=0.1", {"draft_sampling": "topk"}), ("mtp", "t=0.1", {"draft_sampling": "sample"}),
    ("mtp", "t=1", {"draft_sampling": "sample"}),
    ("medusa", "t=0.1", {"draft_sampling": "topk"}),
    ("eagle", "t=0.1", {"draft_sampling": "topk"}), ("eagle", "t=0.1", {"tree": "dynamic", "draft_sampling": "topk"}),
    ("eagle", "t=1", {"tree": "dynamic"}), ("parallelspec", "t=1", {"draft_sampling": "topk"}),
    ("speculative", "t=0.1", {"adaptive": "history"}), ("mtp", "t=0.1", {"adaptive": "confidence"}),
    ("prompt-lookup", "greedy", {"adaptive": "history"}), ("speculative", "t=0.1", {"adaptive": "cost"}),
    ("medusa", "t=1", {"adaptive": "cost"}), ("lookahead", "greedy", {"adaptive": "cost"}),
    ("jacobi", "t=0.1", {"adaptive": "cost"}), ("eagle", "t=0.7 top-p 0.9", {"adaptive": "sweep"}),
    ("speculative", "greedy", {"adaptive": "sweep"}),
    ("speculative", "t=0.1", {"runtime": "static"}), ("medusa", "t=0.1", {"runtime": "static"}),
    ("early-exit", "greedy", {"runtime": "static"})]


def case_id(case):
    method, sampling, options = case
    return " ".join([method, sampling, *(f"{k}={v}" for k, v in options.items())])


@pytest.fixture(scope="module")
def models():
    return {"eager": every_part(), "static": prepare(every_part(), "static")[0]}


def generate(models, case, traced):
    """One seeded run of the case, untraced (ids, stats, None) or traced (ids, stats, the trace's document)."""
    method, sampling, options = case
    options = dict(options)
    parts = models[options.pop("runtime", "eager")]
    if options.get("adaptive") == "cost":
        name = calibration.key(method, SAMPLINGS[sampling].get("temperature", 0.0), options)
        parts = type(parts)(**{**vars(parts), "step_costs": {name: {"seconds": COSTS}}})
    run = lambda m: METHODS[method](m, PROMPT, NEW_TOKENS, **SAMPLINGS[sampling], **options)  # noqa: E731
    if not traced:
        return (*run(parts), None)
    with trace.recording(parts) as recorder:
        ids, stats = run(recorder.models)
    return ids, stats, recorder.document(None, PROMPT, ids, stats)


@pytest.fixture(scope="module")
def runs(models):
    """Every case, untraced and traced, once for the module: {case id: ((ids, stats, None), (ids, stats, doc))}."""
    return {case_id(c): (generate(models, c, False), generate(models, c, True)) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_trace_changes_no_token(runs, case):
    (ids, stats, _), (traced_ids, traced_stats, _) = runs[case_id(case)]
    assert traced_ids == ids
    assert traced_stats == stats


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_steps_are_the_run(runs, case):
    """The steps' emitted tokens, one after the other, are the output; one step per target forward; each step's
    kept guesses and checked guesses are the stats' (run.py counts them in emit)."""
    _, (ids, stats, doc) = runs[case_id(case)]
    steps = doc["steps"]
    assert [t for s in steps for t in s["emitted"]] == ids
    assert len(steps) == stats["target_forwards"] and [s["forward"] for s in steps] == list(range(1, len(steps) + 1))
    assert [min(len(s.get("path", [])), len(s["emitted"])) for s in steps] == stats["guesses_per_step"]
    assert [s["drafted"] for s in steps] == stats["drafted_per_step"]
    assert all(len(s["tokens"]) - 1 == s["drafted"] for s in steps if "rule" in s)  # the guesses sent: the ones checked
    assert sum(len(s.get("path", [])) for s in steps) >= stats["accepted"]  # >: a stop may cut the last step
    assert steps[0]["kind"] == "prefill" and steps[0]["cache"] == [0, len(PROMPT)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_verdict_follows_from_its_randomness(runs, case):
    _, (_, _, doc) = runs[case_id(case)]
    assert trace.check(doc) == [] and doc["problems"] == []


def test_the_cases_judge_every_rule_both_ways(runs):
    """The checks above have something to check: every rule records accepted and rejected guesses, the uniform
    rules record their uniforms, typical acceptance is marked lossy, and the cost rule records its k."""
    seen = {}
    for _, (_, _, doc) in runs.values():
        for s in doc["steps"]:
            for g in s.get("nodes", []):
                seen.setdefault(s["rule"], set()).add(g["verdict"])
                tested = g["verdict"] != "unused" and (s["rule"] != "traversal" or g["w"] is not None)
                if s["rule"] in ("token", "block", "traversal") and tested:  # (traversal: a node under one that
                    assert g["u"] is not None, (s["rule"], g)  # passed is kept untested)
    assert set(seen) == {"greedy", "coupled", "token", "block", "descend", "traversal", "typical"}
    assert all({"accepted", "rejected"} <= verdicts for verdicts in seen.values()), seen
    typical = runs[case_id(("medusa", "t=0.1", {"verify": "typical"}))][1][2]
    assert all(s.get("lossy") for s in typical["steps"] if "rule" in s)
    cost = runs[case_id(("speculative", "t=0.1", {"adaptive": "cost"}))][1][2]
    assert {s["adaptive"]["rule"] for s in cost["steps"] if "adaptive" in s} == {"cost"}


def test_check_reads_a_chain_step_literally():
    """verify.py's example: p = [0.2, 0.8], q = [0.6, 0.4], guess 0 is accepted with probability 1/3. A uniform of
    0.5 rejects it and the residual norm(max(0, p - q)) = [0, 1] gives token 1; a uniform of 0.2 would have
    accepted it, so a trace that says rejected there does not add up."""
    prefill = {"forward": 1, "forwards": 1, "kind": "prefill", "read": 3, "cache": [0, 3], "emitted": [5],
               "produced": [5], "law": {"name": "p", "token": 5, "drawn": 5, "gap": None}}
    chain = {"forward": 2, "forwards": 1, "kind": "chain", "rule": "token", "read": 2, "cache": [3, 4],
             "tokens": [5, 0], "parents": [-1, 0], "path": [], "emitted": [1], "produced": [1],
             "nodes": [{"node": 1, "x": 0, "depth": 1, "p": 0.2, "q": 0.6, "accept": 1 / 3, "u": 0.5, "draw": None,
                        "verdict": "rejected"}],
             "law": {"name": "residual", "token": 1, "drawn": 1, "gap": 0.0}}
    doc = {"ids": [5, 1], "stats": {"target_forwards": 2}, "steps": [prefill, chain]}
    assert trace.check(doc) == []
    chain["nodes"][0]["u"] = 0.2
    assert trace.check(doc) == ["step 2, guess 1: u = 0.2 against accept 0.333333, yet rejected"]
    chain["nodes"][0].update(u=0.5, accept=0.2)  # p alone, as if q were 1
    assert trace.check(doc) == ["step 2, guess 1: accept 0.2 is not min(1, p/q) = min(1, 0.2/0.6)"]
    chain["nodes"][0]["accept"] = 1 / 3
    chain["cache"] = [3, 5]  # the rejected guess left in the cache
    assert trace.check(doc) == ["step 2: the cache went 3 -> 5, not to the root and 0 accepted guesses"]


# ---------------------------------------------------------------------------------------------------------
# Negative controls: a wrong rule, made from the real one by a one-line edit, leaves a trace that does not add up


def edited(function, old, new):
    """`function` with `old` (there exactly once in its source) replaced by `new`, run in its module's own globals
    (so that it calls what the module holds, as the real one does)."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"the edit {old!r} no longer applies to {function.__name__}"
    scope = {}
    exec(compile(source.replace(old, new), f"<edited {function.__name__}>", "exec"), function.__globals__, scope)
    return scope[function.__name__]


def put(monkeypatch, function, wrong):
    """`wrong` wherever nanospec holds `function` (its module, the modules that imported it by name, the rules of
    VERIFY_RULES that run it)."""
    for holder, name in trace.holders(function):
        monkeypatch.setattr(holder, name, wrong)


def keeps_the_first_rejected(p_target, q_draft, draft_tokens, generator=None):
    """The chain rule, except that it keeps the first rejected guess too."""
    n, nxt = REAL["verify_chain"](p_target, q_draft, draft_tokens, generator)
    return (n + 1).clamp(max=draft_tokens.size(-1)), nxt


def sqrt_accept_prob(p, q, x):
    """accept_prob answering sqrt(min(1, p/q)), a bigger chance than the rule's."""
    return REAL["accept_prob"](p, q, x).sqrt()


REAL = {"verify_chain": verify.verify_chain, "accept_prob": verify.accept_prob}
WRAPPED = {  # name: (the function, the wrong one, the case it runs, what check says). The exercises' own functions
    #          (verify_chain, accept_prob) are wrapped rather than edited: a handout blanks their bodies
    "a rule that keeps the first rejected guess": (verify.verify_chain, keeps_the_first_rejected,
                                                   ("speculative", "t=0.1", {}), "yet accepted"),
    "accept_prob answering sqrt(min(1, p/q))": (verify.accept_prob, sqrt_accept_prob,
                                                ("mtp", "t=0.1", {"draft_sampling": "sample"}), "is not min(1, p/q)"),
}
BROKEN = {  # name: (the function, the edit, the case it runs, what check says)
    "a rejected guess left in the output": (
        verify_step.chain_step, "[list(d[:m]) + [t] for d, m, t in zip(drafts, n, nxt)]",
        "[list(d[:m + 1]) + [t] for d, m, t in zip(drafts, n, nxt)]", ("speculative", "greedy", {}),
        "not the accepted guesses"),
    "the KV cache reset instead of rolled back": (
        verify_step.chain_step, "cache.rollback_rows([b + 1 + m for b, m in zip(before, n)])",
        "cache.rollback_rows([0 for b in before])", ("prompt-lookup", "t=0.1", {}), "the cache went"),
    "a tree's children judged against p, not what their rejected siblings left": (
        verify.verify_tree_without_replacement, "accept = accept_prob(torch.stack(P[:-1], -2), q, x)",
        "accept = accept_prob(torch.stack([P[0]] * (len(P) - 1), -2), q, x)",
        ("eagle", "t=0.1", {"tree": "dynamic", "verify": "token"}),
        "away from what is left"),
    "a fresh draw after a mismatch (sample and match)": (
        verify.verify_tree_descend, "return _descend(tokens, parents, draws.__getitem__)",
        "path = _descend(tokens, parents, draws.__getitem__)[0]\n"
        "    return path, int(sample(p_target[path[-1] if path else 0], generator))", ("lookahead", "t=0.1", {}),
        "where the law's draw gave"),
    "block verification passing u > h": (
        verify.verify_block, "passed = (u < h) | (length == 0)", "passed = (u > h) | (length == 0)",
        ("speculative", "t=0.1", {"verify": "block"}), "prefix"),
    "a coupled chain judged in a fresh race, not the one its guesses ran in": (
        verify.verify_chain_coupled, "race(p_target, noise=noise)", "race(p_target)", ("mtp", "t=0.1", {}),
        "where the law's draw gave"),
    "traversal's coin against sqrt(w)": (
        verify.verify_tree_traversal, "lambda prob: next(coins) < prob", "lambda prob: next(coins) < prob ** 0.5",
        ("medusa", "t=0.1", {"verify": "traversal"}), "tested u"),
}


@pytest.mark.parametrize("name", [*WRAPPED, *BROKEN])
def test_a_trace_of_a_wrong_rule_does_not_add_up(models, monkeypatch, name):
    if name in WRAPPED:
        function, wrong, case, says = WRAPPED[name]
    else:
        function, old, new, case, says = BROKEN[name]
        wrong = edited(function, old, new)
    assert trace.check(generate(models, case, True)[2]) == []  # the real rule
    put(monkeypatch, function, wrong)
    problems = trace.check(generate(models, case, True)[2])
    assert any(says in line for line in problems), problems


# ---------------------------------------------------------------------------------------------------------
# Off, it costs nothing


def counted(models, method):
    """(host reads by kind, tensor ops by name) of one run at t=1, the models wrapped as the bench wraps them."""
    verify.tree_tables.cache_clear()
    ledger = Ledger()
    with counting_host_reads() as reads, counting_ops(ledger) as ops:
        METHODS[method](timed_models(models, ledger), PROMPT, NEW_TOKENS, temperature=1.0, seed=0)
    return dict(reads), dict(ops.ops)


@pytest.mark.parametrize("method", ["ar", "speculative", "medusa", "eagle"])
def test_tracing_off_costs_nothing(models, method):
    """A run after a traced one reads the host and runs tensor operations exactly as a run before any: the tracer
    leaves every function it wrapped as it was. While it records, it does read (the counters see it: they would
    see a tracer left on)."""
    parts = models["eager"]
    targets = [(obj, name) for obj, name, _ in trace.Trace(parts).patches()]
    originals = [getattr(obj, name) for obj, name in targets]
    assert all(f.__module__ != "nanospec.trace.record" for f in originals)  # importing the tracer patched nothing
    before = counted(parts, method)
    with trace.recording(parts) as recorder:
        on = counted(recorder.models, method)
    assert counted(parts, method) == before
    assert [getattr(obj, name) for obj, name in targets] == originals
    assert sum(on[0].values()) > sum(before[0].values())


def test_the_methods_and_a_plain_decode_never_load_the_tracer():
    """No method file mentions it (the trace is a layer around them), and a fresh interpreter that imports every
    method and decode.py has not loaded it."""
    for name, module in MODULES.items():
        assert "trace" not in inspect.getsource(module), name
    code = "import sys, decode, nanospec.decoding; print('nanospec.trace.record' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------------------------------------------------
# The page, in a real browser


@pytest.fixture(scope="module")
def chromium():
    if browser.find() is None:
        if os.environ.get("CI"):
            pytest.fail(f"no chromium in CI: .ci/run installs it ({browser.INSTALL})")
        pytest.skip(f"no chromium on this machine: {browser.INSTALL}, then run this test again")


class Page(HTMLParser):
    """What the test reads of the dumped DOM: the body's attributes, the text of each output group, the strip's
    bars, the step detail's heading and its whole text."""

    def __init__(self, dom):
        super().__init__()
        self.body, self.groups, self.bars, self.heading, self.problems_hidden = {}, [], 0, "", None
        self.summary, self.detail = "", ""
        self.open = []  # the stack of open elements: (tag, where its text goes)
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        where = None
        if tag == "body":
            self.body = a
        elif "group" in (a.get("class") or "").split():
            self.groups.append("")
            where = "group"
        elif tag == "g" and "bar" in (a.get("class") or "").split():
            self.bars += 1
        elif a.get("id") == "problems":
            self.problems_hidden = "hidden" in a
        elif tag == "h2" and self.open and any(w == "detail" for _, w in self.open):
            where = "heading"
        elif a.get("id") == "detail":
            where = "detail"
        elif a.get("id") == "summary":
            where = "summary"
        if tag not in ("meta", "br", "img", "input", "link"):
            self.open.append((tag, where))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        places = [w for _, w in self.open if w]
        if "group" in places:
            self.groups[-1] += data
        if "heading" in places:
            self.heading += data
        if "summary" in places:
            self.summary += data
        if "detail" in places:
            self.detail += data


@pytest.mark.parametrize("case", [("speculative", "t=1", {}),
                                  ("eagle", "t=0.1", {"tree": "dynamic", "verify": "traversal"}),
                                  ("medusa", "greedy", {})], ids=case_id)
def test_the_page_shows_every_step_in_a_real_browser(chromium, runs, tmp_path, case):
    """Headless Chromium opens the page from disk at step 2: no console line at all, one group of output text and
    one bar per target forward, the groups' text the steps' emitted tokens (here '<17>' per token: the text of a
    token enters the page as text, never as markup), the detail of step 2 drawn."""
    _, (_, stats, doc) = runs[case_id(case)]
    path = tmp_path / "run.html"
    trace.write(str(path), doc)
    dom, console = browser.dump_dom(f"{path}#step=2")
    assert console == []
    page = Page(dom)
    steps = stats["target_forwards"]
    assert page.body.get("data-ready") == str(steps) and "data-error" not in page.body
    assert len(page.groups) == steps and page.bars == steps
    assert page.groups == ["".join(s["text"]) or "\u2205" for s in doc["steps"]]
    assert "".join(page.groups) == "".join(f"<{t}>" for t in doc["ids"])
    assert page.heading.startswith(f"Step 2 of {steps}") and page.problems_hidden


def test_the_page_says_when_no_draft_pays(chromium, models, runs, tmp_path):
    """A run whose cost rule found that no draft pays takes `ar`'s steps; the page's summary says why there are no
    guesses, and a run that drafted says nothing of the kind."""
    name = calibration.key("jacobi", 1.0, {"adaptive": "cost"})
    dear = Models(**{**vars(models["eager"]), "step_costs": {name: {"seconds": {0: 1.0, 1: 11.0}}}})
    with trace.recording(dear) as recorder:
        ids, stats = METHODS["jacobi"](recorder.models, PROMPT, NEW_TOKENS, **SAMPLINGS["t=1"])
    assert stats["no_draft_pays"]
    for doc, says in ((recorder.document(None, PROMPT, ids, stats), True),
                      (runs[case_id(("speculative", "t=1", {}))][1][2], False)):
        path = tmp_path / "run.html"
        trace.write(str(path), doc)
        dom, console = browser.dump_dom(path)
        assert console == [] and ("no draft pays on this machine" in Page(dom).summary) == says


def test_the_page_names_coupled_guesses_and_their_rule(chromium, runs, tmp_path):
    """mtp's default chain at t=1 is drawn in the target's own races: its step says so and gives the coupled rule,
    where a chain drawn from q (--draft-sampling sample) reads as drawn, judged by Leviathan's rule."""
    for options, says, not_says in (({}, ("coupled: each the drafter's winner", "Coupled: each position holds one race"),
                                      "fixed (point masses"),
                                     ({"draft_sampling": "sample"}, ("drawn from the drafter's q", "Leviathan's rule"),
                                      "Coupled:")):
        _, (_, _, doc) = runs[case_id(("mtp", "t=1", options))]
        shown = next(i for i, st in enumerate(doc["steps"]) if st.get("rule") in ("coupled", "token"))
        path = tmp_path / "run.html"
        trace.write(str(path), doc)
        dom, console = browser.dump_dom(f"{path}#step={shown + 1}")
        detail = Page(dom).detail
        assert console == [] and all(text in detail for text in says) and not_says not in detail, options


def test_the_browser_test_sees_a_broken_page(chromium, runs, tmp_path):
    """Negative control: the same page with an error in its script prints a console line and never says ready."""
    _, (_, _, doc) = runs[case_id(("speculative", "t=1", {}))]
    path = tmp_path / "broken.html"
    path.write_text(trace.page(doc).replace("document.body.dataset.ready = ", "null.ready = "), encoding="utf-8")
    dom, console = browser.dump_dom(path)
    assert any("Uncaught TypeError" in line for line in console), console
    assert "data-ready" not in Page(dom).body


def test_make_figures_screenshots_the_page(chromium, tmp_path):
    """`make figures` draws trace.png (the README's) the same way, from a run of eagle at temperature 1: here on
    tiny random models over bytes, a 1400 x 1150 PNG."""
    tokenizer = Tokenizer({bytes([b]): b for b in range(256)})
    target = tiny_gpt(0, vocab_size=257, block_size=96, n_future=2)
    figures.trace_figure(Models(target=target, eagle=random_head(target), tokenizer=tokenizer), tmp_path / "trace.png")
    header = (tmp_path / "trace.png").read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (1400, 1150)


# ---------------------------------------------------------------------------------------------------------
# decode.py --trace


def test_decode_writes_a_trace_with_the_same_tokens(ckpt, tmp_path, capsys):
    args = ["--ckpt", ckpt, "--device", "cpu", "--max-new-tokens", "12", "--prompt", "def f(x):", "--method", "mtp",
            "--temperature", "1", "--seed", "4", "--json"]
    decode.main(args)
    plain = json.loads(capsys.readouterr().out)
    for name in ("run.json", "run.html", "run.json"):  # the second .json replaces the first: it is a trace
        decode.main(args + ["--trace", str(tmp_path / name)])
        out = capsys.readouterr()
        assert json.loads(out.out)["ids"] == plain["ids"]
        assert f"into {tmp_path / name}" in out.err and trace.is_trace(str(tmp_path / name))
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["ids"] == plain["ids"] and doc["problems"] == [] and doc["settings"]["method"] == "mtp"
    assert doc["settings"]["command"].startswith("python decode.py --ckpt")


def test_traced_run_writes_the_run_and_a_command_a_shell_reads_back(models, tmp_path):
    """trace.traced_run, the one traced run of decode.py --trace and make figures: the tokens are an untraced run's,
    the file holds the trace it returns, and the command quotes each argument for a shell: a prompt with both
    quotes reads back whole (Python's repr, which figures once used, leaves a quote a shell never closes)."""
    run = lambda m: METHODS["speculative"](m, PROMPT, 8, temperature=1.0, seed=0)  # noqa: E731
    argv = ["--method", "speculative", "--prompt", "it's \"x\"", "--trace", "run.json"]
    path = tmp_path / "run.json"
    ids, stats, doc, size = trace.traced_run(models["eager"], run, PROMPT, str(path), {"method": "speculative"}, argv)
    assert (ids, stats) == run(models["eager"]) and doc["problems"] == []
    assert json.loads(path.read_text())["ids"] == ids and size == path.stat().st_size
    assert doc["settings"] == {"method": "speculative", "command": doc["settings"]["command"]}
    assert shlex.split(doc["settings"]["command"]) == ["python", "decode.py", *argv]


def test_decode_refuses_a_bad_trace_path_in_one_line(ckpt, tmp_path, monkeypatch):
    run = lambda *more: decode_error(ckpt, "--prompt", "def f(", *more)  # noqa: E731
    assert "is a folder" in run("--trace", str(tmp_path))
    assert "not '.txt'" in run("--trace", str(tmp_path / "run.txt"))
    assert "without an extension" in run("--trace", str(tmp_path / "run"))
    (tmp_path / "notes.html").write_text("<p>my notes</p>")
    (tmp_path / "data.json").write_text('{"format": "something else"}')
    for mine in ("notes.html", "data.json"):
        assert "is not a nanospec trace: left as it is" in run("--trace", str(tmp_path / mine))
    assert (tmp_path / "notes.html").read_text() == "<p>my notes</p>"
    assert "is not a folder" in run("--trace", str(tmp_path / "notes.html" / "run.json"))
    assert "does not exist" in run("--trace", str(tmp_path / "nowhere" / "run.json"))
    assert "one prompt's run" in run("--prompt", "class A:", "--trace", str(tmp_path / "run.json"))

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(trace, "write_atomic", refused)
    assert run("--trace", str(tmp_path / "run.json")) == \
        f"error: cannot write the trace to {tmp_path / 'run.json'}: Permission denied"


def test_a_64_token_page_of_any_method_is_under_a_megabyte(models):
    """The page of 64 tokens at t=1 (lookahead: greedy too, its tree is the largest), template included."""
    sizes = {}
    for method, sampling in [(m, "t=1") for m in METHODS] + [("lookahead", "greedy")]:
        with trace.recording(models["eager"]) as recorder:
            ids, stats = METHODS[method](recorder.models, PROMPT, 64, **SAMPLINGS[sampling])
        sizes[f"{method} {sampling}"] = len(trace.page(recorder.document(None, PROMPT, ids, stats)).encode())
    print("\n" + "\n".join(f"{name:20s} {size / 1024:6.0f} KB" for name, size in sizes.items()))
    assert max(sizes.values()) < 1_000_000, sizes
