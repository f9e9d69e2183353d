"""Reasoning parsers: split a chat completion into ``reasoning_content`` and ``content``.

Selected by name like vLLM's ``--reasoning-parser`` (``deepseek_r1``, ``qwen3``). Thinking
models write their reasoning between ``<think>`` and ``</think>`` and the answer after it;
the OpenAI chat API returns the two apart. The tags themselves never reach either field.

Where the output starts is decided by the rendered prompt first, because chat templates
differ in who writes ``<think>``:

* the prompt ends (modulo whitespace) with ``</think>``: reasoning was closed by the
  template (Qwen3 with ``enable_thinking=False`` renders ``<think>\\n\\n</think>\\n\\n``),
  so the whole output is content;
* the prompt ends with ``<think>``: the template opened reasoning (DeepSeek-R1, Qwen3.5,
  Qwen3-*-Thinking-2507), so the output starts inside it and only ``</think>`` appears;
* otherwise it is up to the parser (see each class).

Only the end of the prompt counts, not the last tag anywhere in it: earlier assistant turns
may hold whole ``<think>...</think>`` sections (Qwen3 keeps them during tool calling), and
those say nothing about the turn being generated.

Text is kept verbatim, as vLLM does: the ``\\n\\n`` a model writes after ``</think>``
starts ``content`` and the newlines around the reasoning stay in ``reasoning_content``.
A field is None only when it is empty. One leading ``<think>`` in the output (after
whitespace, which is dropped with it) is removed; any later ``<think>`` is literal text, and
after the first ``</think>`` everything is content, including further tags.

Streaming (:class:`ReasoningStreamer`) gives, joined, exactly what :meth:`ReasoningParser.split`
gives for the whole text, whatever the chunking: it holds back a possible partial tag at
the end of its buffer until the next delta (or :meth:`ReasoningStreamer.finish`) decides.

The engine constrains structured outputs only after the reasoning, so
:meth:`ReasoningParser.end_token_ids` gives the end tag in token ids.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ReasoningSplit:
    """A whole output split in two, as the chat API's message fields."""

    reasoning_content: str | None
    """The text inside the reasoning section; None when there was none (or it was empty)."""
    content: str | None
    """The text after the reasoning section; None when empty."""


class _State(enum.Enum):
    REASONING = "reasoning"
    """Inside the reasoning section: text until the end tag is reasoning."""
    CONTENT = "content"
    """After the reasoning section (or without one): all text is content."""
    UNDECIDED = "undecided"
    """The output has not started yet: a leading start tag opens reasoning, else content."""


def _prompt_tail_tag(prompt_text: str | None, start_tag: str, end_tag: str) -> str | None:
    """The think tag the prompt ends with (trailing whitespace ignored), if any."""
    if prompt_text is None:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(end_tag):
        return end_tag
    if tail.endswith(start_tag):
        return start_tag
    return None


