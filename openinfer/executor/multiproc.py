"""Tensor parallelism: one worker process per rank, driven by the engine core.

    EngineCore ── collective_rpc(method, args) ──┬── pipe ──> rank 0: Worker ─┐
        (one scheduler; the core holds no         ├── pipe ──> rank 1: Worker ─┤ torch.distributed
         tensor and no process group)             └── ...                     ─┘ (gloo / NCCL)

Every call goes to every rank (a step's forward needs them all at once for its
collectives) and the core reads rank 0's result. Each rank samples from the same
all-gathered logits with the same seed, so every rank's runner appends the same tokens
and the next step's inputs agree without a broadcast.

Failure: the core waits on the ranks' pipes and their process sentinels together, so a
rank that dies or raises fails the call at once (no wait on a collective that will never
complete); the executor then kills every rank. Ranks also die with the core (Linux
parent-death signal), so none is left behind.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import random
import socket
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

from openinfer.config import EngineConfig
from openinfer.engine.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from openinfer.executor.base import Executor
from openinfer.executor.checks import check_context_parallel, check_tensor_parallel
from openinfer.executor.nodes import JOIN_TIMEOUT_S, RemoteRanks, init_method
from openinfer.executor.rank import rank_main

logger = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A rank (tensor or context parallel) died or raised: the engine cannot go on."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        check_tensor_parallel(config)
        check_context_parallel(config)
        self.size = config.num_ranks
        self.kind = ("context-parallel" if config.prefill_context_parallel_size > 1
                     else "tensor-parallel")
        if config.seed is None:  # unseeded sampling must draw the same on every rank
            config = replace(config, seed=random.randrange(2**31))
        local = config.nodes.local_ranks(self.size)
        remote: RemoteRanks | None = None
        if config.nodes.nnodes > 1:
            init = init_method(config.nodes)
            remote = RemoteRanks(config, range(local.stop, self.size))
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ctx = mp.get_context("spawn")
        if mp.current_process().daemon:
            # The server's engine core is a daemonic process, and multiprocessing lets those
            # start no process. Its ranks cannot outlive it anyway (see rank_main).
            mp.current_process().daemon = False
        self._pipelined = config.scheduler.async_scheduling
        self._pending: deque[_PendingStep] = deque()
        """Steps sent (asynchronous scheduling) whose answers are not read yet."""
        self._conns: list[Connection] = []
        self._procs: list[mp.Process] = []  # this node's ranks (0..k-1)
        for rank in local:
            parent, child = ctx.Pipe()
            # Not daemonic (a daemonic rank could not be joined at exit), but killed at exit
            # by the finalizer below, and by the kernel if the core dies (die_with).
            proc = ctx.Process(target=rank_main, name=f"openinfer-tp{rank}",
                               args=(config, rank, init, child, os.getpid(),
                                     progress and rank == 0, len(local)))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        weakref.finalize(self, _kill_all, list(self._procs))  # also at interpreter exit
        try:
            loaded = self._join(remote) if remote is not None else {}
            self._gather(loaded)  # each rank reports once its shard is loaded
        except BaseException:
            self._kill()
            if remote is not None:
                remote.close(joined=True)  # their ranks end when their connection closes
            raise
        if remote is not None:
            remote.close()
        logger.info("%s: %d ranks (%s) on %d node(s), local worker pids %s", self.kind,
                    self.size, "NCCL" if config.device.startswith("cuda") else "gloo",
                    config.nodes.nnodes, [p.pid for p in self._procs])

    def _join(self, remote: RemoteRanks) -> dict[int, Any]:
        """Adds the other nodes' connections, rank order, once all have joined; a local rank
        that fails first fails the start at once. The local ranks may report their shards
        loaded before the last connection is registered (its rank joined the group first):
        those answers are returned, for the gather that waits for the rest."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        sentinels = [p.sentinel for p in self._procs]
        loaded: dict[int, Any] = {}
        while not remote.complete:
            ready = wait(sentinels if loaded else [*self._conns, *sentinels], timeout=0.2)
            if ready and loaded:  # a local rank that had loaded died
                raise self._died(sentinels.index(ready[0]))
            if ready:
                loaded = dict(enumerate(self._gather()))  # raises: a local rank died or failed
            if time.monotonic() > deadline:
                raise RankFailed(f"ranks {remote.missing} did not join within "
                                 f"{JOIN_TIMEOUT_S:.0f} s: start `openinfer serve` with the "
                                 f"same parallel flags, --nnodes and --master-addr/--master-"
                                 f"port, and each node's --node-rank, on the other nodes")
        self._conns += [remote.conns[rank] for rank in sorted(remote.conns)]
        return loaded

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._read_pending()  # the ranks answer in order: the steps sent before come first
        self._send(method, args)
        return self._gather()

    def submit_step(self, sched: SchedulerOutput,
                    masks: Future[GrammarBitmask | None] | None = None) -> Future[ModelRunnerOutput]:
        """Asynchronous scheduling: send the step and return at once; its answers are read
        when its tokens are asked for (or before the next call), so the ranks compute it
        while the core schedules the next one (no grammar masks: those would need the ranks
        to wait for the core mid-step)."""
        if not self._pipelined or masks is not None:
            return super().submit_step(sched, masks)
        self._send("run_step", (sched,))
        step = _PendingStep(self)
        self._pending.append(step)
        return step

    def _read_pending(self, until: _PendingStep | None = None) -> None:
        """Read the answers of the steps sent and not read yet, oldest first (up to
        ``until``)."""
        while self._pending:
            step = self._pending.popleft()
            try:
                step.set_result(self._gather()[0])
            except BaseException as e:  # raised where its tokens are read
                step.set_exception(e)
            if step is until:
                return

    def _send(self, method: str, args: tuple) -> None:
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError as e:  # a rank's end of the pipe is gone
            self._kill()
            raise RankFailed(f"{self.kind} rank unreachable: {e}") from e

    def _gather(self, answered: dict[int, Any] | None = None) -> list[Any]:
        """Every rank's answer to the last call (those in ``answered`` already read), rank 0
        first; a rank that died or raised fails it at once (and takes the others down)."""
        results: dict[int, Any] = dict(answered or {})
        waiting = {conn: rank for rank, conn in enumerate(self._conns) if rank not in results}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            for ready in wait([*waiting, *sentinels]):
                rank = waiting.get(ready)
                if rank is not None:
                    try:
                        status, value = pickle.loads(ready.recv_bytes())
                    except (EOFError, OSError):
                        status, value = "died", None
                    del waiting[ready]
                else:
                    rank = sentinels.pop(ready)
                    if self._conns[rank] not in waiting or self._conns[rank].poll():
                        continue  # it answered (or its answer is still to be read)
                    status, value = "died", None
                if status == "ok":
                    results[rank] = value
                    continue
                if status == "died":
                    raise self._died(rank)
                self._kill()
                raise RankFailed(f"{self.kind} rank {rank} failed: {value}")
        return [results[rank] for rank in range(len(self._conns))]

    def _died(self, rank: int) -> RankFailed:
        """Takes every rank down; the error naming the one that died."""
        self._kill()
        if rank >= len(self._procs):  # its node closed the connection
            return RankFailed(f"{self.kind} rank {rank} (another node) died")
        code = self._procs[rank].exitcode
        return RankFailed(f"{self.kind} rank {rank} died (exit code {code})")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def shutdown(self) -> None:
        if not self.alive:
            self._kill()
            return
        try:
            self.collective_rpc("shutdown")
        finally:
            for proc in self._procs:
                proc.join(timeout=10)
            self._kill()

    def _kill(self) -> None:
        _kill_all(self._procs)
        for conn in self._conns[len(self._procs):]:  # other nodes' ranks end when it closes
            conn.close()


class _PendingStep(Future):
    """A step the ranks compute while the core goes on: its answers are read (in order,
    behind every step sent before it) when its result is asked for."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            self._executor._read_pending(until=self)
        return super().result(timeout)


def _kill_all(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)
