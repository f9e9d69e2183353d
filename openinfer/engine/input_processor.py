"""Front-end input handling: tokenization and validation, shared by every front end.

Everything a request could get wrong is checked here, before anything is queued, so
a bad request raises ``ValueError`` (naming the field) and others are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence

from openinfer.config import EngineConfig
from openinfer.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | dict


class InputProcessor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or config.model.path)
        self.vocab_size = config.model.vocab_size

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


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine-core requests behind one user request: n parallel samples, one each."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{i}_{request_id}", params.child(i)) for i in range(params.n)]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # heavy import, only when text is used

    return AutoTokenizer.from_pretrained(path)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
