"""Structured outputs, tool calls and reasoning through the real server and the official
``openai`` client, on a tiny random-weight model (only the grammar can make its output
valid): every response_format / guided / structured_outputs form, ``parse()`` with a Pydantic
model, forced and parsed tool calls (streamed and whole), reasoning_content, 400s for bad
constraints with the engine serving on."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import anthropic
import grammar_check
import jsonschema
import openai
import pytest
from conftest import build_checkpoint
from grammar_check import GrammarCheck
from pydantic import BaseModel, ConfigDict, Field
from server_process import MODEL, start_server, stop

from openinfer.demo import build_demo_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict asks

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    likes_cats: bool


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The demo tokenizer plus the reasoning tags, as single tokens (tool-call tags stay
    text: llguidance takes every added token for a special one, which a regex's literal
    text cannot produce)."""
    tokenizer = build_demo_tokenizer(1024)
    tokenizer.add_tokens(["<think>", "</think>"])
    return build_checkpoint(tmp_path_factory.mktemp("tools"), "Qwen3ForCausalLM", tokenizer)


@pytest.fixture(scope="module")
def client(checkpoint):
    base, proc = start_server(checkpoint, "--tool-call-parser", "hermes",
                              "--enable-auto-tool-choice")
    try:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    finally:
        stop(proc)


def _chat(client, **kwargs):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "seed": 1} | kwargs
    return client.chat.completions.create(**kwargs)


def test_response_format_json_schema_and_object(client, checkpoint):
    schema = Person.model_json_schema()
    out = _chat(client, n=3, max_tokens=400, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": schema, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", repr(choice.message.content)
        Person.model_validate_json(choice.message.content)
    # An open object may outrun max_tokens on a random model: a bias towards the closing
    # tokens ends most (the grammar alone makes them valid), and a cut one is a prefix the
    # test's own matcher accepts.
    check = GrammarCheck(checkpoint)
    closing = {str(i): 5 for i in check.hf_tokenizer.convert_tokens_to_ids(['"', "}", '",'])}
    out = _chat(client, response_format={"type": "json_object"}, max_tokens=300, n=4,
                logit_bias=closing, extra_body={"structured_outputs": None})
    finished = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert finished, [(c.finish_reason, c.message.content) for c in out.choices]
    assert all(isinstance(json.loads(text), dict) for text in finished)
    for choice in out.choices:
        if choice.finish_reason == "length":
            assert check.accepts_text_prefix(grammar_check.json_schema({"type": "object"}),
                                             choice.message.content), choice.message.content


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=400,
                                               seed=3, response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.name) <= 8


def test_streamed_json_validates(client):
    chunks = _chat(client, stream=True, max_tokens=400, response_format={
        "type": "json_schema", "json_schema": {
        "name": "person", "schema": Person.model_json_schema()}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Person.model_validate_json(text)


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": Person.model_json_schema(), "max_tokens": 400}, Person.model_validate_json),
    ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", t) or pytest.fail(t)),
    ({"guided_choice": ["red", "green", "blue"]},
     lambda t: t in ("red", "green", "blue") or pytest.fail(t)),
    ({"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'},
     lambda t: re.fullmatch(r"\([0-9](\+[0-9])?\)", t) or pytest.fail(t)),
    ({"structured_outputs": {"regex": "(ab|cd){2}"}},
     lambda t: re.fullmatch("(ab|cd){2}", t) or pytest.fail(t)),
])
def test_completions_guided_forms(client, extra, check):
    extra = {"max_tokens": 100} | extra
    out = client.completions.create(model=MODEL, prompt="Answer:", seed=2, n=2, temperature=1.0,
                                    max_tokens=extra.pop("max_tokens"), extra_body=extra)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        check(choice.text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: nothing_here"}}, "guided_grammar"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice"),
    ({"extra_body": {"guided_decoding_backend": "outlines", "guided_regex": "a"}},
     "guided_decoding_backend"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **body)
    assert info.value.body["param"] == param, info.value.body
    assert _chat(client, max_tokens=3).choices[0].finish_reason == "length"  # still serving


def test_named_tool_choice_forces_the_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])
    assert out.choices[0].message.content is None
    streamed = list(_chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True))
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert deltas[0].function.arguments == calls[0].function.arguments  # same seed, same call


