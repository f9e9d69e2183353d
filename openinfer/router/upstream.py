"""A replica's response, waited on only while the replica stays in rotation.

A replica that accepts connections but never answers (a hung process, a half-open network
path) would hold a request forever: the router's reads from replicas have no timeout,
because a legitimate non-streamed answer, or a stream's next token, can take any time.
The health loop tells a hung replica from a slow one (its /health has a 2 s timeout), so
a request waits on a replica only until the health loop ejects it.

Each response is read by a task of its own into a short queue: whoever waits on it can
stop waiting (the replica ejected, the client gone) without interrupting a read, and the
connection is opened, read and closed in that one task, as httpx requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable
from typing import TypeVar

import httpx

from openinfer.router.policies import Worker

T = TypeVar("T")
POLL_S = 0.25
QUEUED_CHUNKS = 64
"""Chunks read ahead of the client: beyond them the replica waits (backpressure)."""


class ReplicaEjected(Exception):
    """The replica was taken out of rotation while a request waited on it."""


class ReplicaResponse:
    """POST ``content`` to ``url`` and read the response in a task of its own."""

    def __init__(self, http: httpx.AsyncClient, url: str, content: bytes,
                 headers: dict) -> None:
        self.response: httpx.Response | None = None
        """Set (status and headers) before the first chunk is queued."""
        self._queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(QUEUED_CHUNKS)
        self._closing = False
        self._task = asyncio.create_task(self._read(http, url, content, headers))

    async def _read(self, http: httpx.AsyncClient, url: str, content: bytes,
                    headers: dict) -> None:
        try:
            response = await http.send(http.build_request("POST", url, content=content,
                                                          headers=headers), stream=True)
        except Exception as e:  # handed to the waiter
            await self._queue.put(e)
            return
        try:
            self.response = response
            async for chunk in response.aiter_raw():
                if self._closing:
                    break  # (close() shut the connection down; the response closes below)
                await self._queue.put(chunk)
            else:
                await self._queue.put(None)
        except Exception as e:
            await self._queue.put(e)
        finally:
            _shut_down(response)
            await response.aclose()


    async def next_chunk(self, worker: Worker, grace_s: float = 0.0) -> bytes | None:
        """The next bytes (None at the end); raises what the read raised, or ReplicaEjected
        once ``worker`` is unhealthy and nothing came for ``grace_s``."""
        start = time.monotonic()
        while True:
            try:
                item = self._queue.get_nowait()  # (read ahead: no timer to set)
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(POLL_S):  # (a cancelled get loses no item)
                        item = await self._queue.get()
                except TimeoutError:
                    if not worker.healthy and time.monotonic() - start >= grace_s:
                        raise ReplicaEjected(
                            f"replica {worker.url} was ejected (not answering)") from None
                    continue
            if isinstance(item, BaseException):
                raise item
            return item

    async def close(self) -> None:
        """Stop reading and close the connection (the replica sees its client gone).

        A response being read is ended by shutting its socket down, not by cancelling its
        reader: the read fails or the reader sees ``_closing``, and it closes the response
        as after any failed read. A cancelled reader left its connection open and in the
        pool for good (httpcore's close was cut short by the cancellation): one socket
        leaked per client that hung up mid-stream. Not answered yet, there is no socket to
        shut down, and the reader is cancelled.

        The reader is waited on with asyncio.wait, never awaited: awaiting a task passes a
        cancellation of the waiter (a client that hung up cancels the relay, again at each
        await) on to the task, which would cut the reader's own close short."""
        self._closing = True
        if self.response is None:
            self._task.cancel()
        else:
            _shut_down(self.response)
        with contextlib.suppress(asyncio.QueueEmpty):  # room for a reader waiting to put
            while True:
                self._queue.get_nowait()
        await asyncio.wait({self._task})


async def unless_ejected(worker: Worker, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result (it runs as a task of its own), or ReplicaEjected (it is
    cancelled) once ``worker`` is unhealthy."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if not worker.healthy:
                raise ReplicaEjected(f"replica {worker.url} was ejected (not answering)")
    finally:
        if not task.done():
            task.cancel()  # once: waited on, not awaited (see ReplicaResponse.close)
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # (retrieved: a late failure is not logged as unhandled)


def _shut_down(response: httpx.Response) -> None:
    """End a response's connection now, without an await: the client hung up, and the
    request's cancel scope (anyio's) interrupts even httpcore's shielded close, which would
    leave the replica generating for nobody. Not once the response is closed: read to its
    end, its connection went back to the pool, where another request may be using it (httpx
    marks a response closed before it releases the connection)."""
    if response.is_closed:
        return
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:  # (asyncio's socket wrapper refuses shutdown(); a duplicate may)
        with contextlib.suppress(OSError), socket.fromfd(sock.fileno(), sock.family,
                                                         sock.type) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
