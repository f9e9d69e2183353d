"""Qwen3-MoE: Qwen3 blocks whose MLP is a sparse mixture of experts on every
``decoder_sparse_step``-th layer outside ``mlp_only_layers`` (a dense MLP elsewhere)."""

from __future__ import annotations

from torch import nn

from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import MoE, RoutingConfig
from openinfer.models.llama import require_silu
from openinfer.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_weights = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}

    @classmethod
    def make_mlp(cls, hf: dict, layer: int) -> nn.Module:
        require_silu(hf)
        # Hub configs say num_experts; transformers 5 saves it as num_local_experts.
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        sparse = (layer not in (hf.get("mlp_only_layers") or []) and num_experts > 0
                  and (layer + 1) % hf.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return GatedMLP(hf["hidden_size"], hf["intermediate_size"])
        routing = RoutingConfig(num_experts=num_experts, top_k=hf["num_experts_per_tok"],
                                renormalize=bool(hf.get("norm_topk_prob", False)))
        return MoE(hf["hidden_size"], hf["moe_intermediate_size"], routing)
