"""The worker half of the KV connector: on one rank, the bytes of the KV tiers and of
disaggregation, moved in and out of that rank's KV cache tensors.

    engine core: KVConnector (engine/kv_connector.py) ── "call_kv_connector" RPC ──┐
    worker:      Worker.kv = WorkerKVConnector                                     <┘
                   ├─ BlockMover: host pool (L2), file store (L3), pulls from prefill instances
                   └─ KVServer:   leases of finished prompts' blocks (prefill side)

The core half decides (pure Python) and this half carries out: a step's ``KVPlan``
(``execute``), reads that finished (``poll``), leases (``lease``, ``collect_leases``).
A tensor-parallel rank moves its own KV heads' share of every block, to and from the
same rank of the other instance.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from openinfer.config import EngineConfig
from openinfer.distributed.context_parallel import get_cp
from openinfer.distributed.parallel_state import get_tp
from openinfer.kv.block_hash import BlockHash
from openinfer.kv.plan import BlockLoad, KVPlan
from openinfer.kv.spec import BlockLayout
from openinfer.transfer.block_mover import BlockMover
from openinfer.transfer.connector import make_connector
from openinfer.transfer.file_store import FileStore, RankStore, rank_fingerprint
from openinfer.transfer.kv_server import KVServer

logger = logging.getLogger(__name__)


class WorkerKVConnector:
    def __init__(self, config: EngineConfig, kv_caches: list[torch.Tensor]) -> None:
        self.config = config
        self.kv_caches = kv_caches
        """One cache tensor per layer group (worker/kv_cache.py)."""
        self.mover: BlockMover | None = None
        """Host tier, file store and pulls (when tiers or KV transfer are on)."""
        self.server: KVServer | None = None
        """Lends finished prompts' blocks to decode instances (prefill side)."""

    # ---- set-up -----------------------------------------------------------------------

    def attach_tiers(self, layout: BlockLayout, num_host_slots: int) -> RankStore | None:
        """The host pool (L2) and, when configured, the file store (L3); returns the
        directory this worker's block files go to and the probe it wrote there (None without
        a store). A tensor-parallel rank keeps its share of each block (its KV heads) in its
        own host pool and files."""
        cache = self.config.cache
        store = None
        if cache.kv_store_dir is not None:
            store = FileStore(cache.kv_store_dir, _share_of(layout), cache.kv_store_bytes)
        self.mover = BlockMover(layout, self._layout_caches(layout), num_host_slots, store)
        return RankStore(store.dir, store.write_probe()) if store is not None else None

    def attach_transfer(self, layout: BlockLayout, pulls: bool,
                        serves: bool) -> tuple[str, int] | None:
        """Disaggregation: a connector that pulls prefill instances' blocks into the host
        tier (decode side), a KV server that lends finished prompts' blocks (prefill side);
        returns the KV server's address. Both move whole cached blocks by hash, in
        ``layout``; a tensor-parallel rank moves its share, to and from the same rank of the
        other instance."""
        kt = self.config.kv_transfer
        layout = _share_of(layout)
        if pulls:
            self.mover.attach_connector(make_connector(
                kt.connector, layout.describe(), layout.block_bytes, kt.timeout_s,
                self.mover.store, kt.secret))
        if not serves:
            return None
        # (--kv-transfer-port P: tensor-parallel rank r listens on P + r)
        port = kt.port + get_tp().rank if kt.port else 0
        self.server = KVServer(layout, self._layout_caches(layout), kt.host, port, kt.lease_s,
                               kt.secret)
        logger.info("KV server on %s:%d (leases of %.0f s)", self.server.host, self.server.port,
                    kt.lease_s)
        return self.server.host, self.server.port

    def _layout_caches(self, layout: BlockLayout) -> list[torch.Tensor]:
        return [self.kv_caches[g] for g in layout.group_ids]

    # ---- steps ------------------------------------------------------------------------

    def execute(self, plan: KVPlan) -> None:
        """A step's KV plan: stores, then loads, before the forward pass may overwrite a
        block; reads and releases queued on I/O threads."""
        if self.mover is None:
            return
        self.mover.copy_to_host(plan.stores)
        # The bytes are taken now: the slot is free again. Context-parallel ranks hold
        # the same whole blocks: the first one writes them.
        if self.mover.store is not None and get_cp().rank == 0:
            for copy in plan.stores:
                self.mover.submit_write(copy.block_hash, copy.slot)
            for block_hash, until in plan.pins:
                self.mover.store.pin(block_hash, until)
        self.mover.copy_to_device(plan.loads)
        tp = get_tp()
        for load in plan.reads:  # (a pull: this rank's share, from the same rank)
            self.mover.submit_load(load if load.source is None or tp.size == 1 else
                                   replace(load, source=load.source.for_rank(tp.rank)))
        for source in plan.releases:
            self.mover.submit_release(source if tp.size == 1 else source.for_rank(tp.rank))

    def poll(self, wait_s: float = 0.0) -> list[tuple[BlockLoad, int]]:
        """Reads (file store, pulls) that finished: (load, blocks that arrived)."""
        if self.mover is None or not self.mover.num_in_flight:
            return []
        loads = []
        for done in self.mover.poll(wait_s):
            if done[0] == "write":
                self.mover.finish_write(done[1])
            else:
                loads.append((done[1], done[2]))
        return loads

    def num_in_flight(self) -> int:
        """File reads and writes and pulls not finished yet."""
        return self.mover.num_in_flight if self.mover is not None else 0

    # ---- leases (prefill side of disaggregation) ----------------------------------------

    def lease(self, lease_id: str, blocks: dict[BlockHash, tuple[int, ...]]) -> None:
        """Lend these blocks under ``lease_id`` until a decode instance releases the lease
        or it expires."""
        self.server.add_lease(lease_id, blocks)

    def collect_leases(self) -> list[str]:
        """Leases released or expired: the core frees their blocks."""
        return self.server.collect() if self.server is not None else []

    # ---- reporting and shutdown -------------------------------------------------------

    def stats(self) -> dict:
        """This rank's KV I/O counters (bytes and seconds by direction, failures, leases)."""
        stats: dict = {}
        if self.mover is not None:
            t = self.mover.stats
            stats.update(kv_transfer_bytes=dict(t.bytes), kv_transfer_seconds=dict(t.seconds),
                         kv_store_read_failures=t.store_read_failures,
                         kv_store_writes_skipped=t.store_writes_skipped,
                         kv_store_write_failures=t.store_write_failures)
            if self.mover.store is not None:
                stats["kv_store_bytes"] = self.mover.store.bytes_used
            if self.mover.connector is not None:
                stats["kv_remote_pull_failures"] = t.remote_pull_failures
        if self.server is not None:
            stats["kv_leases"] = self.server.num_leases
            stats["kv_bytes_served"] = self.server.bytes_sent
            stats["kv_transfer_rejected"] = self.server.num_rejected
            stats["kv_leases_expired"] = self.server.num_expired
        return stats

    def close_server(self) -> None:
        """Stop lending (at shutdown)."""
        if self.server is not None:
            self.server.close()

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.shutdown()


def _share_of(layout: BlockLayout) -> BlockLayout:
    """``layout`` as this tensor-parallel rank holds it: its KV heads' share of every block,
    under a fingerprint of the split and rank (the model's own with one rank), so that files
    and transfers never mix shares."""
    tp = get_tp()
    return replace(layout, model_fingerprint=rank_fingerprint(layout.model_fingerprint,
                                                              tp.rank, tp.size))
