"""Executors: how the engine core reaches its workers.

The core calls a method by name on every worker (``collective_rpc``) and reads rank 0's
answer; it holds no tensor but a step's packed grammar mask. ``UniprocExecutor`` runs
one worker in this process.
A multi-process executor for tensor/expert parallelism (one worker per rank, the
scheduler output broadcast, outputs from rank 0) implements the same methods. A step is
two calls, ``execute_model`` (the forward pass) then ``sample_tokens``, so that the core
computes the step's grammar masks while the model runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from openinfer.config import EngineConfig
from openinfer.engine.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from openinfer.engine.worker import Worker


class Executor(ABC):
    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker with ``args``; their results, rank 0 first."""

    def call(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every worker; rank 0's result."""
        return self.collective_rpc(method, *args)[0]

    def execute_model(self, sched: SchedulerOutput) -> None:
        """Start the step: its KV plan and forward pass."""
        self.collective_rpc("execute_model", sched)

    def sample_tokens(self, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        """Finish the step: sample under the grammar masks (computed meanwhile by the core)."""
        return self.call("sample_tokens", grammar)

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
