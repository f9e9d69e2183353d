"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens:

1. Running requests first, oldest (or highest priority) first: a decode gets 1
   token, an unfinished prompt gets its next chunk. When the KV pool has no room,
   the newest running request is preempted (its blocks freed, its tokens kept, to
   be recomputed later) until the older one fits, so the oldest request always
   makes progress and nothing is stuck or dropped.
2. Then, if nothing was preempted this step, waiting requests in queue order,
   while budget, ``max_num_seqs`` and blocks allow. A prompt longer than the
   remaining budget is chunked.

There is no separate prefill or decode phase: a request simply has
``num_computed_tokens`` of its ``num_tokens`` in the cache, and the step schedules
some of the rest. When a step computes its last token, the runner samples a new one.

Pure Python over block ids: no tensors here.
"""

from __future__ import annotations

import heapq
import itertools

from openinfer.config import SchedulerConfig
from openinfer.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from openinfer.engine.request import Request, RequestStatus
from openinfer.kv.kv_manager import KVCacheManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, Request]] = []  # heap by _order
        self._arrival_counter = itertools.count()
        self._arrival_index: dict[str, int] = {}
        self._known_to_runner: set[str] = set()
        self._dropped_since_last_step: set[str] = set()
        self.num_preemptions = 0

    # ---- queue state -----------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self.running)

    def _order(self, req: Request) -> tuple:
        """Sort key: smaller runs first and is preempted last."""
        priority = req.priority if self.config.policy == "priority" else 0
        return (priority, req.arrival_time, self._arrival_index[req.request_id])

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._arrival_index[req.request_id] = next(self._arrival_counter)
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self._waiting, (self._order(req), req))

    # ---- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._dropped_since_last_step)
        self._dropped_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        preempted = False

        self.running.sort(key=self._order)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
            while new_blocks is None:
                # The newest request yields its blocks; it may be this one.
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
            if new_blocks is None:
                break  # req itself was preempted; it was the last running request
            self._emit(req, n, new_blocks, out)
            budget -= n
            i += 1

        while (not preempted and self._waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self._waiting[0][1]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            new_blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
            if new_blocks is None:
                break  # head-of-line waits: later requests must not overtake it
            heapq.heappop(self._waiting)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(req, n, new_blocks, out)
            budget -= n
        return out

    def _emit(self, req: Request, n: int, new_blocks: list[list[int]],
              out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[req.request_id] = n
        if req.request_id in self._known_to_runner:
            out.cached_requests.append(
                CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens))
            return
        self._known_to_runner.add(req.request_id)
        out.new_requests.append(NewRequestData(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            stop_token_ids=req.stop_token_ids,
            block_ids=[list(t) for t in self.kv.block_table(req.request_id)],
            num_computed_tokens=req.num_computed_tokens,
        ))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's KV and queue it again; its tokens are recomputed later."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_in_runner(req.request_id, out.finished_request_ids)
        self._push_waiting(req)

    def _forget_in_runner(self, request_id: str, dropped: set[str]) -> None:
        if request_id in self._known_to_runner:
            self._known_to_runner.discard(request_id)
            dropped.add(request_id)

    # ---- after the step --------------------------------------------------------------

    def update_from_output(self, scheduled: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for request_id, n in scheduled.num_scheduled_tokens.items():
            req = self.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted during the step
            req.num_computed_tokens += n
            token = result.sampled_token_ids.get(request_id)
            prompt_logprobs = result.prompt_logprobs.get(request_id)
            if token is None and prompt_logprobs is None:
                continue
            status = None
            new_logprobs = None
            if token is not None:
                req.append_output_token(token)
                status = req.check_stop()
                if request_id in result.logprobs:
                    new_logprobs = [result.logprobs[request_id]]
            outputs.append(EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[] if token is None else [token],
                new_logprobs=new_logprobs,
                prompt_logprobs=prompt_logprobs,
                finish_reason=status.value if status else None,
                stop_reason=req.stop_reason,
            ))
            if status is not None:
                self._finish(req, status)
        return outputs

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, stop string); unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self._waiting = [(k, r) for k, r in self._waiting if r is not req]
                heapq.heapify(self._waiting)
            self._finish(req, status)
            finished.append(req)
        return finished

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        req.status = status
        self.kv.free(req.request_id)
        self._forget_in_runner(req.request_id, self._dropped_since_last_step)
        del self.requests[req.request_id]
        del self._arrival_index[req.request_id]

    # ---- invariants ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert pool refcounts match block tables, and only running requests hold blocks."""
        self.kv.check_integrity()
        running_ids = {r.request_id for r in self.running}
        assert len(running_ids) == len(self.running), "a request runs twice"
        assert self.kv.num_requests <= len(running_ids), "a non-running request holds blocks"
        for _, req in self._waiting:
            assert req.request_id not in running_ids, "a request is both waiting and running"
            assert req.num_computed_tokens == 0, "a waiting request has computed tokens"
        assert set(self.requests) == running_ids | {r.request_id for _, r in self._waiting}, (
            "a request is lost (neither waiting nor running)")
