"""DSpark's confidence-scheduled verification: the rule, its losslessness (Appendix A of
the paper, reproduced), the steps-per-second profile and online calibration."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from scipy.stats import chisquare

from openinfer.sample.rejection import VerifyRequest, verify
from openinfer.sample.rows import SamplingRow
from openinfer.sample.sampler import Sampler
from openinfer.sampling_params import SamplingParams
from openinfer.spec.confidence import Calibration, StepRateProfile, choose_verify_counts
from openinfer.spec.draft_model import pick_drafts
from openinfer.spec.proposer import Draft


def test_rows_join_by_cumulative_confidence_and_the_walk_stops_at_the_first_drop():
    rates = {1: 10.0, 2: 9.5, 3: 9.0, 4: 8.6, 5: 8.3}
    sps = rates.__getitem__
    # Request a: a = 0.9, 0.45; request b: a = 0.8, 0.72.
    chosen = choose_verify_counts({"a": [0.9, 0.5], "b": [0.8, 0.9]}, 1, 1.0, sps, 5)
    # 1 row: 10. +a1 (0.9): 1.9 * 9.5 = 18.05. +b1 (0.8): 2.7 * 9 = 24.3. +b2 (0.72):
    # 3.42 * 8.6 = 29.4. +a2 (0.45): 3.87 * 8.3 = 32.1.
    assert chosen == {"a": 2, "b": 2}
    # A slower machine at 4+ rows: the walk stops at the first token that does not pay,
    # even though a later one would have made up for it.
    rates[4], rates[5] = 5.0, 4.9
    assert choose_verify_counts({"a": [0.9, 0.5], "b": [0.8, 0.9]}, 1, 1.0, sps, 5) == {
        "a": 1, "b": 1}
    # max_rows caps the step.
    assert choose_verify_counts({"a": [1.0, 1.0, 1.0]}, 1, 1.0, lambda b: 1.0, 2) == {"a": 1}
    # Ties: the earlier position first, so a request's drafts join in order.
    assert choose_verify_counts({"a": [1.0, 1.0]}, 1, 1.0, lambda b: 1.0 / b ** 0.5, 3) == {"a": 2}


def test_verify_rows_shrink_as_the_batch_grows():
    # Seconds per step flat up to 16 rows, then linear (a GEMM-bound machine).
    profile = StepRateProfile([(1, 0.01), (16, 0.01), (64, 0.04), (256, 0.16)])
    drafts = [0.8, 0.8, 0.8, 0.8]
    per_request = []
    for num_requests in (1, 8, 32, 64):
        chosen = choose_verify_counts({r: drafts for r in range(num_requests)}, num_requests,
                                      num_requests, profile.steps_per_second, 2048)
        per_request.append(sum(chosen.values()) / num_requests)
    assert per_request[0] == 4 and per_request[-1] < 1
    assert per_request == sorted(per_request, reverse=True)


# ---- DSpark, Appendix A ------------------------------------------------------------------

TARGET = (0.7, 0.3)
DRAFT = (0.5, 0.5)
SPS = {1: 1.0, 2: 0.5, 3: 0.45}
TRIALS = 8000


def _markov_confidences(drafts: list[int]) -> list[float]:
    """A Markov head's confidences: the second depends on the token drafted first."""
    return [0.9, 0.9 if drafts[0] == 0 else 0.1]


def _retrospective(confidences: list[float], sps) -> int:
    """The wrong rule: take the best prefix over all lengths (looking past a drop)."""
    best, best_k, tokens, survive = sps(1), 0, 1.0, 1.0
    for j, c in enumerate(confidences):
        survive *= c
        tokens += survive
        if tokens * sps(j + 2) > best:
            best, best_k = tokens * sps(j + 2), j + 1
    return best_k


