"""A row of the logits as the sampler sees it (one request), and small per-row tensor helpers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openinfer.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """Everything the sampler needs to know about one row (one request) of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far for this request."""
    stop_token_ids: frozenset[int]
    """EOS ids (unless ignore_eos) + params.stop_token_ids; masked while the output is shorter
    than params.min_tokens."""
    grammar_mask: torch.Tensor | None = None
    """Structured outputs: the tokens the row's grammar allows next, as a packed bitmask
    ([ceil(V / 32)] int32, bit t of word t // 32); None: unconstrained."""


def float_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """One float32 value per row, [R]."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def float_column(values: list[float], device: torch.device) -> torch.Tensor:
    """One value per row as an [R, 1] column, to broadcast over the vocabulary."""
    return float_tensor(values, device).unsqueeze(1)
