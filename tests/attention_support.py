"""Shared by tests that run on every attention backend."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

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


def use_interpreter() -> None:
    """Make every jit function the Triton backend calls an interpreted one.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when a function is *defined*, and in a full test
    run triton is already imported (torch._dynamo imports it) before a test module can set the
    variable: so this re-defines triton.language's own jit helpers (tl.zeros, tl.max, tl.sum,
    ...) and this project's kernels in interpreter mode. Call it with TRITON_INTERPRET=1 set."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.zeros, InterpretedFunction):
        for module in (tl.standard, tl.random, tl):
            importlib.reload(module)
    kernels = sys.modules.get("openinfer.kernels.triton_attention")
    if kernels is not None and not kernels.interpreted():
        importlib.reload(kernels)
        for module in ("openinfer.attention.triton", "openinfer.kernels.triton_moe"):
            if module in sys.modules:
                importlib.reload(sys.modules[module])


def triton_test_device() -> str:
    """Where a Triton kernel test module runs its kernels, prepared before it imports them:
    ``cuda`` on a machine with a GPU (compiled kernels), else ``cpu`` in Triton's interpreter
    (TRITON_INTERPRET=1, set here unless the environment says otherwise). Skips the module
    where triton is not installed, or where neither can run."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    if os.environ.get("TRITON_INTERPRET") == "1":
        use_interpreter()
    from openinfer.kernels import triton_attention

    device = "cpu" if triton_attention.interpreted() else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU, and TRITON_INTERPRET is set to something other than 1",
                    allow_module_level=True)
    return device
