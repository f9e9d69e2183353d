"""The engine core: model + KV cache + scheduler, driven one step at a time.

    step():  scheduler.schedule() -> runner.execute() -> scheduler.update_from_output()

It speaks token ids only; text lives in the front end (offline LLM or API server).
"""

from __future__ import annotations

import logging
import time

import torch

from openinfer.config import (
    CUDA_MEMORY_UTILIZATION,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    EngineConfig,
)
from openinfer.engine.outputs import EngineCoreOutput
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.runner import ModelRunner
from openinfer.engine.scheduler import Scheduler
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.spec import FullAttentionSpec, LayerGroup, group_layers
from openinfer.models.loader import load_model
from openinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        mc = config.model
        model = load_model(mc, config.device, progress=progress)
        dtype_name = str(mc.dtype).removeprefix("torch.")
        specs = [FullAttentionSpec(config.cache.block_size, mc.num_kv_heads, mc.head_dim, dtype_name)
                 for _ in range(mc.num_layers)]
        groups = group_layers(specs)
        num_blocks = self._num_blocks(groups)
        capacity = num_blocks * config.cache.block_size
        if capacity < mc.max_model_len:
            raise ValueError(
                f"kv_cache_memory holds {capacity} tokens, fewer than max_model_len "
                f"({mc.max_model_len}): raise kv_cache_memory or lower max_model_len")
        self.kv = KVCacheManager(groups, num_blocks, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(model, groups, num_blocks, mc.num_layers, mc.dtype, config.device,
                                  seed=config.seed)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks,
                    config.cache.block_size, capacity)

    def _num_blocks(self, groups: list[LayerGroup]) -> int:
        bytes_per_block = sum(g.bytes_per_block for g in groups)
        memory = self.config.cache.kv_cache_memory
        if memory is None:
            if self.config.device.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info()
                memory = int(free * CUDA_MEMORY_UTILIZATION)
            else:
                memory = DEFAULT_CPU_KV_CACHE_MEMORY
        return memory // bytes_per_block

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a validated request; its output is capped by the context length."""
        room = self.config.model.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(request_id, prompt_token_ids, params, max_tokens,
                      frozenset(self.config.model.eos_token_ids),
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._release_if_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        outputs = self.scheduler.update_from_output(scheduled, result)
        self._release_if_idle()
        return outputs

    def _release_if_idle(self) -> None:
        # The runner learns of finished requests at the next step; with no next step
        # in sight, send it an empty one so it drops their state now.
        if not self.scheduler.has_unfinished_requests():
            self.runner.execute(self.scheduler.schedule())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
