"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens:

1. Running requests first, oldest (or highest priority) first: a decode gets 1
   token, an unfinished prompt gets its next chunk. When the KV pool has no room,
   the newest running request is preempted (its blocks freed, its tokens kept, to
   be recomputed later) until the older one fits, so the oldest request always
   makes progress and nothing is stuck or dropped.
2. Then, if nothing was preempted this step, waiting requests in queue order,
   while budget, ``max_num_seqs`` and blocks allow. A prompt longer than the
   remaining budget is chunked. A new request starts after its longest cached
   prefix (prefix caching).

In-flight prefix sharing (engine/admission.py): a running request that is prefilling *claims* the hashes
of its prompt blocks nobody has cached. A waiting request whose next uncached block
is claimed steps aside (others behind it go ahead) until the claimant has computed
and cached it, then takes it as a hit: a burst of requests with one new system prompt
computes it once, not once per request. A claim ends when its block is cached or its
claimant stops running, so nobody waits on a preempted or finished request.

Speculative decoding: a decoding request that holds a draft (proposed by the runner after
its last step) is scheduled its last token plus some of the drafts, to verify them in
one pass. How many: all of them (``fixed``), or those that maximise expected accepted
tokens per second (``confidence``, spec/confidence.py). After the step its computed
tokens are those verified; the slots of rejected drafts are rolled back.

Asynchronous scheduling: ``schedule(in_flight=N)`` plans step N+1 before step N lands,
counting step N's tokens as computed (``_progress``; docs/design.md).

There is no separate prefill or decode phase: a request simply has
``num_computed_tokens`` of its ``num_tokens`` in the cache, and the step schedules
some of the rest. When a step computes its last token, the runner samples a new one.

