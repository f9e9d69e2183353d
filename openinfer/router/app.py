"""The router process: the same OpenAI/Anthropic API, forwarded to data-parallel replicas.

For each request it computes the prompt's KV block hashes exactly as the engines do
(state.py), picks a replica (policies.py) and streams the replica's response back byte for
byte, going to the next choice when a replica fails or refuses before answering
(forward.py). ``/admin/*`` manages the replicas (admin.py). This module puts the pieces
together.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema

from openinfer.router.admin import AdminOnly, install_admin_routes
from openinfer.router.forward import forward_get, generate_route
from openinfer.router.metrics import cluster_exposition
from openinfer.router.state import RouterState, prompt_ids
from openinfer.server.anthropic_protocol import MessagesRequest
from openinfer.server.disconnect import CancelOnDisconnect
from openinfer.server.error_bodies import document_errors
from openinfer.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from openinfer.server.responses_protocol import ResponsesRequest

__all__ = ["GENERATE_PATHS", "RouterState", "build_router_app", "prompt_ids"]
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


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
    app.add_middleware(AdminOnly, admin_api_key=admin_api_key)
    app.add_middleware(CancelOnDisconnect)  # a client gone before its answer frees the replica
    _install_status_routes(app, state)
    install_admin_routes(app, state)
    for path in GENERATE_PATHS:
        app.add_api_route(path, generate_route(state, path), methods=["POST"])
    app.openapi = lambda: app.openapi_schema or _openapi_with_bodies(app)
    return app


def _install_status_routes(app: FastAPI, state: RouterState) -> None:
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
        return await forward_get(state, "/v1/models", request)

    @app.get("/v1/responses/{response_id}")
    async def response(response_id: str, request: Request) -> Response:
        return await forward_get(state, f"/v1/responses/{quote(response_id, safe='')}", request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        return await forward_get(state, f"/v1/responses/{quote(response_id, safe='')}", request,
                                 "DELETE")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> Response:
        return await forward_get(state, f"/v1/responses/{quote(response_id, safe='')}/input_items",
                                 request)


def _openapi_with_bodies(app: FastAPI) -> dict:
    """The schema FastAPI makes, plus the request bodies of the generate routes (which read
    the raw body to relay it, so FastAPI cannot see their models): the server's own."""
    models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
              "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest}
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
