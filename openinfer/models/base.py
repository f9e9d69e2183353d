"""The model contract: what the loader, the engine and its start-up checks read of a model
class, with the defaults a plain model has. Every registered architecture derives from
``CausalLM`` (openinfer/models/registry.py)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.kv.spec import KVSpec


class CausalLM(nn.Module):
    """Built as ``cls(ArchConfig.from_hf(config_json))`` (openinfer/models/arch.py)."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}
    """Checkpoint module names that load into a slice of one merged parameter
    (``q_proj`` -> (``qkv_proj``, 0))."""
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    """Checkpoint name parts spelled otherwise here (``block_sparse_moe`` -> ``mlp``)."""
    expert_weights: ClassVar[dict[str, tuple[str, int]]] = {}
    """``experts.<e>.<proj>.weight`` -> a slice of a stacked expert tensor (``w13``, 0)."""
    checkpoint_prefixes: dict[str, str] = {}
    """Checkpoint name prefixes moved elsewhere here (DeepSeek's MTP layers); per instance."""
    optional_modules: ClassVar[tuple[str, ...]] = ()
    """Modules a checkpoint may lack entirely: dropped when it does."""
    supports_tensor_parallel: ClassVar[bool] = False
    """Whether its layers split over tensor-parallel ranks."""
    supports_context_parallel: ClassVar[bool] = False
    """Whether a prompt's tokens may be split over context-parallel ranks."""
    supports_fp8_kv_cache: ClassVar[bool] = True
    """Whether its caches may be float8 (``--kv-cache-dtype``): every layer's cache is written
    and read through an attention backend's scaled float8 paths."""
    supports_decode_graphs: ClassVar[bool] = True
    """Whether a decode step's forward pass can replay as a CUDA graph: its attention reads
    the step only through the backend's buffers, never plans from host-side lengths."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states of the step's tokens, [T, hidden]; ``kv_caches`` and ``metas`` are
        per entry of ``kv_cache_specs``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVSpec | None]:
        """What each layer (each cache slot) keeps per token; None: nothing."""
        raise NotImplementedError
