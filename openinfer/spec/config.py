"""``--speculative-config``: which drafter proposes tokens, how many, and how many of them
each step verifies. vLLM's field names where vLLM has the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model", "mtp", "dspark")
SCHEDULERS = ("fixed", "confidence", "budget")
MAX_SPECULATIVE_TOKENS = 16
"""Drafts verified per request per step at most: past this the acceptance of the tail
is nil for every drafter measured, and the verify rows cost a prefill's worth."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram (prompt lookup), suffix (suffix tree over the request and recent outputs),
    draft_model (a smaller model with the same tokenizer), mtp (the checkpoint's own
    multi-token-prediction modules) or dspark (DeepSeek's block drafter with a confidence
    head: a drafter checkpoint, openinfer/models/dspark.py)."""
    num_speculative_tokens: int
    """Tokens each proposal drafts (and, with the fixed scheduler, each step verifies)."""
    model: str | None = None
    """draft_model, dspark: the draft checkpoint's path (dspark: unset, the drafter that ships
    for the target, where one does)."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix of the context that may match."""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix tried (the longest match wins)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest substring indexed (and matched)."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: finished and running requests whose outputs the global tree keeps."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a continuation is drafted while its frequency given the path is at least this."""
    scheduler: str = "fixed"
    """fixed: verify every draft; confidence: verify the drafts that maximise expected
    accepted tokens per second (DSpark's rule, spec/confidence.py); budget: DeepInfer's
    production schedule, the step's draft rows chosen from the previous step's drafts and
    handed out by this step's ranking, the drafter drafting only for them (spec/budget.py)."""
    sps_cache_dir: str | None = None
    """confidence, budget: where the steps-per-second profile is kept (default
    ~/.cache/openinfer/sps); keyed by model, dtype, device and CPU."""
    refresh_sps: bool = False
    """confidence, budget: profile again at start-up even when a cached profile exists."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"speculative_config.scheduler must be one of "
                             f"{', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft checkpoint) is required for "
                             "method 'draft_model'")
        if self.method not in ("draft_model", "dspark") and self.model is not None:
            raise ValueError(f"speculative_config.model is only for methods 'draft_model' and "
                             f"'dspark', not {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min "
                             f"({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config: suffix_decoding_max_tree_depth must be >= 1 "
                             "and suffix_decoding_max_cached_requests >= 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")

    @property
    def uses_model(self) -> bool:
        """Drafted by a network that keeps KV of its own (draft_model, mtp, dspark)."""
        return self.method in ("draft_model", "mtp", "dspark")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past the verified tokens that drafting writes: a model drafter's chain
        runs k - 1 positions past the token the step sampled (DSpark's block keeps its K/V
        for the pass only)."""
        return self.num_speculative_tokens if self.method in ("draft_model", "mtp") else 0

    @staticmethod
    def parse(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string, the offline API's dict, or a config; unknown keys
        are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config.{required} is required")
        return SpeculativeConfig(**value)
