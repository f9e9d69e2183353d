"""The platform seam: a layer written once in torch (``forward_native``) that a platform may run
through its own kernels (``forward_cpu``, ``forward_cuda``), and batch-invariant mode through
``forward_batch_invariant``. Which one a module runs is chosen once, when the worker binds the
loaded model to its platform (``bind_platform``, openinfer/models/platform.py); ``forward`` then
calls it with no branch. vLLM's ``CustomOp`` (model_executor/custom_op.py) has this shape.

A kernel path covers the calls its kernel computes and hands the rest to ``forward_native``
(another dtype, a layout the kernel does not read): both give the same results, so which calls
take the kernel never changes an output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Platform:
    """What a model is bound to: its device, this machine's kernels, and the mode."""

    device: str
    """``cpu`` or ``cuda``."""
    cpu_kernels: ModuleType | None = None
    """The CPU extension (openinfer/kernels/cpu_attention.py), for engines on the ``cpu``
    attention backend; None: the torch paths."""
    batch_invariant: bool = False
    """``--batch-invariant``: layers whose platform path depends on the rest of the batch
    (``batch_dependent``) run ``forward_batch_invariant``."""


class CustomOp(nn.Module):
    """A layer with one torch definition and, per platform, a faster path (see the module
    docstring). Subclasses implement ``forward_native`` and override the paths they have."""

    batch_dependent = False
    """Whether the platform paths' rows depend on the rest of the batch (thread splits,
    backend modes): such a layer implements ``forward_batch_invariant``. The others' rows are
    independent already and keep their platform path in batch-invariant mode."""

    cpu_kernels: ModuleType | None = None
    """The CPU extension a ``forward_cpu`` calls (set by ``bind``)."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_path: Callable[..., Any] = self.forward_native

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_path(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_batch_invariant(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no batch-invariant path")

    def bind(self, platform: Platform) -> None:
        """Choose the path every later call runs."""
        self.cpu_kernels = platform.cpu_kernels
        if platform.batch_invariant and self.batch_dependent:
            self._forward_path = self.forward_batch_invariant
        elif platform.cpu_kernels is not None:
            self._forward_path = self.forward_cpu
        elif platform.device == "cuda":
            self._forward_path = self.forward_cuda
        else:
            self._forward_path = self.forward_native

    @property
    def forward_path(self) -> str:
        """The bound path's name (``forward_native``, ``forward_cpu``, …)."""
        return self._forward_path.__name__
