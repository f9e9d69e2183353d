"""The attention backend interface: what a model's attention layer asks of the hardware.

A backend turns the step's integers into its metadata once per step (``build_metadata``)
and then, for every layer, stores the step's K/V in that layer's paged cache and attends
(``forward``). Backends: ``torch`` (the reference: gathers each sequence's blocks and runs
SDPA; the oracle every other backend is tested against) and ``cpu`` (one C++ kernel for
prefill, chunked prefill, prefix hits and decode, reading blocks in place).

A layer's cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V),
a strided view of the engine's block-major tensor: each block's ``[block_size, H, D]`` is
contiguous, consecutive blocks are not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from openinfer.attention.metadata import AttentionMetadata, build_attention_metadata

if TYPE_CHECKING:
    from openinfer.layers.attention import Attention
    from openinfer.layers.norm import RMSNorm
    from openinfer.layers.rotary import RotaryEmbedding


class AttentionBackend(ABC):
    name: str

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device | str) -> AttentionMetadata:
        """The step's metadata (sequences ordered decodes first)."""
        return build_attention_metadata(self, query_lens, seq_lens, block_tables, block_size,
                                        device)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k/v ([T, Hkv, D]) into ``cache`` at ``meta.slot_mapping``, then return the
        attention of q ([T, Hq, D]) over each sequence's cached context, [T, Hq, D].

        A layer's variants: ``window`` > 0, query ``p`` sees keys ``p - window + 1 .. p``
        only (and never reads table entries before that: they may be released); ``softcap``
        > 0, scaled scores ``s`` become ``softcap * tanh(s / softcap)``; ``sinks`` [Hq], one
        logit per query head in the softmax denominator, with no value."""

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """The attention of q ([T, Hq, D]) over each sequence's context, already in ``cache``
        (any ``[2, num_blocks, block_size, Hkv, D]`` view: MLA passes its latent entries as
        both K and V, one expanded view), [T, Hq, D]."""

    def rope_attention(self, layer: Attention, positions: torch.Tensor, qkv: torch.Tensor,
                       rotary: RotaryEmbedding, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                       cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """``layer.forward_qkv`` in one call, or None where this backend does not fuse it
        (the layer then splits, rotates and calls ``forward``)."""
        return None

    def forward_batch_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cache: torch.Tensor, meta: AttentionMetadata,
                                scale: float) -> torch.Tensor:
        """``forward``, with each query row's result bitwise independent of the rest of the
        step (other sequences, its own prompt's chunking, padding): ``--batch-invariant``."""
        raise NotImplementedError(f"attention backend {self.name!r} has no batch-invariant mode")
