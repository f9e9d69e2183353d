"""Tool-call parsers for the OpenAI chat API, selected by name like vLLM's ``--tool-call-parser``.

A model asked to call tools writes the calls into its ordinary output text in a format of its
own family; a parser splits that text into user-visible ``content`` and structured tool calls.

Formats (``NAME`` is the function name, ``{...}`` a JSON object of arguments):

``hermes`` (Qwen2.5, Qwen3, Hermes)
    ``text<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, repeated for several
    calls. A last block whose ``</tool_call>`` never came is accepted if its JSON is complete.
``deepseek_v3`` (DeepSeek-V3, R1; the bars are full-width ``｜`` U+FF5C, the blanks ``▁`` U+2581)
    ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
    ``\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` (blanks between calls allowed), then
    ``<｜tool▁calls▁end｜>``.
``deepseek_v31`` (DeepSeek-V3.1)
    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, more
    calls, then ``<｜tool▁calls▁end｜>``.
``llama3_json`` (Llama 3.x JSON tool calling)
    ``{"name": NAME, "parameters": {...}}`` (``"arguments"`` accepted too), several separated by
    ``; ``, either prefixed by ``<|python_tag|>`` or as the very start of the output. A ``{`` later
    in ordinary text is never taken for a call.
``mistral``
    ``[TOOL_CALLS][{"name": NAME, "arguments": {...}}, ...]`` (tokenizers before v11), and the
    newer ``[TOOL_CALLS]NAME[ARGS]{...}`` (v13+), ``[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...}`` (v11)
    and ``[TOOL_CALLS]NAME{...}``, one ``[TOOL_CALLS]`` per call.

The markers of all but ``hermes`` are special tokens: the text handed to a parser must be
detokenized with them kept (``skip_special_tokens=False``), or nothing is ever recognised.

Streaming: unlike vLLM, which streams argument fragments, a :class:`ToolCallStreamer` emits each
tool call whole (name and full arguments) once it is complete. That is simpler, cannot emit a
fragment that later proves wrong, and OpenAI clients accept a tool-call delta carrying
everything at once. Content is streamed as it comes, except a tail that may be the start of a
marker, which is held back until decided. Every format is parsed by one generic streamer: a
parser only names its start marker and parses a section (the text after the marker); the
streamer buffers, re-parses the open section as text arrives and emits newly completed calls.

Malformed output never raises. Non-streaming, a malformed or incomplete tool-call section makes
the whole text content with no calls (as vLLM does). Streaming cannot take back calls it has
already sent, so there the malformed part, from the end of the last good call on, is sent as
content and the rest of the output is passed through as plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()


class _Malformed(Exception):
    """A tool-call section that cannot be a valid call, whatever text follows."""


@dataclass
class ToolCall:
    """One function call; ``arguments`` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an OpenAI chat message (or a whole streaming delta)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """A whole output split into content (None when empty or whitespace only) and calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class _Section:
    """What a parser made of an open tool-call section (the text after its start marker).

    ``calls`` are the complete calls from the section's beginning, ``pos`` is where the text
    after the last of them starts, ``end`` is where content resumes once the section is closed
    (None while it may still grow) and ``error`` says the section cannot be valid."""

    calls: list[ToolCall]
    pos: int = 0
    end: int | None = None
    error: bool = False


def _make_call(name: Any, arguments: Any) -> ToolCall:
    """Validate a parsed name and arguments; arguments become JSON text of an object.

    Arguments already given as a string are kept verbatim when they parse as a JSON object
    (some models double-encode them); missing arguments mean a call without any."""
    if not isinstance(name, str) or not name.strip():
        raise _Malformed("tool name is not a non-empty string")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            if isinstance(json.loads(arguments), dict):
                return ToolCall(name.strip(), arguments)
        except json.JSONDecodeError:
            pass
        raise _Malformed("arguments string is not a JSON object")
    if not isinstance(arguments, dict):
        raise _Malformed("arguments are not an object")
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


def _call_from_object(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A call from a ``{"name": ..., "arguments": {...}}`` object (argument key per family)."""
    if not isinstance(obj, dict):
        raise _Malformed("tool call is not an object")
    arguments = next((obj[k] for k in args_keys if k in obj), None)
    return _make_call(obj.get("name"), arguments)


