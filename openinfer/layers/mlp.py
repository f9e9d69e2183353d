"""The gated feed-forward block of Llama-family models: down(act(gate(x)) * up(x)), act = silu
(or Gemma's tanh-approximated gelu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openinfer.distributed.parallel_state import get_tp
from openinfer.kernels.custom_op import CustomOp
from openinfer.kernels.invariant_gemm import invariant_silu_and_mul
from openinfer.layers.linear import MergedLinear, RowParallelLinear


class GatedMLP(CustomOp):
    """``forward_cpu``: silu(gate) * up runs as one C++ pass over the merged projection's rows.
    ``forward_batch_invariant``: the activation runs in row tiles that never split across
    threads (openinfer.kernels.invariant_gemm); torch's splits depend on the batch's size."""

    batch_dependent = True

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

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.gate_up_proj(x)
        if (self.activation == "silu" and self.clamp_limit is None and merged.is_contiguous()
                and merged.dtype in (torch.float32, torch.bfloat16)):
            out = merged.new_empty((*merged.shape[:-1], merged.shape[-1] // 2))
            self.cpu_kernels.silu_and_mul(out, merged)
            return self.down_proj(out)
        gate, up = self._clamped(*self.gate_up_proj.split(merged))
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)

    def forward_batch_invariant(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x)
        if self.activation != "silu":
            return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
        return self.down_proj(invariant_silu_and_mul(gate, up))

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._clamped(*self.gate_up_proj.split(self.gate_up_proj(x)))

    def _clamped(self, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate clamped to at most ``clamp_limit``, up to [-limit, limit] (DeepSeek-V4)."""
        if self.clamp_limit is None:
            return gate, up
        return gate.clamp(max=self.clamp_limit), up.clamp(-self.clamp_limit, self.clamp_limit)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
"""Gate activations by their config.json names (``hidden_act`` / ``hidden_activation``)."""
