"""In-process engine (the offline API's): InputProcessor -> EngineCore -> OutputProcessor.

``add_request`` validates before anything is queued (see ``input_processor``), so a bad
request raises ``ValueError`` naming the field and leaves the engine serving everyone else.
"""

from __future__ import annotations

from openinfer.config import EngineConfig
from openinfer.engine.core import EngineCore
from openinfer.engine.input_processor import InputProcessor, PromptInput, admit
from openinfer.engine.output_processor import OutputProcessor
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        if config.data_parallel.size > 1:
            raise ValueError("the data-parallel ranks of an expert-parallel group run as "
                             "servers that step together (`openinfer serve "
                             "--data-parallel-size N --enable-expert-parallel`), not offline")
        self.config = config
        self.inputs = InputProcessor(config)
        self.tokenizer = self.inputs.tokenizer
        self.core = EngineCore(config, progress=progress)
        self.output_processor = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        text, token_ids = self.inputs.process(prompt, params)
        self.add_processed_request(request_id, text, token_ids, params)

    def add_processed_request(self, request_id: str, text: str | None, token_ids: list[int],
                              params: SamplingParams) -> None:
        """Queue a request that ``self.inputs.process`` made ready (see ``admit``)."""
        admitted = admit(self.output_processor, request_id, text, token_ids, params)
        for child_id, child_params in admitted.children:
            self.core.add_request(child_id, token_ids, child_params, admitted.arrival_time)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        output, child_ids = self.output_processor.abort(request_id)
        self.core.abort_requests(child_ids)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        processed = self.output_processor.process(self.core.step())
        if processed.to_abort:
            self.core.abort_requests(processed.to_abort)
        return processed.finished

    def check_integrity(self) -> None:
        self.core.check_integrity()
