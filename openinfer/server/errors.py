"""Error bodies in the shape the caller's API uses.

OpenAI routes: ``{"error": {"message", "type", "param", "code"}}``.
Anthropic routes (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``,
with Anthropic's error type names, so its SDK raises the matching exception class.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openinfer.engine.async_llm import RequestFailedError
from openinfer.engine.core_client import EngineDeadError
from openinfer.server.prompt import PromptError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)


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


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the field they are about ('top_p must be ...')."""
    match = re.match(r"^([a-z_]+)\b", message)
    return match.group(1) if match else None


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(request, e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(PromptError)  # a ValueError that names its own param
    async def prompt_error(request: Request, e: PromptError) -> JSONResponse:
        return error_response(request, 400, e.message, "invalid_request_error", e.param)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, e: ValueError) -> JSONResponse:
        message = str(e)
        return error_response(request, 400, message, "invalid_request_error", _param_of(message))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        # Not the client's fault and not retryable here: a supervisor must restart us.
        return error_response(request, 503, f"the engine is unavailable: {e}",
                              "service_unavailable", code="engine_dead")

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, e: RequestFailedError) -> JSONResponse:
        return error_response(request, e.status, str(e), "service_unavailable", code=e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":  # OpenAI's words for a field nobody declared
            return error_response(request, 400, f"Unrecognized request argument supplied: {param}",
                                  "invalid_request_error", param, code="unrecognized_argument")
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(
            first.get("msg", "invalid request"))
        return error_response(request, 400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(request, e.status_code, str(e.detail), "invalid_request_error")
