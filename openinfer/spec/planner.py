"""The scheduler's side of speculative decoding: which drafts each step verifies, and what
verification taught (acceptance counts, calibration). Pure Python over token ids and
floats, like the scheduler it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from openinfer.spec.budget import DraftCost, StepCost, best_draft_rows, survivals, top_drafts
from openinfer.spec.confidence import Calibration, StepRateProfile, choose_verify_counts
from openinfer.spec.config import SpeculativeConfig
from openinfer.spec.proposer import Draft

if TYPE_CHECKING:
    from openinfer.engine.request import Request


EXPLORE_EVERY = 8
"""budget: where no draft pays, one is still drafted and verified every this many steps, so
acceptance keeps being measured and drafting resumes when drafts get better (a count of
steps: it depends on no draft's value)."""


class SpecDecodeStats:
    """Running totals of verification (vLLM's spec_decode counters)."""

    def __init__(self, num_positions: int) -> None:
        self.num_drafts = 0
        """Verifications: requests that verified at least one draft in a step."""
        self.num_decode_steps = 0
        """(request, step) pairs of decoding requests, verifying drafts or not: a decode
        step has 1 + num_draft_tokens / num_decode_steps rows per request on average."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_positions

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_decode_steps": self.num_decode_steps,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": {
                    str(j): n for j, n in enumerate(self.accepted_per_position)}}


class SpeculationPlanner:
    def __init__(self, config: SpeculativeConfig, step_rates: StepRateProfile | None,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.step_rates = step_rates
        """SPS(B), for the confidence scheduler (None: verify every draft)."""
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.calibration = Calibration(config.num_speculative_tokens,
                                       per_request=config.method == "ngram")
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.draft_cost = DraftCost()
        """budget: seconds a step spends drafting, by drafts proposed."""
        self.step_cost = StepCost(step_rates) if step_rates is not None else None
        """budget: seconds a step's forward pass and sampling take, by rows."""
        self._num_plans = 0
        self.draft_budget: int | None = None
        """budget: the draft rows the next step verifies, chosen this step from this step's
        drafts (None: no plan yet); the drafter proposes for it (SchedulerOutput)."""

    def drafts_to_verify(self, running: list[Request]) -> dict[str, int]:
        """Per decoding request with a draft: how many of its drafts this step verifies
        (never more than its output has room for after the token it samples)."""
        candidates: dict[str, list[float]] = {}
        base_rows = num_decoding = 0
        planned, self.draft_budget = self.draft_budget, None
        for req in running:
            remaining = req.num_tokens - req.num_computed_tokens
            base_rows += remaining
            if remaining != 1:
                continue
            num_decoding += 1
            if req.draft is None:
                continue
            room = req.max_tokens - len(req.output_token_ids) - 1
            if req.grammar is not None:  # drafts the grammar refuses are never verified
                room = req.grammar.valid_prefix_len(req.draft.token_ids[:room])
            draft = req.draft.confidences[:room]
            if draft:
                candidates[req.request_id] = draft
        if self.config.scheduler == "fixed" or self.step_rates is None:
            return {rid: len(c) for rid, c in candidates.items()}
        calibrated = {rid: self.calibration.confidences(rid, c) for rid, c in candidates.items()}
        budget = self.max_num_batched_tokens
        base_rows = min(base_rows, budget)
        if self.config.scheduler == "budget" and num_decoding:
            self.draft_budget = self._plan(calibrated, base_rows, num_decoding)
        if planned is not None:
            return top_drafts(calibrated, min(planned, budget - base_rows))
        if not candidates:
            return {}
        # confidence (the paper's rule), and budget's first steps (no plan yet)
        return choose_verify_counts(calibrated, base_rows, num_decoding,
                                    self.step_rates.steps_per_second, budget)

    def _plan(self, calibrated: dict[str, list[float]], base_rows: int, num_decoding: int) -> int:
        """The next step's draft rows, from this step's drafts (a decoding request without
        one counts as the average request); one every EXPLORE_EVERY plans where none pays."""
        pool = [a for confidences in calibrated.values() for a in survivals(confidences)]
        pool += self.calibration.mean_survivals() * (num_decoding - len(calibrated))
        rows = best_draft_rows(pool, base_rows, num_decoding, self.step_cost.seconds,
                               self.draft_cost.seconds, self.max_num_batched_tokens)
        self._num_plans += 1
        return rows if rows or self._num_plans % EXPLORE_EVERY else 1

    def observe_step(self, rows: int, seconds: float, draft_seconds: float,
                     num_drafted: int) -> None:
        """A step of ``rows`` rows took ``seconds``, ``draft_seconds`` of them drafting
        ``num_drafted`` tokens: correct the step-time model (the budget scheduler models
        drafting on its own; the paper's rule counts it in the step)."""
        if self.step_rates is None:
            return
        if self.config.scheduler == "budget":
            self.draft_cost.observe(num_drafted, draft_seconds)
            self.step_cost.observe(rows, seconds - draft_seconds)
        else:
            self.step_rates.observe(rows, seconds)

    def settle(self, req: Request, num_drafts: int, num_sampled: int,
               proposal: Draft | None) -> None:
        """After a step in which ``req`` sampled (before its tokens are appended): account
        for the drafts it verified and keep the drafter's next proposal."""
        draft, req.draft = req.draft, proposal
        if req.output_token_ids:  # a decode (not the prompt's first token)
            self.stats.num_decode_steps += 1
        if num_drafts:
            accepted = num_sampled - 1
            self.stats.record(num_drafts, accepted)
            self.calibration.observe(req.request_id, draft.confidences, num_drafts, accepted)

    def forget(self, request_id: str) -> None:
        self.calibration.forget(request_id)
