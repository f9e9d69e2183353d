"""Incremental detokenization with stop strings.

One `IncrementalDetokenizer` per generated sequence. Tokens arrive a few at a time; the text
grows only by whole characters (a UTF-8 character split across byte-level tokens appears once
its last byte arrives) and is checked for stop strings in the new region only.

Fast tokenizers go through `tokenizers.decoders.DecodeStream`, which keeps a small window of
ids and decodes only that window per step. Other tokenizers (or a stream that raises) fall back
to decoding the whole id list each step and diffing against the previous decode.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from openinfer.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens to decode ahead of the output as context, and the most to try when
# those start or end inside a character. A few tokens are enough for a SentencePiece-style
# decoder to see that the first output token is not at the start of the text.
_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 16


def backend_of(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, or None if it is slow."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class _StreamDecoder:
    """Wraps DecodeStream: step() returns the text the new id completes, or ''."""

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool, prefix_ids: list[int]):
        self._backend = backend
        self._stream = _new_stream(backend, skip_special_tokens, prefix_ids)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def _new_stream(backend: Tokenizer, skip: bool, prefix_ids: list[int]) -> DecodeStream:
    if not prefix_ids:
        return DecodeStream(skip_special_tokens=skip)
    try:
        return DecodeStream(ids=prefix_ids, skip_special_tokens=skip)
    except TypeError:
        # tokenizers < 0.22 takes no prefix: feed it and drop the text it yields.
        stream = DecodeStream(skip_special_tokens=skip)
        for token_id in prefix_ids:
            stream.step(backend, token_id)
        return stream


class _FullDecoder:
    """Re-decodes all ids each step (O(length) per token) and returns the new suffix.

    Used for slow tokenizers and after DecodeStream fails. Text ending in U+FFFD is held back
    until the character completes, as DecodeStream does.
    """

    def __init__(self, decode: Any, prefix_ids: list[int]):
        self._decode = decode
        self._ids = list(prefix_ids)
        # A trailing U+FFFD is a character still incomplete: count it as not yet decoded.
        self._text = decode(self._ids).rstrip(REPLACEMENT_CHAR) if self._ids else ""

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        # If a decoder rewrote earlier text (e.g. space clean-up), emitted text cannot be taken
        # back; only the part past the old length is new.
        new = text[len(self._text):]
        self._text = text
        return new


class IncrementalDetokenizer:
    """Text of one output sequence, built token by token, with stop-string handling.

    `prompt_token_ids`, if given, are decoded ahead of the output as context only (never part
    of `output_text`): SentencePiece-style tokenizers then keep the leading space of the first
    output word, as the text would read after the prompt. Without it the output reads as
    `tokenizer.decode(output_ids)`.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams,
                 prompt_token_ids: list[int] | None = None):
        self._tokenizer = tokenizer
        self._backend = backend_of(tokenizer)
        self._params = params
        self._enabled = tokenizer is not None and params.detokenize
        self._stops = list(params.stop_strings) if self._enabled else []
        # Chars a stop string could still be completing; never streamed before they settle.
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._emitted = 0
        self._token_ids: list[int] = []
        # A stop string must end after this text index (text produced before min_tokens
        # tokens were generated cannot stop the request, as EOS cannot).
        self._stop_floor = 0
        self._stopped: str | None = None
        self._stop_end = 0
        self.num_tokens_at_stop: int | None = None
        """After a stop string: how many output tokens it took to complete it."""
        self._token_cache: dict[int, str] = {}
        self._prefix_ids: list[int] = []
        self._decoder: _StreamDecoder | _FullDecoder | None = None
        if self._enabled:
            self._prefix_ids = self._prime_ids(prompt_token_ids or [])
            self._decoder = self._make_decoder()

    # ------------------------------------------------------------------ public API

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string matched, else None.

        On a match the text is truncated before the stop string (after it when
        params.include_stop_str_in_output) and later updates are ignored. Stop strings only
        count once more than params.min_tokens tokens were generated.
        """
        if not self._enabled or self._stopped is not None:
            return None
        start = end = len(self._text)
        pieces = []
        ends = []
        for token_id in new_token_ids:
            piece = self._step(token_id)
            pieces.append(piece)
            end += len(piece)
            ends.append(end)
            if len(self._token_ids) <= self._params.min_tokens:
                self._stop_floor = end
        self._text += "".join(pieces)
        if len(self._token_ids) <= self._params.min_tokens:
            return None
        stop = self._check_stop(max(start, self._stop_floor))
        if stop is not None:
            # Several tokens at once (verified drafts): the stop string ends inside the
            # first token whose text reaches its end; the tokens after it are not output.
            first = len(self._token_ids) - len(new_token_ids)
            used = next((i + 1 for i, e in enumerate(ends) if e >= self._stop_end), len(ends))
            self.num_tokens_at_stop = first + used
        return stop

    @property
    def output_text(self) -> str:
        """All text so far (never ending inside a UTF-8 character)."""
        return self._text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._stopped

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned before.

        While not finished (and no stop string matched) the last (longest stop string - 1)
        chars are held back, so a stop string split across tokens never leaks into a delta.
        """
        end = len(self._text)
        if not finished and self._stopped is None:
            end = max(end - self._holdback, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def decode_token(self, token_id: int) -> str:
        """One token as text, for logprobs' decoded_token.

        A token that is only part of a UTF-8 character (a byte-level BPE byte) decodes to
        U+FFFD; its raw vocabulary string is returned instead so that distinct byte tokens
        stay distinct (OpenAI's top_logprobs is keyed by this string).
        """
        cached = self._token_cache.get(token_id)
        if cached is not None:
            return cached
        text = self._decode_one(token_id)
        self._token_cache[token_id] = text
        return text

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_one(self, token_id: int) -> str:
        if self._tokenizer is None:
            return ""
        text = self._decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return text
        if self._backend is not None:
            raw = self._backend.id_to_token(token_id)
        else:
            raw = self._tokenizer.convert_ids_to_tokens(token_id)
        return raw if raw is not None else text

    def _prime_ids(self, prompt_ids: list[int]) -> list[int]:
        """A short prompt suffix to decode as context, cut at character boundaries.

        A suffix starting mid-character would decode to a leading U+FFFD (harmless but noisy);
        one ending mid-character would make the first output token rewrite the prefix text,
        which DecodeStream rejects. Returns [] when no clean suffix is found.
        """
        if not prompt_ids:
            return []
        skip = self._params.skip_special_tokens
        for size in range(_PRIME_TOKENS, _MAX_PRIME_TOKENS + 1):
            suffix = prompt_ids[-size:]
            text = self._decode(suffix, skip)
            if not text.startswith(REPLACEMENT_CHAR) and not text.endswith(REPLACEMENT_CHAR):
                return suffix
            if size >= len(prompt_ids):
                break
        return []

    def _make_decoder(self) -> _StreamDecoder | _FullDecoder:
        skip = self._params.skip_special_tokens
        if self._backend is not None:
            return _StreamDecoder(self._backend, skip, self._prefix_ids)
        return _FullDecoder(lambda ids: self._decode(ids, skip), self._prefix_ids)

    def _step(self, token_id: int) -> str:
        try:
            text = self._decoder.step(token_id)
        except Exception:
            if isinstance(self._decoder, _FullDecoder):
                raise
            # DecodeStream refuses some sequences (e.g. a decoder that rewrites earlier text:
            # "invalid prefix"). Continue by full re-decoding, from all ids seen so far.
            skip = self._params.skip_special_tokens
            seen = self._prefix_ids + self._token_ids
            self._decoder = _FullDecoder(lambda ids: self._decode(ids, skip), seen)
            text = self._decoder.step(token_id)
        self._token_ids.append(token_id)
        return text

    def _check_stop(self, region_start: int) -> str | None:
        """Find the stop string completed first in text[region_start:] and truncate there.

        "First" means the match that ends earliest (ties: the longer one), i.e. the one a
        token-by-token reader would see first, so the result does not depend on how the text
        was split into updates. Only text[region_start - len(stop) + 1:] is searched.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = self._text.find(stop, max(0, region_start - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        self._stop_end = end
        cut = end if self._params.include_stop_str_in_output else start
        # The held-back tail guarantees nothing past `cut` was streamed yet, unless a caller
        # asked for a finished delta and then kept updating; never cut streamed text.
        self._text = self._text[:max(cut, self._emitted)]
        self._stopped = stop
        return stop
