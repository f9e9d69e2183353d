"""``--distributed-executor-backend ray``: the ranks of a tensor- or context-parallel group
as Ray actors, one per rank, in one placement group, so the group can span the nodes of a
Ray cluster (``--ray-address``; default: a private local Ray instance).

The engine core drives them as it drives the local executor's processes: every call goes
to every rank (a Ray method call each) and rank 0's answer is read; the ranks rendezvous
in torch.distributed at rank 0's node address (gloo on CPU, NCCL on CUDA, each actor with
the one GPU Ray gave it). A rank that dies or raises fails the call as soon as Ray reports
it, and the executor kills every actor. On a cluster every node needs openinfer installed
and the model at the same path.

Ray is an optional dependency (``pip install 'openinfer[ray]'``), imported only here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
from dataclasses import replace
from typing import Any

from openinfer.config import EngineConfig
from openinfer.executor.base import Executor
from openinfer.executor.checks import check_context_parallel, check_tensor_parallel
from openinfer.executor.multiproc import RankFailed
from openinfer.executor.rank import start_worker
from openinfer.logger import configure_logging

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600


class RankActor:
    """One rank: a plain class, wrapped with ``ray.remote`` at run time."""

    def __init__(self) -> None:
        self.worker = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0's actor)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, config: EngineConfig, rank: int, init_method: str, progress: bool) -> None:
        configure_logging()
        # Ray gives a GPU actor one device, as its cuda:0; a CPU actor its reserved cores
        # (OMP_NUM_THREADS), which it does not share with the other ranks.
        self.worker = start_worker(config, rank, init_method, progress, cuda_index=0,
                                   ranks_here=None)

    def call(self, method: str, args: tuple) -> Any:
        result = getattr(self.worker, method)(*args)
        if method == "shutdown":
            import torch.distributed as dist

            dist.destroy_process_group()
        return result

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        check_tensor_parallel(config)
        check_context_parallel(config)
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: "
                             "pip install 'openinfer[ray]'") from None
        self._ray = ray
        self.size = config.num_ranks
        if config.seed is None:  # unseeded sampling must draw the same on every rank
            config = replace(config, seed=random.randrange(2**31))
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if config.ray_address:
                ray.init(address=config.ray_address, logging_level="WARNING")
            else:  # a private instance with one CPU per rank at least, as the replicas get
                os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, self.size),
                         include_dashboard=False, logging_level="WARNING",
                         object_store_memory=128 * 2**20)
        cuda = config.device.startswith("cuda")
        bundle = {"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
        self._group = placement_group([bundle] * self.size, strategy="PACK")
        self._remove_group = remove_placement_group
        self._actors: list = []
        try:
            ray.get(self._group.ready(), timeout=START_TIMEOUT_S)
            actor = ray.remote(RankActor)
            self._actors = [actor.options(
                num_cpus=1, num_gpus=1 if cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank)).remote()
                for rank in range(self.size)]
            host, port = ray.get(self._actors[0].rendezvous_address.remote())
            self._wait([a.start.remote(config, rank, f"tcp://{host}:{port}",
                                       progress and rank == 0)
                        for rank, a in enumerate(self._actors)], START_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        self.pids = ray.get([a.pid.remote() for a in self._actors])
        logger.info("ray executor: %d ranks (%s), worker pids %s", self.size,
                    "NCCL" if cuda else "gloo", self.pids)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._wait([a.call.remote(method, args) for a in self._actors])

    def _wait(self, refs: list, timeout: float | None = None) -> list[Any]:
        """The ranks' results, rank 0 first; the first rank that dies or raises fails the
        call at once (the others may be blocked in a collective with it) and takes the
        group down."""
        ray = self._ray
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                self._kill()
                raise RankFailed(f"ray ranks did not answer in {timeout:.0f} s")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                rank = refs.index(ready[0])
                self._kill()
                raise RankFailed(f"ray rank {rank} died: {str(e).splitlines()[0]}") from None
            except ray.exceptions.RayTaskError as e:
                rank = refs.index(ready[0])
                self._kill()
                raise RankFailed(f"ray rank {rank} failed: {e.cause}") from None
        return ray.get(refs)

    @property
    def alive(self) -> bool:
        return bool(self._actors)

    def shutdown(self) -> None:
        if self._actors:
            with contextlib.suppress(RankFailed):  # a dead rank: killed below all the same
                self.collective_rpc("shutdown")
        self._kill()

    def _kill(self) -> None:
        ray = self._ray
        for actor in self._actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor)
        self._actors = []
        with contextlib.suppress(Exception):
            self._remove_group(self._group)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
