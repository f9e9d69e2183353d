"""The OpenAI API's handlers over one AsyncLLM: what a route does once FastAPI has parsed its
body. ``OpenAIServing`` holds what every request shares (the engine, the served name, the
prompt renderer, the tool and reasoning parsers, the sampling defaults) and the checks every
generation passes (``check_model``, ``tokenized``); the routes (server/app.py) and the
Anthropic Messages API (server/anthropic_api.py) call it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from openinfer.engine.async_llm import AsyncLLM
from openinfer.engine.core_client import EngineDeadError
from openinfer.outputs import CompletionOutput, PromptSources, RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.server.answer_ids import AnswerIds, ChatEncoding
from openinfer.server.chat_output import ChatOutput, ToolPlan, plan_tools
from openinfer.server.exceptions import APIError
from openinfer.server.limits import PIN_OWNER, salted
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
from openinfer.server.reasoning import ReasoningParser, get_reasoning_parser
from openinfer.server.streaming import (
    DONE,
    chat_logprobs,
    completion_logprobs,
    final,
    merged,
    sse,
    total_sources,
    usage,
    with_error_event,
)
from openinfer.server.tool_parsers import ToolParser, get_tool_parser

logger = logging.getLogger(__name__)


class OpenAIServing:
    """``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``, ``/detokenize`` and
    ``/v1/models`` over ``llm``. ``sampling_defaults`` fill the sampling fields a request
    leaves unset; ``tool_call_parser``, ``enable_auto_tool_choice`` and ``reasoning_parser``
    are vLLM's serve options of those names (server/chat_output.py)."""

    def __init__(self, llm: AsyncLLM, model_name: str, renderer: PromptRenderer, *,
                 sampling_defaults: dict[str, Any] | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None,
                 answer_ids_cache_tokens: int = 0,
                 tool_call_kv_retention_s: float = 0.0) -> None:
        self.llm = llm
        self.model_name = model_name
        self.renderer = renderer
        self.sampling_defaults = sampling_defaults
        self.max_model_len = llm.config.model.max_model_len
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser: ToolParser | None = (get_tool_parser(tool_call_parser)
                                               if tool_call_parser else None)
        self.reasoning: ReasoningParser | None = (
            get_reasoning_parser(reasoning_parser, llm.tokenizer) if reasoning_parser else None)
        # (With prefix caching on or off alike: what a prompt runs as must not depend on it.)
        self.answer_ids = AnswerIds(llm.tokenizer, answer_ids_cache_tokens)
        """Generated answers' ids, for the conversations that resend them (answer_ids.py)."""
        caching = llm.config.cache.enable_prefix_caching
        self.tool_call_kv_retention_s = tool_call_kv_retention_s if caching else 0.0
        self._retaining: set[asyncio.Task] = set()

    def retain(self, token_ids: list[int], cache_salt: str | None, owner: str | None) -> None:
        """An answer ended in a tool call: pin the conversation's KV (its prompt and answer)
        for ``--tool-call-kv-retention`` seconds, so the agent's context waits in the host
        and file tiers while the client runs the tool and comes back. In the background: the
        answer is not held up by it, and a failure only loses the retention."""
        if self.tool_call_kv_retention_s <= 0:
            return

        async def pin() -> None:
            try:
                await self.llm.client.call("pin_tokens", token_ids, cache_salt,
                                           self.tool_call_kv_retention_s, owner)
            except Exception as e:  # an engine gone, a call timed out
                logger.warning("tool-call KV retention not taken: %s", e)
        task = asyncio.create_task(pin())
        self._retaining.add(task)
        task.add_done_callback(self._retaining.discard)

    def chat_encoding(self, cache_salt: str | None) -> ChatEncoding:
        """How a chat request's rendered prompt becomes ids (under its tenant's salt)."""
        return ChatEncoding(self.answer_ids, salted(cache_salt))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model",
                           code="model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "openinfer",
            "max_model_len": self.max_model_len}]}

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        tokenizer = self.llm.tokenizer
        if body.messages is not None:  # as a chat runs it: resent answers as their ids
            tokens = self.renderer.openai_chat(body, encode=self.chat_encoding(None))
        elif body.prompt is not None and tokenizer is not None:
            tokens = tokenizer.encode(body.prompt,
                                      add_special_tokens=body.add_special_tokens is not False)
        else:
            raise APIError(400, "give a prompt or messages (and a model with a tokenizer)", "prompt")
        result = {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}
        if body.return_token_strs:
            result["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return result

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < self.llm.inputs.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
        return {"prompt": self.llm.tokenizer.decode(body.tokens)}

    def tokenized(self, prompt: str | list[int], params: SamplingParams,
                  constraint_source: str | None = None,
                  prompt_param: str = "prompt") -> tuple[str | None, list[int]]:
        """The prompt as the engine runs it; checks it and ``params`` (400s). The output
        constraint is compiled here: an invalid one is a 400 naming
        ``constraint_source``, the field the client used. A prompt too long for the model
        is a 400 naming ``prompt_param`` (``messages`` for chats)."""
        llm, max_model_len = self.llm, self.max_model_len
        if llm.client.dead_reason is not None:  # fail before a stream sends its 200
            raise EngineDeadError(llm.client.dead_reason)
        params.cache_salt = salted(params.cache_salt)  # within the API key's, if so salted
        params.cache_pin_owner = PIN_OWNER.get()
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

    def keep_tool_markers(self, params: SamplingParams, plan: ToolPlan) -> None:
        """Under auto tool choice, markers that are special tokens (DeepSeek's, Mistral's)
        must reach the parser: they are kept in the output text."""
        if plan.mode == "auto" and self.tool_parser is not None and self.llm.tokenizer is not None:
            special = is_special_token(self.llm.tokenizer, self.tool_parser.start)
            params.skip_special_tokens = params.skip_special_tokens and not special

    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        # echo + logprobs scores the prompt too (how eval harnesses get loglikelihoods).
        score_prompt = body.echo and body.logprobs is not None
        params = body.sampling_params(body.max_tokens, body.logprobs, self.sampling_defaults,
                                      prompt_logprobs=body.logprobs if score_prompt else None)
        source = body.structured_outputs_params()[1]
        prompts = [(p.text, self.tokenized(p.token_ids, params, source)[1])
                   for p in self.renderer.completion(body.prompt, body.add_special_tokens)]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        header = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                  "model": self.model_name}
        choices = _CompletionChoices(prompts, params.n, body.echo, score_prompt,
                                     self.llm.tokenizer)
        streams = [self.llm.generate(ids, params, f"{request_id}-{i}") for i, (_, ids) in
                   enumerate(prompts)]
        if body.stream:
            return StreamingResponse(
                with_error_event(_completion_events(streams, header, choices, body.include_usage)),
                media_type="text/event-stream")
        finals = await asyncio.gather(*(final(s) for s in streams))
        return JSONResponse({**header, "choices": [
            choices.choice(i, c, choices.echo_of(i, out))
            for i, out in enumerate(finals) for c in out.outputs],
            "usage": usage(choices.prompt_tokens,
                           sum(len(c.token_ids) for out in finals for c in out.outputs),
                           sum(out.num_cached_tokens for out in finals),
                           total_sources([out.prompt_sources for out in finals])),
            **kv_transfer_field(finals[0])})

    def prepare_chat(self, body: ChatCompletionRequest, prompt_param: str = "messages") -> PreparedChat:
        """A chat request checked and rendered: its prompt ids (answers it resends spliced
        in as generated), parameters, and how its output reads. ``prompt_param``: the field
        a too-long prompt is named by (the Responses API's ``input``)."""
        self.check_model(body.model)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          self.tool_call_parser, self.enable_auto_tool_choice)
        encoding = self.chat_encoding(body.cache_salt)
        token_ids = self.renderer.openai_chat(body, tools=plan.tools or None, encode=encoding)
        # What the prompt's end says about reasoning (did the template open or close it?).
        prompt_tail = (self.llm.tokenizer.decode(token_ids[-16:]) if self.reasoning is not None
                       else None)
        params, source = self._chat_params(body, plan, prompt_tail)
        _, token_ids = self.tokenized(token_ids, params, source, prompt_param)
        choices = ChatChoices(plan, self.tool_parser, self.reasoning, prompt_tail,
                               bool(body.logprobs), body.top_logprobs or 0)
        return PreparedChat(token_ids, params, encoding.text, choices)

    def generate_chat(self, chat: PreparedChat, request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for a prepared chat (its answer remembered at the end)."""
        return self.answer_ids.remembering(self.llm.generate(chat.token_ids, chat.params, request_id),
                                           chat.prompt_text, chat.params.cache_salt)

    def retain_after(self, chat: PreparedChat, ids: list[int]) -> None:
        """``retain`` the chat's prompt and an answer of it (``ids``) that called a tool."""
        self.retain(chat.token_ids + ids, chat.params.cache_salt, chat.params.cache_pin_owner)

    async def chat(self, body: ChatCompletionRequest):
        chat = self.prepare_chat(body)
        token_ids, choices = chat.token_ids, chat.choices
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        header = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                  "model": self.model_name}
        stream = self.generate_chat(chat, request_id)
        if body.stream:
            return StreamingResponse(
                with_error_event(_chat_events(
                    stream, header, choices, body.include_usage, token_ids,
                    body.return_token_ids, lambda ids: self.retain_after(chat, ids))),
                media_type="text/event-stream")
        whole = await final(stream)
        ids = body.return_token_ids
        answers = [choices.whole(c) for c in whole.outputs]
        for c, answer in zip(whole.outputs, answers):
            if answer["finish_reason"] == "tool_calls":
                self.retain_after(chat, c.token_ids)
        return JSONResponse({**header, "choices": [
            {**answer, **({"token_ids": c.token_ids} if ids else {})}
            for c, answer in zip(whole.outputs, answers)],
            "usage": usage(len(token_ids), sum(len(c.token_ids) for c in whole.outputs),
                           whole.num_cached_tokens, whole.prompt_sources),
            **({"prompt_token_ids": token_ids} if ids else {}), **kv_transfer_field(whole)})

    def _chat_params(self, body: ChatCompletionRequest, plan: ToolPlan,
                     prompt_tail: str | None) -> tuple[SamplingParams, str | None]:
        """A chat's sampling parameters, and the field its output constraint came from: the
        client's structured outputs, or the tools a forced tool call constrains to."""
        top = body.top_logprobs or 0
        fields, source = body.structured_outputs_params()
        if plan.constraint is not None:
            if fields is not None:
                raise APIError(400, f"{source} cannot be combined with a forced tool call "
                               f"(tool_choice {body.tool_choice!r})", source)
            fields, source = dict(plan.constraint), "tools"
        reasoning = self.reasoning
        if fields is not None and reasoning is not None and not reasoning.prompt_closes_reasoning(
                prompt_tail):
            fields["start_after_token_ids"] = reasoning.end_token_ids()
        params = body.sampling_params(body.max_completion_tokens or body.max_tokens,
                                      top if body.logprobs else None, self.sampling_defaults,
                                      structured_outputs=structured_param(fields, source))
        self.keep_tool_markers(params, plan)
        return params, source


