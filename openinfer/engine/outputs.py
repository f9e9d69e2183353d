"""The contracts between scheduler, model runner and engine core (plain data, no tensors).

The scheduler sends the runner only what changed: the full data of requests the
runner has not seen (new, or resumed after preemption), and for the others just
the blocks they gained. The runner keeps its own copy of each request's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openinfer.kv.block_hash import BlockHash
from openinfer.kv.plan import KVPlan
from openinfer.kv.remote import KVTransferParams
from openinfer.outputs import PositionLogprobs, PromptSources
from openinfer.sampling_params import SamplingParams
from openinfer.spec.proposer import Draft

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption (empty for a new request)."""
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]
    block_ids: list[list[int]]
    """The request's whole block table, per layer group."""
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[list[int]]
    """Blocks added since the last step, per layer group."""
    num_computed_tokens: int
    num_kept_blocks: list[int] | None = None
    """Speculative decoding: per group, the table's length before ``new_block_ids``
    (blocks past it were rolled back with rejected drafts); None: nothing was."""


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens of each request to compute this step (a prompt chunk, or 1 for a decode)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the drafts each request verifies this step (its scheduled
    tokens are its last sampled token, then these)."""
    draft_budget: int | None = None
    """Speculative decoding, budget scheduler: the draft rows the next step verifies; a
    drafter that ranks its drafts (DSpark) drafts only those that can make it (None: k)."""
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests that ended (or were preempted) since the last step: the runner drops them."""
    kv: KVPlan = field(default_factory=KVPlan)
    """The step's KV byte movement (tiers, file store, pulls): done by the worker, stores
    and loads before the forward pass."""
    step_id: int = 0
    """The scheduler's count of steps: with asynchronous scheduling a step's output lands
    after the next step was scheduled, and ``update_from_output`` must know which came first."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class GrammarBitmask:
    """Structured outputs: a step's token masks (bit ``t`` of row ``r`` set = token ``t``
    allowed). The one tensor in these messages: a packed bitmask, built on the core's side
    by llguidance, that the runner applies to the logits."""

    rows: dict[str, int]
    """Request id -> its first row (it has 1 + its verified drafts rows)."""
    bitmask: torch.Tensor
    """[rows, ceil(V / 32)] int32, on the CPU."""


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """New tokens of each request whose scheduled tokens reached its end: one today, several
    once speculative decoding verifies drafts. The scheduler checks stops after each one and
    drops those after a stop."""
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    """Per request asking for them: one entry per token of ``sampled_token_ids``."""
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    """Per request: (first prompt position covered, logprobs of the positions computed)."""
    drafts: dict[str, Draft] = field(default_factory=dict)
    """Speculative decoding: each sampling request's proposal for its next step."""
    draft_seconds: float = 0.0
    """Speculative decoding: the time the step spent drafting (the budget scheduler's cost
    model)."""


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (sent to the output processor)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: tuple[int, list[PositionLogprobs]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens the request took from the prefix cache."""
    prompt_sources: PromptSources | None = None
    """Where its prompt's tokens came from, by tier (None before it was scheduled)."""
    pinned_tokens: list[int] | None = None
    """Per ``cache_pins`` entry, the prompt tokens pinned (0: refused by a cap); on its
    outputs up to its first token."""
    kv_transfer_params: KVTransferParams | None = None
    """On the last output of a prefill-only request: where a decode instance pulls its KV
    (set by the engine core's KV connector, which leases the blocks)."""
    first_scheduled_time: float | None = None
    """time.monotonic() in the core when the request was first scheduled; set on its outputs
    up to its first token, None after. The front end compares it with its own monotonic
    timestamps: both processes run on one host, where that clock is system-wide."""


HeldBlocks = dict[BlockHash, tuple[int, ...]]
"""A finished prefill-only request's cached prompt blocks, kept for a decode instance to
pull: hash -> its device block in each layer group, in prompt order."""


@dataclass
class StepUpdate:
    """What ``Scheduler.update_from_output`` made of a landed step."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    holds: dict[str, HeldBlocks] = field(default_factory=dict)
    """Request id -> the blocks of each prefill-only request that finished this step (its
    output is among ``outputs``): the engine core's KV connector leases them."""
