"""Executors: how the engine core reaches its workers.

The core calls a method by name on every worker (``collective_rpc``) and reads rank 0's
answer; it never holds a tensor. ``UniprocExecutor`` runs one worker in this process.
A multi-process executor for tensor/expert parallelism (one worker per rank, the
scheduler output broadcast, outputs from rank 0) implements the same two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from openinfer.config import EngineConfig
from openinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from openinfer.engine.worker import Worker


class Executor(ABC):
    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker with ``args``; their results, rank 0 first."""

    def call(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every worker; rank 0's result."""
        return self.collective_rpc(method, *args)[0]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.call("execute_model", sched)

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")


class UniprocExecutor(Executor):
    """One worker, in the engine core's process and thread."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.worker = Worker(config, progress)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]


def make_executor(config: EngineConfig, progress: bool = True) -> Executor:
    return UniprocExecutor(config, progress)