def _output_tokens(choose, sps) -> tuple[list[int], list[int]]:
    rng = random.Random(0)
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=100)
    logits = torch.tensor([list(TARGET)] * 3).log()
    draft_probs = torch.tensor([list(DRAFT)] * 2)
    requests = []
    for _ in range(TRIALS):
        drafts = [int(rng.random() < DRAFT[1]) for _ in range(2)]
        k = choose(_markov_confidences(drafts), sps)
        rows = [SamplingRow(params, [0], drafts[:j], frozenset()) for j in range(k + 1)]
        requests.append(VerifyRequest(rows, drafts[:k], draft_probs[:k]))
    logits_rows = torch.cat([logits[:len(r.rows)] for r in requests])
    results = verify(Sampler(0), logits_rows, requests)
    first = [r.token_ids[0] for r in results]
    second = [r.token_ids[1] for r in results if len(r.token_ids) > 1]
    return first, second


def _matches_target(tokens: list[int]) -> bool:
    counts = [tokens.count(0), tokens.count(1)]
    return chisquare(counts, [TARGET[0] * len(tokens), TARGET[1] * len(tokens)]).pvalue > 1e-3


def _early_stop(confidences, sps) -> int:
    return choose_verify_counts({0: confidences}, 1, 1.0, sps, 3).get(0, 0)


def test_the_early_stop_rule_is_lossless_and_a_retrospective_search_is_not():
    first, _ = _output_tokens(_early_stop, SPS.__getitem__)
    assert _matches_target(first)  # (0.7, 0.3)
    first, _ = _output_tokens(_retrospective, SPS.__getitem__)
    share = first.count(0) / len(first)
    assert abs(share - 0.85) < 0.02  # the paper's (0.85, 0.15)
    assert not _matches_target(first)


def test_the_early_stop_rule_stays_lossless_when_the_second_decision_depends_on_the_first():
    # Faster verification: the first draft always pays, the second only after token 0.
    sps = {1: 1.0, 2: 0.9, 3: 0.85}.__getitem__
    assert _early_stop([0.9, 0.9], sps) == 2 and _early_stop([0.9, 0.1], sps) == 1
    first, second = _output_tokens(_early_stop, sps)
    assert _matches_target(first) and _matches_target(second)


@dataclass
class _Request:  # what pick_drafts reads of a runner's request
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int = 1
    stop_token_ids: frozenset = frozenset()


def test_a_model_drafters_confidence_is_fixed_before_its_token_is_drawn():
    """A drafter's sampled draft (q = (0.9, 0.1)) against a target of (0.5, 0.5), one draft
    verified only when its confidence pays for the row: the first token keeps the target's
    distribution (chi-square). Read off the drawn token (0.9 for a 0, 0.1 for a 1), the
    confidence verified every 0 and no 1, and a first token was 0 with probability 0.55."""
    sps = {1: 1.0, 2: 0.8}.__getitem__  # a draft pays at confidence 0.9, not at 0.1
    params = SamplingParams(temperature=1.0, max_tokens=100)
    requests = [_Request(params, [0]) for _ in range(TRIALS)]
    drafts = [Draft() for _ in requests]
    probs: list[list[torch.Tensor]] = [[] for _ in requests]
    torch.manual_seed(3)
    drafter_logits = torch.tensor([[0.9, 0.1]]).log().expand(TRIALS, -1)
    pick_drafts(Sampler(1), drafter_logits, requests, drafts, probs)
    verified = []
    for draft, q in zip(drafts, probs, strict=True):
        k = choose_verify_counts({0: draft.confidences}, 1, 1.0, sps, 2).get(0, 0)
        rows = [SamplingRow(params, [0], draft.token_ids[:j], frozenset()) for j in range(k + 1)]
        verified.append(VerifyRequest(rows, draft.token_ids[:k], torch.stack(q)[:k]))
    logits = torch.tensor([list(TARGET_HALF)]).log()
    results = verify(Sampler(0), logits.expand(sum(len(r.rows) for r in verified), -1), verified)
    first = [r.token_ids[0] for r in results]
    counts = [first.count(0), first.count(1)]
    assert chisquare(counts, [len(first) / 2] * 2).pvalue > 1e-3, counts
    assert {round(d.confidences[0], 6) for d in drafts} == {0.9}  # the drafter's top probability


