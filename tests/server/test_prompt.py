"""The prompt renderer the server and the router share: what each request kind renders to,
the errors the server answers with 400, and the router reading raw JSON the same way."""

from __future__ import annotations

import copy

import pytest

from openinfer.demo import CHAT_TEMPLATE
from openinfer.kv.block_hash import extend_block_hashes
from openinfer.router.app import prompt_ids
from openinfer.server.anthropic_protocol import MessagesRequest
from openinfer.server.exceptions import PromptError
from openinfer.server.openai_protocol import ChatCompletionRequest, TokenizeRequest
from openinfer.server.prompt import PromptRenderer, RenderedPrompt

# The demo template, led by a system line only when the `persona` template argument is given.
PERSONA_TEMPLATE = ("{%- if persona is defined %}{{- '<|im_start|>system\\nYou are ' + persona "
                    "+ '.<|im_end|>\\n' }}{%- endif %}" + CHAT_TEMPLATE)
MESSAGES = [{"role": "user", "content": "What is a paged KV cache?"}]


@pytest.fixture
def tok(tokenizer):
    """The session's demo tokenizer, copied: tests here change its chat template."""
    return copy.deepcopy(tokenizer)


def _render(tok, messages, template=None, **kwargs) -> list[int]:
    """What the server rendered before the renderer existed: template, then encode."""
    text = tok.apply_chat_template(messages, tokenize=False, chat_template=template,
                                   **{"add_generation_prompt": True, **kwargs})
    return tok.encode(text, add_special_tokens=False)


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_openai_chat_renders_as_the_template_does(tok):
    renderer = PromptRenderer(tok)
    assert renderer.openai_chat(_chat()) == _render(tok, MESSAGES)
    closed = renderer.openai_chat(_chat(add_generation_prompt=False))
    assert closed == _render(tok, MESSAGES, add_generation_prompt=False) != renderer.openai_chat(
        _chat())
    # A None field is dropped, as the request model dumps it (the template never sees it).
    assert renderer.openai_chat(_chat(messages=[{**MESSAGES[0], "name": None}])) == _render(
        tok, MESSAGES)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert renderer.openai_chat(_chat(add_special_tokens=True)) == tok.encode(text)


def test_continue_final_message_leaves_the_last_message_open(tok):
    messages = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    ids = PromptRenderer(tok).openai_chat(_chat(messages=messages, add_generation_prompt=False,
                                                continue_final_message=True))
    assert tok.decode(ids).endswith("It is")


def test_template_kwargs_and_template_precedence(tok):
    """Request template > server default (--chat-template) > the tokenizer's own."""
    server = PromptRenderer(tok, chat_template=PERSONA_TEMPLATE)
    plain = server.openai_chat(_chat())
    assert plain == _render(tok, MESSAGES)  # the kwarg unset: the same text as the demo's
    pirate = server.openai_chat(_chat(chat_template_kwargs={"persona": "a pirate"}))
    assert pirate == _render(tok, MESSAGES, PERSONA_TEMPLATE, persona="a pirate")
    assert tok.decode(pirate).startswith("<|im_start|>system\nYou are a pirate.")
    # The tokenizer's template ignores the kwarg; the request's own template wins over both.
    assert PromptRenderer(tok).openai_chat(_chat(chat_template_kwargs={"persona": "x"})) == plain
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert server.openai_chat(_chat(chat_template=own)) == tok.encode(
        f"[{MESSAGES[0]['content']}]", add_special_tokens=False)


def test_tokenize_request_renders_like_chat(tok):
    renderer = PromptRenderer(tok, chat_template=PERSONA_TEMPLATE)
    kwargs = {"chat_template_kwargs": {"persona": "terse"}}
    tokenize = TokenizeRequest.model_validate({"messages": MESSAGES, **kwargs})
    assert renderer.openai_chat(tokenize) == renderer.openai_chat(_chat(**kwargs))


def test_anthropic_system_prompt_and_content_blocks(tok):
    renderer = PromptRenderer(tok)
    system = "You answer in one sentence."
    expected = _render(tok, [{"role": "system", "content": system}, *MESSAGES])
    as_string = MessagesRequest.model_validate({"max_tokens": 8, "system": system,
                                                "messages": MESSAGES})
    assert renderer.anthropic_messages(as_string) == expected
    # Text blocks are reduced to their text.
    blocks = {"max_tokens": 8, "system": [{"type": "text", "text": "You answer in one "},
                                          {"type": "text", "text": "sentence."}],
              "messages": [{"role": "user", "content": [
                  {"type": "text", "text": MESSAGES[0]["content"]}]}]}
    assert renderer.anthropic_messages(MessagesRequest.model_validate(blocks)) == expected


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": ""}}


@pytest.mark.parametrize("where,param", [
    ("message", "messages.0.content.0"), ("tool_result", "messages.0.content.0.content.1"),
    ("system", "system.0")])
def test_anthropic_blocks_the_model_cannot_read_are_refused_by_name(tok, where, param):
    """A text-only model is never sent a prompt with an image silently left out."""
    text = {"type": "text", "text": MESSAGES[0]["content"]}
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": [IMAGE_BLOCK, text]}]}
    if where == "tool_result":
        body["messages"][0]["content"] = [{"type": "tool_result", "tool_use_id": "t",
                                           "content": [text, IMAGE_BLOCK]}]
    elif where == "system":
        body = {**body, "system": [IMAGE_BLOCK], "messages": MESSAGES}
    with pytest.raises(PromptError, match="image blocks are not supported") as error:
        PromptRenderer(tok).anthropic_messages(MessagesRequest.model_validate(body))
    assert error.value.param == param and error.value.message.startswith(param)


