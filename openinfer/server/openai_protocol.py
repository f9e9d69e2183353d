"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Unknown fields are ignored, as OpenAI does; fields we cannot honour are refused
with a 400 naming them. vLLM's sampling extras (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    """Prefix-cache isolation (vLLM's field): different salts never share cached KV."""
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregation (vLLM's field): {"do_remote_decode": true} to a prefill instance;
    the kv_transfer_params of its answer to a decode instance."""

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt,
            kv_transfer_params=engine_kv_transfer_params(self.kv_transfer_params),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def engine_kv_transfer_params(params: dict | None) -> dict | None:
    """Block hashes travel as hex in JSON and as bytes in the engine."""
    if not params or "remote_block_hashes" not in params:
        return params
    hashes = params["remote_block_hashes"]
    try:
        assert isinstance(hashes, list)
        return {**params, "remote_block_hashes": [bytes.fromhex(h) for h in hashes]}
    except (AssertionError, TypeError, ValueError):
        raise ValueError("kv_transfer_params.remote_block_hashes must be a list of hex "
                         "strings") from None


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
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
