"""The front end's handle on an engine-core process (asyncio, msgpack over ZMQ IPC).

    client = EngineCoreClient(engine_options)
    await client.start()                      # spawns the process, waits for "ready"
    queue = client.add_request(rid, token_ids, params)
    out = await queue.get()                   # EngineCoreOutput, until finish_reason is set
    client.abort([rid]); await client.shutdown()

One background task reads the core's output socket and routes each output to the
queue of its request, so no request ever waits on another's consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

from openinfer.engine import protocol
from openinfer.engine.core_launch import CoreLaunch
from openinfer.engine.outputs import EngineCoreOutput
from openinfer.sampling_params import SamplingParams

DEATH_CHECK_MS = 1000  # how often a quiet output socket makes us check the core is alive
RESTART_WINDOW_S = 600.0
"""Restarts are bounded per window: a core that keeps dying is left dead (and reported)."""
MAX_RESTART_BACKOFF_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine-core process failed; its requests cannot complete."""


class EngineCoreClient:
    def __init__(self, engine_options: dict, startup_timeout_s: float = 600.0,
                 max_restarts: int = 0, launch: CoreLaunch | None = None) -> None:
        """``max_restarts``: how many times within ``RESTART_WINDOW_S`` a core that died is
        started again (after 1, 2, 4, ... s); 0: a dead core stays dead. ``launch``: a core
        interpreter started earlier (openinfer.engine.core_launch), used by the first start."""
        self.engine_options = engine_options
        self._launch = launch
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.num_restarts = 0
        """Cores started again after one died."""
        self._failures: list[float] = []  # when cores died, within the window
        self._restarter: asyncio.Task | None = None
        self.info: dict = {}
        """What the core reported when ready: num_blocks, block_size, max_model_len,
        compute_info (dtype, gemm, cpu_capability, attention: EngineCore.compute_info)."""
        self.stats: dict = {}
        """The core's latest scheduler stats (running, waiting, KV usage, preemptions)."""
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput | Exception]] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._next_call_id = 0
        self._dead: str | None = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="openinfer-")
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._receiver: asyncio.Task | None = None

    async def start(self) -> None:
        base = Path(self._tmpdir.name)
        self._addresses = f"ipc://{base}/input", f"ipc://{base}/output"
        self._input.bind(self._addresses[0])
        self._output.bind(self._addresses[1])
        await self._start_core()
        self._receiver = asyncio.create_task(self._receive_loop())

    async def _start_core(self) -> None:
        """Start a core on our sockets (the launch given, else a new one) and wait for its
        READY."""
        launch, self._launch = self._launch or CoreLaunch(), None
        self._process = launch.start(self.engine_options, *self._addresses)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if await self._output.poll(500):
                kind, body = protocol.decode(await self._output.recv())
                if kind == protocol.READY:
                    self.info = body
                    return
                if kind in (protocol.OUTPUTS, protocol.UTILITY_RESULT):
                    continue  # a dead predecessor's last words
                raise EngineDeadError(f"engine core failed to start: {body}")
            if not self._process.is_alive():
                raise EngineDeadError(f"engine core exited during startup "
                                      f"(exit code {self._process.exitcode})")
            if time.monotonic() > deadline:
                self._process.kill()
                raise EngineDeadError("engine core did not start in time")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    queue: asyncio.Queue[EngineCoreOutput | Exception] | None = None,
                    ) -> asyncio.Queue[EngineCoreOutput | Exception]:
        """Send a validated request; its outputs (or an EngineDeadError) arrive on ``queue``
        (a new one unless given: several requests may share one)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue = asyncio.Queue() if queue is None else queue
        self._queues[request_id] = queue
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._send(protocol.ADD, protocol.add_body(request_id, prompt_token_ids, params, arrival))
        return queue

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (client gone, stop string); their blocks are freed in the core."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if request_ids and self._dead is None:
            self._send(protocol.ABORT, list(request_ids))

    async def call(self, method: str, *args: object, timeout_s: float = 60.0):
        """Run a utility method in the core between steps (e.g. reset_prefix_cache), with
        msgpack-safe ``args``."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        call_id = self._next_call_id
        self._next_call_id += 1
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(protocol.UTILITY, {"call_id": call_id, "method": method, "args": list(args)})
        try:
            reply = await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        if "error" in reply:
            raise RuntimeError(f"engine call {method} failed: {reply['error']}")
        return reply["result"]

    def _send(self, kind: str, body: object) -> None:
        # PUSH to a connected peer queues without blocking; the frame leaves in order.
        self._input.send(protocol.encode(kind, body), copy=False)

    async def _receive_loop(self) -> None:
        try:
            while True:
                if not await self._output.poll(DEATH_CHECK_MS):
                    if not self._process.is_alive():  # killed without a word (OOM, SIGKILL)
                        self._fail(f"engine core exited (exit code {self._process.exitcode})")
                        return
                    continue
                kind, body = protocol.decode(await self._output.recv())
                if kind == protocol.ERROR:
                    self._fail(f"engine core died: {body}")
                    return
                if kind == protocol.UTILITY_RESULT:
                    future = self._calls.get(body["call_id"])
                    if future is not None and not future.done():
                        future.set_result(body)
                    continue
                self.stats = body["stats"]
                for packed in body["outputs"]:
                    out = protocol.unpack_output(packed)
                    queue = self._queues.get(out.request_id)
                    if queue is None:
                        continue  # aborted meanwhile
                    if out.finish_reason is not None:
                        del self._queues[out.request_id]
                    queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken frame must not leave requests hanging
            self._fail(f"engine output stream broke: {e}")

    def _fail(self, reason: str) -> None:
        self._dead = reason
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(EngineDeadError(reason))
        self._queues.clear()
        if self.max_restarts:
            self._restarter = asyncio.create_task(self._restart(reason))

    async def _restart(self, reason: str) -> None:
        """Start a new core after a backoff, while the window's restarts last; requests in
        flight have failed already, and new ones are refused until it is READY."""
        while True:
            now = time.monotonic()
            self._failures = [t for t in self._failures if now - t < RESTART_WINDOW_S] + [now]
            if len(self._failures) > self.max_restarts:
                self._dead = (f"{reason}; not restarted: {len(self._failures)} engine core "
                              f"failures within {RESTART_WINDOW_S:.0f} s")
                return
            delay = min(MAX_RESTART_BACKOFF_S, 2.0 ** (len(self._failures) - 1))
            self._dead = f"{reason}; restarting the engine core in {delay:.0f} s"
            await asyncio.sleep(delay)
            if self._process is not None and self._process.is_alive():
                self._process.kill()
            await asyncio.get_running_loop().run_in_executor(None, self._process.join)
            try:
                await self._start_core()
            except EngineDeadError as e:
                reason = str(e)
                continue
            self.stats = {}
            self.num_restarts += 1
            self._dead = None
            self._receiver = asyncio.create_task(self._receive_loop())
            return

    @property
    def dead_reason(self) -> str | None:
        """Why the core can serve nothing more, or None while it is healthy."""
        return self._dead

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core process (it finishes nothing further) and release sockets."""
        if self._restarter is not None:
            self._restarter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restarter
        if self._launch is not None:  # never started
            self._launch.cancel()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        if self._process is not None and self._process.is_alive():
            self._send(protocol.SHUTDOWN, None)
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        self._tmpdir.cleanup()
