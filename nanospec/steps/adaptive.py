"""
Adaptive draft length: how many guesses to make per target forward, decided online instead of a fixed k. One
option set, shared by every method that drafts (the tree methods count a tree's guesses: its first k nodes).

A fixed k is a bet on the acceptance rate: too short wastes target forwards when the guesses are good, too
long wastes draft work and verify width when they are not, and the right k changes along the text. The rules:

  history     grow after a step whose guesses were ALL accepted (k += 2), shrink after any rejection
              (k = max(1, k - 1)); k starts at draft_len. The "heuristic" schedule of HF transformers'
              assisted generation (candidate_generator.py). draft_len 4: accept 4/4 -> k 6; 2/6 -> 5; 5/5 -> 7.
  confidence  stop drafting after a guess the drafter itself gives probability below a threshold; that guess
              is still verified, no further one is drafted. draft_len is then the most guesses per step.
              Draft & Verify (Zhang et al. 2023, arXiv 2309.08168), Kangaroo (Liu et al. 2024, arXiv
              2404.18911), HF's assistant_confidence_threshold. Threshold 0.5, the drafter's probabilities for
              its guesses 0.9, 0.8, 0.3, 0.7 -> 3 guesses (the 0.3 one is the last).
              The probability is the drafter's plain softmax (temperature 1, no top-k/top-p): the warped q is
              one-hot when greedy and would never stop anything.
  cost        price every step (Leviathan et al. 2022, arXiv 2211.17192, section 3.4; SpecDec++ and SmartSpec
              choose per step): draft the k in 0..draft_len with the most expected tokens per second, E(k) / T(k),
              and k = 0, a plain step, when no draft pays. T(k): the seconds of a step with k guesses on this
              machine (nanospec/bench/calibration.py measures them once; decode.py and the bench attach them to
              the models as `step_costs`). E(k) = 1 + pi_1 + .. + pi_k, pi_i the chance guess i is accepted,
              learnt from the steps verified so far (decayed, drawn back towards the calibration's chances, so
              that a stretch of plain steps tries a draft again). The books and a worked example: pricing.py.
              Without step_costs (a library call on models nobody calibrated) it drafts draft_len, as "off".
              A run whose rule starts at k = 0 stays there (`never`: a plain step teaches it nothing), so it is
              `ar`'s own loop from the prefill on (run.first_token), without the method's bookkeeping per step.
  sweep       what the calibration runs: every k of 0..draft_len in turn, SWEEP_STEPS steps each.

Why this stays lossless: how many guesses a step makes depends only on the draft side (its guesses, its
probabilities, its own randomness), on steps already verified and on the calibration, never on the target's
distribution at the positions this step will verify. Given that number j, the step is an ordinary k = j step:
every guess goes through the same rule and the last token comes from the target's law (residual or bonus).
Under greedy the output is `ar`'s whatever k is, so only speed changes; the same seed and calibration give the
same tokens.

`prompt-lookup` guesses without probabilities, so `confidence` does not apply to it; `mtp` and `parallelspec`
guess all positions at once, so `confidence` cuts their chain at the first unconfident guess (`cut`).
"""
import torch

from nanospec.steps.options import Option
from nanospec.steps.pricing import Price

RULES = ("off", "history", "confidence", "cost", "sweep")
CONFIDENCE = 0.5  # the threshold of --adaptive confidence unless --confidence says otherwise
SWEEP_STEPS = 3  # --adaptive sweep: consecutive steps per k (the calibration times the ones between two alike)
ADAPTIVE_OPTIONS = {
    "adaptive": Option(str, "cost", "draft length rule: off (always draft_len), history (k += 2 after a fully "
                                   "accepted step, k - 1 after a rejection), confidence (stop after a guess the "
                                   "drafter gives probability < --confidence; draft_len is then the most), cost "
                                   "(the k in 0..draft_len with the most expected tokens per second on this "
                                   "machine, 0 = a plain step), sweep (every k in turn: the calibration)",
                       choices=RULES),
    "confidence": Option(float, None, "threshold of --adaptive confidence on the drafter's probability for its "
                                      f"guess (default {CONFIDENCE})", low=0.0, high=1.0),
}
PRICED_OPTIONS = {  # the rules that fit any guesses (jacobi's block, a tree's nodes): how many of them to check
    "adaptive": Option(str, "cost", "guesses per step: off (all of them), cost (the first k, k in 0..all with the "
                                   "most expected tokens per second on this machine, 0 = a plain step), sweep "
                                   "(every k in turn: the calibration)", choices=("off", "cost", "sweep"))}


