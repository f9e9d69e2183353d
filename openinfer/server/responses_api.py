"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``) over the chat path: a request is translated into a
chat request (server/responses_protocol.py) and prepared by ``OpenAIServing.prepare_chat``, so
tools, ``tool_choice``, structured outputs (``text.format``), the answer-ids splice and
tool-call KV retention are the chat's own. The answer comes back as Responses output items
(a ``message`` with ``output_text``, ``function_call`` items), whole or as the Responses
stream of events. With ``store`` (the default) the response and its conversation go to the
response store (server/response_store.py), and ``previous_response_id`` continues that
conversation: its turns are rendered again, and the answers among them are spliced in as the
ids the engine generated, so the continuation is a prefix-cache hit."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from openinfer.engine.async_llm import RequestFailedError
from openinfer.engine.core_client import EngineDeadError
from openinfer.outputs import RequestOutput
from openinfer.server.exceptions import APIError
from openinfer.server.limits import PIN_OWNER
from openinfer.server.response_store import ResponseStore
from openinfer.server.responses_protocol import ResponsesRequest
from openinfer.server.serving import OpenAIServing, PreparedChat
from openinfer.server.streaming import final


def install_responses_routes(app: FastAPI, serving: OpenAIServing,
                             store: ResponseStore | None) -> None:
    @app.post("/v1/responses")
    async def create(body: ResponsesRequest):
        return await create_response(serving, store, body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return _stored(store, response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        if store is None or not store.delete(response_id, PIN_OWNER.get()):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str) -> dict:
        response, conversation = _stored(store, response_id)
        data = conversation[:len(conversation) - len(response["output"])]
        data = [{"id": f"item_{response_id}_{i}", **item} for i, item in enumerate(data)][::-1]
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param,
                    code="response_not_found")


def _stored(store: ResponseStore | None, response_id: str,
            param: str = "response_id") -> tuple[dict, list[dict]]:
    found = store.get(response_id, PIN_OWNER.get()) if store is not None else None
    if found is None:
        raise _not_found(response_id, param)
    return found


async def create_response(serving: OpenAIServing, store: ResponseStore | None,
                          body: ResponsesRequest):
    body.refuse_unsupported()
    if body.store and store is None:
        raise APIError(400, "store: this server keeps no responses (--responses-store none); "
                       "send store: false", "store", code="unsupported_parameter")
    owner = PIN_OWNER.get()  # (read here: a stream's body runs after this handler returns)
    history = (_stored(store, body.previous_response_id, "previous_response_id")[1]
               if body.previous_response_id else [])
    items = history + body.input_items()
    chat = serving.prepare_chat(body.chat_request(items, len(history)), prompt_param="input")
    response = _shell(serving, body, chat)
    stream = serving.generate_chat(chat, response["id"])

    def finish(output: list[dict], ids: list[int], finish_reason: str | None,
               out: RequestOutput) -> dict:
        """The finished response (stored when asked); a tool call retains the KV."""
        if any(item["type"] == "function_call" for item in output):
            serving.retain_after(chat, ids)
        done = _finished(response, output, finish_reason, len(chat.token_ids), len(ids), out)
        if body.store:
            store.put(done, items + [_as_input(item) for item in output], owner)
        return done

    if body.stream:
        return StreamingResponse(_events(stream, response, chat, finish),
                                 media_type="text/event-stream")
    whole = await final(stream)
    c = whole.outputs[0]
    answer = chat.choices.whole(c)
    return JSONResponse(finish(output_items(answer["message"]), c.token_ids, c.finish_reason,
                               whole))


def _shell(serving: OpenAIServing, body: ResponsesRequest, chat: PreparedChat) -> dict:
    """The response object before its output: what the request asked, echoed."""
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "model": serving.model_name, "status": "in_progress", "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": chat.params.temperature, "top_p": chat.params.top_p,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "truncation": "disabled", "usage": None, "user": body.user}


