"""The engine core: model + KV cache + scheduler, driven one step at a time.

    step():  scheduler.schedule() -> runner.execute() -> scheduler.update_from_output()

It speaks token ids only; text lives in the front end (offline LLM or API server).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from openinfer.attention import select_attention_backend
from openinfer.config import (
    CUDA_MEMORY_UTILIZATION,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_KV_HOST_MEMORY_WITH_STORE,
    EngineConfig,
)
from openinfer.cpu_features import cpu_capability
from openinfer.disagg.connector import make_connector
from openinfer.disagg.server import KVServer
from openinfer.engine.outputs import EngineCoreOutput
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.runner import ModelRunner
from openinfer.engine.scheduler import Scheduler
from openinfer.kv.events import KVEventPublisher, to_wire
from openinfer.kv.file_store import FileStore, StoreLayout, model_fingerprint
from openinfer.kv.host_cache import HostCacheIndex
from openinfer.kv.kv_manager import KVCacheManager, KVEvent
from openinfer.kv.spec import FullAttentionSpec, LayerGroup, group_layers
from openinfer.kv.transfer import KVTransfer
from openinfer.layers.gemm import describe_gemms
from openinfer.models.loader import load_model
from openinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        mc = config.model
        start = time.perf_counter()
        model = load_model(mc, config.device, progress=progress)
        num_params = sum(p.numel() for p in model.parameters())
        dtype_name = str(mc.dtype).removeprefix("torch.")
        gemm = describe_gemms(model)
        logger.info("%s (%s, %.0fM parameters) loaded in %.1f s: %s on %s (CPU capability %s); "
                    "GEMM %s", mc.path, mc.architecture, num_params / 1e6,
                    time.perf_counter() - start, dtype_name, config.device, cpu_capability(),
                    gemm.text)
        specs = [FullAttentionSpec(config.cache.block_size, mc.num_kv_heads, mc.head_dim, dtype_name)
                 for _ in range(mc.num_layers)]
        groups = group_layers(specs)
        num_blocks = self._num_blocks(groups)
        capacity = num_blocks * config.cache.block_size
        if capacity < mc.max_model_len:
            raise ValueError(
                f"kv_cache_memory holds {capacity} tokens, fewer than max_model_len "
                f"({mc.max_model_len}): raise kv_cache_memory or lower max_model_len")
        self.kv = KVCacheManager(groups, num_blocks, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   config.kv_transfer.load_failure_policy)
        attention = select_attention_backend(config.attention_backend, config.device)
        logger.info("attention backend: %s", attention.name)
        self.compute_info = {"dtype": dtype_name, "gemm": gemm.label,
                             "cpu_capability": cpu_capability(), "attention": attention.name}
        """How this engine computes (the labels of the compute_info metric)."""
        self.runner = ModelRunner(model, groups, num_blocks, mc.num_layers, mc.dtype, config.device,
                                  attention, seed=config.seed)
        self._block_layout: StoreLayout | None = None
        self.transfer = self._attach_kv_tiers(groups[0], dtype_name)
        self.kv_server = self._attach_kv_transfer(dtype_name)
        self.event_sink: Callable[[list[KVEvent]], None] | None = None
        """Receives the KV events of each step (else they are dropped)."""
        self.publisher = None
        if config.cache.kv_events_endpoint is not None:
            self.publisher = KVEventPublisher(config.cache.kv_events_endpoint,
                                              config.cache.kv_events_replay_endpoint,
                                              config.cache.kv_events_topic)
            medium = "GPU" if config.device.startswith("cuda") else "CPU"
            self.event_sink = lambda events: self.publisher.publish(
                to_wire(events, config.cache.block_size, medium))
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks,
                    config.cache.block_size, capacity)

    def _attach_kv_tiers(self, group: LayerGroup, dtype_name: str) -> KVTransfer | None:
        """Tier L2 (host memory) and L3 (file store), when configured."""
        cache = self.config.cache
        host_memory = cache.kv_host_memory
        if host_memory is None and (cache.kv_store_dir is not None
                                    or self.config.kv_transfer.role == "decode"):
            host_memory = DEFAULT_KV_HOST_MEMORY_WITH_STORE  # loaded blocks pass through it
        if host_memory is None or not cache.enable_prefix_caching:
            return None
        store = None
        if cache.kv_store_dir is not None:
            store = FileStore(cache.kv_store_dir, self._layout(dtype_name), cache.kv_store_bytes)
        num_slots = host_memory // group.bytes_per_block
        host = HostCacheIndex(num_slots)
        self.kv.attach_tiers(host, store.contains if store is not None else None)
        transfer = KVTransfer(self.runner.kv_blocks, num_slots, store)
        self.runner.transfer = transfer
        logger.info("KV tiers: L2 %d host blocks%s", num_slots,
                    f", L3 {cache.kv_store_dir}" if store else "")
        return transfer

    def _layout(self, dtype_name: str) -> StoreLayout:
        """What a block's bytes mean: instances that share blocks must agree on all of it.
        (Computed once: the fingerprint reads the checkpoint's files.)"""
        if self._block_layout is None:
            cache, mc = self.config.cache, self.config.model
            self._block_layout = StoreLayout(model_fingerprint(mc.path), cache.block_size,
                                             mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                             dtype_name)
        return self._block_layout

    def _attach_kv_transfer(self, dtype_name: str) -> KVServer | None:
        """Disaggregation: a KV server that lends finished prompts' blocks (prefill), a
        connector that pulls them (decode). Both move whole cached blocks by hash."""
        kt = self.config.kv_transfer
        if kt.role == "both" and kt.port is None and self.transfer is None:
            return None  # colocated, nothing to lend, nowhere to pull into
        if kt.role != "both" and not self.config.cache.enable_prefix_caching:
            raise ValueError(f"--role {kt.role} needs prefix caching: blocks move by hash")
        if len(self.kv.groups) != 1:
            raise ValueError("KV transfer needs a model with one KV layer group")
        layout = dataclasses.asdict(self._layout(dtype_name))
        if kt.pulls_kv and self.transfer is not None:
            self.transfer.attach_connector(make_connector(
                kt.connector, layout, self.transfer.block_bytes, kt.timeout_s,
                self.transfer.store))
            self.kv.can_pull = True
        if not kt.serves_kv:
            return None
        server = KVServer(self.runner.kv_blocks, layout, kt.host, kt.port or 0, kt.lease_s)
        logger.info("KV server on %s:%d (leases of %.0f s)", server.host, server.port, kt.lease_s)
        return server

    def _num_blocks(self, groups: list[LayerGroup]) -> int:
        bytes_per_block = sum(g.bytes_per_block for g in groups)
        memory = self.config.cache.kv_cache_memory
        if memory is None:
            if self.config.device.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info()
                memory = int(free * CUDA_MEMORY_UTILIZATION)
            else:
                memory = DEFAULT_CPU_KV_CACHE_MEMORY
        return memory // bytes_per_block

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a validated request; its output is capped by the context length."""
        room = self.config.model.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(request_id, prompt_token_ids, params, max_tokens,
                      frozenset(self.config.model.eos_token_ids),
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._release_if_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        self._finish_file_io()
        scheduled = self.scheduler.schedule()
        if self.transfer is not None:
            for load in self.kv.pending_block_loads:
                self.transfer.submit_load(load)
            self.kv.pending_block_loads.clear()
            for source in self.kv.pending_releases:
                self.transfer.submit_release(source)
            self.kv.pending_releases.clear()
        result = self.runner.execute(scheduled)
        if self.transfer is not None:
            self._after_host_stores(scheduled.kv_stores)
            if scheduled.is_empty and self.scheduler.num_loading:
                self._finish_file_io(wait_s=0.01)  # nothing else to do: let loads land
        outputs = self.scheduler.update_from_output(scheduled, result)
        outputs += self._settle_kv_transfers(outputs)
        self._release_if_idle()
        self._flush_events()
        return outputs

    def _settle_kv_transfers(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Lease the blocks of finished prefill-only requests (telling their outputs where
        to pull them), free leases that ended, and end requests whose pull failed under
        the 'fail' policy; returns the outputs of those."""
        holds, self.scheduler.new_holds = self.scheduler.new_holds, {}
        for out in outputs:
            if out.kv_transfer_params is None:
                continue
            if self.kv_server is None:  # nobody could pull them: free them now
                out.kv_transfer_params = None
                self.kv.release(out.request_id)
                continue
            self.kv_server.add_lease(out.request_id, holds[out.request_id])
            out.kv_transfer_params.update(remote_host=self.kv_server.host,
                                          remote_port=self.kv_server.port)
        self.collect_leases()
        failed, self.scheduler.failed = self.scheduler.failed, []
        return [EngineCoreOutput(req.request_id, [], finish_reason=RequestStatus.FINISHED_ERROR.value,
                                 stop_reason="kv_transfer_failed") for req in failed]

    def collect_leases(self) -> int:
        """Free the blocks of leases that were released or expired (also called when idle);
        returns how many ended."""
        if self.kv_server is None:
            return 0
        ended = self.kv_server.collect()
        for lease_id in ended:
            self.kv.release(lease_id)
        return len(ended)

    def _flush_events(self) -> None:
        if self.kv.events:
            events, self.kv.events = self.kv.events, []
            if self.event_sink is not None:
                self.event_sink(events)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block in L1 and L2 (not the shared file store); returns how
        many device blocks were cached. Running requests keep their blocks."""
        count = self.kv.reset_cache()
        self._flush_events()
        return count

    def stats(self) -> dict:
        """Scheduler and KV-cache figures, as running totals (for /metrics)."""
        s, kv = self.scheduler, self.kv
        stats = {
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_loading": s.num_loading, "kv_cache_usage": kv.usage,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": kv.num_queried_tokens, "prefix_cache_hits": kv.num_hit_tokens,
            "prefix_cache_hits_by_tier": dict(kv.hit_tokens_by_tier),
            "prefix_cache_blocks": kv.pools[0].num_cached,
            "prompt_tokens_computed": s.num_prompt_tokens_computed,
        }
        if self.transfer is not None:
            stats["kv_host_blocks_used"] = kv.host.num_used
            stats["kv_host_blocks_total"] = kv.host.num_slots
            stats["kv_transfer_bytes"] = dict(self.transfer.stats.bytes)
            stats["kv_transfer_seconds"] = dict(self.transfer.stats.seconds)
            stats["kv_store_read_failures"] = self.transfer.stats.store_read_failures
            stats["kv_store_writes_skipped"] = self.transfer.stats.store_writes_skipped
            stats["kv_host_stores_skipped"] = kv.num_host_stores_skipped
            if self.transfer.store is not None:
                stats["kv_store_bytes"] = self.transfer.store.bytes_used
            if self.transfer.connector is not None:
                stats["kv_remote_blocks_pulled"] = s.num_remote_blocks_pulled
                stats["kv_remote_pull_failures"] = self.transfer.stats.remote_pull_failures
        if self.kv_server is not None:
            stats["kv_leases"] = self.kv_server.num_leases
            stats["kv_bytes_served"] = self.kv_server.bytes_sent
        return stats

    def _after_host_stores(self, stores: list[tuple[int, int]]) -> None:
        """Blocks just copied to the host are queued for the file store (their bytes are
        taken, so their host slots may be reused at once)."""
        if self.transfer.store is not None:
            for _, slot in stores:
                self.transfer.submit_write(self.kv.host.hash_at(slot), slot)
        self.kv.finish_host_stores([slot for _, slot in stores])

    def _finish_file_io(self, wait_s: float = 0.0) -> None:
        if self.transfer is None or not self.transfer.num_in_flight:
            return
        for done in self.transfer.poll(wait_s):
            if done[0] == "write":
                self.transfer.finish_write(done[1])
            else:
                self.scheduler.finish_load(done[1], done[2])

    def drain_file_io(self, timeout_s: float = 30.0) -> None:
        """Wait until every file read and write has finished (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.transfer is not None and self.transfer.num_in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError("KV file I/O did not finish")
            self._finish_file_io(wait_s=0.05)

    def shutdown(self) -> None:
        if self.kv_server is not None:
            self.kv_server.close()
        self.drain_file_io()
        if self.transfer is not None:
            self.transfer.shutdown()
        if self.publisher is not None:
            self.publisher.shutdown()

    def _release_if_idle(self) -> None:
        # The runner learns of finished requests at the next step; with no next step
        # in sight, send it an empty one so it drops their state now.
        if not self.scheduler.has_unfinished_requests():
            scheduled = self.scheduler.schedule()
            self.runner.execute(scheduled)
            if self.transfer is not None:  # the last step's blocks still go to L2 (and L3)
                self._after_host_stores(scheduled.kv_stores)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
