"""Anthropic's Messages API (``POST /v1/messages``) over the same engine: the request is
translated and checked by the OpenAI handlers' ``OpenAIServing`` (server/serving.py), and
the output read back as Anthropic's content blocks and events."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from openinfer.engine.async_llm import RequestFailedError
from openinfer.engine.core_client import EngineDeadError
from openinfer.kv.remote import KVTransferParams
from openinfer.outputs import CompletionOutput, RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.server import prompt_caching
from openinfer.server.anthropic_protocol import MessagesRequest, openai_tools
from openinfer.server.chat_output import ChatOutput, ToolPlan, plan_tools
from openinfer.server.error_bodies import anthropic_error_body
from openinfer.server.exceptions import APIError
from openinfer.server.limits import PIN_OWNER
from openinfer.server.openai_protocol import kv_transfer_field, structured_param
from openinfer.server.serving import OpenAIServing
from openinfer.server.streaming import final


def tool_plan(body: MessagesRequest, parser_name: str | None, auto_enabled: bool) -> ToolPlan:
    """Anthropic's tools and tool_choice as the OpenAI route plans them: auto, any
    (= required), tool (= a named function), none."""
    tools = openai_tools(body)
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    openai_choice: str | dict = {"auto": "auto", "any": "required", "none": "none"}.get(kind, "")
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif not openai_choice:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                       "tool_choice")
    if not tools:
        openai_choice = "none"
    try:
        return plan_tools(tools, openai_choice, not choice.get("disable_parallel_tool_use"),
                          parser_name, auto_enabled)
    except APIError as e:
        e.message = e.message.replace('"required"', '"any"')
        raise


def _content_blocks(message: dict) -> list[dict]:
    """An OpenAI-shaped assistant message (chat_output.ChatOutput) as Anthropic blocks."""
    blocks: list[dict] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", ()):
        blocks.append(_tool_use_block(call, json.loads(call["function"]["arguments"])))
    return blocks or [{"type": "text", "text": ""}]


def _tool_use_block(call: dict, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": tool_input}


def _stop(c: CompletionOutput, tool_use: bool = False) -> tuple[str, str | None]:
    if c.finish_reason == "stop" and tool_use:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _input_usage(prompt_tokens: int, out: RequestOutput,
                 points: list[prompt_caching.Breakpoint]) -> dict:
    # Anthropic counts cache reads and writes apart from input_tokens (server/prompt_caching.py).
    body = prompt_caching.usage(prompt_tokens, out.num_cached_tokens, points, out.pinned_tokens)
    if out.prompt_sources is not None:  # openinfer's: by KV tier, pulled, computed
        body["prompt_tokens_by_source"] = out.prompt_sources.as_dict()
    return body


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def install_anthropic_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest):
        return await create_message(serving, body)


async def create_message(serving: OpenAIServing, body: MessagesRequest):
    """``POST /v1/messages``: a message, whole or as Anthropic's stream of events."""
    serving.check_model(body.model)
    body.refuse_unsupported()
    tool_parser = serving.tool_parser
    plan = tool_plan(body, tool_parser.name if tool_parser else None,
                     serving.enable_auto_tool_choice)
    points = prompt_caching.breakpoints(body)
    encoding = serving.chat_encoding(None)
    token_ids = serving.renderer.anthropic_messages(body, tools=plan.tools or None,
                                                    encode=encoding)
    shown = prompt_caching.pins(body, points, serving.renderer, plan.tools or None,
                                encoding.text, encoding.prefix_length) if points else []
    params = _sampling_params(body, plan, serving.sampling_defaults or {})
    if shown:
        params.cache_pins, params.cache_pin_owner = [pin for _, pin in shown], PIN_OWNER.get()
    points = [point for point, _ in shown]
    serving.keep_tool_markers(params, plan)
    _, token_ids = serving.tokenized(token_ids, params, "tools", "messages")
    message_id = f"msg_{uuid.uuid4().hex}"
    stream = serving.answer_ids.remembering(serving.llm.generate(token_ids, params, message_id),
                                            encoding.text, params.cache_salt)
    message = {"id": message_id, "type": "message", "role": "assistant",
               "model": serving.model_name}
    output = ChatOutput(plan, tool_parser, None, None)
    if body.stream:
        retain = lambda ids: serving.retain(  # noqa: E731
            token_ids + ids, params.cache_salt, params.cache_pin_owner)
        return StreamingResponse(_message_events(stream, message, output, len(token_ids),
                                                 points, retain),
                                 media_type="text/event-stream")
    whole = await final(stream)
    out = whole.outputs[0]
    content = _content_blocks(output.message(out.text))
    stop_reason, stop_sequence = _stop(out, output.has_tool_calls)
    if stop_reason == "tool_use":
        serving.retain(token_ids + out.token_ids, params.cache_salt, params.cache_pin_owner)
    return JSONResponse({**message, "content": content,
                         "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": {**_input_usage(len(token_ids), whole, points),
                                   "output_tokens": len(out.token_ids)},
                         **kv_transfer_field(whole)})


