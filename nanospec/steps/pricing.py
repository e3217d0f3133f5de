"""
The cost rule's books (`--adaptive cost`, nanospec/steps/adaptive.py): what a step with k guesses costs on this
machine (measured by nanospec/bench/calibration.py, attached to the models as `step_costs`), what each guess is worth
(learnt from the verified steps, against the calibration's prior), and the k with the most expected tokens per
second. Pure Python over short lists: a step's price costs no tensor operation.

    seconds [1.0, 1.2, 1.3, 1.45] (ms), chances [0.8, 0.6, 0.3] -> E(k) = 1, 1.8, 2.4, 2.7 -> E/T = 1.0, 1.5, 1.85,
    1.86 per ms: k = 3. Chances [0.2, 0.05, 0.01] -> 1.0, 1.0, 0.96, 0.86: k = 0, a plain step.
"""
import json

PRIOR = 0.5  # the cost rule's pi_1 where the calibration measured none (later guesses: PRIOR_DECAY times less)
PRIOR_DECAY = 0.7
# The memory is long and the prior heavy because a chance learnt from a few steps is noisy, and on a CPU a draft
# wins by a few percent at most (at t=1 eagle's tree is worth about 5% over a plain step). With a memory of ~10
# steps (0.9) and a prior worth 2, that noise alone sent eagle into plain steps on a third of its steps at t=1; with
# ~50 steps (0.98) and a prior worth 10, on 6% (docs/benchmark.md, "The cost rule's memory").
PRIOR_WEIGHT = 10.0  # the prior counts as this many verified steps
FORGET = 0.98  # the cost rule's memory: each step multiplies what it counted before by this (~50 steps)


def costs_key(method, greedy, opts):
    """The calibration's name for one method's steps: the method, greedy or sampled, and every option that
    changes a step's cost but not its number of guesses: speculative, sampled, with its default options ->
    'speculative|sampled|{"verify": "token"}'."""
    fixed = {k: v for k, v in sorted(vars(opts).items()) if k not in ("adaptive", "confidence", "draft_len",
                                                                       "total_tokens", "show_tree")}
    return f"{method}|{'greedy' if greedy else 'sampled'}|{json.dumps(fixed)}"


def step_costs(models, module_name, sampling, opts):
    """What the calibration attached to `models` for this method (its module's __name__), sampling and options:
    {"seconds": {k: seconds of a step with k guesses}, "chances": [the chance of each guess]}; None if nothing."""
    return (getattr(models, "step_costs", None) or {}).get(costs_key(module_name.rsplit(".", 1)[-1],
                                                                     sampling.greedy, opts))


class Price:
    """The cost rule's books: seconds[k] for a step with k guesses (from the calibration, k = 0..most), and for
    every guess i = 1..most, how often it was offered and accepted (decayed counts) beside the chance the
    calibration saw (the prior). best() -> the k of the most expected tokens per second."""

    def __init__(self, costs, most, menu):
        self.seconds = interpolate({int(k): s for k, s in costs["seconds"].items()}, most)  # (most+1,) list
        self.measured = list(costs.get("chances") or [])  # the calibration's chance of guess 1, 2, ...
        self.menu = menu
        self.offered = [0.0] * (most + 1)  # index i: guess i (index 0 unused)
        self.won = [0.0] * (most + 1)

    def chances(self):
        """pi_i, the estimated chance guess i is accepted, i = 1..most: its counts with PRIOR_WEIGHT steps of a
        prior, the calibration's chance of guess i, or (beyond what it measured) one that falls along the guesses:
        PRIOR for the first, then PRIOR_DECAY times the estimate of the guess before."""
        pi, before = [], PRIOR / PRIOR_DECAY
        for i in range(1, len(self.won)):
            prior = self.measured[i - 1] if i <= len(self.measured) else before * PRIOR_DECAY
            before = (self.won[i] + PRIOR_WEIGHT * prior) / (self.offered[i] + PRIOR_WEIGHT)
            pi.append(before)
        return pi

    def best(self):
        return best_k(self.chances(), self.seconds, self.menu)

    def observe(self, drafted, accepted):
        """One verified step: guesses 1..drafted were offered, those in `accepted` were kept."""
        self.offered = [c * FORGET for c in self.offered]
        self.won = [c * FORGET for c in self.won]
        for i in range(1, min(drafted, len(self.offered) - 1) + 1):
            self.offered[i] += 1
        for i in accepted:
            if i < len(self.won):
                self.won[i] += 1


def best_k(pi, seconds, menu):
    """The k of `menu` with the most expected tokens per second, E(k) / T(k), E(k) = 1 + pi_1 + ... + pi_k (pi: the
    chance of each guess, pi_1 first), T = seconds (k = 0, 1, ...); the smaller k on a tie. The docstring's example:
    pi [0.8, 0.6, 0.3], seconds [1.0, 1.2, 1.3, 1.45] -> 3; pi [0.2, 0.05, 0.01] -> 0."""
    expected = [1.0]
    for p in pi:
        expected.append(expected[-1] + p)
    return max(menu, key=lambda k: (expected[k] / seconds[k], -k))


def interpolate(seconds, most):
    """{k: seconds} measured at some k -> a list for k = 0..most: the measured ones, straight lines between them,
    below them the line through the first two, and above them the largest's seconds. {0: 1.0, 2: 1.4}, most 3 ->
    [1.0, 1.2, 1.4, 1.4]. Why flat above: a k the calibration's sweep asked for but never measured is one its steps
    could not build, as `lookahead`'s "all" (17 guesses at most) is the 8-11 that its n-gram pool and window give,
    priced at what those cost. A line drawn on through them priced it at 1.9 plain steps where it costs 1.5, and
    greedy `lookahead` took plain steps on 81% of its steps where it drafted on 62% (docs/benchmark.md)."""
    known = sorted(seconds)
    if not known:
        raise ValueError("the cost rule needs the seconds of at least one step size")
    out = []
    for k in range(most + 1):
        below, above = [m for m in known if m <= k], [m for m in known if m >= k]
        if k in seconds or not above or len(known) == 1:  # measured; above them all; or one measured k
            out.append(seconds[above[0] if above else known[-1]])
            continue
        lo, hi = (below[-1], above[0]) if below else known[:2]
        out.append(max(seconds[lo] + (seconds[hi] - seconds[lo]) * (k - lo) / (hi - lo), 1e-9))
    return out