def draft_length(opts, draft_len, most=None, costs=None, menu=None):
    """The DraftLength of a run from its options (opts.adaptive, opts.confidence): --confidence is only for
    --adaptive confidence (a one-line ValueError otherwise). costs: the cost rule's calibration (step_costs);
    menu: the k the cost rule and the sweep may choose (default 0..draft_len)."""
    confidence = getattr(opts, "confidence", None)
    if confidence is not None and opts.adaptive != "confidence":
        raise ValueError("--confidence is the threshold of --adaptive confidence: add --adaptive confidence or drop it")
    return DraftLength(opts.adaptive, draft_len, CONFIDENCE if confidence is None else confidence, most, costs, menu)


class DraftLength:
    """The draft length of one generation: `k` guesses next step, `stop` after each guess, `update` after each
    verification. With rule "off" it is just draft_len, so a method's fixed-k path is the same code."""

    def __init__(self, rule, draft_len, threshold=CONFIDENCE, most=None, costs=None, menu=None):
        if rule not in RULES:
            raise ValueError(f"adaptive must be one of {', '.join(RULES)}, got {rule!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence must be a probability in [0, 1], got {threshold}")
        self.rule = rule if rule != "cost" or costs else "off"  # no calibration: draft_len every step
        self.k = draft_len  # guesses next step
        self.threshold = threshold
        self.most = most  # a cap on k, or None
        self.steps = 0  # verified steps
        self.menu = list(menu or range(draft_len + 1))  # the cost rule's and the sweep's choices
        if self.rule == "cost":
            self.price = Price(costs, draft_len, self.menu)
            self.k = self.price.best()
        # No draft ever: the cost rule starts at k = 0, and a plain step offers no guess, so its books only fade
        # towards the calibration's chances, where they start: k stays 0 (first_token then runs `ar`'s steps).
        self.never = self.rule == "cost" and self.k == 0
        if self.rule == "sweep":
            self.k = self.menu[0]

    def stop(self, logits, guess):
        """After guessing `guess` from the drafter's logits (V,): make no more guesses this step?"""
        if self.rule != "confidence":
            return False
        return torch.softmax(logits.double(), -1)[guess].item() < self.threshold

    @property
    def stopper(self):
        """`stop`, for a drafter that guesses one token at a time (draft_chain), under the confidence rule; None
        under the others, which never stop a chain early (and read nothing per guess)."""
        return self.stop if self.rule == "confidence" else None

    def cut(self, logits, guesses):
        """For drafters that guess every position at once: logits (k, V), guesses (k,) a list or a LongTensor
        -> the guesses up to and including the first unconfident one. [0.9, 0.3, 0.8] with threshold 0.5 -> the
        first two. Only the confidence rule looks at them (one host read per guess); the others keep them all."""
        if self.rule == "confidence":
            for i, guess in enumerate(guesses):
                if self.stop(logits[i], guess):
                    return guesses[:i + 1]
        return guesses

    def update(self, drafted, accepted):
        """After a verification of `drafted` guesses: set next step's k. accepted: how many a chain kept (its
        guesses 1..accepted), or a tree's accepted path (its guesses, numbered 1..drafted in the tree's order)."""
        self.steps += 1
        n = accepted if isinstance(accepted, int) else len(accepted)
        if self.rule == "history" and drafted > 0:  # a step with no guesses says nothing about them
            self.k = self.k + 2 if n == drafted else max(1, self.k - 1)
            if self.most is not None:
                self.k = min(self.k, self.most)
        elif self.rule == "cost":
            self.price.observe(drafted, range(1, n + 1) if isinstance(accepted, int) else accepted)
            self.k = self.price.best()
        elif self.rule == "sweep":
            self.k = self.menu[self.steps // SWEEP_STEPS % len(self.menu)]