STRING_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                   "+ '<|im_end|>\\n' }}{% endfor %}{{ '<|im_start|>assistant\\n' }}")
"""Concatenates content to strings, as SmolLM2's template does: a list of parts fails it."""
PARTS = [{"type": "text", "text": "What is a paged"}, {"type": "text", "text": "KV cache?"}]


def test_text_parts_reach_a_string_template_joined(tok):
    renderer = PromptRenderer(tok, chat_template=STRING_TEMPLATE)
    joined = renderer.openai_chat(_chat(messages=[{"role": "user",
                                                   "content": "What is a paged\nKV cache?"}]))
    assert renderer.openai_chat(_chat(messages=[{"role": "user", "content": PARTS}])) == joined
    # Forced to pass the parts, this template fails as it did before (a 400, not a crash).
    forced = PromptRenderer(tok, chat_template=STRING_TEMPLATE, content_format="openai")
    with pytest.raises(PromptError, match="chat template failed"):
        forced.openai_chat(_chat(messages=[{"role": "user", "content": PARTS}]))


def test_text_parts_reach_a_parts_template_as_parts(tok):
    """The demo template loops over parts (auto: openai); it renders them without a join."""
    renderer = PromptRenderer(tok)
    parts = renderer.openai_chat(_chat(messages=[{"role": "user", "content": PARTS}]))
    assert tok.decode(parts).count("What is a pagedKV cache?") == 1
    string = PromptRenderer(tok, content_format="string").openai_chat(
        _chat(messages=[{"role": "user", "content": PARTS}]))
    assert tok.decode(string).count("What is a paged\nKV cache?") == 1


@pytest.mark.parametrize("content_format", ["auto", "string", "openai"])
def test_a_part_that_is_not_text_is_refused_by_name(tok, content_format):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    renderer = PromptRenderer(tok, content_format=content_format)
    messages = [MESSAGES[0], {"role": "user", "content": [PARTS[0], image]}]
    with pytest.raises(PromptError, match="^messages.1.content.1: image_url parts are not "
                                          "supported") as error:
        renderer.openai_chat(_chat(messages=messages))
    assert error.value.param == "messages.1.content.1"


def test_completion_prompts(tok):
    renderer = PromptRenderer(tok)
    text = "The capital of France is"
    assert renderer.completion(text) == [RenderedPrompt(text, tok.encode(text))]
    assert renderer.completion(text, add_special_tokens=False) == [
        RenderedPrompt(text, tok.encode(text, add_special_tokens=False))]
    assert renderer.completion([text, "Hi"]) == [RenderedPrompt(text, tok.encode(text)),
                                                 RenderedPrompt("Hi", tok.encode("Hi"))]
    assert renderer.completion([5, 6, 7]) == [RenderedPrompt(None, [5, 6, 7])]
    assert renderer.completion([[5, 6], [7]]) == [RenderedPrompt(None, [5, 6]),
                                                  RenderedPrompt(None, [7])]


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_an_empty_completion_prompt_is_a_prompt_error(tok, prompt):
    with pytest.raises(PromptError, match="prompt must not be empty") as error:
        PromptRenderer(tok).completion(prompt)
    assert error.value.param == "prompt"


def test_errors_name_their_param(tok):
    """The messages the server answered with before; PromptError is also a ValueError."""
    with pytest.raises(PromptError, match="^chat needs a tokenizer$") as error:
        PromptRenderer(None).openai_chat(_chat())
    assert error.value.param == "messages" and isinstance(error.value, ValueError)
    with pytest.raises(PromptError, match="text needs a tokenizer") as error:
        PromptRenderer(None).completion("hi")
    assert error.value.param == "prompt"
    assert PromptRenderer(None).completion([1, 2]) == [RenderedPrompt(None, [1, 2])]
    tok.chat_template = None
    with pytest.raises(PromptError, match="no chat template; start the server with "
                                          "--chat-template") as error:
        PromptRenderer(tok).openai_chat(_chat())
    assert error.value.param == "messages"
    raising = "{{ raise_exception('no system messages here') }}"
    with pytest.raises(PromptError, match="^chat template failed: .*no system messages here"):
        PromptRenderer(tok, chat_template=raising).openai_chat(_chat())


def test_the_router_reads_raw_bodies_as_the_server_does(tok):
    """The router hashes raw JSON; it must get the ids the server renders from the models."""
    renderer = PromptRenderer(tok, chat_template=PERSONA_TEMPLATE)
    chat = {"messages": MESSAGES, "chat_template_kwargs": {"persona": "a pirate"},
            "max_tokens": 4}
    assert prompt_ids(renderer, "/v1/chat/completions", chat) == renderer.openai_chat(
        ChatCompletionRequest.model_validate(chat))
    messages = {"max_tokens": 4, "system": "Be brief.", "messages": MESSAGES}
    assert prompt_ids(renderer, "/v1/messages", messages) == renderer.anthropic_messages(
        MessagesRequest.model_validate(messages))
    # The first prompt of a batch; the engine's left truncation applies.
    assert prompt_ids(renderer, "/v1/completions", {"prompt": [[1, 2, 3], [4]]}) == [1, 2, 3]
    assert prompt_ids(renderer, "/v1/completions", {"prompt": list(range(40)),
                                                    "truncate_prompt_tokens": 20}) == list(
        range(20, 40))
    # What the server refuses, the router does not hash (the replica explains the 400).
    with pytest.raises(ValueError):
        prompt_ids(renderer, "/v1/chat/completions", {"messages": [], "no_such_field": 1})
    hashes: list[bytes] = []
    ids = prompt_ids(renderer, "/v1/chat/completions", chat)
    extend_block_hashes(hashes, ids, 16)
    assert len(hashes) == len(ids) // 16 >= 1
