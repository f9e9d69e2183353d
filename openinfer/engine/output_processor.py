"""Turns engine-core outputs (token ids) into user-facing RequestOutputs.

Runs in the front end (offline LLM now, the API server later): detokenizes
incrementally, applies stop strings (asking the core to abort the request), fills
decoded tokens into logprobs, and gathers the n samples of a request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from openinfer.engine.detokenizer import IncrementalDetokenizer
from openinfer.engine.outputs import EngineCoreOutput
from openinfer.outputs import (
    CompletionOutput,
    PositionLogprobs,
    PromptSources,
    RequestMetrics,
    RequestOutput,
)
from openinfer.sampling_params import SamplingParams


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_streamed: int = 0
    """Tokens already sent in deltas (streaming requests)."""
    streamed_finish: bool = False

    def delta(self) -> CompletionOutput | None:
        """What is new since the last delta, or None if nothing is."""
        finished = self.finish_reason is not None
        if self.num_streamed == len(self.token_ids) and (self.streamed_finish or not finished):
            return None
        start, self.num_streamed = self.num_streamed, len(self.token_ids)
        self.streamed_finish = finished
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_delta(finished=finished),
            token_ids=self.token_ids[start:],
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class ProcessedOutputs:
    finished: list[RequestOutput] = field(default_factory=list)
    """Requests that ended, each with its whole output."""
    deltas: list[RequestOutput] = field(default_factory=list)
    """For streaming requests: what each one gained this step (text, tokens, logprobs)."""
    to_abort: list[str] = field(default_factory=list)
    """Core request ids ended here by a stop string: the core must drop them."""


@dataclass(frozen=True)
class InFlight:
    """A request the front end is serving: its size so far."""
    request_id: str
    num_prompt_tokens: int
    num_generated_tokens: int
    arrival_time: float
    params: SamplingParams


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _Sample]
    """By engine-core request id (one per parallel sample)."""
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics
    num_unfinished: int = 0
    stream: bool = False
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int | None = None
    prompt_sources: PromptSources | None = None
    pinned_tokens: list[int] | None = None
    kv_transfer_params: dict | None = None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float,
                    stream: bool = False) -> None:
        samples = {
            child_id: _Sample(i, IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids),
                              logprobs=[] if params.logprobs is not None else None)
            for i, child_id in enumerate(child_ids)
        }
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] * len(prompt_token_ids)
        self._requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, samples, prompt_logprobs,
            RequestMetrics(arrival_time=arrival_time), num_unfinished=len(samples), stream=stream)
        for child_id in child_ids:
            self._parent_of[child_id] = request_id

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def in_flight(self) -> list[InFlight]:
        """The requests not yet finished, oldest first (what llama.cpp's /slots lists)."""
        return [InFlight(state.request_id, len(state.prompt_token_ids),
                         sum(len(s.token_ids) for s in state.samples.values()),
                         state.metrics.arrival_time, state.params)
                for state in sorted(self._requests.values(),
                                    key=lambda state: state.metrics.arrival_time)]

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        to_abort, finished = result.to_abort, result.finished
        streaming: dict[str, _RequestState] = {}
        now = time.monotonic()
        for out in outputs:
            parent_id = self._parent_of.get(out.request_id)
            if parent_id is None:
                continue  # already finished by a stop string
            state = self._requests[parent_id]
            if state.stream:
                streaming[parent_id] = state
            sample = state.samples[out.request_id]
            if state.num_cached_tokens is None and (out.new_token_ids or out.finish_reason):
                state.num_cached_tokens = out.num_cached_tokens
                state.prompt_sources = out.prompt_sources
                state.pinned_tokens = out.pinned_tokens
            if out.kv_transfer_params is not None:  # the offline API's (and vLLM's) plain dict
                state.kv_transfer_params = out.kv_transfer_params.to_dict()
            if out.first_scheduled_time is not None:  # the earliest of its samples'
                scheduled = state.metrics.first_scheduled_time
                state.metrics.first_scheduled_time = out.first_scheduled_time if scheduled is None \
                    else min(scheduled, out.first_scheduled_time)
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                self._store_prompt_logprobs(state, *out.prompt_logprobs)
            if out.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                stop = self._append_tokens(sample, out)
                if stop is not None and out.finish_reason is None:
                    sample.finish_reason, sample.stop_reason = "stop", stop
                    to_abort.append(out.request_id)
            if out.finish_reason is not None and sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if sample.finish_reason is None:
                continue
            del self._parent_of[out.request_id]
            state.num_unfinished -= 1
            if state.num_unfinished == 0:
                state.metrics.finished_time = now
                finished.append(self._to_output(state))
                del self._requests[parent_id]
        for state in streaming.values():
            deltas = [d for s in state.samples.values() if (d := s.delta()) is not None]
            if deltas:
                result.deltas.append(self._to_output(state, deltas))
        return result

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """End a request from outside; returns its final output and its core request ids."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None, []
        child_ids = [cid for cid, s in state.samples.items() if s.finish_reason is None]
        for cid in child_ids:
            state.samples[cid].finish_reason = "abort"
            self._parent_of.pop(cid, None)
        state.metrics.finished_time = time.monotonic()
        return self._to_output(state), child_ids

    def _append_tokens(self, sample: _Sample, out: EngineCoreOutput) -> str | None:
        before = len(sample.token_ids)
        sample.token_ids.extend(out.new_token_ids)
        if sample.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs:
                sample.logprobs.append(self._decode_logprobs(sample.detokenizer, entry))
        stop = sample.detokenizer.update(out.new_token_ids)
        kept = sample.detokenizer.num_tokens_at_stop
        if stop is not None and kept is not None and kept < len(sample.token_ids):
            # A verified run went past the stop string: its tail is not output.
            del sample.token_ids[max(kept, before):]
            if sample.logprobs is not None:
                del sample.logprobs[max(kept, before):]
        return stop

    def _store_prompt_logprobs(self, state: _RequestState, start: int,
                               entries: list[PositionLogprobs]) -> None:
        # Idempotent: a preempted request recomputes (and resends) the same positions.
        detokenizer = next(iter(state.samples.values())).detokenizer
        for i, entry in enumerate(entries):
            state.prompt_logprobs[start + i] = self._decode_logprobs(detokenizer, entry)

    def _decode_logprobs(self, detokenizer: IncrementalDetokenizer,
                         entry: PositionLogprobs) -> PositionLogprobs:
        if self.tokenizer is None:
            return entry
        for token_id, logprob in entry.items():
            logprob.decoded_token = detokenizer.decode_token(token_id)
        return entry

    def _to_output(self, state: _RequestState,
                   deltas: list[CompletionOutput] | None = None) -> RequestOutput:
        finished = state.num_unfinished == 0
        if deltas is not None:
            # A streaming step: only what is new. Prompt logprobs ride on the first delta: a
            # sample's first token means its prompt was fully prefilled (and scored).
            prompt_logprobs = None
            if not state.prompt_logprobs_sent:
                prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
            return RequestOutput(
                request_id=state.request_id, prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids, outputs=deltas,
                prompt_logprobs=prompt_logprobs, finished=finished, metrics=state.metrics,
                num_cached_tokens=state.num_cached_tokens or 0,
                prompt_sources=state.prompt_sources, pinned_tokens=state.pinned_tokens,
                kv_transfer_params=state.kv_transfer_params if finished else None)
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.output_text,
                token_ids=list(s.token_ids),
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in sorted(state.samples.values(), key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            prompt_logprobs=state.prompt_logprobs,
            finished=True,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens or 0,
            prompt_sources=state.prompt_sources,
            pinned_tokens=state.pinned_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )
