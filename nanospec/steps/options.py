"""
What a caller asks of a decoding method, checked: the sampling settings (`Sampling`: temperature, top-k, top-p)
and the method's own options (`Option`, one table per method, read by decode.py for its flags and by
`read_options` for the method's values). Every default and every bound is written once, in that table.

The verification rules by name (`VERIFY_RULES`): the one table from a --verify name to its rule, the functions of
nanospec/rules/verify.py that judge each kind of guesses it can judge. Every --verify option (`verify_option`) and
the verify steps (verify_step.py) read it, and so does the trace (nanospec/trace/record.py), which wraps them.
"""
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

from nanospec.rules.verify import (typical_accept, verify_block, verify_chain, verify_tree_descend,
                                   verify_tree_traversal, verify_tree_without_replacement)

MIN_TEMPERATURE = 1e-4  # below it (and above 0) logits / temperature can overflow to inf: use 0 for greedy


class Sampling(NamedTuple):
    """How the output is drawn: warp(logits, *sampling) is the law every token follows. Temperature 0 = greedy."""
    temperature: float = 0.0
    top_k: int = None  # keep the k most likely tokens (None: all)
    top_p: float = None  # keep the smallest set of most likely tokens with this much mass (None: all)

    @property
    def greedy(self):
        return self.temperature == 0

    def check(self):
        """Self, or a one-line ValueError naming the bad setting."""
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature {t} is too small to sample with (below {MIN_TEMPERATURE} the scaled "
                             f"logits overflow): use 0 for greedy decoding")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self

    def guesses_drawn(self, draft_sampling):
        """Does the drafter DRAW its guesses from its warped q_draft this run? With --draft-sampling sample and
        temperature > 0; otherwise it takes its top-k (greedy: q is one-hot and both modes are the same)."""
        return draft_sampling == "sample" and not self.greedy

    def guesses_coupled(self, draft_sampling):
        """Does the drafter run its q in the race the target's token will win (--draft-sampling coupled, temperature
        > 0), so that its guesses are judged by verify_chain_coupled?"""
        return draft_sampling == "coupled" and not self.greedy


class Option(NamedTuple):
    """One method option: decode.py makes it a --kebab-case flag, `read_options` fills in and checks it."""
    type: type
    default: object  # None: the method picks a value from the model (e.g. "all its heads")
    help: str
    low: float = None  # bounds, checked when the value is not None
    high: float = None
    choices: tuple = None


# How a drafter with a distribution picks its guesses when sampling: draw them from q_draft, or take its top-k; a
# chain drafter that guesses every position at once (mtp's heads) may also run its q in the target's own race.
DRAFT_SAMPLING = ("topk", "sample")
DRAFT_SAMPLING_MEANINGS = {
    "coupled": "each guess is the winner under the drafter's q of the race the target's token at that position wins "
               "under p (one random draw per position for both), accepted while the two are the same token: the "
               "same law without rejection sampling (verify_chain_coupled; --verify does not apply)",
    "sample": "draw each guess from the drafter's own warped q (a tree's siblings without replacement) and verify "
              "with rejection sampling against that q (--verify)",
    "topk": "its most likely tokens, verified as point masses"}


def draft_sampling_option(coupled=False):
    """The --draft-sampling option: sample (the default) or topk; with `coupled`, coupled too, and the default."""
    modes = (("coupled",) if coupled else ()) + ("sample", "topk")
    meanings = "; ".join(f"{mode} = {DRAFT_SAMPLING_MEANINGS[mode]}" for mode in modes)
    return {"draft_sampling": Option(str, modes[0], f"how the drafter guesses when sampling (temperature > 0): "
                                                    f"{meanings}. Greedy always uses topk",
                                     choices=DRAFT_SAMPLING + (("coupled",) if coupled else ()))}


DRAFT_SAMPLING_OPTION = draft_sampling_option()
COUPLED_DRAFT_SAMPLING_OPTION = draft_sampling_option(coupled=True)


