"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Every field a request may carry is declared here, and each is one of three kinds:

* honoured: it changes what the engine does (sampling fields, vLLM's extras);
* accepted with no effect on the output, because it has none here (``user``,
  ``metadata``, ``service_tier``, ``prompt_cache_key`` — prefix caching is always on);
* refused with a 400 naming it when set to a value we cannot honour (``functions``,
  ``best_of`` > 1, beam search, ...), see :data:`REFUSED`. A field nobody declared is
  refused too, as OpenAI does ("Unrecognized request argument supplied"), so nothing is
  silently ignored.

Sampling fields a request leaves unset take the server's defaults (the model's
``generation_config.json`` with ``--generation-config auto``), then OpenAI's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from openinfer.kv.remote import KVTransferParams
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.server.exceptions import APIError
from openinfer.structured.params import StructuredOutputsParams

PROMPT_PIN_TOKENS = 1 << 30
"""A pin of the whole prompt (the engine pins at most the prompt's tokens)."""

# Caps on what one request may ask for (beyond them: a 400 naming the field and the cap).
# A request's cost is bounded by them and the body size (--max-body-bytes): no single
# client can queue unbounded work with one call.
MAX_N = 128
"""Samples per prompt (``n``)."""
MAX_PROMPTS = 1024
"""Prompts in one /v1/completions batch."""
MAX_STOP = 64
"""Stop strings (``stop``, Anthropic's ``stop_sequences``)."""
MAX_MESSAGES = 4096
"""Chat messages in one conversation (OpenAI's and Anthropic's)."""
MAX_LOGPROBS = 20
"""Top log probabilities per token (``logprobs``, ``top_logprobs``; OpenAI's cap)."""


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Field -> (is this value one we can honour?, why not). Checked before a request is queued.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_unset, "the deprecated functions field is not supported; use tools"),
    "function_call": (_unset, "the deprecated function_call field is not supported; use "
                              "tool_choice"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not supported (as in vLLM V1); use n"),
    "use_beam_search": (_unset, "beam search is not supported"),
    "length_penalty": (lambda v: v in (None, 1.0), "length_penalty needs beam search, "
                                                   "which is not supported"),
    "logits_processors": (_unset, "custom logits processors are not supported"),
    "audio": (_unset, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "reasoning_effort": (_unset, "reasoning controls are not supported yet"),
    "web_search_options": (_unset, "web search is not supported"),
    "store": (_unset, "this server does not store completions"),
    "return_tokens_as_token_ids": (_unset, "return_tokens_as_token_ids is not supported"),
    "prompt_logprobs": (_unset, "prompt_logprobs is not supported here; use echo with logprobs "
                                "on /v1/completions"),
    "prompt_embeds": (_unset, "prompt embeddings are not supported"),
    "documents": (_unset, "documents (RAG chat templates) are not supported"),
    "mm_processor_kwargs": (_unset, "multimodal inputs are not supported"),
    "vllm_xargs": (_unset, "vllm_xargs is not supported"),
    "suffix": (_unset, "suffix (insertion) is not supported"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(default=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's shape) -> bias added to its logit, in [-100, 100]."""
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted, no effect on the output.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    """OpenAI's cache-routing hint: prefix caching here is automatic, keyed by content; the
    router keeps the requests of one key on one replica (router/forward.py)."""
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    """OpenAI's: ``24h`` pins the prompt's blocks for 24 hours (kept in the host and file
    tiers, under ``--kv-pin-memory``; kv/pins.py); ``in_memory`` is the default caching."""
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    """Lower runs first when the server runs with --scheduling-policy priority."""
    cache_salt: str | None = None
    """Prefix-cache isolation (vLLM's field): different salts never share cached KV."""
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregation (vLLM's field): {"do_remote_decode": true} to a prefill instance;
    the kv_transfer_params of its answer to a decode instance."""
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (one of them per request; see structured_outputs_params).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # Declared so that they are refused by name (see REFUSED), not as unknown.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    vllm_xargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set to a value this server cannot honour."""
        for name, (honourable, why) in REFUSED.items():
            if not honourable(getattr(self, name, None)):
                raise APIError(400, f"{name}: {why}", name, code="unsupported_parameter")
        if self.stream_options is not None:
            if not self.stream:
                raise APIError(400, "stream_options is only allowed with stream: true",
                               "stream_options")
            if self.stream_options.continuous_usage_stats:
                raise APIError(400, "stream_options.continuous_usage_stats is not supported",
                               "stream_options.continuous_usage_stats",
                               code="unsupported_parameter")
        if not self.spaces_between_special_tokens:
            raise APIError(400, "spaces_between_special_tokens: false is not supported",
                           "spaces_between_special_tokens", code="unsupported_parameter")

    def structured_outputs_params(self) -> tuple[dict[str, Any] | None, str | None]:
        """The output constraint the request asks for, as ``StructuredOutputsParams``
        fields, and the field that asked (to name it in errors)."""
        forms: list[tuple[dict[str, Any], str]] = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            forms.append((_response_format(rf), "response_format"))
        if self.structured_outputs:
            forms.append((dict(self.structured_outputs), "structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                forms.append(({key: getattr(self, name)}, name))
        if self.guided_decoding_backend not in (None, "auto", "llguidance", "guidance"):
            raise APIError(400, f"guided_decoding_backend: {self.guided_decoding_backend!r} is "
                           "not available; this server constrains outputs with llguidance",
                           "guided_decoding_backend", code="unsupported_parameter")
        if len(forms) > 1:
            names = ", ".join(source for _, source in forms)
            raise APIError(400, f"give one output constraint, not several ({names})",
                           forms[1][1])
        if not forms:
            if self.guided_whitespace_pattern is not None:
                raise APIError(400, "guided_whitespace_pattern needs a JSON constraint",
                               "guided_whitespace_pattern")
            return None, None
        fields, source = forms[0]
        if self.guided_whitespace_pattern is not None:
            fields["whitespace_pattern"] = self.guided_whitespace_pattern
        return fields, source

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        ) -> SamplingParams:
        """The engine's parameters: the request's fields, then ``defaults`` (the server's
        sampling defaults, e.g. the model's generation config), then OpenAI's.
        ``structured_outputs``: a constraint of the server's own (a forced tool call),
        instead of the request's."""
        self.refuse_unsupported()
        defaults = defaults or {}
        if structured_outputs is None:
            fields, source = self.structured_outputs_params()
            structured_outputs = structured_param(fields, source)

        def pick(name: str, value: Any, fallback: Any) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", self.temperature, 1.0),
            top_p=pick("top_p", self.top_p, 1.0), top_k=pick("top_k", self.top_k, 0),
            min_p=pick("min_p", self.min_p, 0.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, 1.0),
            seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=pick("max_tokens", max_tokens, None), min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens,
            priority=self.priority, cache_salt=self.cache_salt,
            cache_pins=[[PROMPT_PIN_TOKENS, 86400.0]] if self.prompt_cache_retention == "24h"
            else None,
            kv_transfer_params=KVTransferParams.parse(self.kv_transfer_params),
            structured_outputs=structured_outputs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _response_format(rf: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` (json_object, json_schema) as constraint fields."""
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            raise APIError(400, "response_format.json_schema.schema: a JSON schema object is "
                           "required", "response_format")
        return {"json": spec["schema"]}
    raise APIError(400, f"response_format.type: {kind!r} is not supported (text, json_object, "
                   "json_schema)", "response_format")


def structured_param(fields: dict[str, Any] | None,
                     source: str | None) -> StructuredOutputsParams | None:
    """Checked constraint fields; a 400 naming ``source`` (the request's field) if not."""
    if fields is None:
        return None
    try:
        return StructuredOutputsParams.parse(fields)
    except (TypeError, ValueError) as e:
        raise structured_error(e, source) from None


def structured_error(e: Exception, source: str | None) -> APIError:
    """A constraint the engine refused, as a 400 naming the field the client used."""
    message = str(e)
    if source and source != "structured_outputs" and message.startswith("structured_outputs"):
        message = source + message[len("structured_outputs"):]
    return APIError(400, message, source or "structured_outputs")


def kv_transfer_field(out: RequestOutput) -> dict:
    """vLLM's response field for disaggregation: where a decode instance pulls the KV."""
    params = out.kv_transfer_params
    if not params:
        return {}
    return {"kv_transfer_params": {**params, "remote_block_hashes": [
        h.hex() for h in params.get("remote_block_hashes", [])]}}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True
    """Whether the tokenizer adds its special tokens (e.g. BOS) to a text prompt."""

    @field_validator("prompt")
    @classmethod
    def _few_enough_prompts(cls, prompt):
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if batch and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools; the chat template receives them (server/chat_output.py)."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one call (enforced under tool_choice "required")."""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Render the last (assistant) message open, so the model continues it (vLLM's field)."""
    add_special_tokens: bool = False
    """Whether the tokenizer adds special tokens on top of the rendered template."""
    chat_template: str | None = None
    """A Jinja chat template for this request instead of the server's."""
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False
    """vLLM's: the response carries ``prompt_token_ids`` (what the engine ran) and each
    choice its ``token_ids`` (streamed: the first chunk, and each delta's)."""
    # Refused by name when set (see REFUSED).
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    verbosity: str | None = None
    echo: bool = False
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo: not supported on chat completions", "echo",
                           code="unsupported_parameter")
        if self.verbosity not in (None, "medium"):
            raise APIError(400, "verbosity: output verbosity controls are not supported",
                           "verbosity", code="unsupported_parameter")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                           "be true", "continue_final_message")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    """Whether the tokenizer adds its special tokens: by default yes for a prompt, no for
    messages (the rendered template holds them), as vLLM does."""
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
