"""Per-request sampling parameters (the vLLM / OpenAI set), validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from openinfer.kv.remote import KVTransferParams
from openinfer.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy decoding.
GREEDY_TEMPERATURE = 1e-5
# logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0


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
    cache_pins: list[list] | None = None
    """Prompt caching's breakpoints: ``[num_tokens, ttl_s]`` pairs (at most 4), each keeping
    the prompt's first ``num_tokens`` tokens (its whole blocks) cached for ``ttl_s`` seconds
    from when they are computed or hit: kept in the host and file tiers until then (the device
    may let them go under pressure). Refreshed by every request that pins them again. A pin
    past the engine's caps (``--kv-pin-memory``, per owner and in all) is not taken;
    ``RequestOutput.pinned_tokens`` says what was."""
    cache_pin_owner: str | None = None
    """Whose pin cap the pins count against (the server passes the API key's tenant)."""
    kv_transfer_params: KVTransferParams | dict | None = None
    """Disaggregation: {"do_remote_decode": true} asks a prefill instance to hold the
    prompt's KV for pickup; a prefill instance's answer (remote_host, remote_port,
    remote_lease_id, remote_block_hashes) tells a decode instance where to pull it.
    Parsed at construction into a frozen ``KVTransferParams``."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (OpenAI semantics: each value in
    [-100, 100]; -100 in effect bans the token, +100 in effect forces it). Keys may be given as
    decimal strings, as JSON clients send them; they are stored as ints. The input processor
    checks the ids against the vocabulary."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens can be sampled (every other logit becomes -inf). Non-empty; the input
    processor checks the ids against the vocabulary."""
    bad_words: list[str] | None = None
    """Words never to generate (vLLM semantics). Each is tokenized as given and with a leading
    space (when that gives other tokens); a one-token word is always banned, a longer one has
    its last token banned whenever the output ends with the rest of it. Needs the tokenizer:
    the input processor resolves the token sequences (see ``bad_words_token_ids``)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last N prompt tokens (left truncation), before the prompt is validated;
    -1 means as many as leave room for max_tokens (max_model_len - max_tokens, or
    max_model_len - 1 when max_tokens is None). The truncated prompt is the one the engine,
    ``prompt_token_ids`` and usage see."""
    structured_outputs: StructuredOutputsParams | dict | None = None
    """Constrain the output to a JSON schema, a regex, a choice of strings or a grammar
    (vLLM's field; see openinfer/structured). Parsed at construction; the input processor
    compiles it, so an invalid grammar is refused before the request is queued."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        """Refuse a value no request may have (ValueError naming the field); normalise the
        list-valued fields."""
        self._validate_sampling()
        self._validate_lengths()
        self._normalize_token_lists()
        _require(_is_int(self.priority), "priority", f"must be an integer, got {self.priority!r}")
        self.kv_transfer_params = KVTransferParams.parse(self.kv_transfer_params)
        self.structured_outputs = StructuredOutputsParams.parse(self.structured_outputs)
        _require(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
                "cache_salt", f"must be a non-empty string, got {self.cache_salt!r}")
        if self.cache_pins is not None:
            self.cache_pins = [list(pin) for pin in self.cache_pins]
            _require(len(self.cache_pins) <= 4 and all(
                len(pin) == 2 and _is_int(pin[0]) and pin[0] >= 1 and _is_number(pin[1])
                and pin[1] > 0 for pin in self.cache_pins), "cache_pins",
                f"must be at most 4 [num_tokens >= 1, ttl_s > 0] pairs, got {self.cache_pins!r}")
        _require(
            self.truncate_prompt_tokens is None
            or (_is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
            "truncate_prompt_tokens", f"must be an integer >= 1, or -1, got {self.truncate_prompt_tokens!r}",
        )

    def _validate_sampling(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature", f"must be a number >= 0, got {self.temperature!r}",
        )
        _require(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p", f"must be in (0, 1], got {self.top_p!r}",
        )
        _require(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k", f"must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}",
        )
        _require(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p", f"must be in [0, 1], got {self.min_p!r}",
        )
        _require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _require(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")

    def _validate_lengths(self) -> None:
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and value >= 0),
                name, f"must be an integer >= 0, got {value!r}",
            )

    def _normalize_token_lists(self) -> None:
        self._stop_list = _normalize_stop(self.stop)
        if self.stop_token_ids is not None:
            _require(
                isinstance(self.stop_token_ids, list | tuple)
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}",
            )
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            _require(
                isinstance(self.allowed_token_ids, list | tuple) and len(self.allowed_token_ids) > 0
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}",
            )
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            _require(
                isinstance(self.bad_words, list | tuple)
                and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words", f"must be a list of non-blank strings, got {self.bad_words!r}",
            )
            self.bad_words = list(dict.fromkeys(self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def edits_logits(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words touch this request's logits
        (the sampler's one check before any of that work)."""
        return bool(self.logit_bias or self.allowed_token_ids or self._bad_words_token_ids)

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """``bad_words`` as token-id sequences; None until the input processor resolved them
        (or when there are no bad words)."""
        return self._bad_words_token_ids

    def set_bad_words_token_ids(self, sequences: list[list[int]]) -> None:
        """Record the token sequences of ``bad_words`` (the input processor computes them with
        the model's tokenizer). Each sequence is a non-empty list of token ids."""
        if not self.bad_words:
            raise ValueError("bad_words: token sequences given for a request without bad words")
        if not (isinstance(sequences, list | tuple) and all(
                isinstance(seq, list | tuple) and seq and all(_is_int(t) and t >= 0 for t in seq)
                for seq in sequences)):
            raise ValueError(f"bad_words: token sequences must be non-empty lists of token ids, "
                             f"got {sequences!r}")
        self._bad_words_token_ids = [list(seq) for seq in sequences]

    def child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples (each a request of its own),
        resolved fields (bad-word token ids) included.

        Seeded children get distinct but reproducible seeds (seed + index), as vLLM does.
        """
        seed = None if self.seed is None else self.seed + index
        return SamplingParams.from_wire({**self.to_wire(), "n": 1, "seed": seed})

    def public_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def to_wire(self) -> dict:
        """Everything the engine core needs, in msgpack-safe types: the public fields (with
        ``logit_bias`` keyed by decimal strings, since msgpack maps only take string keys) plus
        the input processor's resolved fields. ``from_wire(p.to_wire()) == p``."""
        wire = self.public_dict()
        if self.kv_transfer_params is not None:
            wire["kv_transfer_params"] = self.kv_transfer_params.to_dict()
        if self.logit_bias is not None:
            wire["logit_bias"] = {str(token): bias for token, bias in self.logit_bias.items()}
        if self.structured_outputs is not None:
            wire["structured_outputs"] = self.structured_outputs.to_wire()
        wire["_bad_words_token_ids"] = self._bad_words_token_ids
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> SamplingParams:
        """The inverse of ``to_wire`` (validates again)."""
        wire = dict(wire)
        bad_words_token_ids = wire.pop("_bad_words_token_ids", None)
        params = cls(**wire)
        if bad_words_token_ids is not None:
            params.set_bad_words_token_ids(bad_words_token_ids)
        return params


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


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


def _normalize_logit_bias(bias: object) -> dict[int, float]:
    """``{token id (int or decimal string): bias}`` -> ``{int: float}``; ValueError naming
    logit_bias for a key that is not a token id or a value outside [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {bias!r}")
    result: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id_key(key)
        if token is None:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0, or strings of "
                             f"them), got {key!r}")
        if not (_is_number(value) and math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for "
                             f"token {key!r}")
        if token in result:
            raise ValueError(f"logit_bias gives token {token} twice")
        result[token] = float(value)
    return result


def _token_id_key(key: object) -> int | None:
    """A logit_bias key as a token id: an int >= 0 or a string of decimal digits; else None."""
    if _is_int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdecimal():
        return int(key)
    return None
