"""The engine core's half of the KV connector: what the core does for the lower KV tiers
(L2 host memory, L3 file store) and for prefill/decode disaggregation, so that its step
loop calls a few methods here and knows none of it.

    EngineCore.__init__   KVConnector(...)        attach the tiers and KV transfer
    EngineCore.step       poll_reads()            finished reads -> Scheduler.finish_load
                          free_store_slots(step)  the step's stores were copied: slots reusable
                          on_landed(update)       lease held blocks (their outputs get their
                                                  KVTransferParams), free ended leases, and
                                                  the outputs of requests whose pull failed
    idle, /metrics        collect_leases(), stats()
    tests, shutdown       drain_file_io(), close()

The KV manager and scheduler decide (pure Python); the worker half
(transfer/worker_connector.py, ``Worker.kv``) moves the bytes. This half reaches every
rank's through one RPC, ``call_kv_connector``, and combines their answers
(engine/rank_results.py).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from typing import Any

from openinfer.config import DEFAULT_KV_HOST_MEMORY_WITH_STORE, EngineConfig
from openinfer.engine.outputs import EngineCoreOutput, HeldBlocks, SchedulerOutput, StepUpdate
from openinfer.engine.rank_results import (
    EveryRank,
    ReadsAcrossRanks,
    ended_on_every_rank,
    summed,
)
from openinfer.engine.scheduler import Scheduler
from openinfer.executor.base import Executor
from openinfer.kv.host_cache import HostCacheIndex
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.remote import KVTransferParams
from openinfer.kv.spec import BlockLayout, LayerGroup
from openinfer.transfer.file_store import StoreMembership, model_fingerprint

logger = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, config: EngineConfig, executor: Executor, kv: KVCacheManager,
                 scheduler: Scheduler, groups: list[LayerGroup]) -> None:
        self.config = config
        self.executor = executor
        self.kv = kv
        self.scheduler = scheduler
        self._layout: BlockLayout | None = None
        self._reads = ReadsAcrossRanks(config.num_ranks)
        self._leases_ended = EveryRank(config.num_ranks)
        self._lease_requests: dict[str, str] = {}  # live KV lease id -> its request
        self._failed: list[EngineCoreOutput] = []
        """Outputs of requests whose KV pull failed (the 'fail' policy), sent with the next
        landed step's."""
        self._rank_ports: tuple[int, ...] = ()
        """Each rank's KV server port, where there are several ranks."""
        self._rank_hosts: tuple[str, ...] = ()
        """Each rank's KV server host, where they differ (ranks on several machines)."""
        self.has_tiers = self._attach_tiers(groups)
        self.server_address = self._attach_transfer(groups)
        """Where decode instances pull this instance's leased blocks (rank 0's KV server);
        None where it lends none."""

    def _on_workers(self, method: str, *args: Any) -> list[Any]:
        """``method`` of every worker's half (``Worker.kv``); their answers, rank 0 first."""
        return self.executor.collective_rpc("call_kv_connector", method, *args)

    # ---- set-up -----------------------------------------------------------------------

    def _block_layout(self, groups: list[LayerGroup]) -> BlockLayout:
        """What a cached block's bytes mean: instances and files that share blocks must
        agree on all of it. (Computed once: the fingerprint reads the checkpoint's files.)"""
        if self._layout is None:
            fingerprint = model_fingerprint(self.config.model.path)
            if self.config.model.batch_invariant:  # bitwise-different KV: never mixed in
                fingerprint = hashlib.sha256(f"{fingerprint}:batch-invariant".encode()).hexdigest()
            self._layout = BlockLayout.of(groups, fingerprint)
        return self._layout

    def _attach_tiers(self, groups: list[LayerGroup]) -> bool:
        """Tier L2 (host memory) and L3 (file store), when configured."""
        cache, kt = self.config.cache, self.config.kv_transfer
        host_memory = cache.kv_host_memory
        if host_memory is None and (cache.kv_store_dir is not None or kt.role == "decode"):
            host_memory = DEFAULT_KV_HOST_MEMORY_WITH_STORE  # loaded blocks pass through it
        if host_memory is None or not cache.enable_prefix_caching:
            return False
        layout = self._block_layout(groups)
        num_slots = host_memory // layout.block_bytes
        stores = self._on_workers("attach_tiers", layout, num_slots)
        # (With ranks on other machines, a store is only usable on a mount they all share.)
        store_contains = StoreMembership.of_ranks(stores) if stores[0] is not None else None
        # Pulled blocks land in the host tier: an instance pulls only where it has one.
        self.kv.attach_tiers(HostCacheIndex(num_slots), store_contains, can_pull=kt.pulls_kv)
        logger.info("KV tiers: L2 %d host blocks%s", num_slots,
                    f", L3 {cache.kv_store_dir}" if store_contains else "")
        return True

    def _attach_transfer(self, groups: list[LayerGroup]) -> tuple[str, int] | None:
        """Disaggregation: a KV server that lends finished prompts' blocks (prefill), a
        connector that pulls them (decode); returns the KV server's address."""
        kt = self.config.kv_transfer
        if kt.role == "both" and kt.port is None and not self.has_tiers:
            return None  # colocated, nothing to lend, nowhere to pull into
        if kt.role != "both" and not self.config.cache.enable_prefix_caching:
            raise ValueError(f"--role {kt.role} needs prefix caching: blocks move by hash")
        # Every rank's KV server lends its share of the blocks, on a port of its own (and,
        # with ranks on other machines, on a host of its own).
        addresses = [address for address in self._on_workers(
            "attach_transfer", self._block_layout(groups), kt.pulls_kv and self.has_tiers,
            kt.serves_kv) if address]
        if len(addresses) > 1:
            self._rank_ports = tuple(port for _, port in addresses)
        hosts = tuple(host for host, _ in addresses)
        self._rank_hosts = hosts if len(set(hosts)) > 1 else ()
        return addresses[0] if addresses else None

    # ---- steps ------------------------------------------------------------------------

    def poll_reads(self, wait_s: float = 0.0) -> None:
        """Hand the scheduler the reads (file store, pulls) that finished on every rank,
        waiting up to ``wait_s`` for one."""
        if not self.has_tiers:
            return
        for load, num_loaded in self._reads.finished(self._on_workers("poll", wait_s)):
            failed = self.scheduler.finish_load(load, num_loaded)
            if failed is not None:
                self._failed.append(failed)

    def free_store_slots(self, scheduled: SchedulerOutput) -> None:
        """The host slots the step's stores were copied into (and queued for the file
        store from) may be reused now."""
        if scheduled.kv.stores:
            self.kv.finish_host_stores([copy.slot for copy in scheduled.kv.stores])

    def on_landed(self, update: StepUpdate) -> list[EngineCoreOutput]:
        """After a step: lease the blocks of finished prefill-only requests (telling their
        outputs where to pull them), free leases that ended, and return the outputs of
        requests a failed pull ended (the 'fail' policy)."""
        for out in update.outputs:
            held = update.holds.get(out.request_id)
            if held is None:
                continue
            if self.server_address is None or not held:
                # Nobody could pull them, or there is nothing to pull (a prompt shorter than a
                # block: its decode instance computes it, and would never release a lease).
                self.kv.release(out.request_id)
                continue
            out.kv_transfer_params = self._lease(out.request_id, held)
        self.collect_leases()
        failed, self._failed = self._failed, []
        return failed

    def _lease(self, request_id: str, held: HeldBlocks) -> KVTransferParams:
        """Lend a finished request's blocks on every rank; where to pull them."""
        # The lease is named by 128 random bits, not the request id: only the client the
        # answer went to (and the decode instance it hands it on to) can pull its blocks.
        lease_id = secrets.token_hex(16)
        self._lease_requests[lease_id] = request_id
        self._on_workers("lease", lease_id, held)
        host, port = self.server_address
        return KVTransferParams(remote_host=host, remote_port=port, remote_lease_id=lease_id,
                                remote_block_hashes=tuple(held),
                                remote_rank_ports=self._rank_ports,
                                remote_rank_hosts=self._rank_hosts)

    def collect_leases(self) -> int:
        """Free the blocks of leases that were released or expired (also called when idle);
        returns how many ended."""
        if self.server_address is None:
            return 0
        ended = ended_on_every_rank(self._leases_ended, self._on_workers("collect_leases"))
        for lease_id in ended:
            self.kv.release(self._lease_requests.pop(lease_id))
        return len(ended)

    # ---- reporting and shutdown -------------------------------------------------------

    def stats(self) -> dict:
        """The tiers' and transfers' figures, as running totals (for /metrics)."""
        stats: dict = {}
        kv = self.kv
        if self.has_tiers:
            stats["kv_host_blocks_used"] = kv.host.num_used
            stats["kv_host_blocks_total"] = kv.host.num_slots
            stats["kv_host_stores_skipped"] = kv.num_host_stores_skipped
            if kv.can_pull:
                stats["kv_remote_blocks_pulled"] = self.scheduler.num_remote_blocks_pulled
        if self.has_tiers or self.server_address is not None:
            stats.update(summed(self._on_workers("stats")))  # every rank's
        return stats

    def drain_file_io(self, timeout_s: float = 30.0) -> None:
        """Wait until every file read and write and pull has finished (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.has_tiers and max(self._on_workers("num_in_flight")):
            if time.monotonic() > deadline:
                raise TimeoutError("KV file I/O did not finish")
            self.poll_reads(wait_s=0.05)

    def close(self) -> None:
        """Stop lending, then let the file I/O finish (a restarted server finds the files)."""
        self._on_workers("close_server")
        self.drain_file_io()
