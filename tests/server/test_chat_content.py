"""Which content format a chat template takes (``--chat-template-content-format auto``),
read from its Jinja syntax tree as vLLM does."""

from __future__ import annotations

import pytest

from openinfer.demo import CHAT_TEMPLATE
from openinfer.server.chat_content import chat_messages, resolve_content_format
from openinfer.server.exceptions import PromptError
from openinfer.server.prompt import PromptRenderer

SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")
"""SmolLM2-135M-Instruct's template (from its GGUF), shortened: it concatenates content."""


@pytest.mark.parametrize("template,expected", [
    (SMOLLM2, "string"),
    (CHAT_TEMPLATE, "openai"),  # if content is string ... else for part in content
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    # Llama 3.2 vision's shape: a filtered loop over the parts.
    ("{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') "
     "%}{{ c['text'] }}{% endfor %}{% endfor %}", "openai"),
    # Through a {% set %} name.
    ("{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p['text'] }}"
     "{% endfor %}{% endfor %}", "openai"),
    # Loops over other lists of a message are not over its content.
    ("{% for m in messages %}{{ m['content'] }}{% for t in m['tool_calls'] %}{{ t }}{% endfor %}"
     "{% endfor %}", "string"),
    ("{% for m in messages %", "string"),  # unparsable: the template's own error comes later
    (None, "string"),
    ({"default": CHAT_TEMPLATE, "tool_use": SMOLLM2}, "string"),
    ({"default": CHAT_TEMPLATE, "tool_use": CHAT_TEMPLATE}, "openai"),
])
def test_auto_detects_whether_the_template_loops_over_content(template, expected):
    assert resolve_content_format("auto", template) == expected


def test_an_explicit_format_wins_and_a_wrong_one_is_refused():
    assert resolve_content_format("openai", SMOLLM2) == "openai"
    assert resolve_content_format("string", CHAT_TEMPLATE) == "string"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        resolve_content_format("list", SMOLLM2)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        PromptRenderer(None, content_format="list")


def test_string_format_joins_text_parts_and_leaves_other_content_alone():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": []}]
    assert chat_messages(messages, "string") == [messages[0], {"role": "user", "content": "a\nb"},
                                                 messages[2]]
    assert chat_messages(messages, "openai") == messages
    assert messages[1]["content"][0] == {"type": "text", "text": "a"}  # not changed in place


@pytest.mark.parametrize("part,named", [
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio parts"),
    ({"type": "text"}, "text parts"),  # no text
    ("just a string", "a part that is not text"),
])
def test_parts_that_are_not_text_are_refused_by_name(part, named):
    with pytest.raises(PromptError, match=f"^messages.0.content.1: {named} (is|are) not "
                                          "supported") as error:
        chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, part]}],
                      "string")
    assert error.value.param == "messages.0.content.1"
