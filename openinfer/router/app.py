"""The router process: the same OpenAI/Anthropic API, forwarded to data-parallel replicas.

For each request it computes the prompt's KV block hashes exactly as the engines do (the
server's own prompt renderer, server/prompt.py, over the same tokenizer and chat template,
then the same hash chain), picks a replica (policies.py) and streams the
replica's response back byte for byte. A replica that cannot be reached before it
answered is marked unhealthy and the request goes to the next choice, so no request is
lost to a dead replica; a replica that answers 503 (its engine dead or restarting, its
queue full) has refused without starting anything, and the request goes to the next
choice too (the last refusal is the answer when every replica refused); once a response
has started, a broken stream ends with an error event. Replicas are health-checked every
second (ejected on failure, re-admitted when they answer again), and their KV events, when
they publish them, keep the cache index exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlparse

import httpx
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic.json_schema import models_json_schema

from openinfer.kv.block_hash import extend_block_hashes
from openinfer.router.kv_events import EventFollower
from openinfer.router.metrics import cluster_exposition, replica_load
from openinfer.router.pd import PrefillLeg, prefill_first, release_unused_lease
from openinfer.router.policies import Router, RouterConfig, Worker
from openinfer.router.upstream import ReplicaEjected, ReplicaResponse
from openinfer.server.anthropic_protocol import MessagesRequest, openai_tools
from openinfer.server.disconnect import CancelOnDisconnect
from openinfer.server.error_bodies import document_errors, error_body
from openinfer.server.limits import admin_refusal, bearer_token, tenant_salt, within_tenant
from openinfer.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from openinfer.server.prompt import PromptRenderer

logger = logging.getLogger(__name__)
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
HEALTH_INTERVAL_S = 1.0
STALLED_STREAM_S = 10.0
"""A started response is cut (an error event ends a stream) once its replica has been
ejected and nothing came for this long: a replica slow to answer /health under load keeps
its streams; a hung one does not keep them forever."""


class RouterState:
    def __init__(self, urls: list[str], config: RouterConfig, renderer: PromptRenderer,
                 block_size: int,
                 prefill_urls: list[str] = (), disagg_min_tokens: int = 256,
                 cache_salt_per_api_key: bool = False,
                 kv_transfer_secret: str | None = None) -> None:
        self.router = Router(config, [Worker(u.rstrip("/")) for u in urls])
        """The replicas that answer clients (decode instances, when disaggregated)."""
        self.prefill = Router(config, [Worker(u.rstrip("/")) for u in prefill_urls]) \
            if prefill_urls else None
        """Disaggregation: the prefill instances, chosen by the same policy."""
        self.cache_salt_per_api_key = cache_salt_per_api_key
        """The replicas salt each request's prefix cache by its API key: hash as they do."""
        self.renderer = renderer
        """The server's prompt renderer, over the replicas' tokenizer and chat template."""
        self.block_size = block_size
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                      limits=httpx.Limits(max_connections=None,
                                                          max_keepalive_connections=None))
        self.zmq = zmq.asyncio.Context()
        # The replicas' --kv-transfer-secret: their KV events speak CURVE, keyed by it, and
        # the prefill leg gives it when it releases a lease nobody will pull.
        self.events = EventFollower(self.http, self.zmq, kv_transfer_secret)
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self.engine_index = {w.url: i for i, w in enumerate(self.all_workers)}
        """Each replica's number, its `engine` label in /metrics: serving replicas, prefill
        instances, then those added at run time (a URL keeps its number)."""
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("openinfer_router:decisions", "Routing decisions by reason",
                                 ["reason"], registry=r)
        self.prompt_blocks = Counter("openinfer_router:prompt_blocks",
                                     "Full prompt blocks of routed requests", registry=r)
        self.matched_blocks = Counter("openinfer_router:matched_blocks",
                                      "Of those, blocks the chosen replica already held",
                                      registry=r)
        self.load = Gauge("openinfer_router:worker_in_flight", "Requests in flight per replica",
                          ["worker"], registry=r)
        self.external_load = Gauge("openinfer_router:worker_external_load",
                                   "Requests a replica reported beyond those routed here",
                                   ["worker"], registry=r)
        self.healthy_gauge = Gauge("openinfer_router:worker_healthy", "1 if in rotation",
                                   ["worker"], registry=r)
        self.max_excess = Gauge("openinfer_router:max_load_excess",
                                "Most requests a chosen replica had in flight beyond the least "
                                "loaded one, at the moment of a routing decision", registry=r)
        self.max_excess_seen = 0
        disagg = Counter("openinfer_router:disagg_decisions",
                         "Disaggregation per request: prefill_then_decode, decode_only "
                         "(short or cached prompt), prefill_failed (decode recomputed), "
                         "client_left (during the prefill leg, whose lease is then "
                         "released)",
                         ["decision"], registry=r)
        leases_released = Counter(
            "openinfer_router:disagg_leases_released",
            "Prefill leases released by the router because their decode leg never started "
            "(the client left during or between the legs, or no decode instance answered)",
            registry=r)
        self.routed = Counter("openinfer_router:worker_requests", "Requests routed per replica",
                              ["worker"], registry=r)
        self.rerouted = Counter("openinfer_router:rerouted_requests",
                                "Requests sent to another replica because this one failed, "
                                "was ejected or answered 503 before answering", ["worker"], registry=r)
        self.prefill_leg = PrefillLeg(self.prefill, self.http, block_size, disagg_min_tokens,
                                      kv_transfer_secret, disagg, leases_released) \
            if self.prefill is not None else None
        """Disaggregation: what the prefill leg of a request needs (router/pd.py)."""

    # ---- replicas --------------------------------------------------------------------

    def add_worker(self, url: str) -> Worker:
        url = url.rstrip("/")
        worker = next((w for w in self.router.workers if w.url == url), None)
        if worker is None:
            # Never handed a client's credentials; in rotation once its /health answers.
            worker = Worker(url, trusted=False, healthy=False)
            self.engine_index.setdefault(url, len(self.engine_index))
            self.router.workers.append(worker)
            self._start_watch(worker)
        return worker

    def remove_worker(self, url: str) -> bool:
        url = url.rstrip("/")
        worker = next((w for w in self.router.workers if w.url == url), None)
        if worker is None:
            return False
        self.router.workers.remove(worker)
        for task in self._tasks.pop(url, []):
            task.cancel()
        return True

    def start(self) -> None:
        for worker in self.all_workers:
            self._start_watch(worker)

    @property
    def all_workers(self) -> list[Worker]:
        return self.router.workers + (self.prefill.workers if self.prefill else [])

    def _start_watch(self, worker: Worker) -> None:
        self._tasks[worker.url] = [asyncio.create_task(self._health_loop(worker)),
                                   asyncio.create_task(self.events.follow(worker))]

    async def _follow_events_again(self, worker: Worker) -> None:
        """A replica back in rotation may be a new process (its event endpoints new, its
        cache empty): subscribe afresh, and wait (a few seconds at most) until the index
        has caught up or started over."""
        tasks = self._tasks[worker.url]
        tasks[1].cancel()
        await asyncio.wait({tasks[1]})
        synced = asyncio.Event()
        tasks[1] = asyncio.create_task(self.events.follow(worker, synced))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await synced.wait()

    async def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        await self.http.aclose()
        self.zmq.term()

    async def _health_loop(self, worker: Worker) -> None:
        while True:
            try:
                resp = await self.http.get(f"{worker.url}/health", timeout=2.0)
                healthy = resp.status_code == 200
                if healthy:
                    await self._poll_load(worker)
            except (httpx.HTTPError, OSError):
                healthy = False
            if healthy and not worker.healthy:
                await self._follow_events_again(worker)  # (before it is routed to again)
            if healthy != worker.healthy:
                logger.warning("replica %s %s", worker.url, "re-admitted" if healthy else "ejected")
            worker.healthy = healthy
            self.healthy_gauge.labels(worker=worker.url).set(1 if healthy else 0)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _poll_load(self, worker: Worker) -> None:
        """The replica's own view of its load, from its Prometheus metrics."""
        in_flight = worker.in_flight  # what we had sent it when it answered
        resp = await self.http.get(f"{worker.url}/metrics", timeout=2.0)
        requests, worker.kv_usage = replica_load(resp.text)  # whatever its --metrics-prefix
        worker.report(requests, in_flight)

    # ---- requests --------------------------------------------------------------------

    def prompt_hashes(self, path: str, body: dict, api_key: str) -> tuple[int, list[bytes]]:
        """The request's prompt length and full blocks, hashed as its engine will hash them
        (salted by ``api_key`` when the replicas salt by it)."""
        try:
            ids = prompt_ids(self.renderer, path, body)
        except Exception:
            return 0, []  # the replica will explain what is wrong with it
        salt = body.get("cache_salt")
        if self.cache_salt_per_api_key:
            salt = within_tenant(tenant_salt(api_key), salt)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, ids, self.block_size, salt)
        return len(ids), hashes


