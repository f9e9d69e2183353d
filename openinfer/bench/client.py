"""Talking to the server under test: one streamed request timed chunk by chunk, and the
served model's name from ``/v1/models``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from openinfer.bench import BenchError


class ServerError(BenchError):
    """The server cannot be used as asked: unreachable, no model listed, no ``/tokenize``."""


@dataclass
class RequestResult:
    session: int
    turn: int
    start_s: float
    """When it was sent, in seconds from the start of the run."""
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    """Gaps between successive chunks that carried output."""
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    prompt_sources: dict[str, int] | None = None
    """The usage's ``prompt_tokens_by_source`` (an openinfer server's: by KV tier); None
    from a server without it."""
    expected_output_tokens: int = 0
    sent_prompt_tokens: int | None = None
    """The prompt's length by this client's tokenizer (the server's count should agree, but
    for a returning chat turn where the server runs the answers as the ids it generated);
    None where it could not be counted."""
    oracle_hit_tokens: int | None = None
    """Prompt tokens an infinite prefix cache would have held when this was sent; None where
    the oracle could not be scored."""

    @property
    def tpot_s(self) -> float | None:
        """vLLM's definition: (E2E - TTFT) / (output tokens - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def stream_request(http: httpx.AsyncClient, url: str, body: dict,
                         result: RequestResult, clock_zero: float,
                         count_empty_chunks: bool = False) -> RequestResult:
    """POST ``body`` (with stream=True) to ``url`` and fill ``result`` as chunks arrive.

    A token is timed when its chunk brings text; with ``count_empty_chunks``, when any
    chunk with a choice arrives (a model whose vocabulary is padded past its tokenizer's
    emits tokens that decode to nothing)."""
    start = time.perf_counter()
    result.start_s = start - clock_zero
    last = None
    chunks = 0
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {error_message(raw)}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = f"stream error: {error_message(data)}"
                    return result
                if payload.get("usage"):
                    _read_usage(payload["usage"], result)
                choices = payload.get("choices") or ()
                piece = "".join(_choice_text(c) for c in choices)
                if not piece and not (count_empty_chunks and choices):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
                result.text += piece
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    if result.ttft_s is None:
        result.error = "the stream ended without output"
        return result
    if not result.output_tokens:  # a server that does not report usage: count chunks
        result.output_tokens = chunks
    result.ok = True
    return result


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def _read_usage(usage: dict, result: RequestResult) -> None:
    result.prompt_tokens = usage.get("prompt_tokens") or 0
    result.output_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    # OpenAI's field, else DeepSeek's.
    result.cached_tokens = details.get("cached_tokens") or usage.get("prompt_cache_hit_tokens") or 0
    result.prompt_sources = usage.get("prompt_tokens_by_source")


def error_message(raw: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the start of the body."""
    try:
        error = json.loads(raw).get("error")
        return error.get("message", raw) if isinstance(error, dict) else str(error or raw)
    except (ValueError, AttributeError):
        return raw[:300]


def first_served_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The id of the first model ``GET {base_url}/v1/models`` lists (what ``vllm bench serve``
    takes when ``--model`` is not given). ServerError if the server cannot be reached, does not
    answer that API, or lists no model."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot list the served models: {url} ({type(e).__name__}: {e}); "
                          "is the server up? (or pass --model NAME)") from e
    if response.status_code != 200:
        raise ServerError(f"cannot list the served models: {url} answered HTTP "
                          f"{response.status_code}: {error_message(response.text)}; pass --model NAME")
    try:
        models = response.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, TypeError) as e:
        raise ServerError(f"{url} is not an OpenAI model list: {response.text[:200]}; "
                          "pass --model NAME") from e
    except IndexError as e:
        raise ServerError(f"the server at {base_url} lists no model ({url} is empty); "
                          "pass --model NAME") from e