Pure Python over block ids: no tensors here.
"""

from __future__ import annotations

import heapq
import itertools
import time

from openinfer.config import SchedulerConfig
from openinfer.engine.admission import Admission, Admit, PrefixClaims, Verdict
from openinfer.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    HeldBlocks,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepUpdate,
)
from openinfer.engine.request import Request, RequestStatus
from openinfer.kv.block_hash import extend_block_hashes
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.plan import BlockLoad
from openinfer.outputs import PromptSources
from openinfer.spec.confidence import StepRateProfile
from openinfer.spec.config import SpeculativeConfig
from openinfer.spec.planner import SpeculationPlanner

PREFETCH_DEPTH = 16
"""Waiting requests behind the head whose file-store reads start while they queue."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 kv_load_failure_policy: str = "recompute",
                 speculative: SpeculativeConfig | None = None,
                 step_rates: StepRateProfile | None = None) -> None:
        self.config = config
        self.spec = SpeculationPlanner(speculative, step_rates, config.max_num_batched_tokens
                                       ) if speculative is not None else None
        """Speculative decoding's bookkeeping (None: off)."""
        self.num_lookahead_tokens = speculative.num_lookahead_tokens if speculative else 0
        self.kv = kv
        self.kv_load_failure_policy = kv_load_failure_policy
        self.num_remote_blocks_pulled = 0
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, Request]] = []  # heap by _order
        self._arrival_counter = itertools.count()
        self._arrival_index: dict[str, int] = {}
        self._known_to_runner: set[str] = set()
        self._dropped_since_last_step: set[str] = set()
        self.num_preemptions = 0
        self.claims = PrefixClaims(kv, config.share_inflight_prefixes)
        self.admission = Admission(config, kv, self.claims, self.num_lookahead_tokens)
        self.num_prompt_tokens_computed = 0
        """Prompt tokens this scheduler sent to the model (cache hits excluded)."""
        self._step_ids = itertools.count(1)

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
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.kv.block_size,
                            req.cache_salt)
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self._waiting, (self._order(req), req))

    # ---- one step --------------------------------------------------------------------

    def schedule(self, in_flight: SchedulerOutput | None = None) -> SchedulerOutput:
        """The next step. ``in_flight``: a step scheduled before whose output has not landed
        yet (asynchronous scheduling; not with speculative decoding)."""
        assert in_flight is None or self.spec is None, "speculation needs the last step's output"
        out = SchedulerOutput(finished_request_ids=self._dropped_since_last_step,
                              step_id=next(self._step_ids))
        self._dropped_since_last_step = set()
        self.kv.pins.expire(time.time())
        budget, preempted = self._schedule_running(out, in_flight)
        if self.spec is not None:
            out.draft_budget = self.spec.draft_budget
        if not preempted:
            self._admit_waiting(out, budget)
        out.kv = self.kv.take_plan()
        return out

    def _schedule_running(self, out: SchedulerOutput,
                          in_flight: SchedulerOutput | None) -> tuple[int, bool]:
        """Running requests first, oldest first: each its next tokens (and drafts to verify),
        preempting the newest while the pool has no room. (budget left, whether any request
        was preempted)."""
        budget = self.config.max_num_batched_tokens
        preempted = False
        self.running.sort(key=self._order)
        verify = self.spec.drafts_to_verify(self.running) if self.spec is not None else {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            computed, num_tokens = self._progress(req, in_flight)
            if computed == num_tokens:  # the step in flight samples its last token
                i += 1
                continue
            n = min(num_tokens - computed, budget)
            num_drafts = min(verify.get(req.request_id, 0), budget - n)
            n += num_drafts
            slots = self._slots_needed(req, computed + n, num_drafts, num_tokens)
            new_blocks, preempted_now = self._allocate_or_preempt(req, slots, computed, out)
            preempted = preempted or preempted_now
            if new_blocks is None:
                break  # req itself was preempted; it was the last running request
            if num_drafts:
                out.spec_token_ids[req.request_id] = req.draft.token_ids[:num_drafts]
            self._emit(req, n, new_blocks, out, computed)
            self._count_prompt_tokens(req, computed, n)
            budget -= n
            i += 1
        return budget, preempted

    def _allocate_or_preempt(self, req: Request, slots: int, computed: int,
                             out: SchedulerOutput) -> tuple[list[list[int]] | None, bool]:
        """The request's new blocks, preempting the newest running requests (maybe ``req``
        itself: then None) until they fit; and whether any was preempted."""
        preempted = False
        new_blocks = self.kv.allocate_slots(req.request_id, slots, num_computed_tokens=computed)
        while new_blocks is None:
            victim = self.running.pop()  # the newest request yields its blocks
            self._preempt(victim, out)
            preempted = True
            if victim is req:
                return None, True
            new_blocks = self.kv.allocate_slots(req.request_id, slots, num_computed_tokens=computed)
        return new_blocks, preempted

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Then waiting requests in queue order while budget, ``max_num_seqs`` and blocks
        allow (engine/admission.py decides for each)."""
        stepped_aside = []
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._waiting[0][1]
            decision = self.admission.admit(req, budget)
            if decision is Verdict.STEP_ASIDE:
                stepped_aside.append(heapq.heappop(self._waiting))
                continue
            if decision is Verdict.BLOCKED:
                break  # head-of-line waits: later requests must not overtake it
            heapq.heappop(self._waiting)
            self._start(req, decision, out)
            budget -= decision.num_tokens
        for item in stepped_aside:
            heapq.heappush(self._waiting, item)
        if self.kv.store_contains is not None and self._waiting:
            self.admission.prefetch([r for _, r in heapq.nsmallest(PREFETCH_DEPTH,
                                                                    self._waiting)])

    def _start(self, req: Request, admitted: Admit, out: SchedulerOutput) -> None:
        """An admitted request runs: its first chunk goes into this step."""
        hit, num_hit = admitted.hit, admitted.hit.num_tokens
        if req.num_cached_tokens < 0:  # first scheduling: what the user is told
            req.first_scheduled_time = time.monotonic()
            # Blocks pulled from a prefill instance were computed for this request,
            # not found in a cache: they count as neither hit nor query.
            remote = min(req.num_blocks_from_remote, len(hit.host_slots))
            req.num_cached_tokens = num_hit - remote * self.kv.block_size
            by_tier = self.kv.record_prefix_query(
                req.num_tokens - remote * self.kv.block_size, hit,
                min(req.num_blocks_from_store, len(hit.host_slots) - remote), remote)
            req.prompt_tokens_by_source = PromptSources(
                by_tier["L1"], by_tier["L2"], by_tier["L3"], remote * self.kv.block_size,
                req.num_prompt_tokens - num_hit)
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING
        req.admitted_step = out.step_id
        self.running.append(req)
        self.claims.claim(req)
        self._emit(req, admitted.num_tokens, admitted.new_blocks, out, num_hit)
        self._count_prompt_tokens(req, num_hit, admitted.num_tokens)

    @staticmethod
    def _progress(req: Request, in_flight: SchedulerOutput | None) -> tuple[int, int]:
        """(computed, known) tokens of a running request once the step in flight lands:
        a sampling step adds one known token (only the runner has its id; it feeds it to the
        next step itself), unless ``max_tokens`` ends the request there (computed == known).
        A stop token it samples wastes the next step's row; ``update_from_output`` drops it."""
        computed, known = req.num_computed_tokens, req.num_tokens
        if in_flight is None or in_flight.step_id < req.admitted_step:
            return computed, known
        pending = in_flight.num_scheduled_tokens.get(req.request_id, 0)
        computed += pending
        if pending and computed == known and len(req.output_token_ids) + 1 < req.max_tokens:
            known += 1
        return computed, known

    def _count_prompt_tokens(self, req: Request, computed: int, n: int) -> None:
        if computed < req.num_prompt_tokens:
            self.num_prompt_tokens_computed += min(n, req.num_prompt_tokens - computed)

    # ---- speculative decoding ---------------------------------------------------------

    def _slots_needed(self, req: Request, slots: int, num_drafts: int, num_tokens: int) -> int:
        """Tokens the request's tables must cover for a step that ends at ``slots``: those,
        and when it samples, the positions a model drafter writes past them."""
        if slots - num_drafts == num_tokens and self.num_lookahead_tokens:
            slots = min(slots + self.num_lookahead_tokens, req.max_num_tokens)
        return slots

    # ---- KV loads ---------------------------------------------------------------------

    def finish_load(self, load: BlockLoad, num_loaded: int) -> EngineCoreOutput | None:
        """Blocks read from the file store or pulled from a prefill instance are in the host
        tier: the request may start (recomputing what did not arrive, or failing, as the
        policy says). Returns the last output of a request the failure ended."""
        self.kv.finish_load(load, num_loaded)
        self.admission.waiting_for_kv.discard(load.request_id)
        req = self.requests.get(load.request_id)
        if req is not None and req.status is RequestStatus.WAITING_FOR_KV:
            req.status = RequestStatus.WAITING
        if load.source is None:
            if req is not None:
                req.num_blocks_from_store = num_loaded
            return None
        self.num_remote_blocks_pulled += num_loaded
        if req is None:
            return None
        req.num_blocks_from_remote = num_loaded
        if num_loaded >= len(load.blocks) or self.kv_load_failure_policy != "fail":
            return None
        self._waiting = [(k, r) for k, r in self._waiting if r is not req]
        heapq.heapify(self._waiting)
        self._finish(req, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(req.request_id, [], finish_reason=RequestStatus.FINISHED_ERROR.value,
                                stop_reason="kv_transfer_failed")

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.admission.waiting_for_kv)

    def _emit(self, req: Request, n: int, new_blocks: list[list[int]],
              out: SchedulerOutput, computed: int) -> None:
        out.num_scheduled_tokens[req.request_id] = n
        if req.request_id in self._known_to_runner:
            kept = None
            if self.spec is not None:  # rollbacks shorten tables: say where the new blocks go
                kept = [len(t) - len(b) for t, b in zip(self.kv.block_table(req.request_id),
                                                        new_blocks)]
            out.cached_requests.append(
                CachedRequestData(req.request_id, new_blocks, computed, kept))
            return
        self._known_to_runner.add(req.request_id)
        out.new_requests.append(NewRequestData(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            stop_token_ids=req.stop_token_ids,
            block_ids=[list(t) for t in self.kv.block_table(req.request_id)],
            num_computed_tokens=computed,
        ))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's KV and queue it again; its tokens are recomputed later
        (its blocks that were cached and not evicted meanwhile come back as hits)."""
        self.claims.settle(req, release_all=True)
        self._free(req)
        req.num_computed_tokens = 0
        req.draft = None
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

    def update_from_output(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> StepUpdate:
        update = StepUpdate()
        outputs = update.outputs
        for request_id, n in scheduled.num_scheduled_tokens.items():
            req = self.requests.get(request_id)
            if (req is None or req.status is not RequestStatus.RUNNING
                    or req.admitted_step > scheduled.step_id):
                # Ended (or preempted) after the step was scheduled: its row is not its own.
                continue
            sampled = result.sampled_token_ids.get(request_id, ())
            num_drafts = len(scheduled.spec_token_ids.get(request_id, ()))
            # Rejected drafts were computed but are not the request's tokens: their slots go.
            num_rejected = num_drafts + 1 - len(sampled) if num_drafts else 0
            req.num_computed_tokens += n - num_rejected
            if self.spec is not None:
                if num_rejected or self.num_lookahead_tokens:
                    self.kv.rollback(request_id, req.num_computed_tokens)
                if sampled:
                    self.spec.settle(req, num_drafts, len(sampled), result.drafts.get(request_id))
            # A step may yield several tokens (verified drafts): a stop anywhere ends the
            # request there, and what follows it is dropped.
            new_tokens: list[int] = []
            status = None
            for token in sampled:
                req.append_output_token(token)
                new_tokens.append(token)
                status = req.check_stop()
                if status is not None:
                    break
            if self.kv.enable_caching:
                extend_block_hashes(req.block_hashes, req.all_token_ids, self.kv.block_size,
                                    req.cache_salt)
                self.kv.cache_blocks(request_id, req.block_hashes, req.all_token_ids,
                                     req.num_computed_tokens)
                self.claims.settle(req)
                self._pin(req)
            prompt_logprobs = result.prompt_logprobs.get(request_id)
            if not new_tokens and prompt_logprobs is None:
                continue
            new_logprobs = result.logprobs.get(request_id)
            if new_logprobs is not None:
                new_logprobs = new_logprobs[:len(new_tokens)]
            outputs.append(EngineCoreOutput(
                request_id=request_id,
                new_token_ids=new_tokens,
                new_logprobs=new_logprobs,
                prompt_logprobs=prompt_logprobs,
                finish_reason=status.value if status else None,
                stop_reason=req.stop_reason,
                num_cached_tokens=max(0, req.num_cached_tokens),
                prompt_sources=req.prompt_tokens_by_source,
                pinned_tokens=list(req.pinned_tokens) if req.sampling_params.cache_pins
                and len(req.output_token_ids) <= 1 else None,
                # Until the front end has seen its first token (then it is known there).
                first_scheduled_time=req.first_scheduled_time
                if len(req.output_token_ids) <= 1 else None,
            ))
            if status is not None:
                held = self._finish(req, status)
                if held is not None:  # the engine core's KV connector leases them
                    update.holds[request_id] = held
        return update

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, stop string); unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                              RequestStatus.WAITING_FOR_KV):
                self._waiting = [(k, r) for k, r in self._waiting if r is not req]
                heapq.heapify(self._waiting)
            if req.remote_prefill is not None and not req.remote_load_tried and self.kv.can_pull:
                self.kv.release_remote(req.remote_prefill)  # never to be pulled
            self._finish(req, status)
            finished.append(req)
        return finished

    def _pin(self, req: Request) -> None:
        """Take the request's prompt pins (``cache_pins``) whose tokens it has computed."""
        pins = req.sampling_params.cache_pins or ()
        while len(req.pinned_tokens) < len(pins):
            num_tokens, ttl_s = pins[len(req.pinned_tokens)]
            num_tokens = min(num_tokens, req.num_prompt_tokens)
            if req.num_computed_tokens < num_tokens:
                return
            req.pinned_tokens.append(self.kv.pin_prefix(
                req.block_hashes, num_tokens, ttl_s, req.sampling_params.cache_pin_owner,
                time.time()))

    def _free(self, req: Request) -> None:
        """Free the request's blocks, keeping its partial last block cached (the next turn of
        a conversation, or the request itself after a preemption, resumes there)."""
        if self.kv.partials is not None:
            self.kv.partials.keep(self.kv.block_table(req.request_id), req.block_hashes,
                                  req.all_token_ids, req.num_computed_tokens, req.cache_salt)
        self.kv.free(req.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> HeldBlocks | None:
        """End the request and free its blocks; a prefill-only request that ended normally
        keeps its prompt's cached blocks instead, returned for a decode instance to pull."""
        held = None
        if req in self.running:
            self.running.remove(req)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        req.status = status
        self.admission.waiting_for_kv.discard(req.request_id)
        self.claims.settle(req, release_all=True)
        if req.wants_remote_decode and status in (RequestStatus.FINISHED_LENGTH,
                                                  RequestStatus.FINISHED_STOPPED):
            held = self.kv.hold(req.request_id, req.block_hashes, req.num_prompt_tokens)
        else:
            self._free(req)
        self._forget_in_runner(req.request_id, self._dropped_since_last_step)
        del self.requests[req.request_id]
        del self._arrival_index[req.request_id]
        return held

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
            assert (req.status is RequestStatus.WAITING_FOR_KV) == (
                req.request_id in self.admission.waiting_for_kv), "WAITING_FOR_KV and its index disagree"
        assert set(self.requests) == running_ids | {r.request_id for _, r in self._waiting}, (
            "a request is lost (neither waiting nor running)")
        assert set(self.claims.owner.values()) <= running_ids, "a claim outlived its claimant"

