"""The generate path: a request forwarded to the replica the policy chose, and its response
streamed back byte for byte.

A replica that cannot be reached before it answered is marked unhealthy and the request
goes to the next choice, so no request is lost to a dead replica; a replica that answers
503 (its engine dead or restarting, its queue full) has refused without starting anything,
and the request goes to the next choice too (the last refusal is the answer when every
replica refused). A response counts as started with its first bytes, not its headers: until
then the request can still go elsewhere. Once a response has started, a broken stream ends
with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from openinfer.router.pd import prefill_first, release_unused_lease
from openinfer.router.policies import Decision, Worker
from openinfer.router.state import RouterState
from openinfer.router.upstream import ReplicaEjected, ReplicaResponse
from openinfer.server.error_bodies import error_body
from openinfer.server.limits import bearer_token

logger = logging.getLogger(__name__)
STALLED_STREAM_S = 10.0
"""A started response is cut (an error event ends a stream) once its replica has been
ejected and nothing came for this long: a replica slow to answer /health under load keeps
its streams; a hung one does not keep them forever."""
RELAYED_HEADERS = ("authorization", "x-api-key", "content-type", "anthropic-version")
"""The client's headers a replica gets (the router's own credentials aside)."""


def generate_route(state: RouterState, path: str):
    """The handler of a generate endpoint (``path``): the raw body is relayed as it came."""
    async def route(request: Request) -> Response:
        raw = await request.body()
        body = _json_object(raw)
        if body is None:
            return JSONResponse(error_body("request body is not a JSON object",
                                           "invalid_request_error"), status_code=400)
        num_tokens, hashes = state.prompt_hashes(path, body, bearer_token(request))
        headers = {k: v for k, v in request.headers.items() if k.lower() in RELAYED_HEADERS}
        forward = _Forward(state, path, body, raw, headers, _session(request, body),
                           num_tokens, hashes)
        return await forward.run()

    return route


def _json_object(raw: bytes) -> dict | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _session(request: Request, body: dict) -> str | None:
    """The session the affinity policy keeps together: X-Session-Id, else OpenAI's
    ``prompt_cache_key`` (its cache-routing hint), else ``user``, else Anthropic's
    ``metadata.user_id``."""
    metadata = body.get("metadata")
    session = (request.headers.get("x-session-id") or body.get("prompt_cache_key")
               or body.get("user")
               or (metadata.get("user_id") if isinstance(metadata, dict) else None))
    return session if isinstance(session, str) else None  # (a bad field is the replica's 400)


@dataclass
class _Forward:
    """One generate request on its way to a replica, from choice to choice."""

    state: RouterState
    path: str
    body: dict
    raw: bytes
    """What the replica gets: the client's body, or the one the prefill leg made."""
    headers: dict[str, str]
    session: str | None
    num_tokens: int
    hashes: list[bytes]
    tried: set[str] = field(default_factory=set)
    prefilled_by: str = "none"
    lease: dict | None = None
    """The prefill instance's lease on the prompt's blocks, when it has one."""
    refusal: Response | None = None
    """The last replica's 503, if each one refused."""

    async def run(self) -> Response:
        while True:
            decision = self.state.router.choose(self.hashes, self.session, exclude=self.tried)
            leg = self.state.prefill_leg
            if decision is not None and leg is not None and not self.tried:
                self.raw, self.prefilled_by, self.lease = await prefill_first(
                    leg, self.path, self.body, self.raw, self.headers, self.num_tokens,
                    self.hashes, decision)
            if decision is None:
                return self._no_replica()
            response = await self._try(decision)
            if response is not None:
                return response

    def _no_replica(self) -> Response:
        self._release_lease()
        if self.refusal is not None:
            return self.refusal
        return JSONResponse(error_body("no healthy replica to serve the request",
                                       "service_unavailable", code="no_replica"),
                            status_code=503, headers={"Retry-After": "1"})

    def _release_lease(self) -> None:
        leg = self.state.prefill_leg
        if leg is not None and self.lease is not None:
            release_unused_lease(leg, self.lease)

    async def _try(self, decision: Decision) -> Response | None:
        """The chosen replica's response, or None when it failed or refused before
        answering (then the request may go elsewhere)."""
        worker = decision.worker
        self.tried.add(worker.url)
        self.state.note_load_excess(worker)
        worker.in_flight += 1  # counted from now, not from its first token
        upstream = ReplicaResponse(self.state.http, worker.url + self.path, self.raw,
                                   worker.forwarded_headers(self.headers))
        try:
            first = await upstream.next_chunk(worker)
        except (httpx.TransportError, ReplicaEjected) as e:
            # Any failure before the first byte (refused, reset, a request body written
            # to a socket the replica closed as it died, a replica that never answers):
            # nothing reached the client yet, so the request may go elsewhere.
            await upstream.close()
            worker.in_flight -= 1
            worker.healthy = False  # not started: try the next replica
            self.state.rerouted.labels(worker=worker.url).inc()
            logger.warning("replica %s failed before answering (%s); rerouting", worker.url, e)
            return None
        except asyncio.CancelledError:  # the client hung up before the replica answered
            await upstream.close()  # (the replica sees its connection go: it aborts)
            worker.in_flight -= 1
            self._release_lease()  # (a pull under way holds it)
            raise
        if upstream.response.status_code == 503:
            # Refused, nothing started (its engine dead or restarting, its queue full):
            # another replica may serve it. The health loop decides on ejection.
            self.refusal = await _refusal(upstream, first, worker)
            self.state.rerouted.labels(worker=worker.url).inc()
            logger.warning("replica %s answered 503; trying another", worker.url)
            return None
        self.state.count_routed(decision, self.hashes)
        return self._relayed(decision, upstream, first)

    def _relayed(self, decision: Decision, upstream: ReplicaResponse,
                 first: bytes | None) -> Response:
        worker, response = decision.worker, upstream.response
        return _RelayResponse(
            _relay(upstream, first, worker), status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            headers={"x-openinfer-worker": worker.url, "x-openinfer-route": decision.reason,
                     "x-openinfer-prefill": self.prefilled_by, **_prefix_headers(self.hashes)})


