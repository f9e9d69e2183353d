"""A request as the engine core tracks it: token ids and progress counters, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openinfer.kv.remote import KVTransferParams
from openinfer.outputs import PromptSources
from openinfer.sampling_params import SamplingParams
from openinfer.spec.proposer import Draft

if TYPE_CHECKING:
    from openinfer.structured.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    """Queued, and its prefix blocks are being read into the host tier (file store or a
    prefill instance); schedulable again when they arrive or fail."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """Its KV could not be pulled and the policy is to fail (not recompute)."""


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    """Resolved output limit: min(params.max_tokens, max_model_len - prompt length)."""
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prompt first, then outputs)."""
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache when first scheduled (-1 until then)."""
    prompt_tokens_by_source: PromptSources | None = None
    """Where its prompt's tokens came from, by tier (set when first scheduled)."""
    first_scheduled_time: float | None = None
    """time.monotonic() when the scheduler first gave it tokens (None until then)."""
    pinned_tokens: list[int] = field(default_factory=list)
    """Per ``cache_pins`` entry taken so far, the tokens it pinned (a pin is taken once its
    tokens are computed)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of the request's full blocks (prompt, then outputs)."""
    store_load_tried: bool = False
    """Its prefix blocks were looked for in the file store once (a failed read is not retried)."""
    num_blocks_from_store: int = 0
    store_prefetched: bool = False
    """Looked for in the file store while queued behind the head (once)."""
    remote_load_tried: bool = False
    """Its prompt's blocks were pulled from a prefill instance once (not retried)."""
    num_blocks_from_remote: int = 0
    draft: Draft | None = None
    """Speculative decoding: the drafter's proposal to follow the last sampled token."""
    admitted_step: int = -1
    """The step at which it last started running (asynchronous scheduling: an older step's
    output, for an earlier run of it or another request of the same id, is not its own)."""
    grammar: RequestGrammar | None = None
    """Structured outputs: the matcher its output tokens advance (kept across preemption:
    the output tokens are kept too)."""
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most output it may get: no slot past it is ever needed."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    @property
    def remote_prefill(self) -> KVTransferParams | None:
        """The prefill instance's kv_transfer_params, when this request pulls its KV."""
        params = self.sampling_params.kv_transfer_params
        return params if params is not None and params.pulls else None

    @property
    def wants_remote_decode(self) -> bool:
        params = self.sampling_params.kv_transfer_params
        return params is not None and params.do_remote_decode

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end generation: EOS (unless ignore_eos) plus the request's own."""
        params = self.sampling_params
        own = frozenset(params.stop_token_ids or ())
        return own if params.ignore_eos else own | self.eos_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Whether the last appended token ends the request (and why)."""
        last = self.output_token_ids[-1]
        num_out = len(self.output_token_ids)
        params = self.sampling_params
        if num_out >= params.min_tokens and last in self.stop_token_ids:
            # As in vLLM: stop_reason names a stop token the user asked for; EOS leaves it None.
            self.stop_reason = last if last in (params.stop_token_ids or ()) else None
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.active:
            if self.grammar.error is not None:  # a token the mask allowed was refused
                self.stop_reason = f"grammar error: {self.grammar.error.splitlines()[0]}"
                return RequestStatus.FINISHED_ERROR
            if self.grammar.is_terminated:  # complete: only EOS could follow
                return RequestStatus.FINISHED_STOPPED
        if num_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