def _finished(response: dict, output: list[dict], finish_reason: str | None,
              input_tokens: int, output_tokens: int, out: RequestOutput) -> dict:
    incomplete = finish_reason == "length"
    usage: dict[str, Any] = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens}
    if out.prompt_sources is not None:  # openinfer's: by KV tier, pulled, computed
        usage["prompt_tokens_by_source"] = out.prompt_sources.as_dict()
    if incomplete:
        output = [{**item, "status": "incomplete"} if item["type"] == "message" else item
                  for item in output]
    return {**response, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "usage": usage}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict) -> list[dict]:
    """An OpenAI-shaped assistant message (chat_output.ChatOutput) as output items."""
    items = [_reasoning_item(message["reasoning_content"])] if message.get(
        "reasoning_content") else []
    items += [_message_item(message["content"])] if message.get("content") else []
    items += [_call_item(call) for call in message.get("tool_calls", ())]
    return items if any(item["type"] != "reasoning" for item in items) else items + [
        _message_item("")]


def _as_input(item: dict) -> dict:
    """An output item as the conversation keeps it (what a client would send back)."""
    return {key: value for key, value in item.items() if key not in ("id", "status")}


class _Events:
    """The Responses stream's events, numbered, with the output items they build."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict] = []
        self.message: dict | None = None
        """The message item being streamed, if one is open."""
        self.reasoning = ""
        """Reasoning text not yet sent (it goes out whole, as the first item)."""

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def flush_reasoning(self) -> list[str]:
        if not self.reasoning:
            return []
        item, self.reasoning = _reasoning_item(self.reasoning), ""
        return [self._added(item),
                self.event("response.output_item.done", output_index=len(self.output) - 1,
                           item=item)]

    def text(self, delta: str) -> list[str]:
        events = self.flush_reasoning()
        if self.message is None:
            self.message = _message_item("", "in_progress")
            events += [self._added(self.message),
                       self.event("response.content_part.added", **self._at(),
                                  content_index=0, part=_text_part(""))]
            self.message["text"] = ""
        self.message["text"] += delta
        return events + [self.event("response.output_text.delta", **self._at(), content_index=0,
                                    delta=delta, logprobs=[])]

    def call(self, call: dict) -> list[str]:
        item = _call_item(call)
        events = self.flush_reasoning() + self.close_message()
        events += [self._added({**item, "arguments": "", "status": "in_progress"})]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events += [self.event("response.function_call_arguments.delta", **where,
                              delta=item["arguments"]),
                   self.event("response.function_call_arguments.done", **where,
                              arguments=item["arguments"])]
        self.output[-1] = item
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=item)]

    def close_message(self) -> list[str]:
        if self.message is None:
            return []
        text = self.message.pop("text")
        done = {**self.message, "status": "completed", "content": [_text_part(text)]}
        self.output[-1], at = done, self._at()
        self.message = None
        return [self.event("response.output_text.done", **at, content_index=0, text=text,
                           logprobs=[]),
                self.event("response.content_part.done", **at, content_index=0,
                           part=_text_part(text)),
                self.event("response.output_item.done", output_index=at["output_index"],
                           item=done)]

    def _added(self, item: dict) -> str:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1,
                          item={k: v for k, v in item.items() if k != "text"})

    def _at(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}


async def _events(stream: AsyncIterator[RequestOutput], response: dict, chat: PreparedChat,
                  finish: Callable[..., dict]) -> AsyncIterator[str]:
    events = _Events()
    yield events.event("response.created", response=response)
    yield events.event("response.in_progress", response=response)
    output = chat.choices.output()
    last: RequestOutput | None = None
    ids: list[int] = []
    finish_reason = None
    try:
        async with contextlib.aclosing(stream):
            async for delta in stream:
                last = delta
                for c in delta.outputs:
                    ids += c.token_ids
                    finish_reason = c.finish_reason
                    pieces = output.feed(c.text)
                    if c.finish_reason is not None:
                        pieces += output.finish()
                    for piece in pieces:
                        events.reasoning += piece.get("reasoning_content") or ""
                        for event in (events.text(piece["content"]) if piece.get("content")
                                      else []):
                            yield event
                        for call in piece.get("tool_calls", ()):
                            for event in events.call(call):
                                yield event
    except (EngineDeadError, RequestFailedError) as e:  # reported in-band
        reason = str(e) if isinstance(e, RequestFailedError) else f"the engine is unavailable: {e}"
        yield events.event("error", code="server_error", message=reason, param=None)
        return
    for event in events.flush_reasoning() + events.close_message():
        yield event
    if all(item["type"] == "reasoning" for item in events.output):
        for event in events.text("") + events.close_message():  # as the whole answer has
            yield event
    done = finish(events.output, ids, finish_reason, last)
    kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
    yield events.event(kind, response=done)

