"""The gated feed-forward block of Llama-family models: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers.batch_invariant import invariant_silu_and_mul
from openinfer.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    batch_invariant = False
    """Set in batch-invariant mode: the activation runs in row tiles that never split across
    threads (openinfer.layers.batch_invariant)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        if self.batch_invariant:
            return self.down_proj(invariant_silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)
