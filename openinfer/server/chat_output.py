"""Chat completions' tools and reasoning: what a request's ``tools`` / ``tool_choice`` make
the engine do, and how a choice's output text becomes an OpenAI assistant message (whole,
or as stream deltas).

``tool_choice`` (OpenAI's semantics, vLLM's enforcement):

* ``none``: the tools are not shown to the model and its output is plain content;
* ``auto`` (the default with tools): the model decides; its text is parsed for tool calls by
  the server's ``--tool-call-parser`` (which must be set, with ``--enable-auto-tool-choice``);
* ``required``: a grammar forces a JSON array of ``{"name", "parameters"}`` objects, one per
  call (exactly one when ``parallel_tool_calls`` is false), each valid under its tool's schema;
* a named function: a grammar forces that function's arguments object; the output is its
  ``arguments``.

The forced forms need no parser, so they work with every model. With a reasoning parser the
text inside ``<think>…</think>`` becomes ``reasoning_content`` and any grammar applies only
after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from openinfer.server.exceptions import APIError
from openinfer.server.reasoning import ReasoningParser, ReasoningStreamer
from openinfer.server.tool_parsers import ToolCall, ToolCallStreamer, ToolParser


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the engine and of the output parser."""

    mode: str
    """"none" (no tools), "auto", "required" or "named"."""
    tools: list[dict[str, Any]]
    """The tools as the chat template receives them (OpenAI's ``{"type": "function",
    "function": {...}}``); empty when the model is not to see them."""
    constraint: dict[str, Any] | None = None
    """StructuredOutputsParams fields forcing the call (required, named)."""
    named: str | None = None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
               parallel_tool_calls: bool | None, parser_name: str | None,
               auto_enabled: bool) -> ToolPlan:
    """Check a request's tools and tool_choice (400s naming the field) and plan them."""
    tools = tools or []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
            raise APIError(400, f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": {...}}}", f"tools[{i}]")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           f"tools[{i}].function.parameters")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice: a named choice is {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", "tool_choice")
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        return ToolPlan("named", tools, {"json": _parameters(tool)}, named=name)
    if choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice must be none, auto, required or a named function, "
                       f"got {choice!r}", "tool_choice")
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "none":
        return ToolPlan("none", [])
    if choice == "auto":
        if not auto_enabled or parser_name is None:
            raise APIError(400, '"auto" tool choice needs the server started with '
                           "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools)
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                          "parameters": _parameters(t)},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}
    if parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolPlan("required", tools, {"json": calls})


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _forced_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls of a grammar-forced output; None when it is not complete JSON (the
    output was cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        return [ToolCall(plan.named, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in value]


class ChatOutput:
    """One choice's output text -> an assistant message: ``reasoning_content``, ``content``
    and ``tool_calls``, whole (``message``) or as stream deltas (``feed``, ``finish``)."""

    def __init__(self, plan: ToolPlan, tool_parser: ToolParser | None,
                 reasoning: ReasoningParser | None, prompt_text: str | None) -> None:
        self.plan = plan
        self.reasoning = reasoning
        self.prompt_text = prompt_text
        self.tool_parser = tool_parser if plan.mode == "auto" else None
        self._reasoning_stream: ReasoningStreamer | None = (
            reasoning.streamer(prompt_text) if reasoning is not None else None)
        self._tool_stream: ToolCallStreamer | None = (
            self.tool_parser.streamer() if self.tool_parser is not None else None)
        self._forced_text = ""
        self._num_calls = 0

    @property
    def has_tool_calls(self) -> bool:
        return self._num_calls > 0

    def message(self, text: str) -> dict[str, Any]:
        """The whole output as a chat message."""
        reasoning_content, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text, self.prompt_text)
            reasoning_content, content = split.reasoning_content, split.content or ""
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning_content is not None:
            message["reasoning_content"] = reasoning_content
        calls: list[ToolCall] = []
        if self.plan.mode in ("named", "required"):
            forced = _forced_calls(self.plan, content)
            if forced is not None:
                calls, message["content"] = forced, None
        elif self.tool_parser is not None:
            extracted = self.tool_parser.extract(content)
            calls, message["content"] = extracted.tool_calls, extracted.content
        if calls:
            self._num_calls = len(calls)
            message["tool_calls"] = [call.to_openai() for call in calls]
        elif message["content"] is None and reasoning_content is None:
            message["content"] = ""
        return message

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """The stream deltas a piece of output text makes (possibly none yet)."""
        return self._deltas(delta_text, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas held back until the end of the output."""
        return self._deltas("", final=True)

    def _deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """``final``: the end of the output (``text`` is then empty)."""
        deltas: list[dict[str, Any]] = []
        content = text
        if self._reasoning_stream is not None:
            reasoning, content = (self._reasoning_stream.finish() if final
                                  else self._reasoning_stream.feed(text))
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        calls: list[ToolCall] = []
        if self.plan.mode in ("named", "required"):
            self._forced_text += content
            content = ""
            if final:
                forced = _forced_calls(self.plan, self._forced_text)
                if forced is None:  # cut short: what was written is all there is
                    content = self._forced_text
                else:
                    calls = forced
        elif self._tool_stream is not None:
            content, calls = (self._tool_stream.finish() if final
                              else self._tool_stream.feed(content))
        if content:
            deltas.append({"content": content})
        for call in calls:
            deltas.append({"tool_calls": [{"index": self._num_calls, **call.to_openai()}]})
            self._num_calls += 1
        return deltas