@dataclass
class PreparedChat:
    """A chat ready for the engine (``OpenAIServing.prepare_chat``)."""
    token_ids: list[int]
    params: SamplingParams
    prompt_text: str
    """The rendered prompt (the answer-ids cache keys answers by it)."""
    choices: ChatChoices


@dataclass
class _CompletionChoices:
    """A completion request's choices: numbered across its prompts, each led by its prompt
    when echoed (with the prompt's scored tokens when asked)."""
    prompts: list[tuple[str | None, list[int]]]
    n: int
    echo: bool
    score_prompt: bool
    tokenizer: Any

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    def echo_of(self, i: int, out: RequestOutput) -> tuple[str, list[tuple[int, Any]]]:
        """The prompt text a choice starts with, and its scored tokens when asked."""
        if not self.echo:
            return "", []
        text, ids = self.prompts[i]
        text = text if text is not None else self.tokenizer.decode(ids)
        scored = list(zip(ids, out.prompt_logprobs)) if self.score_prompt else []
        return text, scored

    def choice(self, i: int, c: CompletionOutput, echo: tuple[str, list]) -> dict:
        text, scored = echo
        return {"index": i * self.n + c.index, "text": text + c.text,
                "logprobs": completion_logprobs(c, scored, self.tokenizer),
                "finish_reason": c.finish_reason}


