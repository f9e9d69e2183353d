"""The router's event follower against a real publisher (ZMQ over loopback); only the
replica's GET /kv_events is a stand-in (httpx's MockTransport)."""

from __future__ import annotations

import asyncio

import httpx
import zmq.asyncio

from openinfer.kv.events import KVEventPublisher
from openinfer.router.kv_events import EventFollower
from openinfer.router.policies import Worker


def _stored(block_hash: bytes) -> dict:
    return {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None,
            "token_ids": [1], "block_size": 16, "lora_id": None, "medium": "CPU"}


def test_a_resubscription_without_replay_starts_the_index_over():
    """A publisher with no replay socket cannot say whether it restarted (cache empty,
    numbering from 0 again, its first batches perhaps sent before the router joined): the
    index of a past life is dropped on resubscribing, not kept as if still held."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*")  # no replay endpoint
    info = {"endpoint": publisher.endpoint, "replay_endpoint": None, "topic": "",
            "block_size": 16}
    worker = Worker("http://replica:8000")
    for seq in range(5):  # what the router knew of the replica's previous life
        assert worker.index.apply(seq, [_stored(b"old-%d" % seq)])

    async def follow() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=info)))
        ctx = zmq.asyncio.Context()
        synced = asyncio.Event()
        task = asyncio.create_task(EventFollower(http, ctx, None).follow(worker, synced))
        try:
            await asyncio.wait_for(synced.wait(), 10)
            assert len(worker.index) == 0 and worker.index.match([b"old-0"]) == 0
            # PUB drops what precedes the subscription: publish until a batch lands.
            for _ in range(200):
                publisher.publish([_stored(b"new")])
                await asyncio.sleep(0.05)
                if worker.index.match([b"new"]):
                    break
            assert worker.index.match([b"new"]) == 1 and len(worker.index) == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await http.aclose()
            ctx.term()

    try:
        asyncio.run(follow())
    finally:
        publisher.shutdown()
