"""DeepSeek-V2 / V3: pre-norm blocks of multi-head latent attention (openinfer.layers.mla) and
a feed-forward that is a dense gated MLP in the first ``first_k_dense_replace`` layers and
DeepSeekMoE after (routed experts + always-on shared experts).

    x ─ embed ─┬─ RMSNorm ─ MLA ─(+)─┬─ RMSNorm ─ MLP | MoE ─(+)─ ... ─ RMSNorm ─ LM head
               └──────────────────────┘└─────────────────────────┘

V2 routes by softmax scores (``greedy`` or ``group_limited_greedy``); V3 by sigmoid scores
with a learned bias (``noaux_tc``). RoPE pairs are interleaved (V2 always; V3 when
``rope_interleave``, the default).
"""

from __future__ import annotations

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.kv.spec import KVSpec, MLALatentSpec
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.linear import Linear
from openinfer.layers.mla import MLAAttention
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import MoE, RoutingConfig
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding, get_rope
from openinfer.models.base import CausalLM
from openinfer.models.llama import DecoderLayer, DecoderStack, require_silu, rope_scaling, rope_theta


class DeepseekModel(DecoderStack):
    def __init__(self, hf: dict, routing: RoutingConfig | None, interleaved_rope: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(hf["vocab_size"], hf["hidden_size"])
        rope_dim = hf["qk_rope_head_dim"]
        rotary = get_rope(rope_dim, hf["max_position_embeddings"], rope_theta(hf), rope_scaling(hf),
                          interleaved=interleaved_rope)
        self.layers = nn.ModuleList(
            DecoderLayer(hf, MLAAttention(hf, rotary), _mlp(hf, i, routing))
            for i in range(hf["num_hidden_layers"])
        )
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))
        n = hf["num_hidden_layers"]
        self.mtp = nn.ModuleList(DeepseekMTPLayer(hf, n + k, routing, rotary)
                                 for k in range(hf.get("num_nextn_predict_layers") or 0))


class DeepseekMTPLayer(nn.Module):
    """A multi-token-prediction (NextN) module of DeepSeek-V3: from the main model's hidden
    state at position i and the embedding of token i + 1 it predicts token i + 2, through one
    more decoder block. Loaded from the checkpoint's layer ``num_hidden_layers + k`` and kept
    for speculative decoding; the engine does not run it yet.

        h' = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]) -> decoder block -> norm -> head
    """

    def __init__(self, hf: dict, layer: int, routing: RoutingConfig | None,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.embed_tokens = VocabEmbedding(hf["vocab_size"], hidden)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.block = DecoderLayer(hf, MLAAttention(hf, rotary), _mlp(hf, layer, routing))
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)
        self.shared_head.head = LMHead(hf["vocab_size"], hidden, None)


def _mlp(hf: dict, layer: int, routing: RoutingConfig | None) -> nn.Module:
    require_silu(hf)
    sparse = (routing is not None and layer >= hf.get("first_k_dense_replace", 0)
              and layer % (hf.get("moe_layer_freq") or 1) == 0)
    if not sparse:
        return GatedMLP(hf["hidden_size"], hf["intermediate_size"])
    inter = hf["moe_intermediate_size"]
    shared = hf.get("n_shared_experts") or 0
    return MoE(hf["hidden_size"], inter, routing,
               GatedMLP(hf["hidden_size"], inter * shared) if shared else None)


def num_routed_experts(hf: dict) -> int:
    """Hub configs say n_routed_experts; transformers 5 may save it under an alias."""
    return hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0


class DeepseekV2ForCausalLM(CausalLM):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_weights = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    supports_tensor_parallel = True
    optional_modules = ("model.mtp",)
    """Checkpoints converted by transformers keep num_nextn_predict_layers but drop the MTP
    weights: the model then loads without them."""

    def __init__(self, hf: dict) -> None:
        super().__init__()
        self.model = DeepseekModel(hf, self.routing(hf), self.interleaved_rope(hf))
        tied = self.model.embed_tokens if hf.get("tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf["vocab_size"], hf["hidden_size"], tied)
        # The MTP layers follow the decoder layers in the checkpoint; their decoder block's
        # names (self_attn, mlp, the two norms) sit directly under the layer.
        n = hf["num_hidden_layers"]
        self.checkpoint_prefixes = {}
        for k in range(len(self.model.mtp)):
            own = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
            for part in own:
                self.checkpoint_prefixes[f"model.layers.{n + k}.{part}."] = f"model.mtp.{k}.{part}."
            self.checkpoint_prefixes[f"model.layers.{n + k}."] = f"model.mtp.{k}.block."

    @classmethod
    def routing(cls, hf: dict) -> RoutingConfig | None:
        experts = num_routed_experts(hf)
        if not experts:
            return None
        method = hf.get("topk_method") or "greedy"
        return RoutingConfig(
            num_experts=experts, top_k=hf["num_experts_per_tok"],
            scoring=hf.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax"),
            method=method, num_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
            renormalize=bool(hf.get("norm_topk_prob", False)) and hf["num_experts_per_tok"] > 1,
            scaling=float(hf.get("routed_scaling_factor") or 1.0), fp32_logits=True)

    @classmethod
    def interleaved_rope(cls, hf: dict) -> bool:
        return True

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVSpec | None]:
        """What each layer keeps per token: its latent KV entry."""
        return [MLALatentSpec(block_size, layer.self_attn.latent_dim, layer.self_attn.rope_dim, dtype)
                for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def routing(cls, hf: dict) -> RoutingConfig | None:
        return super().routing({"topk_method": "noaux_tc", **hf})

    @classmethod
    def interleaved_rope(cls, hf: dict) -> bool:
        return bool(hf.get("rope_interleave", True))
