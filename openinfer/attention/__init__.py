"""Attention backends over the paged KV cache, and the step metadata they share.

The names below are imported on first use, so that ``ATTENTION_BACKENDS`` (the CLI's
choices) is readable without importing torch."""

import importlib

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
"""``--attention-backend`` values (openinfer.attention.selector)."""

_EXPORTS = {"AttentionBackend": "base", "AttentionMetadata": "base",
            "build_attention_metadata": "base", "TorchAttentionBackend": "reference",
            "select_attention_backend": "selector"}

__all__ = ["ATTENTION_BACKENDS", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'openinfer.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"openinfer.attention.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
