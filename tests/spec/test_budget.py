"""DeepInfer's production schedule (spec/budget.py): the budget searched over every row
count, shares by ranking, drafting within the budget, the drafting cost model, and that
verification under it keeps the target's distribution."""

from __future__ import annotations

import random

import pytest
from test_confidence import DRAFT, _markov_confidences, _matches_target, _output_tokens

from openinfer.spec.budget import (
    DraftCost,
    StepCost,
    best_draft_rows,
    keep_within_budget,
    survivals,
    top_drafts,
)
from openinfer.spec.confidence import StepRateProfile, choose_verify_counts


def test_the_budget_looks_past_a_drop_that_the_papers_rule_stops_at():
    # A machine whose second row costs a lot and the next ones nothing.
    seconds = {1: 1.0, 2: 1.6, 3: 1.6, 4: 1.6}.__getitem__
    confidences = [0.5, 1.0, 1.0]  # survivals 0.5, 0.5, 0.5
    assert choose_verify_counts({"a": confidences}, 1, 1.0, lambda b: 1 / seconds(b), 4) == {}
    # 1 row: 1 token/s; +1: 1.5 / 1.6; +2: 2 / 1.6; +3: 2.5 / 1.6.
    assert best_draft_rows(survivals(confidences), 1, 1.0, seconds, lambda m: 0.0, 4) == 3
    assert best_draft_rows(survivals(confidences), 1, 1.0, seconds, lambda m: 0.0, 3) == 2
    # Drafting that costs a second a draft: none pays.
    assert best_draft_rows(survivals(confidences), 1, 1.0, seconds, lambda m: 1.0 * m, 4) == 0


def test_rows_go_to_the_likeliest_drafts_and_each_request_verifies_a_prefix():
    # Survivals: a 0.9, 0.45; b 0.8, 0.72, 0.072.
    candidates = {"a": [0.9, 0.5], "b": [0.8, 0.9, 0.1]}
    assert top_drafts(candidates, 0) == {}
    assert top_drafts(candidates, 1) == {"a": 1}
    assert top_drafts(candidates, 3) == {"a": 1, "b": 2}
    assert top_drafts(candidates, 4) == {"a": 2, "b": 2}
    assert top_drafts(candidates, 9) == {"a": 2, "b": 3}
    # Ties: earlier positions first.
    assert top_drafts({"a": [1.0, 1.0], "b": [1.0]}, 2) == {"a": 1, "b": 1}


def test_drafting_keeps_the_candidates_that_can_make_the_budget():
    # Position 0 drafted for three requests, two of which go on.
    made = [0.9, 0.6, 0.3]
    assert keep_within_budget(made, [0.85, 0.5], 3) == [0]  # 0.85 is 2nd, 0.5 would be 4th
    assert keep_within_budget(made, [0.85, 0.5], 4) == [0, 1]
    assert keep_within_budget(made, [0.3], 3) == []  # ties: the earlier position wins
    assert keep_within_budget([], [0.2, 0.7, 0.4], 2) == [1, 2]
    assert keep_within_budget(made, [0.99], 0) == []


def test_the_drafting_cost_model_tells_the_fixed_part_from_the_per_draft_part():
    cost = DraftCost()
    assert cost.seconds(10) == 0.0
    for _ in range(50):  # always 40 drafts: all of it is counted per draft
        cost.observe(40, 0.020)
    assert cost.fit.coefficients() == (0.0, pytest.approx(0.0005))
    rng = random.Random(0)
    for _ in range(300):  # 4 ms a step and 0.25 ms a draft, with some noise
        drafts = rng.randrange(1, 129)
        cost.observe(drafts, 0.004 + 0.00025 * drafts + rng.uniform(-2e-4, 2e-4))
    a, b = cost.fit.coefficients()
    assert a == pytest.approx(0.004, abs=3e-4) and b == pytest.approx(0.00025, rel=0.05)
    # A step that drafts nothing costs what such steps took (DSpark still writes its K/V).
    assert cost.seconds(0) == 0.0
    for _ in range(20):
        cost.observe(0, 0.001)
    assert cost.seconds(0) == pytest.approx(0.001) and cost.seconds(1) > 0.004


def test_real_steps_correct_the_profile_per_row_and_per_step():
    profile = StepRateProfile([(1, 0.010), (8, 0.012), (64, 0.040)])
    cost = StepCost(profile)
    assert cost.seconds(8) == 0.012
    for _ in range(50):  # one batch shape only: all of the gap counted per row
        cost.observe(32, profile.profiled_seconds(32) + 0.016)
    assert cost.seconds(32) == pytest.approx(profile.profiled_seconds(32) + 0.016)
    assert cost.seconds(64) == pytest.approx(0.040 + 0.032)
    rng = random.Random(0)
    for _ in range(300):  # long contexts: 0.3 ms more a row, and 4 ms of Python a step
        rows = rng.randrange(8, 65)
        cost.observe(rows, profile.profiled_seconds(rows) + 0.004 + 0.0003 * rows)
    assert cost.seconds(48) == pytest.approx(profile.profiled_seconds(48) + 0.004 + 0.0144, rel=0.01)
    for _ in range(300):  # a profile that overestimates never goes below half of it
        cost.observe(8, 0.0)
    assert cost.seconds(8) == 0.006


# ---- losslessness, with test_confidence.py's two-token Markov drafter --------------------

SECONDS = {2: 1.0, 3: 1.5, 4: 1.86, 5: 2.2}.__getitem__
"""Two requests' rows, then drafts: after a 0 the first request's drafts (survivals 0.9,
0.81) with the other request's (0.8) pay; after a 1 (0.9, 0.09) none do."""
OTHER_REQUEST = [0.8]


def _rows_for(confidences: list[float]) -> int:
    return best_draft_rows(survivals(confidences) + survivals(OTHER_REQUEST), 2, 2.0, SECONDS,
                           lambda m: 0.0, 5)


def _budgeted(past: random.Random):
    def choose(confidences: list[float], sps) -> int:
        # The budget comes from a settled round: drafts drawn before, independently.
        settled = _markov_confidences([int(past.random() < DRAFT[1]) for _ in range(2)])
        return top_drafts({"a": confidences, "b": OTHER_REQUEST}, _rows_for(settled)).get("a", 0)
    return choose


def _from_this_round(confidences: list[float], sps) -> int:
    return top_drafts({"a": confidences, "b": OTHER_REQUEST}, _rows_for(confidences)).get("a", 0)


def test_verifying_within_a_settled_budget_keeps_the_targets_distribution():
    assert _rows_for([0.9, 0.9]) == 3 and _rows_for([0.9, 0.1]) == 0
    first, second = _output_tokens(_budgeted(random.Random(1)), None)
    assert _matches_target(first) and _matches_target(second)
    # The same search over this round's drafts: whether the first draft is verified then
    # depends on its value, and the first token leans to the draft's 0.
    first, _ = _output_tokens(_from_this_round, None)
    assert first.count(0) / len(first) > 0.8 and not _matches_target(first)
