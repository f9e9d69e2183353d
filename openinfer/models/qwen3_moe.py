"""Qwen3-MoE: Qwen3 blocks whose MLP is a sparse mixture of experts on every
``decoder_sparse_step``-th layer outside ``mlp_only_layers`` (a dense MLP elsewhere)."""

from __future__ import annotations

from torch import nn

from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import MoE
from openinfer.layers.moe_router import RoutingConfig
from openinfer.models.arch import ArchConfig
from openinfer.models.llama import require_silu
from openinfer.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_weights = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}

    @classmethod
    def make_mlp(cls, arch: ArchConfig, layer: int) -> nn.Module:
        require_silu(arch)
        moe = arch.moe
        sparse = (layer not in moe.dense_layers and moe.num_experts > 0
                  and (layer + 1) % moe.sparse_step == 0)
        if not sparse:
            return GatedMLP(arch.hidden_size, arch.intermediate_size)
        routing = RoutingConfig(num_experts=moe.num_experts, top_k=moe.top_k,
                                renormalize=moe.norm_topk_prob)
        return MoE(arch.hidden_size, moe.intermediate_size, routing)