def _loads_object(text: str) -> dict[str, Any]:
    """``json.loads`` that insists on an object and reports failure as :class:`_Malformed`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Malformed(str(e)) from e
    if not isinstance(obj, dict):
        raise _Malformed("not a JSON object")
    return obj


def _decode_object(text: str, i: int) -> tuple[dict[str, Any], int] | None:
    """The JSON object starting at ``text[i]`` and the index after it; None while incomplete.

    Incomplete and invalid JSON look alike to the decoder, so formats without an end marker
    only learn at the end of the output that their JSON was broken."""
    if text[i] != "{":
        raise _Malformed("expected a JSON object")
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _is_prefix(text: str, *markers: str) -> bool:
    """Whether ``text`` may still grow into one of ``markers``."""
    return any(m.startswith(text) for m in markers)


class ToolParser(ABC):
    """One model family's tool-call format. Subclasses set ``start`` and parse sections."""

    name: ClassVar[str]
    start: ClassVar[str]
    """Marker opening a tool-call section, wherever it appears in the output."""
    leading_json: ClassVar[bool] = False
    """Whether an output whose first non-blank character is ``{`` is a section too."""

    @abstractmethod
    def parse_section(self, text: str, final: bool) -> _Section:
        """Parse the text after a start marker; ``final`` when no more text will come.

        Must depend on ``text`` alone (it is re-parsed as it grows) and must not raise."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """Split a whole output; a malformed tool-call section makes it all content."""
        streamer = self.streamer()
        content, calls = streamer.feed(text)
        tail, more = streamer.finish()
        if streamer.failed:
            return ExtractedToolCalls(text if text.strip() else None, [])
        content += tail
        return ExtractedToolCalls(content if content.strip() else None, calls + more)

    def streamer(self) -> ToolCallStreamer:
        """Fresh streaming state, one per choice."""
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Incremental splitting of one output into content and whole tool calls.

    States: content (scanning for the start marker, holding back a possible partial one),
    section (buffering text after the marker until the parser closes it) and, after a
    malformed section, plain (everything is content)."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._buf = ""  # unsent content, or the open section's text
        self._marker: str | None = None  # the marker that opened the current section
        self._sent = 0  # calls of the current section already emitted
        self._at_start = parser.leading_json  # nothing but blanks seen yet
        self._after_call = False  # blanks right after a section are dropped, not content
        self.failed = False
        """Whether a malformed tool-call section was met (its text went out as content)."""

    def feed(self, delta_text: str) -> tuple[str, list[ToolCall]]:
        """New output text in; content safe to show now and the calls completed by it."""
        self._buf += delta_text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: flush held-back content; a broken section comes back as content."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self.failed:
                content.append(self._buf)
                self._buf = ""
                break
            if self._marker is None:
                if not self._scan_content(content, final):
                    break
            elif not self._scan_section(content, calls, final):
                break
        return "".join(content), calls

    def _open(self, marker: str, rest: str) -> None:
        self._marker, self._buf, self._sent = marker, rest, 0

    def _scan_content(self, out: list[str], final: bool) -> bool:
        """Move content out until a section opens (then True) or the text runs out."""
        buf = self._buf
        if self._at_start:
            stripped = buf.lstrip()
            if not stripped and not final:
                return False
            self._at_start = False
            if stripped.startswith("{"):
                self._open("", stripped)
                return True
        i = buf.find(self._parser.start)
        if i >= 0:
            if not (self._after_call and buf[:i].isspace()):
                out.append(buf[:i])
            self._open(self._parser.start, buf[i + len(self._parser.start) :])
            return True
        keep = 0 if final else _partial_marker(buf, self._parser.start)
        ready = buf[: len(buf) - keep]
        if self._after_call and not ready.strip():
            if final:
                self._buf = ""
            return False
        out.append(ready)
        self._buf, self._after_call = buf[len(ready) :], False
        return False

    def _scan_section(self, out: list[str], calls: list[ToolCall], final: bool) -> bool:
        """Emit newly completed calls; True when the section closed and content resumes."""
        sec = self._parser.parse_section(self._buf, final)
        calls.extend(sec.calls[self._sent :])
        self._sent = len(sec.calls)
        if sec.end is not None and not sec.error:
            self._marker, self._buf, self._after_call = None, self._buf[sec.end :], True
            return True
        if not final:
            if sec.error:
                self._fail(sec, out)
            return sec.error
        if not sec.error and not self._buf[sec.pos :].strip():
            self._marker, self._buf = None, ""  # unclosed, but nothing after its last call
            return False
        self._fail(sec, out)
        return True

    def _fail(self, sec: _Section, out: list[str]) -> None:
        """A malformed section: what follows its last good call is content from now on."""
        out.append(("" if sec.calls else self._marker or "") + self._buf[sec.pos :])
        self._marker, self._buf, self.failed = None, "", True


class HermesToolParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: one JSON object per ``<tool_call>`` block."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_section(self, text: str, final: bool) -> _Section:
        close = text.find(self.end)
        if close < 0 and not final:
            return _Section([])
        body = text if close < 0 else text[:close]
        try:
            call = _call_from_object(_loads_object(body))
        except _Malformed:
            return _Section([], error=True)
        stop = len(text) if close < 0 else close + len(self.end)
        return _Section([call], pos=stop, end=stop)


class _DeepSeekToolParser(ToolParser):
    """DeepSeek: a ``calls begin`` section of ``call begin ... call end`` blocks."""

    start = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    @abstractmethod
    def parse_call(self, body: str) -> ToolCall:
        """One call from the text between the call begin and end markers."""

    def parse_section(self, text: str, final: bool) -> _Section:
        sec = _Section([])
        i = _skip_ws(text, 0)
        try:
            while i < len(text):
                if text.startswith(self.calls_end, i):
                    sec.end = i + len(self.calls_end)
                    return sec
                if not text.startswith(self.call_begin, i):
                    if _is_prefix(text[i:], self.calls_end, self.call_begin):
                        return sec
                    raise _Malformed("unexpected text between tool calls")
                body_start = i + len(self.call_begin)
                close = text.find(self.call_end, body_start)
                if close < 0:
                    return sec
                sec.calls.append(self.parse_call(text[body_start:close]))
                sec.pos = close + len(self.call_end)
                i = _skip_ws(text, sec.pos)
        except _Malformed:
            sec.error = True
        return sec


class DeepSeekV3ToolParser(_DeepSeekToolParser):
    """DeepSeek-V3: ``function<｜tool▁sep｜>NAME`` then the arguments in a json code fence."""

    name = "deepseek_v3"
    _fence = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)

    def parse_call(self, body: str) -> ToolCall:
        kind, sep, rest = body.partition(self.sep)
        if not sep or kind.strip() not in ("", "function"):
            raise _Malformed("no function<｜tool▁sep｜>")
        name, _, args = rest.partition("\n")
        args = args.strip()
        fenced = self._fence.match(args)
        return _make_call(name, _loads_object(fenced.group(1) if fenced else args))


class DeepSeekV31ToolParser(_DeepSeekToolParser):
    """DeepSeek-V3.1: ``NAME<｜tool▁sep｜>{...}`` with bare JSON arguments."""

    name = "deepseek_v31"

    def parse_call(self, body: str) -> ToolCall:
        name, sep, args = body.partition(self.sep)
        if not sep:
            raise _Malformed("no <｜tool▁sep｜>")
        return _make_call(name, _loads_object(args.strip()))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x: ``;``-separated ``{"name", "parameters"}`` objects at the output's start."""

    name = "llama3_json"
    start = "<|python_tag|>"
    leading_json = True

    def parse_section(self, text: str, final: bool) -> _Section:
        sec = _Section([])
        i = _skip_ws(text, 0)
        try:
            while i < len(text):
                decoded = _decode_object(text, i)
                if decoded is None:
                    if final:
                        raise _Malformed("incomplete JSON")
                    return sec
                obj, end = decoded
                sec.calls.append(_call_from_object(obj, ("parameters", "arguments")))
                sec.pos = end
                i = _skip_ws(text, sec.pos)
                if i < len(text) and text[i] != ";":
                    sec.end = sec.pos  # ordinary text follows the calls
                    return sec
                i = _skip_ws(text, i + 1)
        except _Malformed:
            sec.error = True
        return sec


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of calls, or one ``NAME[ARGS]{...}`` call."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    _name = re.compile(r"[\w.\-]*")
    _call_id = re.compile(r"\[CALL_ID\]\s*\w*")

    def parse_section(self, text: str, final: bool) -> _Section:
        sec = _Section([])
        i = _skip_ws(text, 0)
        try:
            if i < len(text):
                parse = self._parse_list if text[i] == "[" else self._parse_named
                parse(text, i, sec)
        except _Malformed:
            sec.error = True
        return sec

    def _parse_list(self, text: str, i: int, sec: _Section) -> None:
        """``[{...}, {...}]``: calls complete one by one; the section ends at ``]``."""
        i = _skip_ws(text, i + 1)
        if text.startswith("]", i):
            sec.pos = sec.end = i + 1
            return
        while i < len(text):
            decoded = _decode_object(text, i)
            if decoded is None:
                return
            obj, end = decoded
            sec.calls.append(_call_from_object(obj))
            sec.pos = end
            i = _skip_ws(text, sec.pos)
            if i == len(text):
                return
            if text[i] == "]":
                sec.pos = sec.end = i + 1
                return
            if text[i] != ",":
                raise _Malformed("expected , or ] in the tool-call list")
            i = _skip_ws(text, i + 1)

    def _parse_named(self, text: str, i: int, sec: _Section) -> None:
        """``NAME[CALL_ID]id[ARGS]{...}`` with the bracketed parts optional; one call."""
        name_end = self._name.match(text, i).end()
        j = _skip_ws(text, name_end)
        if text.startswith("[CALL_ID]", j):
            j = _skip_ws(text, self._call_id.match(text, j).end())
        if text.startswith("[ARGS]", j):
            j = _skip_ws(text, j + len("[ARGS]"))
        if j == len(text) or _is_prefix(text[j:], "[ARGS]", "[CALL_ID]"):
            return
        decoded = _decode_object(text, j)
        if decoded is None:
            return
        args, end = decoded
        sec.calls.append(_make_call(text[i:name_end], args))
        sec.pos = sec.end = end


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
    )
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known: {known}") from None