def prompt_ids(renderer: PromptRenderer, path: str, body: dict) -> list[int]:
    """The token ids a replica's engine will run for the request's (first) prompt.

    The body is read by the server's own request models and rendered by the server's
    renderer, so defaults, template arguments and content blocks are the same as there;
    the engine then keeps the last ``truncate_prompt_tokens`` tokens, and so does this.
    Raises whatever the server would answer with a 400.
    """
    limit = None
    if path == "/v1/completions":
        completion = CompletionRequest.model_validate(body)
        prompts = renderer.completion(completion.prompt, completion.add_special_tokens)
        ids, limit = prompts[0].token_ids, completion.truncate_prompt_tokens
    elif path == "/v1/chat/completions":
        chat = ChatCompletionRequest.model_validate(body)
        # The server shows the template the tools unless tool_choice is "none".
        tools = chat.tools if chat.tool_choice != "none" else None
        ids, limit = renderer.openai_chat(chat, tools=tools), chat.truncate_prompt_tokens
    elif path == "/v1/messages":
        messages = MessagesRequest.model_validate(body)
        none = (messages.tool_choice or {}).get("type") == "none"
        ids = renderer.anthropic_messages(
            messages, tools=None if none else openai_tools(messages) or None)
    else:
        raise ValueError(f"no prompt on {path}")
    if limit is not None and limit >= 1:  # -1 depends on max_model_len: not known here
        ids = ids[-limit:]
    return ids


