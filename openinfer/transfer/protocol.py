"""The KV transfer wire format: length-prefixed msgpack headers, raw block bytes.

Every message is one frame:

    [4-byte big-endian header length][msgpack header][payload: header["nbytes"] bytes]

No pickle crosses the socket. A decode instance opens a connection to a prefill
instance's KV server and sends

    {"op": "pull", "lease": id, "hashes": [block hash, ...], "layout": BlockLayout.describe(),
     "mode": "tcp" | "shm", "shm": name, "release": bool}

and the server answers one frame per block it holds, in order, so the puller can copy
each block while the next is on the wire:

    {"op": "block", "i": k, "hash": h, "crc": crc32}  + the block's bytes: its page in
        every layer group of the layout, in order (mode "shm": no payload; the bytes are
        in the named shared memory at k * block bytes)

then {"op": "end", "n": blocks sent, "error": reason or None}. With "release" the
lease ends once the blocks are sent; {"op": "release", "lease": id} ends one
explicitly (answered by {"op": "ok"}).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 30


class KVTransferError(Exception):
    """A pull failed: unreachable peer, timeout, a malformed or corrupt frame."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    header = {**header, "nbytes": len(payload)}
    packed = msgpack.packb(header, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(packed)) + packed)
    if len(payload):
        sock.sendall(payload)


def recv_frame(sock: socket.socket, max_payload: int = MAX_PAYLOAD_BYTES) -> tuple[dict, bytearray]:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise KVTransferError(f"frame header of {length} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(bytes(_recv_exact(sock, length)), raw=False)
    except (ValueError, msgpack.ExtraData) as e:
        raise KVTransferError(f"unreadable frame header: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("nbytes", 0), int):
        raise KVTransferError("frame header is not a map with an integer nbytes")
    nbytes = header.get("nbytes", 0)
    if not 0 <= nbytes <= max_payload:
        raise KVTransferError(f"frame payload of {nbytes} bytes (at most {max_payload})")
    return header, _recv_exact(sock, nbytes)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError as e:
            raise KVTransferError("timed out waiting for the peer") from e
        except OSError as e:
            raise KVTransferError(f"connection failed: {e}") from e
        if k == 0:
            raise KVTransferError("the peer closed the connection mid-frame")
        got += k
    return buf
