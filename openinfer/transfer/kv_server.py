"""A prefill instance's KV server: hands finished prompts' blocks to decode instances.

When a request that asked for remote decode finishes, the engine keeps its full prompt
blocks referenced (kv_manager.hold) and registers them here as a *lease*. Decode
instances pull blocks by hash over TCP (bytes on the socket) or, on the same host,
through shared memory they name; each pull renews the lease. The engine thread frees a
lease's blocks (``collect``) once it is released by the puller, or has not been touched
for ``lease_s`` and no pull is streaming from it, so a decode instance that never comes
costs memory for at most ``lease_s``.

The serving threads only read blocks that a lease holds: the engine never writes a
referenced block, so no lock is needed around the tensor itself. (On CUDA a block is
copied to the host first; a GPU connector such as NIXL or Mooncake's transfer engine
would instead register the cache tensor and let the decode side read it by RDMA, with
this same lease protocol deciding when the blocks may be reused.)
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from openinfer.kv.spec import BlockLayout
from openinfer.transfer.connector import LOCAL_SEGMENTS, SEGMENT_PREFIX
from openinfer.transfer.protocol import KVTransferError, recv_frame, send_frame

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    blocks: dict[bytes, tuple[int, ...]]
    """Block hash -> its device block id in each of the model's layer groups."""
    deadline: float
    pulls: int = 0
    """Pulls streaming from it now: it is not freed under them."""
    released: bool = False


