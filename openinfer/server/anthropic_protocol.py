"""Anthropic's Messages API request body (``POST /v1/messages``), as pydantic models.

Apart from the route (server/anthropic_api.py), which needs the engine, so that the prompt
renderer and the router can read these requests without importing the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from openinfer.server.exceptions import APIError
from openinfer.server.openai_protocol import MAX_MESSAGES, MAX_STOP


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """Anthropic's request body. A field nobody declared is refused (400), and so is a
    declared one set to what we cannot honour (extended thinking, containers, ...)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Accepted, no effect (Anthropic's end-user id)."""
    service_tier: str | None = None
    """Accepted, no effect."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregation, as on the OpenAI endpoints (an openinfer/vLLM extension)."""

    def refuse_unsupported(self) -> None:
        refused = {
            "thinking": (self.thinking is None or self.thinking.get("type") == "disabled",
                         "extended thinking is not supported yet"),
            "container": (self.container is None, "containers are not supported"),
            "mcp_servers": (not self.mcp_servers, "MCP servers are not supported"),
        }
        for name, (ok, why) in refused.items():
            if not ok:
                raise APIError(400, f"{name}: {why}", name, code="unsupported_parameter")


def openai_tools(body: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic's client tools in OpenAI's shape (what chat templates take)."""
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get(
                "type", "custom") not in ("custom", None):
            raise APIError(400, f"tools[{i}]: a client tool is {{\"name\", \"description\", "
                           "\"input_schema\"}} (server tools are not supported)", f"tools.{i}")
        tools.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object"}}})
    return tools
