"""User-facing results of generation (offline API and, later, the server)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int
    """1-based rank of the token in the distribution it was read from."""
    decoded_token: str | None = None


# One position's logprobs: the chosen token plus the top-N tokens, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or context), 'abort'."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the output, if any."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (the first sample's, when n > 1)."""
    kv_transfer_params: dict | None = None
    """A prefill-only request's held KV: where a decode instance pulls it from."""
