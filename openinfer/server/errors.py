"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the field they are about ('top_p must be ...')."""
    match = re.match(r"^([a-z_]+)\b", message)
    return match.group(1) if match else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError) -> JSONResponse:
        message = str(e)
        return JSONResponse(error_body(message, "invalid_request_error", _param_of(message)),
                            status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(
            first.get("msg", "invalid request"))
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"),
                            status_code=e.status_code)
