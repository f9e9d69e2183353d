"""What every drafter gives the engine: tokens and a confidence per position."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    """Per position j: the drafter's probability that token j is right given tokens
    before it are (a model drafter's largest probability, fixed before the draw; match
    frequencies for n-gram/suffix).
    The confidence scheduler multiplies them into the chance a prefix survives."""

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.confidences)


class TokenProposer(ABC):
    """A drafter that reads only token ids (n-gram, suffix): pure Python, run by the
    model runner after each step for the requests that sampled."""

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                num_tokens: int) -> Draft:
        """Up to ``num_tokens`` draft tokens to follow ``token_ids`` (the prompt's
        ``num_prompt_tokens``, then the output)."""

    def drop(self, request_id: str) -> None:  # noqa: B027 (most drafters keep nothing)
        """The request left the runner (finished or preempted)."""
