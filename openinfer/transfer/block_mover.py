"""The tensor side of the KV tiers: the host pool, device<->host copies, file I/O threads.

The scheduler decides (pure Python, kv_manager.py); this moves bytes:

* device -> host (write-through of newly cached blocks) and host -> device (L2 hits) run
  at the start of a step, stores before loads, before the forward pass writes any
  block. Each layer group's device cache is block-major, so a block's part of a group is
  one contiguous chunk; a block off the device is those chunks in ``BlockLayout`` order.
  On CUDA the host pool is pinned; host->device copies are asynchronous on the compute
  stream, device->host copies synchronous (their bytes are read at once).
* host <-> file store reads and writes, and pulls from a prefill instance through a KV
  connector (openinfer/transfer/), run on a small thread pool; their completions
  are polled by the engine core each step, so the engine loop never waits on a disk
  (except, when nothing else can run, briefly for the load a request waits on).
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from openinfer.kernels.kv_quant import is_fp8
from openinfer.kv.block_hash import BlockHash
from openinfer.kv.kv_manager import BlockCopy, BlockLoad
from openinfer.kv.remote import KVTransferParams
from openinfer.kv.spec import BlockLayout
from openinfer.transfer.connector import release_lease
from openinfer.transfer.file_store import FileStore, StoreFileError
from openinfer.transfer.protocol import KVTransferError

logger = logging.getLogger(__name__)
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_store", "store_to_host",
              "remote_to_host")


@dataclass
class TransferStats:
    """Running totals, reported with the engine's stats (and so in /metrics)."""
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    store_read_failures: int = 0
    """Store files not loaded: corrupt, truncated, another model's, or unreadable."""
    store_write_failures: int = 0
    """Blocks the disk refused (full, read-only, directory gone): a lost cache entry each."""
    store_writes_skipped: int = 0
    """Blocks not written to the file store because the disk lagged too far behind."""
    remote_pull_failures: int = 0
    """Pulls from prefill instances that delivered fewer blocks than asked."""


