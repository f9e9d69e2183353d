"""Request bodies to prompt token ids: the one renderer the API server and the router share.

The server feeds the engine what :class:`PromptRenderer` returns, and the router hashes
the same ids to find the replica holding the prompt's KV blocks. Both used to render on
their own, and the router's copy ignored ``chat_template_kwargs``, per-request and
``--chat-template`` templates, Anthropic content blocks and ``add_special_tokens``, so its
block hashes missed the engine's and cache-aware routing went blind for those requests.
One implementation makes them agree by construction.

It depends on a tokenizer and the request models' fields only (no FastAPI objects), so
the router can import it. Whatever is wrong with a prompt raises :class:`PromptError`,
which the server answers with a 400 naming ``param``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openinfer.server.anthropic_protocol import MessagesRequest
from openinfer.server.chat_content import (
    chat_messages,
    resolve_content_format,
    text_part,
    text_parts,
)
from openinfer.server.exceptions import PromptError
from openinfer.server.openai_protocol import ChatCompletionRequest, TokenizeRequest

ChatEncoder = Callable[[str, list[str]], list[int]]
"""A rendered chat and its assistant messages' texts to ids (server/answer_ids.py)."""

CompletionPrompt = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]
"""``/v1/completions``' ``prompt``: a text, texts, token ids, or lists of token ids."""


@dataclass(frozen=True)
class RenderedPrompt:
    """One prompt as the engine gets it, with the text it came from (for ``echo``)."""

    text: str | None
    """The prompt text as the client gave it; None for token ids."""
    token_ids: list[int]