TARGET_HALF = (0.5, 0.5)


# ---- profile and calibration ------------------------------------------------------------

def test_step_rate_profile_interpolates_and_round_trips_through_its_file(tmp_path):
    profile = StepRateProfile([(1, 0.010), (8, 0.012), (32, 0.040)])
    assert profile.seconds(4) == 0.010 + 0.002 * 3 / 7
    assert profile.seconds(64) == 0.080  # past the end: in proportion
    path = StepRateProfile.cache_path(str(tmp_path), {"model": "x", "cpu": "y"})
    assert path != StepRateProfile.cache_path(str(tmp_path), {"model": "x", "cpu": "z"})
    profile.save(path, {"model": "x"})
    assert StepRateProfile.load(path) == profile
    path.write_text("not json")
    assert StepRateProfile.load(path) is None
    # A point slowed by something else on the machine is capped by the later ones.
    noisy = StepRateProfile([(1, 0.010), (2, 0.050), (4, 0.020), (8, 0.030)])
    assert noisy.points == [(1, 0.010), (2, 0.020), (4, 0.020), (8, 0.030)]


def test_sequential_temperature_scaling_tempers_an_overconfident_drafter():
    calibration = Calibration(2, per_request=False, refit_every=200, min_samples=100)
    rng = random.Random(0)
    for i in range(1000):
        # Says 0.95 at both positions, right half the time at the first, a quarter at the
        # second (given the first was).
        first = rng.random() < 0.5
        second = rng.random() < 0.25
        accepted = 0 if not first else (1 if not second else 2)
        calibration.observe(i, [0.95, 0.95], 2, accepted)
    c1, c2 = calibration.confidences("new", [0.95, 0.95])
    assert abs(c1 - 0.5) < 0.1 and abs(c2 - 0.25) < 0.1


def test_ngram_confidence_is_the_requests_own_acceptance_rate():
    calibration = Calibration(3, per_request=True)
    for _ in range(20):
        calibration.observe("good", [1.0, 1.0, 1.0], 3, 3)
        calibration.observe("bad", [1.0, 1.0, 1.0], 3, 0)
    good = calibration.confidences("good", [1.0, 1.0, 1.0])
    bad = calibration.confidences("bad", [1.0, 1.0, 1.0])
    assert min(good) > 0.8 and bad[0] < 0.2
    fresh = calibration.confidences("fresh", [1.0, 1.0, 1.0])
    assert 0.3 < fresh[0] < 0.7  # all requests' rate at that position


def test_a_position_never_verified_borrows_the_rate_of_the_one_before():
    calibration = Calibration(3, per_request=True)
    for i in range(40):  # only the first draft was ever verified, and always accepted
        calibration.observe(i, [1.0, 1.0, 1.0], 1, 1)
    c1, c2, c3 = calibration.confidences("fresh", [1.0, 1.0, 1.0])
    assert c1 > 0.85 and c2 > 0.8 and c3 > 0.75  # not stuck at 0.5, so they get verified


def test_real_step_times_correct_the_profile_by_an_offset():
    profile = StepRateProfile([(1, 0.010), (8, 0.020)])
    for _ in range(200):  # long contexts: every step takes 40 ms more than profiled
        profile.observe(1, 0.050)
        profile.observe(8, 0.060)
    assert abs(profile.seconds(1) - 0.050) < 1e-3 and abs(profile.seconds(8) - 0.060) < 1e-3
    # Extra rows are now relatively cheaper: 8 rows cost 1.2x one row, not 2x.
    assert profile.steps_per_second(1) / profile.steps_per_second(8) < 1.25
    for _ in range(400):  # a profile that overestimates never goes below half of it
        profile.observe(1, 0.0)
    assert profile.seconds(1) == 0.005
