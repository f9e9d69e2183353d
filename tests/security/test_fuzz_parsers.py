"""Hostile bytes at every parser that reads another process's input: the KV-transfer frame
reader, the L3 file-store block reader and the router's KV-event decoder. Random and
mutated inputs (hypothesis) end in the parser's own error, never another exception (which
would kill a serving thread or loop), and never yield a block that was not written."""

from __future__ import annotations

import json
import socket
import threading

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openinfer.kv.spec import BlockLayout, FullAttentionSpec, group_layers
from openinfer.router.policies import WorkerCacheIndex, parse_event_batch
from openinfer.transfer.file_store import MAGIC, FileStore, StoreFileError
from openinfer.transfer.protocol import KVTransferError, recv_frame, send_frame

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _read_frame(data: bytes, max_payload: int = 1 << 16):
    """recv_frame over a real socket pair holding ``data``, then EOF."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return recv_frame(b, max_payload)


def _valid_frame(header: dict, payload: bytes) -> bytes:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, header, payload)
        a.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := b.recv(1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)


def _mutations(data: bytes):
    """Truncations, bit flips and splices of ``data``."""
    return st.one_of(
        st.integers(0, len(data)).map(lambda n: data[:n]),
        st.tuples(st.integers(0, max(0, len(data) - 1)), st.integers(1, 255)).map(
            lambda f: data[:f[0]] + bytes([data[f[0]] ^ f[1]]) + data[f[0] + 1:] if data else data),
        st.tuples(st.integers(0, len(data)), st.binary(max_size=64)).map(
            lambda s: data[:s[0]] + s[1] + data[s[0]:]),
    )


VALID_FRAME = _valid_frame({"op": "pull", "lease": "ab" * 16, "hashes": [b"x" * 16]}, b"p" * 40)


@FUZZ
@given(st.one_of(st.binary(max_size=512), _mutations(VALID_FRAME)))
def test_kv_frames_from_hostile_bytes_are_read_or_refused(data):
    try:
        header, payload = _read_frame(data)
    except KVTransferError:
        return
    assert isinstance(header, dict) and isinstance(header.get("nbytes", 0), int)
    assert len(payload) == header.get("nbytes", 0)


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.binary(max_size=8)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=30))
def test_kv_frame_headers_of_any_shape_are_read_or_refused(value):
    packed = msgpack.packb(value, use_bin_type=True)
    try:
        header, _ = _read_frame(len(packed).to_bytes(4, "big") + packed)
    except KVTransferError:
        return
    assert isinstance(header, dict)


LAYOUT = BlockLayout.of(group_layers([FullAttentionSpec(4, 1, 8, "float32")] * 2), "fuzz-model")


@FUZZ
@given(data=st.data())
def test_store_files_from_hostile_bytes_are_refused_and_never_loaded(tmp_path_factory, data):
    store = FileStore(tmp_path_factory.mktemp("store"), LAYOUT, capacity_bytes=1 << 20)
    block_hash = b"h" * 16
    payload = bytes(range(256)) * (LAYOUT.block_bytes // 256) + b"\x07" * (LAYOUT.block_bytes % 256)
    assert store.write(block_hash, payload)
    path = store.path_of(block_hash)
    original = path.read_bytes()
    # A file with the right magic and a header that is JSON of any shape (or deeply nested).
    header = st.one_of(
        st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=20).map(lambda v: json.dumps(v).encode()),
        st.integers(1, 50_000).map(lambda n: b"[" * n))
    forged = st.tuples(header, st.binary(max_size=64)).map(
        lambda hp: MAGIC + len(hp[0]).to_bytes(4, "little") + hp[0] + hp[1])
    path.write_bytes(data.draw(st.one_of(st.binary(max_size=2048), _mutations(original),
                                         forged)))
    try:
        got = store.read(block_hash)
    except StoreFileError:
        assert not path.exists()  # a bad file is deleted, not offered again
        return
    assert got == payload  # only an unchanged payload is ever loaded


EVENTS = msgpack.packb({"events": [
    {"type": "BlockStored", "block_hashes": [b"a" * 8, b"b" * 8], "medium": "GPU"},
    {"type": "BlockRemoved", "block_hashes": [b"a" * 8]}, {"type": "AllBlocksCleared"}]})


@FUZZ
@given(st.one_of(
    st.binary(max_size=256), _mutations(EVENTS),
    st.recursive(st.none() | st.integers(-2**63, 2**63 - 1) | st.binary(max_size=8)
                 | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=4)
                 | st.dictionaries(st.sampled_from(["events", "type", "block_hashes", "medium",
                                                    "x"]), inner, max_size=4),
                 max_leaves=30).map(msgpack.packb)))
def test_kv_event_batches_from_hostile_bytes_are_decoded_or_refused(payload):
    try:
        events = parse_event_batch(payload)
    except ValueError:
        return
    index = WorkerCacheIndex()
    assert index.apply(0, events)  # what the decoder lets through applies cleanly


def test_a_kv_server_survives_hostile_requests_and_lends_only_its_lease():
    """Random request frames at a live KV server (its serving threads, a real socket):
    each gets an answer or a closed connection, none gets a byte of a block unless it names
    the lease and the secret, and a proper pull still works afterwards."""
    import torch

    from openinfer.transfer.kv_server import KVServer

    bpb = LAYOUT.block_bytes
    cache = (torch.arange(8 * bpb) % 251).to(torch.uint8).view(8, bpb)
    server = KVServer(LAYOUT, [cache], "127.0.0.1", 0, lease_s=60, secret="k")
    lease, hashes = "ab" * 16, [b"h" * 16, b"i" * 16]
    server.add_lease(lease, {hashes[0]: (3,), hashes[1]: (5,)})
    value = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
                      st.text(max_size=8), st.binary(max_size=16), st.sampled_from(
                          [lease, "k", "pull", "release", "shm", "tcp", hashes, LAYOUT.describe()]),
                      st.lists(st.binary(max_size=16), max_size=3))
    # Mostly well-addressed frames (the right op, lease and secret) with hostile fields, so
    # the checks past the first ones are reached too.
    def mostly(right):  # the right value 3 times in 4
        return st.integers(0, 3).flatmap(lambda k: right if k else value)

    header = st.fixed_dictionaries(
        {"op": mostly(st.sampled_from(["pull", "release"])), "lease": mostly(st.just(lease)),
         "secret": mostly(st.just("k")), "layout": mostly(st.just(LAYOUT.describe()))},
        optional={k: value for k in ("hashes", "mode", "shm", "release", "nbytes")})

    @settings(max_examples=300, deadline=None)
    @given(header)
    def ask(frame):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            try:
                send_frame(sock, frame)
                while True:
                    reply, payload = recv_frame(sock)
                    if reply["op"] == "block":  # only for the lease, with the secret
                        assert frame.get("lease") == lease and frame.get("secret") == "k"
                    if reply["op"] in ("end", "ok"):
                        break
            except (KVTransferError, OSError):
                pass  # closed on us: a refusal

    crashed: list[BaseException] = []  # a serving thread's uncaught exception
    hook, threading.excepthook = threading.excepthook, lambda args: crashed.append(args.exc_value)
    try:
        before = server.bytes_sent
        ask()
        assert not crashed, crashed
        proper = {"op": "pull", "lease": lease, "hashes": hashes, "layout": LAYOUT.describe(),
                  "mode": "tcp", "secret": "k", "release": False}
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            send_frame(sock, proper)
            got = [recv_frame(sock) for _ in range(3)]
        assert [h["op"] for h, _ in got] == ["block", "block", "end"]
        assert bytes(got[0][1]) == cache[3].numpy().tobytes()
        assert server.bytes_sent >= before + 2 * bpb
    finally:
        threading.excepthook = hook
        server.close()