def build_router_app(state: RouterState, admin_api_key: str | None = None) -> FastAPI:
    """The router's API. ``/admin/*`` needs ``admin_api_key`` and is refused without one."""
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.start()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="openinfer router", lifespan=lifespan)

    app.add_middleware(_AdminOnly, admin_api_key=admin_api_key)
    app.add_middleware(CancelOnDisconnect)  # a client gone before its answer frees the replica

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = bool(state.router.healthy())
        return JSONResponse({"status": "ok" if ok else "no healthy replica"},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for w in state.all_workers:
            state.load.labels(worker=w.url).set(w.in_flight)
            state.external_load.labels(worker=w.url).set(w.external_load)
        # One scrape sees the cluster: the router's series, then every healthy replica's.
        replicas = {str(state.engine_index[w.url]): w.url for w in state.all_workers if w.healthy}
        body = await cluster_exposition(state.http, replicas, state.registry)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _forward_get(state, "/v1/models", request)

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

    def named_worker(body: dict) -> Worker | None:
        url = str(body.get("url", "")).rstrip("/")
        return next((w for w in state.all_workers if w.url == url), None)

    @app.post("/admin/workers/drain")
    async def drain_worker(body: dict) -> JSONResponse:
        """Take a replica out of rotation and wait (up to ``timeout_s``, 300) until the
        requests it has in flight have ended: then it can be restarted losing nothing."""
        worker = named_worker(body)
        if worker is None:
            return JSONResponse(error_body(f"no replica {body.get('url')!r}",
                                           "invalid_request_error"), status_code=404)
        timeout_s = body.get("timeout_s", 300)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) \
                or not 0 <= timeout_s <= 3600:
            return JSONResponse(error_body("'timeout_s' must be a number of seconds in "
                                           "[0, 3600]", "invalid_request_error",
                                           param="timeout_s"), status_code=400)
        worker.draining = True
        deadline = time.monotonic() + timeout_s
        while worker.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return JSONResponse({"url": worker.url, "drained": worker.in_flight == 0,
                             "in_flight": worker.in_flight},
                            status_code=200 if worker.in_flight == 0 else 504)

    @app.post("/admin/workers/undrain")
    async def undrain_worker(body: dict) -> JSONResponse:
        """Put a drained replica back in rotation (once its health check passes)."""
        worker = named_worker(body)
        if worker is None:
            return JSONResponse(error_body(f"no replica {body.get('url')!r}",
                                           "invalid_request_error"), status_code=404)
        worker.draining = False
        return JSONResponse({"url": worker.url, "draining": False})

    for path in GENERATE_PATHS:
        app.add_api_route(path, _generate_route(state, path), methods=["POST"])
    app.openapi = lambda: app.openapi_schema or _openapi_with_bodies(app)
    return app


def _openapi_with_bodies(app: FastAPI) -> dict:
    """The schema FastAPI makes, plus the request bodies of the generate routes (which read
    the raw body to relay it, so FastAPI cannot see their models): the server's own."""
    models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
              "/v1/messages": MessagesRequest}
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    refs, defs = models_json_schema([(m, "validation") for m in models.values()],
                                    ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, model in models.items():
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(model, "validation")]}}}
    app.openapi_schema = document_errors(schema)
    return app.openapi_schema


class _AdminOnly:
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