def test_required_tool_choice(client):
    for parallel, most in ((False, 1), (True, None)):
        out = _chat(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200,
                    parallel_tool_calls=parallel, temperature=1.0)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert calls and (most is None or len(calls) <= most)
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(client):
    """The model's text holds a hermes tool call (a regex makes the random model write one):
    the parser turns it into tool_calls, whole and streamed."""
    kwargs = dict(tools=[WEATHER], tool_choice="auto", temperature=0,
                  extra_body={"guided_regex": r"Sure\. " + HERMES_CALL})
    out = _chat(client, **kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content.strip() == "Sure."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    args = json.loads(message.tool_calls[0].function.arguments)
    assert args["city"] in ("Paris", "Rome")
    chunks = [c for c in _chat(client, stream=True, **kwargs) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert content.strip() == "Sure." and "<tool_call>" not in content
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls] == [
        (0, "get_weather", args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_reach_the_chat_template(client):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    with_tools = _chat(client, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=1,
                       extra_body={"chat_template": template})
    without = _chat(client, tools=[WEATHER, TIME], tool_choice="none", max_tokens=1,
                    extra_body={"chat_template": template})
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens


def test_anthropic_tool_use(client):
    messages = anthropic.Anthropic(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"),
                                   api_key="unused", max_retries=0).messages
    tools = [{"name": t["function"]["name"], "description": "",
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    named = messages.create(model=MODEL, max_tokens=120, messages=ask, tools=tools,
                            tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in named.content if b.type == "tool_use"]
    assert named.stop_reason == "tool_use" and [b.name for b in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER["function"]["parameters"])
    # Streamed: the call arrives as a tool_use block and its input_json_delta.
    with messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=tools,
                         tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, {t["name"]: t["input_schema"] for t in tools}[uses[0].name])
    # A conversation that carries the call and its result reaches the template.
    history = ask + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "Sunny, 24 degrees, light wind from the sea"}]}]
    short = messages.create(model=MODEL, max_tokens=2, messages=ask, tools=tools,
                            tool_choice={"type": "none"})
    long = messages.create(model=MODEL, max_tokens=2, messages=history, tools=tools,
                           tool_choice={"type": "none"})
    assert long.usage.input_tokens > short.usage.input_tokens + 10
    with pytest.raises(anthropic.BadRequestError):
        messages.create(model=MODEL, max_tokens=2, messages=ask, tools=tools,
                        tool_choice={"type": "tool", "name": "nope"})


@pytest.mark.slow
def test_reasoning_parser_and_constraints_after_the_reasoning(checkpoint):
    tokenizer = build_demo_tokenizer(1024)
    tokenizer.add_tokens(["<think>", "</think>"])
    end_think = tokenizer.convert_tokens_to_ids("</think>")
    base, proc = start_server(checkpoint, "--reasoning-parser", "deepseek_r1")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        # Unconstrained: DeepSeek-R1 starts inside the reasoning; no </think>, all reasoning.
        out = _chat(client, max_tokens=10, temperature=0,
                    extra_body={"logit_bias": {str(end_think): -100}})
        # The reasoning never ends (the bias keeps </think> away): all 10 tokens are it.
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 10
        msg = out.choices[0].message
        assert msg.content is None and msg.model_extra["reasoning_content"]
        # The bias writes </think> first; the choice grammar applies after it (the bias
        # cannot push </think> again: the grammar masks it).
        kwargs = dict(max_tokens=20, temperature=0, extra_body={
            "guided_choice": ["yes", "no"], "logit_bias": {str(end_think): 100}})
        msg = _chat(client, **kwargs).choices[0].message
        assert msg.content in ("yes", "no") and msg.model_extra.get("reasoning_content") is None
        chunks = [c for c in _chat(client, stream=True, **kwargs) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
        # tool_choice auto needs a parser and the flag.
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, tools=[WEATHER], tool_choice="auto")
        assert info.value.body["param"] == "tool_choice"
    finally:
        stop(proc)


def _pinned_blocks(client) -> float:
    text = urllib.request.urlopen(str(client.base_url).removesuffix("v1/") + "metrics",
                                  timeout=30).read().decode()
    return float(re.search(r"^openinfer:kv_pinned_blocks\{[^}]*\} (\S+)$", text, re.M).group(1))


def _tool_call(client, how: str, words: str) -> int:
    """A forced tool call, ``how``: chat whole or streamed, Anthropic whole or streamed; the
    tokens it computed (its prompt and its answer but the last id)."""
    ask = [{"role": "user", "content": f"{words}: " + "What is the weather in Paris? " * 4}]
    if how.startswith("chat"):
        kwargs = {"stream": True, "stream_options": {"include_usage": True}} if how == (
            "chat-stream") else {}
        out = _chat(client, messages=ask, tools=[WEATHER], tool_choice="required",
                    max_tokens=200, **kwargs)
        if how == "chat-stream":
            chunks = list(out)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
            usage = chunks[-1].usage
        else:
            assert out.choices[0].finish_reason == "tool_calls"
            usage = out.usage
        return usage.prompt_tokens + usage.completion_tokens - 1
    messages = anthropic.Anthropic(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"),
                                   api_key="unused", max_retries=0).messages
    tool = {"name": "get_weather", "description": "",
            "input_schema": WEATHER["function"]["parameters"]}
    kwargs = dict(model=MODEL, max_tokens=200, messages=ask, tools=[tool],
                  tool_choice={"type": "tool", "name": "get_weather"})
    if how == "anthropic-stream":
        with messages.stream(**kwargs) as stream:
            out = stream.get_final_message()
    else:
        out = messages.create(**kwargs)
    assert out.stop_reason == "tool_use"
    return out.usage.input_tokens + out.usage.output_tokens - 1


@pytest.mark.parametrize("how", ["chat", "chat-stream", "anthropic", "anthropic-stream"])
def test_an_answer_ending_in_tool_calls_keeps_its_conversation_pinned(client, how):
    """The agent runs the tool meanwhile: its prompt and the call stay pinned (tool-call
    retention), every whole block it computed; a plain answer pins nothing."""
    before = _pinned_blocks(client)
    computed = _tool_call(client, how, how.replace("-", " "))
    # (The engine's figures reach /metrics with its next step's output: a plain answer,
    # which pins nothing.)
    deadline = time.monotonic() + 10
    while True:
        _chat(client, messages=[{"role": "user", "content": "Just say hi"}], max_tokens=2)
        pinned = _pinned_blocks(client)
        if pinned != before or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert pinned - before == computed // 16
