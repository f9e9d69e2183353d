"""Chat message content as the chat template expects it: a string, or OpenAI's parts.

OpenAI's ``content`` is a string or a list of parts (``[{"type": "text", "text": ...}]``,
which LangChain, the Agents SDK and many UIs send). Templates differ: SmolLM2's
concatenates ``message['content']`` to strings and fails on a list; others loop over the
parts. As vLLM's ``--chat-template-content-format``:

* ``string``: each list of text parts is joined (``"\\n"``, as vLLM joins them) to one string;
* ``openai``: the parts are passed as they are;
* ``auto`` (the default): ``openai`` when the template loops over a message's content
  (read from its Jinja syntax tree), ``string`` otherwise.

The models served here read text only: a part of any other kind (``image_url``,
``input_audio``, ``file``, ...) is refused with a 400 naming it, never dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.nodes

from openinfer.server.exceptions import PromptError

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")
"""The choices of ``--chat-template-content-format``."""


def resolve_content_format(option: str, template: str | dict[str, str] | None) -> ContentFormat:
    """``option`` (auto, string or openai) for ``template``, the one the prompt renders with."""
    if option not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                         f"got {option!r}")
    if option != "auto":
        return option  # type: ignore[return-value]
    if template is None:
        return "string"
    # A tokenizer may hold several named templates: parts only if each of them loops over them.
    templates = template.values() if isinstance(template, dict) else [template]
    return "openai" if all(_loops_over_content(t) for t in templates) else "string"


def chat_messages(messages: Sequence[Mapping[str, Any]],
                  content_format: ContentFormat) -> list[dict[str, Any]]:
    """``messages`` with each list content checked (text parts only) and, for the
    ``string`` format, joined to a string."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = text_parts(content, f"messages.{i}.content")
            if content_format == "string":
                message["content"] = "\n".join(texts)
        out.append(message)
    return out


def text_parts(parts: Sequence[Any], param: str, noun: str = "parts") -> list[str]:
    """The texts of content parts (OpenAI's; Anthropic's ``blocks``); one that is not text
    is refused by name (``param.j``)."""
    return [text_part(part, f"{param}.{j}", noun) for j, part in enumerate(parts)]


def text_part(part: Any, param: str, noun: str = "parts") -> str:
    """The text of one content part; one of another kind is refused, naming ``param``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text" or not isinstance(part.get("text"), str):
        what = (f"{kind} {noun} are" if isinstance(kind, str)
                else f"a {noun[:-1]} that is not text is")
        raise PromptError(f"{param}: {what} not supported: this model reads text only "
                          f"(content {noun} of type text)", param)
    return part["text"]


@lru_cache(maxsize=32)
def _loops_over_content(template: str) -> bool:
    """Whether the template iterates over a message's ``content`` (``{% for part in
    message['content'] %}``, directly or through a ``{% set %}`` name): it takes parts."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False  # (rendering will report the error) a string is what most templates take
    names = {target.name for node in tree.find_all(jinja2.nodes.Assign)
             if isinstance(target := node.target, jinja2.nodes.Name)
             and _reads_content(node.node, set())}
    return any(_reads_content(loop.iter, names) for loop in tree.find_all(jinja2.nodes.For))


def _reads_content(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """``x['content']``, ``x.content`` or a name bound to one, through filters and tests
    (``message['content'] | selectattr(...)``)."""
    return any(_is_content(inner, names) for inner in _unwrapped(node))


def _is_content(node: jinja2.nodes.Node, names: set[str]) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _unwrapped(node: jinja2.nodes.Node) -> Iterator[jinja2.nodes.Node]:
    yield node
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
        yield node
