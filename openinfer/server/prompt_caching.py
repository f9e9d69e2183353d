"""Anthropic prompt caching on ``/v1/messages``: ``cache_control`` breakpoints become engine
pins (``SamplingParams.cache_pins``, kv/pins.py), and the usage says what was written.

A breakpoint (``{"type": "ephemeral", "ttl": "5m" | "1h"}``, at most 4, on a tool, a system
block or a message's text or ``tool_result`` block) pins the prompt up to the end of that
block for its TTL, refreshed by every request that pins it again. Where a block ends in the
prompt's tokens is found by rendering the request with a marker after each breakpointed
block: the marker's place in the text, encoded, is the number of tokens before it. The engine
pins whole blocks of that prefix, up to its caps (``--kv-pin-memory``, per API key and in
all); what it pinned comes back on the output, and the usage counts, as Anthropic does:

    cache_read_input_tokens      the prompt tokens read from the cache (any prefix hit)
    cache_creation_input_tokens  tokens past the hit that this request pinned, split by TTL
                                 in cache_creation.{ephemeral_5m,ephemeral_1h}_input_tokens
    input_tokens                 the rest (a pin a cap refused counts here)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openinfer.server.anthropic_protocol import MessagesRequest
from openinfer.server.exceptions import APIError
from openinfer.server.prompt import PromptRenderer

TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4
MARK = "<<openinfer-cache-breakpoint-{}>>"


@dataclass(frozen=True)
class Breakpoint:
    param: str
    """Where the request set it, as a 400 names it (``system.1.cache_control``)."""
    ttl: str


def breakpoints(body: MessagesRequest) -> list[Breakpoint]:
    """The request's ``cache_control`` breakpoints in prompt order (400 on a bad one)."""
    found = [(f"tools.{i}", tool) for i, tool in enumerate(body.tools or ())]
    if isinstance(body.system, list):
        found += [(f"system.{j}", block) for j, block in enumerate(body.system)]
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            found += [(f"messages.{i}.content.{j}", b) for j, b in enumerate(message.content)]
    points = []
    for where, item in found:
        control = item.get("cache_control") if isinstance(item, dict) else None
        if control is None:
            continue
        param = f"{where}.cache_control"
        if not isinstance(control, dict) or control.get("type") != "ephemeral" or (
                set(control) - {"type", "ttl"}) or control.get("ttl", "5m") not in TTLS:
            raise APIError(400, f"{param}: must be {{\"type\": \"ephemeral\"}} with an optional "
                           "\"ttl\" of \"5m\" or \"1h\"", param)
        if item.get("type") == "tool_use":
            raise APIError(400, f"{param}: a breakpoint on a tool_use block is not supported; "
                           "put it on a text or tool_result block", param)
        points.append(Breakpoint(param, control.get("ttl", "5m")))
    if len(points) > MAX_BREAKPOINTS:
        param = points[MAX_BREAKPOINTS].param
        raise APIError(400, f"{param}: at most {MAX_BREAKPOINTS} blocks may have cache_control, "
                       f"got {len(points)}", param)
    return points


def pins(body: MessagesRequest, points: list[Breakpoint], renderer: PromptRenderer,
         tools: list[dict[str, Any]] | None, text: str,
         prefix_length: Callable[[int], int]) -> list[tuple[Breakpoint, list]]:
    """The breakpoints the prompt shows, each with its ``cache_pins`` entry: [tokens before
    the end of the block, TTL seconds]. ``text`` is the rendered prompt; ``prefix_length``
    the ids of its first characters. A breakpoint the template does not show (a tool under tool_choice none)
    pins nothing; if marking the blocks changes the rendering otherwise, none does."""
    marked, marked_tools = copy.deepcopy(body), copy.deepcopy(tools)
    for n, point in enumerate(points):
        _mark(marked, marked_tools, point.param.removesuffix(".cache_control"), MARK.format(n))
    rendered = renderer.anthropic_text(marked, marked_tools)
    offsets, plain = [], rendered
    for n in range(len(points)):
        at = plain.find(MARK.format(n))
        offsets.append(at if at >= 0 else 0)
        plain = plain.replace(MARK.format(n), "")
    if plain != text:
        return []
    return [(point, [prefix_length(at), TTLS[point.ttl]])
            for at, point in zip(offsets, points) if at > 0]


def _mark(body: MessagesRequest, tools: list[dict] | None, where: str, mark: str) -> None:
    """Append ``mark`` to the text of the block at ``where`` (a tool: its description)."""
    kind, index, *rest = where.split(".")
    if kind == "tools":
        if tools and int(index) < len(tools):
            tools[int(index)]["function"]["description"] += mark
        return
    block = (body.system if kind == "system"
             else body.messages[int(index)].content)[int(rest[-1]) if rest else int(index)]
    if block.get("type") == "text":
        block["text"] += mark
    elif isinstance(block.get("content"), str):  # tool_result
        block["content"] += mark
    elif isinstance(block.get("content"), list) and block["content"]:
        block["content"][-1]["text"] += mark


def usage(prompt_tokens: int, cached: int, points: list[Breakpoint],
          pinned: list[int] | None) -> dict[str, Any]:
    """Anthropic's input usage: what was read, written (pinned past the hit, by TTL), and the
    rest. ``points``: the breakpoints pinned, ``pinned`` the tokens each pin took."""
    pinned = list(pinned or ())
    ends = {ttl: max([t for p, t in zip(points, pinned) if p.ttl == ttl], default=0)
            for ttl in TTLS}
    long = max(0, ends["1h"] - cached)
    short = max(0, ends["5m"] - max(cached, ends["1h"]))
    return {"input_tokens": prompt_tokens - cached - long - short,
            "cache_creation_input_tokens": long + short,
            "cache_read_input_tokens": cached,
            "cache_creation": {"ephemeral_5m_input_tokens": short,
                               "ephemeral_1h_input_tokens": long}}
