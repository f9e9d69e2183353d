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


@dataclass(frozen=True)
class PromptSources:
    """Where a request's prompt tokens came from (they sum to the prompt's length)."""

    l1: int = 0
    """The prefix cache in device memory."""
    l2: int = 0
    """Host memory, copied back to the device."""
    l3: int = 0
    """The shared file store, read for this request."""
    pulled: int = 0
    """Computed by a prefill instance and pulled from it (disaggregation)."""
    computed: int = 0
    """Computed here."""

    def __add__(self, other: PromptSources) -> PromptSources:
        return PromptSources(self.l1 + other.l1, self.l2 + other.l2, self.l3 + other.l3,
                             self.pulled + other.pulled, self.computed + other.computed)

    def as_dict(self) -> dict[str, int]:
        """The API's shape (``prompt_tokens_by_source``): the tiers as the metrics name them."""
        return {"L1": self.l1, "L2": self.l2, "L3": self.l3, "pulled": self.pulled,
                "computed": self.computed}

    def to_wire(self) -> list[int]:
        return [self.l1, self.l2, self.l3, self.pulled, self.computed]


@dataclass
class RequestMetrics:
    """A request's milestones, as time.monotonic() values (seconds; one clock for the
    front end and its engine-core process, which run on one host). With n > 1 samples:
    the earliest sample's scheduling and first token, the last sample's finish.

        arrival -> first_scheduled -> first_token -> finished
           queue time      prefill time    decode time
    """

    arrival_time: float
    """When the front end received it (before tokenization)."""
    first_scheduled_time: float | None = None
    """When the engine core first gave it tokens to compute (reported by the core)."""
    first_token_time: float | None = None
    """When the front end received its first generated token."""
    finished_time: float | None = None
    """When the front end saw its last sample end (or aborted it)."""

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
    prompt_sources: PromptSources | None = None
    """Where the prompt's tokens came from, by tier (the first sample's, when n > 1)."""
    pinned_tokens: list[int] | None = None
    """Per ``SamplingParams.cache_pins`` entry, the prompt tokens it pinned (whole blocks;
    0 where a cap refused it); None without pins."""
    kv_transfer_params: dict | None = None
    """A prefill-only request's held KV: where a decode instance pulls it from."""
