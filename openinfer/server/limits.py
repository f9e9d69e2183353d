"""Admission control in front of the routes: API key, body size, queue depth."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request

from openinfer.server.errors import error_response

# Paths anyone may call (probes, scrapers) even when an API key is set.
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/kv_events"})


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None
    """When set, every non-public request needs ``Authorization: Bearer <key>`` (or x-api-key)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Larger request bodies get 413 before they are read."""
    max_waiting_requests: int | None = None
    """When the engine's waiting queue is deeper than this, new generations get 503."""
    retry_after_s: int = 1


def install_limits(app: FastAPI, limits: ServerLimits, num_waiting: Callable[[], int]) -> None:
    @app.middleware("http")
    async def admit(request: Request, call_next):
        path = request.url.path
        if limits.api_key is not None and path not in PUBLIC_PATHS:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            given = given or request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), limits.api_key.encode()):
                return error_response(request, 401, "invalid or missing API key",
                                      "authentication_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return error_response(request, 413,
                                  f"request body exceeds {limits.max_body_bytes} bytes",
                                  "invalid_request_error")
        generating = (request.method == "POST" and path.startswith("/v1/")
                      and not path.startswith("/v1/cache/"))
        if (generating and limits.max_waiting_requests is not None
                and num_waiting() > limits.max_waiting_requests):
            return error_response(request, 503, "the server is overloaded; retry later",
                                  "server_overloaded", code="overloaded",
                                  headers={"Retry-After": str(limits.retry_after_s)})
        return await call_next(request)
