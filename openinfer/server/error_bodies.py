"""Error bodies in the shape the caller's API uses.

OpenAI routes: ``{"error": {"message", "type", "param", "code"}}``.
Anthropic routes (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``,
with Anthropic's error type names, so its SDK raises the matching exception class.

No engine import: the router answers in these shapes too.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_response(request: Request, status: int, message: str, type_: str,
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if request.url.path.startswith(ANTHROPIC_PATH):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}},
}
"""An error body as the OpenAI routes send it (``error_body``); the Anthropic route's has
``type: error`` beside ``error``, which the schema's open object admits."""


def document_errors(schema: dict) -> dict:
    """``schema`` (FastAPI's OpenAPI) with the errors the routes really answer: a request that
    fails validation gets 400 with an OpenAI error body (``validation_error`` below), not the
    422 and ``HTTPValidationError`` FastAPI documents by default."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            had_body = "422" in responses or "requestBody" in operation
            responses.pop("422", None)
            if had_body or operation.get("parameters"):
                responses["400"] = {"description": "Invalid request",
                                    "content": {"application/json": {"schema": ref}}}
    return schema
