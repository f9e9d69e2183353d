"""Mixtral: Llama blocks whose MLP is a sparse mixture of experts (softmax router, top-k,
weights renormalised over the chosen experts)."""

from __future__ import annotations

from torch import nn

from openinfer.layers.moe import MoE, RoutingConfig
from openinfer.models.llama import LlamaForCausalLM, require_silu


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = {"block_sparse_moe": "mlp"}
    expert_weights = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}

    @classmethod
    def make_mlp(cls, hf: dict, layer: int) -> nn.Module:
        require_silu(hf)
        routing = RoutingConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                                renormalize=True)
        return MoE(hf["hidden_size"], hf["intermediate_size"], routing)
