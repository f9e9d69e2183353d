"""DeepInfer's production schedule for verification (``scheduler: "budget"``), beside the
paper's rule in spec/confidence.py.

The paper's rule walks the drafts of this step by likelihood and stops at the first that does
not raise expected tokens per second: it may not look past a drop, since a later draft's
confidence can depend on an earlier draft's value. DeepInfer splits the decision in two
(``csrc/engine/mtp_varlen.hpp``):

- the **budget**, how many draft rows step N verifies, is chosen from the drafts of the step
  before (round N-2 in DeepInfer's counting). Those drafts are settled, so the search may try
  every row count and keep the best (no early stop);
- the **shares**: the budget goes to step N's own drafts, likeliest first (round N-1's
  ranking). A draft's rank depends on its own and earlier confidences and on other
  requests', never on its own value or a later draft's: verification stays lossless.

Here the budget is also what the drafter is told: drafting for step N happens at the end of
step N-1, after the budget is known, and a drafter with a confidence head (DSpark) drafts
only the tokens that can make the budget, likeliest first (``keep_within_budget``). A drafter
whose drafts are rejected then costs little at a large batch, where drafting every row
cost as much as the step (DSpark k=4 at 32 requests: 0.5x of no speculation with nothing
verified). The step time is the profiled curve (spec/confidence.py's ``StepRateProfile``)
plus a per-row and a fixed part learnt from the real steps (``StepCost``), plus drafting,
learnt from the drafting time each step reports (``DraftCost``). Where no draft pays, one
is still drafted and verified every few steps (spec/planner.py's EXPLORE_EVERY), so
acceptance keeps being measured and the budget can grow again when drafts get better.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from openinfer.spec.confidence import StepRateProfile


class LinearFit:
    """y = a + b * x, least squares over recent observations, each one's weight decaying by
    ``decay``. Until x varies enough to tell a from b, all of y is counted per unit of x
    (a = 0, b = mean y / mean x): x is what the budget adds (rows, drafts), so this is the
    pessimistic reading, which makes the budget smaller, and so x vary."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y

    def observe(self, x: float, y: float) -> None:
        for i, value in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] = self.decay * self._sums[i] + value

    def coefficients(self) -> tuple[float, float]:
        n, sx, sy, sxx, sxy = self._sums
        if n == 0:
            return 0.0, 0.0
        mx, my = sx / n, sy / n
        variance = sxx / n - mx * mx
        if variance <= (0.1 * max(mx, 1.0)) ** 2:
            return (0.0, my / max(mx, 1.0)) if my > 0 else (my, 0.0)
        b = max(0.0, (sxy / n - mx * my) / variance)
        return my - b * mx, b

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class DraftCost:
    """Seconds a step spends drafting: a + b * drafts proposed (``LinearFit``) over steps
    that drafted, and, for a step that drafts nothing, what such steps took (a drafter still
    keeps its context: DSpark writes its K/V)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.fit = LinearFit(decay)
        self.decay = decay
        self._idle = [0.0, 0.0]  # weight, seconds over steps that drafted nothing

    def observe(self, drafts: int, seconds: float) -> None:
        if drafts:
            self.fit.observe(drafts, seconds)
        else:
            self._idle = [self.decay * self._idle[0] + 1, self.decay * self._idle[1] + seconds]

    def seconds(self, drafts: int) -> float:
        if drafts:
            return max(0.0, self.fit(drafts))
        weight, total = self._idle
        return total / weight if weight else 0.0


class StepCost:
    """Seconds of a step's forward pass and sampling by rows: the profiled curve plus a
    residual a + b * rows learnt from the real steps (``LinearFit``). DeepInfer fits the
    per-row part the same way (``ForwardRuntimeEstimator``: medians of (real - profiled) /
    rows): real requests' long contexts make each row cost more than the profile's short
    synthetic ones, and the constant part is Python's."""

    def __init__(self, profile: StepRateProfile) -> None:
        self.profile = profile
        self.residual = LinearFit()

    def observe(self, rows: int, seconds: float) -> None:
        self.residual.observe(rows, seconds - self.profile.profiled_seconds(rows))

    def seconds(self, rows: int) -> float:
        profiled = self.profile.profiled_seconds(rows)
        return max(profiled + self.residual(rows), 0.5 * profiled)


def best_draft_rows(survivals: list[float], base_rows: int, base_tokens: float,
                    step_seconds: Callable[[int], float], draft_seconds: Callable[[int], float],
                    max_rows: int) -> int:
    """How many draft rows maximise expected tokens per second: the ``m`` likeliest of
    ``survivals`` (each draft's chance of acceptance) on top of ``base_rows`` rows that yield
    ``base_tokens``. Every m is tried (the survivals are a settled round's)."""
    ranked = sorted(survivals, reverse=True)[:max(0, max_rows - base_rows)]
    tokens = float(base_tokens)
    best_m, best = 0, tokens / (step_seconds(base_rows) + draft_seconds(0))
    for m, survival in enumerate(ranked, 1):
        tokens += survival
        theta = tokens / (step_seconds(base_rows + m) + draft_seconds(m))
        if theta > best:
            best_m, best = m, theta
    return best_m


def survivals(confidences: list[float]) -> list[float]:
    """Each draft's chance of acceptance: the product of its and the earlier confidences."""
    out, survive = [], 1.0
    for c in confidences:
        survive *= c
        out.append(survive)
    return out


def top_drafts(candidates: dict[Hashable, list[float]], rows: int) -> dict[Hashable, int]:
    """The ``rows`` likeliest drafts (by survival; ties: earlier positions first, so a
    request's drafts join in order): how many leading drafts each request verifies."""
    pool = sorted(((-a, j, n, key) for n, (key, confidences) in enumerate(candidates.items())
                   for j, a in enumerate(survivals(confidences))),
                  key=lambda item: item[:3])
    chosen: dict[Hashable, int] = {}
    for _, j, _, key in pool[:max(0, rows)]:
        chosen[key] = max(chosen.get(key, 0), j + 1)
    return chosen


def keep_within_budget(made: list[float], candidates: list[float], budget: int) -> list[int]:
    """Drafting one position at a time: which ``candidates`` (survivals of the next drafts)
    are among the ``budget`` likeliest of every draft so far (``made``, earlier positions,
    win ties). A draft left out here would not be verified even if every later one were
    worse; one kept may still be outranked later, which costs a row, not a token."""
    pool = sorted([(-a, 0, n) for n, a in enumerate(made)]
                  + [(-a, 1, n) for n, a in enumerate(candidates)])
    return sorted(n for _, later, n in pool[:max(0, budget)] if later)
