"""The engine core: model + KV cache + scheduler, driven one step at a time.

    step():  scheduler.schedule() -> executor.execute_model() -> executor.sample_tokens()
             -> scheduler.update_from_output()

(with structured outputs, the step's grammar masks are computed between the first two)

With asynchronous scheduling a step is submitted to the executor's model thread and
lands at the next call, after that call has scheduled and submitted the following step:

    step() k:   schedule(N+1, in_flight=N) -> submit N+1 -> N lands -> update_from_output(N)

so the model runs step N+1 right after step N while this thread turns step N's tokens
into outputs. A step that needs the previous step's tokens before it can be scheduled
(speculative drafts, grammar masks) runs the synchronous way, after the one in flight.

It speaks token ids only; text lives in the front end (offline LLM or API server), and
tensors in the workers behind the executor (executor/, worker/worker.py). The lower KV
tiers and disaggregation are its KV connector's (engine/kv_connector.py): the loop polls
it for finished reads and hands it each landed step.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from openinfer.config import CacheConfig, EngineConfig
from openinfer.cpu_features import cpu_model_name
from openinfer.engine.kv_connector import KVConnector
from openinfer.engine.outputs import (
    EngineCoreOutput,
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
)
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.executor import make_executor
from openinfer.kv.block_hash import extend_block_hashes
from openinfer.kv.cache_events import KVEvent
from openinfer.kv.events import KVEventPublisher, to_wire
from openinfer.kv.host_cache import HostCacheIndex
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.pins import PinLimits
from openinfer.kv.spec import SlidingWindowSpec, group_layers, page_bytes
from openinfer.sampling_params import SamplingParams
from openinfer.spec.confidence import PROFILE_ROWS, StepRateProfile
from openinfer.structured.manager import StructuredOutputManager
from openinfer.tokenizer import load_tokenizer
from openinfer.transfer.file_store import model_fingerprint

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        mc, cache = config.model, config.cache
        self.executor = make_executor(config, progress)
        groups = group_layers(self.executor.call("kv_cache_specs"))
        num_blocks = min(self.executor.collective_rpc("kv_cache_memory")) // page_bytes(groups)
        # An instance that lends KV to decode instances keeps window layers' blocks whole for
        # the requests it holds (their window pages travel with every block).
        self.kv = KVCacheManager(groups, num_blocks, cache.enable_prefix_caching,
                                 cache.window_snapshot_interval if cache.window_snapshots else None,
                                 lends_windows=config.kv_transfer.serves_kv)
        # One request of max_model_len tokens must fit: every block in the full groups, the
        # window and a prefill chunk in the window groups.
        chunk = config.scheduler.max_num_batched_tokens
        needed = sum(g.spec.max_live_blocks(chunk) if isinstance(g.spec, SlidingWindowSpec)
                     else g.spec.blocks_for(mc.max_model_len) for g in groups)
        if needed > num_blocks:
            raise ValueError(
                f"kv_cache_memory holds {num_blocks} blocks, fewer than one request of "
                f"max_model_len ({mc.max_model_len}) needs ({needed}): raise kv_cache_memory "
                "or lower max_model_len")
        capacity = num_blocks * cache.block_size // len(self.kv.anchors)
        if len(self.kv.windows) == len(groups) and (
                cache.kv_host_memory is not None or cache.kv_store_dir is not None
                or config.kv_transfer.role != "both" or config.kv_transfer.port is not None):
            raise ValueError("this model has sliding-window layers only: the host/file KV tiers "
                             "and disaggregation need a full-attention layer group")
        self.executor.collective_rpc("initialize_kv_cache", groups, num_blocks)
        self.compute_info: dict = self.executor.call("compute_info_labels")
        """How this engine computes (the labels of the compute_info metric)."""
        spec = config.speculative
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   config.kv_transfer.load_failure_policy, spec,
                                   self._step_rates() if spec and spec.scheduler != "fixed"
                                   else None)
        self.connector = KVConnector(config, self.executor, self.kv, self.scheduler, groups)
        """The core's half of the KV connector: the tiers and disaggregation."""
        self.kv.pins.limits = pin_limits(cache, num_blocks, page_bytes(groups), self.kv.host)
        self.num_aborted = 0
        """Live requests ended from outside (a client gone, a stop string met)."""
        self.structured: StructuredOutputManager | None = None
        self._refused: list[EngineCoreOutput] = []
        """Outputs of requests refused at add_request, sent with the next step's."""
        self._in_flight: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None
        """Asynchronous scheduling: the step the model thread runs, not landed yet."""
        self.event_sink: Callable[[list[KVEvent]], None] | None = None
        """Receives the KV events of each step (else they are dropped)."""
        self.publisher = None
        if cache.kv_events_endpoint is not None:
            self.publisher = KVEventPublisher(cache.kv_events_endpoint,
                                              cache.kv_events_replay_endpoint,
                                              cache.kv_events_topic,
                                              secret=config.kv_transfer.secret)
            medium = "GPU" if config.device.startswith("cuda") else "CPU"
            self.event_sink = lambda events: self.publisher.publish(
                to_wire(events, cache.block_size, medium))
        logger.info("KV cache: %d blocks of %d tokens (%d tokens) shared by %d layer group(s)%s",
                    num_blocks, cache.block_size, capacity, len(groups),
                    f", {len(self.kv.windows)} of them sliding-window" if self.kv.windows else "")

    def _step_rates(self) -> StepRateProfile:
        """The model's steps per second by rows (confidence scheduling): profiled once per
        model, dtype, device and CPU, then read from disk."""
        spec, sched = self.config.speculative, self.config.scheduler
        max_rows = min(sched.max_num_batched_tokens,
                       sched.max_num_seqs * (spec.num_speculative_tokens + 1))
        key = {"model": model_fingerprint(self.config.model.path),
               "dtype": str(self.config.model.dtype), "device": self.config.device,
               "cpu": cpu_model_name(), "threads": torch.get_num_threads(),
               "attention": self.compute_info.get("attention"), "max_rows": max_rows,
               "query_len": spec.num_speculative_tokens + 1}
        path = StepRateProfile.cache_path(spec.sps_cache_dir, key)
        profile = None if spec.refresh_sps else StepRateProfile.load(path)
        if profile is None:
            rows = [r for r in PROFILE_ROWS if r <= max_rows]
            start = time.perf_counter()
            profile = StepRateProfile(self.executor.call(
                "profile_step_seconds", rows, spec.num_speculative_tokens + 1))
            profile.save(path, key)
            logger.info("speculative decoding: profiled steps/s at %d row counts in %.1f s "
                        "(cached in %s)", len(profile.points), time.perf_counter() - start, path)
        return profile

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a validated request; its output is capped by the context length."""
        room = self.config.model.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(request_id, prompt_token_ids, params, max_tokens,
                      frozenset(self.config.model.eos_token_ids),
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        if params.structured_outputs is not None:
            try:
                req.grammar = self._structured_outputs().grammar(params.structured_outputs)
            except ValueError as e:  # the front end checked it: only a direct caller gets here
                logger.warning("request %s refused: %s", request_id, e)
                self._refused.append(EngineCoreOutput(
                    request_id, [], finish_reason=RequestStatus.FINISHED_ERROR.value,
                    stop_reason=f"invalid structured_outputs: {e}"))
                return
        self.scheduler.add_request(req)

    def _structured_outputs(self) -> StructuredOutputManager:
        """Built at the first constrained request (it loads the tokenizer)."""
        if self.structured is None:
            if self.config.skip_tokenizer_init:
                raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init)")
            mc = self.config.model
            self.structured = StructuredOutputManager(
                load_tokenizer(self.config.tokenizer or mc.path), mc.vocab_size,
                list(mc.eos_token_ids), self.config.grammar_cache_size)
        return self.structured

    def abort_requests(self, request_ids: list[str]) -> None:
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.num_aborted += len(ended)
        self._release_if_idle()

    def has_unfinished_requests(self) -> bool:
        return (bool(self._refused) or self._in_flight is not None
                or self.scheduler.has_unfinished_requests())

    def step(self) -> list[EngineCoreOutput]:
        if self.config.scheduler.async_scheduling and self._can_overlap():
            return self._step_overlapped()
        outputs = self._land_in_flight()
        self.connector.poll_reads()
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        masks = (self.structured.submit(scheduled, self.scheduler.requests)
                 if self.structured is not None else None)
        self.executor.execute_model(scheduled)  # the masks are computed meanwhile
        result = self.executor.sample_tokens(masks.result() if masks is not None else None)
        if self.scheduler.spec is not None and not scheduled.is_empty:
            self.scheduler.spec.observe_step(
                scheduled.total_num_scheduled_tokens, time.perf_counter() - start,
                result.draft_seconds, sum(len(d.token_ids) for d in result.drafts.values()))
        if scheduled.is_empty and self.scheduler.num_waiting_for_kv:
            self.connector.poll_reads(wait_s=0.01)  # nothing else to do: let loads land
        return outputs + self._land(scheduled, result)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the one in flight lands: not when
        it needs that step's tokens (drafts to verify; grammar masks, unless the model
        thread can wait for them after its forward pass)."""
        if self.scheduler.spec is not None:
            return False
        return self.structured is None or self.executor.defers_masks or not any(
            req.grammar is not None for req in self.scheduler.requests.values())

    def _step_overlapped(self) -> list[EngineCoreOutput]:
        self.connector.poll_reads()
        in_flight = self._in_flight[0] if self._in_flight is not None else None
        scheduled = self.scheduler.schedule(in_flight=in_flight)
        # Grammar masks need the matchers past the step in flight: the model thread runs
        # this step's forward pass meanwhile, and samples once they are computed.
        masks: Future[GrammarBitmask | None] | None = (
            Future() if self.structured is not None and self.executor.defers_masks
            and not scheduled.is_empty else None)
        future = self.executor.submit_step(scheduled, masks)  # after the step in flight
        started = []

        def start_masks() -> None:
            started.append(True)
            self._compute_masks(scheduled, masks)

        try:
            outputs = self._land_in_flight(start_masks if masks is not None else None)
        finally:
            if masks is not None and not started:  # landing failed: free the thread
                masks.set_exception(RuntimeError("the step before this one failed to land"))
        if scheduled.is_empty:  # nothing to overlap with: let it land now
            outputs += self._land(scheduled, future.result())
        else:
            self._in_flight = (scheduled, future)
        return outputs

    def _compute_masks(self, scheduled: SchedulerOutput, masks: Future) -> None:
        """Start the masks of ``scheduled`` (its matchers advanced by the step that just
        landed); ``masks`` resolves when they are done."""
        try:
            computing = self.structured.submit(scheduled, self.scheduler.requests)
        except BaseException as e:
            masks.set_exception(e)
            raise
        if computing is None:
            masks.set_result(None)
            return

        def done(f: Future) -> None:
            if f.exception() is not None:
                masks.set_exception(f.exception())
            else:
                masks.set_result(f.result())

        computing.add_done_callback(done)

    def _land_in_flight(self, after_update: Callable[[], None] | None = None
                        ) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            if after_update is not None:
                after_update()
            return []
        scheduled, future = self._in_flight
        self._in_flight = None
        return self._land(scheduled, future.result(), after_update)

    def _land(self, scheduled: SchedulerOutput, result: ModelRunnerOutput,
              after_update: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """A step's tokens, into the scheduler and out as outputs (``after_update``: called
        once the scheduler has them, before anything that may wait on the model thread)."""
        self.connector.free_store_slots(scheduled)
        update = self.scheduler.update_from_output(scheduled, result)
        if after_update is not None:
            after_update()
        outputs = update.outputs
        if self._refused:
            outputs, self._refused = self._refused + outputs, []
        outputs += self.connector.on_landed(update)
        self._release_if_idle()
        self._flush_events()
        return outputs

    def _flush_events(self) -> None:
        events = self.kv.take_events()
        if events and self.event_sink is not None:
            self.event_sink(events)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block in L1 and L2 (not the shared file store); returns how
        many device blocks were cached. Running requests keep their blocks."""
        count = self.kv.reset_cache()
        self._flush_events()
        return count

    def pin_tokens(self, token_ids: list[int], cache_salt: str | None, ttl_s: float,
                   owner: str | None) -> int:
        """Pin the cached whole blocks of ``token_ids`` (a finished request's prompt and
        output, under its salt) for ``ttl_s`` seconds (kv/pins.py); returns the tokens
        pinned. The server keeps an agent's context so while its tool call runs."""
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.kv.block_size, cache_salt)
        return self.kv.pin_prefix(hashes, len(token_ids), ttl_s, owner, time.time())

    def stats(self) -> dict:
        """Scheduler and KV-cache figures, as running totals (for /metrics)."""
        s, kv = self.scheduler, self.kv
        stats = {
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_loading": s.num_waiting_for_kv, "kv_cache_usage": kv.usage,
            "num_preemptions": s.num_preemptions,
            "num_aborted": self.num_aborted,
            "prefix_cache_queries": kv.num_queried_tokens, "prefix_cache_hits": kv.num_hit_tokens,
            "prefix_cache_hits_by_tier": dict(kv.hit_tokens_by_tier),
            "prefix_cache_blocks": kv.num_cached_blocks,
            "kv_pinned_blocks": len(kv.pins), "kv_pins_refused": kv.pins.num_refused,
            "prompt_tokens_computed": s.num_prompt_tokens_computed,
            "gc_frozen_objects": gc.get_freeze_count(),
        }
        if kv.windows:
            stats["window_replayed_tokens"] = kv.num_replayed_tokens
            stats["window_pages_cached"] = sum(kv.pools[g].num_cached for g, _ in kv.windows)
        stats.update(self.connector.stats())
        if self.config.speculative is not None:
            stats.update(s.spec.stats.as_dict())
        if self.config.moe_expert_stats:
            stats["moe_expert_tokens"] = self.executor.call("expert_token_counts")
        if self.config.eplb is not None:  # every rank's moves, summed
            ranks = self.executor.collective_rpc("eplb_stats")
            stats.update({key: sum(r[key] for r in ranks) if key != "eplb_rearrangements"
                          else ranks[0][key] for key in ranks[0]})
        return stats

    def shutdown(self) -> None:
        self._land_in_flight()
        if self.structured is not None:
            self.structured.shutdown()
        self.connector.close()
        self.executor.shutdown()
        if self.publisher is not None:
            self.publisher.shutdown()

    @property
    def lockstep(self) -> bool:
        """A data-parallel rank of an expert-parallel group: it steps only when every rank
        does (``any_rank_busy``), so that the MoE layers' collectives pair up."""
        return self.config.data_parallel.size > 1

    def any_rank_busy(self) -> bool:
        """Lockstep: whether any rank has requests; every rank must call it together."""
        return self.executor.call("any_rank_busy", self.has_unfinished_requests())

    def _release_if_idle(self) -> None:
        # The runner learns of finished requests at the next step; with no next step
        # in sight, send it an empty one so it drops their state now (the last step's
        # cached blocks still go to L2 and L3 with it). Not in lockstep: an extra step on
        # one rank would be a step the others do not take (its next step drops them).
        if not self.scheduler.has_unfinished_requests() and not self.lockstep:
            scheduled = self.scheduler.schedule()
            self.executor.execute_model(scheduled)  # (after the step in flight, if any)
            self.scheduler.update_from_output(scheduled, self.executor.sample_tokens(None))
            self.connector.free_store_slots(scheduled)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def pin_limits(cache: CacheConfig, num_blocks: int, block_bytes: int,
               host: HostCacheIndex | None) -> PinLimits:
    """``--kv-pin-memory`` (per key and in all) in blocks: by default half the tier that keeps
    pinned blocks (the host tier when there is one, else the device pool), a quarter of that
    per key."""
    held = host.num_slots if host is not None else num_blocks
    total = held // 2 if cache.kv_pin_memory is None else cache.kv_pin_memory // block_bytes
    per_key = (total // 4 if cache.kv_pin_memory_per_key is None
               else cache.kv_pin_memory_per_key // block_bytes)
    return PinLimits(total, min(per_key, total))
