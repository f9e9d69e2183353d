"""KV connectors: how a decode instance pulls a prefill instance's blocks.

A connector fills the decode instance's host slots (the L2 tier) with the blocks a
request's ``kv_transfer_params`` point at; from there the request starts like any
host-tier hit (copied to the device before the forward pass). It runs on the KV I/O
threads, never on the engine loop, and delivers blocks in order, one by one, so each
is copied while the next is in flight. A failure after k blocks keeps those k: the rest
is recomputed (or the request fails, by policy).

* ``tcp``: the blocks' bytes over the prefill instance's KV server socket.
* ``shm``: one host, no bytes on the socket: the decode side creates a shared-memory
  segment, the prefill side copies the blocks into it and sends only their checksums.
* ``file``: through a shared L3 store (a 3FS/NFS directory both instances mount): the
  prefill side writes blocks through to it as they are cached; the decode side reads
  them, waiting up to the timeout for writes still in flight.

A GPU connector (NIXL, Mooncake's transfer engine) implements the same ``fetch``:
register both caches with the transfer engine, send the block ids over the control
connection, and let it RDMA-write straight into device blocks instead of host slots.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable
from multiprocessing import shared_memory

from openinfer.kv.remote import KVTransferParams
from openinfer.transfer.file_store import FileStore, StoreFileError
from openinfer.transfer.protocol import KVTransferError, recv_frame, send_frame

PutBlock = Callable[[int, memoryview], None]
"""Called with (index into the requested hashes, the block's bytes), in order."""


SEGMENT_PREFIX = "openinfer-kv-"
"""Shared-memory segments a KV server may write into are named so (and 128 random bits):
it never writes into a segment a puller names otherwise."""


def release_lease(params: KVTransferParams, secret: str | None, timeout_s: float) -> None:
    """End a lease now: its blocks will not be pulled (or were read elsewhere), so the
    prefill instance frees them instead of holding them to the lease timeout (on every
    rank's KV server of a tensor-parallel one). Raises OSError or KVTransferError when the
    prefill instance cannot be told."""
    frame = {"op": "release", "lease": params.remote_lease_id}
    if secret:
        frame["secret"] = secret
    for host, port in params.all_addresses:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            send_frame(sock, frame)
            reply, _ = recv_frame(sock, 0)
        if reply.get("op") != "ok":
            raise KVTransferError(f"release refused: {reply.get('error')}")


class KVConnector:
    name = "base"

    def __init__(self, layout: dict, block_bytes: int, timeout_s: float,
                 secret: str | None = None) -> None:
        self.layout = layout
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        self.secret = secret

    def _frame(self, **fields) -> dict:
        """A request frame to the KV server, with the shared secret when there is one."""
        return {**fields, "secret": self.secret} if self.secret else fields

    def fetch(self, params: KVTransferParams, hashes: list[bytes], put: PutBlock) -> int:
        """Deliver the leading blocks of ``hashes`` the prefill instance holds; returns
        how many. Raises KVTransferError (carrying ``delivered``) when it fails."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the connector keeps between pulls."""

    def _connect(self, params: KVTransferParams) -> socket.socket:
        try:
            sock = socket.create_connection((params.remote_host, params.remote_port),
                                            timeout=self.timeout_s)
        except (OSError, KeyError, ValueError) as e:
            raise KVTransferError(f"cannot reach the prefill instance: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _check(self, header: dict, i: int, expected: bytes, data) -> None:
        if header.get("op") != "block" or header.get("i") != i or header.get("hash") != expected:
            raise KVTransferError(f"unexpected frame {header.get('op')!r} for block {i}")
        if len(data) != self.block_bytes or zlib.crc32(data) != header.get("crc"):
            raise KVTransferError(f"block {i} is corrupt (size or checksum)")


class TcpConnector(KVConnector):
    name = "tcp"
    mode = "tcp"

    def fetch(self, params: KVTransferParams, hashes: list[bytes], put: PutBlock) -> int:
        delivered = 0
        with self._connect(params) as sock:
            try:
                shm = self._segment(len(hashes))
                send_frame(sock, self._frame(
                    op="pull", lease=params.remote_lease_id, hashes=hashes, layout=self.layout,
                    mode=self.mode, shm=shm.name if shm else None, release=True))
                while True:
                    header, payload = recv_frame(sock, self.block_bytes)
                    if header.get("op") == "end":
                        if header.get("error"):
                            raise KVTransferError(f"prefill instance: {header['error']}")
                        return delivered
                    data = memoryview(payload)
                    if shm is not None:
                        offset = delivered * self.block_bytes
                        data = shm.buf[offset:offset + self.block_bytes]
                    with data:  # no view may outlive the segment
                        self._check(header, delivered, hashes[delivered]
                                    if delivered < len(hashes) else b"", data)
                        put(delivered, data)
                    delivered += 1
            except KVTransferError as e:
                e.delivered = delivered
                self._abandon_segment()
                raise

    def _segment(self, num_blocks: int) -> shared_memory.SharedMemory | None:
        return None

    def _abandon_segment(self) -> None:
        pass


LOCAL_SEGMENTS: set[str] = set()
"""Shared-memory segments this process created (the KV server must not disown them)."""


class ShmConnector(TcpConnector):
    name = mode = "shm"

    def __init__(self, layout: dict, block_bytes: int, timeout_s: float,
                 secret: str | None = None) -> None:
        super().__init__(layout, block_bytes, timeout_s, secret)
        # One segment per pulling thread, kept and grown: a fresh segment per pull costs a
        # page fault per 4 KiB on both sides, more than the copy itself.
        self._local = threading.local()
        self._all: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()

    def _segment(self, num_blocks: int) -> shared_memory.SharedMemory:
        size = max(1, num_blocks) * self.block_bytes
        shm = getattr(self._local, "shm", None)
        if shm is None or shm.size < size:
            if shm is not None:
                self._drop(shm)
            shm = shared_memory.SharedMemory(f"{SEGMENT_PREFIX}{secrets.token_hex(16)}",
                                             create=True, size=size)
            LOCAL_SEGMENTS.add(shm.name)
            with self._lock:
                self._all.append(shm)
            self._local.shm = shm
        return shm

    def _abandon_segment(self) -> None:
        # After a failed pull the server may still be writing into it: never reuse it.
        shm = getattr(self._local, "shm", None)
        if shm is not None:
            self._local.shm = None
            self._drop(shm)

    def _drop(self, shm: shared_memory.SharedMemory) -> None:
        with self._lock:
            self._all.remove(shm)
        LOCAL_SEGMENTS.discard(shm.name)
        with contextlib.suppress(BufferError, FileNotFoundError):
            shm.close()
            shm.unlink()

    def close(self) -> None:
        for shm in list(self._all):
            self._drop(shm)


class FileConnector(KVConnector):
    name = "file"

    def __init__(self, layout: dict, block_bytes: int, timeout_s: float,
                 store: FileStore, secret: str | None = None) -> None:
        super().__init__(layout, block_bytes, timeout_s, secret)
        self.store = store

    def fetch(self, params: KVTransferParams, hashes: list[bytes], put: PutBlock) -> int:
        deadline = time.monotonic() + self.timeout_s
        delivered = 0
        try:
            for i, block_hash in enumerate(hashes):
                while True:
                    try:
                        payload = self.store.read(block_hash)
                        break
                    except FileNotFoundError:
                        if time.monotonic() > deadline:  # the prefill side's write lags
                            raise KVTransferError("timed out waiting for the store") from None
                        time.sleep(0.005)
                    except (StoreFileError, OSError) as e:
                        raise KVTransferError(f"store block unreadable: {e}") from e
                put(i, memoryview(bytearray(payload)))
                delivered += 1
        except KVTransferError as e:
            e.delivered = delivered
            raise
        finally:
            with contextlib.suppress(KVTransferError, OSError):  # not needed either way
                release_lease(params, self.secret, self.timeout_s)
        return delivered


def make_connector(name: str, layout: dict, block_bytes: int, timeout_s: float,
                   store: FileStore | None, secret: str | None = None) -> KVConnector:
    if name == "file":
        if store is None:
            raise ValueError("--kv-connector file needs --kv-store-dir (the store both "
                             "instances share)")
        return FileConnector(layout, block_bytes, timeout_s, store, secret)
    return {"tcp": TcpConnector, "shm": ShmConnector}[name](layout, block_bytes, timeout_s,
                                                            secret)