def _generate_route(state: RouterState, path: str):
    async def route(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return JSONResponse(error_body("request body is not a JSON object",
                                           "invalid_request_error"), status_code=400)
        num_tokens, hashes = state.prompt_hashes(path, body, bearer_token(request))
        session = request.headers.get("x-session-id") or body.get("user")
        if not isinstance(session, str):  # (a bad `user` is the replica's 400 to give)
            session = None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "x-api-key", "content-type",
                                    "anthropic-version")}
        tried: set[str] = set()
        prefilled_by, lease = "none", None
        refusal: Response | None = None  # the last replica's 503, if each one refused
        while True:
            decision = state.router.choose(hashes, session, exclude=tried)
            leg = state.prefill_leg
            if decision is not None and leg is not None and not tried:
                raw, prefilled_by, lease = await prefill_first(leg, path, body, raw, headers,
                                                               num_tokens, hashes, decision)
            if decision is None:
                if leg is not None and lease is not None:
                    release_unused_lease(leg, lease)
                if refusal is not None:
                    return refusal
                return JSONResponse(error_body("no healthy replica to serve the request",
                                               "service_unavailable", code="no_replica"),
                                    status_code=503, headers={"Retry-After": "1"})
            worker = decision.worker
            tried.add(worker.url)
            excess = worker.load - min(w.load for w in state.router.healthy())
            if excess > state.max_excess_seen:
                state.max_excess_seen = excess
                state.max_excess.set(excess)
            worker.in_flight += 1  # counted from now, not from its first token
            # A response counts as started with its first bytes, not its headers: until
            # then the request can still go elsewhere.
            upstream = ReplicaResponse(state.http, worker.url + path, raw,
                                       worker.forwarded_headers(headers))
            try:
                first = await upstream.next_chunk(worker)
            except (httpx.TransportError, ReplicaEjected) as e:
                # Any failure before the first byte (refused, reset, a request body written
                # to a socket the replica closed as it died, a replica that never answers):
                # nothing reached the client yet, so the request may go elsewhere.
                await upstream.close()
                worker.in_flight -= 1
                worker.healthy = False  # not started: try the next replica
                state.rerouted.labels(worker=worker.url).inc()
                logger.warning("replica %s failed before answering (%s); rerouting",
                               worker.url, e)
                continue
            except asyncio.CancelledError:  # the client hung up before the replica answered
                await upstream.close()  # (the replica sees its connection go: it aborts)
                worker.in_flight -= 1
                if leg is not None and lease is not None:  # (a pull under way holds it)
                    release_unused_lease(leg, lease)
                raise
            if upstream.response.status_code == 503:
                # Refused, nothing started (its engine dead or restarting, its queue full):
                # another replica may serve it. The health loop decides on ejection.
                refusal = await _refusal(upstream, first, worker)
                state.rerouted.labels(worker=worker.url).inc()
                logger.warning("replica %s answered 503; trying another", worker.url)
                continue
            state.decisions.labels(reason=decision.reason).inc()
            state.prompt_blocks.inc(len(hashes))
            state.matched_blocks.inc(decision.matched_blocks)
            state.routed.labels(worker=worker.url).inc()
            worker.routed += 1
            response = upstream.response
            return _RelayResponse(
                _relay(upstream, first, worker), status_code=response.status_code,
                media_type=response.headers.get("content-type"),
                headers={"x-openinfer-worker": worker.url, "x-openinfer-route": decision.reason,
                         "x-openinfer-prefill": prefilled_by, **_prefix_headers(hashes)})

    return route


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


async def _forward_get(state: RouterState, path: str, request: Request) -> Response:
    for worker in state.router.healthy():
        try:
            resp = await state.http.get(worker.url + path, headers=worker.forwarded_headers({
                k: v for k, v in request.headers.items() if k.lower() == "authorization"}))
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        except (httpx.HTTPError, OSError):
            continue
    return JSONResponse(error_body("no healthy replica", "service_unavailable"), status_code=503)


def _replica_url(url: str) -> bool:
    try:
        parsed = urlparse(url)
        return parsed.scheme in ("http", "https") and bool(parsed.hostname) and \
            parsed.port is not None and not parsed.query and not parsed.fragment
    except ValueError:  # e.g. a port out of range
        return False


def _prefix_headers(hashes: list[bytes]) -> dict[str, str]:
    """The prompt's full blocks as the router hashed them: their number and the last hash
    (hex). The hashes chain, so the last one names the whole prefix: an operator (or a
    test) can check it against the replica's BlockStored events to see that routing saw
    the prompt the engine ran."""
    headers = {"x-openinfer-prefix-blocks": str(len(hashes))}
    if hashes:
        headers["x-openinfer-prefix-hash"] = hashes[-1].hex()
    return headers
