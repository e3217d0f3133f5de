"""
Adaptive draft length: how many guesses to make per target forward, decided online instead of a fixed k.
One option set, shared by every method that drafts a chain (`speculative`, `early-exit`, `mtp`,
`prompt-lookup`, `parallelspec`).

A fixed k is a bet on the acceptance rate: too short wastes target forwards when the guesses are good, too
long wastes draft work and verify width when they are not, and the right k changes along the text. Two rules:

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

Why this stays lossless: how many guesses a step makes depends only on the draft side (its guesses, its
probabilities, its own randomness) and on steps already verified, never on the target's distribution at the
positions this step will verify. Given that number j, the step is an ordinary k = j step: every guess goes
through the same rule and the last token comes from the target's law (residual or bonus). Under greedy the
output is `ar`'s whatever k is, so only speed changes.

`prompt-lookup` guesses without probabilities, so only `history` applies to it; `mtp` and `parallelspec` guess
all positions at once, so `confidence` cuts their chain at the first unconfident guess (`cut`).
"""
import torch

from nanospec.decoding.options import Option

RULES = ("off", "history", "confidence")
CONFIDENCE = 0.5  # the threshold of --adaptive confidence unless --confidence says otherwise
ADAPTIVE_OPTIONS = {
    "adaptive": Option(str, "off", "draft length rule: off (always draft_len), history (k += 2 after a fully "
                                   "accepted step, k - 1 after a rejection), confidence (stop after a guess the "
                                   "drafter gives probability < --confidence; draft_len is then the most)",
                       choices=RULES),
    "confidence": Option(float, None, "threshold of --adaptive confidence on the drafter's probability for its "
                                      f"guess (default {CONFIDENCE})", low=0.0, high=1.0),
}


def draft_length(opts, draft_len, most=None):
    """The DraftLength of a run from its options (opts.adaptive, opts.confidence): --confidence is only for
    --adaptive confidence (a one-line ValueError otherwise)."""
    confidence = getattr(opts, "confidence", None)
    if confidence is not None and opts.adaptive != "confidence":
        raise ValueError("--confidence is the threshold of --adaptive confidence: add --adaptive confidence or drop it")
    return DraftLength(opts.adaptive, draft_len, CONFIDENCE if confidence is None else confidence, most)


class DraftLength:
    """The draft length of one generation: `k` guesses next step, `stop` after each guess, `update` after each
    verification. With rule "off" it is just draft_len, so a method's fixed-k path is the same code."""

    def __init__(self, rule, draft_len, threshold=CONFIDENCE, most=None):
        if rule not in RULES:
            raise ValueError(f"adaptive must be one of {', '.join(RULES)}, got {rule!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence must be a probability in [0, 1], got {threshold}")
        self.rule = rule
        self.k = draft_len  # guesses next step
        self.threshold = threshold
        self.most = most  # a cap on k, or None

    def stop(self, logits, guess):
        """After guessing `guess` from the drafter's logits (V,): make no more guesses this step?"""
        if self.rule != "confidence":
            return False
        return torch.softmax(logits.double(), -1)[guess].item() < self.threshold

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
        """After a verification of `drafted` guesses, `accepted` of them kept: set next step's k."""
        if self.rule == "history" and drafted > 0:  # a step with no guesses says nothing about them
            self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)
            if self.most is not None:
                self.k = min(self.k, self.most)
