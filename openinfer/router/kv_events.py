"""The router's side of a replica's KV events: its exact index of what the replica caches.

Each replica that publishes events (``--kv-events-endpoint``, set up by
``--data-parallel-size``) says where on ``/kv_events``; the router subscribes (ZMQ SUB) and
applies every batch to the replica's ``WorkerCacheIndex``. A gap in the sequence numbers is
filled from the replica's replay socket; a batch lost for good starts the index over. On
each (re)subscription the router first replays from its next sequence number: the
replay's end says the publisher's next number and its epoch, so a restarted engine (its
cache empty, its first batches perhaps sent before the subscription reconnected) is told
from one the router merely lost sight of, and its index starts over. A replica without a
replay socket cannot be told apart so: its index starts over at each resubscription.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlparse

import httpx
import zmq
import zmq.asyncio

from openinfer.kv.events import secure_subscriber
from openinfer.router.policies import Worker, parse_event_batch

logger = logging.getLogger(__name__)
RETRY_S = 1.0
"""Wait before asking a replica again for its event endpoints, or resubscribing."""


class EventFollower:
    """Keeps replicas' cache indexes from their KV events (one ``follow`` task each)."""

    def __init__(self, http: httpx.AsyncClient, ctx: zmq.asyncio.Context,
                 secret: str | None) -> None:
        self.http = http
        self.ctx = ctx
        self.secret = secret
        """The replicas' --kv-transfer-secret: their event sockets speak CURVE, keyed by it."""

    async def follow(self, worker: Worker, synced: asyncio.Event | None = None) -> None:
        """Follow the replica's KV events (if it publishes them) into its exact index;
        ``synced`` is set once the index has caught up (or there are no events)."""
        while True:
            try:
                info = (await self.http.get(f"{worker.url}/kv_events", timeout=2.0)).json()
            except (httpx.HTTPError, OSError, ValueError):
                await asyncio.sleep(RETRY_S)
                continue
            if not info.get("endpoint"):
                if synced is not None:
                    synced.set()
                return  # no events: the approximate index serves
            host = urlparse(worker.url).hostname
            endpoint = connectable(info["endpoint"], host)
            replay = connectable(info["replay_endpoint"], host) if info.get("replay_endpoint") else None
            sub = self.ctx.socket(zmq.SUB)
            secure_subscriber(sub, self.secret)
            sub.setsockopt(zmq.SUBSCRIBE, info.get("topic", "").encode())
            sub.connect(endpoint)
            if replay is None:
                # Nothing tells a restarted publisher (its cache empty, its numbering from 0
                # again, its first batches perhaps sent before we joined) from the one we
                # lost sight of: start over rather than keep blocks it may not hold.
                worker.index.reset()
            try:
                if replay is not None:  # catch up on what happened before we subscribed
                    publisher = await self._replay(worker, replay)
                    if publisher is not None and worker.index.started_over(*publisher):
                        # A restarted engine, its cache empty.
                        logger.warning("replica %s restarted: its cache index starts over",
                                       worker.url)
                        worker.index.reset()
                        await self._replay(worker, replay)
                    if publisher is not None:
                        worker.index.epoch = publisher[1]
                if synced is not None:
                    synced.set()
                while True:
                    _, seq_bytes, payload = await sub.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big")
                    events = parse_event_batch(payload)
                    if not worker.index.apply(seq, events):
                        if replay is not None:
                            await self._replay(worker, replay)
                        if not worker.index.apply(seq, events):
                            worker.index.reset()  # lost for good: start over from here
                            worker.index.next_seq = seq
                            worker.index.apply(seq, events)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a broken event stream must not take the router down
                logger.warning("KV events of %s: %s", worker.url, e)
                worker.index.reset()
                await asyncio.sleep(RETRY_S)
            finally:
                sub.close(linger=0)

    async def _replay(self, worker: Worker, endpoint: str) -> tuple[int, bytes | None] | None:
        """Apply the batches the replica buffered from our next one on; returns the number
        its publisher gives its next batch and the publisher's epoch (None: not told)."""
        sock = self.ctx.socket(zmq.DEALER)
        secure_subscriber(sock, self.secret)
        sock.connect(endpoint)
        try:
            await sock.send_multipart((b"", worker.index.next_seq.to_bytes(8, "big")))
            while await sock.poll(5000):
                _, seq_bytes, payload = await sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:  # the end: vLLM's carries nothing, ours next_seq and epoch
                    if len(payload) < 8:
                        return None
                    return int.from_bytes(payload[:8], "big"), payload[8:16] or None
                worker.index.apply(seq, parse_event_batch(payload))
            return None
        finally:
            sock.close(linger=0)


def connectable(endpoint: str, host: str | None) -> str:
    """A bind address (tcp://*:5557) as the router can connect to it."""
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host or '127.0.0.1'}:")
    return endpoint
