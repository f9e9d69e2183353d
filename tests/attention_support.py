"""Shared by tests that run on every attention backend."""

from __future__ import annotations

import pytest

from openinfer.attention import AttentionBackend, select_attention_backend

ATTENTION_BACKENDS = ["torch", "cpu"]
"""What attention-path tests are parametrized over: the reference and the CPU kernel."""


def attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name``; the test is skipped, with the reason, where the CPU
    kernel cannot be built (no C++ compiler)."""
    if name == "cpu":
        from openinfer.kernels.cpu_attention import load_cpu_attention

        if load_cpu_attention() is None:
            pytest.skip("the CPU attention kernel cannot be built here")
    return select_attention_backend(name, "cpu")
