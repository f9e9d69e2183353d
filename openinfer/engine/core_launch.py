"""Starting an engine-core process in two halves: the interpreter now, the engine later.

A spawned core spends most of its start-up importing torch, transformers and the engine
(~1.5 s on 2 cores), and so does the server's own process before it can start one. Started
one after the other they add up; ``openinfer serve`` therefore makes a ``CoreLaunch`` first
thing, before it imports the server, and the two interpreters import side by side. The core
then waits, its imports done, for what to run: the front end sends the engine options and
its socket addresses once it has checked them itself (``CoreLaunch.start``), so a bad option
is reported once, by the front end, and no model is loaded for a server that will not run.

This module imports nothing heavy: it is imported before the rest of the server.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess


class CoreLaunch:
    """A spawned interpreter importing the engine core, waiting for ``start``."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # the core owns torch/ZMQ from a clean interpreter
        reader, self._conn = ctx.Pipe(duplex=False)
        self.process: BaseProcess = ctx.Process(
            target=_wait_then_run, args=(reader, os.getpid()), name="openinfer-engine-core",
            daemon=True)
        self.process.start()
        reader.close()  # the child's end: its recv sees EOF once ours is closed

    def start(self, engine_options: dict, input_addr: str, output_addr: str) -> BaseProcess:
        """Have the core build ``EngineCore(create_engine_config(**engine_options))`` and
        serve on the two addresses (openinfer.engine.core_proc.run_engine_core)."""
        # If it died while importing, the send fails and the client finds it dead.
        with contextlib.suppress(OSError):
            self._conn.send((engine_options, input_addr, output_addr))
        self._conn.close()
        return self.process

    def cancel(self) -> None:
        """Not needed after all: the core exits without loading anything."""
        self._conn.close()


def _wait_then_run(conn: Connection, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; the front end decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from openinfer.engine.core_proc import run_engine_core

    try:
        engine_options, input_addr, output_addr = conn.recv()
    except EOFError:  # cancelled, or the front end is gone
        return
    finally:
        conn.close()
    run_engine_core(engine_options, input_addr, output_addr, parent_pid)
