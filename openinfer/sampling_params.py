"""Per-request sampling parameters (the vLLM / OpenAI set), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are treated as greedy decoding.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions to return for the prompt."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in the prompt or output (divides positive logits)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that appeared in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from the logit of a token once per appearance in the output."""
    seed: int | None = None
    """A seeded request samples the same tokens whatever else is in the batch."""
    stop: str | list[str] | None = None
    """Stop strings; the output text ends before the first one (not included by default)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to the model's EOS)."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    max_tokens: int | None = 16
    """Maximum generated tokens; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop tokens are masked until this many tokens were generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs per output position."""
    prompt_logprobs: int | None = None
    """Return logprobs for prompt positions, with this many top logprobs each."""
    skip_special_tokens: bool = True
    detokenize: bool = True
    priority: int = 0
    """Lower runs first when the scheduler policy is 'priority'."""
    cache_salt: str | None = None
    """Prefix-cache isolation key (e.g. per tenant): requests with different salts never
    share cached KV, even for identical prompts."""
    kv_transfer_params: dict | None = None
    """Disaggregation: {"do_remote_decode": true} asks a prefill instance to hold the
    prompt's KV for pickup; a prefill instance's answer (remote_host, remote_port,
    remote_lease_id, remote_block_hashes) tells a decode instance where to pull it."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def require(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name} {message}")

        require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        require(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature", f"must be a number >= 0, got {self.temperature!r}",
        )
        require(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p", f"must be in (0, 1], got {self.top_p!r}",
        )
        require(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k", f"must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}",
        )
        require(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p", f"must be in [0, 1], got {self.min_p!r}",
        )
        require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        require(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            require(
                self.min_tokens <= self.max_tokens,
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(
                value is None or (_is_int(value) and value >= 0),
                name, f"must be an integer >= 0, got {value!r}",
            )
        self._stop_list = _normalize_stop(self.stop)
        if self.stop_token_ids is not None:
            require(
                isinstance(self.stop_token_ids, list | tuple)
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}",
            )
            self.stop_token_ids = list(self.stop_token_ids)
        require(_is_int(self.priority), "priority", f"must be an integer, got {self.priority!r}")
        require(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict),
                "kv_transfer_params", "must be an object")
        require(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
                "cache_salt", f"must be a non-empty string, got {self.cache_salt!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    def child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples (each a request of its own).

        Seeded children get distinct but reproducible seeds (seed + index), as vLLM does.
        """
        seed = None if self.seed is None else self.seed + index
        params = SamplingParams(**{**self.public_dict(), "n": 1, "seed": seed})
        return params

    def public_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stops):
        raise ValueError("stop must not contain empty strings")
    return stops
