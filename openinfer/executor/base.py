"""Executors: how the engine core reaches its workers.

The core calls a method by name on every worker (``collective_rpc``) and reads rank 0's
answer; it holds no tensor but a step's packed grammar mask. ``UniprocExecutor`` runs
one worker in this process.
A multi-process executor for tensor/expert parallelism (one worker per rank, the
scheduler output broadcast, outputs from rank 0) implements the same methods. A step is
two calls, ``execute_model`` (the forward pass) then ``sample_tokens``, so that the core
computes the step's grammar masks while the model runs.

With asynchronous scheduling the worker lives behind one model thread: ``submit_step``
queues a whole step and returns its future at once, and every other call queues behind
the steps submitted before it, so the worker sees calls in the order they were made and
never two at a time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from openinfer.engine.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


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

    @property
    def alive(self) -> bool:
        """Whether calls still reach the workers (after ``shutdown``, maybe not)."""
        return True

    @property
    def defers_masks(self) -> bool:
        """Whether ``submit_step`` takes grammar masks still being computed: a model thread
        runs the forward pass, then waits for them to sample."""
        return False

    def submit_step(self, sched: SchedulerOutput,
                    masks: Future[GrammarBitmask | None] | None = None) -> Future[ModelRunnerOutput]:
        """Run a step; the future of its tokens (done at return, unless the executor has a
        model thread). ``masks``: the step's grammar masks, where ``defers_masks``."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            self.execute_model(sched)
            future.set_result(self.sample_tokens(masks.result() if masks is not None else None))
        except BaseException as e:  # raised where the result is read, as a thread's would be
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")
