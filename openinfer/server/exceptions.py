"""The exceptions a request handler raises to answer a client with an error.

A leaf: it imports nothing of openinfer, so the request models, the prompt renderer and
the router can raise them without importing the handlers (server/errors.py) or the
engine those handlers know about.
"""

from __future__ import annotations


class APIError(Exception):
    """An error answered as is: ``status``, and the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)


class PromptError(ValueError):
    """A prompt the server cannot render: answered with a 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param
