"""The gated feed-forward block of Llama-family models: down(act(gate(x)) * up(x)), act = silu
(or Gemma's tanh-approximated gelu)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.parallel_state import get_tp
from openinfer.kernels.invariant_gemm import invariant_silu_and_mul
from openinfer.layers.linear import MergedLinear, RowParallelLinear


class GatedMLP(nn.Module):
    cpu_kernels: ModuleType | None = None
    """The CPU kernel extension (set with the norms' by ``models.platform.use_cpu_kernels``):
    silu(gate) * up then runs as one C++ pass over the merged projection's rows."""
    batch_invariant = False
    """Set in batch-invariant mode: the activation runs in row tiles that never split across
    threads (openinfer.kernels.invariant_gemm)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: str = "silu", clamp_limit: float | None = None) -> None:
        """``clamp_limit``: gate clamped to at most it, up to [-it, it] (DeepSeek-V4)."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.clamp_limit = clamp_limit
        tp = get_tp()  # a rank holds its share of the intermediate features
        per_rank = tp.split(intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedLinear(
            hidden_size, [per_rank] * 2, bias=bias,
            shard_offsets=None if tp.size == 1 else [tp.rank * per_rank] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.gate_up_proj(x)
        if (self.cpu_kernels is not None and self.activation == "silu" and self.clamp_limit is None
                and not self.batch_invariant and merged.is_contiguous()
                and merged.dtype in (torch.float32, torch.bfloat16)):
            out = merged.new_empty((*merged.shape[:-1], merged.shape[-1] // 2))
            self.cpu_kernels.silu_and_mul(out, merged)
            return self.down_proj(out)
        gate, up = self.gate_up_proj.split(merged)
        if self.clamp_limit is not None:
            gate, up = gate.clamp(max=self.clamp_limit), up.clamp(-self.clamp_limit, self.clamp_limit)
        if self.activation != "silu":
            return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
        if self.batch_invariant:
            return self.down_proj(invariant_silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
"""Gate activations by their config.json names (``hidden_act`` / ``hidden_activation``)."""
