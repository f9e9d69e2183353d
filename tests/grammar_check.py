"""An independent judge of constrained outputs: an llguidance matcher that a test builds from
its own grammar text over the checkpoint's tokenizer. It shares nothing with the engine's
compiler (not its ``grammar_text``, its cache or its matchers), so a grammar the engine
compiles wrongly makes the mask and this check disagree.

Finished outputs are better judged by jsonschema or ``re.fullmatch``; this judges outputs
cut by max_tokens, which must be prefixes the grammar accepts."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf
import transformers


def lark(text: str) -> str:
    return llguidance.grammar_from("lark", text)


def gbnf(text: str) -> str:
    return llguidance.grammar_from("gbnf", text)


def regex(pattern: str) -> str:
    return llguidance.grammar_from("regex", pattern)


def choice(options: list[str]) -> str:
    return llguidance.grammar_from("choice", json.dumps(options))


def json_schema(schema: dict, any_whitespace: bool = True) -> str:
    """``any_whitespace`` False: compact JSON only (what ``disable_any_whitespace`` asks);
    True: any whitespace between tokens, a superset of the engine's bounded default."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides={"whitespace_flexible": any_whitespace})


class GrammarCheck:
    """Matchers over one checkpoint's tokenizer (loaded here, not taken from the engine)."""

    def __init__(self, checkpoint: str | Path) -> None:
        self.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        n_vocab = transformers.AutoConfig.from_pretrained(checkpoint).vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab)

    def accepts_prefix(self, grammar: str, token_ids: list[int]) -> bool:
        """Whether ``grammar`` accepts these tokens one by one (an output cut short)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return all(matcher.consume_token(t) for t in token_ids) and not matcher.is_error()

    def accepts_text_prefix(self, grammar: str, text: str) -> bool:
        """The same for a text (a server's answer): its tokens as the tokenizer writes it."""
        ids = self.hf_tokenizer.encode(text, add_special_tokens=False)
        assert self.hf_tokenizer.decode(ids) == text, "the text does not round-trip"
        return self.accepts_prefix(grammar, ids)