def _sampling_params(body: MessagesRequest, plan: ToolPlan,
                     sampling_defaults: dict[str, Any]) -> SamplingParams:
    def pick(name: str, value: Any, fallback: Any) -> Any:
        return value if value is not None else sampling_defaults.get(name, fallback)

    return SamplingParams(
        max_tokens=body.max_tokens, temperature=pick("temperature", body.temperature, 1.0),
        top_p=pick("top_p", body.top_p, 1.0), top_k=pick("top_k", body.top_k, 0),
        min_p=pick("min_p", None, 0.0),
        repetition_penalty=pick("repetition_penalty", None, 1.0), stop=body.stop_sequences,
        kv_transfer_params=KVTransferParams.parse(body.kv_transfer_params),
        structured_outputs=structured_param(plan.constraint, "tools"))


@dataclass
class _Blocks:
    """The content block a stream has open: its index, and whether it is a tool call."""
    index: int = 0
    in_tool: bool = False

    def piece(self, piece: dict) -> list[str]:
        """The events for one piece of the assistant message (text, tool calls)."""
        events = []
        if piece.get("content"):
            if self.in_tool:  # text after a call: a block of its own
                events.append(_event("content_block_stop", {"index": self.index}))
                self.index, self.in_tool = self.index + 1, False
                events.append(_event("content_block_start", {
                    "index": self.index, "content_block": {"type": "text", "text": ""}}))
            events.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": piece["content"]}}))
        for call in piece.get("tool_calls", ()):
            events.append(_event("content_block_stop", {"index": self.index}))
            self.index, self.in_tool = self.index + 1, True
            events.append(_event("content_block_start", {
                "index": self.index, "content_block": _tool_use_block(call, {})}))
            events.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call["function"]["arguments"]}}))
        return events


def _message_start(message: dict, prompt_tokens: int, delta: RequestOutput,
                   points: list[prompt_caching.Breakpoint]) -> list[str]:
    """The opening events, at the first delta (when the cache hit is known)."""
    return [_event("message_start", {"message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {**_input_usage(prompt_tokens, delta, points),
                          "output_tokens": 0}}}),
            _event("content_block_start", {"index": 0, "content_block": {
                "type": "text", "text": ""}})]


async def _message_events(stream: AsyncIterator[RequestOutput], message: dict,
                          output: ChatOutput, prompt_tokens: int,
                          points: list[prompt_caching.Breakpoint],
                          on_tool_use: Callable[[list[int]], None]) -> AsyncIterator[str]:
    output_tokens, last, started, ids = 0, None, False, []
    blocks = _Blocks()
    try:
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if not started:
                    started = True
                    for event in _message_start(message, prompt_tokens, delta, points):
                        yield event
                for c in delta.outputs:
                    output_tokens += len(c.token_ids)
                    ids += c.token_ids
                    last = c
                    pieces = output.feed(c.text)
                    if c.finish_reason is not None:
                        pieces += output.finish()
                    for piece in pieces:
                        for event in blocks.piece(piece):
                            yield event
    except (EngineDeadError, RequestFailedError) as e:  # reported in-band
        reason = str(e) if isinstance(e, RequestFailedError) else (
            f"the engine is unavailable: {e}")
        body = anthropic_error_body(getattr(e, "status", 503), reason)
        yield _event("error", {"error": body["error"]})
        return
    yield _event("content_block_stop", {"index": blocks.index})
    stop_reason, stop_sequence = _stop(last, output.has_tool_calls)
    if stop_reason == "tool_use":
        on_tool_use(ids)
    yield _event("message_delta", {
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": {"output_tokens": output_tokens}})
    yield _event("message_stop", {})
