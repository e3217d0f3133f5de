"""
Bookkeeping every decoding method shares: checking the prompt, counting target forwards, stopping at
end-of-text, the token budget or the context limit, and the stats dict that `decode.py --json`, the
benchmark and the tests read.

A method calls `run.emit(tokens)` once per target forward with the tokens that forward produced (the
accepted guesses plus the target's own next token); `emit` keeps what fits and says when to stop.
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from nanospec.verify import verify_chain, verify_chain_greedy, verify_chain_point_mass, warp


@dataclass
class Run:
    prompt: list  # prompt token ids
    max_new_tokens: int  # budget of generated tokens
    block_size: int  # the target's context: prompt + output never exceed it
    eot: int = None  # end-of-text id, or None to never stop early
    generator: torch.Generator = None  # the one RNG of this generation: never re-seeded mid-run
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
                break
            if self.room() <= 0:
                self.stop = "context"
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


def start(models, prompt_ids, max_new_tokens, seed=None):
    """Check the request and set up the run; one clear ValueError per bad input."""
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
    device = models.target.wte.weight.device
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # a fresh nondeterministic seed
    else:
        generator.manual_seed(seed)
    return Run(prompt, max_new_tokens, block_size, models.eot, generator)


def check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


# How a drafter with a distribution picks its guesses when sampling (temperature > 0). Greedy always takes the
# top-k: at temperature 0 the warped q is one-hot and both modes are the same thing.
DRAFT_SAMPLING = ("topk", "sample")
DRAFT_SAMPLING_OPTIONS = {
    "draft_sampling": (str, "sample", "how the drafter guesses when sampling (temperature > 0): sample = draw each "
                                      "guess from the drafter's own warped q (a tree's siblings without "
                                      "replacement) and verify with rejection sampling against that q; topk = its "
                                      "most likely tokens, verified as point masses. Greedy always uses topk"),
}


def samples_drafts(draft_sampling, temperature):
    """True when this run draws its guesses from q_draft: draft_sampling "sample" and temperature > 0."""
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {draft_sampling!r}")
    return draft_sampling == "sample" and temperature > 0


def tensor(ids, device):
    return torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)


def chain_step(run, target, cache, last, drafts, sampling, q_draft=None, heads=False):
    """The verify step every chain method shares: one target forward over [last, d1..dk], a chain rule, and
    the cache rolled back to what was accepted.

    last: the newest emitted token (not yet in the cache); drafts: k guesses for the tokens after it;
    sampling: (temperature, top_k, top_p); q_draft (k, V): the draft's probabilities when the guesses were
    sampled from a draft model (Leviathan's rule), or None for deterministic guesses (point-mass rule).
    Returns (emitted tokens = accepted drafts + the target's next token, n_accepted, the forward's Output).
    Afterwards the cache holds the sequence up to the last accepted draft; the new token is not in it yet.
    """
    n_before = cache.length
    out = target(tensor([last] + list(drafts), cache.k.device), cache=cache, heads=heads)
    emitted, n = chain_verify(run, cache, n_before, out.logits[0], drafts, sampling, q_draft)
    return emitted, n, out


def chain_verify(run, cache, n_before, logits, drafts, sampling, q_draft=None):
    """The second half of `chain_step`, for a method that runs the verify forward its own way (`early-exit`
    runs only the upper layers): the chain rule on that forward's logits (k+1, V) over [last, d1..dk], then the
    cache rolled back to n_before (its length before last) + last + the accepted drafts.
    Returns (emitted tokens, n_accepted)."""
    draft_ids = torch.tensor(list(drafts), dtype=torch.long, device=logits.device)  # (k,)
    if sampling[0] == 0:  # greedy: both rules reduce to "accept while guess == argmax"; skip building p
        n, nxt = verify_chain_greedy(logits, draft_ids)
    elif q_draft is None:
        n, nxt = verify_chain_point_mass(warp(logits, *sampling), draft_ids, run.generator)
    else:  # warp(logits): the target's law (k+1, V) after last, d1, ..., dk
        n, nxt = verify_chain(warp(logits, *sampling), q_draft, draft_ids, run.generator)
    cache.rollback(n_before + 1 + n)  # keep last and the accepted drafts
    return list(drafts[:n]) + [int(nxt)], n