class KVServer:
    def __init__(self, layout: BlockLayout, device_caches: list[torch.Tensor], host: str,
                 port: int, lease_s: float, secret: str | None = None) -> None:
        self.block_layout = layout
        self.device_caches = device_caches
        """The layout groups' device tensors (a block's bytes are its pages in each, in order)."""
        self.layout = layout.describe()
        self.lease_s = lease_s
        self._leases: dict[str, _Lease] = {}
        self._segments: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), backlog=128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.secret = secret
        self.bytes_sent = 0
        self.num_pulls = 0
        self.num_rejected = 0
        self.num_expired = 0
        """Leases that ended unreleased: no decode instance pulled them and let go (it never
        came, or failed), so their blocks were held for the whole lease timeout."""
        """Connections refused and closed: a wrong or missing secret, a lease that is not
        live (lease ids are 128 random bits: a puller cannot guess one), a bad request."""
        self._closed = False
        threading.Thread(target=self._accept_loop, name="openinfer-kv-server", daemon=True).start()

    # ---- engine thread ---------------------------------------------------------------

    def add_lease(self, lease_id: str, blocks: dict[bytes, tuple[int, ...]]) -> None:
        with self._lock:
            self._leases[lease_id] = _Lease(blocks, time.monotonic() + self.lease_s)

    def collect(self) -> list[str]:
        """Leases that ended (released, or expired with no pull streaming): the engine
        frees their blocks."""
        now = time.monotonic()
        with self._lock:
            ended = [lid for lid, lease in self._leases.items()
                     if lease.pulls == 0 and (lease.released or now > lease.deadline)]
            for lid in ended:
                self.num_expired += not self._leases.pop(lid).released
        return ended

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone may not)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for shm in self._segments.values():
                with contextlib.suppress(BufferError):
                    shm.close()
            self._segments.clear()

    # ---- serving threads -------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(60)
            try:
                while True:
                    header, _ = recv_frame(conn, max_payload=0)
                    refusal = self._refusal(header)
                    if refusal is not None:
                        self.num_rejected += 1
                        logger.warning("KV server: refused a connection: %s", refusal)
                        send_frame(conn, {"op": "end", "n": 0, "error": refusal})
                        return  # closed: nothing more is read from it
                    if header["op"] == "pull":
                        self._pull(conn, header)
                    else:
                        self._release(header["lease"])
                        send_frame(conn, {"op": "ok"})
            except (KVTransferError, OSError):
                return  # the puller hung up (normally, after its last frame) or failed

    def _refusal(self, header: dict) -> str | None:
        """Why a request frame is refused, or None. A pull or release must carry the
        secret (when one is set) and name a live lease; a pull into shared memory must
        name a segment a connector made."""
        given = header.get("secret")
        if self.secret is not None and not (
                isinstance(given, str) and hmac.compare_digest(given.encode(), self.secret.encode())):
            return "wrong or missing KV transfer secret"
        if header.get("op") not in ("pull", "release"):
            return "unknown op"
        lease = header.get("lease")
        if header["op"] == "release":
            # Idempotent: the lease may have ended already (its pull released it, and then
            # the router released it too), and releasing nothing lends nothing.
            return None if isinstance(lease, str) else "a release names its lease"
        with self._lock:
            live = isinstance(lease, str) and lease in self._leases
        if not live:
            return "no such lease (expired?)"
        hashes = header.get("hashes")
        if not (isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)):
            return "a pull names its blocks as a list of hashes"
        if header.get("mode", "tcp") not in ("tcp", "shm"):
            return "a pull's mode is tcp or shm"
        if header.get("mode") == "shm" and not (
                isinstance(header.get("shm"), str) and header["shm"].startswith(SEGMENT_PREFIX)):
            return "not a KV connector's shared-memory segment"
        return None

    def _pull(self, conn: socket.socket, header: dict) -> None:
        lease_id = str(header.get("lease"))
        if header.get("layout") != self.layout:
            send_frame(conn, {"op": "end", "n": 0, "error": "KV layout differs (another model?)"})
            return
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.pulls += 1
                lease.deadline = time.monotonic() + self.lease_s
        if lease is None:
            send_frame(conn, {"op": "end", "n": 0, "error": f"no lease {lease_id!r} (expired?)"})
            return
        shm = None
        sent = 0
        try:
            if header.get("mode") == "shm":
                shm = self._attach(str(header["shm"]))
            for i, block_hash in enumerate(header.get("hashes") or []):
                blocks = lease.blocks.get(block_hash)
                if blocks is None:
                    break  # only a leading run of held blocks is useful to the puller
                data = self._block_bytes(blocks)
                frame = {"op": "block", "i": i, "hash": block_hash, "crc": zlib.crc32(data)}
                if shm is not None:
                    offset = i * len(data)
                    shm.buf[offset:offset + len(data)] = data
                    send_frame(conn, frame)
                else:
                    send_frame(conn, frame, data)
                sent += 1
                self.bytes_sent += len(data)
                with self._lock:
                    lease.deadline = time.monotonic() + self.lease_s
            send_frame(conn, {"op": "end", "n": sent, "error": None})
            self.num_pulls += 1
        except (OSError, ValueError, KeyError) as e:
            logger.warning("KV pull of lease %s failed after %d blocks: %s", lease_id, sent, e)
            with contextlib.suppress(OSError):
                send_frame(conn, {"op": "end", "n": sent, "error": str(e)})
        finally:
            with self._lock:
                lease.pulls -= 1
                if header.get("release"):
                    lease.released = True

    def _attach(self, name: str) -> shared_memory.SharedMemory:
        """A puller's segment, mapped once and kept (pullers reuse theirs)."""
        with self._lock:
            shm = self._segments.pop(name, None)
            if shm is None:
                shm = shared_memory.SharedMemory(name=name)
                if name not in LOCAL_SEGMENTS:
                    # The puller owns it; without this, Python's resource tracker would
                    # unlink it when this process exits (bpo-39959).
                    resource_tracker.unregister(shm._name, "shared_memory")
            self._segments[name] = shm
            while len(self._segments) > 64:  # pullers that went away, or grew theirs
                _, old = self._segments.popitem(last=False)
                with contextlib.suppress(BufferError):
                    old.close()
        return shm

    def _release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.released = True

    def _block_bytes(self, blocks: tuple[int, ...]) -> memoryview:
        """A block's pages in every layout group, in order, as one buffer."""
        pages = [cache[blocks[g]].reshape(-1).view(torch.uint8)
                 for g, cache in zip(self.block_layout.group_ids, self.device_caches)]
        data = pages[0] if len(pages) == 1 else torch.cat(pages)
        if data.device.type != "cpu":
            data = data.cpu()
        return memoryview(data.numpy()).cast("B")
