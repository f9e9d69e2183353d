"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


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
    expected_output_tokens: int = 0
    sent_prompt_tokens: int = 0
    """The prompt's length by this client's tokenizer (the server's count should agree)."""
    oracle_hit_tokens: int = 0
    """Prompt tokens an infinite prefix cache would have held when this was sent."""

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
                result.error = f"HTTP {response.status_code}: {_message(raw)}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = f"stream error: {_message(data)}"
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


def _message(raw: str) -> str:
    try:
        error = json.loads(raw).get("error")
        return error.get("message", raw) if isinstance(error, dict) else str(error or raw)
    except (ValueError, AttributeError):
        return raw[:300]
