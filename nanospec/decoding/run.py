"""
What every decoding method does around its idea: the sampling settings (`Sampling`), the method's own options
(`Option`, `read_options`), and the run record (`Run`): the prompt checked, target forwards counted, stopping at
end-of-text, the token budget or the context limit, and the stats dict that `decode.py --json`, the benchmark
and the tests read.

A method calls `run.emit(tokens)` once per target forward with the tokens that forward produced (the accepted
guesses plus the target's own next token); `emit` keeps what fits and says when to stop.
"""
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import NamedTuple

import torch

from nanospec.verify import sample, warp

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

    def draws(self, draft_sampling):
        """Does the drafter DRAW its guesses from its warped q_draft this run? With --draft-sampling sample and
        temperature > 0; otherwise it takes its top-k (greedy: q is one-hot and both modes are the same)."""
        return draft_sampling == "sample" and not self.greedy


class Option(NamedTuple):
    """One method option: decode.py makes it a --kebab-case flag, `read_options` fills in and checks it."""
    type: type
    default: object  # None: the method picks a value from the model (e.g. "all its heads")
    help: str
    low: float = None  # bounds, checked when the value is not None
    high: float = None
    choices: tuple = None


# How a drafter with a distribution picks its guesses when sampling: draw them from q_draft, or take its top-k.
DRAFT_SAMPLING = ("topk", "sample")
DRAFT_SAMPLING_OPTION = {
    "draft_sampling": Option(str, "sample", "how the drafter guesses when sampling (temperature > 0): sample = "
                                            "draw each guess from the drafter's own warped q (a tree's siblings "
                                            "without replacement) and verify with rejection sampling against that "
                                            "q; topk = its most likely tokens, verified as point masses. Greedy "
                                            "always uses topk", choices=DRAFT_SAMPLING),
}


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


@dataclass
class Run:
    prompt: list  # prompt token ids
    max_new_tokens: int  # budget of generated tokens
    block_size: int  # the target's context: prompt + output never exceed it
    sampling: Sampling  # checked
    generator: torch.Generator  # the one RNG of this generation, on the model's device: never re-seeded mid-run
    eot: int = None  # end-of-text id, or None to never stop early
    out: list = field(default_factory=list)  # generated ids so far
    accepted_per_step: list = field(default_factory=list)  # tokens produced by each target forward
    target_forwards: int = 0
    stop: str = None  # why generation ended: "eot", "max_new_tokens" or "context"
    t0: float = field(default_factory=time.perf_counter)
    draft_time: float = 0.0  # seconds inside `with run.drafting():`, for methods that report their drafter's share

    @property
    def seq(self):
        return self.prompt + self.out

    def room(self):
        """How many more tokens the sequence can take before it fills the context."""
        return self.block_size - len(self.prompt) - len(self.out)

    def draft_room(self, k):
        """Clamp a draft length so the verify forward (last token + k guesses) stays inside the context."""
        return max(0, min(k, self.room() - 1, self.max_new_tokens - len(self.out) - 1))

    def sample(self, logits):
        """One token (an int) from the target's warped law: logits (V,)."""
        return int(sample(warp(logits, *self.sampling), self.generator))

    def emit(self, tokens):
        """Record one target forward that produced `tokens`; keep those that fit. Returns True when done."""
        self.target_forwards += 1
        kept = 0
        for t in tokens:
            if self.eot is not None and t == self.eot:
                self.stop = "eot"
                break
            self.out.append(int(t))
            kept += 1
            if len(self.out) >= self.max_new_tokens:
                self.stop = "max_new_tokens"
            elif self.room() <= 0:
                self.stop = "context"
            if self.stop:
                break
        self.accepted_per_step.append(kept)
        return self.stop is not None

    @contextmanager
    def drafting(self):
        """`with run.drafting():` around a drafter's work adds its wall time to draft_time."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.draft_time += time.perf_counter() - t

    def stats(self, **extra):
        n = len(self.out)
        return {"new_tokens": n, "target_forwards": self.target_forwards,
                "tokens_per_forward": n / max(1, self.target_forwards),
                "accepted_per_step": self.accepted_per_step, "wall_time": time.perf_counter() - self.t0,
                "stop": self.stop, **extra}


def start(models, prompt_ids, max_new_tokens, sampling=Sampling(), seed=None):
    """Check the request and set up the run; one clear ValueError per bad input."""
    sampling = Sampling(*sampling).check()
    block_size = models.target.config.block_size
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token of text")
    if len(prompt) >= block_size:
        raise ValueError(f"the prompt is {len(prompt)} tokens but the model's context is {block_size}: shorten it")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    vocab = models.target.config.vocab_size
    if max(prompt) >= vocab or min(prompt) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab}): was it encoded with another tokenizer?")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    generator = torch.Generator(device=models.target.wte.weight.device)
    if seed is None:
        generator.seed()  # a fresh nondeterministic seed
    else:
        generator.manual_seed(seed)
    return Run(prompt, max_new_tokens, block_size, sampling, generator, models.eot)


def tensor(ids, device):
    """Token ids -> a (1, T) LongTensor on `device` (the model's: cache.device or model.wte.weight.device)."""
    return torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)


def prefill(run, target, cache):
    """The target reads the prompt and picks the first token itself, like `ar`. Returns (that token, the
    forward's Output: logits (1, P, V), hidden (1, P, C)). The token is not emitted yet, nor in the cache."""
    out = target(tensor(run.prompt, cache.device), cache=cache)
    return run.sample(out.logits[0, -1]), out
