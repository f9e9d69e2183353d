"""Grammars over a tokenizer's vocabulary, through llguidance.

``GrammarCompiler`` turns a request's ``StructuredOutputsParams`` into an llguidance
matcher: it validates (the front end calls it before a request is queued, so a bad schema is
a 400) and keeps compiled matchers in an LRU cache keyed by the grammar, handing each request
a copy. ``RequestGrammar`` is one request's matcher plus the gate that holds it back until a
reasoning section ended; the scheduler feeds it the request's tokens.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import llguidance

from openinfer.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
BOUNDED_JSON_WHITESPACE = r"[\x20\x09]{0,8}(\r?\n[\x20\x09]{0,48})?"
"""JSON's whitespace between tokens, by default: pretty-printing fits (one line break and
its indentation), but not an unbounded run, which a small or unsure model can fall into and
never leave until max_tokens."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (not yet checked: compiling does that)."""
    if params.kind in ("json", "json_object"):
        schema = params.json if params.json is not None else {"type": "object"}
        options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or BOUNDED_JSON_WHITESPACE
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if params.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:  # Lark, or llama.cpp's GBNF (converted to Lark)
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        # The model's logits may be wider than the tokenizer's vocabulary: the mask covers
        # every logit, and ids past the tokenizer's are never allowed.
        # llguidance.hf imports transformers (0.5 s): the engine core has no tokenizer
        # until a grammar needs one, and starts without it.
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=eos_token_ids or None)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``params``; ValueError naming the field when the grammar is
        invalid."""
        key = params.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return template.deep_copy()
        grammar = grammar_text(params)
        # Construction compiles the grammar (and releases the GIL while it does).
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(template.get_error())}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the field if ``params`` cannot be compiled."""
        self.matcher(params)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "invalid grammar"


class RequestGrammar:
    """One request's matcher, fed the request's output tokens one at a time.

    Before ``start_after`` has appeared in the output (a reasoning section), the output is
    free and the matcher is not fed."""

    def __init__(self, matcher: llguidance.LLMatcher,
                 start_after: tuple[int, ...] | None = None) -> None:
        self.matcher = matcher
        self.start_after = start_after
        self.active = not start_after
        self._recent: list[int] = []

    def accept(self, token_id: int) -> None:
        if self.active:
            self.matcher.consume_token(token_id)
            return
        self._recent = (self._recent + [token_id])[-len(self.start_after):]
        self.active = tuple(self._recent) == self.start_after

    def valid_prefix_len(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (drafts) the grammar accepts in a row from here."""
        if self.active:
            return self.matcher.validate_tokens(token_ids) if token_ids else 0
        # Drafts may end the free section; the ones after that were drafted unconstrained
        # and no mask covers them this step: cut them.
        recent = self._recent
        for i, token_id in enumerate(token_ids):
            recent = (recent + [token_id])[-len(self.start_after):]
            if tuple(recent) == self.start_after:
                return i + 1
        return len(token_ids)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (the request is done)."""
        return self.active and self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None
