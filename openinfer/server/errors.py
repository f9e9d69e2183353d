"""The server's exception handlers: each exception a route raises, as the error body of
the caller's API (server/error_bodies.py) with the right status."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openinfer.engine.async_llm import RequestFailedError
from openinfer.engine.core_client import EngineDeadError
from openinfer.server.error_bodies import error_response
from openinfer.server.exceptions import APIError, PromptError


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the field they are about ('top_p must be ...')."""
    match = re.match(r"^([a-z_]+)\b", message)
    return match.group(1) if match else None


def _json_error(error: dict, body: object) -> str:
    """FastAPI's json_invalid error as json.JSONDecodeError words it, where the body is."""
    reason = (error.get("ctx") or {}).get("error", "JSON decode error")
    position = error.get("loc", ())[-1]
    if not isinstance(body, str) or not isinstance(position, int):
        return f"invalid JSON in request body: {reason}"
    line = body.count("\n", 0, position) + 1
    column = position - body.rfind("\n", 0, position)
    return f"invalid JSON in request body: {reason} at line {line} column {column}"


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
        if first.get("type") == "json_invalid":  # its loc holds a byte offset, not a field
            return error_response(request, 400, _json_error(first, e.body),
                                  "invalid_request_error")
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
