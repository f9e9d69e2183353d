"""Which attention backend a model runs with (``--attention-backend``).

``auto`` is ``cpu`` on a CPU when its kernel builds here, and ``triton`` on CUDA when
``import triton`` works; otherwise ``torch`` (the reference, with one logged warning saying
why). ``triton`` on a CPU is refused unless ``TRITON_INTERPRET=1`` (Triton's interpreter: for
tests, far too slow to serve). ``OPENINFER_ATTENTION_BACKEND`` overrides ``auto`` (for
benchmarks and bisecting).
"""

from __future__ import annotations

import logging
import os

import torch

from openinfer.attention import ATTENTION_BACKENDS
from openinfer.attention.base import AttentionBackend
from openinfer.attention.reference import TorchAttentionBackend
from openinfer.kernels.cpu_attention import load_cpu_attention

logger = logging.getLogger(__name__)


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name`` (or the best one here for ``auto``); ValueError when a
    backend asked for by name cannot run on ``device``."""
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    explicit = name != "auto"
    override = os.environ.get("OPENINFER_ATTENTION_BACKEND")
    if not explicit:
        name = override or {"cpu": "cpu", "cuda": "triton"}.get(device.type, "torch")
    if name == "triton":
        backend = _triton_backend(device, required=explicit or bool(override))
        if backend is not None:
            return backend
    elif name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}")
        if load_cpu_attention() is not None:
            from openinfer.attention.cpu import CPUAttentionBackend

            return CPUAttentionBackend()
        if explicit:
            raise ValueError("attention_backend 'cpu': its kernel could not be built here "
                             "(see the warning above); use 'torch'")
        logger.warning("attention: falling back to the torch reference backend (slower)")
    elif name != "torch":
        raise ValueError(f"OPENINFER_ATTENTION_BACKEND must be one of torch, cpu, triton; got {name!r}")
    return TorchAttentionBackend()


def _triton_backend(device: torch.device, required: bool) -> AttentionBackend | None:
    """The Triton backend, or None (after one warning) where it cannot run and was only
    ``auto``'s pick; ValueError where it was asked for by name."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        raise ValueError(f"attention_backend 'triton' runs on CUDA, not on {device} "
                         "(set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter)")
    try:
        from openinfer.attention.triton import TritonAttentionBackend
    except ImportError as exc:  # triton not installed, or a build without this GPU's backend
        if required:
            raise ValueError(f"attention_backend 'triton': cannot import triton ({exc})") from exc
        logger.warning("attention: falling back to the torch reference backend (slower): "
                       "cannot import triton (%s)", exc)
        return None
    from openinfer.kernels.triton_attention import interpreted

    if device.type != "cuda" and not interpreted():
        raise ValueError("attention_backend 'triton' on the CPU: TRITON_INTERPRET=1 was set after "
                         "triton was imported (set it before, e.g. in the environment)")
    return TritonAttentionBackend()