@dataclass
class PromptRenderer:
    """Renders chat messages and completion prompts to the token ids the engine runs.

    ``chat_template`` is the server's ``--chat-template``; without it the tokenizer's own
    template is used (a GGUF's is already set on the tokenizer by ``load_tokenizer``). A
    request's ``chat_template`` wins over both. ``content_format`` is
    ``--chat-template-content-format`` (server/chat_content.py): whether the template gets
    a message's list of text parts as it is or joined to a string.
    """

    tokenizer: Any | None
    """A Hugging Face tokenizer; None when the engine runs with ``skip_tokenizer_init``."""
    chat_template: str | None = None
    content_format: str = "auto"

    def __post_init__(self) -> None:
        resolve_content_format(self.content_format, None)  # a bad option fails at start-up

    def chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             add_special_tokens: bool = False,
             tools: list[dict[str, Any]] | None = None,
             encode: ChatEncoder | None = None) -> list[int]:
        """Chat messages through the chat template, then the tokenizer (or ``encode``: the
        server's, which keeps generated answers' ids).

        ``add_special_tokens`` is off by default because the rendered template already
        holds the model's special tokens; a BOS added on top would double it.
        """
        messages = self._chat_messages(messages, chat_template)
        text = self.chat_text(messages, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              chat_template=chat_template,
                              chat_template_kwargs=chat_template_kwargs, tools=tools)
        if encode is not None and not add_special_tokens:
            return encode(text, [m["content"] for m in messages if m.get("role") == "assistant"
                                 and isinstance(m.get("content"), str) and m["content"]])
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _chat_messages(self, messages: Sequence[Mapping[str, Any]],
                       chat_template: str | None) -> list[dict[str, Any]]:
        """The messages as the template takes them (content parts joined or not)."""
        if self.tokenizer is None:
            raise PromptError("chat needs a tokenizer", "messages")
        template = chat_template or self.chat_template
        if template is None and self.tokenizer.chat_template is None:
            raise PromptError("this model has no chat template; start the server with "
                              "--chat-template or use /v1/completions", "messages")
        content_format = resolve_content_format(
            self.content_format, template or self.tokenizer.chat_template)
        return chat_messages(messages, content_format)

    def chat_text(self, messages: Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                  chat_template: str | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
        """The rendered chat template (``messages`` as ``_chat_messages`` gives them)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template or self.chat_template, tools=tools,
                **(chat_template_kwargs or {}))
        except Exception as e:  # a template that rejects these messages
            raise PromptError(f"chat template failed: {e}", "messages") from e

    def openai_chat(self, request: ChatCompletionRequest | TokenizeRequest,
                    tools: list[dict[str, Any]] | None = None,
                    encode: ChatEncoder | None = None) -> list[int]:
        """``/v1/chat/completions`` (and ``/tokenize`` with messages); ``tools`` as the
        template receives them (none under tool_choice "none")."""
        return self.chat(
            [m.model_dump(exclude_none=True) for m in request.messages or ()],
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            # /tokenize leaves it unset (None): no, as for chat completions.
            add_special_tokens=bool(request.add_special_tokens), tools=tools, encode=encode)

    def anthropic_messages(self, request: MessagesRequest,
                           tools: list[dict[str, Any]] | None = None,
                           encode: ChatEncoder | None = None) -> list[int]:
        """``/v1/messages`` (``anthropic_chat``); ``tools``: OpenAI-shaped, for the template."""
        return self.chat(self.anthropic_chat(request), add_generation_prompt=True, tools=tools,
                         encode=encode)

    def anthropic_text(self, request: MessagesRequest,
                       tools: list[dict[str, Any]] | None = None) -> str:
        """``/v1/messages``' rendered template (where prompt caching finds its breakpoints)."""
        return self.chat_text(self._chat_messages(self.anthropic_chat(request), None),
                              tools=tools)

    @staticmethod
    def anthropic_chat(request: MessagesRequest) -> list[dict[str, Any]]:
        """The system prompt becomes a leading system message; text blocks become content,
        ``tool_use`` blocks an assistant's ``tool_calls`` and ``tool_result`` blocks ``tool``
        messages, as chat templates take them (OpenAI's shape)."""
        chat: list[dict[str, Any]] = []
        if request.system is not None:
            if not isinstance(request.system, str):
                text_parts(request.system, "system", "blocks")
            chat.append({"role": "system", "content": content_text(request.system)})
        for i, m in enumerate(request.messages):
            _check_anthropic_blocks(m.content, f"messages.{i}.content")
            chat.extend(_anthropic_to_chat(m.role, m.content))
        return chat

    def completion(self, prompt: CompletionPrompt,
                   add_special_tokens: bool = True) -> list[RenderedPrompt]:
        """``/v1/completions``: each prompt of the request (one engine request each).

        ``add_special_tokens`` is whether the tokenizer adds its special tokens (BOS) to a
        text prompt; token ids are taken as given (the engine checks their range).
        """
        rendered = []
        for one in _prompt_list(prompt):
            if isinstance(one, str):
                if not one:
                    raise PromptError("prompt must not be empty", "prompt")
                if self.tokenizer is None:
                    raise PromptError("prompt: text needs a tokenizer (skip_tokenizer_init is "
                                      "set); pass token ids", "prompt")
                ids = list(self.tokenizer.encode(one, add_special_tokens=add_special_tokens))
                rendered.append(RenderedPrompt(one, ids))
            else:
                if not one:
                    raise PromptError("prompt must not be empty", "prompt")
                rendered.append(RenderedPrompt(None, list(one)))
        return rendered


def _anthropic_to_chat(role: str, content: str | Sequence[Mapping[str, Any]]) -> list[dict]:
    """One Anthropic message as chat-template messages (tool results are messages of their
    own, after the rest of the turn's text)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    message: dict[str, Any] = {"role": role, "content": content_text(content)}
    calls = [{"id": b.get("id"), "type": "function", "function": {
        "name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}}
        for b in content if b.get("type") == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    results = [{"role": "tool", "tool_call_id": b.get("tool_use_id"),
                "content": content_text(b.get("content") or "")}
               for b in content if b.get("type") == "tool_result"]
    return ([message] if message["content"] or calls or not results else []) + results


_TOOL_BLOCKS = ("tool_use", "tool_result")
"""With text, the content blocks a prompt is made of here; an image, a document, ... is
refused."""


def _check_anthropic_blocks(content: str | Sequence[Any], param: str) -> None:
    """A 400 naming the first block the model cannot read (``tool_result`` content too)."""
    if isinstance(content, str):
        return
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and isinstance(block.get("content"), list):
            text_parts(block["content"], f"{param}.{j}.content", "blocks")
        elif kind not in _TOOL_BLOCKS:
            text_part(block, f"{param}.{j}", "blocks")


def is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` is one of the tokenizer's special tokens (dropped from output text
    unless skip_special_tokens is off)."""
    return text in getattr(tokenizer, "all_special_tokens", ()) or any(
        token.content == text and token.special
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values())


def content_text(content: str | Sequence[Mapping[str, Any]]) -> str:
    """Anthropic content (a string or content blocks) as the text the model reads."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _prompt_list(prompt: CompletionPrompt) -> list[str | Sequence[int]]:
    """One prompt, or the several a request batches: a flat list of ids is one prompt."""
    if isinstance(prompt, str) or (prompt and all(_is_int(t) for t in prompt)):
        return [prompt]
    if not prompt:
        raise PromptError("prompt must not be empty", "prompt")
    return list(prompt)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
