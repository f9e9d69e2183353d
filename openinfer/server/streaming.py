"""Delta streams, as the routes consume them: drained whole (``final``), interleaved
(``merged``), or written as server-sent events that end in-band when the engine fails
(``with_error_event``); and the usage and logprobs fields the OpenAI responses carry."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from openinfer.engine.async_llm import RequestFailedError
from openinfer.engine.core_client import EngineDeadError
from openinfer.outputs import CompletionOutput, PositionLogprobs, PromptSources, RequestOutput
from openinfer.server.error_bodies import error_body

DONE = "data: [DONE]\n\n"


async def final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Drain a delta stream into one whole output per sample."""
    merged: dict[int, CompletionOutput] = {}
    prompt_logprobs = None
    async with contextlib.aclosing(stream):
        async for delta in stream:
            for c in delta.outputs:
                whole = merged.setdefault(c.index, CompletionOutput(
                    c.index, "", [], [] if c.logprobs is not None else None))
                whole.text += c.text
                whole.token_ids += c.token_ids
                if c.logprobs is not None:
                    whole.logprobs += c.logprobs
                whole.finish_reason, whole.stop_reason = c.finish_reason, c.stop_reason
            prompt_logprobs = prompt_logprobs or delta.prompt_logprobs  # on the first delta
            last = delta
    last.prompt_logprobs = prompt_logprobs
    last.outputs = [merged[i] for i in sorted(merged)]
    return last


async def merged(streams: list[AsyncIterator[RequestOutput]],
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several delta streams as they produce; closing this closes them all
    (so a client that disconnects aborts every one of its requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    await queue.put((i, delta))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose engine dies mid-way ends with an error event, not a cut connection."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except EngineDeadError as e:
            yield sse(error_body(f"the engine is unavailable: {e}", "service_unavailable",
                                 code="engine_dead"))
            yield DONE
        except RequestFailedError as e:
            yield sse(error_body(str(e), "service_unavailable", code=e.code))
            yield DONE


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          sources: PromptSources | None = None) -> dict:
    """OpenAI's usage, plus DeepSeek's cache hit/miss split of the prompt and openinfer's
    split by source (the KV tiers, a prefill instance, computed here)."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "prompt_cache_hit_tokens": cached_tokens,
            "prompt_cache_miss_tokens": prompt_tokens - cached_tokens}
    if sources is not None:
        body["prompt_tokens_by_source"] = sources.as_dict()
    return body


def total_sources(sources: list[PromptSources | None]) -> PromptSources | None:
    """Several prompts' sources summed (None where one has none)."""
    if not sources or any(s is None for s in sources):
        return None
    return sum(sources[1:], sources[0])


def completion_logprobs(c: CompletionOutput, prompt: list[tuple[int, PositionLogprobs | None]],
                        tokenizer) -> dict | None:
    """OpenAI's legacy logprobs: echoed prompt tokens first (the very first has no logprob)."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entry in [*prompt, *zip(c.token_ids, c.logprobs)]:
        text = _token_text(entry, token_id) if entry is not None else tokenizer.decode([token_id])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(entry[token_id].logprob if entry is not None else None)
        top.append({_token_text(entry, t): lp.logprob for t, lp in entry.items()}
                   if entry is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, top: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({**_logprob_item(entry, token_id),
                        "top_logprobs": [_logprob_item(entry, t) for t, _ in ranked]})
    return {"content": content}


def _logprob_item(entry: PositionLogprobs, token_id: int) -> dict:
    text = _token_text(entry, token_id)
    return {"token": text, "logprob": entry[token_id].logprob, "bytes": list(text.encode())}


def _token_text(entry: PositionLogprobs, token_id: int) -> str:
    return entry[token_id].decoded_token or ""
