"""One worker in the engine core's process."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from openinfer.config import EngineConfig
from openinfer.engine.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from openinfer.executor.base import Executor
from openinfer.worker.worker import Worker


class UniprocExecutor(Executor):
    """One worker in the engine core's process: in its thread, or with asynchronous
    scheduling on a model thread of its own."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.worker = Worker(config, progress)
        self._model_thread = (ThreadPoolExecutor(1, thread_name_prefix="openinfer-model")
                              if config.scheduler.async_scheduling else None)
        self._closed = False

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        call = getattr(self.worker, method)
        if self._model_thread is None:
            return [call(*args)]
        return [self._model_thread.submit(call, *args).result()]

    @property
    def defers_masks(self) -> bool:
        return self._model_thread is not None

    def submit_step(self, sched: SchedulerOutput,
                    masks: Future[GrammarBitmask | None] | None = None) -> Future[ModelRunnerOutput]:
        if self._model_thread is None:
            return super().submit_step(sched, masks)
        return self._model_thread.submit(self._run_step, sched, masks)

    def _run_step(self, sched: SchedulerOutput,
                  masks: Future[GrammarBitmask | None] | None) -> ModelRunnerOutput:
        self.worker.execute_model(sched)
        return self.worker.sample_tokens(masks.result() if masks is not None else None)

    @property
    def alive(self) -> bool:
        return self._model_thread is None or not self._closed

    def shutdown(self) -> None:
        super().shutdown()
        if self._model_thread is not None:
            self._model_thread.shutdown()
            self._closed = True
