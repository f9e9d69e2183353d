"""KV events under a shared secret: CURVE-encrypted PUB and replay sockets that only a
subscriber holding the secret can connect to (the events carry the tenants' token ids)."""

from __future__ import annotations

import time

import msgpack
import zmq

from openinfer.kv.events import END_OF_REPLAY, KVEventPublisher, secure_subscriber


def _subscriber(ctx: zmq.Context, endpoint: str, secret: str | None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    secure_subscriber(sub, secret)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _replayed(ctx: zmq.Context, endpoint: str, secret: str | None) -> list[int] | None:
    """The sequence numbers a replay request returns (None: no answer within 2 s)."""
    dealer = ctx.socket(zmq.DEALER)
    secure_subscriber(dealer, secret)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")), flags=zmq.NOBLOCK)
    except zmq.Again:  # (no peer ever completed the handshake: nothing to queue the request to)
        dealer.close(linger=0)
        return None
    seqs = []
    try:
        while dealer.poll(2000):
            _, seq, _ = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                return seqs
            seqs.append(int.from_bytes(seq, "big"))
        return None
    finally:
        dealer.close(linger=0)


def test_only_holders_of_the_secret_read_kv_events():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", secret="s3cret")
    endpoint, replay = publisher.endpoint, publisher.replay_endpoint  # the ports it took
    ctx = zmq.Context()
    try:
        holder = _subscriber(ctx, endpoint, "s3cret")
        strangers = [_subscriber(ctx, endpoint, None), _subscriber(ctx, endpoint, "guess")]
        # PUB/SUB drops what is sent before a subscription arrives: probe until one lands.
        probe = {"type": "AllBlocksCleared"}
        deadline = time.monotonic() + 30
        while not holder.poll(100):
            assert time.monotonic() < deadline, "the holder never got an event"
            publisher.publish([probe])
        while holder.poll(200):  # the probes still on their way
            holder.recv_multipart()
        event = {"type": "BlockStored", "block_hashes": [b"h" * 32], "token_ids": [1, 2, 3]}
        for _ in range(3):
            publisher.publish([event])
        got = []
        while len(got) < 3 and holder.poll(5000):
            seq, payload = holder.recv_multipart()[1:]
            got.append(msgpack.unpackb(payload)["events"])
        assert got == [[event]] * 3
        assert not any(s.poll(500) for s in strangers)
        last = int.from_bytes(seq, "big")
        assert _replayed(ctx, replay, "s3cret") == list(range(last + 1))
        assert _replayed(ctx, replay, None) is None
        assert _replayed(ctx, replay, "guess") is None
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