def _partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: the part
    that may become the tag once more text arrives, so it must not be emitted yet."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser(ABC):
    """Splits one model's output into reasoning and content; one instance per server.

    Subclasses set ``name`` and say, in :meth:`_default_state`, where an output starts when
    the prompt does not tell.
    """

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: the model's Hugging Face tokenizer, needed for
        :meth:`end_token_ids` only (None is fine for the text functions)."""
        self.tokenizer = tokenizer
        self._end_token_ids: list[int] | None = None

    @abstractmethod
    def _default_state(self, prompt_known: bool) -> _State:
        """Where the output starts when the prompt neither opens nor closes reasoning
        (``prompt_known``: False when no prompt text was given)."""

    def _initial_state(self, prompt_text: str | None) -> _State:
        tag = _prompt_tail_tag(prompt_text, self.start_tag, self.end_tag)
        if tag == self.end_tag:
            return _State.CONTENT
        if tag == self.start_tag:
            return _State.REASONING
        return self._default_state(prompt_known=prompt_text is not None)

    def prompt_closes_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt already ended a reasoning section, so the whole output is
        content and structured outputs apply from the first token (no ``start_after``)."""
        return _prompt_tail_tag(prompt_text, self.start_tag, self.end_tag) == self.end_tag

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether this parser takes the output to begin inside a reasoning section, before
        any tag: the prompt ends with an open ``<think>``, or (DeepSeek-R1) the parser
        assumes one. False does not rule reasoning out for Qwen3: its output may still open
        with ``<think>``."""
        return self._initial_state(prompt_text) is _State.REASONING

    def split(self, text: str, prompt_text: str | None = None) -> ReasoningSplit:
        """Split a whole (non-streamed) output. ``prompt_text``: the rendered prompt, to
        know whether it already opened or closed the reasoning section."""
        state = self._initial_state(prompt_text)
        if state is _State.CONTENT:
            return ReasoningSplit(None, text or None)
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            text = stripped[len(self.start_tag):]
        elif state is _State.UNDECIDED:
            return ReasoningSplit(None, text or None)
        reasoning, _, content = text.partition(self.end_tag)
        return ReasoningSplit(reasoning or None, content or None)

    def streamer(self, prompt_text: str | None = None) -> ReasoningStreamer:
        """A splitter for one streamed output; feed it the text deltas in order."""
        return ReasoningStreamer(self, self._initial_state(prompt_text))

    def end_token_ids(self) -> list[int]:
        """The end tag in this tokenizer's ids: the engine starts grammar constraints once
        the output holds this sequence, so the reasoning stays free."""
        if self._end_token_ids is None:
            if self.tokenizer is None:
                raise ValueError(f"reasoning parser {self.name!r} needs a tokenizer for the "
                                 f"token ids of {self.end_tag!r}")
            ids = list(self.tokenizer.encode(self.end_tag, add_special_tokens=False))
            if not ids:
                raise ValueError(f"the tokenizer encodes {self.end_tag!r} to no tokens")
            self._end_token_ids = ids
        return list(self._end_token_ids)


class ReasoningStreamer:
    """Splits one streamed output delta by delta, agreeing with :meth:`ReasoningParser.split`.

    A tag may arrive cut across deltas (``"</th"`` then ``"ink>"``), so the end of the
    buffer that could still grow into the awaited tag is held back; at the very start a
    possible leading ``<think>`` (and the whitespace before it) is held back the same way.
    """

    def __init__(self, parser: ReasoningParser, state: _State) -> None:
        self._start_tag = parser.start_tag
        self._end_tag = parser.end_tag
        self._state = state
        # A leading start tag is still possible (nothing but whitespace seen so far).
        self._at_start = state is not _State.CONTENT
        self._buffer = ""

    def feed(self, delta_text: str) -> tuple[str, str]:
        """Take the next delta; return the (reasoning, content) text decided so far."""
        self._buffer += delta_text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever was held back is text after all."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buffer:
            if self._state is _State.CONTENT:
                content.append(self._buffer)
                self._buffer = ""
            elif self._at_start:
                head = self._buffer.lstrip()
                if head.startswith(self._start_tag):
                    self._buffer = head[len(self._start_tag):]
                    self._at_start = False
                    self._state = _State.REASONING
                elif self._start_tag.startswith(head) and not final:
                    break  # Whitespace or a partial start tag: wait for more.
                else:
                    self._at_start = False
                    if self._state is _State.UNDECIDED:
                        self._state = _State.CONTENT
            else:  # REASONING after the start.
                end = self._buffer.find(self._end_tag)
                if end >= 0:
                    reasoning.append(self._buffer[:end])
                    self._buffer = self._buffer[end + len(self._end_tag):]
                    self._state = _State.CONTENT
                    continue
                hold = 0 if final else _partial_suffix_len(self._buffer, self._end_tag)
                reasoning.append(self._buffer[:len(self._buffer) - hold])
                self._buffer = self._buffer[len(self._buffer) - hold:]
                break
        return "".join(reasoning), "".join(content)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the chat template ends the prompt with ``<think>\\n``,
    and older templates let the model skip ``<think>``, so the output is taken to start
    inside reasoning whatever the prompt (unless it closed the section). Without
    ``</think>`` the whole output is reasoning: the model was cut off while thinking."""

    name = "deepseek_r1"

    def _default_state(self, prompt_known: bool) -> _State:
        return _State.REASONING


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 family. Two template styles exist: Qwen3 (hybrid) lets the model write
    ``<think>`` itself, while Qwen3.5 and Qwen3-*-Thinking-2507 put ``<think>\\n`` in the
    prompt so only ``</think>`` is generated; ``enable_thinking=False`` renders a closed
    empty section into the prompt.

    Semantics chosen (vLLM's current parser, made prompt-aware):

    * prompt closes reasoning: all content (vLLM: ``enable_thinking=False``);
    * prompt opens it: reasoning until ``</think>``, all reasoning without one (truncated);
    * prompt given but neither: reasoning only if the output opens with ``<think>``,
      otherwise all content. vLLM would call such output reasoning, which misfiles the
      answer of a Qwen3 model that does not think (the Instruct-2507 models); with the
      prompt at hand the start tag tells, and streaming needs to wait only for it;
    * prompt unknown (None): as vLLM, the output starts inside reasoning, a leading
      ``<think>`` is dropped, and without ``</think>`` everything is reasoning.

    vLLM's implicit end of reasoning at a ``<tool_call>`` (Qwen3.5 calling a tool without
    closing ``</think>``) is not done here: it would need a tool parser to follow.
    """

    name = "qwen3"

    def _default_state(self, prompt_known: bool) -> _State:
        return _State.UNDECIDED if prompt_known else _State.REASONING


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser registered as ``name`` (``--reasoning-parser``), bound to ``tokenizer``."""
    try:
        cls = REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
    return cls(tokenizer)