async def _refusal(upstream: ReplicaResponse, first: bytes | None, worker: Worker) -> Response:
    """A replica's refusal (a short error body) read whole, and its request ended."""
    body = bytearray(first or b"")
    try:
        async with asyncio.timeout(5):
            while (chunk := await upstream.next_chunk(worker)) is not None \
                    and len(body) < 65536:
                body += chunk
    except (TimeoutError, httpx.HTTPError, OSError, ReplicaEjected):
        pass  # what came is the answer
    finally:
        worker.in_flight -= 1
        await upstream.close()
    response = upstream.response
    return Response(bytes(body), status_code=response.status_code,
                    media_type=response.headers.get("content-type"),
                    headers={"Retry-After": response.headers.get("retry-after", "1"),
                             "x-openinfer-worker": worker.url})


class _RelayResponse(StreamingResponse):
    """Closes its relay when the response ends however it ends: a client that hangs up
    ends the replica's request (and the in-flight count) now, not when the relay is
    garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _relay(upstream: ReplicaResponse, first: bytes | None,
                 worker: Worker) -> AsyncIterator[bytes]:
    sse = "text/event-stream" in upstream.response.headers.get("content-type", "")
    try:
        chunk = first
        while chunk is not None:
            yield chunk
            # a replica ejected and silent for a while is hung: end the stream
            chunk = await upstream.next_chunk(worker, grace_s=STALLED_STREAM_S)
    except (httpx.HTTPError, OSError, ReplicaEjected) as e:
        if sse:  # the client has a partial stream: end it with an error, not a hang
            error = error_body(f"replica {worker.url} failed mid-stream: {e}",
                               "service_unavailable", code="replica_failed")
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        worker.in_flight -= 1
        await upstream.close()


async def forward_get(state: RouterState, path: str, request: Request,
                      method: str = "GET") -> Response:
    """A GET (or ``method``) relayed to the first healthy replica that answers
    (``/v1/models``; stored responses, which replicas sharing a store file all hold)."""
    for worker in state.router.healthy():
        try:
            resp = await state.http.request(method, worker.url + path, headers=worker.forwarded_headers({
                k: v for k, v in request.headers.items() if k.lower() == "authorization"}))
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        except (httpx.HTTPError, OSError):
            continue
    return JSONResponse(error_body("no healthy replica", "service_unavailable"), status_code=503)


def _prefix_headers(hashes: list[bytes]) -> dict[str, str]:
    """The prompt's full blocks as the router hashed them: their number and the last hash
    (hex). The hashes chain, so the last one names the whole prefix: an operator (or a
    test) can check it against the replica's BlockStored events to see that routing saw
    the prompt the engine ran."""
    headers = {"x-openinfer-prefix-blocks": str(len(hashes))}
    if hashes:
        headers["x-openinfer-prefix-hash"] = hashes[-1].hex()
    return headers
