"""A conversation that comes back keeps the token ids of the answers the engine generated.

A chat's next request resends each answer as text: the chat template renders it and the
tokenizer encodes it again, and the ids need not be those the model sampled (a text has many
encodings, and a model samples non-canonical ones). The prefix cache keys blocks by ids, so
the conversation would miss from its first re-encoded answer on.

:class:`AnswerIds` remembers, per cache salt, each finished answer: its text, the ids
generated for it, and the rendered prompt it answered (length and digest). Encoding a later
request, where that prompt's text leads the rendered text and the answer's text follows it
verbatim, the answer's span takes its generated ids; the text around is encoded as usual:

    rendered:  [ prompt of turn 1 ][ answer 1 ][ ...turn 2's prompt ][ answer 2 ][ ... ]
    ids:       encode(..)           generated   encode(..)            generated   encode(..)

Turn 1's prompt encoded alone is what turn 1 ran; turn 2's prompt is encoded the same way when
it runs, so every turn's ids lead the next turn's and its blocks hit (with the kept partial last
block, every token the turn computed). The ids decode to the rendered text: spans are encoded
on their own only where the tokenizer's encodings concatenate (byte-level BPE; checked once).
Answers whose text the template changes (reasoning it drops, tool calls it re-serializes) are
not found and encode as before. Least recently used answers go first past ``max_tokens`` ids.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from openinfer.outputs import RequestOutput

PER_TEXT = 4
"""Answers kept per (salt, text): the same short answer follows many prompts."""


@dataclass(frozen=True)
class _Answer:
    prompt_chars: int
    prompt_digest: bytes
    token_ids: tuple[int, ...]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def spans_concatenate(tokenizer: Any) -> bool:
    """Whether texts encoded apart decode, joined, to the joined text (byte-level BPE; not a
    SentencePiece tokenizer that prefixes each encoding with a space)."""
    pieces = ["Hello", " world", "\n", "x"]
    ids = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
    return tokenizer.decode(ids, skip_special_tokens=False) == "".join(pieces)


class AnswerIds:
    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.enabled = max_tokens > 0 and tokenizer is not None and spans_concatenate(tokenizer)
        self._answers: OrderedDict[tuple[str | None, str], list[_Answer]] = OrderedDict()
        self.num_tokens = 0
        self.num_spliced = 0
        """Answers whose generated ids a request's prompt took."""

    def encode(self, text: str, answers: Sequence[str], salt: str | None) -> list[int]:
        """``text`` (a rendered chat) as ids, each of ``answers`` (the assistant messages'
        contents, in order) that is known at its place taking its generated ids."""
        ids: list[int] = []
        cursor = 0
        for answer in answers if self.enabled else ():
            found = self._find(text, cursor, answer, salt)
            if found is not None:
                ids += self._encode(text[cursor:found.prompt_chars]) + list(found.token_ids)
                cursor = found.prompt_chars + len(answer)
                self.num_spliced += 1
        return ids + self._encode(text[cursor:])

    def _find(self, text: str, cursor: int, answer: str, salt: str | None) -> _Answer | None:
        key = (salt, answer)
        for entry in reversed(self._answers.get(key, ())):
            start = entry.prompt_chars
            if (start >= cursor and text.startswith(answer, start)
                    and _digest(text[:start]) == entry.prompt_digest):
                self._answers.move_to_end(key)
                return entry
        return None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def record(self, prompt_text: str, answer: str, token_ids: Sequence[int],
               salt: str | None) -> None:
        """A finished answer to ``prompt_text``: kept when its ids (less a final stop token)
        decode to exactly its text."""
        ids = tuple(token_ids)
        decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
        if ids and decode(ids) != answer:
            ids = ids[:-1]  # the EOS or stop token the text leaves out
        if not answer or not ids or len(ids) > self.max_tokens or decode(ids) != answer:
            return
        key = (salt, answer)
        entries = self._answers.pop(key, [])
        entries.append(_Answer(len(prompt_text), _digest(prompt_text), ids))
        self.num_tokens += len(ids)
        if len(entries) > PER_TEXT:
            self.num_tokens -= len(entries.pop(0).token_ids)
        self._answers[key] = entries
        while self.num_tokens > self.max_tokens:
            _, dropped = self._answers.popitem(last=False)
            self.num_tokens -= sum(len(e.token_ids) for e in dropped)

    async def remembering(self, stream: AsyncIterator[RequestOutput], prompt_text: str | None,
                          salt: str | None) -> AsyncIterator[RequestOutput]:
        """``stream`` as it is, recording each sample's answer as it finishes (before the
        client can see the end of it and send its next turn)."""
        if not self.enabled or prompt_text is None:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    yield delta
            return
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        async with contextlib.aclosing(stream):  # closing this aborts the request
            async for delta in stream:
                for c in delta.outputs:
                    texts.setdefault(c.index, []).append(c.text)
                    ids.setdefault(c.index, []).extend(c.token_ids)
                    if c.finish_reason in ("stop", "length"):
                        self.record(prompt_text, "".join(texts[c.index]), ids[c.index], salt)
                yield delta


@dataclass
class ChatEncoding:
    """One request's rendered chat through :class:`AnswerIds` (the renderer's ``encode``); keeps
    the text, which the request's answers are recorded against."""
    answer_ids: AnswerIds
    salt: str | None
    text: str | None = None
    answers: Sequence[str] = ()

    def __call__(self, text: str, answers: Sequence[str]) -> list[int]:
        self.text, self.answers = text, answers
        return self.answer_ids.encode(text, answers, self.salt)

    def prefix_length(self, end: int) -> int:
        """How many of the prompt's ids its text's first ``end`` characters are (as this
        request's ids were made: answers before ``end`` as their generated ids)."""
        return len(self.answer_ids.encode(self.text[:end], self.answers, self.salt))
