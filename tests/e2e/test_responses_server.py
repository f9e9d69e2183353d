"""OpenAI's Responses API through the real server and the official ``openai`` client, on a
tiny random-weight model: a response is the chat completion of the same conversation, whole
and streamed; ``previous_response_id`` continues a stored conversation as a prefix-cache hit
(also after a restart, from the SQLite file); an agent loop calls a tool and reads its output;
``text.format`` constrains the output; and what the server cannot honour is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import build_checkpoint
from server_process import MODEL, start_router, start_server, stop

from openinfer.demo import build_demo_tokenizer

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("responses"), "Qwen3ForCausalLM",
                            build_demo_tokenizer(1024))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("store") / "responses.sqlite3"


def _serve(checkpoint, store):
    base, proc = start_server(checkpoint, "--tool-call-parser", "hermes",
                              "--enable-auto-tool-choice", "--responses-store", str(store))
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), proc


@pytest.fixture(scope="module")
def client(checkpoint, store):
    client, proc = _serve(checkpoint, store)
    try:
        yield client
    finally:
        stop(proc)


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    kwargs = dict(temperature=0, max_output_tokens=12)
    response = client.responses.create(model=MODEL, instructions="Be brief.",
                                       input="What is the weather in Paris?", **kwargs)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"  # out of max_output_tokens: says so
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details.reason if cut else response.incomplete_details) == (
        "max_output_tokens" if cut else None)
    assert [item.type for item in response.output] == ["message"]

    with client.responses.stream(model=MODEL, instructions="Be brief.",
                                 input="What is the weather in Paris?", **kwargs) as stream:
        events = list(stream)
    streamed = events[-1].response  # (the SDK's get_final_response wants response.completed)
    assert streamed.output_text == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type == ("response.incomplete" if cut else "response.completed")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    assert streamed.usage.output_tokens == response.usage.output_tokens


def test_previous_response_id_continues_the_conversation_from_the_cache(client):
    first = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0,
                                    max_output_tokens=20)
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="And then?", temperature=0, max_output_tokens=8)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # The first turn's prompt and answer (its generated ids, spliced in) are a hit, up to the
    # last whole block the first request computed.
    seen = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= seen - 15
    items = client.responses.input_items.list(second.id)
    assert [item.type for item in items.data][::-1] == ["message", "message", "message"]


def test_an_agent_loop_calls_a_tool_and_answers_from_its_output(client):
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice=forced, max_output_tokens=120, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answer = client.responses.create(
        model=MODEL, previous_response_id=response.id, tools=[WEATHER], max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C"}])
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens_details.cached_tokens > 0

    # Streamed: the call's arguments arrive as function_call_arguments events.
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice=forced, max_output_tokens=120, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    assert json.loads(done[0].arguments) == json.loads(final.output[0].arguments)
    # An agent that sends its whole history back as input (no previous_response_id).
    again = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Rome?"}, final.output[0].model_dump(),
        {"type": "function_call_output", "call_id": final.output[0].call_id, "output": "Rain"}])
    assert again.usage.input_tokens > final.usage.input_tokens


def test_text_format_json_schema_constrains_the_output(client):
    response = client.responses.create(model=MODEL, input="A person, please.", max_output_tokens=300,
                                       text={"format": {"type": "json_schema", "name": "person",
                                                        "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_stored_responses_are_read_deleted_and_outlive_a_restart(client, checkpoint, store):
    """A second server on the same store file (a restart, or a replica beside the first)
    reads what the first stored; behind a router over both, every call finds it."""
    kept = client.responses.create(model=MODEL, input="Remember this.", max_output_tokens=4,
                                   metadata={"run": "one"})
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unkept = client.responses.create(model=MODEL, input="Not this.", max_output_tokens=4,
                                     store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)

    restarted, proc = _serve(checkpoint, store)
    first = str(client.base_url).removesuffix("/").removesuffix("/v1")
    second = str(restarted.base_url).removesuffix("/").removesuffix("/v1")
    router_base, router = start_router([first, second], checkpoint, "--policy", "round_robin")
    routed = openai.OpenAI(base_url=f"{router_base}/v1", api_key="unused", max_retries=0)
    try:
        again = restarted.responses.retrieve(kept.id)
        assert again.output_text == kept.output_text and again.metadata == {"run": "one"}
        for _ in range(2):  # round robin: one on each replica
            follow = routed.responses.create(model=MODEL, previous_response_id=kept.id,
                                             input="What was it?", max_output_tokens=4)
            assert follow.usage.input_tokens > kept.usage.input_tokens + kept.usage.output_tokens
            assert routed.responses.retrieve(follow.id).output_text == follow.output_text
        routed.responses.delete(kept.id)
        for c in (client, restarted, routed):
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError) as e:
            restarted.responses.create(model=MODEL, previous_response_id=kept.id, input="?")
        assert e.value.body["param"] == "previous_response_id"
    finally:
        stop(router)
        stop(proc)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[1].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0].type"),
    ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_what_it_cannot_honour_is_a_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=4, **body)
    assert e.value.body["param"] == param, e.value.body
    assert client.responses.create(model=MODEL, input="Still here?", max_output_tokens=2).usage


def test_a_stored_response_is_visible_only_to_the_api_key_that_made_it(checkpoint):
    base, proc = start_server(checkpoint, "--api-key", "key-a", "key-b",
                              "--responses-store", ":memory:")
    a, b = (openai.OpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0) for k in ("key-a", "key-b"))
    try:
        made = a.responses.create(model=MODEL, input="Mine.", max_output_tokens=3)
        assert a.responses.retrieve(made.id).id == made.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, previous_response_id=made.id, input="Yours?")
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(made.id)
        assert a.responses.retrieve(made.id).id == made.id
        streamed = list(a.responses.create(model=MODEL, input="Mine too.", max_output_tokens=3,
                                           stream=True))[-1].response
        assert a.responses.retrieve(streamed.id).output_text == streamed.output_text
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(streamed.id)
    finally:
        stop(proc)
