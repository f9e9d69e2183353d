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
from openinfer.layers.mla import MLAAttention, MLAConfig
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import MoE
from openinfer.layers.moe_router import RoutingConfig
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding
from openinfer.models.arch import ArchConfig
from openinfer.models.base import CausalLM
from openinfer.models.llama import DecoderLayer, DecoderStack, require_silu, shared_rope


class DeepseekModel(DecoderStack):
    def __init__(self, arch: ArchConfig, routing: RoutingConfig | None, interleaved_rope: bool) -> None:
        super().__init__()
        mla = arch.mla()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        rotary = shared_rope(arch, mla.rope_dim, interleaved_rope)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, MLAAttention(mla, rotary), _mlp(arch, i, routing))
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        n = arch.num_layers
        self.mtp = nn.ModuleList(DeepseekMTPLayer(arch, mla, n + k, routing, rotary)
                                 for k in range(arch.num_mtp_layers))


class DeepseekMTPLayer(nn.Module):
    """A multi-token-prediction (NextN) module of DeepSeek-V3: from the main model's hidden
    state at position i and the embedding of token i + 1 it predicts token i + 2, through one
    more decoder block. Loaded from the checkpoint's layer ``num_hidden_layers + k`` and kept
    for speculative decoding; the engine does not run it yet.

        h' = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]) -> decoder block -> norm -> head
    """

    def __init__(self, arch: ArchConfig, mla: MLAConfig, layer: int, routing: RoutingConfig | None,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.embed_tokens = VocabEmbedding(arch.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.block = DecoderLayer(arch, MLAAttention(mla, rotary), _mlp(arch, layer, routing))
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)
        self.shared_head.head = LMHead(arch.vocab_size, hidden, None)


def _mlp(arch: ArchConfig, layer: int, routing: RoutingConfig | None) -> nn.Module:
    """A dense MLP in the first ``first_k_dense_replace`` layers, DeepSeekMoE (routed experts
    and the shared ones as one MLP) in every ``moe_layer_freq``-th after."""
    require_silu(arch)
    moe = arch.moe
    sparse = routing is not None and layer >= moe.first_dense_layers and layer % moe.layer_freq == 0
    if not sparse:
        return GatedMLP(arch.hidden_size, arch.intermediate_size)
    inter, shared = moe.intermediate_size, moe.num_shared_experts
    return MoE(arch.hidden_size, inter, routing,
               GatedMLP(arch.hidden_size, inter * shared) if shared else None)


class DeepseekV2ForCausalLM(CausalLM):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_weights = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    supports_tensor_parallel = True
    optional_modules = ("model.mtp",)
    """Checkpoints converted by transformers keep num_nextn_predict_layers but drop the MTP
    weights: the model then loads without them."""

    default_topk_method = "greedy"
    """How experts are picked where the config does not say (V3: ``noaux_tc``)."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.model = DeepseekModel(arch, self.routing(arch), self.interleaved_rope(arch))
        tied = self.model.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, tied)
        # The MTP layers follow the decoder layers in the checkpoint; their decoder block's
        # names (self_attn, mlp, the two norms) sit directly under the layer.
        n = arch.num_layers
        self.checkpoint_prefixes = {}
        for k in range(len(self.model.mtp)):
            own = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
            for part in own:
                self.checkpoint_prefixes[f"model.layers.{n + k}.{part}."] = f"model.mtp.{k}.{part}."
            self.checkpoint_prefixes[f"model.layers.{n + k}."] = f"model.mtp.{k}.block."

    @classmethod
    def routing(cls, arch: ArchConfig) -> RoutingConfig | None:
        moe = arch.moe
        if not moe.num_experts:
            return None
        method = moe.topk_method or cls.default_topk_method
        return RoutingConfig(
            num_experts=moe.num_experts, top_k=moe.top_k,
            scoring=moe.scoring_func or ("sigmoid" if method == "noaux_tc" else "softmax"),
            method=method, num_groups=moe.num_groups, topk_groups=moe.topk_groups,
            renormalize=moe.norm_topk_prob and moe.top_k > 1,
            scaling=moe.routed_scaling_factor, fp32_logits=True)

    @classmethod
    def interleaved_rope(cls, arch: ArchConfig) -> bool:
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
    default_topk_method = "noaux_tc"

    @classmethod
    def interleaved_rope(cls, arch: ArchConfig) -> bool:
        return bool(arch.raw.get("rope_interleave", True))  # V3's own switch
