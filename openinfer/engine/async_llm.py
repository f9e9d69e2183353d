"""The asyncio engine the API server runs on: front end here, engine core in its own process.

    llm = AsyncLLM(model_path, **engine_options); await llm.start()
    async for delta in llm.generate(prompt, SamplingParams(...), request_id):
        ...   # RequestOutput with only what is new; the last has finished=True

Tokenization, validation and detokenization run in this process; the core only
sees token ids. A consumer that stops iterating (a client that went away) aborts
its request, so the core frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from openinfer.engine.core_client import EngineCoreClient
from openinfer.engine.core_launch import CoreLaunch
from openinfer.engine.input_processor import InputProcessor, PromptInput, admit
from openinfer.engine.output_processor import OutputProcessor
from openinfer.engine.outputs import EngineCoreOutput
from openinfer.engine_args import create_engine_config
from openinfer.outputs import CompletionOutput, RequestOutput
from openinfer.sampling_params import SamplingParams


class RequestFailedError(RuntimeError):
    """The engine ended a request without an answer (a KV pull failed under the 'fail'
    policy); the engine itself is fine."""

    status, code = 503, "request_failed"


class RequestTimeoutError(RequestFailedError):
    """The request ran past the server's --request-timeout and was aborted (its blocks
    freed): nobody would read the rest in time."""

    status, code = 504, "request_timeout"

class AsyncLLM:
    def __init__(self, model: str, max_engine_restarts: int = 0,
                 request_timeout_s: float | None = None, core_launch: CoreLaunch | None = None,
                 **engine_options) -> None:
        """``max_engine_restarts``: how often within 10 minutes a dead engine-core process is
        started again (0: never; see EngineCoreClient). ``request_timeout_s``: a request
        still running after this long is aborted (RequestTimeoutError). ``core_launch``: the
        engine-core interpreter, started before this process imported the engine
        (openinfer.engine.core_launch); cancelled if these options are refused."""
        self.request_timeout_s = request_timeout_s
        try:
            self.config = create_engine_config(model, **engine_options)
            self.inputs = InputProcessor(self.config)
        except BaseException:
            if core_launch is not None:
                core_launch.cancel()
            raise
        self.tokenizer = self.inputs.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        # The resolved local path: the engine process must not resolve (or download) again.
        self.client = EngineCoreClient({"model": self.config.model.path, **engine_options},
                                       max_restarts=max_engine_restarts, launch=core_launch)
        self._core_outputs: asyncio.Queue[EngineCoreOutput | Exception] = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._pump: asyncio.Task | None = None
        self.observers: list[Callable[[RequestOutput], None]] = []
        """Called with every delta and with the final output of an aborted request (metrics)."""
        self.request_observers: list[Callable[[str, SamplingParams], None]] = []
        """Called with a request's id and sampling params once it is accepted, before any of
        its outputs reach ``observers`` (metrics)."""

    async def start(self) -> None:
        await self.client.start()
        self._pump = asyncio.create_task(self._pump_outputs())

    async def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await self.client.shutdown()

    async def generate(self, prompt: PromptInput, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's progress. Bad input raises ValueError before anything is queued."""
        text, token_ids = self.inputs.process(prompt, params)
        timeout = self.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        admitted = admit(self.output_processor, request_id, text, token_ids, params, stream=True)
        stream: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = stream
        for observe in self.request_observers:
            observe(request_id, params)
        try:
            for child_id, child_params in admitted.children:
                self.client.add_request(child_id, token_ids, child_params,
                                        admitted.arrival_time, queue=self._core_outputs)
            while True:
                if deadline is None:
                    item = await stream.get()
                else:
                    try:
                        item = await asyncio.wait_for(stream.get(), deadline - time.monotonic())
                    except TimeoutError:
                        raise RequestTimeoutError(
                            f"the request ran past the server's request timeout ({timeout:g} s) "
                            "and was aborted") from None
                if isinstance(item, Exception):
                    raise item
                failed = [c for c in item.outputs if c.finish_reason == "error"] if item.finished else []
                if failed:
                    raise RequestFailedError(_failure(failed[0].stop_reason))
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request early (its consumer is gone); the core frees its blocks."""
        self._streams.pop(request_id, None)
        final, child_ids = self.output_processor.abort(request_id)
        self.client.abort(child_ids)
        if final is not None:
            # As a delta: the samples it ended, with no new tokens.
            final.outputs = [CompletionOutput(c.index, "", [], finish_reason="abort")
                             for c in final.outputs if c.finish_reason == "abort"]
            for observe in self.observers:
                observe(final)

    async def _pump_outputs(self) -> None:
        """Feed core outputs through the output processor to each request's stream."""
        while True:
            batch = [await self._core_outputs.get()]
            while not self._core_outputs.empty():
                batch.append(self._core_outputs.get_nowait())
            errors = [o for o in batch if isinstance(o, Exception)]
            if errors:
                for stream in self._streams.values():
                    stream.put_nowait(errors[0])
                continue
            processed = self.output_processor.process(batch)  # type: ignore[arg-type]
            if processed.to_abort:
                self.client.abort(processed.to_abort)
            for delta in processed.deltas:
                for observe in self.observers:
                    observe(delta)
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put_nowait(delta)
                    if delta.finished:
                        del self._streams[delta.request_id]


def _failure(stop_reason: object) -> str:
    """Why the engine ended a request with finish_reason "error"."""
    if stop_reason == "kv_transfer_failed":
        return ("the request's KV could not be pulled from its prefill instance (kv load "
                "failure policy: fail)")
    return f"the request failed in the engine: {stop_reason}"
