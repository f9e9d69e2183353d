"""The router's ``/admin/*`` API: list, add and remove replicas, drain one before a restart
and put it back. It needs the admin key (``AdminOnly``) and is refused without one."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from openinfer.router.policies import Worker
from openinfer.router.state import RouterState
from openinfer.server.error_bodies import error_body
from openinfer.server.limits import admin_refusal


class AdminOnly:
    """/admin/* needs the admin key. A plain ASGI middleware: Starlette's @app.middleware
    (BaseHTTPMiddleware) would pass every relayed stream through a task and a memory
    channel of its own."""

    def __init__(self, app, admin_api_key: str | None) -> None:
        self.app, self.admin_api_key = app, admin_api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/admin/"):
            refusal = admin_refusal(Request(scope), self.admin_api_key)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_admin_routes(app: FastAPI, state: RouterState) -> None:
    _install_worker_routes(app, state)
    _install_drain_routes(app, state)


def _install_worker_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/admin/workers")
    async def list_workers() -> dict:
        prefill = {w.url for w in state.prefill.workers} if state.prefill else set()
        return {"workers": [{"url": w.url, "role": "prefill" if w.url in prefill else "serve",
                             "healthy": w.healthy, "draining": w.draining,
                             "in_flight": w.in_flight,
                             "external_load": w.external_load, "routed": w.routed,
                             "indexed_blocks": len(w.index),
                             "events": w.index.live} for w in state.all_workers]}

    @app.post("/admin/workers")
    async def add_worker(body: dict) -> JSONResponse:
        url = body.get("url")
        if not isinstance(url, str) or not _replica_url(url):
            return JSONResponse(error_body("'url' must be a replica's http(s)://host:port URL",
                                           "invalid_request_error", param="url"),
                                status_code=400)
        state.add_worker(url)
        return JSONResponse({"added": url})

    @app.delete("/admin/workers")
    async def remove_worker(url: str) -> JSONResponse:
        removed = state.remove_worker(url)
        return JSONResponse({"removed": removed}, status_code=200 if removed else 404)


def _install_drain_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/admin/workers/drain")
    async def drain_worker(body: dict) -> JSONResponse:
        """Take a replica out of rotation and wait (up to ``timeout_s``, 300) until the
        requests it has in flight have ended: then it can be restarted losing nothing."""
        worker = _named_worker(state, body)
        if worker is None:
            return _no_such_worker(body)
        timeout_s = body.get("timeout_s", 300)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) \
                or not 0 <= timeout_s <= 3600:
            return JSONResponse(error_body("'timeout_s' must be a number of seconds in "
                                           "[0, 3600]", "invalid_request_error",
                                           param="timeout_s"), status_code=400)
        return await _drain(worker, timeout_s)

    @app.post("/admin/workers/undrain")
    async def undrain_worker(body: dict) -> JSONResponse:
        """Put a drained replica back in rotation (once its health check passes)."""
        worker = _named_worker(state, body)
        if worker is None:
            return _no_such_worker(body)
        worker.draining = False
        return JSONResponse({"url": worker.url, "draining": False})


async def _drain(worker: Worker, timeout_s: float) -> JSONResponse:
    worker.draining = True
    deadline = time.monotonic() + timeout_s
    while worker.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return JSONResponse({"url": worker.url, "drained": worker.in_flight == 0,
                         "in_flight": worker.in_flight},
                        status_code=200 if worker.in_flight == 0 else 504)


def _named_worker(state: RouterState, body: dict) -> Worker | None:
    url = str(body.get("url", "")).rstrip("/")
    return next((w for w in state.all_workers if w.url == url), None)


def _no_such_worker(body: dict) -> JSONResponse:
    return JSONResponse(error_body(f"no replica {body.get('url')!r}", "invalid_request_error"),
                        status_code=404)


def _replica_url(url: str) -> bool:
    try:
        parsed = urlparse(url)
        return parsed.scheme in ("http", "https") and bool(parsed.hostname) and \
            parsed.port is not None and not parsed.query and not parsed.fragment
    except ValueError:  # e.g. a port out of range
        return False