# The verification rules, by the name every method's --verify option takes: the one table of them, which
# verify_step.py runs and every --verify option reads. Greedy, each is "accept while the guess is the argmax".
@dataclass
class Rule:
    """A verification rule: what it does, and the function of nanospec/rules/verify.py that judges each kind of
    guesses it can judge (None: it cannot). A method's guesses come as a chain, a tree of guesses DRAWN from a
    drafter's q (judged against q_draft), or a tree of guesses not drawn (copies, top-k, iterates: point masses)."""
    meaning: str  # for --verify's help
    chain: object = None  # (p_target, q_draft, guesses, generator) -> (n accepted, next token), tensors (B,)
    drawn_tree: object = None  # (p_target, q_draft, tokens, parents, generator) -> (path, next token)
    fixed_tree: object = None  # (p_target, tokens, parents, generator=) -> (path, next token)
    padded: bool = False  # its chain rule judges each guess by those before it alone: a padded row may stop at its own


KINDS = ("chain", "drawn_tree", "fixed_tree")  # what guesses a rule judges: Rule's fields of that name
KIND_NAMES = {"chain": "a chain of guesses", "drawn_tree": "a tree of drawn guesses",
              "fixed_tree": "a tree of guesses not drawn (--draft-sampling topk)"}
VERIFY_RULES = {
    "token": Rule("one guess at a time, from the root down (Leviathan's rule; on a tree, recursive rejection)",
                  chain=verify_chain, drawn_tree=verify_tree_without_replacement, fixed_tree=verify_tree_descend,
                  padded=True),
    "block": Rule("a chain jointly (block verification, arXiv 2403.10444: the same law, at least as many accepted)",
                  chain=verify_block),
    "traversal": Rule("a drawn tree from its leaves up (traversal verification, arXiv 2505.12398: the same law, "
                      "more accepted)", drawn_tree=verify_tree_traversal),
    "typical": Rule("Medusa's typical acceptance of the top-k guesses, whatever --draft-sampling says (LOSSY when "
                    "sampling)", fixed_tree=typical_accept),
}


def rules_for(*kinds):
    """The names of the rules that judge any of `kinds` (KINDS), "token" first:
    rules_for("chain") -> ("token", "block")."""
    return tuple(name for name, rule in VERIFY_RULES.items() if any(getattr(rule, kind) is not None for kind in kinds))


# The rule a --verify left unset runs, by the guesses it judges: the fastest lossless rule measured on them
# (docs/benchmark.md, "The default verification rule of a drawn tree"). A drawn tree: traversal, which accepts at
# least as many guesses and whose walk on the host costs a few numpy operations where the top-down rule runs ~50
# tensor operations per tree.
DEFAULT_RULE = {"chain": "token", "drawn_tree": "traversal", "fixed_tree": "token"}


def rule_for(rule, kind):
    """The name of the rule that judges guesses of `kind` (KINDS) under --verify `rule`; None: DEFAULT_RULE's."""
    return DEFAULT_RULE[kind] if rule is None else rule


def verify_option(*kinds):
    """The --verify option of a method whose guesses come as `kinds` (see rules_for). A method that draws trees
    leaves it unset (None): each step's guesses get their kind's DEFAULT_RULE (a tree drawn, or its top-k with
    --draft-sampling topk); the rest default to "token"."""
    rules = rules_for(*kinds)
    meanings = "; ".join(f"{rule} = {VERIFY_RULES[rule].meaning}" for rule in rules)
    if "drawn_tree" not in kinds:
        return {"verify": Option(str, "token", f"how the target judges the guesses when sampling: {meanings}",
                                 choices=rules)}
    default = f"{DEFAULT_RULE['drawn_tree']} for a tree of drawn guesses, {DEFAULT_RULE['fixed_tree']} for the rest"
    return {"verify": Option(str, None, f"how the target judges the guesses when sampling: {meanings} (default: "
                                        f"{default})", choices=rules)}


def read_options(options, given):
    """A method's options table + the values given -> a namespace with every option, defaults filled in. Any
    unknown name, value out of bounds or not among the choices is a one-line ValueError (decode.py calls this
    before loading the models; generate calls it again for everyone else)."""
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; this method takes: {', '.join(options) or 'none'}")
    values = {name: given.get(name, opt.default) for name, opt in options.items()}
    for name, opt in options.items():
        v = values[name]
        if v is None:
            continue
        if opt.choices is not None and v not in opt.choices:
            raise ValueError(f"{name} must be one of {', '.join(opt.choices)}, got {v!r}")
        if (opt.low is not None and v < opt.low) or (opt.high is not None and v > opt.high):
            raise ValueError(f"{name} must be in {opt.low}..{opt.high}, got {v}")
    return SimpleNamespace(**values)
