"""Tool-call parsers: each family's format whole, and streamed in every chunking.

The streamed result (content joined, calls in order, ids aside) must equal the non-streaming one
for any split of the text, and no piece of a marker may ever reach the content."""

from __future__ import annotations

import json
import random

import pytest

from openinfer.server.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    get_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
SEARCH = {"query": 'café "best" 東京', "filters": {"tags": ["a", "b"], "n": 3}}
UNICODE = {"text": "Grüße, мир, 世界 🌍", "emoji": "✓"}


def _hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def _ds3(name: str, args: dict) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
        f"{json.dumps(args, ensure_ascii=False)}\n```<｜tool▁call▁end｜>"
    )


def _ds31(name: str, args: dict) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


def _ds_section(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(calls) + "<｜tool▁calls▁end｜>"


def _llama(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)


def _mistral_list(*calls: tuple[str, dict]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def _mistral_args(name: str, args: dict) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args, ensure_ascii=False)}"


W, S, U = ("get_weather", WEATHER), ("search", SEARCH), ("echo", UNICODE)
PRE = "Let me check that for you.\n\n"
PLAIN = "The weather in Paris is mild; {braces} and <tags> [brackets] are fine here."

# (parser, text, expected content, expected calls as (name, args dict))
GOOD: list[tuple[str, str, str | None, list[tuple[str, dict]]]] = [
    ("hermes", _hermes(*W), None, [W]),
    ("hermes", _hermes(*W) + "\n" + _hermes(*S), None, [W, S]),
    ("hermes", PRE + _hermes(*W), PRE, [W]),
    ("hermes", PLAIN, PLAIN, []),
    ("hermes", _hermes(*U), None, [U]),
    ("hermes", PRE + _hermes(*W) + "\nI will wait.", PRE + "\nI will wait.", [W]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("deepseek_v3", _ds_section(_ds3(*W)), None, [W]),
    ("deepseek_v3", _ds_section(_ds3(*W), _ds3(*S)), None, [W, S]),
    ("deepseek_v3", PRE + _ds_section(_ds3(*W)), PRE, [W]),
    ("deepseek_v3", PLAIN, PLAIN, []),
    ("deepseek_v3", _ds_section(_ds3(*U)), None, [U]),
    ("deepseek_v31", _ds_section(_ds31(*W)), None, [W]),
    ("deepseek_v31", _ds_section(_ds31(*W), _ds31(*S)), None, [W, S]),
    ("deepseek_v31", PRE + _ds_section(_ds31(*W)), PRE, [W]),
    ("deepseek_v31", PLAIN, PLAIN, []),
    ("deepseek_v31", _ds_section(_ds31(*U)), None, [U]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + _ds31(*W), None, [W]),
    ("llama3_json", _llama(*W), None, [W]),
    ("llama3_json", _llama(*W) + "; " + _llama(*S), None, [W, S]),
    ("llama3_json", "<|python_tag|>" + _llama(*W), None, [W]),
    ("llama3_json", PRE + "<|python_tag|>" + _llama(*W), PRE, [W]),
    ("llama3_json", PLAIN, PLAIN, []),
    ("llama3_json", _llama(*U), None, [U]),
    ("llama3_json", '{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("mistral", _mistral_list(W), None, [W]),
    ("mistral", _mistral_list(W, S), None, [W, S]),
    ("mistral", PRE + _mistral_list(W), PRE, [W]),
    ("mistral", PLAIN, PLAIN, []),
    ("mistral", _mistral_list(U), None, [U]),
    ("mistral", _mistral_args(*W), None, [W]),
    ("mistral", _mistral_args(*W) + _mistral_args(*S), None, [W, S]),
    ("mistral", PRE + _mistral_args(*W), PRE, [W]),
    ("mistral", _mistral_args(*U), None, [U]),
    ("mistral", '[TOOL_CALLS]f[CALL_ID]abcDEF123[ARGS]{"a": 1}', None, [("f", {"a": 1})]),
    ("mistral", '[TOOL_CALLS]f{"a": 1}', None, [("f", {"a": 1})]),
]

# Broken tool-call sections: the whole text comes back as content, no calls.
BAD: list[tuple[str, str]] = [
    ("hermes", PRE + '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("hermes", PRE + "<tool_call>\nnot json at all\n</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": '),
    ("deepseek_v3", PRE + _ds_section(_ds3(*W).replace('"Paris"', "Paris"))),
    ("deepseek_v3", PRE + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage"),
    ("deepseek_v31", PRE + _ds_section(_ds31(*W).replace("{", "{{"))),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", PRE + '<|python_tag|>brave_search.call(query="x")'),
    ("mistral", PRE + '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}'),
    ("mistral", '[TOOL_CALLS] ["f", {"a": 1}]'),
    ("mistral", "[TOOL_CALLS] Sorry, I cannot call tools."),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1'),
    ("mistral", "[TOOL_CALLS]f[ARGS][1, 2]"),
]

MARKERS = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ],
    "llama3_json": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
}
MARKERS["deepseek_v31"] = MARKERS["deepseek_v3"]


def _calls(result: ExtractedToolCalls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def _stream(parser: ToolParser, chunks: list[str]) -> tuple[list[str], list[ToolCall]]:
    streamer = parser.streamer()
    pieces: list[str] = []
    calls: list[ToolCall] = []
    for chunk in [*chunks, None]:
        content, done = streamer.feed(chunk) if chunk is not None else streamer.finish()
        pieces.append(content)
        calls += done
    return pieces, calls


def _chunkings(text: str) -> list[list[str]]:
    """Every two-way split, one char at a time, and random chunk sizes (fixed seed)."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(1234)
    for _ in range(30):
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            chunks.append(text[i : i + n])
            i += n
        out.append(chunks)
    return out


def _check_streams_match(name: str, text: str, markers: bool) -> None:
    parser = get_tool_parser(name)
    whole = parser.extract(text)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    for chunks in _chunkings(text):
        pieces, calls = _stream(parser, chunks)
        content = "".join(pieces)
        got = (content if content.strip() else None, [(c.name, c.arguments) for c in calls])
        assert got == expected, chunks
        if markers:
            for marker in MARKERS[name]:
                assert marker not in content, (marker, chunks)
                # nothing shown early that a later chunk would have turned into a marker
                for piece in pieces:
                    assert marker not in piece


@pytest.mark.parametrize(("name", "text", "content", "calls"), GOOD)
def test_extract(name: str, text: str, content: str | None, calls: list) -> None:
    result = get_tool_parser(name).extract(text)
    assert result.content == content
    assert _calls(result) == calls
    for call in result.tool_calls:
        assert json.loads(call.arguments) is not None
        assert "\\u" not in call.arguments  # ensure_ascii=False: unicode kept as is


@pytest.mark.parametrize(("name", "text"), BAD)
def test_malformed_falls_back_to_content(name: str, text: str) -> None:
    result = get_tool_parser(name).extract(text)
    assert result.content == text
    assert result.tool_calls == []


@pytest.mark.parametrize(("name", "text", "content", "calls"), GOOD)
def test_streaming_matches_extract(name: str, text: str, content: str | None, calls: list):
    _check_streams_match(name, text, markers=True)


@pytest.mark.parametrize(("name", "text"), BAD)
def test_streaming_malformed_is_content(name: str, text: str) -> None:
    _check_streams_match(name, text, markers=False)


def test_partial_marker_is_held_back_then_released() -> None:
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Hi <tool") == ("Hi ", [])
    assert streamer.feed("box> there") == ("<toolbox> there", [])
    assert streamer.finish() == ("", [])
    streamer = get_tool_parser("deepseek_v31").streamer()
    assert streamer.feed("ends with <｜tool▁") == ("ends with ", [])
    assert streamer.finish() == ("<｜tool▁", [])


def test_streaming_emits_each_call_when_complete() -> None:
    streamer = get_tool_parser("deepseek_v31").streamer()
    first, second = _ds31(*W), _ds31(*S)
    assert streamer.feed(PRE + "<｜tool▁calls▁begin｜>" + first[:-3]) == (PRE, [])
    content, calls = streamer.feed(first[-3:] + "\n" + second[:10])
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    content, calls = streamer.feed(second[10:])
    assert content == "" and [c.name for c in calls] == ["search"]
    assert streamer.finish() == ("", [])

    streamer = get_tool_parser("llama3_json").streamer()
    _, calls = streamer.feed(_llama(*W) + "; " + _llama(*S)[:5])
    assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("name", "text", "rest"),
    [
        (
            "hermes",
            _hermes(*W) + '\n<tool_call>{"name": "g", "arguments": {</tool_call> more',
            '<tool_call>{"name": "g", "arguments": {</tool_call> more',
        ),
        ("mistral", _mistral_list(W)[:-1] + ' {"name": "g"}]', ' {"name": "g"}]'),
        (
            "llama3_json",
            _llama(*W) + '; {"name": "g", "parameters": 3}',
            '; {"name": "g", "parameters": 3}',
        ),
    ],
)
def test_streaming_keeps_good_calls_before_a_broken_one(name: str, text: str, rest: str):
    """Streaming cannot take back a sent call; the broken rest becomes content."""
    for chunks in ([text], list(text)):
        pieces, calls = _stream(get_tool_parser(name), chunks)
        assert [c.name for c in calls] == ["get_weather"]
        assert "".join(pieces) == rest
    assert get_tool_parser(name).extract(text) == ExtractedToolCalls(text, [])


def test_llama_brace_in_later_text_is_content() -> None:
    text = 'Use {"name": "f", "parameters": {}} like this.'
    assert get_tool_parser("llama3_json").extract(text) == ExtractedToolCalls(text, [])


def test_string_arguments_kept_when_they_hold_an_object() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    (call,) = get_tool_parser("hermes").extract(text).tool_calls
    assert call.arguments == '{"a": 1}'
    bad = '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>'
    assert get_tool_parser("hermes").extract(bad) == ExtractedToolCalls(bad, [])


def test_to_openai_and_ids() -> None:
    call = ToolCall("f", '{"a": 1}')
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    assert call.id.startswith("call_") and call.id != ToolCall("f", "{}").id


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "deepseek_v3", "deepseek_v31", "llama3_json", "mistral"}
    for name, cls in TOOL_PARSERS.items():
        assert isinstance(get_tool_parser(name), cls) and cls.name == name
    with pytest.raises(ValueError, match="hermes") as err:
        get_tool_parser("nope")
    assert "nope" in str(err.value) and "mistral" in str(err.value)
