"""In-process engine: validation and tokenization in front of an EngineCore.

``add_request`` checks everything a request could get wrong before anything is
queued, so a bad request raises ``ValueError`` (naming the field) and leaves the
engine serving everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from openinfer.config import EngineConfig
from openinfer.engine.core import EngineCore
from openinfer.engine.output_processor import OutputProcessor
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or config.model.path)
        self.core = EngineCore(config, progress=progress)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = config.model.vocab_size

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        text, token_ids = self.process_prompt(prompt)
        self.add_tokenized_request(request_id, text, token_ids, params)

    def add_tokenized_request(self, request_id: str, text: str | None, token_ids: list[int],
                              params: SamplingParams) -> None:
        self.validate(token_ids, params)
        if request_id in self.output_processor._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        arrival = time.monotonic()
        self.output_processor.add_request(request_id, text, token_ids, params, child_ids, arrival)
        for i, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else params.child(i)
            self.core.add_request(child_id, token_ids, child_params, arrival)

    def process_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer (skip_tokenizer_init is set); "
                                 "pass token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence) and all(_is_int(t) for t in prompt):
            if not prompt:
                raise ValueError("prompt must not be empty")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Check the request against the model (raises ValueError naming the field)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        max_len = self.config.model.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room to generate "
                             f"within max_model_len ({max_len})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name} ({value}) exceeds the vocabulary size ({self.vocab_size})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        output, child_ids = self.output_processor.abort(request_id)
        self.core.abort_requests(child_ids)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        finished, to_abort = self.output_processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return finished

    def check_integrity(self) -> None:
        self.core.check_integrity()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # heavy import, only when text is used

    return AutoTokenizer.from_pretrained(path)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
