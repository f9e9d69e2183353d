"""Process plumbing shared by the engine, its ranks and the launchers: a child that dies
with its parent, ports picked free, and argv with flags removed. A leaf: imports nothing
from openinfer."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent (the front end; for a
    tensor-parallel rank, the engine core) dies, even mid-load or blocked
    in a send to the front end's vanished socket (Linux; elsewhere the idle loop's
    parent check is all there is)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the line above took effect
        os._exit(1)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` now ("" for every interface of this
    machine): all held bound together while they are picked, so none is picked twice."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def strip_flags(argv: list[str], flags: set[str]) -> list[str]:
    """argv without the given flags (and their values), leaving a leading 'serve' out too."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg and i + 1 < len(argv)
            continue
        if arg == "serve" and not out:
            continue
        out.append(arg)
    return out
