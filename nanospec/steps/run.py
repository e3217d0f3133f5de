"""
What every decoding method does around its idea, the run record (`Run`, made by `new_run`): the prompt and the
sampling settings checked, one random generator on the model's device, target forwards counted, stopping at
end-of-text, the token budget or the context limit, and the stats dict that `decode.py --json`, the benchmark
and the tests read. The settings and the methods' options themselves are options.py.

A method calls `run.emit(tokens, drafted)` once per target forward with the tokens that forward produced (the
accepted guesses plus the target's own next token) and the number of guesses it checked, until `run.done`; `emit`
keeps what fits, says when to stop, and counts: the run is the one acceptance counter every method's stats come
from (`acceptance`). How long the forwards and the drafting took is not the method's business: decode.py and the
benchmark time them from outside (nanospec/bench/timing.py wraps the models). Beside the run: what every method
does the same way, written once (the first token, `ar`'s plain steps, a cache with room past the context, a drafter
that fits).
"""
from dataclasses import dataclass, field

import torch

from nanospec.device import seeded_generator
from nanospec.model.checkpoint import train_hint
from nanospec.rules.verify import pick_token
from nanospec.steps.options import Sampling


@dataclass
class Run:
    prompt: list  # prompt token ids
    max_new_tokens: int  # budget of generated tokens
    block_size: int  # the target's context: prompt + output never exceed it
    sampling: Sampling  # checked: warp(logits, *sampling) is the law of every token
    generator: torch.Generator  # the one RNG of this generation, on the model's device: never re-seeded mid-run
    eot: int = None  # end-of-text id, or None to never stop early
    out: list = field(default_factory=list)  # generated ids so far
    accepted_per_step: list = field(default_factory=list)  # tokens produced by each target forward
    guesses_per_step: list = field(default_factory=list)  # of those, accepted guesses (the rest: the target's own)
    drafted_per_step: list = field(default_factory=list)  # guesses each target forward checked
    target_forwards: int = 0
    stop: str = None  # why generation ended: "eot", "max_new_tokens" or "context"
    no_draft_pays: bool = False  # the cost rule found at the start that no draft pays here: `ar`'s steps (first_token)

    @property
    def seq(self):
        return self.prompt + self.out

    @property
    def done(self):
        """Has the run stopped (an end-of-text, the token budget or the context)?"""
        return self.stop is not None

    def room(self):
        """How many more tokens the sequence can take before it fills the context."""
        return self.block_size - len(self.prompt) - len(self.out)

    def draft_room(self, k):
        """Clamp a draft length so the verify forward (last token + k guesses) stays inside the context."""
        return max(0, min(k, self.room() - 1, self.max_new_tokens - len(self.out) - 1))

    def sample(self, logits):
        """One token (an int) from the target's warped law: logits (V,) (greedy: the argmax, verify.pick_token)."""
        return int(pick_token(logits, *self.sampling, generator=self.generator))

    def emit(self, tokens, drafted=0):
        """Record one target forward that checked `drafted` guesses and produced `tokens` (the accepted guesses,
        then the target's own token); keep those that fit. Returns True when done."""
        self.target_forwards += 1
        kept = self.keep(tokens)
        self.accepted_per_step.append(kept)
        self.guesses_per_step.append(min(kept, len(tokens) - 1))  # the last of `tokens` is the target's own
        self.drafted_per_step.append(drafted)
        return self.stop is not None

    def keep(self, tokens):
        """Append `tokens` to the output until an end-of-text, the token budget or the context stops it (`stop`
        says which). Returns how many were kept: [5, eot, 9] -> 1."""
        for kept, t in enumerate(tokens):
            if self.eot is not None and t == self.eot:
                self.stop = "eot"
                return kept
            self.out.append(int(t))
            if len(self.out) >= self.max_new_tokens:
                self.stop = "max_new_tokens"
            elif self.room() <= 0:
                self.stop = "context"
            if self.stop:
                return kept + 1
        return len(tokens)

    def stats(self, **extra):
        """What the run did: tokens, target forwards, tokens per forward (and per forward, accepted_per_step; the
        guesses each forward checked, drafted_per_step: 0 is a plain step), the guesses drafted and accepted, why
        it stopped, and the method's own figures (`extra`). acceptance_rate = accepted / judged (`acceptance`).
        No clock: decode.py and the bench time a run."""
        n = len(self.out)
        accepted, judged = acceptance(self.guesses_per_step, self.drafted_per_step)
        return {"new_tokens": n, "target_forwards": self.target_forwards,
                "tokens_per_forward": n / max(1, self.target_forwards),
                "accepted_per_step": self.accepted_per_step, "guesses_per_step": self.guesses_per_step,
                "drafted_per_step": self.drafted_per_step,
                "drafted": sum(self.drafted_per_step), "accepted": accepted, "judged": judged,
                "acceptance_rate": accepted / max(1, judged), "stop": self.stop, "no_draft_pays": self.no_draft_pays,
                **extra}


