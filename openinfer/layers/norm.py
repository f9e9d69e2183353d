"""RMSNorm with an optional fused residual add (the pre-norm transformer pattern)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.kernels.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``forward_cpu``: float32 and bfloat16 norms run as one C++ pass per row (add fused in)
    instead of torch's five-op composite (eight with bf16's casts)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, fp32_weight: bool = False) -> None:
        """``fp32_weight``: the weight stays float32 whatever the compute dtype, and lower
        precision inputs are scaled in float32 and cast once (DeepSeek-V4's norms)."""
        super().__init__()
        self.eps = eps
        dtype = torch.float32 if fp32_weight else None
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def in_kernel(self, x: torch.Tensor) -> bool:
        """Whether the C++ norm computes rows of x (and of a residual of x's dtype): float32,
        or bfloat16 with a bfloat16 weight (DeepSeek-V4's float32 weights on bf16 rows round
        differently), on a model bound to the CPU kernels. Plain comparisons: this runs twice
        per layer of every decode step."""
        return (self.cpu_kernels is not None and x.dtype == self.weight.dtype
                and x.dtype in _KERNEL_DTYPES)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Lower precision: normalize in float32, scale after casting back, as HF models do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype == torch.float32:
            return (self.weight * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if not (self.in_kernel(x) and _rows_readable(x)):
                return self._norm(x)
            out = torch.empty(x.shape, dtype=x.dtype)
            self.cpu_kernels.rms_norm(out, x, self.weight, self.eps)
            return out
        if (self.in_kernel(x) and residual.dtype == x.dtype and x.is_contiguous()
                and residual.is_contiguous()):
            out, total = torch.empty_like(x), torch.empty_like(x)
            self.cpu_kernels.add_rms_norm(out, total, x, residual, self.weight, self.eps)
            return out, total
        x = x + residual
        return self.forward_cpu(x), x


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _rows_readable(x: torch.Tensor) -> bool:
    """Whether the C++ norm reads x in place: [rows, n], or [T, H, n] whose heads are
    adjacent (a view into the fused q/k/v output), with unit stride in n."""
    if x.stride(-1) != 1:
        return False
    return x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[-1])
