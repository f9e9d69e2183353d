"""The listening socket, bound before anything slow, and uvicorn serving on it.

Binding first means a port already in use fails in a second, not after a model load,
and clients that connect while the model loads wait in the backlog instead of being
refused.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); ValueError naming them when that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


KEEP_ALIVE_S = 75
"""Seconds an idle client connection stays open (``--timeout-keep-alive``). Longer than the
idle expiry of the clients that reuse connections (httpx, so the OpenAI SDK and the router:
5 s), so that the client is always the one to close: with uvicorn's default of 5 s both
sides give up at once, and a request sent on a connection the server is just closing fails
with ReadError or "Server disconnected" before reaching it (8 of 240 requests that came
after 4.95-5 s idle; 0 with 65 s). nginx's default is the same 75 s."""


def serve(app: FastAPI, sock: socket.socket, *, log_level: str = "info", access_log: bool = True,
          timeout_graceful_shutdown: int | None = None,
          timeout_keep_alive: int = KEEP_ALIVE_S) -> None:
    """Run ``app`` with uvicorn on an already bound socket until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=timeout_graceful_shutdown,
                            timeout_keep_alive=timeout_keep_alive)
    uvicorn.Server(config).run(sockets=[sock])
