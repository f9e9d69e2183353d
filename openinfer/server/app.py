"""The OpenAI-compatible HTTP API over an AsyncLLM (engine core in its own process)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

import openinfer
from openinfer.engine.async_llm import AsyncLLM, RequestFailedError
from openinfer.engine.core_client import EngineDeadError
from openinfer.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.server.anthropic_api import install_anthropic_routes
from openinfer.server.chat_output import ChatOutput, plan_tools
from openinfer.server.disconnect import CancelOnDisconnect
from openinfer.server.error_bodies import document_errors, error_body
from openinfer.server.errors import install_error_handlers
from openinfer.server.exceptions import APIError
from openinfer.server.limits import Admission, EngineLoad, ServerLimits, salted
from openinfer.server.metrics import ServerMetrics
from openinfer.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    kv_transfer_field,
    structured_error,
    structured_param,
)
from openinfer.server.prompt import PromptRenderer, is_special_token
from openinfer.server.reasoning import get_reasoning_parser
from openinfer.server.tool_parsers import get_tool_parser


def build_app(llm: AsyncLLM, served_model_name: str, limits: ServerLimits | None = None, *,
              sampling_defaults: dict[str, Any] | None = None,
              on_ready: Callable[[], None] | None = None, metrics_prefix: str = "openinfer",
              metrics_engine: str = "0", tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None,
              chat_template_content_format: str = "auto") -> FastAPI:
    """The API over ``llm``. ``sampling_defaults`` fill the sampling fields a request leaves
    unset (the model's generation config under ``--generation-config auto``); ``on_ready``
    runs once the engine has loaded and requests are served. /metrics names its series
    ``<metrics_prefix>:...`` and labels them ``engine=metrics_engine`` (server/metrics.py).
    ``tool_call_parser``, ``enable_auto_tool_choice`` and ``reasoning_parser`` are vLLM's
    serve options of those names (server/chat_output.py), ``chat_template_content_format``
    too (server/chat_content.py)."""
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
    max_model_len = llm.config.model.max_model_len
    metrics = ServerMetrics.for_llm(llm, served_model_name, prefix=metrics_prefix,
                                    engine=metrics_engine)
    # `--chat-template` is already the tokenizer's own (cli.py sets it), as on the router.
    renderer = PromptRenderer(llm.tokenizer, content_format=chat_template_content_format)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model",
                           code="model_not_found")

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

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": 0, "owned_by": "openinfer",
            "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if body.messages is not None:
            tokens = renderer.openai_chat(body)
        elif body.prompt is not None and llm.tokenizer is not None:
            tokens = llm.tokenizer.encode(body.prompt,
                                          add_special_tokens=body.add_special_tokens is not False)
        else:
            raise APIError(400, "give a prompt or messages (and a model with a tokenizer)", "prompt")
        result = {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}
        if body.return_token_strs:
            result["token_strs"] = llm.tokenizer.convert_ids_to_tokens(tokens)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < llm.inputs.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    def tokenized(prompt: str | list[int], params: SamplingParams,
                  constraint_source: str | None = None,
                  prompt_param: str = "prompt") -> tuple[str | None, list[int]]:
        """The prompt as the engine runs it; checks it and ``params`` (400s). The output
        constraint is compiled here: an invalid one is a 400 naming
        ``constraint_source``, the field the client used. A prompt too long for the model
        is a 400 naming ``prompt_param`` (``messages`` for chats)."""
        if llm.client.dead_reason is not None:  # fail before a stream sends its 200
            raise EngineDeadError(llm.client.dead_reason)
        params.cache_salt = salted(params.cache_salt)  # within the API key's, if so salted
        if not isinstance(prompt, str):
            # Checked here, not left to the engine's ValueError, to carry OpenAI's code as the
            # max_tokens check below does (clients tell an overflow from other 400s by it).
            num_tokens = len(llm.inputs.truncate(prompt, params))
            if num_tokens >= max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} "
                               f"tokens; the prompt has {num_tokens}, which leaves no room to "
                               "generate.", prompt_param, code="context_length_exceeded")
        try:  # tokenized, truncated, checked
            text, token_ids = llm.inputs.process(prompt, params)
        except ValueError as e:
            if str(e).startswith("structured_outputs"):
                raise structured_error(e, constraint_source) from None
            raise
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; "
                           f"the prompt has {len(token_ids)} and max_tokens asks for "
                           f"{params.max_tokens}.", "max_tokens", code="context_length_exceeded")
        return text, token_ids

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        # echo + logprobs scores the prompt too (how eval harnesses get loglikelihoods).
        score_prompt = body.echo and body.logprobs is not None
        params = body.sampling_params(body.max_tokens, body.logprobs, sampling_defaults,
                                      prompt_logprobs=body.logprobs if score_prompt else None)
        source = body.structured_outputs_params()[1]
        prompts = [(p.text, tokenized(p.token_ids, params, source)[1])
                   for p in renderer.completion(body.prompt, body.add_special_tokens)]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        header = {"id": request_id, "object": "text_completion", "created": created,
                  "model": served_model_name}

        def echo_of(i: int, out: RequestOutput) -> tuple[str, list[tuple[int, Any]]]:
            """The prompt text a choice starts with, and its scored tokens when asked."""
            if not body.echo:
                return "", []
            text, ids = prompts[i]
            text = text if text is not None else llm.tokenizer.decode(ids)
            scored = list(zip(ids, out.prompt_logprobs)) if score_prompt else []
            return text, scored

        def choice(i: int, c: CompletionOutput, echo: tuple[str, list]) -> dict:
            text, scored = echo
            return {"index": i * params.n + c.index, "text": text + c.text,
                    "logprobs": _completion_logprobs(c, scored, llm.tokenizer),
                    "finish_reason": c.finish_reason}

        streams = [llm.generate(ids, params, f"{request_id}-{i}") for i, (_, ids) in
                   enumerate(prompts)]
        if body.stream:
            async def events() -> AsyncIterator[str]:
                completion_tokens = 0
                firsts: dict[int, RequestOutput] = {}  # per prompt: the delta with its logprobs
                cached: dict[int, int] = {}
                echoed: set[tuple[int, int]] = set()
                async for i, delta in _merged(streams):
                    firsts.setdefault(i, delta)
                    cached[i] = delta.num_cached_tokens
                    for c in delta.outputs:
                        completion_tokens += len(c.token_ids)
                        echo: tuple[str, list] = ("", [])
                        if (i, c.index) not in echoed:  # the prompt leads a sample's first chunk
                            echo = echo_of(i, firsts[i])
                            echoed.add((i, c.index))
                        yield _sse({**header, "choices": [choice(i, c, echo)]})
                if body.include_usage:
                    usage = _usage(sum(len(ids) for _, ids in prompts), completion_tokens,
                                   sum(cached.values()))
                    yield _sse({**header, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            return StreamingResponse(_with_error_event(events()), media_type="text/event-stream")

        finals = await asyncio.gather(*(_final(s) for s in streams))
        choices = [choice(i, c, echo_of(i, out))
                   for i, out in enumerate(finals) for c in out.outputs]
        usage = _usage(sum(len(ids) for _, ids in prompts),
                       sum(len(c.token_ids) for out in finals for c in out.outputs),
                       sum(out.num_cached_tokens for out in finals))
        return JSONResponse({**header, "choices": choices, "usage": usage,
                             **kv_transfer_field(finals[0])})

    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    reasoning = (get_reasoning_parser(reasoning_parser, llm.tokenizer)
                 if reasoning_parser else None)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = body.top_logprobs or 0
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          tool_call_parser, enable_auto_tool_choice)
        token_ids = renderer.openai_chat(body, tools=plan.tools or None)
        # What the prompt's end says about reasoning (did the template open or close it?).
        prompt_tail = (llm.tokenizer.decode(token_ids[-16:]) if reasoning is not None
                       else None)
        fields, source = body.structured_outputs_params()
        if plan.constraint is not None:
            if fields is not None:
                raise APIError(400, f"{source} cannot be combined with a forced tool call "
                               f"(tool_choice {body.tool_choice!r})", source)
            fields, source = dict(plan.constraint), "tools"
        if fields is not None and reasoning is not None and not reasoning.prompt_closes_reasoning(
                prompt_tail):
            fields["start_after_token_ids"] = reasoning.end_token_ids()
        params = body.sampling_params(max_tokens, top if body.logprobs else None,
                                      sampling_defaults,
                                      structured_outputs=structured_param(fields, source))
        if plan.mode == "auto" and tool_parser is not None and llm.tokenizer is not None:
            # Markers that are special tokens (DeepSeek's, Mistral's) must reach the parser.
            special = is_special_token(llm.tokenizer, tool_parser.start)
            params.skip_special_tokens = params.skip_special_tokens and not special
        _, token_ids = tokenized(token_ids, params, source, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        header = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                  "model": served_model_name}
        stream = llm.generate(token_ids, params, request_id)

        def output() -> ChatOutput:
            return ChatOutput(plan, tool_parser, reasoning, prompt_tail)

        def finish_reason(c: CompletionOutput, out: ChatOutput) -> str | None:
            if c.finish_reason == "stop" and out.has_tool_calls and plan.mode != "named":
                return "tool_calls"
            return c.finish_reason

        if body.stream:
            async def events() -> AsyncIterator[str]:
                chunk = {**header, "object": "chat.completion.chunk"}
                outs: dict[int, ChatOutput] = {}
                completion_tokens = cached = 0

                def event(index: int, delta: dict, finish: str | None = None,
                          logprobs: dict | None = None) -> str:
                    return _sse({**chunk, "choices": [{"index": index, "delta": delta,
                                                       "finish_reason": finish,
                                                       "logprobs": logprobs}]})
                async for _, delta in _merged([stream]):
                    cached = delta.num_cached_tokens
                    for c in delta.outputs:
                        completion_tokens += len(c.token_ids)
                        if c.index not in outs:
                            outs[c.index] = output()
                            yield event(c.index, {"role": "assistant", "content": ""})
                        out = outs[c.index]
                        pieces = out.feed(c.text)
                        if c.finish_reason is not None:
                            pieces += out.finish()
                        logprobs = _chat_logprobs(c, top) if body.logprobs else None
                        if logprobs is not None and not pieces:
                            pieces = [{"content": ""}]
                        for i, piece in enumerate(pieces):
                            yield event(c.index, piece, None, logprobs if i == 0 else None)
                        if c.finish_reason is not None:
                            yield event(c.index, {}, finish_reason(c, out))
                if body.include_usage:
                    yield _sse({**chunk, "choices": [],
                                "usage": _usage(len(token_ids), completion_tokens, cached)})
                yield "data: [DONE]\n\n"
            return StreamingResponse(_with_error_event(events()), media_type="text/event-stream")

        final = await _final(stream)
        choices = []
        for c in final.outputs:
            out = output()
            choices.append({"index": c.index, "message": out.message(c.text),
                            "logprobs": _chat_logprobs(c, top) if body.logprobs else None,
                            "finish_reason": finish_reason(c, out)})
        usage = _usage(len(token_ids), sum(len(c.token_ids) for c in final.outputs),
                       final.num_cached_tokens)
        return JSONResponse({**header, "choices": choices, "usage": usage,
                             **kv_transfer_field(final)})

    install_anthropic_routes(app, llm, served_model_name, check_model, renderer,
                             tokenized, _final, sampling_defaults or {}, tool_parser,
                             enable_auto_tool_choice)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(get_openapi(
                title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Drain a delta stream into one whole output per sample."""
    merged: dict[int, CompletionOutput] = {}
    prompt_logprobs = None
    async with contextlib.aclosing(stream):
        async for delta in stream:
            for c in delta.outputs:
                whole = merged.setdefault(c.index, CompletionOutput(
                    c.index, "", [], [] if c.logprobs is not None else None))
                whole.text += c.text
                whole.token_ids += c.token_ids
                if c.logprobs is not None:
                    whole.logprobs += c.logprobs
                whole.finish_reason, whole.stop_reason = c.finish_reason, c.stop_reason
            prompt_logprobs = prompt_logprobs or delta.prompt_logprobs  # on the first delta
            last = delta
    last.prompt_logprobs = prompt_logprobs
    last.outputs = [merged[i] for i in sorted(merged)]
    return last



async def _merged(streams: list[AsyncIterator[RequestOutput]],
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several delta streams as they produce; closing this closes them all
    (so a client that disconnects aborts every one of its requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    await queue.put((i, delta))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose engine dies mid-way ends with an error event, not a cut connection."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except EngineDeadError as e:
            yield _sse(error_body(f"the engine is unavailable: {e}", "service_unavailable",
                                  code="engine_dead"))
            yield "data: [DONE]\n\n"
        except RequestFailedError as e:
            yield _sse(error_body(str(e), "service_unavailable", code=e.code))
            yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage, plus DeepSeek's cache hit/miss split of the prompt."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "prompt_cache_hit_tokens": cached_tokens,
            "prompt_cache_miss_tokens": prompt_tokens - cached_tokens}


def _completion_logprobs(c: CompletionOutput, prompt: list[tuple[int, PositionLogprobs | None]],
                         tokenizer) -> dict | None:
    """OpenAI's legacy logprobs: echoed prompt tokens first (the very first has no logprob)."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entry in [*prompt, *zip(c.token_ids, c.logprobs)]:
        text = _token_text(entry, token_id) if entry is not None else tokenizer.decode([token_id])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(entry[token_id].logprob if entry is not None else None)
        top.append({_token_text(entry, t): lp.logprob for t, lp in entry.items()}
                   if entry is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def _chat_logprobs(c: CompletionOutput, top: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({**_logprob_item(entry, token_id),
                        "top_logprobs": [_logprob_item(entry, t) for t, _ in ranked]})
    return {"content": content}


def _logprob_item(entry: PositionLogprobs, token_id: int) -> dict:
    text = _token_text(entry, token_id)
    return {"token": text, "logprob": entry[token_id].logprob, "bytes": list(text.encode())}


def _token_text(entry: PositionLogprobs, token_id: int) -> str:
    return entry[token_id].decoded_token or ""
