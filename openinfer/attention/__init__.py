"""Attention backends over the paged KV cache, and the step metadata they share."""

from openinfer.attention.backend import AttentionBackend
from openinfer.attention.metadata import AttentionMetadata, build_attention_metadata
from openinfer.attention.reference import TorchAttentionBackend
from openinfer.attention.selector import ATTENTION_BACKENDS, select_attention_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "TorchAttentionBackend",
           "build_attention_metadata", "select_attention_backend"]
