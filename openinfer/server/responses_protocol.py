"""OpenAI's Responses API request (``POST /v1/responses``) and its translation into the chat
request the engine already serves: input items become chat messages (``function_call`` items
an assistant turn's tool calls, ``function_call_output`` items tool messages), ``instructions``
a system message, ``tools`` and ``text.format`` the chat's tools and ``response_format``. The
chat request's own checks then apply to all of it. A field or item this server cannot honour
is refused with a 400 naming it (``input[2].content[0].type``), never dropped."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openinfer.server.exceptions import APIError
from openinfer.server.openai_protocol import MAX_MESSAGES, ChatCompletionRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_MESSAGES)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Declared so that they are refused by name when set.
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    stream_options: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        refused = {
            "reasoning": "reasoning controls are not supported",
            "include": "include: no extra output data is available here",
            "background": "background responses are not supported",
            "conversation": "conversations are not supported; use previous_response_id",
            "prompt": "prompt templates are not supported",
            "max_tool_calls": "max_tool_calls is not supported",
            "top_logprobs": "logprobs are not supported on the Responses API here; use "
                            "/v1/chat/completions",
            "stream_options": "stream_options are not supported",
        }
        for name, why in refused.items():
            if getattr(self, name) not in (None, False, [], {}):
                raise APIError(400, f"{name}: {why}", name, code="unsupported_parameter")
        if self.truncation == "auto":
            raise APIError(400, "truncation: 'auto' (dropping the start of a conversation) is "
                           "not supported; a prompt past the context is refused", "truncation",
                           code="unsupported_parameter")

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [dict(item) for item in self.input]

    def chat_request(self, items: list[dict[str, Any]], first_new: int) -> ChatCompletionRequest:
        """The chat request of a conversation (``items``: earlier turns, then this request's
        input from ``first_new``, whose items errors name by their index in ``input``)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for i, item in enumerate(items):
            where = f"input[{i - first_new}]" if i >= first_new else "previous_response_id"
            _append(messages, item, where)
        if not messages:
            raise APIError(400, "input: give at least one item", "input")
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": self.temperature,
            "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens,
            "user": self.user, "prompt_cache_key": self.prompt_cache_key,
            "parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream}
        if self.tools:
            fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.text is not None:
            fields["response_format"] = _response_format(self.text)
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise APIError(400, f"{where}: {error['msg']}", "input") from None


def _append(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """One input item onto the chat messages."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                           f"{where}.role")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function", "function": {
            "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        if messages and messages[-1]["role"] == "assistant":  # its text, or parallel calls
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "reasoning":
        return  # an earlier answer's reasoning, sent back: templates leave it out, as here
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(output, f"{where}.output")})
    else:
        raise APIError(400, f"{where}.type: {kind!r} items are not supported (message, "
                       "function_call, function_call_output, reasoning)", f"{where}.type",
                       code="unsupported_parameter")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{where}[{j}].type: {kind!r} content is not supported (text "
                           "only: input_text, output_text)", f"{where}[{j}].type",
                           code="unsupported_parameter")
        texts.append(part.get("text") or "")
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: a string is required", f"{where}.{key}")
    return value


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}].type: {tool.get('type')!r} tools are not supported "
                       "(function only)", f"tools[{i}].type", code="unsupported_parameter")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f"tool_choice.type: {choice.get('type')!r} is not supported "
                       "(auto, none, required, or a function)", "tool_choice",
                       code="unsupported_parameter")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as the chat's ``response_format``."""
    unknown = set(text) - {"format", "verbosity"}
    if unknown or text.get("verbosity") not in (None, "medium"):
        name = sorted(unknown)[0] if unknown else "verbosity"
        raise APIError(400, f"text.{name} is not supported", f"text.{name}",
                       code="unsupported_parameter")
    form = text.get("format") or {"type": "text"}
    kind = form.get("type")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": form.get("name"), "schema": form.get("schema"), "strict": form.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(400, f"text.format.type: {kind!r} is not supported (text, json_object, "
                   "json_schema)", "text.format", code="unsupported_parameter")
