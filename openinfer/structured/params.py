"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``).

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` is set. The
server maps OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*`` fields, and forced tool calls onto this one shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    """A JSON schema (object or its text); the output is a JSON value valid under it."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax or llama.cpp's GBNF."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between tokens (vLLM's field): shorter outputs, and a small
    model cannot wander off into spaces."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace JSON may hold between tokens (vLLM's
    ``guided_whitespace_pattern``)."""
    start_after_token_ids: tuple[int, ...] | None = None
    """Constrain only the output after this token sequence (the end of a reasoning section,
    set by the server's reasoning parser); None: from the first output token."""

    def __post_init__(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(kinds) or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if not (isinstance(self.choice, list | tuple) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.start_after_token_ids is not None:
            object.__setattr__(self, "start_after_token_ids", tuple(self.start_after_token_ids))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """Identifies the compiled grammar: everything but where it starts."""
        wire = self.to_wire()
        wire.pop("start_after_token_ids")
        return json.dumps(wire, sort_keys=True)

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        if self.start_after_token_ids is not None:
            wire["start_after_token_ids"] = list(self.start_after_token_ids)
        return wire

    @classmethod
    def parse(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """From a request's dict (unknown keys are refused, naming them)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown field (known: "
                             f"{', '.join(sorted(known - {'start_after_token_ids'}))})")
        return cls(**value)
