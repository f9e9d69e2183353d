"""Front-end input handling: tokenization and validation, shared by every front end.

Everything a request could get wrong is checked here, before anything is queued, so
a bad request raises ``ValueError`` (naming the field) and others are unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from openinfer.config import EngineConfig
from openinfer.engine.output_processor import OutputProcessor
from openinfer.sampling_params import SamplingParams
from openinfer.structured.grammar import GrammarCompiler
from openinfer.tokenizer import load_tokenizer

PromptInput = str | Sequence[int] | dict


class InputProcessor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or config.model.path)
        self.vocab_size = config.model.vocab_size
        self._grammar_compiler: GrammarCompiler | None = None

    def process(self, prompt: PromptInput, params: SamplingParams) -> tuple[str | None, list[int]]:
        """One request, ready to queue: tokenized, truncated to ``params.truncate_prompt_tokens``
        and validated (which resolves ``bad_words`` into ``params``). What front ends call.

        Returns the prompt text as given (None for token ids) and the token ids the engine
        sees; with truncation the text covers more than the ids. Raises ValueError naming the
        field.
        """
        _require_sampling_params(params)
        text, token_ids = self.process_prompt(prompt)
        token_ids = self.truncate(token_ids, params)
        self.validate(token_ids, params)
        return text, token_ids

    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured outputs' grammars to check them (built on first use)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init is set)")
            model = self.config.model
            self._grammar_compiler = GrammarCompiler(self.tokenizer, model.vocab_size,
                                                     list(model.eos_token_ids))
        return self._grammar_compiler

    def truncate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The last ``params.truncate_prompt_tokens`` tokens of the prompt (vLLM's left
        truncation); the prompt itself when it is no longer. Idempotent."""
        limit = self._truncation_limit(params)
        if limit is None or len(token_ids) <= limit:
            return token_ids
        return token_ids[-limit:]

    def _truncation_limit(self, params: SamplingParams) -> int | None:
        """truncate_prompt_tokens with -1 resolved: the most prompt tokens that leave room for
        max_tokens (for at least one token when max_tokens is None)."""
        limit = params.truncate_prompt_tokens
        if limit is None or limit >= 1:
            return limit
        max_len = self.config.model.max_model_len
        limit = max_len - (1 if params.max_tokens is None else params.max_tokens)
        if limit < 1:
            raise ValueError(f"truncate_prompt_tokens=-1 leaves no room for a prompt: max_tokens "
                             f"({params.max_tokens}) fills max_model_len ({max_len})")
        return limit

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
        """Check the request against the model (raises ValueError naming the field), and
        resolve ``params.bad_words`` into token sequences (stored in ``params``).

        ``token_ids`` must already be truncated (``truncate``); ``process`` does both.
        """
        _require_sampling_params(params)
        limit = self._truncation_limit(params)
        if limit is not None and len(token_ids) > limit:
            raise RuntimeError(f"truncate_prompt_tokens: the prompt ({len(token_ids)} tokens) was "
                               f"not truncated to {limit}; call InputProcessor.process (or "
                               f"truncate) before validate")
        max_len = self.config.model.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room to generate "
                             f"within max_model_len ({max_len})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name} ({value}) exceeds the vocabulary size ({self.vocab_size})")
        if params.logit_bias:
            self._check_in_vocabulary("logit_bias", params.logit_bias)
        if params.allowed_token_ids:
            self._check_in_vocabulary("allowed_token_ids", params.allowed_token_ids)
        if params.structured_outputs is not None:
            self.grammar_compiler().validate(params.structured_outputs)
        if params.bad_words:
            if self.tokenizer is not None:
                params.set_bad_words_token_ids(bad_words_token_ids(self.tokenizer, params.bad_words))
            elif params.bad_words_token_ids is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set)")
            self._check_in_vocabulary(
                "bad_words", (t for sequence in params.bad_words_token_ids for t in sequence))

    def _check_in_vocabulary(self, name: str, token_ids: Iterable[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences that ``bad_words`` ban: each word (leading whitespace dropped) as is,
    and with one leading space when that gives other tokens, so the word is banned at the start
    of the text and after a space. Duplicates are dropped.

    vLLM adds the spaced form only when it also has as many tokens as the plain one; here any
    different spaced form is added (with byte-level BPE, ' return' is often one token while
    'return' is two, and vLLM's rule would leave ' return' allowed). The added sequence
    decodes to the word after a space, so this bans a superset of what vLLM bans.
    """
    sequences: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        plain = list(tokenizer.encode(word, add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} gives no tokens")
        spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
        for sequence in (plain, spaced):
            if sequence and sequence not in sequences:
                sequences.append(sequence)
    return sequences


@dataclass(frozen=True)
class Admitted:
    """A request the output processor now tracks: what to queue in the engine core."""
    children: list[tuple[str, SamplingParams]]
    """(engine-core request id, its params): one per parallel sample."""
    token_ids: list[int]
    arrival_time: float


def admit(outputs: OutputProcessor, request_id: str, text: str | None, token_ids: list[int],
          params: SamplingParams, stream: bool = False) -> Admitted:
    """The one admission path of every front end (offline ``LLMEngine``, server ``AsyncLLM``):
    a processed request (``InputProcessor.process``) is registered with the output processor
    under a fresh id and fanned out into engine-core requests, which the caller queues."""
    if outputs.has_request(request_id):
        raise ValueError(f"request_id {request_id!r} is already in use")
    children = fan_out(request_id, params)
    arrival = time.monotonic()
    outputs.add_request(request_id, text, token_ids, params, [cid for cid, _ in children],
                        arrival, stream=stream)
    return Admitted(children, token_ids, arrival)


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine-core requests behind one user request: n parallel samples, one each."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{i}_{request_id}", params.child(i)) for i in range(params.n)]


def _require_sampling_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
