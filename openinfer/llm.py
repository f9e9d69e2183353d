"""The offline API: ``LLM(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from openinfer.engine.input_processor import PromptInput
from openinfer.engine.llm_engine import LLMEngine
from openinfer.engine_args import create_engine_config
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams


class LLM:
    """A model loaded in this process, generating for batches of prompts.

    ``engine_options`` are those of ``create_engine_config`` and mirror the server's
    flags: ``dtype`` ('auto' = the checkpoint's dtype on CUDA; on CPU bfloat16 for a bfloat16
    checkpoint where the CPU has AVX512_BF16 or AMX, else float32),
    ``max_model_len``, ``kv_cache_memory`` (bytes), ``block_size``,
    ``max_num_batched_tokens`` (step token budget), ``max_num_seqs``,
    ``scheduling_policy`` ('fcfs' | 'priority'), ``enable_chunked_prefill``, ``seed``
    (for unseeded sampling), ``tokenizer``, ``skip_tokenizer_init``, ``batch_invariant``
    (a request's logits bitwise the same whatever else is in the batch; CPU only).
    """

    def __init__(self, model: str, *, progress: bool = True, **engine_options) -> None:
        self.engine = LLMEngine(create_engine_config(model, **engine_options), progress=progress)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``prompts`` is a string, a list of token ids, or a list of either. Every prompt
        is validated before any is queued, so a ValueError leaves the engine idle.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params: got {len(params_list)} for "
                                 f"{len(prompt_list)} prompts")
        engine = self.engine
        processed = [engine.inputs.process(prompt, params)
                     for prompt, params in zip(prompt_list, params_list)]

        ids = [f"gen-{next(self._counter)}" for _ in prompt_list]
        for request_id, (text, token_ids), params in zip(ids, processed, params_list):
            engine.add_processed_request(request_id, text, token_ids, params)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    results[output.request_id] = output
                    bar.update(1)
        return [results[i] for i in ids]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, Sequence) and not prompts:
        raise ValueError("prompt must not be empty")
    return list(prompts)
