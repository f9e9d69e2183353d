"""KV events on a ZMQ PUB socket, in vLLM's schema, so routers built for vLLM can follow us.

Wire format (as vLLM's ``ZmqEventPublisher`` sends it): each batch is a multipart
message ``(topic, seq, payload)`` with ``seq`` an 8-byte big-endian counter and
``payload`` msgpack of::

    {"ts": <unix seconds>, "events": [event, ...], "data_parallel_rank": <int>}

    {"type": "BlockStored", "block_hashes": [<bytes>], "parent_block_hash": <bytes|None>,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [<bytes>], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Block hashes are the 32-byte sha256 chain of kv/block_hash.py. ``medium`` names the tier:
``GPU`` or ``CPU`` for the device pool (by device), ``HOST`` for host memory (L2);
file-store writes are not announced (that store is shared, not a replica's own).

A subscriber that joins late or sees a gap in ``seq`` asks the replay socket (ROUTER)
for everything from a sequence number: it sends ``(b"", start_seq as 8 bytes)`` from a
REQ/DEALER socket and receives ``(seq, payload)`` for each buffered batch, then
``(-1 as 8 signed bytes, next_seq as 8 bytes + epoch as 8 bytes)``: the sequence number the
publisher will give its next batch, and 8 random bytes drawn when the publisher started. A
new epoch, or a next_seq below what the subscriber asked for, is a publisher that started
over (a restarted engine, whose cache started empty).

With a shared secret (`--kv-transfer-secret`), both sockets speak CURVE (ZMQ's
encryption and authentication): the publisher's key pair and the one key pair it admits
are derived from the secret, so only a subscriber that holds it can connect, and nobody on
the network reads the token ids in the events (they are the tenants' prompts).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections import deque

import msgpack
import zmq
import zmq.auth.thread

from openinfer.kv.cache_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def to_wire(events: list[KVEvent], block_size: int, device_medium: str) -> list[dict]:
    """Our events as vLLM's dicts (consecutive blocks of one kind are not merged)."""
    medium = {"L1": device_medium, "L2": "HOST"}
    wire = []
    for e in events:
        if isinstance(e, BlockStored):
            wire.append({"type": "BlockStored", "block_hashes": [e.block_hash],
                         "parent_block_hash": e.parent_hash, "token_ids": list(e.token_ids),
                         "block_size": block_size, "lora_id": None, "medium": medium[e.tier],
                         "lora_name": None})
        elif isinstance(e, BlockRemoved):
            wire.append({"type": "BlockRemoved", "block_hashes": [e.block_hash],
                         "medium": medium[e.tier]})
        elif isinstance(e, AllBlocksCleared):
            wire.append({"type": "AllBlocksCleared"})
    return wire


def _curve_pair(secret: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys, both ends deriving the same from the shared secret."""
    private = zmq.utils.z85.encode(hashlib.sha256(f"openinfer-kv-events/{role}/{secret}"
                                                  .encode()).digest())
    return zmq.curve_public(private), private


def secure_subscriber(sock: zmq.Socket, secret: str | None) -> None:
    """Make ``sock`` (SUB or DEALER, before connecting) a CURVE client of a publisher
    started with the same ``secret``; nothing without one."""
    if secret is not None:
        sock.curve_serverkey = _curve_pair(secret, "publisher")[0]
        sock.curve_publickey, sock.curve_secretkey = _curve_pair(secret, "subscriber")


class _OnlySubscriber:
    """ZAP credentials check: the one client key derived from the secret."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class KVEventPublisher:
    """Publishes event batches from a background thread (the engine loop never blocks on
    a subscriber) and keeps the last ``buffer_batches`` for replay."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 data_parallel_rank: int = 0, buffer_batches: int = 10_000,
                 secret: str | None = None) -> None:
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._auth = None
        if secret is not None:  # CURVE: only the holders of the secret connect
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(
                "*", _OnlySubscriber(_curve_pair(secret, "subscriber")[0]))
        self._pub = self._secured(self._ctx.socket(zmq.PUB), secret)
        self._pub.set_hwm(100_000)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where it is bound: the port ZMQ picked for a ``tcp://host:*`` endpoint."""
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint is not None:
            self._replay = self._secured(self._ctx.socket(zmq.ROUTER), secret)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.Queue[list[dict] | None] = queue.Queue()
        self._seq = 0
        self.epoch = os.urandom(8)
        """Which life of the publisher this is: its sequence numbers count from 0 in each."""
        self._thread = threading.Thread(target=self._run, name="openinfer-kv-events",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _secured(sock: zmq.Socket, secret: str | None) -> zmq.Socket:
        if secret is not None:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = _curve_pair(secret, "publisher")
        return sock

    def publish(self, events: list[dict]) -> None:
        if events:
            self._queue.put(events)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                break
            payload = msgpack.packb({"ts": time.time(), "events": events,
                                     "data_parallel_rank": self.rank}, use_bin_type=True)
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY,
                                     self._seq.to_bytes(8, "big") + self.epoch))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