async def _completion_events(streams: list[AsyncIterator[RequestOutput]], header: dict,
                             choices: _CompletionChoices,
                             include_usage: bool) -> AsyncIterator[str]:
    completion_tokens = 0
    firsts: dict[int, RequestOutput] = {}  # per prompt: the delta with its logprobs
    cached: dict[int, int] = {}
    sources: dict[int, PromptSources | None] = {}
    echoed: set[tuple[int, int]] = set()
    async for i, delta in merged(streams):
        firsts.setdefault(i, delta)
        cached[i] = delta.num_cached_tokens
        sources[i] = delta.prompt_sources or sources.get(i)
        for c in delta.outputs:
            completion_tokens += len(c.token_ids)
            echo: tuple[str, list] = ("", [])
            if (i, c.index) not in echoed:  # the prompt leads a sample's first chunk
                echo = choices.echo_of(i, firsts[i])
                echoed.add((i, c.index))
            yield sse({**header, "choices": [choices.choice(i, c, echo)]})
    if include_usage:
        yield sse({**header, "choices": [],
                   "usage": usage(choices.prompt_tokens, completion_tokens, sum(cached.values()),
                                  total_sources(list(sources.values())))})
    yield DONE


@dataclass
class ChatChoices:
    """How a chat's choices read: each sample's text parsed into an assistant message (tool
    calls, reasoning), with its logprobs when asked."""
    plan: ToolPlan
    tool_parser: ToolParser | None
    reasoning: ReasoningParser | None
    prompt_tail: str | None
    logprobs: bool
    top: int

    def output(self) -> ChatOutput:
        return ChatOutput(self.plan, self.tool_parser, self.reasoning, self.prompt_tail)

    def finish_reason(self, c: CompletionOutput, out: ChatOutput) -> str | None:
        if c.finish_reason == "stop" and out.has_tool_calls and self.plan.mode != "named":
            return "tool_calls"
        return c.finish_reason

    def logprobs_of(self, c: CompletionOutput) -> dict | None:
        return chat_logprobs(c, self.top) if self.logprobs else None

    def whole(self, c: CompletionOutput) -> dict:
        out = self.output()
        return {"index": c.index, "message": out.message(c.text),
                "logprobs": self.logprobs_of(c), "finish_reason": self.finish_reason(c, out)}


