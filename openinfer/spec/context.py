"""What a model drafter (draft_model.py, mtp.py) reads of the runner that drives it, as
protocols: the drafters sit below the worker in the import order, so they name the contract
instead of the runner's class (openinfer/worker/runner.py implements both)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from openinfer.sample.sampler import Sampler
from openinfer.sampling_params import SamplingParams


class DraftRequest(Protocol):
    """A request as the runner holds it (``RunnerRequest``)."""

    request_id: str
    token_ids: list[int]
    """Prompt followed by the tokens sampled so far."""
    num_prompt_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int]
    block_ids: list[list[int]]
    """Per KV layer group."""
    draft_probs: torch.Tensor | None
    """Set by the drafter: its distributions [k, V] for the drafts it proposes (random rows)."""


class DraftContext(Protocol):
    """The runner (``ModelRunner``), as a drafter uses it."""

    layer_caches: list[torch.Tensor]
    """Per layer of the runner's list (target, then drafter)."""
    layer_group: list[int]
    """Each layer's KV group."""
    attention: Any
    """The attention backend (``build_metadata``)."""
    block_size: int
    device: torch.device
    sampler: Sampler

    def long_tensor(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the runner's device."""
        ...
