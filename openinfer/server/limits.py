"""Admission control in front of the routes: API keys, body size, queue depth; and the
tenant salt of a request's prefix cache (--cache-salt-per-api-key)."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from openinfer.server.error_bodies import error_response

# Paths anyone may call (probes, scrapers; the chat page's two static files, which ask for
# the key themselves) even when an API key is set.
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/kv_events", "/", "/chat.js"})
# Paths that change the server's state for everyone: they need the admin key.
ADMIN_PATHS = frozenset({"/v1/cache/reset"})


TENANT_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant_salt",
                                                                       default=None)
"""The prefix-cache salt of the request being handled (set by the middleware when caches
are salted per API key; the handler's task inherits it)."""


PIN_OWNER: contextvars.ContextVar[str | None] = contextvars.ContextVar("pin_owner", default=None)
"""Whose cap a request's prompt-caching pins count against: its API key's tenant (set by the
middleware when the server has API keys)."""


def salted(cache_salt: str | None) -> str | None:
    """A request's ``cache_salt`` within its tenant's: blocks hashed under one API key never
    match another's, so a tenant cannot hit, or time, another's cached prefix."""
    return within_tenant(TENANT_SALT.get(), cache_salt)


def tenant_salt(api_key: str) -> str:
    """The salt of everything one API key sends (--cache-salt-per-api-key; the router
    computes it too, to hash prompts as the replicas do)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def within_tenant(tenant: str | None, cache_salt: str | None) -> str | None:
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


@dataclass(frozen=True)
class ServerLimits:
    api_keys: tuple[str, ...] = ()
    """When set, every non-public request needs ``Authorization: Bearer <key>`` (or x-api-key)
    with one of them."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Larger request bodies get 413 before they are read."""
    max_waiting_requests: int | None = None
    """When the engine's waiting queue is deeper than this, new generations get 503."""
    retry_after_s: int = 1
    admin_api_key: str | None = None
    """Key of the admin endpoints (ADMIN_PATHS); when None they take the API key if there is
    exactly one (several keys are several tenants: none of them is the admin), else they are
    refused (403): nobody can empty a cache anonymously."""
    cache_salt_per_api_key: bool = False
    """Salt every request's prefix cache by the API key it presented."""

    @property
    def admin_key(self) -> str | None:
        if self.admin_api_key is not None:
            return self.admin_api_key
        return self.api_keys[0] if len(self.api_keys) == 1 else None

def bearer_token(request: Request) -> str:
    """The key a client presented: ``Authorization: Bearer KEY`` or Anthropic's ``x-api-key``."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return given or request.headers.get("x-api-key", "")


def key_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def admin_refusal(request: Request, admin_key: str | None) -> JSONResponse | None:
    """None when ``request`` may call an admin endpoint; else the 401/403 to answer."""
    if admin_key is None:
        return error_response(request, 403, "admin endpoints are disabled: start the server "
                              "with --admin-api-key (or --api-key)", "permission_error",
                              code="admin_disabled")
    if not key_matches(bearer_token(request), admin_key):
        return error_response(request, 401, "invalid or missing admin API key",
                              "authentication_error", code="invalid_api_key")
    return None


def is_generation(method: str, path: str) -> bool:
    """A request that queues for the engine (the admin /v1/cache/ calls do not)."""
    return method == "POST" and path.startswith("/v1/") and not path.startswith("/v1/cache/")


@dataclass(frozen=True)
class EngineLoad:
    """What admission reads of the engine: how many requests it runs at most, and how many
    were waiting at its latest report."""
    max_num_seqs: int
    num_waiting: int = 0


class Admission:
    """Admission control as an outermost ASGI middleware: API keys, body size, queue depth
    and the tenant salt, decided on the headers alone, before anything reads, parses or
    tokenizes the body; a refusal costs a header lookup and one small JSON answer.

    Queue depth counts here, not only in the engine's reports. The engine reports its
    waiting queue once per step; a burst that arrives within one step, or while earlier
    arrivals are still being parsed on their way in, would all read the same stale count
    and all be admitted (under 3x overload that let the queue grow far past
    --max-waiting-requests, and admitted requests' p99 TTFT with it). So every generation
    admitted and not yet answered is counted, and those beyond what the engine runs at once
    are waiting, or about to. (The engine's own report still counts where it is higher: a
    request of n samples is n sequences, and a full KV cache runs fewer than max_num_seqs.)"""

    def __init__(self, app: ASGIApp, limits: ServerLimits, load: Callable[[], EngineLoad]) -> None:
        self.app = app
        self.limits = limits
        self.load = load
        self.generating = 0
        """Generation requests admitted whose responses have not ended."""

    def num_waiting(self) -> int:
        load = self.load()
        return max(load.num_waiting, self.generating - load.max_num_seqs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self.refusal(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        limits = self.limits
        if limits.cache_salt_per_api_key:
            TENANT_SALT.set(tenant_salt(bearer_token(request)))
        if limits.api_keys:
            PIN_OWNER.set(tenant_salt(bearer_token(request)))
        if not is_generation(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        self.generating += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.generating -= 1

    def refusal(self, request: Request) -> JSONResponse | None:
        limits, path = self.limits, request.url.path
        if path in ADMIN_PATHS:
            refusal = admin_refusal(request, limits.admin_key)
            if refusal is not None:
                return refusal
        elif (limits.api_keys and path not in PUBLIC_PATHS
              and not any([key_matches(bearer_token(request), key) for key in limits.api_keys])):
            return error_response(request, 401, "invalid or missing API key",
                                  "authentication_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return error_response(request, 413,
                                  f"request body exceeds {limits.max_body_bytes} bytes",
                                  "invalid_request_error")
        if (is_generation(request.method, path) and limits.max_waiting_requests is not None
                and self.num_waiting() > limits.max_waiting_requests):
            return error_response(request, 503, "the server is overloaded; retry later",
                                  "server_overloaded", code="overloaded",
                                  headers={"Retry-After": str(limits.retry_after_s)})
        return None
