"""Executors: how the engine core reaches its workers (openinfer/executor/base.py), in this
process (uniproc), one process per rank (multiproc, with ranks on other nodes: nodes), or
as Ray actors (ray)."""

from __future__ import annotations

from openinfer.config import EngineConfig
from openinfer.executor.base import Executor
from openinfer.executor.checks import check_expert_parallel
from openinfer.executor.multiproc import MultiprocExecutor
from openinfer.executor.ray import RayExecutor
from openinfer.executor.uniproc import UniprocExecutor


def make_executor(config: EngineConfig, progress: bool = True) -> Executor:
    check_expert_parallel(config)
    if config.num_ranks != 1 and config.distributed_executor_backend == "ray":
        return RayExecutor(config, progress)
    if config.num_ranks != 1:
        return MultiprocExecutor(config, progress)
    return UniprocExecutor(config, progress)