async def _chat_events(stream: AsyncIterator[RequestOutput], header: dict, choices: ChatChoices,
                       include_usage: bool, prompt_ids: list[int],
                       return_token_ids: bool = False,
                       on_tool_calls: Callable[[list[int]], None] | None = None,
                       ) -> AsyncIterator[str]:
    """The chunks of a streamed chat; with ``return_token_ids`` (vLLM's), the first chunk
    carries ``prompt_token_ids`` and each delta's first chunk its ``token_ids``.
    ``on_tool_calls`` gets the ids of each sample that ends in tool calls."""
    chunk = {**header, "object": "chat.completion.chunk"}
    outs: dict[int, ChatOutput] = {}
    completion_tokens = cached = 0
    sources: PromptSources | None = None

    def event(index: int, delta: dict, finish: str | None = None,
              logprobs: dict | None = None, **extra: Any) -> str:
        return sse({**chunk, "choices": [{"index": index, "delta": delta,
                                          "finish_reason": finish, "logprobs": logprobs,
                                          **extra}]})
    first = {"prompt_token_ids": prompt_ids} if return_token_ids else {}
    ids: dict[int, list[int]] = {}
    async for _, delta in merged([stream]):
        cached = delta.num_cached_tokens
        sources = delta.prompt_sources or sources
        for c in delta.outputs:
            completion_tokens += len(c.token_ids)
            ids.setdefault(c.index, []).extend(c.token_ids)
            if c.index not in outs:
                outs[c.index] = choices.output()
                yield sse({**chunk, "choices": [{"index": c.index, "finish_reason": None,
                                                 "logprobs": None, "delta": {
                                                     "role": "assistant", "content": ""}}],
                           **first})
                first = {}
            out = outs[c.index]
            pieces = out.feed(c.text)
            if c.finish_reason is not None:
                pieces += out.finish()
            logprobs = choices.logprobs_of(c)
            if (logprobs is not None or return_token_ids and c.token_ids) and not pieces:
                pieces = [{"content": ""}]
            delta_ids = {"token_ids": c.token_ids} if return_token_ids else {}
            for i, piece in enumerate(pieces):
                yield event(c.index, piece, None, logprobs if i == 0 else None,
                            **(delta_ids if i == 0 else {}))
            if c.finish_reason is not None:
                finish = choices.finish_reason(c, out)
                if finish == "tool_calls" and on_tool_calls is not None:
                    on_tool_calls(ids[c.index])
                yield event(c.index, {}, finish)
    if include_usage:
        yield sse({**chunk, "choices": [],
                   "usage": usage(len(prompt_ids), completion_tokens, cached, sources)})
    yield DONE
