"""The OpenAI-compatible HTTP API over an AsyncLLM (engine core in its own process): the
app, its middleware, and routes that hand each request to ``OpenAIServing``
(server/serving.py) or report on the engine."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

import openinfer
from openinfer.engine.async_llm import AsyncLLM
from openinfer.server.anthropic_api import install_anthropic_routes
from openinfer.server.disconnect import CancelOnDisconnect
from openinfer.server.error_bodies import document_errors
from openinfer.server.errors import install_error_handlers
from openinfer.server.limits import Admission, EngineLoad, ServerLimits
from openinfer.server.llamacpp_api import install_llamacpp_routes
from openinfer.server.metrics import ServerMetrics
from openinfer.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from openinfer.server.prompt import PromptRenderer
from openinfer.server.response_store import ResponseStore
from openinfer.server.responses_api import install_responses_routes
from openinfer.server.serving import OpenAIServing


def build_app(llm: AsyncLLM, served_model_name: str, limits: ServerLimits | None = None, *,
              sampling_defaults: dict[str, Any] | None = None,
              on_ready: Callable[[], None] | None = None, metrics_prefix: str = "openinfer",
              metrics_engine: str = "0", tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None,
              answer_ids_cache_tokens: int = 0,
              tool_call_kv_retention_s: float = 0.0,
              chat_template_content_format: str = "auto",
              response_store: ResponseStore | None = None) -> FastAPI:
    """The API over ``llm``. ``sampling_defaults`` fill the sampling fields a request leaves
    unset (the model's generation config under ``--generation-config auto``); ``on_ready``
    runs once the engine has loaded and requests are served. /metrics names its series
    ``<metrics_prefix>:...`` and labels them ``engine=metrics_engine`` (server/metrics.py).
    ``tool_call_parser``, ``enable_auto_tool_choice`` and ``reasoning_parser`` are vLLM's
    serve options of those names (server/chat_output.py), ``chat_template_content_format``
    too (server/chat_content.py). ``answer_ids_cache_tokens``: server/answer_ids.py;
    ``tool_call_kv_retention_s``: ``OpenAIServing.retain``; ``response_store``: where the
    Responses API keeps responses (None: ``store`` is refused)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await llm.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await llm.shutdown()

    app = FastAPI(title="openinfer", version=openinfer.__version__, lifespan=lifespan)
    install_error_handlers(app)
    def engine_load() -> EngineLoad:
        return EngineLoad(llm.config.scheduler.max_num_seqs,
                          llm.client.stats.get("num_waiting", 0))

    app.add_middleware(CancelOnDisconnect)  # it sees the client's own receive()
    # Outermost: a refusal is decided on the headers, before any other layer runs.
    app.add_middleware(Admission, limits=limits or ServerLimits(), load=engine_load)
    metrics = ServerMetrics.for_llm(llm, served_model_name, prefix=metrics_prefix,
                                    engine=metrics_engine)
    # `--chat-template` is already the tokenizer's own (cli.py sets it), as on the router.
    renderer = PromptRenderer(llm.tokenizer, content_format=chat_template_content_format)
    serving = OpenAIServing(llm, served_model_name, renderer,
                            sampling_defaults=sampling_defaults,
                            tool_call_parser=tool_call_parser,
                            enable_auto_tool_choice=enable_auto_tool_choice,
                            reasoning_parser=reasoning_parser,
                            answer_ids_cache_tokens=answer_ids_cache_tokens,
                            tool_call_kv_retention_s=tool_call_kv_retention_s)
    _install_engine_routes(app, llm, metrics)
    _install_openai_routes(app, serving)
    install_anthropic_routes(app, serving)
    install_responses_routes(app, serving, response_store)
    install_llamacpp_routes(app, llm, served_model_name, sampling_defaults)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(get_openapi(
                title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    return app


def _install_engine_routes(app: FastAPI, llm: AsyncLLM, metrics: ServerMetrics) -> None:
    """What the engine reports: health, metrics, KV event endpoints, version; and the
    prefix cache reset."""
    @app.get("/health")
    async def health() -> JSONResponse:
        dead = llm.client.dead_reason
        restarts = llm.client.num_restarts
        if dead is not None:  # load balancers take this replica out of rotation
            return JSONResponse({"status": "dead", "reason": dead, "engine_restarts": restarts},
                                status_code=503)
        return JSONResponse({"status": "ok", "engine_restarts": restarts})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv_events")
    async def kv_events() -> dict:
        """Where this replica publishes its KV events (routers subscribe there)."""
        cache = llm.config.cache
        # Where the engine core bound them (its port, for a tcp://host:* endpoint); each
        # restarted core binds afresh, and routers ask here again when it comes back.
        bound = llm.client.info.get("kv_events") or {}
        return {"endpoint": bound.get("endpoint", cache.kv_events_endpoint),
                "replay_endpoint": bound.get("replay_endpoint",
                                             cache.kv_events_replay_endpoint),
                "topic": cache.kv_events_topic, "block_size": cache.block_size}

    @app.post("/v1/cache/reset")
    async def reset_cache() -> dict:
        """Admin: drop every cached prefix in device and host memory (the shared file
        store is left alone). Needs the API key when one is set."""
        cleared = await llm.client.call("reset_prefix_cache")
        return {"reset": True, "device_blocks_cleared": cleared}

    @app.get("/version")
    async def version() -> dict:
        return {"version": openinfer.__version__}


def _install_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return serving.detokenize(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await serving.completions(body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        return await serving.chat(body)
