"""The listening socket, bound before anything slow, and uvicorn serving on it.

Binding first means a port already in use fails in a second, not after a model load,
and clients that connect while the model loads wait in the backlog instead of being
refused.
"""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI


def bind_socket(host: str, port: int, announce: bool = True) -> socket.socket:
    """A listening TCP socket on (host, port); ValueError naming them when that fails.

    Unless ``announce`` is False, prints ``openinfer: listening on http://HOST:PORT`` to
    stderr, whatever the log level: with ``--port 0`` the kernel picks a free port, and
    this line is how a script (the tests among them) learns which, race-free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if announce:
        _announce(sock)
    return sock


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket a parent process bound and handed over (``pass_fds``)."""
    sock = socket.socket(fileno=fd)
    _announce(sock)
    return sock


def _announce(sock: socket.socket) -> None:
    print(f"openinfer: listening on {base_url(sock)}", file=sys.stderr, flush=True)


def base_url(sock: socket.socket) -> str:
    """http://host:port of a bound socket (the port the kernel picked when asked for 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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