class BlockMover:
    """Moves cached blocks' bytes between the device cache (one tensor per layer group),
    the host pool (the same, with a slot per block), the file store and remote instances.

    A block's bytes off the device are its cacheable groups' pages in ``layout`` order;
    ``device_caches`` are those groups' tensors ``[num_blocks, layers, *page_shape]``.
    """

    def __init__(self, layout: BlockLayout, device_caches: list[torch.Tensor],
                 num_host_slots: int, store: FileStore | None, io_threads: int = 2) -> None:
        assert len(device_caches) == len(layout.groups)
        self.layout = layout
        self.connector = None
        """A KVConnector when this instance pulls KV from prefill instances."""
        self.device_caches = device_caches
        pin = device_caches[0].is_cuda
        self.host_caches = [torch.zeros((num_host_slots, *c.shape[1:]), dtype=c.dtype,
                                        pin_memory=pin) for c in device_caches]
        self.block_bytes = layout.block_bytes
        assert self.block_bytes == sum(h[0].numel() * h.element_size() for h in self.host_caches)
        self.store = store
        self.stats = TransferStats()
        self._io: ThreadPoolExecutor | None = None
        if store is not None:
            self._io = ThreadPoolExecutor(io_threads, "openinfer-kv-io")
        self._done: queue.Queue[tuple] = queue.Queue()
        self.num_in_flight = 0
        self.max_pending_write_bytes = 256 * 1024**2
        self._pending_write_bytes = 0

    # ---- device <-> host (main thread, at the start of a step) ------------------------

    def copy_to_host(self, copies: list[BlockCopy]) -> None:
        if not copies:
            return
        start = time.perf_counter()
        for device, host, slots, blocks in self._per_group(copies):
            # A synchronous copy: the slot's bytes are read (file writes) right after, and
            # an asynchronous device->host copy would not have landed yet.
            host.index_copy_(0, slots, device.index_select(0, blocks).to("cpu"))
        self._account("device_to_host", len(copies), start)

    def copy_to_device(self, copies: list[BlockCopy]) -> None:
        if not copies:
            return
        start = time.perf_counter()
        for device, host, slots, blocks in self._per_group(copies):
            # Host->device on the compute stream: ordered before the forward pass reads it.
            device.index_copy_(0, blocks, host.index_select(0, slots).to(device.device,
                                                                         non_blocking=True))
        self._account("host_to_device", len(copies), start)

    def _per_group(self, copies: list[BlockCopy]):
        """Per layout group: (device cache, host cache, host slots, device block ids)."""
        slots = torch.tensor([c.slot for c in copies])
        for g, device, host in zip(self.layout.group_ids, self.device_caches, self.host_caches):
            if is_fp8(device.dtype):  # torch's index_copy_ has no float8 kernel: move the bytes
                device, host = device.view(torch.uint8), host.view(torch.uint8)
            yield device, host, slots, torch.tensor([c.blocks[g] for c in copies],
                                                    device=device.device)

    def slot_payload(self, slot: int) -> bytes:
        """A host slot's block as bytes, in layout order (for the file store)."""
        return b"".join(h[slot].view(torch.uint8).numpy().tobytes() for h in self.host_caches)

    def fill_slot(self, slot: int, payload: bytes | bytearray | memoryview) -> None:
        """Put a block's bytes (layout order, already checked for size) into a host slot."""
        if isinstance(payload, bytes):
            payload = bytearray(payload)  # torch.frombuffer wants a writable buffer
        offset = 0
        for h in self.host_caches:
            n = h[slot].numel() * h.element_size()
            chunk = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset)
            h[slot].view(torch.uint8).view(-1).copy_(chunk)
            offset += n

    def _account(self, kind: str, num_blocks: int, start: float) -> None:
        self.stats.bytes[kind] += num_blocks * self.block_bytes
        self.stats.seconds[kind] += time.perf_counter() - start

    # ---- host <-> file store (I/O threads) -------------------------------------------

    def submit_write(self, block_hash: BlockHash, slot: int) -> bool:
        """Queue a copy of the slot's block for the file store. The bytes are taken now, so
        the slot is free again at once; False (nothing queued) when more than
        ``max_pending_write_bytes`` already wait for a slow disk."""
        if self._pending_write_bytes + self.block_bytes > self.max_pending_write_bytes:
            self.stats.store_writes_skipped += 1
            return False
        payload = self.slot_payload(slot)
        self._pending_write_bytes += len(payload)
        self.num_in_flight += 1
        self._io.submit(self._write, block_hash, payload)
        return True

    def finish_write(self, num_bytes: int) -> None:
        self._pending_write_bytes -= num_bytes

    def attach_connector(self, connector, max_concurrent_pulls: int = 16) -> None:
        self.connector = connector
        # Pulls wait on the network, not the CPU: more of them overlap.
        self._pulls = ThreadPoolExecutor(max_concurrent_pulls, "openinfer-kv-pull")

    def submit_load(self, load: BlockLoad) -> None:
        self.num_in_flight += 1
        if load.source is None:
            self._io.submit(self._load, load)
        else:
            self._pulls.submit(self._pull, load)

    def submit_release(self, source: KVTransferParams) -> None:
        """Tell a prefill instance its blocks are not needed (a pull of nothing)."""
        self._pulls.submit(self._release, source)

    def _release(self, source: KVTransferParams) -> None:
        try:
            self.connector.fetch(source, [], lambda i, data: None)
        except Exception as e:  # its lease expires instead
            logger.info("KV release of %s failed: %s", source.remote_lease_id, e)

    def _end_lease(self, source: KVTransferParams) -> None:
        """Release a lease on every port it names (each rank's share, when this instance
        does not pull them rank by rank), whatever the layouts."""
        try:
            release_lease(source, self.connector.secret, self.connector.timeout_s)
        except Exception as e:  # a dead or stalled prefill instance: its lease expires
            logger.info("KV release of %s failed: %s", source.remote_lease_id, e)

    def _pull(self, load: BlockLoad) -> None:
        start, loaded = time.perf_counter(), 0

        def put(i: int, data: memoryview) -> None:
            nonlocal loaded
            self.fill_slot(load.blocks[i][1], data)
            loaded = i + 1

        try:
            self.connector.fetch(load.source, [h for h, _ in load.blocks], put)
        except Exception as e:  # never let a pull take the engine down: recompute instead
            kind = "" if isinstance(e, KVTransferError) else f"{type(e).__name__}: "
            logger.warning("KV pull for %s failed after %d of %d blocks: %s%s", load.request_id,
                           loaded, len(load.blocks), kind, e)
            # The rest is recomputed: the lease is of no more use (a refused pull, such as
            # one whose layout differs, did not end it). Told on another thread: a stalled
            # prefill instance must not hold up this load's end.
            self._pulls.submit(self._end_lease, load.source)
        finally:
            if loaded < len(load.blocks):
                self.stats.remote_pull_failures += 1
            self._account("remote_to_host", loaded, start)
            self._done.put(("load", load, loaded))

    def _write(self, block_hash: BlockHash, payload: bytes) -> None:
        start = time.perf_counter()
        try:
            self.store.write(block_hash, payload)
            self._account("host_to_store", 1, start)
        except OSError as e:  # a full or failing disk loses a cache entry, never a request
            self.stats.store_write_failures += 1
            if self.stats.store_write_failures % 1000 == 1:  # the first, then every 1000th
                logger.warning("KV file store write failed (%d so far): %s",
                               self.stats.store_write_failures, e)
        finally:
            self._done.put(("write", len(payload)))

    def _load(self, load: BlockLoad) -> None:
        start, loaded = time.perf_counter(), 0
        try:
            for block_hash, slot in load.blocks:
                try:
                    payload = self.store.read(block_hash)
                except (StoreFileError, OSError):
                    self.stats.store_read_failures += 1
                    break  # the rest is recomputed
                self.fill_slot(slot, payload)
                loaded += 1
            self._account("store_to_host", loaded, start)
        finally:
            self._done.put(("load", load, loaded))

    def poll(self, timeout_s: float = 0.0) -> list[tuple]:
        """Finished I/O: ("write", bytes) and ("load", BlockLoad, blocks loaded)."""
        done = []
        try:
            done.append(self._done.get(timeout=timeout_s) if timeout_s else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.num_in_flight -= len(done)
        return done

    def shutdown(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self.connector is not None:
            self._pulls.shutdown(wait=True)
            self.connector.close()
