"""Which attention backend a model runs with (``--attention-backend``).

``auto`` is ``cpu`` on a CPU when its kernel builds here, else ``torch`` (the reference,
with one logged warning saying why); on CUDA it is ``torch`` until the Triton backend
lands. ``OPENINFER_ATTENTION_BACKEND`` overrides ``auto`` (for benchmarks and bisecting).
"""

from __future__ import annotations

import logging
import os

import torch

from openinfer.attention.backend import AttentionBackend
from openinfer.attention.reference import TorchAttentionBackend

logger = logging.getLogger(__name__)
ATTENTION_BACKENDS = ("auto", "torch", "cpu")


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name`` (or the best one here for ``auto``); ValueError when a
    backend asked for by name cannot run on ``device``."""
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    explicit = name != "auto"
    if not explicit:
        name = os.environ.get("OPENINFER_ATTENTION_BACKEND") or (
            "cpu" if device.type == "cpu" else "torch")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}")
        from openinfer.kernels.cpu_attention import load_cpu_attention

        if load_cpu_attention() is not None:
            from openinfer.attention.cpu import CPUAttentionBackend

            return CPUAttentionBackend()
        if explicit:
            raise ValueError("attention_backend 'cpu': its kernel could not be built here "
                             "(see the warning above); use 'torch'")
        logger.warning("attention: falling back to the torch reference backend (slower)")
    elif name != "torch":
        raise ValueError(f"OPENINFER_ATTENTION_BACKEND must be one of torch, cpu; got {name!r}")
    return TorchAttentionBackend()