def acceptance(guesses_per_step, drafted_per_step):
    """Leviathan's a, the chance a guess passes, as (accepted, judged): a = accepted / judged. A guess is judged if
    every guess before it was accepted (the ones after a rejection say nothing): a step that accepted n of its d
    guesses judged min(n + 1, d). If each guess passes with probability a, independently, accepted / judged is the
    maximum-likelihood a. Steps that checked no guess (the prefill, plain steps) count nothing.
    Example: accepted [0, 2, 0, 0, 1] of drafted [0, 2, 0, 2, 2] -> (3, 5): a = 3/5."""
    return sum(guesses_per_step), sum(min(n + 1, d) for n, d in zip(guesses_per_step, drafted_per_step))


def new_run(models, prompt_ids, max_new_tokens, sampling=Sampling(), seed=None):
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
    device = models.target.wte.weight.device
    if seed is None:
        generator = torch.Generator(device=device)
        generator.seed()  # a fresh nondeterministic seed
    else:  # 0..2**63-1, each its own stream (the CPU generator alone keeps a seed's low 32 bits)
        generator = seeded_generator(device, seed)
    return Run(prompt, max_new_tokens, block_size, sampling, generator, models.eot)


def drafts(target, layers=None, **call):
    """Does a target call with these keywords draft? One through blocks 0..E-1 only, E < n_layer, does
    (early-exit's draft: the target's own first layers); every other is a target forward. The bench's timing and
    the trace both ask, so that they count the forwards the run counts."""
    return layers is not None and layers[0] == 0 and layers[1] < target.config.n_layer


def tensor(ids, device):
    """Token ids -> a (1, T) LongTensor on `device` (the model's: cache.device or model.wte.weight.device)."""
    return torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)


def first_token(run, target, cache, draft_policy=None):
    """The target reads the prompt and picks the first token itself, like `ar`; the run emits it (run.done says
    whether that was all). Returns (that token, the forward's Output: logits (1, P, V), hidden (1, P, C)). The
    token is not in the cache yet: it opens the next forward.
    draft_policy: the method's DraftLength. When it will never draft (`never`: the cost rule found that no draft
    pays on this machine, and plain steps teach it nothing new), the rest of the run is `ar`'s too, plain_steps
    without the method's bookkeeping per step, and the run is done on return."""
    out = target(tensor(run.prompt, cache.device), cache=cache)
    token = run.sample(out.logits[0, -1])
    run.emit([token])
    if draft_policy is not None and draft_policy.never:
        run.no_draft_pays = True
        plain_steps(run, target, cache)
    return token, out


def plain_steps(run, target, cache):
    """`ar`'s steps until the run is done: one target forward over the newest token (emitted, not yet in the
    cache), which attends to the cache of everything before it, and its next token from the target's law."""
    while not run.done:
        logits = target(tensor(run.out[-1:], cache.device), cache=cache).logits[0, -1]  # (V,) the next token's
        run.emit([run.sample(logits)])


def heads_at(target, out, n, k):
    """The MTP heads 1..k's logits (k, V) at position n of a target forward's Output (one row): the ones the
    forward ran itself (target(..., heads=k or more): out.head_logits), else run now on its trunk state there
    (after the prompt, or when this step guesses more than the forward before it asked for). `mtp` and `medusa`
    guess their next tokens with them."""
    if out.head_logits is not None and out.head_logits.size(1) >= k:
        return out.head_logits[0, :k, n]  # (k, V)
    return target.head_logits(out.hidden[:, n, None], k)[0, :, 0]  # (1, C) -> (k, V)


def cache_for(model, context, forward, **kwargs):
    """`model`'s KV cache for a sequence of up to `context` tokens and then one forward of `forward` more: a tree, a
    window or a padded chain read at the context's end takes slots past it (each node one slot, whatever its
    position). kwargs: the model's own (batch_size)."""
    return model.new_cache(max_len=context + forward, **kwargs)


def drafter_of(models, part, features=True):
    """models.<part>, a drafter, checked to fit models.target: a one-line ValueError unless it is there, has the
    target's vocabulary (its tokenizer) and at least its context, and, if it reads the target's `features`
    (eagle, parallelspec), the target's width. A draft GPT of its own (speculative) may be narrower."""
    drafter, target = getattr(models, part, None), models.target
    if drafter is None:
        raise ValueError(f"the {part} model is missing: {train_hint(part)}")
    unfit = {"vocab_size": f"the {part} model and the target use different tokenizers",
             "block_size": f"the {part} model's context is shorter than the target's",
             "n_embd": f"the {part} model was trained for another target"}
    for name in ("vocab_size", "block_size") + (("n_embd",) if features else ()):
        mine, its = getattr(drafter.config, name), getattr(target.config, name)
        if mine < its if name == "block_size" else mine != its:
            raise ValueError(f"{unfit[name]} ({name} {mine}, the target's {its}): retrain it, {train_hint(part)}")
    return drafter
