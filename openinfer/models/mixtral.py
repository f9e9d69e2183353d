"""Mixtral: Llama blocks whose MLP is a sparse mixture of experts (softmax router, top-k,
weights renormalised over the chosen experts)."""

from __future__ import annotations

from torch import nn

from openinfer.layers.moe import MoE
from openinfer.layers.moe_router import RoutingConfig
from openinfer.models.arch import ArchConfig
from openinfer.models.llama import LlamaForCausalLM, require_silu


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = {"block_sparse_moe": "mlp"}
    expert_weights = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}

    @classmethod
    def make_mlp(cls, arch: ArchConfig, layer: int) -> nn.Module:
        require_silu(arch)
        routing = RoutingConfig(num_experts=arch.moe.num_experts, top_k=arch.moe.top_k, renormalize=True)
        return MoE(arch.hidden_size, arch.intermediate_size, routing)  # experts as wide as a dense MLP
