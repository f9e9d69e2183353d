"""DSpark-style confidence-scheduled verification: how many of each request's drafts a
step verifies, so that expected accepted tokens per second is highest.

Each draft token j of request r has a confidence c_{r,j} (the chance it is right given the
drafts before it are); a_{r,j} = c_{r,1} ... c_{r,j} is the chance it is accepted. A step of
B rows runs at SPS(B) steps per second and yields tau = R + sum(a) tokens in expectation
(every request gets at least its one sampled token). The rule: pool all (r, j), sort by a
descending (ties: smaller j first, so a request's drafts join in order), start with no
drafts, and add one token at a time while Theta = tau * SPS(B) strictly increases;
**stop at the first token that does not increase it**. A search that looks past a drop
lets the value of a later draft decide whether an earlier one is verified, and since a
later draft's confidence may depend on the earlier draft's value, the set of verified
tokens would then depend on the tokens themselves and the output distribution would move
(DSpark, Appendix A; tests/spec/test_confidence.py reproduces it).

SPS(B) is profiled at start-up by timing the model on B rows and kept on disk, keyed by
model, dtype, device and CPU (``StepRateProfile``); the engine's real step times then
correct it online by a constant offset (the time a step spends beyond the profile's short
synthetic sequences, which does not grow with the rows). Both depend on past steps only,
never on the drafts being decided on.

Confidences are calibrated online from what verification accepts (``Calibration``):
- model drafters (draft_model, mtp) and suffix decoding give a raw confidence per position
  (a draft probability, a continuation frequency); each position j gets a temperature T_j
  and a bias b_j fitted on the recent (raw, accepted) pairs of that position,
  c = sigmoid(logit(raw) / T_j + b_j) ("sequential temperature scaling": position j's pairs
  are those where the drafts before j were accepted; the bias lets an overconfident
  drafter's 0.95 become 0.25, which a temperature alone cannot);
- n-gram matches say little (one earlier occurrence is a confidence of 1), so a request's
  own acceptance rate at each position, shrunk toward all requests' rate there, stands in;
  a position with little history borrows the rate of the one before it (a position that
  is never verified would otherwise keep its prior and never be verified).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

PROFILE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass
class StepRateProfile:
    """SPS(B): model steps per second at B rows, linear between profiled points (seconds
    per step interpolate; past the last point they grow in proportion to B)."""

    points: list[tuple[int, float]]
    """(rows, seconds per step), rows ascending."""
    offset: float = 0.0
    """Seconds the engine's real steps take beyond the profile's (attention over long
    contexts, drafting, Python): learnt online from observed steps (``observe``). It does
    not grow with the rows, so it is what makes extra rows relatively cheaper under load."""

    def __post_init__(self) -> None:
        # More rows never take less time: a point above a later one was slowed by something
        # else on the machine, so each point is at most every later one (a suffix minimum).
        points = [(int(r), float(s)) for r, s in self.points]
        for i in range(len(points) - 2, -1, -1):
            points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
        self.points = points

    def seconds(self, rows: int) -> float:
        # Never below half the profiled time, whatever the offset learnt.
        profiled = self.profiled_seconds(rows)
        return max(profiled + self.offset, 0.5 * profiled)

    def observe(self, rows: int, seconds: float, weight: float = 0.05) -> None:
        """A real step of ``rows`` rows took ``seconds``: move the offset toward the gap
        (an exponential moving average over about 1 / weight steps)."""
        self.offset += weight * (seconds - self.profiled_seconds(rows) - self.offset)

    def profiled_seconds(self, rows: int) -> float:
        xs = [r for r, _ in self.points]
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return self.points[i][1]
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            r, s = self.points[-1]
            return s * rows / r
        (r0, s0), (r1, s1) = self.points[i - 1], self.points[i]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def steps_per_second(self, rows: int) -> float:
        return 1.0 / self.seconds(rows)

    @staticmethod
    def cache_path(cache_dir: str | None, key: dict) -> Path:
        root = Path(cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "openinfer", "sps"))
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return root / f"{digest}.json"

    @staticmethod
    def load(path: Path) -> StepRateProfile | None:
        try:
            points = json.loads(path.read_text())["points"]
            return StepRateProfile([(int(r), float(s)) for r, s in points])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: Path, key: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "points": self.points}))
        tmp.replace(path)


def choose_verify_counts(candidates: dict[Hashable, list[float]], base_rows: int,
                         base_tokens: float, steps_per_second: Callable[[int], float],
                         max_rows: int) -> dict[Hashable, int]:
    """How many leading drafts each request verifies (absent: none). ``candidates``: per
    request, the calibrated confidences c_1.. of its drafts; ``base_rows``: rows the step
    has without drafts; ``base_tokens``: tokens it yields without drafts."""
    pool = []
    for key, confidences in candidates.items():
        survive = 1.0
        for j, c in enumerate(confidences):
            survive *= c
            pool.append((-survive, j, key))
    pool.sort(key=lambda item: (item[0], item[1]))
    rows, tokens = base_rows, base_tokens
    best = tokens * steps_per_second(rows)
    chosen: dict[Hashable, int] = {}
    for neg_a, j, key in pool:
        if rows + 1 > max_rows:
            break
        theta = (tokens - neg_a) * steps_per_second(rows + 1)
        if not theta > best:
            break  # never look past a drop: that would not be lossless
        rows, tokens, best = rows + 1, tokens - neg_a, theta
        chosen[key] = j + 1
    return chosen


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


REGULARIZATION = 1.0


class Calibration:
    """Online calibration of draft confidences from verification outcomes."""

    def __init__(self, num_positions: int, per_request: bool, window: int = 1024,
                 refit_every: int = 512, min_samples: int = 64) -> None:
        self.per_request = per_request
        self.temperatures = [1.0] * num_positions
        self.biases = [0.0] * num_positions
        self._pairs = [deque(maxlen=window) for _ in range(num_positions)]
        self._since_fit = [0] * num_positions
        self.refit_every = refit_every
        self.min_samples = min_samples
        self._tried = [0] * num_positions
        self._accepted = [0] * num_positions
        self._requests: dict[Hashable, list[list[int]]] = {}
        """per request: [tried, accepted] per position."""

    def confidences(self, key: Hashable, raw: list[float]) -> list[float]:
        if not self.per_request:
            return [_sigmoid(_logit(c) / self.temperatures[j] + self.biases[j])
                    for j, c in enumerate(raw)]
        counts = self._requests.get(key)
        result = []
        prior = 0.5
        for j in range(len(raw)):
            prior = (self._accepted[j] + 4 * prior) / (self._tried[j] + 4)
            tried, accepted = counts[j] if counts is not None else (0, 0)
            result.append((accepted + 2 * prior) / (tried + 2))
        return result

    def mean_survivals(self) -> list[float]:
        """The average draft's chance of acceptance at each position, from every request's
        verifications (past a position never verified: 1, as DeepInfer counts a request's
        first round)."""
        out, survive = [], 1.0
        for tried, accepted in zip(self._tried, self._accepted):
            survive *= accepted / tried if tried else 1.0
            out.append(survive)
        return out

    def observe(self, key: Hashable, raw: list[float], num_verified: int,
                num_accepted: int) -> None:
        """Drafts 0..num_verified-1 were verified; the first num_accepted were accepted."""
        counts = self._requests.setdefault(key, [[0, 0] for _ in self.temperatures])
        for j in range(min(num_verified, num_accepted + 1)):
            accepted = j < num_accepted
            self._tried[j] += 1
            self._accepted[j] += accepted
            counts[j][0] += 1
            counts[j][1] += accepted
            if not self.per_request:
                self._pairs[j].append((_logit(raw[j]), accepted))
                self._since_fit[j] += 1
                if self._since_fit[j] >= self.refit_every and len(self._pairs[j]) >= self.min_samples:
                    self._fit(j)

    def _fit(self, j: int) -> None:
        """Position j's scale w = 1/T and bias b minimising the log loss of its recent
        pairs (Newton steps, lightly held toward w = 1, b = 0: a temperature alone
        cannot take a confidence below 1/2, and an overconfident drafter needs that)."""
        w, b = 1.0 / self.temperatures[j], self.biases[j]
        pairs = self._pairs[j]
        for _ in range(12):  # coordinate-wise damped Newton steps (the loss is convex)
            for coordinate in ("b", "w"):
                grad = REGULARIZATION * (b if coordinate == "b" else w - 1)
                hess = REGULARIZATION
                for x, accepted in pairs:
                    p = _sigmoid(w * x + b)
                    feature = 1.0 if coordinate == "b" else x
                    grad += (p - accepted) * feature
                    hess += p * (1 - p) * feature * feature
                step = grad / hess
                step /= max(1.0, abs(step))  # saturated pairs overshoot: damp
                if coordinate == "b":
                    b -= step
                else:
                    w = min(max(w - step, 1 / 16), 16.0)
        self.temperatures[j], self.biases[j] = 1 / w, b
        self._since_fit[j] = 0

    def forget(self, key: Hashable) -> None:
        self._requests.pop(key, None)
